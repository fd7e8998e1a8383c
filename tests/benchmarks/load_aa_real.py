"""`gate load` for real: interleaved `evals load` sweeps (guidellm driving a loopback server), A/A and A/half.

    nice -n 5 python -m tests.benchmarks.load_aa_real --out /tmp/load-aa [--repeats 3]

Two stand-in servers on 127.0.0.1 (tests/evals/load_server.py: one FIFO prefill worker, so a set
capacity of 1 / prefill_s req/s): A, and T throttled to half of A's capacity. Pair 1 sweeps A
against itself (reference and candidate both A, interleaved A B A B by one `evals load`); pair 2
sweeps A (reference) and T (candidate) the same way. Each pair is then judged by `gate load --json`;
the table shows each arm's knees, the ratio with its one-sided 95% bounds, the verdict and the exit
code. Expected: pair 1 not FAIL, pair 2 FAIL. Every guidellm run starts a fresh process (about
20-80 s of start-up on a busy host besides --max-seconds), so this takes tens of minutes: a script,
not a test (tests/evals/test_load_repeats.py runs the same path small).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from quant.example import write_tokenizer
from tests.evals.load_server import serve


def cli(entry: str) -> list[str]:
    """The console script `evals` (evals_main) or `gate` (main), run by this interpreter."""
    return [sys.executable, "-c", f"import sys; from evals.cli import {entry}; sys.exit({entry}(sys.argv[1:]))"]


def sweep_pair(args, cand_url: str, ref_url: str, name: str) -> None:
    cmd = [*cli("evals_main"), "load", "--base-url", cand_url, "--model", "standin",
           "--tokenizer", str(args.out / "tok"), "--out", str(args.out / f"{name}-cand"), "--reference-base-url", ref_url,
           "--reference-out", str(args.out / f"{name}-ref"), "--repeats", str(args.repeats), "--rates", args.rates,
           "--max-seconds", str(args.max_seconds), "--ttft-slo", str(args.slo), "--refine-step",
           str(args.refine_step), "--prompt-tokens", "64", "--output-tokens", "8"]
    started = time.monotonic()
    with (args.out / f"{name}.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}).returncode
    print(f"{name}: evals load exit {code} in {time.monotonic() - started:.0f} s (log {args.out / f'{name}.log'})",
          flush=True)


def judge(args, name: str) -> dict:
    proc = subprocess.run([*cli("main"), "load", "--candidate", str(args.out / f"{name}-cand"), "--reference",
                           str(args.out / f"{name}-ref"), "--margin", str(args.margin), "--json"],
                          capture_output=True, text=True)
    result = json.loads(proc.stdout) if proc.stdout.strip() else {"verdict": "error", "why": proc.stderr.strip()}
    return result | {"exit": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the sweeps and logs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-s", type=float, default=0.2, help="server A: capacity 1 / prefill_s req/s")
    parser.add_argument("--rates", default="1.5,3,6")
    parser.add_argument("--refine-step", type=float, default=0.75)
    parser.add_argument("--max-seconds", type=float, default=8)
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT p95 SLO, seconds")
    parser.add_argument("--margin", type=float, default=0.10)
    parser.add_argument("--pairs", default="aa,half", help="which pairs to run: aa, half or both")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=False)
    (args.out / "tok").mkdir()
    write_tokenizer(args.out / "tok", 512, 4096)
    a, t = serve(args.prefill_s, seed=1), serve(2 * args.prefill_s, seed=2)
    url = lambda s: f"http://127.0.0.1:{s.server_address[1]}"  # noqa: E731
    pairs = {"aa": (url(a), url(a)), "half": (url(t), url(a))}
    chosen = [p for p in args.pairs.split(",") if p in pairs]
    for name in chosen:
        sweep_pair(args, *pairs[name], name)
    print(f"\ncapacity A {1 / args.prefill_s:g} req/s, T {0.5 / args.prefill_s:g} req/s; SLO TTFT p95 <= {args.slo:g} s; "
          f"{args.repeats} sweeps per arm; margin {args.margin:g}")
    print(f"{'pair':<6} {'reference knees':<26} {'candidate knees':<26} {'ratio':>6} {'bounds':>16} {'verdict':>13} exit")
    for name in chosen:
        r = judge(args, name)
        knees = lambda arm: ", ".join("-" if k["rps"] is None else f"{k['rps']:.2f}"  # noqa: E731
                                      for k in r["arms"][arm]["sweeps"]) if "arms" in r else "-"
        bounds = f"[{r['lower']:.3f}, {r['upper']:.3f}]" if r.get("lower") is not None else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") is not None else "-"
        print(f"{name:<6} {knees('reference'):<26} {knees('candidate'):<26} {ratio:>6} {bounds:>16} {r['verdict']:>13} "
              f"{r['exit']}")
        print(f"       {r['why']}")
    a.shutdown()
    t.shutdown()


if __name__ == "__main__":
    main()
