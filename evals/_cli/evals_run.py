"""``evals run``: benchmarks against a server or a local checkpoint, into a run bundle."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from evals.errors import EXIT_PASS, BadInput

HELP = """\
Run benchmarks with lm-eval (GSM8K, GPQA-Diamond; tau2 through tau2-bench) against an
OpenAI-compatible server (--base-url, --model the served name) or a local checkpoint folder
(--model DIR; MXFP4 / MXFP6 / FP8 checkpoints are evaluated as the engines serve them), and write
a run bundle: run.json (provenance, settings, scores) and samples.jsonl (one row per item x repeat
x scoring filter), which `gate accuracy` pairs with a reference bundle question by question.

Protocols default to the Wafer write-up's: GSM8K first 200 test questions, 5-shot, greedy;
GPQA-Diamond 198 questions, temperature 1.0, two repeats that differ only in the request seed.
GSM8K ships with quantgate; GPQA-Diamond is gated: prepare it once with `evals data --gpqa`.
The model is checked first (the folder exists and holds a tokenizer, or the server answers on
/v1/models and serves it), so a typo costs nothing and leaves nothing behind.

examples:
  evals run --benchmarks gsm8k --limit 20 --model ex/bf16 --out runs/bf16
  evals run --benchmarks gsm8k,gpqa_diamond --data-dir DATA --base-url http://127.0.0.1:30000 \\
      --model glm-5-mxfp4 --tokenizer /ckpt/GLM-5-mxfp4 --checkpoint /ckpt/GLM-5-mxfp4 --out runs/mxfp4

OUT is this run's alone: one evals run at a time (OUT/.quantgate.lock), task YAMLs written into
OUT/tasks/, a folder it creates itself, and never read back (sha256s in run.json).

exit codes: 0 done (the scores are printed); 2 bad input (a missing folder, an unknown benchmark,
a model the server does not serve, a number below 1, a --base-url without http://, OUT written by
another run, ...); 3 the run could not finish (no server, a dead server:
finished units are kept, rerun with --resume)"""


def register(sub) -> None:
    from evals.budget import DEFAULT_MAX_GEN_TOKS
    from evals.run import DEFAULT_REQUEST_TIMEOUT_S, LOCAL_BATCH_SIZE, LOCAL_CPU_THREADS

    p = sub.add_parser("run", help="run benchmarks against a server or a local checkpoint into a run bundle",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--benchmarks", default="gsm8k,gpqa_diamond",
                   help="comma list of gsm8k, gpqa_diamond, arith (the built-in example's), tau2 (tau2 drives "
                        "`tau2 run` per domain; or run it yourself and use `evals import-tau2`)")
    tau2_flags(p)
    p.add_argument("--out", type=Path, required=True,
                   help="run bundle folder (run.json, samples.jsonl; tasks/ holds the task YAMLs lm-eval ran, written "
                        "for the run, sha256s in run.json); one evals run at a time writes it (OUT/.quantgate.lock)")
    p.add_argument("--data-dir", type=Path,
                   help="benchmark data: a folder prepared by `evals data`, or GSM8K's own files "
                        "(DIR/gsm8k/{train,test}.jsonl, hashed at run time); default: the GSM8K copy shipped "
                        "with quantgate (GPQA always needs a folder from `evals data`)")
    p.add_argument("--model", required=True,
                   help="served model name (with --base-url), or a local HF checkpoint folder: bf16, or MXFP4 / MXFP6 "
                        "(Quark) or block FP8 evaluated as served (weights decoded exactly, each quantized "
                        "module's input activations quantize-dequantized as the engines do; run.json records it)")
    p.add_argument("--base-url", help="the OpenAI-compatible server (sglang, vLLM), as for `evals load`: its root "
                                      "http://127.0.0.1:30000, or .../v1, or the full endpoint .../v1/completions "
                                      "(.../v1/chat/completions with --api chat), with its scheme (a bare "
                                      "127.0.0.1:30000 is refused: say http:// or https://); checked on /v1/models "
                                      "first")
    p.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="with --base-url: the quantgate checkpoint folder the server serves; its shards are hashed "
                        "against its conversion_manifest.json and their identity recorded in run.json "
                        "(checkpoint_sha256, as a local --model's is), so `gate release` can check it is the "
                        "checkpoint being released")
    p.add_argument("--tokenizer", help="tokenizer path for the served model (recorded; chat template hashed)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions", help="endpoint flavour")
    p.add_argument("--limit", type=int,
                   help="items per benchmark, at least 1 (default: the protocol's, GSM8K 200, GPQA all; tau2: tasks "
                        "per domain)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight against the server (at least 1)")
    p.add_argument("--max-gen-toks", type=int,
                   help=f"generation budget per answer, at least 1 (default: {DEFAULT_MAX_GEN_TOKS}, reasoning models "
                        "need it, "
                        "capped to the model's context minus the longest prompt: a local model's config, a "
                        "server's max_model_len on /v1/models; the value used is printed and kept in run.json; given, also "
                        "the tau2 agent's budget per turn)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="SECONDS",
                   help=f"per-request timeout against the server, a positive number (default "
                        f"{DEFAULT_REQUEST_TIMEOUT_S}; recorded; 0, a negative, inf or nan is refused: there is no "
                        "'no limit'). Long budgets on a slow server need more: a timed-out answer is generated again")
    p.add_argument("--seeds", help="comma list of distinct request seeds (whole numbers 0..2^32-1), one repeat each "
                                   "(default: GSM8K 0; GPQA 0,1)")
    p.add_argument("--keep-text", action="store_true", help="also keep GPQA responses in the bundle (never commit it)")
    p.add_argument("--resume", action="store_true",
                   help="complete an interrupted run: finished units recorded with the same settings, model and "
                        "data sha256s are kept; units that no longer match are redone (run.json lists them). A "
                        "finished bundle is only ever added to: another model or settings there is refused and the "
                        "bundle kept")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="local checkpoint only: where it runs (default cuda when present, else cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="local checkpoint only: compute dtype (default bfloat16, what sglang and vLLM compute in, on "
                        "cpu too; float32 moves a tiny model about as far as MXFP4 does, so runs of different "
                        "dtypes are never paired; recorded in run.json)")
    p.add_argument("--activations", choices=["bf16"],
                   help="local checkpoint only, where its config names no activation scheme (gpt-oss's own MXFP4, "
                        "quant_method mxfp4): evaluate it with bf16 activations, W4A16, as vLLM serves it on every "
                        "GPU and sglang on SM90 (sglang runs MXFP8 activations on SM100/SM120); without it such a "
                        "checkpoint is refused. Recorded in run.json")
    p.add_argument("--batch-size", type=int, default=LOCAL_BATCH_SIZE, metavar="N",
                   help=f"local checkpoint only: prompts generated together, greedy and KV-cached (default "
                        f"{LOCAL_BATCH_SIZE}); the answers do not depend on it, only the speed")
    p.add_argument("--threads", type=int, metavar="N",
                   help=f"local checkpoint on cpu only: torch threads (default {LOCAL_CPU_THREADS}: a small model is "
                        "Python-bound, and extra threads spin on a shared machine)")
    g = p.add_argument_group("a planned run (`gate plan`; README: Planning a release run)")
    g.add_argument("--plan", type=Path, help="a plan written by `gate plan --out`: its items and seeds per benchmark "
                                             "(instead of --limit/--seeds); run.json records it and the gate judges the "
                                             "run at the plan's looks")
    g.add_argument("--until-decided", action="store_true",
                   help="with --plan and --reference: run look by look (the plan's repeats), judge each with the gate "
                        "and stop once every benchmark is PASS or FAIL, or at the plan's last look; each look is "
                        "printed and kept in OUT/looks.json; exit 0 PASS, 1 FAIL or INCONCLUSIVE")
    g.add_argument("--reference", type=Path, help="the reference bundle, run with the same --plan (all its repeats)")
    g.add_argument("--policy", help="gate policy for --until-decided: a path (./my-policy.yaml), or a shipped one by "
                                     "name (release, arith-example; default: release)")
    p.add_argument("--json", action="store_true", help="machine-readable summary on stdout (scores, rows, timings)")
    p.set_defaults(func=run)


def tau2_flags(run: argparse.ArgumentParser) -> None:
    from evals.tau2_run import DOMAINS, MAX_RETRIES, Tau2Settings

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
                   help=f"litellm retries per LLM call before a simulation counts as failed (default: %(default)s; "
                        f"0 to {MAX_RETRIES})")
    g.add_argument("--tau2-infra-retries", type=int, default=d.infra_retries,
                   help="times a simulation that ended in an infrastructure error (a dropped connection, a server or "
                        "user-simulator failure) is run again before the run finishes; each retry is recorded per "
                        f"task (default: %(default)s; 0 to {MAX_RETRIES})")


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
                        num_tasks=args.limit if args.limit is not None else getattr(args, "planned_tau2_tasks", None),
                        task_split=args.tau2_task_split, concurrency=args.tau2_concurrency,
                        max_retries=args.tau2_max_retries, infra_retries=args.tau2_infra_retries,
                        agent_max_tokens=args.max_gen_toks)


def endpoint_url(base_url: str, api: str) -> str:
    """The full endpoint for ``api`` from any URL form users paste (root, /v1 or the endpoint itself)."""
    from evals.data import DataError
    from evals.load import server_root

    want = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    given = base_url.rstrip("/")
    other = "/v1/completions" if api == "chat" else "/v1/chat/completions"
    if given.endswith(other):
        raise DataError(f"--base-url {base_url} is the {other} endpoint but --api is {api}: give the server root "
                        f"or {want}")
    return server_root(given) + want


SEED_MAX = 2**32 - 1  # numpy's seed range (simple_evaluate's numpy_random_seed)


def _at_least(flag: str, value, low: int) -> None:
    if value is not None and value < low:
        raise BadInput(f"{flag} {value}: give a whole number of at least {low}")


def seeds_of(text: str | None) -> list[int] | None:
    """``--seeds``: distinct whole numbers in numpy's seed range (a repeated seed repeats a repeat)."""
    if not text:
        return None
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise BadInput(f"--seeds {text!r}: expected a comma list of integers, e.g. 0,1") from None
    if any(not 0 <= s <= SEED_MAX for s in seeds):
        raise BadInput(f"--seeds {text!r}: each seed is a whole number from 0 to {SEED_MAX}")
    if len(set(seeds)) != len(seeds):
        raise BadInput(f"--seeds {text!r}: a seed is repeated; each repeat needs its own seed, e.g. 0,1")
    return seeds


def check_flags(args: argparse.Namespace) -> None:
    """Degenerate numbers and a URL without its scheme are bad input, refused before anything runs."""
    from urllib.parse import urlsplit

    for flag, value, low in (("--limit", args.limit, 1), ("--max-gen-toks", args.max_gen_toks, 1),
                             ("--concurrency", args.concurrency, 1), ("--tau2-trials", args.tau2_trials, 1),
                             ("--tau2-max-steps", args.tau2_max_steps, 1), ("--tau2-max-errors", args.tau2_max_errors, 1),
                             ("--tau2-concurrency", args.tau2_concurrency, 1),
                             ("--tau2-max-retries", args.tau2_max_retries, 0),
                             ("--tau2-infra-retries", args.tau2_infra_retries, 0)):
        _at_least(flag, value, low)
    from evals.tau2_run import MAX_RETRIES

    for flag, value in (("--tau2-max-retries", args.tau2_max_retries),
                        ("--tau2-infra-retries", args.tau2_infra_retries)):
        if value > MAX_RETRIES:
            raise BadInput(f"{flag} {value}: at most {MAX_RETRIES} (more only keep a run against a failing server from "
                           "finishing; errors that outlive them are the serving's: fix it, then --resume)")
    if not (math.isfinite(args.request_timeout) and args.request_timeout > 0):
        raise BadInput(f"--request-timeout {args.request_timeout}: must be a positive finite number of seconds "
                       "(0 does not mean no limit), e.g. 600")
    if args.base_url is not None:
        url = urlsplit(args.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise BadInput(f"--base-url {args.base_url!r}: give the server's URL with its scheme, e.g. "
                           f"http://{args.base_url.split('://')[-1].lstrip('/')}")
    if args.checkpoint is not None:
        if not args.base_url:
            raise BadInput("--checkpoint is for a served model (--base-url); a local --model folder is hashed itself")
        if not args.checkpoint.is_dir():
            raise BadInput(f"--checkpoint {args.checkpoint}: no such folder; give the checkpoint folder the server "
                           "serves")
        from evals.run import served_checkpoint_sha256

        served_checkpoint_sha256(args.checkpoint, verify=False)  # before anything runs; the run hashes the shards


def check_model(args: argparse.Namespace) -> None:
    """Before anything is built or written: the local folder exists, or the server answers and serves it."""
    from evals.data import DataError
    from evals.load import LoadError, server_root, served_models
    from evals.run import RunError

    if not args.base_url:
        folder = Path(args.model)
        if not folder.is_dir():
            raise DataError(f"{args.model}: no such folder; --model is a local checkpoint folder (or, with "
                            "--base-url, the name a server serves)")
        if not (folder / "config.json").is_file():
            raise DataError(f"{folder}: no config.json; --model needs a Hugging Face checkpoint folder "
                            "(e.g. one written by `quantize`)")
        return
    root = server_root(args.base_url)
    try:
        served = served_models(root)
    except LoadError as exc:
        if not _listening(root):
            raise RunError(f"{exc}; nothing was written: start the server or fix --base-url") from None
        served = []  # up, but lists no models: its first request will say whether it serves this one
    if served and args.model not in served:
        raise DataError(f"--model {args.model!r} is not served at {root} (it serves {served}); nothing was written")


def _listening(root: str) -> bool:
    """Whether anything accepts a connection at the URL's host and port."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(root)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5):
            return True
    except (OSError, ValueError):
        return False


def run(args: argparse.Namespace) -> int:
    from evals.data import DataError
    from evals.run import LOCAL_BATCH_SIZE, PROTOCOLS, RunSpec
    from evals.run import run as run_benchmarks

    check_flags(args)  # before anything is read, loaded or asked of a server
    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in benchmarks if b not in PROTOCOLS and b != "tau2"]
    if "tau2" in benchmarks and not (args.base_url and args.tau2_user_llm):
        raise DataError("tau2 needs a served model (--base-url) and a fixed user simulator (--tau2-user-llm, the "
                        "same for both arms); or run `tau2 run` yourself and use `evals import-tau2`")
    if unknown:
        raise DataError(f"unknown benchmarks {unknown}; known: {sorted(PROTOCOLS)}")
    seeds = seeds_of(args.seeds)
    if args.base_url and (args.device or args.dtype or args.activations or args.threads
                          or args.batch_size != LOCAL_BATCH_SIZE):
        raise DataError("--device/--dtype/--activations/--batch-size/--threads apply to a local checkpoint; with "
                        "--base-url the server decides (--concurrency sets the requests in flight)")
    if args.batch_size < 1 or (args.threads is not None and args.threads < 1):
        raise DataError(f"--batch-size {args.batch_size} / --threads {args.threads}: give a whole number >= 1")
    if args.base_url and any(b != "tau2" for b in benchmarks):  # lm-eval's endpoint; tau2 takes the server's /v1
        args.base_url = endpoint_url(args.base_url, args.api)
    plan = _plan(args, benchmarks)  # a plan no run can follow is refused before any server is asked
    check_model(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DataError("--device cuda: no CUDA device is visible here; use --device cpu")
    spec = RunSpec(benchmarks=benchmarks, out=args.out, data_dir=args.data_dir, model=args.model,
                   base_url=args.base_url, tokenizer=args.tokenizer, api=args.api, limit=args.limit,
                   concurrency=args.concurrency, max_gen_toks=args.max_gen_toks, keep_text=args.keep_text,
                   request_timeout=args.request_timeout, seeds=seeds,
                   tau2=tau2_settings(args) if "tau2" in benchmarks else None, device=args.device, dtype=args.dtype,
                   activations=args.activations, batch_size=args.batch_size, threads=args.threads, plan=plan,
                   checkpoint=args.checkpoint)
    if args.until_decided:
        return _until_decided(args, spec)
    result = run_benchmarks(spec, resume=args.resume)
    if args.json:
        print(json.dumps({"out": str(args.out), "scores": result["scores"], "rows": result["rows"],
                          "timings_s": result["timings_s"], "redone_on_resume": result.get("redone_on_resume")},
                         indent=2))
    else:
        print(human_summary(args.out, result))
    return EXIT_PASS


def _plan(args: argparse.Namespace, benchmarks: list[str]) -> dict | None:
    """The plan of ``--plan``, checked against the other flags (it fixes items, seeds, tau2 trials)."""
    from evals.errors import BadInput
    from evals.judge.plan_file import read_plan

    if (args.until_decided or args.reference) and not (args.plan and args.until_decided and args.reference):
        raise BadInput("--until-decided needs --plan PLAN and --reference REF (and --reference is only for it)")
    if not args.plan:
        return None
    plan = read_plan(args.plan)
    missing = [b for b in benchmarks if b not in plan["benchmarks"]]
    if missing:
        raise BadInput(f"--plan {args.plan}: plans {sorted(plan['benchmarks'])}, not {missing}; plan them with `gate plan`")
    if args.limit is not None or args.seeds:
        raise BadInput(f"--plan {args.plan} fixes items and seeds per benchmark; drop --limit/--seeds")
    if "tau2" in benchmarks:  # set before the tau2 settings are built; a count no run has is refused here
        from evals.judge.design import tau2_tasks_per_domain

        args.tau2_trials = plan["benchmarks"]["tau2"]["repeats"]  # looks run a prefix of them (--until-decided)
        domains = tuple(d for d in args.tau2_domains.split(",") if d)
        args.planned_tau2_tasks = tau2_tasks_per_domain(plan["benchmarks"]["tau2"]["items"], domains)
    return plan


def _until_decided(args: argparse.Namespace, spec) -> int:
    from evals.bundle import read_bundle
    from evals.errors import EXIT_BLOCK
    from evals.judge.gate import PASS
    from evals.judge.policy import load_policy
    from evals.until_decided import render, run_until_decided

    read_bundle(args.reference)  # a bad reference is refused before any model runs
    result = run_until_decided(spec, args.reference, load_policy(args.policy), args.resume)
    print(render(result))
    print(json.dumps({"out": str(args.out), "verdict": result["accuracy"]["verdict"],
                      "looks": len(result["looks"]), "blocking": result["accuracy"]["blocking"]}, indent=2))
    return EXIT_PASS if result["accuracy"]["verdict"] == PASS else EXIT_BLOCK
def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def human_summary(out: Path, result: dict) -> str:
    """Each benchmark's score with its n and 95% interval, then what the bundle holds."""
    lines = []
    for bench, s in result["scores"].items():
        lines.append(f"{bench:<14} {100 * s['score']:5.1f}%  (95% CI {100 * s['ci_low']:.1f}-{100 * s['ci_high']:.1f}%; "
                     f"{_count(s['items'], 'item')} x {_count(s['repeats'], 'repeat')}, filter {s['filter']})")
    shape = " + ".join(f"{s['rows']} {b} ({_count(s['items'], 'item')} x {_count(s['repeats'], 'repeat')} x "
                       f"{_count(s['filters'], 'scoring filter')})" for b, s in result["scores"].items())
    lines.append(f"wrote {out}: run.json and samples.jsonl, {result['rows']} rows = {shape}")
    if result.get("redone_on_resume"):
        lines.append(f"redone on resume: {', '.join(result['redone_on_resume'])}")
    lines.append(f"compare it: gate accuracy --candidate {out} --reference REFERENCE_BUNDLE")
    return "\n".join(lines)
