"""``evals`` (data import, benchmark runs into bundles) and ``gate`` (release checks: ``gate
checkpoint`` proves a checkpoint loads correctly in sglang and vLLM before anyone starts a server).

Each subcommand is one module of ``evals._cli``; this file only assembles the two parsers and
turns a raised ``QuantgateError`` into its message and exit code (``evals.errors``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from evals._cli import (evals_data, evals_import_tau2, evals_load, evals_run, gate_accuracy, gate_checkpoint,
                        gate_kernels, gate_load, gate_plan, gate_release)
from evals.errors import EXIT_BAD_INPUT
from quant.errors import QuantgateError

EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it

# Which extra (pyproject.toml) brings a module a subcommand imports on use: the core install converts
# and checks, and a job that needs more says which extra to add instead of a traceback.
EXTRA_OF = {"lm_eval": "evals", "transformers": "evals", "pandas": "evals", "matplotlib": "evals",
            "tau2": "tau2", "guidellm": "load", "papermill": "notebook"}

GATE_COMMANDS = (gate_checkpoint, gate_accuracy, gate_load, gate_release, gate_kernels, gate_plan)
EVALS_COMMANDS = (evals_data, evals_import_tau2, evals_run, evals_load)

GATE_EPILOG = """\
exit codes (every subcommand): 0 pass / release; 1 fail or block (a blocking INCONCLUSIVE too);
2 bad input or refused (gate plan: 1 when no design reaches the power); 130 interrupted (Ctrl-C)"""

EVALS_EPILOG = """\
examples:
  evals run --benchmarks gsm8k --model /ckpt/tiny --limit 20 --out runs/try     # GSM8K ships with quantgate
  evals data --data-dir DATA --gpqa gpqa_diamond.csv                          # GPQA: you supply it (gated)
  evals run --benchmarks gsm8k,gpqa_diamond --out runs/mxfp4 --data-dir DATA \\
      --base-url http://127.0.0.1:30000 --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4
  evals run --benchmarks gsm8k --out runs/raw --data-dir /data --model /ckpt/x   # /data/gsm8k/{train,test}.jsonl

  evals load --base-url http://127.0.0.1:30000 --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4 --out load/mxfp4 \
      --reference-base-url http://127.0.0.1:30001 --reference-model glm-5-fp8 --reference-out load/fp8

exit codes: 0 done; 2 bad input; 3 the run could not finish (evals run: finished units are kept, rerun
with --resume; evals load: nothing could be measured, the server is down or every request failed);
130 interrupted (Ctrl-C; evals run: rerun with --resume)"""


def _parser(prog: str, description: str, epilog: str, commands) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        command.register(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return _parser("gate", "Pre-release checks for quantized checkpoints.", GATE_EPILOG, GATE_COMMANDS)


def build_evals_parser() -> argparse.ArgumentParser:
    return _parser("evals", "Benchmark runs that the accuracy gate can pair.", EVALS_EPILOG, EVALS_COMMANDS)


def _dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except QuantgateError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"{parser.prog}: error: {parser.prog} {args.command} needs the [{extra}] extra ({exc.name} is not "
              f"installed): pip install 'quantgate[{extra}]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # a file or folder the command was pointed at: the input, not a crash
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{parser.prog}: error: {where}{exc.strerror or exc}; check the path and its permissions",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; finished work is kept (evals run: rerun with --resume)", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except QuantgateError as exc:  # a table the flags' choices are read from (the GPUs) is unusable
        print(f"gate: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return _dispatch(parser, argv)


def evals_main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("evals").setLevel(logging.INFO)  # our progress lines; lm-eval's own INFO stays quiet
    return _dispatch(build_evals_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
