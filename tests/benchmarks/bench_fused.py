"""Fused 3-D experts against the same experts stored per expert, side by side, in one run.

    python -m tests.benchmarks.bench_fused [--experts 16] [--hidden 4096] [--intermediate 1024]
        [--repeat 5] [--workdir DIR]

One MoE layer at Qwen3.5-397B-A17B's expert dims (hidden 4096, moe_intermediate 1024; 16 experts:
403 MB of bf16) is written four ways with the same expert bytes: per expert (``experts.E.*_proj``,
the converter's original path) and fused, as a manifest's ``fused_experts`` describes (Qwen3.5's
``[E, 2I, H]``, Llama-4's ``[E, H, 2I]``, gpt-oss's ``[E, H, 2I]`` with gate and up interleaved).
Each is converted ``--to mxfp4`` (then its output ``--to bf16``, which writes the fused tensors
back) with ``--workers 1``, each run in its own process, in ``--repeat`` rounds over all of them
(so the machine's load falls on every run alike), fastest of each kept. Printed
per run: the conversion's own seconds (the manifest's, start-up excluded), GB/s of the source's
bytes, the ratio of throughput per byte to the per-expert run's (the issue asks >= 0.8), and the
peak RSS of the quantize process (its VmHWM) and of its worker processes (``ru_maxrss``; with
``--workers 1`` the shard is converted in the quantize process itself). The outputs must be the
per-expert run's tensors, and the decodes the fused sources' shapes.

Not a test: timings depend on the machine and on whatever else runs (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.quant.test_fused_experts import LAYOUTS, fuse, fused_manifest

# The quantize CLI in this process, then the peak resident set of it (VmHWM: ru_maxrss would carry
# the benchmark's own peak over the exec) and of its worker processes, if any (ru_maxrss; KiB).
RUN = """
import json, resource, sys
from quant.cli import main
code = main(sys.argv[1:])
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"code": code, "rss_self": hwm, "rss_workers": kids.ru_maxrss}))
"""
PREFIX = "model.layers.0.mlp."


def make_layer(dst: Path, experts: int, hidden: int, inter: int) -> Path:
    """The per-expert checkpoint: one Qwen3-MoE layer (router and routed experts), bf16."""
    dst.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {PREFIX + "gate.weight": torch.randn(experts, hidden, generator=gen).to(torch.bfloat16)}
    for e in range(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            tensors[f"{PREFIX}experts.{e}.{name}.weight"] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 1,
              "hidden_size": hidden, "moe_intermediate_size": inter, "num_local_experts": experts,
              "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "vocab_size": 151936, "torch_dtype": "bfloat16"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def make_fused(src: Path, dst: Path, layout: str, experts: int) -> Path:
    """``src`` with its experts in two fused tensors of ``layout`` (the same bytes, rearranged)."""
    axes, split = LAYOUTS[layout]
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        take = lambda e, proj: f.get_tensor(f"{PREFIX}experts.{e}.{proj}.weight")  # noqa: E731
        tensors = {PREFIX + "gate.weight": f.get_tensor(PREFIX + "gate.weight"),
                   PREFIX + "experts.gate_up_proj": fuse([[take(e, "gate_proj"), take(e, "up_proj")]
                                                          for e in range(experts)], axes, split),
                   PREFIX + "experts.down_proj": fuse([[take(e, "down_proj")] for e in range(experts)], axes, split)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}))
    fused_manifest(dst.parent, axes, split)  # its manifest, beside it: DIR/<layout>/qwen3_moe_fused.yaml
    return dst


def quantize(args: list[str], dst: Path) -> dict:
    """One run of ``quantize ARGS DST`` in a new process: its manifest's seconds and stages, peak RSS."""
    if dst.exists():
        shutil.rmtree(dst)
    # one BLAS thread, as in a converting worker: numpy's OpenBLAS pool would otherwise spin on the
    # other core, and each run's time would depend on what else the machine runs there
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN, "-q", "--workers", "1", *args, str(dst)],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"quantize {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    if usage["code"]:
        raise SystemExit(f"quantize {' '.join(args)}: exit {usage['code']}:\n{done.stderr[-3000:]}")
    manifest = json.loads((dst / "conversion_manifest.json").read_text())
    return {**usage, "seconds": manifest["seconds"], "stages": manifest["summary"]["stage_seconds"]}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one, removed after)")
    args = parser.parse_args()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-fused-", dir=args.workdir))
    try:
        per_expert = make_layer(work / "per_expert" / "bf16", args.experts, args.hidden, args.intermediate)
        nbytes = (per_expert / "model.safetensors").stat().st_size
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; one layer, {args.experts} "
              f"experts, hidden {args.hidden}, moe_intermediate {args.intermediate}: {nbytes / 1e9:.3f} GB bf16; "
              f"--workers 1, fastest of {args.repeat}", flush=True)
        sources = {"per_expert": (per_expert, [])}
        for layout in ("qwen3_5", "llama4", "interleaved"):
            src = make_fused(per_expert, work / layout / "bf16", layout, args.experts)
            sources[layout] = (src, ["--family-manifest", str(work / layout / "qwen3_moe_fused.yaml")])
        print(f"\n{'source layout':<14} {'to':<6} {'seconds':>8} {'GB/s':>7} {'ratio':>6} {'RSS MB':>7} "
              f"{'worker RSS MB':>14}   stages (s): read kernel source_hash output_hash write")
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.repeat):  # rounds over every run, so the machine's load falls on all of them alike
            for layout, (src, manifest) in sources.items():
                for to in ("mxfp4", "bf16"):
                    source, out = (src, src.parent / "mxfp4") if to == "mxfp4" else (src.parent / "mxfp4",
                                                                                      src.parent / "decoded")
                    r = quantize([*manifest, "--to", to, str(source)], out)
                    if (layout, to) not in best or r["seconds"] < best[layout, to]["seconds"]:
                        best[layout, to] = r
        oracle = tensors_of(per_expert.parent / "mxfp4")
        for (layout, to), r in best.items():
            rate, st = nbytes / r["seconds"], r["stages"]
            base = nbytes / best["per_expert", to]["seconds"]
            print(f"{layout:<14} {to:<6} {r['seconds']:>8.2f} {rate / 1e9:>7.3f} {rate / base:>6.2f} "
                  f"{r['rss_self'] / 1024:>7.0f} {r['rss_workers'] / 1024:>14.0f}   "
                  + " ".join(f"{st.get(s, 0.0):.2f}" for s in ("read", "kernel", "source_hash", "output_hash", "write")))
        for layout, (src, _) in sources.items():
            converted = tensors_of(src.parent / "mxfp4")
            if converted.keys() != oracle.keys() or any(not torch.equal(converted[n], oracle[n]) for n in oracle):
                raise SystemExit(f"{layout}: its MXFP4 output is not the per-expert run's")
            decoded = {n: t.shape for n, t in tensors_of(src.parent / "decoded").items()}
            if decoded != {n: t.shape for n, t in tensors_of(src).items()}:
                raise SystemExit(f"{layout}: --to bf16 did not give the source's tensors back")
        print("\nevery fused layout's MXFP4 output equals the per-expert one's, tensor by tensor; each --to bf16 "
              "gives its source's names and shapes back (ratio: GB/s of the source's bytes over the per-expert run's)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
