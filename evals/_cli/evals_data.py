"""``evals data``: import benchmark data into a data folder, recording sha256s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_PASS

HELP = """\
Import benchmark data into a data folder that `evals run --data-dir` reads: each file is
validated row by row and its sha256 recorded in manifest.json, so a run records exactly which
data it saw and `gate accuracy` refuses runs on different data. GSM8K ships with quantgate (you
need this only for another copy); GPQA-Diamond is gated and never bundled: you supply its CSV,
and each question's choice order is frozen at import.

example:
  evals data --data-dir DATA --gpqa gpqa_diamond.csv

exit codes: 0 imported (a JSON summary is printed); 2 bad input (a missing file, a row not in the
benchmark's format, the hub out of reach)"""


def register(sub) -> None:
    p = sub.add_parser("data", help="import benchmark data into a data folder, recording sha256s",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, required=True, help="where the prepared data goes")
    p.add_argument("--gsm8k", type=Path, metavar="DIR",
                   help="folder with GSM8K's official train.jsonl, test.jsonl; or `hub` to fetch it with datasets")
    p.add_argument("--gpqa", type=Path, metavar="FILE",
                   help="GPQA-Diamond's official CSV (you supply it: it is gated and never bundled), or `hub` to "
                        "fetch it with datasets once you have accepted its terms; the choice order is frozen "
                        "into the prepared file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.data import DataError, fetch_from_hub, import_gpqa, import_gsm8k

    if not (args.gsm8k or args.gpqa):
        raise DataError("nothing to import: give --gsm8k DIR and/or --gpqa FILE")
    done = {}
    staging = args.data_dir / ".hub"
    if args.gsm8k:
        source = fetch_from_hub("gsm8k", staging / "gsm8k") if str(args.gsm8k) == "hub" else args.gsm8k
        done["gsm8k"] = import_gsm8k(source, args.data_dir)
    if args.gpqa:
        source = fetch_from_hub("gpqa_diamond", staging / "gpqa") if str(args.gpqa) == "hub" else args.gpqa
        done["gpqa_diamond"] = import_gpqa(source, args.data_dir)
    print(json.dumps(done, indent=2))
    return EXIT_PASS
