"""Encode speed per byte of the per-tensor FP8 kernel (the W8A8 rung: the amax pass plus the encode, as the
executor runs them) against the MXFP4 kernel, on one random bf16 ``--rows`` x ``--cols`` weight, best of
``--repeat``, all cores. Kernels only: the whole conversion per rung is ``bench_mixed_convert``.

    python -m tests.benchmarks.bench_fp8_tensor [--rows 4096] [--cols 4096] [--repeat 5]

Not a test: timings depend on the machine and whatever else runs. Measured on the shared 2-core dev machine:
fp8_tensor amax+encode 2.3-2.7 GB/s (encode alone 2.8), mxfp4 3.3-3.7 GB/s: per-tensor FP8 reads each
byte twice (the amax pass), so ~0.7x MXFP4's speed per source byte.
"""

from __future__ import annotations

import argparse
import time

import torch

from quant.formats import fp8_tensor, mxfp4_fast


def best(raw, run, repeat: int) -> float:
    """GB/s of source bf16 read by ``run()``, best of ``repeat``."""
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return raw.nbytes / min(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    weight = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = weight.view(torch.uint8).numpy()

    def fp8():
        fp8_tensor.encode_bf16(raw, float(fp8_tensor.scale_of(fp8_tensor.amax_bf16(raw))))

    def mxfp4():
        mxfp4_fast.quantize_bf16(raw, 64, 0, None)

    fp8(), mxfp4()  # compile (or load the cached kernels) outside the timing
    print(f"fp8_tensor amax+encode {best(raw, fp8, args.repeat):.2f} GB/s, "
          f"mxfp4 {best(raw, mxfp4, args.repeat):.2f} GB/s ({args.rows}x{args.cols} bf16)")


if __name__ == "__main__":
    main()
