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
                                   "rate breaks the TTFT SLO; then bisects between the last rate that met it and "
                                   "the one that broke it, down to --refine-step. Repeated --repeats times into "
                                   "OUT/sweep-K; with --reference-base-url the reference server is swept too, "
                                   "interleaved (reference sweep 1, candidate sweep 1, reference sweep 2, ...) so "
                                   "drift on the host hits both. Default workload: 20000 prompt tokens of which 60% "
                                   "are one shared prefix (prefix-cache hits), 1000 output tokens.")
    p.add_argument("--base-url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="served model name (must be in the server's /v1/models)")
    p.add_argument("--tokenizer", required=True, help="tokenizer path or id: prompts are sized in its tokens")
    p.add_argument("--out", type=Path, required=True, help="load bundle folder (sweep-K/load.json, sweep-K/rates/)")
    p.add_argument("--repeats", type=int, default=3,
                   help="sweeps per server (default %(default)s); gate load needs at least 2 in an arm")
    p.add_argument("--refine-step", type=float, default=0.1,
                   help="bisect the knee's bracketing rates until they are this close, req/s (default %(default)s)")
    p.add_argument("--reference-base-url", help="also sweep this reference server, interleaved with --base-url")
    p.add_argument("--reference-model", help="the reference's served model name (default: --model)")
    p.add_argument("--reference-tokenizer", help="the reference's tokenizer (default: --tokenizer)")
    p.add_argument("--reference-out", type=Path, help="the reference's load bundle folder")
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
    p.add_argument("--all-rates", action="store_true",
                   help="sweep every rate in --rates, then bisect above the highest one that met the SLO")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sweep order and the guidellm scenario of the first rate; send nothing")
    p.add_argument("--json", action="store_true", help="print the sweeps' load.json instead of the tables")
    p.set_defaults(func=run)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from evals.load import LoadError, LoadSpec, Workload, human, rate_folder, run_repeats, scenario

    try:
        rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
        if not rates or min(rates) <= 0:
            raise ValueError
    except ValueError:
        raise BadInput(f"--rates {args.rates!r}: expected positive numbers, e.g. 0.5,1,2") from None
    if args.repeats < 1 or args.refine_step <= 0 or args.ttft_slo <= 0:
        raise BadInput(f"--repeats {args.repeats} / --refine-step {args.refine_step:g} / --ttft-slo {args.ttft_slo:g}: "
                       "expected >= 1, > 0 and > 0")
    if bool(args.reference_base_url) != bool(args.reference_out):
        raise BadInput("give both --reference-base-url and --reference-out, or neither")
    try:
        workload = Workload(args.prompt_tokens, args.output_tokens, args.prefix_hit, args.ignore_eos, args.api)
        spec = LoadSpec(args.base_url, args.model, args.tokenizer, args.out, workload, rates, args.max_seconds,
                        args.max_requests, args.ttft_slo, stop_at_knee=not args.all_rates,
                        refine_step=args.refine_step)
        specs = {"candidate": spec}
        if args.reference_base_url:  # the reference first: A B A B with A the reference
            specs = {"reference": replace(spec, base_url=args.reference_base_url, out=args.reference_out,
                                          model=args.reference_model or args.model,
                                          tokenizer=args.reference_tokenizer or args.tokenizer), **specs}
        signal.signal(signal.SIGTERM, _interrupt)  # a killed sweep still ends with what it measured
        if args.dry_run:
            order = [f"{name} sweep {k}: {s.out / f'sweep-{k}'}" for k in range(1, args.repeats + 1)
                     for name, s in specs.items()]
            report = rate_folder(args.out / "sweep-1", rates[0]) / "guidellm-report.partial.json"
            print(json.dumps({"rates": rates, "refine_step": args.refine_step, "order": order,
                              "scenario": scenario(spec, rates[0], report)}, indent=2))
            return EXIT_PASS
        sweeps = run_repeats(specs, args.repeats)
    except LoadError as exc:  # nothing could be measured: the server is down or every request failed
        raise RunFailed(f"could not finish: {exc}") from None
    except ValueError as exc:  # the load module's own input checks
        raise BadInput(str(exc)) from None
    if args.json:
        print(json.dumps(sweeps, indent=2))
    else:
        print("\n\n".join(f"{name} sweep {k}:\n{human(b)}" for name, bundles in sweeps.items()
                          for k, b in enumerate(bundles, 1)))
        if "reference" in specs:
            print(f"\ncompare: gate load --candidate {args.out} --reference {args.reference_out}")
    return EXIT_PASS
