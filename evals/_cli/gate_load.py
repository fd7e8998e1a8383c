"""``gate load``: serving load, knee RPS and tok/s at the TTFT SLO, candidate vs reference sweeps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_BLOCK, EXIT_PASS

HELP = """\
Compare the load sweeps of a candidate and a reference server (evals load --repeats N: each
folder holds sweep-1, sweep-2, ...) at the TTFT SLO. Knee of a sweep: the largest achieved RPS at
which TTFT p95 <= SLO, interpolated (log TTFT p95 against achieved RPS) between the highest rate
that meets the SLO (success >= min too) and the next, which breaks it; its bootstrap interval
resamples each rate's requests. Verdict on the ratio of the arms' geometric-mean knees with
one-sided 95% Student-t bounds from the sweeps' spread (log scale): PASS when the lower bound is
>= 1 - margin; FAIL when the upper bound is below it; INCONCLUSIVE otherwise (it says how many
sweeps per arm would decide it), or when a sweep does not bracket its knee (it says which rates to
add), or with one sweep per arm. A margin below the reference's own A/A spread is refused.

exit codes: 0 PASS; 1 FAIL or INCONCLUSIVE (both block a release); 2 bad input or refused (sweeps
of different workloads, broken numbers, a margin under the noise floor)"""


def add_load_args(p: argparse.ArgumentParser, prefix: str) -> None:
    """The knee gate's knobs: ``gate load`` (no prefix) and ``gate release`` (``load-``)."""
    p.add_argument(f"--{prefix}margin", type=float, default=0.10,
                   help="the candidate may sustain this fraction less load than the reference (default 0.10)")
    p.add_argument(f"--{prefix}ttft-slo", type=float, help="TTFT p95 SLO in seconds (default: the one the sweeps used)")
    p.add_argument(f"--{prefix}min-success", type=float, help="least success fraction within the SLO (default: the "
                                                               "sweep's, 0.99)")


def register(sub) -> None:
    p = sub.add_parser("load", help="serving load: knee RPS and tok/s at the TTFT SLO, candidate vs reference",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", type=Path, required=True, help="candidate load bundle (evals load)")
    p.add_argument("--reference", type=Path, required=True, help="reference load bundle, same workload")
    add_load_args(p, prefix="")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.judge.knee import PASS, human, load_gate

    load = load_gate(args.candidate, args.reference, args.margin, args.ttft_slo, args.min_success)
    print(json.dumps(load, indent=2) if args.json else human(load))
    return EXIT_PASS if load["verdict"] == PASS else EXIT_BLOCK
