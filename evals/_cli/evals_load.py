"""``evals load``: a serving-load sweep (guidellm, constant rates) into a load bundle for ``gate load``."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from evals.errors import EXIT_PASS, BadInput, RunFailed


def register(sub) -> None:
    from evals.load import DEFAULT_RATES

    p = sub.add_parser("load", help="serving-load sweep (guidellm, constant rates) into a load bundle for gate load",
                       description="One guidellm run per constant request rate with the Wafer write-up's workload, until a "
                                   "rate breaks the TTFT SLO. Default workload: 20000 prompt tokens of which 60% "
                                   "are one shared prefix (prefix-cache hits), 1000 output tokens.")
    p.add_argument("--base-url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="served model name (must be in the server's /v1/models)")
    p.add_argument("--tokenizer", required=True, help="tokenizer path or id: prompts are sized in its tokens")
    p.add_argument("--out", type=Path, required=True, help="load bundle folder (load.json, rates/)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES),
                   help="comma list of offered request rates per second, swept upwards (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=300, help="seconds per rate (default %(default)s)")
    p.add_argument("--max-requests", type=int, help="also end a rate after this many requests, all of them finished")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT p95 SLO in seconds (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=20000,
                   help="prompt tokens per request, prefix included (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=1000, help="output tokens per request (default %(default)s)")
    p.add_argument("--prefix-hit", type=float, default=0.6,
                   help="share of each prompt that is one prefix common to all requests (default %(default)s)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions", help="endpoint flavour")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it, e.g. transformers serve): "
                        "output tokens become a cap, not a fixed length")
    p.add_argument("--all-rates", action="store_true", help="keep sweeping after a rate breaks the SLO")
    p.add_argument("--dry-run", action="store_true", help="print the guidellm scenario of the first rate; send nothing")
    p.add_argument("--json", action="store_true", help="print load.json instead of the table")
    p.set_defaults(func=run)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from evals.load import LoadError, LoadSpec, Workload, human, rate_folder, run_load, scenario

    try:
        rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
        if not rates or min(rates) <= 0:
            raise ValueError
    except ValueError:
        raise BadInput(f"--rates {args.rates!r}: expected positive numbers, e.g. 0.5,1,2") from None
    try:
        workload = Workload(args.prompt_tokens, args.output_tokens, args.prefix_hit, args.ignore_eos, args.api)
        spec = LoadSpec(args.base_url, args.model, args.tokenizer, args.out, workload, rates, args.max_seconds,
                        args.max_requests, args.ttft_slo, stop_at_knee=not args.all_rates)
        signal.signal(signal.SIGTERM, _interrupt)  # a killed sweep still ends with what it measured
        if args.dry_run:
            report = rate_folder(args.out, rates[0]) / "guidellm-report.partial.json"
            print(json.dumps({"rates": rates, "scenario": scenario(spec, rates[0], report)}, indent=2))
            return EXIT_PASS
        bundle = run_load(spec)
    except LoadError as exc:  # nothing could be measured: the server is down or every request failed
        raise RunFailed(f"could not finish: {exc}") from None
    except ValueError as exc:  # the load module's own input checks
        raise BadInput(str(exc)) from None
    print(json.dumps(bundle, indent=2) if args.json else human(bundle))
    return EXIT_PASS
