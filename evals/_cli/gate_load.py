"""``gate load``: serving load, knee RPS and tok/s at the TTFT SLO, candidate vs reference sweeps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_BAD_INPUT, EXIT_BLOCK, EXIT_PASS

HELP = """\
Compare two load sweeps (evals load) at the TTFT SLO. Knee of a sweep: the last offered rate that
meets the SLO (TTFT p95 <= SLO, success >= min) before the first that breaks it, read as its
achieved RPS and output tok/s. PASS when the candidate's RPS and tok/s are both >= (1 - margin)
times the reference's; FAIL below; INCONCLUSIVE when a sweep does not bracket its knee (every rate
met the SLO, or the lowest already broke it: the output says which rates to add).

exit codes: 0 PASS; 1 FAIL; 2 INCONCLUSIVE or bad input (bundles of different workloads)"""


def add_load_args(p: argparse.ArgumentParser, prefix: str) -> None:
    """The knee gate's knobs: ``gate load`` (no prefix) and ``gate release`` (``load-``)."""
    p.add_argument(f"--{prefix}margin", type=float, default=0.05,
                   help="the candidate may sustain this fraction less load than the reference (default 0.05)")
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
    from evals.gate import PASS
    from evals.knee import INCONCLUSIVE, human, load_gate

    load = load_gate(args.candidate, args.reference, args.margin, args.ttft_slo, args.min_success)
    print(json.dumps(load, indent=2) if args.json else human(load))
    return {PASS: EXIT_PASS, INCONCLUSIVE: EXIT_BAD_INPUT}.get(load["verdict"], EXIT_BLOCK)
