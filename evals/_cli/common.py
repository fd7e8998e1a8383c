"""Arguments and output shared by several subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from evals.errors import BadInput


def margins(items: list[str]) -> dict[str, float]:
    """``--margin BENCH=VALUE`` items as a mapping."""
    out = {}
    for item in items:
        bench, _, value = item.partition("=")
        try:
            out[bench] = float(value)
        except ValueError:
            raise BadInput(f"--margin {item!r}: expected BENCH=VALUE, e.g. gsm8k=0.02") from None
    return out


def add_comparison_args(p: argparse.ArgumentParser) -> None:
    """The two runs to compare and how: ``gate accuracy`` and ``gate release``."""
    p.add_argument("--candidate", type=Path, required=True, help="candidate run bundle (evals run)")
    p.add_argument("--reference", type=Path, required=True, help="reference run bundle, same items and settings")
    p.add_argument("--reference-rerun", type=Path, help="a second reference run: its self-discordance is the "
                                                        "noise floor the candidate is judged against")
    p.add_argument("--policy", help="gate policy: a shipped one by name (release, arith-example; default: release), "
                                     "or a file by its path (./my-policy.yaml: a slash or a .yaml/.yml suffix)")
    p.add_argument("--margin", action="append", default=[], metavar="BENCH=VALUE",
                   help="override a benchmark's non-inferiority margin, e.g. gsm8k=0.03, or name one the policy "
                        "does not (such a benchmark is refused without one)")
    p.add_argument("--allow-setting-differences", action="store_true",
                   help="compare runs whose recorded settings or prompts differ (refused by default, exit 2); "
                        "the result and report are then labelled as not like for like")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")


def accuracy_of(args: argparse.Namespace, benchmarks: list[str] | None = None) -> dict:
    from evals.judge.gate import accuracy_gate
    from evals.judge.policy import load_policy

    policy = load_policy(args.policy).with_margins(margins(args.margin))
    return accuracy_gate(args.candidate, args.reference, policy, args.reference_rerun,
                         allow_setting_differences=args.allow_setting_differences, benchmarks=benchmarks)


def dumps(obj) -> str:
    from evals.judge.report import strict_json

    return strict_json(obj)
