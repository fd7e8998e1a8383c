"""``evals`` (data import, benchmark runs into bundles) and ``gate`` (release checks: ``gate
checkpoint`` proves a checkpoint loads correctly in sglang and vLLM before anyone starts a server)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from quant import kernels
from quant.engines import UnknownEngine

if TYPE_CHECKING:  # quant.verify loads torch: only commands that check a checkpoint import it
    from quant.verify import Report

EXIT_OK, EXIT_BLOCK, EXIT_BAD_INPUT, EXIT_UNFINISHED = 0, 1, 2, 3

CHECKPOINT_HELP = """\
Replay sglang's and vLLM's loading rules on a quantized checkpoint (Quark MXFP4/MXFP6 or block
FP8), from headers and config alone: layout (every quantized weight has a fitting scale, index and
shards agree, tokenizer present), config (the Quark schema, router keys, MTP layer count), and per
engine release the module each tensor loads into (fused gate_up_proj / fused_qkv_a_proj*, the
FusedMoE ...mlp.experts, sglang's model.decoder.* names for the MTP draft) with that release's
exclude matching, compared with the dtypes on disk. The rules are data read from each release's
source (manifests/engines/*.yaml, with file and function); --list-engines shows them.

  gate checkpoint DIR                         every known release of both engines
  gate checkpoint DIR --engine sglang         every known sglang release, reported per rule set
  gate checkpoint DIR --engine sglang==0.5.23 the one rule set covering that release

exit codes: 0 loads correctly in every engine asked for; 1 it would not (or would load wrong);
2 the input is unreadable or not a checkpoint"""


ACCURACY_HELP = """\
Compare a candidate run with a reference run question by question. Per benchmark: both scores
with n and a 95% interval, the paired delta, one-sided paired-bootstrap bounds (items resampled;
repeats averaged per item; tau2 resampled within domains, macro = mean of domain deltas), exact
McNemar p for single-repeat binary scores, and a verdict against the policy's margin:
PASS (lower bound > -margin), FAIL (upper bound < -margin, or an absolute floor broken),
INCONCLUSIVE (anything else; says how many items would decide it).

exit codes: 0 PASS; 1 FAIL or a blocking INCONCLUSIVE; 2 bad input (bundles that do not pair:
different items, documents, data files or filters)"""

LOAD_HELP = """\
Compare two load sweeps (evals load) at the TTFT SLO. Knee of a sweep: the last offered rate that
meets the SLO (TTFT p95 <= SLO, success >= min) before the first that breaks it, read as its
achieved RPS and output tok/s. PASS when the candidate's RPS and tok/s are both >= (1 - margin)
times the reference's; FAIL below; INCONCLUSIVE when a sweep does not bracket its knee (every rate
met the SLO, or the lowest already broke it: the output says which rates to add).

exit codes: 0 PASS; 1 FAIL; 2 INCONCLUSIVE or bad input (bundles of different workloads)"""

RELEASE_HELP = """\
gate checkpoint + gate accuracy (+ gate load with --load-candidate/--load-reference) in one
verdict; writes report.md and report.json.

exit codes: 0 release; 1 block; 2 bad input"""


def _margins(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        bench, _, value = item.partition("=")
        try:
            out[bench] = float(value)
        except ValueError:
            raise SystemExit(f"gate: --margin {item!r}: expected BENCH=VALUE, e.g. gsm8k=0.02") from None
    return out


def human_accuracy(result: dict) -> str:
    lines = [f"{'eval':<14} {'n':>5} {'reference':>22} {'candidate':>22} {'delta':>8} {'bounds':>19} "
             f"{'margin':>7}  verdict"]
    for b in result["benchmarks"]:
        ref, cand = b["reference"], b["candidate"]
        name = "tau2 macro" if b["benchmark"] == "tau2" else b["benchmark"]
        lines.append(f"{name:<14} {b['n_items']:>5} {ref['score']:.4f} [{ref['ci_low']:.3f},{ref['ci_high']:.3f}] "
                     f"{cand['score']:.4f} [{cand['ci_low']:.3f},{cand['ci_high']:.3f}] {b['delta']:+.4f} "
                     f"[{b['lower']:+.3f},{b['upper']:+.3f}] {-b['margin']:+.3f}  {b['verdict']}")
        if b["benchmark"] == "tau2":
            for domain, d in (b["per_stratum"] or {}).items():
                (rl, rh), (cl, ch) = d["reference_ci"], d["candidate_ci"]
                lines.append(f"  {domain:<12} {d['n']:>5} {d['reference']:.4f} [{rl:.3f},{rh:.3f}] "
                             f"{d['candidate']:.4f} [{cl:.3f},{ch:.3f}] {d['delta']:+.4f} "
                             f"[{d['lower']:+.3f},{d['upper']:+.3f}]")
        notes = [b["rule"]]
        if b["mcnemar_p"] is not None:
            notes.append(f"b={b['discordant_ref_only']} c={b['discordant_cand_only']} McNemar p={b['mcnemar_p']:.4f}")
        if b["items_to_decide"]:
            notes.append(f"~{b['items_to_decide']} items would decide it")
        if b["noise"]:
            notes.append("within noise of the reference rerun" if b["noise"]["within_noise"] else "beyond noise")
        if b.get("infra"):
            notes.append("infrastructure errors: " + ", ".join(
                f"{arm} {c['errors']}/{c['simulations']}" for arm, c in b["infra"].items()))
        lines.append("               " + "; ".join(notes))
    lines.append("scores: mean over items with a 95% Wilson interval (tau2: macro = mean of per-domain pass^1, 95% "
                 "interval resampling tasks within domains); bounds: one-sided paired bootstrap at the policy's "
                 "confidence")
    for u in result.get("unpaired") or []:
        lines.append(f"UNPAIRED vs published {u['benchmark']}: {u['candidate']:.4f} vs {u['reference']:.4f}, delta "
                     f"{u['delta']:+.4f}" + (f", 95% CI [{u['ci95'][0]:+.3f}, {u['ci95'][1]:+.3f}]"
                                             if u["se"] == u["se"] else "") + " (summary scores only: weaker)")
    each = ", ".join(f"{b['benchmark']} {b['verdict']}" + ("" if b["required"] else " (optional)")
                     for b in result["benchmarks"])
    lines.append(f"verdict: {result['verdict']} [{each}]"
                 + (f" ({'; '.join(result['blocking'])})" if result["blocking"] else ""))
    return "\n".join(lines)


def load_args(p, prefix: str) -> None:
    p.add_argument(f"--{prefix}margin", type=float, default=0.05,
                   help="the candidate may sustain this fraction less load than the reference (default 0.05)")
    p.add_argument(f"--{prefix}ttft-slo", type=float, help="TTFT p95 SLO in seconds (default: the one the sweeps used)")
    p.add_argument(f"--{prefix}min-success", type=float, help="least success fraction within the SLO (default: the "
                                                               "sweep's, 0.99)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gate", description="Pre-release checks for quantized checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("checkpoint", help="prove a checkpoint loads correctly in sglang and vLLM",
                           description=CHECKPOINT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("dir", type=Path, nargs="?", help="checkpoint folder (config.json, shards, index)")
    check.add_argument("--engine", default="all", metavar="ENGINE[==VERSION]",
                       help="all (default), sglang, vllm, or one release such as sglang==0.5.23")
    check.add_argument("--list-engines", action="store_true",
                       help="list the engine releases whose rules are known, with each rule's source, and exit")
    check.add_argument("--deep", action="store_true",
                       help="also read tensor data: scale bytes in range, no all-zero scale rows, no NaN/Inf in bf16")
    check.add_argument("--json", action="store_true", help="machine-readable report on stdout")

    def accuracy_args(p):
        p.add_argument("--candidate", type=Path, required=True, help="candidate run bundle (evals run)")
        p.add_argument("--reference", type=Path, required=True, help="reference run bundle, same items and settings")
        p.add_argument("--reference-rerun", type=Path, help="a second reference run: its self-discordance is the "
                                                            "noise floor the candidate is judged against")
        p.add_argument("--policy", type=Path, help="gate policy YAML (default: manifests/gates/release.yaml)")
        p.add_argument("--margin", action="append", default=[], metavar="BENCH=VALUE",
                       help="override a benchmark's non-inferiority margin, e.g. gsm8k=0.03")
        p.add_argument("--json", action="store_true", help="machine-readable result on stdout")

    acc = sub.add_parser("accuracy", help="paired, noise-aware accuracy verdict: candidate vs reference runs",
                         description=ACCURACY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    accuracy_args(acc)
    acc.add_argument("--reference-table", type=Path,
                     help="published summary scores (manifests/references/...): adds an UNPAIRED, weaker comparison")
    load = sub.add_parser("load", help="serving load: knee RPS and tok/s at the TTFT SLO, candidate vs reference",
                          description=LOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    load.add_argument("--candidate", type=Path, required=True, help="candidate load bundle (evals load)")
    load.add_argument("--reference", type=Path, required=True, help="reference load bundle, same workload")
    load_args(load, prefix="")
    load.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    rel = sub.add_parser("release", help="gate checkpoint + gate accuracy: one verdict, report.md and report.json",
                         description=RELEASE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    rel.add_argument("checkpoint", type=Path, help="the quantized checkpoint folder")
    accuracy_args(rel)
    rel.add_argument("--load-candidate", type=Path, help="candidate load bundle: the release also needs gate load")
    rel.add_argument("--load-reference", type=Path, help="reference load bundle for --load-candidate")
    load_args(rel, prefix="load-")
    rel.add_argument("--report-dir", type=Path, help="where report.md/report.json go (default: beside the candidate run)")
    rel.add_argument("--plots", type=Path, metavar="DIR",
                     help="also write the dashboard's figures (PNG) and an HTML page with tables and figures to DIR")
    kernels.add_arguments(rel, release=True)
    kern = sub.add_parser("kernels", help="will the engine run this checkpoint's MoE on a tuned kernel (aiter, Triton)",
                          description=kernels.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels.add_arguments(kern)
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


def list_engines(spec: str, as_json: bool) -> str:
    from quant.engines import select

    rule_sets = select(spec)
    if as_json:
        return json.dumps([{"id": r.id, "engine": r.engine, "first": r.first, "last": r.last,
                            "rules": {k: {"value": r.values[k], "cite": r.cites[k]} for k in r.values}}
                           for r in rule_sets], indent=2)
    lines = []
    for r in rule_sets:
        lines.append(f"{r.id}")
        lines += [f"  {name:<20} {json.dumps(r.values[name])}\n  {'':<20} {r.cites[name]}" for name in r.values]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # first: --help and usage errors need none of the heavy imports
    from evals.bundle import BundleError
    from evals.gate import PASS, accuracy_gate, load_policy, unpaired_against_reference
    from evals.knee import INCONCLUSIVE, human as human_load, load_gate
    from evals.report import strict_json, write
    from quant.verify import UnreadableCheckpoint, verify

    try:
        if args.command == "checkpoint" and args.list_engines:
            print(list_engines(args.engine, args.json))
            return EXIT_OK
        if args.command == "checkpoint" and args.dir is None:
            print("gate checkpoint: give a checkpoint folder (or --list-engines)", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.command == "checkpoint":
            report = verify(args.dir, args.engine, args.deep)
            print(json.dumps(report.to_dict(), indent=2) if args.json else human_report(report))
            return EXIT_OK if report.ok else EXIT_BLOCK
        if args.command == "kernels":
            return kernels.run_cli(args)
        if args.command == "load":
            load = load_gate(args.candidate, args.reference, args.margin, args.ttft_slo, args.min_success)
            print(json.dumps(load, indent=2) if args.json else human_load(load))
            return {PASS: EXIT_OK, INCONCLUSIVE: EXIT_BAD_INPUT}.get(load["verdict"], EXIT_BLOCK)
        if args.command == "release" and bool(args.load_candidate) != bool(args.load_reference):
            raise BundleError("give both --load-candidate and --load-reference, or neither")
        result = accuracy_gate(args.candidate, args.reference, load_policy(args.policy), _margins(args.margin),
                               args.reference_rerun)
        if args.command == "accuracy":
            if args.reference_table:
                result["unpaired"] = unpaired_against_reference(args.candidate, args.reference_table)
            print(strict_json(result) if args.json else human_accuracy(result))
            return EXIT_OK if result["verdict"] == PASS else EXIT_BLOCK
        structure = verify(args.checkpoint, "all")
        kern = kernels.release_check(args, result["policy"])
        kernels_block = bool(kern and kern["blocking"] and not kern["ok"])
        load = load_gate(args.load_candidate, args.load_reference, args.load_margin, args.load_ttft_slo,
                         args.load_min_success) if args.load_candidate else None
        verdict = "RELEASE" if structure.ok and result["verdict"] == PASS and not kernels_block and (
            load is None or load["verdict"] == PASS) else "BLOCK"
        report = {"verdict": verdict, "checkpoint": str(args.checkpoint), "structure": structure.to_dict(),
                  "accuracy": result, "kernels": kern, "load": load}
        md, js = write(report, args.report_dir or args.candidate)
        if args.plots:
            from evals import dashboard

            dashboard.write_plots(dashboard.load(args.candidate, args.reference, args.checkpoint, js), args.plots)
        sections = [human_report(structure), human_accuracy(result)]
        if kern:
            sections.append(f"{kern['summary']} ({'BLOCKING' if kern['blocking'] else 'warning'})")
        if load:
            sections.append(human_load(load))
        sections.append(f"release verdict: {verdict}\nreport: {md} and {js}")
        print(strict_json(report) if args.json else "\n\n".join(sections))
        return EXIT_OK if verdict == "RELEASE" else EXIT_BLOCK
    except (UnreadableCheckpoint, BundleError, UnknownEngine) as exc:
        print(f"gate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


EVALS_EPILOG = """\
examples:
  evals run --benchmarks gsm8k --model /ckpt/tiny --limit 20 --out runs/try     # GSM8K ships with quantgate
  evals data --data-dir DATA --gpqa gpqa_diamond.csv                          # GPQA: you supply it (gated)
  evals run --benchmarks gsm8k,gpqa_diamond --out runs/mxfp4 --data-dir DATA \\
      --base-url http://127.0.0.1:30000/v1/completions --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4
  evals run --benchmarks gsm8k --out runs/raw --data-dir /data --model /ckpt/x   # /data/gsm8k/{train,test}.jsonl

  evals load --base-url http://127.0.0.1:30000 --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4 --out load/mxfp4

exit codes: 0 done, 1 the run failed (finished units are kept: rerun with --resume), 2 bad input,
3 (evals load) nothing could be measured: the server is down or every request failed"""


def tau2_flags(run: argparse.ArgumentParser) -> None:
    from evals.tau2_run import DOMAINS, Tau2Settings

    d = Tau2Settings(model="", api_base="", user_llm="")
    g = run.add_argument_group("tau2 (drives tau2-bench's `tau2 run` per domain against --base-url; README: tau2)")
    g.add_argument("--tau2-domains", default=",".join(DOMAINS), help="comma list of tau2 domains (default: %(default)s)")
    g.add_argument("--tau2-user-llm", help="the fixed user simulator, a litellm model name (e.g. openai/NAME for an "
                                           "OpenAI-compatible server); must be the same for both arms")
    g.add_argument("--tau2-user-llm-args", default=json.dumps(d.user_llm_args),
                   help='JSON args for the user simulator, e.g. \'{"api_base": "http://127.0.0.1:30001/v1", '
                        '"temperature": 0.0}\' (default: %(default)s)')
    g.add_argument("--tau2-trials", type=int, default=d.trials, help="trials per task (default: %(default)s)")
    g.add_argument("--tau2-max-steps", type=int, default=d.max_steps, help="step limit per simulation (default: %(default)s)")
    g.add_argument("--tau2-max-errors", type=int, default=d.max_errors,
                   help="tool errors in a row before tau2 ends a simulation (default: %(default)s)")
    g.add_argument("--tau2-seed", type=int, default=d.seed, help="tau2's run seed (default: %(default)s)")
    g.add_argument("--tau2-task-split", default=d.task_split, help="tau2 task split (default: %(default)s)")
    g.add_argument("--tau2-concurrency", type=int, default=d.concurrency,
                   help="simulations in flight per domain (tau2's max_concurrency; default: %(default)s)")
    g.add_argument("--tau2-max-retries", type=int, default=d.max_retries,
                   help="litellm retries per LLM call before a simulation counts as failed (default: %(default)s)")


def tau2_settings(args: argparse.Namespace):
    from evals.tau2 import Tau2Error
    from evals.tau2_run import Tau2Settings

    try:
        user_args = json.loads(args.tau2_user_llm_args)
    except json.JSONDecodeError as exc:
        raise Tau2Error(f"--tau2-user-llm-args is not JSON ({exc}): {args.tau2_user_llm_args!r}") from None
    return Tau2Settings(model=args.model, api_base=args.base_url.rsplit("/v1", 1)[0] + "/v1",
                        user_llm=args.tau2_user_llm, user_llm_args=user_args,
                        domains=tuple(d for d in args.tau2_domains.split(",") if d), trials=args.tau2_trials,
                        max_steps=args.tau2_max_steps, max_errors=args.tau2_max_errors, seed=args.tau2_seed,
                        num_tasks=args.limit, task_split=args.tau2_task_split, concurrency=args.tau2_concurrency,
                        max_retries=args.tau2_max_retries, agent_max_tokens=args.max_gen_toks)


def build_evals_parser() -> argparse.ArgumentParser:
    from evals.budget import DEFAULT_MAX_GEN_TOKS
    from evals.load import SEED_RATES

    parser = argparse.ArgumentParser(prog="evals", description="Benchmark runs that the accuracy gate can pair.",
                                     epilog=EVALS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="import benchmark data into a data folder, recording sha256s")
    data.add_argument("--data-dir", type=Path, required=True, help="where the prepared data goes")
    data.add_argument("--gsm8k", type=Path, metavar="DIR",
                      help="folder with GSM8K's official train.jsonl, test.jsonl; or `hub` to fetch it with datasets")
    data.add_argument("--gpqa", type=Path, metavar="FILE",
                      help="GPQA-Diamond's official CSV (you supply it: it is gated and never bundled), or `hub` to "
                           "fetch it with datasets once you have accepted its terms; the choice order is frozen "
                           "into the prepared file")
    tau2 = sub.add_parser("import-tau2", help="ingest tau2-bench results files (one per domain) into a run bundle")
    tau2.add_argument("results", type=Path, nargs="+", help="tau2 results JSON files, one per domain")
    tau2.add_argument("--out", type=Path, required=True, help="run bundle folder to create")
    run = sub.add_parser("run", help="run benchmarks against a server or a local checkpoint into a run bundle")
    run.add_argument("--benchmarks", default="gsm8k,gpqa_diamond",
                     help="comma list of gsm8k, gpqa_diamond, tau2 (tau2 drives `tau2 run` per domain; or run it "
                          "yourself and use `evals import-tau2`)")
    tau2_flags(run)
    run.add_argument("--out", type=Path, required=True, help="run bundle folder (run.json, samples.jsonl)")
    run.add_argument("--data-dir", type=Path,
                     help="benchmark data: a folder prepared by `evals data`, or GSM8K's own files "
                          "(DIR/gsm8k/{train,test}.jsonl, hashed at run time); default: the GSM8K copy shipped "
                          "with quantgate (GPQA always needs a folder from `evals data`)")
    run.add_argument("--model", required=True,
                     help="served model name (with --base-url) or a local HF checkpoint path (e.g. from quantize --to bf16)")
    run.add_argument("--base-url", help="full endpoint URL of an OpenAI-compatible server, e.g. "
                                        "http://127.0.0.1:30000/v1/completions (sglang, vLLM)")
    run.add_argument("--tokenizer", help="tokenizer path for the served model (recorded; chat template hashed)")
    run.add_argument("--api", choices=["completions", "chat"], default="completions", help="endpoint flavour")
    run.add_argument("--limit", type=int,
                     help="items per benchmark (default: the protocol's, GSM8K 200, GPQA all; tau2: tasks per domain)")
    run.add_argument("--concurrency", type=int, default=1, help="requests in flight against the server")
    run.add_argument("--max-gen-toks", type=int,
                     help=f"generation budget per answer (default: {DEFAULT_MAX_GEN_TOKS}, reasoning models need it, "
                          "capped to the model's context minus the longest prompt: a local model's config, a "
                          "server's max_model_len on /v1/models; the value used is printed and kept in run.json; given, also the tau2 agent's budget per turn)")
    run.add_argument("--seeds", help="comma list of request seeds, one repeat each (default: GSM8K 0; GPQA 0,1)")
    run.add_argument("--keep-text", action="store_true", help="also keep GPQA responses in the bundle (never commit it)")
    run.add_argument("--resume", action="store_true", help="complete an interrupted run; finished units are kept")
    load = sub.add_parser("load", help="serving-load sweep (guidellm, constant rates) into a load bundle for gate load",
                          description="One guidellm run per constant request rate with the seed's workload, until a "
                                      "rate breaks the TTFT SLO. Default workload: 20000 prompt tokens of which 60% "
                                      "are one shared prefix (prefix-cache hits), 1000 output tokens.")
    load.add_argument("--base-url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    load.add_argument("--model", required=True, help="served model name (must be in the server's /v1/models)")
    load.add_argument("--tokenizer", required=True, help="tokenizer path or id: prompts are sized in its tokens")
    load.add_argument("--out", type=Path, required=True, help="load bundle folder (load.json, rates/)")
    load.add_argument("--rates", default=",".join(f"{r:g}" for r in SEED_RATES),
                      help="comma list of offered request rates per second, swept upwards (default %(default)s)")
    load.add_argument("--max-seconds", type=float, default=300, help="seconds per rate (default %(default)s)")
    load.add_argument("--max-requests", type=int, help="also end a rate after this many requests, all of them finished")
    load.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT p95 SLO in seconds (default %(default)s)")
    load.add_argument("--prompt-tokens", type=int, default=20000,
                      help="prompt tokens per request, prefix included (default %(default)s)")
    load.add_argument("--output-tokens", type=int, default=1000, help="output tokens per request (default %(default)s)")
    load.add_argument("--prefix-hit", type=float, default=0.6,
                      help="share of each prompt that is one prefix common to all requests (default %(default)s)")
    load.add_argument("--api", choices=["completions", "chat"], default="completions", help="endpoint flavour")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="do not send ignore_eos (for servers that reject it, e.g. transformers serve): "
                           "output tokens become a cap, not a fixed length")
    load.add_argument("--all-rates", action="store_true", help="keep sweeping after a rate breaks the SLO")
    load.add_argument("--dry-run", action="store_true", help="print the guidellm scenario of the first rate; send nothing")
    load.add_argument("--json", action="store_true", help="print load.json instead of the table")
    return parser


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def load_main(args) -> int:
    from evals.load import LoadError, LoadSpec, Workload, human, rate_folder, run_load, scenario

    try:
        rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
        if not rates or min(rates) <= 0:
            raise ValueError
    except ValueError:
        print(f"evals: error: --rates {args.rates!r}: expected positive numbers, e.g. 0.5,1,2", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        workload = Workload(args.prompt_tokens, args.output_tokens, args.prefix_hit, args.ignore_eos, args.api)
        spec = LoadSpec(args.base_url, args.model, args.tokenizer, args.out, workload, rates, args.max_seconds,
                        args.max_requests, args.ttft_slo, stop_at_knee=not args.all_rates)
        signal.signal(signal.SIGTERM, _interrupt)  # a killed sweep still ends with what it measured
        if args.dry_run:
            report = rate_folder(args.out, rates[0]) / "guidellm-report.partial.json"
            print(json.dumps({"rates": rates, "scenario": scenario(spec, rates[0], report)}, indent=2))
            return EXIT_OK
        bundle = run_load(spec)
    except ValueError as exc:
        print(f"evals: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LoadError as exc:
        print(f"evals: could not finish: {exc}", file=sys.stderr)
        return EXIT_UNFINISHED
    print(json.dumps(bundle, indent=2) if args.json else human(bundle))
    return EXIT_OK


def evals_main(argv: list[str] | None = None) -> int:
    args = build_evals_parser().parse_args(argv)  # first: --help needs none of the heavy imports
    from evals.budget import BudgetError
    from evals.data import DataError, fetch_from_hub, import_gpqa, import_gsm8k
    from evals.run import PROTOCOLS, RunError, RunSpec, run
    from evals.tau2 import Tau2Error, import_tau2

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("evals").setLevel(logging.INFO)  # our progress lines; lm-eval's own INFO stays quiet
    if args.command == "load":
        return load_main(args)
    try:
        if args.command == "import-tau2":
            result = import_tau2(args.results, args.out)
            print(json.dumps(result["benchmarks"]["tau2"], indent=2))
            return EXIT_OK
        if args.command == "data":
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
            return EXIT_OK
        benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        unknown = [b for b in benchmarks if b not in PROTOCOLS and b != "tau2"]
        if "tau2" in benchmarks and not (args.base_url and args.tau2_user_llm):
            raise DataError("tau2 needs a served model (--base-url) and a fixed user simulator (--tau2-user-llm, the "
                            "same for both arms); or run `tau2 run` yourself and use `evals import-tau2`")
        if unknown:
            raise DataError(f"unknown benchmarks {unknown}; known: {sorted(PROTOCOLS)}")
        spec = RunSpec(benchmarks=benchmarks, out=args.out, data_dir=args.data_dir, model=args.model,
                       base_url=args.base_url, tokenizer=args.tokenizer, api=args.api, limit=args.limit,
                       concurrency=args.concurrency, max_gen_toks=args.max_gen_toks, keep_text=args.keep_text,
                       seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None,
                       tau2=tau2_settings(args) if "tau2" in benchmarks else None)
        result = run(spec, resume=args.resume)
        print(json.dumps({"out": str(args.out), "rows": result["rows"], "timings_s": result["timings_s"]}, indent=2))
        return EXIT_OK
    except (DataError, BudgetError, Tau2Error) as exc:
        print(f"evals: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunError as exc:
        print(f"evals: failed: {exc}", file=sys.stderr)
        return EXIT_BLOCK


if __name__ == "__main__":
    sys.exit(main())
