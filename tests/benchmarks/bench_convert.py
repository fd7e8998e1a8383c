"""quantgate's converter against AMD Quark's file-to-file exporter (and llm-compressor's
``model_free_ptq`` where it is installed), side by side, in one run.

    python -m tests.benchmarks.bench_convert [--experts 16] [--skip-quark] [--skip-workers]
        [--skip-reference] [--llmcompressor-python PYTHON] [--workdir DIR]

Prints, from one run on this machine:

1. start-up: ``quantize --help``, ``gate --help``, ``evals --help`` and ``quantize --dry-run``
   (best of 5; the interpreter's own start included);
2. one GLM-5-shaped shard (routed experts at real dims, 6144 x 2048 bf16; 16 experts = 1.2 GB)
   converted to MXFP4 by each tool in its own process: wall clock with start-up, the conversion
   alone, CPU seconds and peak RSS of the whole process tree (every process, summed, sampled
   every 20 ms), and the ratios; both outputs must be byte-identical;
   ``--to fp8`` (block FP8) the same way, with its ratios to ``--to mxfp4`` and its output checked
   tensor by tensor against the torch reference (``fp8.quantize``); llm-compressor 0.14's
   ``model_free_ptq`` with ``FP8_BLOCK`` when the interpreter given by ``--llmcompressor-python``
   (default: this one) imports it, else a line saying it was skipped;
3. the same at twice the shard size (steady state, and memory must stay flat);
4. ``--to bf16`` (decode, on the same executor) of the 1x and 2x outputs of both formats (the FP8
   decode checked against ``fp8.dequantize``);
5. where quantgate's time goes (read, kernel, source and output sha256, write: seconds each stage
   was busy; hashes and writes run on helper threads overlapping the kernel, so stages add up to
   more than the total), beside this machine's own limits measured in this process: sha256 and
   the kernels on one core, the bound they set for two cores, and the decode's bound: its output
   is 4x (MXFP4) or 2x (FP8) the source's bytes and sha256 is sequential, so the output's sha256
   alone, after the kernels' first load, is its floor;
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
LLMCOMPRESSOR = """
import json, sys, time
from llmcompressor import model_free_ptq
src, dst = sys.argv[1], sys.argv[2]
started = time.perf_counter()
model_free_ptq(src, dst, scheme="FP8_BLOCK", ignore=["re:.*mlp.gate$"], device="cpu")
print(json.dumps({"seconds": time.perf_counter() - started}))
"""
QUANTIZE = [sys.executable, "-m", "quant.cli"]
# Compiles both numba kernels into their on-disk cache if they are not there (after an install or
# an edit of the module): a one-time cost that no conversion after the first pays.
WARM = """
import numpy as np
from quant.formats import fp8_fast, mxfp4_fast
packed, scales, *_ = mxfp4_fast.quantize_bf16(np.zeros((1, 64), np.uint8))
mxfp4_fast.decode_bf16(packed, scales)
codes, scale_inv, *_ = fp8_fast.quantize_bf16(np.zeros((1, 64), np.uint8))
fp8_fast.decode_bf16(codes, scale_inv)
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
    return {"wall": wall, "cpu": cpu, "peak_rss": peak, "stdout": out, "load": os.getloadavg()[0]}


def quantgate(src: Path, dst: Path, *args: str) -> dict:
    r = run_measured([*QUANTIZE, "-q", *args, str(src), str(dst)])
    manifest = json.loads((dst / "conversion_manifest.json").read_text())
    return {**r, "seconds": manifest["seconds"], "stages": manifest["summary"]["stage_seconds"],
            "workers": manifest["summary"]["workers"]}


def quark(src: Path, dst: Path) -> dict:
    r = run_measured([sys.executable, "-c", QUARK, str(src), str(dst)])
    return {**r, "seconds": json.loads(r["stdout"].strip().splitlines()[-1])["seconds"]}


def llmcompressor(python: str, src: Path, dst: Path) -> dict | None:
    """llm-compressor's FP8_BLOCK on the CPU, or None (said why) when ``python`` cannot import it."""
    found = subprocess.run([python, "-c", "import llmcompressor"], capture_output=True, text=True)
    if found.returncode:
        print(f"llm-compressor: skipped, {python} cannot import it (pip install llmcompressor into a venv "
              "made with --system-site-packages, then pass --llmcompressor-python VENV/bin/python)")
        return None
    try:
        r = run_measured([python, "-c", LLMCOMPRESSOR, str(src), str(dst)])
    except SystemExit as exc:  # its failure is its own: the rest of the comparison still runs
        print(f"llm-compressor: failed, left out: {str(exc)[-500:]}")
        return None
    return {**r, "seconds": json.loads(r["stdout"].strip().splitlines()[-1])["seconds"]}


def agreement_with_llmcompressor(ours: Path, theirs: Path) -> str:
    """How llm-compressor's FP8_BLOCK bytes compare with quantgate's: its scale's dtype and the share of
    e4m3 codes that are equal (it names the scale ``weight_scale``; quantgate ``weight_scale_inv``)."""
    import torch
    from safetensors import safe_open

    equal = total = 0
    dtypes = set()
    for path in ours.glob("*.safetensors"):
        with safe_open(str(path), "pt") as a, safe_open(str(theirs / path.name), "pt") as b:
            for name in a.keys():
                if name.endswith("_scale_inv"):
                    weight = name.removesuffix("_scale_inv")
                    dtypes.add(str(b.get_tensor(weight + "_scale").dtype))
                    qa, qb = a.get_tensor(weight).view(torch.uint8), b.get_tensor(weight).view(torch.uint8)
                    equal, total = equal + int((qa == qb).sum()), total + qa.numel()
    return f"its scales are {', '.join(sorted(dtypes))} (quantgate's float32); {equal / total:.2%} of its e4m3 codes equal quantgate's"


def fp8_is_the_reference(src: Path, fp8_out: Path, decoded: Path) -> bool:
    """Every FP8 weight quantgate wrote equals ``fp8.quantize`` of its source tensor (codes and
    scales, bit for bit), and its ``--to bf16`` equals ``fp8.dequantize`` of it."""
    import torch
    from safetensors import safe_open

    from quant.formats import fp8

    torch.set_num_threads(1)  # the machine is shared; one thread also spares libgomp's spinning
    weight_map = json.loads((fp8_out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in weight_map.items():
        if not name.endswith("_scale_inv"):
            continue
        weight = name.removesuffix("_scale_inv")
        with safe_open(str(src / file), "pt") as a, safe_open(str(fp8_out / file), "pt") as b, \
                safe_open(str(decoded / file), "pt") as c:
            ref_q, ref_scale = fp8.quantize(a.get_tensor(weight))
            q, scale_inv = b.get_tensor(weight), b.get_tensor(name)
            if not (torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale_inv, ref_scale)
                    and torch.equal(c.get_tensor(weight).view(torch.int16),
                                    fp8.dequantize(q, scale_inv).view(torch.int16))):
                return False
    return True


def best_of(cmd: list[str], n: int = 5) -> tuple[float, float]:
    """Best wall clock and best CPU seconds of ``n`` runs (CPU time barely moves with the machine's load)."""
    runs = [run_measured(cmd) for _ in range(n)]
    return min(r["wall"] for r in runs), min(r["cpu"] for r in runs)


def machine_limits(shard: Path) -> dict[str, float]:
    """GB/s (of bf16 bytes, per CPU second) of sha256 and of each kernel on one core, on up to 256 MB
    of the shard's expert bytes."""
    import hashlib

    import numpy as np

    from quant.formats import fp8_fast, mxfp4_fast

    path = next(shard.glob("*.safetensors"))
    rows = min(256 << 20, path.stat().st_size // 2) // (6144 * 2) // 128 * 128  # whole FP8 tiles
    raw = np.fromfile(path, dtype=np.uint8, count=rows * 6144 * 2, offset=path.stat().st_size - rows * 6144 * 2)
    raw = raw.reshape(rows, 6144 * 2)  # the file's last bytes: a down_proj's rows, bf16
    packed, scales, *_ = mxfp4_fast.quantize_bf16(raw, threads=1)  # also loads the compiled kernels
    codes, scale_inv, *_ = fp8_fast.quantize_bf16(raw, threads=1)

    def best(fn) -> float:
        times = []
        for _ in range(3):  # CPU seconds of this process (one thread busy): what a loaded machine leaves honest
            started = time.process_time()
            fn()
            times.append(time.process_time() - started)
        return raw.nbytes / 1e9 / min(times)

    return {"sha256": best(lambda: hashlib.sha256(raw).digest()),
            "mxfp4 encode": best(lambda: mxfp4_fast.quantize_bf16(raw, threads=1)),
            "fp8 encode": best(lambda: fp8_fast.quantize_bf16(raw, threads=1)),
            "mxfp4 decode": best(lambda: mxfp4_fast.decode_bf16(packed, scales, threads=1)),
            "fp8 decode": best(lambda: fp8_fast.decode_bf16(codes, scale_inv, threads=1))}


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
    return (f"{label:<30} {r['wall']:>8.2f} {r['seconds']:>9.2f} {gb / r['wall']:>8.3f} {gb / r['seconds']:>9.3f} "
            f"{r['cpu']:>7.1f} {r['peak_rss'] / 1e9:>8.3f} {r['load']:>5.1f}")


HEADER = (f"{'':<30} {'wall s':>8} {'convert s':>9} {'GB/s':>8} {'GB/s conv':>9} {'CPU s':>7} {'RSS GB':>8} {'load':>5}\n"
          f"{'':<30} {'(start-up included)':>19} {'(wall)':>8} {'(no start)':>9} {'(tree)':>7} {'(tree)':>8} {'(1 min)':>5}")


def ratios(label: str, a: dict, b: dict) -> str:
    """``a`` over ``b``: wall (start-up included), conversion alone, CPU seconds, peak RSS."""
    return (f"{label}: wall {a['wall'] / b['wall']:.2f}x, conversion {a['seconds'] / b['seconds']:.2f}x, "
            f"CPU {a['cpu'] / b['cpu']:.2f}x, peak RSS {a['peak_rss'] / b['peak_rss']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16, help="routed experts in the 1x shard (16 = 1.2 GB)")
    parser.add_argument("--skip-quark", action="store_true", help="measure quantgate only")
    parser.add_argument("--skip-workers", action="store_true", help="leave out section 6 (--workers 1, 2, 4, 8)")
    parser.add_argument("--skip-reference", action="store_true",
                        help="leave out the check of the FP8 output against the torch reference (~40 CPU s)")
    parser.add_argument("--llmcompressor-python", default=sys.executable,
                        help="an interpreter that imports llmcompressor (default: this one; skipped if it cannot)")
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

        print(f"\n2-4. conversions (1x shard {gb1:.3f} GB, 2x shard {gb2:.3f} GB; GB/s are of bf16 bytes; "
              "load: the 1-minute load average when the row ended)")
        print(HEADER, flush=True)
        # mxfp4 and fp8 alternate, so a change in the machine's load hits both formats alike.
        results = {"quantgate 1x -> mxfp4": quantgate(one, work / "m1", "--to", "mxfp4"),
                   "quantgate 1x -> fp8": quantgate(one, work / "f1", "--to", "fp8")}
        if not args.skip_quark:
            results["quark 1x -> mxfp4"] = quark(one, work / "quark1")
            same = tensors_equal(work / "m1", work / "quark1")
            shutil.rmtree(work / "quark1")
        if llmc := llmcompressor(args.llmcompressor_python, one, work / "llmc1"):
            results["llm-compressor 1x -> FP8_BLOCK"] = llmc
            llmc_agreement = agreement_with_llmcompressor(work / "f1", work / "llmc1")
            shutil.rmtree(work / "llmc1")
        results["quantgate 2x -> mxfp4"] = quantgate(two, work / "m2", "--to", "mxfp4")
        results["quantgate 2x -> fp8"] = quantgate(two, work / "f2", "--to", "fp8")
        for size in ("1x", "2x"):
            for fmt in ("mxfp4", "fp8"):
                src = work / f"{fmt[0]}{size[0]}"
                read_once(src)
                results[f"quantgate {size} {fmt} --to bf16"] = quantgate(src, work / f"d{fmt[0]}{size[0]}", "--to", "bf16")
                if (fmt, size) != ("fp8", "1x"):  # kept for the reference check
                    shutil.rmtree(work / f"d{fmt[0]}{size[0]}")
        for label, r in results.items():
            print(row(label, r, gb2 if "2x" in label else gb1))
        g, f = results["quantgate 1x -> mxfp4"], results["quantgate 1x -> fp8"]
        g2, f2 = results["quantgate 2x -> mxfp4"], results["quantgate 2x -> fp8"]
        if "quark 1x -> mxfp4" in results:
            q = results["quark 1x -> mxfp4"]
            print(f"quantgate vs quark, 1x: {q['wall'] / g['wall']:.1f}x faster (wall, start-up included), "
                  f"{q['seconds'] / g['seconds']:.1f}x (conversion alone), {q['cpu'] / g['cpu']:.1f}x less CPU, "
                  f"{q['peak_rss'] / g['peak_rss']:.1f}x less memory; outputs byte-identical: {same}")
        print(ratios("fp8 / mxfp4, 1x", f, g))
        print(ratios("fp8 / mxfp4, 2x", f2, g2))
        if "llm-compressor 1x -> FP8_BLOCK" in results:
            print(ratios("llm-compressor FP8_BLOCK / quantgate fp8, 1x", results["llm-compressor 1x -> FP8_BLOCK"], f)
                  + f"; {llmc_agreement}")
        if not args.skip_reference:
            print("fp8 1x output and its --to bf16 bit-identical to the torch reference (fp8.quantize / "
                  f"fp8.dequantize, every tensor): {fp8_is_the_reference(one, work / 'f1', work / 'df1')}")
        shutil.rmtree(work / "df1")
        print(f"memory 2x / 1x: mxfp4 {g2['peak_rss'] / g['peak_rss']:.2f}, fp8 {f2['peak_rss'] / f['peak_rss']:.2f} "
              "(flat = 1.00)")
        print(f"steady state (the 2x conversion, start-up excluded), GB/s of bf16: {gb2 / g2['seconds']:.3f} -> mxfp4, "
              f"{gb2 / f2['seconds']:.3f} -> fp8, "
              f"{gb2 / results['quantgate 2x mxfp4 --to bf16']['seconds']:.3f} mxfp4 --to bf16, "
              f"{gb2 / results['quantgate 2x fp8 --to bf16']['seconds']:.3f} fp8 --to bf16")

        print("\n5. where quantgate's time goes (seconds each stage was busy; all but the kernel run on "
              "helper threads)")
        print(f"{'':<30} {'total':>7} " + " ".join(f"{s:>11}" for s in STAGES))
        for label, r in results.items():
            if "stages" in r:
                st = r["stages"]
                print(f"{label:<30} {st['total']:>7.2f} " + " ".join(f"{st.get(s, 0.0):>11.2f}" for s in STAGES))
        limits = machine_limits(one)
        sha = limits["sha256"]
        print("this machine, one core, GB/s of bf16: " + ", ".join(f"{k} {v:.2f}" for k, v in limits.items()))
        for fmt in ("mxfp4", "fp8"):
            out_ratio = size_of(work / f"{fmt[0]}1") / size_of(one)
            core_s_per_gb = 1 / sha + 1 / limits[f"{fmt} encode"] + out_ratio / sha  # source hash, kernel, output hash
            print(f"  -> {fmt}: on two cores the two hashes and the kernel alone bound a conversion to "
                  f"{1 / max(1 / sha, core_s_per_gb / 2):.2f} GB/s (the source's sha256, one sequential stream, "
                  f"caps it at {sha:.2f})")
        load = {k: run_measured([sys.executable, "-c", WARM])[k] - run_measured([sys.executable, "-c", "pass"])[k]
                for k in ("wall", "cpu")}  # importing numba and loading the cached kernels, interpreter aside
        print(f"  --to bf16: the output is the bf16 itself and its sha256 is one sequential stream, so it alone caps "
              f"a decode at {sha:.2f} GB/s; it starts only after the first chunk is decoded, i.e. after numba and the "
              f"kernels load ({load['wall']:.2f} s wall, {load['cpu']:.2f} CPU s here), so the 2x decode is bounded "
              f"by {gb2 / (gb2 / sha + load['cpu']):.2f} GB/s (per CPU second, like the rates above); every other "
              "stage runs beside it on the second core")

        for folder in ("m1", "f1", "m2", "f2"):
            shutil.rmtree(work / folder)
        shutil.rmtree(two)
        if args.skip_workers:
            return
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
