"""``evals import-tau2``: tau2-bench results files (one per domain) into a run bundle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_PASS

HELP = """\
Turn tau2-bench results files (one per domain, from your own `tau2 run`) into a run bundle that
`gate accuracy` pairs with another: one row per (task, trial), scored by tau2's own reward, with
infrastructure errors kept apart from task failures. Files are validated with tau2-bench's own
result models; both arms must use the same user simulator, trials, limits and task split.

example:
  evals import-tau2 airline.json retail.json telecom.json --out runs/mxfp4-tau2

exit codes: 0 imported (a JSON summary is printed); 2 bad input (a file that is not tau2 results,
two files of one domain, runs that differ in their settings)"""


def register(sub) -> None:
    p = sub.add_parser("import-tau2", help="ingest tau2-bench results files (one per domain) into a run bundle",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="tau2 results JSON files, one per domain")
    p.add_argument("--out", type=Path, required=True, help="run bundle folder to create")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.tau2 import import_tau2

    result = import_tau2(args.results, args.out)
    print(json.dumps(result["benchmarks"]["tau2"], indent=2))
    return EXIT_PASS
