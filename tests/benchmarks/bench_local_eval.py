"""Local evaluation speed: items/s of bf16, FP8 and MXFP4-emulated on the built-in example, side by side.

    nice -n 10 python3 -m tests.benchmarks.bench_local_eval [--limit N] [--batch-size 32] [--dtype bfloat16] [--json]

Writes the built-in example (``quantize --to mxfp4 --example``: DIR/bf16 and its default MXFP4
conversion) and its block-FP8 reference (``quantize --to fp8``), then runs ``evals run`` on each,
in this one process (``evals.run.run``, the path the CLI takes: lm-eval's HFLM, greedy, batched,
KV-cached, stopping at the task's stop sequences). Per arm it prints the score, items/s over the
benchmark unit (wall), the process CPU seconds the arm took (the machine may be shared: wall
time alone says little), and the process's peak RSS so far (``ru_maxrss``, a running maximum:
each arm's figure includes the arms before it). Not a test: a measurement for the README.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from tests.benchmarks.trained_example_gate import build


def measure(model: Path, out: Path, benchmark: str, limit: int | None, batch_size: int, dtype: str) -> dict:
    from evals.run import RunSpec, run

    spec = RunSpec(benchmarks=[benchmark], out=out, model=str(model), limit=limit, batch_size=batch_size,
                   dtype=dtype, device="cpu")
    cpu, wall = time.process_time(), time.time()
    result = run(spec)
    cpu, wall = time.process_time() - cpu, time.time() - wall
    score = result["scores"][benchmark]
    unit = result["timings_s"][f"{benchmark}-r0"]
    return {"score": round(score["score"], 4), "items": score["items"], "unit_s": unit,
            "items_per_s": round(score["items"] / unit, 3), "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    from evals.run import PROTOCOLS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="arith" if "arith" in PROTOCOLS else "gsm8k",
                        help="the example's benchmark (default: %(default)s)")
    parser.add_argument("--limit", type=int, help="items (default: the benchmark's protocol)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = build(Path(tmp), arms=("bf16", "fp8", "mxfp4"))
        results = {arm: measure(path, Path(tmp) / "runs" / arm, args.benchmark, args.limit, args.batch_size,
                                args.dtype) for arm, path in models.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.benchmark}, local cpu, {args.dtype}, batch {args.batch_size}")
    print(f"{'arm':<6} {'score':>6} {'items':>5} {'items/s':>8} {'unit s':>7} {'cpu s':>6} {'wall s':>7} {'peak RSS MB':>11}")
    for arm, r in results.items():
        print(f"{arm:<6} {r['score']:>6.3f} {r['items']:>5} {r['items_per_s']:>8.2f} {r['unit_s']:>7.1f} "
              f"{r['cpu_s']:>6.1f} {r['wall_s']:>7.1f} {r['peak_rss_mb']:>11}")


if __name__ == "__main__":
    main()
