"""``gate``: release checks. ``gate checkpoint`` proves a checkpoint loads correctly in sglang and
vLLM before anyone starts a server (more subcommands follow with the accuracy gate)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quant.verify import Report, UnreadableCheckpoint, verify

EXIT_OK, EXIT_BLOCK, EXIT_BAD_INPUT = 0, 1, 2

CHECKPOINT_HELP = """\
Replay sglang's and vLLM's loading rules on a quantized checkpoint, from headers and config alone:
layout (every U8 weight has a fitting weight_scale, index and shards agree, tokenizer present),
config (Quark schema sglang and vLLM need, exclude entries exact or re:), and per engine the
module each tensor loads into (fused gate_up_proj / fused_qkv_a_proj*, the FusedMoE
...mlp.experts, sglang's model.decoder.* names for the MTP layer) with that engine's exact
exclude matching, compared with the dtypes on disk.

exit codes: 0 loads correctly in every engine asked for; 1 it would not (or would load wrong);
2 the input is unreadable or not a checkpoint"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gate", description="Pre-release checks for quantized checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("checkpoint", help="prove a checkpoint loads correctly in sglang and vLLM",
                           description=CHECKPOINT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("dir", type=Path, help="checkpoint folder (config.json, shards, index)")
    check.add_argument("--engine", choices=["sglang", "vllm", "all"], default="all", help="engines to check for")
    check.add_argument("--deep", action="store_true",
                       help="also read tensor data: scale bytes in range, no all-zero scale rows, no NaN/Inf in bf16")
    check.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    return parser


def human_report(report: Report) -> str:
    lines = [f"checkpoint  {report.checkpoint}  ({report.modules_checked} Linear modules checked)"]
    for engine in report.engines:
        findings = report.for_engine(engine)
        lines.append(f"\n{engine}: {'OK' if not findings else f'{len(findings)} problem(s)'}")
        for f in findings:
            lines += [f"  PROBLEM  [{f.check}] {f.module}", f"           why: {f.why}", f"           fix: {f.fix}"]
    lines.append("\nverdict: " + ("loads correctly" if report.ok else "would NOT load correctly"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = verify(args.dir, args.engine, args.deep)
    except UnreadableCheckpoint as exc:
        print(f"gate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report.to_dict(), indent=2) if args.json else human_report(report))
    return EXIT_OK if report.ok else EXIT_BLOCK


if __name__ == "__main__":
    sys.exit(main())
