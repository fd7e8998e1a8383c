"""``gate release``: ``gate checkpoint`` + ``gate accuracy`` in one verdict, with report.md and report.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from evals._cli.common import accuracy_of, add_comparison_args, dumps, margins
from evals._cli.gate_load import add_load_args
from evals.errors import EXIT_BLOCK, EXIT_PASS, BadInput

HELP = """\
gate checkpoint + gate accuracy (+ gate load with --load-candidate/--load-reference) in one
verdict; writes report.md and report.json. RELEASE needs the checkpoint to load correctly in every
engine, every benchmark the policy requires to be compared and to pass, and the load gate (when
given) to pass.

The verdict is bound to the checkpoint: CHECKPOINT's conversion_manifest.json must have the sha256
the candidate run recorded (run.json checkpoint_manifest_sha256: `evals run --model DIR`, or
`--checkpoint DIR` for a served one); another checkpoint is refused naming both hashes, a run that
recorded none is refused unless --unverified-checkpoint. Candidate and reference that are one run
or evaluated one checkpoint are refused. report.md/json and the page name the policy (path,
sha256), tool version, date, recipe and both checkpoints' hashes.

exit codes: 0 release; 1 block; 2 bad input or refused (runs that are not comparable, a checkpoint
the candidate run did not evaluate, candidate and reference the same run or checkpoint)"""


def register(sub) -> None:
    from quant import kernels

    p = sub.add_parser("release", help="gate checkpoint + gate accuracy: one verdict, report.md and report.json",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="the quantized checkpoint folder")
    add_comparison_args(p)
    p.add_argument("--load-candidate", type=Path, help="candidate load bundle: the release also needs gate load")
    p.add_argument("--load-reference", type=Path, help="reference load bundle for --load-candidate")
    add_load_args(p, prefix="load-")
    p.add_argument("--unverified-checkpoint", action="store_true",
                   help="release although nothing shows the candidate run evaluated CHECKPOINT (the run records no "
                        "checkpoint_manifest_sha256, or CHECKPOINT has no conversion_manifest.json): refused by "
                        "default (exit 2); the report then says UNVERIFIED. A checkpoint other than the one the run "
                        "recorded is always refused")
    p.add_argument("--report-dir", type=Path, help="where report.md/report.json go (default: beside the candidate run)")
    p.add_argument("--plots", type=Path, metavar="DIR",
                   help="also write the figures (PNG) and report.html to DIR: one self-contained page (styles and "
                        "figures inside), verdict first, the same content as report.md")
    kernels.add_arguments(p, release=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals.judge import render
    from evals._cli.gate_checkpoint import human
    from evals.judge.binding import bind_checkpoint, lines, provenance
    from evals.bundle import read_bundle
    from evals.judge.gate import RELEASE, release_report
    from evals.judge.knee import human as human_load
    from evals.judge.knee import load_gate
    from evals.judge.report import write
    from quant import kernels
    from quant.verify import verify

    cand_run, _ = read_bundle(args.candidate)
    ref_run, _ = read_bundle(args.reference)
    bound = bind_checkpoint(args.checkpoint, args.candidate, cand_run, args.unverified_checkpoint)
    accuracy = accuracy_of(args)  # refuses a candidate and reference that are one run or one checkpoint

    if bool(args.load_candidate) != bool(args.load_reference):
        raise BadInput("give both --load-candidate and --load-reference, or neither")
    structure = verify(args.checkpoint, "all")
    kern = kernels.release_check(args, accuracy["policy"])
    load = load_gate(args.load_candidate, args.load_reference, args.load_margin, args.load_ttft_slo,
                     args.load_min_success) if args.load_candidate else None
    prov = provenance(args.checkpoint, bound, ref_run, accuracy["policy"]["source"], margins(args.margin))
    report = release_report(args.checkpoint, structure.to_dict(), accuracy, kern, load, prov)
    md, js = write(report, args.report_dir or args.candidate)
    if args.plots:
        from evals.judge import dashboard, page

        page.write(dashboard.load(args.candidate, args.reference, args.checkpoint, js), args.plots)
    sections = [human(structure), render.text(accuracy)]
    if kern:
        sections.append(f"{kern['summary']} ({'BLOCKING' if kern['blocking'] else 'warning'})")
    if load:
        sections.append(human_load(load))
    sections.append("\n".join(f"{label}: {text}" for label, text in lines(prov)))
    sections.append(f"release verdict: {report['verdict']}" + "".join(f"\n  {r}" for r in report["reasons"])
                    + f"\nreport: {md} and {js}")
    print(dumps(report) if args.json else "\n\n".join(sections))
    return EXIT_PASS if report["verdict"] == RELEASE else EXIT_BLOCK
