"""NVFP4 decode (compressed-tensors and ModelOpt) beside the MXFP4 decode, in one run.

    python -m tests.benchmarks.bench_third_party_decode [--experts 8] [--rows 2048] [--cols 7168] [--workdir DIR]

Prints, from one run on this machine:

1. the kernels alone, on one core and on all of them (best of 5, GB/s of the bf16 written): the
   NVFP4 decode of a chunk of rows (``third_party_decode.decode_rows``: the fp32 block scales, then the
   numba kernel) for each producer, and Quark's MXFP4 decode (``mxfp4_fast.decode_bf16``), same shape;
2. ``quantize --to bf16`` of one shard of ``--experts`` expert weights of ``rows x cols`` stored as
   compressed-tensors NVFP4, ModelOpt NVFP4 and Quark MXFP4, each in its own process: wall clock with
   start-up, the decode alone (the manifest's seconds), GB/s of bf16 written, and the peak RSS of the
   process tree (sampled every 20 ms): memory stays at a few chunks whatever the shard's size.

Not a test: timings depend on the machine and on whatever else runs (the load average is printed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from quant.formats import mxfp4_fast, third_party_decode
from quant.formats.constants import ScaleRule
from quant.quark_config import quantization_config
from quant.safetensors_io import DTYPE_BYTES
from quant.third_party import CT, MODELOPT, Scheme
from tests.benchmarks.bench_convert import run_measured

SCHEMES = {"ct-nvfp4": Scheme(CT, "nvfp4", "nvfp4-pack-quantized", 4, "tensor_group", 16),
           "modelopt-nvfp4": Scheme(MODELOPT, "nvfp4", "NVFP4", 4, "tensor_group", 16)}
CONFIGS = {
    "ct-nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": [],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
    "modelopt-nvfp4": {"quant_method": "modelopt", "producer": {"name": "modelopt"},
                       "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}},
    "mxfp4": quantization_config([], ScaleRule.EVEN, True),
}


def random_module(kind: str, rows: int, cols: int, rng: np.random.Generator) -> dict[str, tuple[str, list, bytes]]:
    """One expert weight as ``kind`` stores it: suffix -> (dtype, shape, bytes)."""
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8).tobytes()
    if kind == "mxfp4":
        scales = rng.integers(110, 130, (rows, cols // 32), np.uint8).tobytes()
        return {"weight": ("U8", [rows, cols // 2], codes), "weight_scale": ("U8", [rows, cols // 32], scales)}
    scales = rng.integers(0x20, 0x70, (rows, cols // 16), dtype=np.uint8).tobytes()  # positive e4m3
    if kind == "ct-nvfp4":
        return {"weight_packed": ("U8", [rows, cols // 2], codes),
                "weight_scale": ("F8_E4M3", [rows, cols // 16], scales),
                "weight_global_scale": ("F32", [1], np.float32(768.0).tobytes())}
    return {"weight": ("U8", [rows, cols // 2], codes), "weight_scale": ("F8_E4M3", [rows, cols // 16], scales),
            "weight_scale_2": ("F32", [], np.float32(1 / 768.0).tobytes())}


def write_checkpoint(folder: Path, kind: str, experts: int, rows: int, cols: int) -> int:
    """A one-shard checkpoint of ``experts`` expert weights; returns the bf16 bytes its decode writes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for e in range(experts):
        for suffix, entry in random_module(kind, rows, cols, rng).items():
            tensors[f"model.layers.0.mlp.experts.{e}.down_proj.{suffix}"] = entry
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.writelines(blobs)
    config = {"model_type": "bench_third_party", "quantization_config": CONFIGS[kind]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return experts * rows * cols * DTYPE_BYTES["BF16"]


def best(run, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def kernels(rows: int, cols: int) -> dict[str, dict[str, float]]:
    """GB/s of bf16 written by each decode kernel on a [rows, cols] chunk, one core and all cores."""
    rng = np.random.default_rng(1)
    out_gb = rows * cols * 2 / 1e9
    found: dict[str, dict[str, float]] = {}
    for threads in (1, os.cpu_count()):
        for kind, scheme in SCHEMES.items():
            module = random_module(kind, rows, cols, rng)
            weight = np.frombuffer(module.pop(scheme.weight)[2], np.uint8).reshape(rows, -1)
            params = third_party_decode.load_params(
                scheme, {k: (d, tuple(s), b) for k, (d, s, b) in module.items()}, rows, cols)
            run = functools.partial(third_party_decode.decode_rows, scheme, weight, 0, cols, params, threads)
            run()  # compile or load the kernel
            seconds = best(run)
            found.setdefault(kind, {})[f"{threads} cores"] = out_gb / seconds
        module = random_module("mxfp4", rows, cols, rng)
        packed = np.frombuffer(module["weight"][2], np.uint8).reshape(rows, -1)
        scales = np.frombuffer(module["weight_scale"][2], np.uint8).reshape(rows, -1)
        run = functools.partial(mxfp4_fast.decode_bf16, packed, scales, threads)
        run()
        seconds = best(run)
        found.setdefault("mxfp4", {})[f"{threads} cores"] = out_gb / seconds
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-third-party-", dir=args.workdir))
    try:
        chunk_rows = max(1, 32 * 2**20 // (args.cols * 2))  # the executor's chunk: 32 MB of bf16
        print(f"1. kernels on a [{chunk_rows}, {args.cols}] chunk (GB/s of bf16 written, best of 5; "
              f"load {os.getloadavg()[0]:.2f})")
        for kind, rates in kernels(chunk_rows, args.cols).items():
            print(f"   {kind:<16} " + "  ".join(f"{where}: {rate:6.2f}" for where, rate in rates.items()))
        print(f"\n2. quantize --to bf16 of one shard: {args.experts} experts of [{args.rows}, {args.cols}]")
        print(f"   {'':<16} {'wall s':>8} {'decode s':>9} {'GB/s':>7} {'GB out':>7} {'peak RSS MB':>12} {'load':>5}")
        for kind in ("ct-nvfp4", "modelopt-nvfp4", "mxfp4"):
            src, dst = work / kind, work / f"{kind}-bf16"
            out_bytes = write_checkpoint(src, kind, args.experts, args.rows, args.cols)
            done = run_measured([sys.executable, "-m", "quant.cli", "--to", "bf16", "-q", str(src), str(dst)])
            manifest = json.loads((dst / "conversion_manifest.json").read_text())
            seconds = manifest["seconds"]  # the conversion alone: start-up excluded, loading the kernel included
            print(f"   {kind:<16} {done['wall']:8.2f} {seconds:9.2f} {out_bytes / 1e9 / seconds:7.2f} "
                  f"{out_bytes / 1e9:7.3f} {done['peak_rss'] / 2**20:12.0f} {done['load']:5.2f}")
            shutil.rmtree(src)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
