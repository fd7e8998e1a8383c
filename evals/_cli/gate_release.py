"""``gate release``: ``gate checkpoint`` + ``gate accuracy`` in one verdict, with report.md and report.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals._cli.common import accuracy_of, add_comparison_args, dumps, margins
from evals._cli.gate_load import add_load_args
from evals.errors import EXIT_BLOCK, EXIT_PASS, BadInput

HELP = """\
gate checkpoint + gate accuracy (+ gate load with --load-candidate/--load-reference) in one
verdict; writes report.md and report.json. RELEASE needs the checkpoint to load correctly in every
engine, every benchmark the policy requires to be compared and to pass, and the load gate (when
given) to pass.

The verdict is bound to the checkpoint, identified by its shards: every shard CHECKPOINT's
conversion_manifest.json lists is hashed (streamed) and must have the sha256 it records (--fast
checks names and sizes only, and the report says so), the manifest and shards must be regular files
inside CHECKPOINT (no links), and the identity must be the one the candidate run recorded (run.json
checkpoint_sha256: `evals run --model DIR`, or `--checkpoint DIR` for a served one); another
checkpoint is refused naming both, a run that recorded none is refused unless
--unverified-checkpoint. Candidate and reference that are one run or evaluated one checkpoint (the
same shards) are refused. report.md/json and the page name the policy (path, sha256), tool version,
date, recipe and both checkpoints' identities.

The checkpoint is judged for the serving setup given (the flags gate checkpoint and gate kernels
take; default MI355X, TP 8, fusion on): the structure check for the engines --engine selects, and,
with --gpu, the kernel check. The report records the setup.

Everything is checked before anything is written: the report and the page (--plots) are written
together, and their paths printed. A report of another release (checkpoint, runs or policy) in the
report folder is replaced only with --overwrite, and a report whose page is elsewhere only with
--plots there.

exit codes: 0 release; 1 block; 2 bad input or refused (runs that are not comparable, a checkpoint
the candidate run did not evaluate or whose shards changed, candidate and reference the same run or
checkpoint, a report of another release in the way)"""


def register(sub) -> None:
    from quant import kernels
    from quant.engines import serving

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
    p.add_argument("--fast", action="store_true",
                   help="do not hash the checkpoint's shards (only their names and sizes are checked against "
                        "conversion_manifest.json); the report and the terminal say the shards were NOT verified")
    p.add_argument("--report-dir", type=Path, help="where report.md/report.json go (default: beside the candidate run)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a report (and page) of another release: another checkpoint, run or policy")
    p.add_argument("--plots", type=Path, metavar="DIR",
                   help="also write the figures (PNG) and report.html to DIR: one self-contained page (styles and "
                        "figures inside), verdict first, the same content as report.md")
    kernels.add_arguments(p, release=True)
    serving.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from evals._cli.gate_checkpoint import human
    from evals.bundle import read_bundle
    from evals.judge import render
    from evals.judge import report as report_files
    from evals.judge.binding import bind_checkpoint, lines, provenance
    from evals.judge.gate import RELEASE, release_report
    from evals.judge.knee import human as human_load
    from evals.judge.knee import load_gate
    from quant import kernels
    from quant.engines import serving
    from quant.outputs import write_atomic
    from quant.safe_files import make_folder, refuse_link
    from quant.verify import verify

    if args.plots:  # a missing extra (matplotlib) is refused here, before anything is judged or written
        from evals.judge import dashboard, page
    cand_run, _ = read_bundle(args.candidate)
    ref_run, _ = read_bundle(args.reference)
    bound = bind_checkpoint(args.checkpoint, args.candidate, cand_run, args.unverified_checkpoint, args.fast)
    accuracy = accuracy_of(args)  # refuses a candidate and reference that are one run or one checkpoint

    if bool(args.load_candidate) != bool(args.load_reference):
        raise BadInput("give both --load-candidate and --load-reference, or neither")
    setup = serving.from_args(args)  # one setup for the structure check and the kernel check
    structure = verify(args.checkpoint, args.engine, serving=setup)
    kern = kernels.release_check(args, accuracy["policy"], setup)
    load = load_gate(args.load_candidate, args.load_reference, args.load_margin, args.load_ttft_slo,
                     args.load_min_success) if args.load_candidate else None
    prov = provenance(bound, ref_run, accuracy["policy"]["source"], margins(args.margin))
    report = release_report(args.checkpoint, structure, accuracy, kern, load, prov)
    out_dir = args.report_dir or args.candidate
    report["page"] = str(args.plots.resolve() / "report.html") if args.plots else None  # (a link there is refused)
    # Everything is rendered and checked first, then written: a refusal writes nothing, and the
    # report and its page always say the same.
    files = report_files.files(report, out_dir)
    if args.plots:
        saved = json.loads(report_files.strict_json(report))  # the report as it reads back from report.json
        data = dashboard.load(args.candidate, args.reference, args.checkpoint, out_dir / "report.json", saved=saved)
        files.update(page.files(data, args.plots))
    report_files.check_replaceable(report, out_dir, args.overwrite)
    for path in [out_dir, *([args.plots] if args.plots else []), *files]:
        refuse_link(path)
    for folder in {path.parent for path in files}:
        make_folder(folder)
    for path, content in files.items():
        write_atomic(path, content)

    md, js = out_dir / "report.md", out_dir / "report.json"
    written = f"report: {md} and {js}" + (f"\npage: {args.plots / 'report.html'} (figures beside it)" if args.plots
                                          else "")
    sections = [human(structure), render.text(accuracy)]
    if kern:
        sections.append(f"{kern['summary']} ({'BLOCKING' if kern['blocking'] else 'warning'})")
    if load:
        sections.append(human_load(load))
    sections.append("\n".join(f"{label}: {text}" for label, text in lines(prov)))
    sections.append(f"release verdict: {report['verdict']}" + "".join(f"\n  {r}" for r in report["reasons"])
                    + f"\n{written}")
    if args.json:
        print(dumps({**report, "written": [str(p) for p in files]}))
    else:
        print("\n\n".join(sections))
    return EXIT_PASS if report["verdict"] == RELEASE else EXIT_BLOCK
