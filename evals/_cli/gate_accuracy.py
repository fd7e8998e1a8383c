"""``gate accuracy``: the paired, noise-aware accuracy verdict of a candidate run against a reference run."""

from __future__ import annotations

import argparse
from pathlib import Path

from evals._cli.common import accuracy_of, add_comparison_args, dumps
from evals.errors import EXIT_BLOCK, EXIT_PASS

HELP = """\
Compare a candidate run with a reference run question by question. Per benchmark: both scores
with n and a 95% interval, the paired delta, one-sided paired-bootstrap bounds (items resampled;
repeats averaged per item; tau2 resampled within domains, macro = mean of domain deltas), exact
McNemar p for single-repeat binary scores, and a verdict against the policy's margin:
PASS (lower bound > -margin), FAIL (upper bound < -margin, or an absolute floor broken),
INCONCLUSIVE (anything else; says what would decide it: more items, else more repeats, and the margin
the data certifies).

Only like is compared with like: runs whose recorded settings (API, generation budget, sampling,
few-shot sampler, stop sequences, timeout, ...) or prompts differ are refused, naming each
difference, unless --allow-setting-differences. The overall verdict needs every benchmark the
policy requires; --benchmarks limits the comparison (and the verdict) to those named.

exit codes: 0 PASS; 1 FAIL or a blocking INCONCLUSIVE (including a required benchmark not
compared); 2 bad input or refused (bundles that do not pair: different items, documents, data
files, filters or settings; candidate and reference that are one run, a copy of it, or runs of
one checkpoint, the same shards: run.json checkpoint_sha256)"""


def register(sub) -> None:
    p = sub.add_parser("accuracy", help="paired, noise-aware accuracy verdict: candidate vs reference runs",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_comparison_args(p)
    p.add_argument("--benchmarks", metavar="B1,B2",
                   help="compare only these benchmarks; the verdict then covers only them")
    p.add_argument("--reference-table", type=Path,
                   help="published summary scores (manifests/references/...): adds an UNPAIRED, weaker comparison")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.judge import render
    from evals.judge.gate import PASS, unpaired_against_reference

    benchmarks = [b for b in (args.benchmarks or "").split(",") if b] or None
    result = accuracy_of(args, benchmarks)
    if args.reference_table:
        result["unpaired"] = unpaired_against_reference(args.candidate, args.reference_table)
    # the file that judged, by its full path: a shipped name and a file of one's own are never confused
    print(dumps(result) if args.json else render.text(result) + f"\npolicy: {result['policy']['source']}")
    return EXIT_PASS if result["verdict"] == PASS else EXIT_BLOCK
