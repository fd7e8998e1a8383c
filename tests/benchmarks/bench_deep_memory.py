"""``gate checkpoint --deep`` on one large bf16 tensor: the checker's peak memory against the tensor's size.

    python -m tests.benchmarks.bench_deep_memory [--gib 2] [--workdir DIR]

The tiny GLM-5 example checkpoint plus one extra shard holding a ``--gib``-sized bf16 tensor (zeros,
written a slice at a time, with a NaN in its last element) is checked ``--deep`` by the real command
in its own process; printed: the command's exit code, whether the NaN was found, its seconds and
its peak RSS (``ru_maxrss`` of the child). With chunked reads the peak stays near the command's
start-up size whatever ``--gib`` is (232 MiB at 0.25 and at 1 GiB, measured here); loading the tensor
whole needed its size and half again.

Not a test: it writes ``--gib`` of data and takes the disk's time to read it back.
"""

from __future__ import annotations

import argparse
import json
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quant.example import tiny_config, write_checkpoint

NAME = "model.layers.0.extra.weight"
COLS = 8192


def write_big_shard(path: Path, gib: float) -> None:
    """One bf16 tensor [rows, 8192] of zeros but a NaN last, written without holding it in memory."""
    rows = int(gib * (1 << 30)) // (COLS * 2)
    header = json.dumps({NAME: {"dtype": "BF16", "shape": [rows, COLS], "data_offsets": [0, rows * COLS * 2]}})
    header += " " * (-len(header) % 8)
    zeros = bytes(COLS * 2 * 1024)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        for start in range(0, rows, 1024):
            f.write(zeros[:min(1024, rows - start) * COLS * 2])
        f.seek(-2, 2)
        f.write(b"\xc0\x7f")  # bf16 NaN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = write_checkpoint(Path(tmp) / "bf16", tiny_config("glm_moe_dsa"))
        write_big_shard(src / "model-extra.safetensors", args.gib)
        index_path = src / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"][NAME] = "model-extra.safetensors"
        index.get("metadata", {}).pop("total_size", None)
        index_path.write_text(json.dumps(index))
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(src), "--deep", "--json"],
                             capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        found = NAME in out.stdout and "NaN/Inf values" in out.stdout
        print(f"tensor {args.gib:g} GiB bf16: exit {out.returncode}, NaN found {found}, {seconds:.1f} s, "
              f"peak RSS {peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
