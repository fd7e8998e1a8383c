"""Throughput and peak memory of quantgate vs AMD Quark's file-to-file exporter, side by side.

    python -m tests.benchmarks.bench_convert [--experts 16] [--repeat 1] [--workdir DIR]

Builds one GLM-5-shaped shard (routed experts at real dims, 6144 x 2048), converts it with each
tool in its own subprocess (imports excluded from the timing, which brackets the conversion call
alone), samples the resident memory of each process tree every 20 ms (summed over all its
processes: interpreter, workers, everything), checks both outputs are byte-identical, and prints
GB/s, peak RSS and the ratios. Not a test: this machine is noisy, so run the two in one go.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.benchmarks.make_shard import make_glm5_shard

QUANTGATE = """
import json, sys, time
from pathlib import Path
from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe
from quant.formats import mxfp4_fast  # noqa: F401  (numba kernel load, outside the timing)
src, dst, workers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
started = time.perf_counter()
convert(make_plan(src, load_recipe()), dst, show_progress=False, workers=workers or None)
print(json.dumps({"seconds": time.perf_counter() - started}))
"""

QUARK = """
import json, sys, time, logging
from pathlib import Path
from quark.torch import LLMTemplate
from quark.torch.quantization.file2file_quantization import quantize_model_per_safetensor
logging.disable(logging.INFO)
src, dst = sys.argv[1], sys.argv[2]
config = LLMTemplate.get("glm_moe_dsa").get_config(scheme="mxfp4", exclude_layers=["*mlp.gate"])
started = time.perf_counter()
quantize_model_per_safetensor(src, config, dst, device="cpu")
print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def run_measured(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; its own timing plus the peak RSS of its process tree."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"benchmark subprocess failed:\n{err[-3000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak}


def tensors_equal(a: Path, b: Path) -> bool:
    from tests.conftest import load_tensors

    return load_tensors(a) == load_tensors(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16, help="routed experts in the shard (16 = ~1.2 GB)")
    parser.add_argument("--workers", type=int, default=0, help="quantgate --workers (0 = its default)")
    parser.add_argument("--skip-quark", action="store_true", help="measure quantgate only")
    parser.add_argument("--workdir", type=Path, help="where to build the shard (default: a temp folder)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        src = make_glm5_shard(work / "src", args.experts)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        os.sync()  # the fresh shard's write-back would otherwise land inside the first tool's timing
        results = {"quantgate": run_measured(QUANTGATE, str(src), str(work / "qg"), str(args.workers))}
        if not args.skip_quark:
            results["quark"] = run_measured(QUARK, str(src), str(work / "quark"))
        print(f"shard: {size / 1e9:.3f} GB bf16, {args.experts} routed experts at 2048x6144")
        print(f"{'tool':<10} {'seconds':>8} {'GB/s':>8} {'peak RSS GB':>12} {'RSS / shard':>12}")
        for tool, r in results.items():
            print(f"{tool:<10} {r['seconds']:>8.2f} {size / 1e9 / r['seconds']:>8.3f} {r['peak_rss'] / 1e9:>12.3f} "
                  f"{r['peak_rss'] / size:>12.2f}")
        if "quark" in results:
            q, g = results["quark"], results["quantgate"]
            print(f"speed-up quantgate/quark: {q['seconds'] / g['seconds']:.1f}x;  "
                  f"memory quark/quantgate: {q['peak_rss'] / g['peak_rss']:.1f}x")
            print(f"outputs byte-identical: {tensors_equal(work / 'qg', work / 'quark')}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
