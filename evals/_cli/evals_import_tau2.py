"""``evals import-tau2``: tau2-bench results files (one per domain) into a run bundle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_PASS


def register(sub) -> None:
    p = sub.add_parser("import-tau2", help="ingest tau2-bench results files (one per domain) into a run bundle")
    p.add_argument("results", type=Path, nargs="+", help="tau2 results JSON files, one per domain")
    p.add_argument("--out", type=Path, required=True, help="run bundle folder to create")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.tau2 import import_tau2

    result = import_tau2(args.results, args.out)
    print(json.dumps(result["benchmarks"]["tau2"], indent=2))
    return EXIT_PASS
