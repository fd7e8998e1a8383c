"""quantgate's converter against AMD Quark's file-to-file exporter, side by side, in one run.

    python -m tests.benchmarks.bench_convert [--experts 16] [--skip-quark] [--workdir DIR]

Prints, from one run on this machine:

1. start-up: ``quantize --help``, ``gate --help``, ``evals --help`` and ``quantize --dry-run``
   (best of 5; the interpreter's own start included);
2. one GLM-5-shaped shard (routed experts at real dims, 6144 x 2048 bf16; 16 experts = 1.2 GB)
   converted to MXFP4 by each tool in its own process: wall clock with start-up, the conversion
   alone, CPU seconds and peak RSS of the whole process tree (every process, summed, sampled
   every 20 ms), and the ratios; both outputs must be byte-identical;
3. the same at twice the shard size (steady state, and memory must stay flat);
4. ``--to bf16`` (decode, on the same executor) of the 1x and 2x outputs;
5. where quantgate's time goes (read, kernel, source and output sha256, write: seconds each stage
   was busy; hashes and writes run on helper threads overlapping the kernel, so stages add up to
   more than the total), beside this machine's own limits measured in this process: sha256 and
   the kernel on one core, and the bound they set for two cores;
6. ``--workers 1, 2, 4, 8`` on 8 shards of the 2x size.

Steady state is the 2x shard's conversion rate, process start-up excluded (the manifest's own
seconds; loading numba's kernel is in them).

Not a test: timings depend on the machine and on whatever else runs (the load average is printed
with them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.benchmarks.make_shard import make_glm5_shard

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
QUANTIZE = [sys.executable, "-m", "quant.cli"]
# Compiles both numba kernels into their on-disk cache if they are not there (after an install or
# an edit of the module): a one-time cost that no conversion after the first pays.
WARM = """
import numpy as np
from quant.formats import mxfp4_fast
packed, scales, *_ = mxfp4_fast.quantize_bf16(np.zeros((1, 64), np.uint8))
mxfp4_fast.decode_bf16(packed, scales)
"""
STAGES = ("read", "kernel", "source_hash", "output_hash", "write")


def run_measured(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall clock (start-up included), CPU seconds and the peak RSS of its process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"benchmark subprocess failed ({' '.join(cmd[:6])} ...):\n{err[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "peak_rss": peak, "stdout": out}


def quantgate(src: Path, dst: Path, *args: str) -> dict:
    r = run_measured([*QUANTIZE, "-q", *args, str(src), str(dst)])
    manifest = json.loads((dst / "conversion_manifest.json").read_text())
    return {**r, "seconds": manifest["seconds"], "stages": manifest["summary"]["stage_seconds"],
            "workers": manifest["summary"]["workers"]}


def quark(src: Path, dst: Path) -> dict:
    r = run_measured([sys.executable, "-c", QUARK, str(src), str(dst)])
    return {**r, "seconds": json.loads(r["stdout"].strip().splitlines()[-1])["seconds"]}


def best_of(cmd: list[str], n: int = 5) -> tuple[float, float]:
    """Best wall clock and best CPU seconds of ``n`` runs (CPU time barely moves with the machine's load)."""
    runs = [run_measured(cmd) for _ in range(n)]
    return min(r["wall"] for r in runs), min(r["cpu"] for r in runs)


def machine_limits(shard: Path) -> tuple[float, float]:
    """GB/s of sha256 and of the MXFP4 kernel on one core, on 256 MB of the shard's expert bytes."""
    import hashlib

    import numpy as np

    from quant.formats import mxfp4_fast

    path = next(shard.glob("*.safetensors"))
    rows = (256 << 20) // (6144 * 2)
    raw = np.fromfile(path, dtype=np.uint8, count=rows * 6144 * 2, offset=path.stat().st_size - rows * 6144 * 2)
    raw = raw.reshape(rows, 6144 * 2)  # the file's last bytes: a down_proj's rows, bf16
    mxfp4_fast.quantize_bf16(raw[:64], threads=1)  # load the compiled kernel

    def best(fn) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return raw.nbytes / 1e9 / min(times)

    return best(lambda: hashlib.sha256(raw).digest()), best(lambda: mxfp4_fast.quantize_bf16(raw, threads=1))


def read_once(folder: Path) -> None:
    """Bring a folder's shards into the page cache, as the freshly made bf16 sources are: quantgate
    writes its outputs with O_DIRECT, so decoding one straight after would time the disk instead."""
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def tensors_equal(a: Path, b: Path) -> bool:
    from tests.conftest import load_tensors

    return load_tensors(a) == load_tensors(b)


def row(label: str, r: dict, gb: float) -> str:
    return (f"{label:<26} {r['wall']:>8.2f} {r['seconds']:>9.2f} {gb / r['wall']:>8.3f} {gb / r['seconds']:>9.3f} "
            f"{r['cpu']:>7.1f} {r['peak_rss'] / 1e9:>8.3f}")


HEADER = (f"{'':<26} {'wall s':>8} {'convert s':>9} {'GB/s':>8} {'GB/s conv':>9} {'CPU s':>7} {'RSS GB':>8}\n"
          f"{'':<26} {'(start-up included)':>19} {'(wall)':>8} {'(no start)':>9} {'(tree)':>7} {'(tree)':>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16, help="routed experts in the 1x shard (16 = 1.2 GB)")
    parser.add_argument("--skip-quark", action="store_true", help="measure quantgate only")
    parser.add_argument("--workdir", type=Path, help="where to build the shards (default: a temp folder)")
    args = parser.parse_args()

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
        one = make_glm5_shard(work / "x1", args.experts)
        two = make_glm5_shard(work / "x2", 2 * args.experts)
        os.sync()  # the fresh shards' write-back would otherwise land inside the first timing
        gb1, gb2 = size_of(one) / 1e9, size_of(two) / 1e9

        print(f"numba kernels compiled or loaded from the cache: {run_measured([sys.executable, '-c', WARM])['wall']:.2f} s "
              "(compiling happens once, on first use)")
        print(f"\n1. start-up (best of 5)     {'wall s':>8} {'CPU s':>8}")
        for label, cmd in (("python3 -c pass (floor)", [sys.executable, "-c", "pass"]),
                           ("quantize --help", [*QUANTIZE, "--help"]),
                           ("gate --help", [sys.executable, "-m", "evals.cli", "--help"]),
                           ("evals --help", [sys.executable, "-c", "from evals.cli import evals_main; evals_main()",
                                             "--help"]),
                           ("quantize --dry-run (1x)", [*QUANTIZE, "--to", "mxfp4", "--dry-run", str(one),
                                                        str(work / "never")])):
            print(f"  {label:<26} {'%8.3f %8.3f' % best_of(cmd)}")

        print(f"\n2-4. conversions (1x shard {gb1:.3f} GB, 2x shard {gb2:.3f} GB; GB/s are of bf16 bytes)")
        print(HEADER)
        results = {"quantgate 1x -> mxfp4": quantgate(one, work / "qg1", "--to", "mxfp4")}
        if not args.skip_quark:
            results["quark 1x -> mxfp4"] = quark(one, work / "quark1")
            same = tensors_equal(work / "qg1", work / "quark1")
            shutil.rmtree(work / "quark1")
        results["quantgate 2x -> mxfp4"] = quantgate(two, work / "qg2", "--to", "mxfp4")
        for size in ("1x", "2x"):
            read_once(work / f"qg{size[0]}")
            results[f"quantgate {size} --to bf16"] = quantgate(work / f"qg{size[0]}", work / "dec", "--to", "bf16")
            shutil.rmtree(work / "dec")
        shutil.rmtree(work / "qg2")
        for label, r in results.items():
            print(row(label, r, gb2 if "2x" in label else gb1))
        g = results["quantgate 1x -> mxfp4"]
        if "quark 1x -> mxfp4" in results:
            q = results["quark 1x -> mxfp4"]
            print(f"quantgate vs quark, 1x: {q['wall'] / g['wall']:.1f}x faster (wall, start-up included), "
                  f"{q['seconds'] / g['seconds']:.1f}x (conversion alone), {q['cpu'] / g['cpu']:.1f}x less CPU, "
                  f"{q['peak_rss'] / g['peak_rss']:.1f}x less memory; outputs byte-identical: {same}")
        g2 = results["quantgate 2x -> mxfp4"]
        print(f"memory 2x / 1x: {g2['peak_rss'] / g['peak_rss']:.2f} (flat = 1.00)")
        print(f"steady state (the 2x conversion, start-up excluded): {gb2 / g2['seconds']:.3f} GB/s -> mxfp4, "
              f"{gb2 / results['quantgate 2x --to bf16']['seconds']:.3f} GB/s --to bf16")

        print("\n5. where quantgate's time goes (seconds each stage was busy; all but the kernel run on "
              "helper threads)")
        print(f"{'':<26} {'total':>7} " + " ".join(f"{s:>11}" for s in STAGES))
        for label, r in results.items():
            if "stages" in r:
                st = r["stages"]
                print(f"{label:<26} {st['total']:>7.2f} " + " ".join(f"{st.get(s, 0.0):>11.2f}" for s in STAGES))
        sha, kernel = machine_limits(one)
        out_ratio = size_of(work / "qg1") / size_of(one)
        core_s_per_gb = 1 / sha + 1 / kernel + out_ratio / sha  # source hash, kernel, output hash
        bound = 1 / max(1 / sha, core_s_per_gb / 2)
        print(f"this machine, one core: sha256 {sha:.2f} GB/s, kernel {kernel:.2f} GB/s; on two cores these "
              f"three alone bound a conversion to {bound:.2f} GB/s (the source's sha256 is one sequential "
              f"stream; it alone caps it at {sha:.2f} GB/s)")

        shutil.rmtree(work / "qg1")
        shutil.rmtree(two)
        eight = make_glm5_shard(work / "x8", 2 * args.experts, shards=8)
        os.sync()
        print(f"\n6. workers ({gb2:.3f} GB in 8 shards; each worker keeps two cores busy, so on "
              f"{os.cpu_count()} cores more than {max(1, (os.cpu_count() or 1) // 2)} only share them; the default "
              f"is one per two cores, at most one per 4 GB of work)")
        print(HEADER)
        for workers in (1, 2, 4, 8):
            r = quantgate(eight, work / "w", "--to", "mxfp4", "--workers", str(workers))
            shutil.rmtree(work / "w")
            print(row(f"--workers {workers}", r, gb2))
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
