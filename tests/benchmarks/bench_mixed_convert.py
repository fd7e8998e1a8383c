"""Speed per byte of each rung a mixed recipe writes, on one executor: the same bf16 checkpoint (GLM-5 layout,
routed experts at ``--hidden`` x ``--moe-intermediate``) converted with every routed expert at mxfp4 (W4A4),
mxfp4_fp8 (W4A8) and fp8 (W8A8, per-tensor: a first pass takes each weight's amax, then it is encoded), in
its own process, one worker. Prints the conversion's GB/s of source read (the manifest's seconds, process
start-up excluded) and the kernel's busy seconds, best of ``--repeat``.

    python -m tests.benchmarks.bench_mixed_convert [--experts 8] [--hidden 2048] [--moe-intermediate 1536]

Not a test: timings depend on the machine and whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from quant.example import tiny_config, write_checkpoint

RECIPE = """\
name: bench-{rung}
format: mxfp4
rules:
  - {{role: routed_expert, action: quantize, format: {rung}}}
"""


def sidecar(src: Path, path: Path) -> Path:
    """Every Linear measured at amax 4 over 1000 tokens: the static scales' values do not change the speed."""
    weights = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    modules = [n.removesuffix(".weight") for n in weights if n.endswith("_proj.weight")]
    path.write_text(json.dumps({"kind": "quantgate-sensitivity", "version": 1, "amax": dict.fromkeys(modules, 4.0),
                                "tokens": dict.fromkeys(modules, 1000), "calibration": {"source": "bench"}}))
    return path


def convert(src: Path, dst: Path, recipe: Path, side: Path) -> dict:
    subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", "--workers", "1", "--recipe", str(recipe),
                    "--sensitivity", str(side), "--overwrite", str(src), str(dst)], check=True, capture_output=True)
    return json.loads((dst / "conversion_manifest.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe-intermediate", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mixed-") as tmp:
        work = Path(tmp)
        config = tiny_config("glm_moe_dsa", n_routed_experts=args.experts, hidden_size=args.hidden,
                             moe_intermediate_size=args.moe_intermediate)
        src = write_checkpoint(work / "bf16", config)
        side = sidecar(src, work / "side.json")
        for rung in ("mxfp4", "mxfp4_fp8", "fp8"):
            recipe = work / f"{rung}.yaml"
            recipe.write_text(RECIPE.format(rung=rung))
            runs = [convert(src, work / rung, recipe, side) for _ in range(args.repeat)]
            best = min(runs, key=lambda m: m["seconds"])
            quantized = sum(t["shape"][0] * t["shape"][1] * 2 for s in best["shards"] for t in s["quantized"].values())
            print(f"{rung:<10} {best['summary']['bytes_in'] / 1e9:.3f} GB in ({quantized / 1e9:.3f} GB quantized) "
                  f"-> {best['summary']['bytes_out'] / 1e9:.3f} GB: {best['seconds']:.2f} s, "
                  f"{best['summary']['bytes_in'] / 1e9 / best['seconds']:.2f} GB/s, kernel "
                  f"{best['summary']['stage_seconds'].get('kernel', 0):.2f} s")


if __name__ == "__main__":
    main()
