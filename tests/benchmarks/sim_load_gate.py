"""How often `gate load` fails a server against itself, and how often it catches one with less capacity.

    nice -n 10 python -m tests.benchmarks.sim_load_gate [--trials 1000] [--sweeps 3] [--cap-noise 0.03]

A simulated server: capacity C req/s, drawn afresh for every sweep around its nominal value
(lognormal, --cap-noise: run-to-run drift of the host and the engine). At offered rate r the load
is rho = r / C, the achieved RPS min(r, C) (1% noise) and the true TTFT p95 t0 / (1 - rho) (an
M/M/1-like queue, t0 = 0.5 s), times a per-rate lognormal factor (--p95-noise); each request's
TTFT is exponential with that p95, r x --seconds requests per rate, and the row's p95 is taken
from them as guidellm takes it. Nominal C = 2.67 req/s puts the knee at TTFT p95 <= 5 s near the
Wafer write-up's 2.4 RPS. Every sweep runs the real rate planner of `evals load`
(``evals.load.next_rate``: the default grid until a rate breaks the SLO, then bisection to 0.1 req/s)
and every trial the real ``load_gate`` (bootstrap included) on bundles written to disk.
Prints the rate of each verdict per scenario. Not a test: the statistics experiment behind the
README's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from evals.errors import Refused
from evals.judge.knee import load_gate, p95_rank
from evals.load import FORMAT, LoadSpec, Workload, next_rate

T0, SLO, NOMINAL = 0.5, 5.0, 2.67


def measure(rng, rate: float, capacity: float, p95_noise: float, seconds: float) -> dict:
    """One rate of a sweep against the simulated server, as an `evals load` row."""
    rho = rate / capacity
    achieved = min(rate, capacity) * (1 + rng.normal(0, 0.01))
    p95_true = T0 / max(1 - rho, 0.02) * (1 + 4 * max(rho - 0.98, 0))  # past capacity the queue keeps growing
    n = max(20, round(achieved * seconds))
    ttft = np.sort(rng.exponential(p95_true * math.exp(rng.normal(0, p95_noise)) / math.log(20), n))
    return {"rate": rate, "achieved_rps": achieved, "output_tok_s": 1000 * achieved,
            "ttft_p95_s": float(ttft[p95_rank(n) - 1]), "ttft_s": ttft.round(4).tolist(), "successful": n,
            "errored": 0, "incomplete": 0, "success_fraction": 1.0}


def sweep(rng, folder: Path, capacity: float, args) -> None:
    spec = LoadSpec("http://sim", "sim", "sim", folder, ttft_slo_s=SLO)
    rows: list[dict] = []
    while (rate := next_rate(spec, rows, 0.99)) is not None:
        rows.append(measure(rng, rate, capacity, args.p95_noise, args.seconds))
    folder.mkdir(parents=True)
    (folder / "load.json").write_text(json.dumps({
        "format": FORMAT, "state": "done", "tool": {"name": "sim", "version": "0"},
        "workload": Workload().to_dict(), "ttft_slo_s": SLO, "min_success": 0.99, "rates": rows}))


def trial(rng, root: Path, cand_capacity: float, args) -> str:
    for k in range(1, args.sweeps + 1):  # interleaved: reference sweep k, then candidate sweep k
        for arm, nominal in (("ref", NOMINAL), ("cand", cand_capacity)):
            sweep(rng, root / arm / f"sweep-{k}", nominal * math.exp(rng.normal(0, args.cap_noise)), args)
    try:
        verdict = load_gate(root / "cand", root / "ref", margin=args.margin, resamples=args.resamples)["verdict"]
    except Refused:
        verdict = "refused"
    shutil.rmtree(root)
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--sweeps", type=int, default=3, help="sweeps per arm")
    parser.add_argument("--margin", type=float, default=0.10)
    parser.add_argument("--cap-noise", type=float, nargs="+", default=[0.03, 0.05],
                        help="SD of log capacity from sweep to sweep (one table block per value)")
    parser.add_argument("--p95-noise", type=float, default=0.10, help="SD of a rate's log TTFT p95 beyond sampling")
    parser.add_argument("--seconds", type=float, default=120, help="seconds per rate (requests = rate x seconds)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per sweep")
    parser.add_argument("--capacities", type=float, nargs="+", default=[1.0, 0.9, 0.8],
                        help="the candidate's capacity as a share of the reference's (one row each)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"{args.trials} trials, {args.sweeps} sweeps per arm, margin {args.margin:g}, SLO TTFT p95 <= {SLO:g} s, "
          f"p95 noise {args.p95_noise:g}, {args.seconds:g} s per rate")
    print(f"{'capacity noise':>14} {'candidate':>22} {'PASS':>6} {'INCONCL':>8} {'FAIL':>6} {'refused':>8} {'s/trial':>8}")
    with tempfile.TemporaryDirectory(prefix="sim-load-") as tmp:
        for cap_noise in args.cap_noise:
            args.cap_noise = cap_noise
            for share in args.capacities:
                label = "identical (A/A)" if share == 1 else f"{1 - share:.0%} less capacity"
                counts: Counter = Counter()
                started = time.perf_counter()
                for t in range(args.trials):
                    counts[trial(rng, Path(tmp) / str(t), NOMINAL * share, args)] += 1
                rate = {k: counts[k] / args.trials for k in ("PASS", "INCONCLUSIVE", "FAIL", "refused")}
                print(f"{cap_noise:>14g} {label:>22} {rate['PASS']:>6.3f} {rate['INCONCLUSIVE']:>8.3f} "
                      f"{rate['FAIL']:>6.3f} {rate['refused']:>8.3f} {(time.perf_counter() - started) / args.trials:>8.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
