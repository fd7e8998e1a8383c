"""Operating characteristics of the accuracy gate: how often it passes, blocks or fails a candidate
whose true delta is 0, exactly the margin, or a point beyond it, at the sizes people run.

    nice -n 15 python -m tests.benchmarks.sim_gate [--sims 2000] [--workers 2] [--cells "gsm8k;tau2"]
        [--models heterogeneous,concentrated] [--at=-margin] [--plan-from pilot|stated]

Not a test: a statistics experiment. Each simulation draws a fresh set of items and both arms'
outcomes and judges them with the real
decision function (``evals.judge.gate.judge``, through which ``compare_benchmark`` decides; with infrastructure
errors ``compare_benchmark`` itself on the rows) under the shipped ``manifests/gates/release.yaml``.

Items are heterogeneous: a share always right, a share always wrong, the rest with a success
probability from a Beta (coin flips at temperature 1.0). The candidate loses a reference success
with a per-item probability and gains a reference failure with another (both Beta-distributed
around their means: the quantization hurts some items more than others), chosen so the expected
delta over items is exactly the cell's and the discordance the benchmark's. The arms are coupled
per item (the candidate redraws independently with a per-item probability), so their correlation
differs between items (``arms``). The second item model (``concentrated_arms``: quantization breaks a few questions)
puts all the damage on 10-20% of the items and couples the arms by a per-item uniform odds; every
cell runs under both (``--models``). tau2 has three domains at their own levels (the macro's delta is each
domain's), trials as repeats and, in one cell, infrastructure errors in the reference arm. The
few-discordance cells have losses only (the percentile bootstrap passed them too often).

False pass is PASS at the margin: the policy promises at most 5% (one-sided 95% bounds).

Sequential cells judge one run after each repeat and stop at the first PASS or FAIL: at the level
``gate accuracy`` gives each look of a plan (Lan-DeMets O'Brien-Fleming spending on the information
the look observed, ``evals.judge.design.observed_levels``, against the plan `gate plan` writes), and,
to show why, naively at the policy's 95% at every look; "mean repeats" is how many repeats the looks
used on average.

Plans (the power printed beside the simulated one at a true delta of -0.01, and the sequential cells'
looks) are made as a user makes them: from a pilot of the cell's item model (``assumptions``,
``design.paired_pilot``), or, with ``--plan-from stated``, from ``design.DEFAULT_ASSUMPTIONS``, which
describe the heterogeneous items only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from multiprocessing import Pool

import numpy as np

from evals.judge.design import DEFAULT_ASSUMPTIONS, Assumptions, _power, observed_levels, paired_pilot, plan_looks
from evals.judge.gate import compare_benchmark, judge
from evals.judge.policy import load_policy


@dataclass(frozen=True)
class Mix:
    """A population of items: shares always right and always wrong, the rest Beta(a, b)."""
    always_right: float
    always_wrong: float
    a: float
    b: float

    @property
    def mean(self) -> float:
        return self.always_right + (1 - self.always_right - self.always_wrong) * self.a / (self.a + self.b)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        u = rng.random(n)
        return np.where(u < self.always_right, 1.0,
                        np.where(u < self.always_right + self.always_wrong, 0.0, rng.beta(self.a, self.b, n)))


GREEDY = Mix(0.93, 0.02, 1, 1)  # GSM8K at temperature 0: reference ~0.955
GPQA = Mix(0.70, 0.02, 3, 1)  # GPQA-Diamond at temperature 1.0: ~0.91
TAU2 = {"airline": (50, Mix(0.45, 0.15, 2, 2)), "retail": (114, Mix(0.65, 0.05, 2, 1)),
        "telecom": (114, Mix(0.75, 0.05, 2, 1))}  # macro ~0.79


@dataclass(frozen=True)
class Cell:
    name: str
    benchmark: str
    items: int
    repeats: int
    mix: Mix | None  # None: tau2's domains
    discordance: float | None  # expected share of (item, repeat) outcomes flipped; None: losses only
    infra: float = 0.0  # reference simulations lost to infrastructure errors (tau2)
    looks: str = ""  # "planned": judged after each repeat at the plan's levels; "naive": each at the policy's


CELLS = [
    Cell("GSM8K 1319x1", "gsm8k", 1319, 1, GREEDY, 0.04),
    Cell("GSM8K 200x1", "gsm8k", 200, 1, GREEDY, 0.04),
    Cell("GPQA 198x2", "gpqa_diamond", 198, 2, GPQA, 0.10),
    Cell("GPQA 198x4", "gpqa_diamond", 198, 4, GPQA, 0.10),
    Cell("GPQA 198x8", "gpqa_diamond", 198, 8, GPQA, 0.10),
    Cell("tau2 278x1", "tau2", 278, 1, None, 0.15),
    Cell("tau2 278x4", "tau2", 278, 4, None, 0.15),
    Cell("tau2 278x4, ref 4.5% infra", "tau2", 278, 4, None, 0.15, infra=0.045),
    Cell("few: GSM8K 200x1 losses only", "gsm8k", 200, 1, GREEDY, None),
    Cell("few: GSM8K 300x1 losses only", "gsm8k", 300, 1, GREEDY, None),
    Cell("GPQA 198x8, planned looks", "gpqa_diamond", 198, 8, GPQA, 0.10, looks="planned"),
    Cell("GPQA 198x8, naive looks at 95%", "gpqa_diamond", 198, 8, GPQA, 0.10, looks="naive"),
    Cell("tau2 278x4, planned looks", "tau2", 278, 4, None, 0.15, looks="planned"),
]


PILOT_RUNS = 200  # a pilot of 200 runs of the cell's design (of 200 candidates): it measures the item model


@lru_cache(maxsize=None)
def assumptions(cell: Cell, delta: float, model: str, plan_from: str) -> Assumptions:
    """What the plan assumes: ``stated``, the cell's ``DEFAULT_ASSUMPTIONS`` (heterogeneous items at a drop
    of 0.01); ``pilot``, as a user plans, from a pilot run's paired outcomes
    (``design.paired_pilot``: variance components, tau2's per domain, and the share of items that differ
    per repeats), drawn from the cell's item model at its true delta, independent of the judged runs
    (its own random seed): ``PILOT_RUNS`` simulated runs of the cell's design stacked, so that it
    measures the model rather than its own noise, and every part of it, including what the
    concentrated model draws once per run (the share of damaged items: one run's share gave GPQA
    198x2 a standard error 4.6% below the runs' 0.0195)."""
    if plan_from == "stated":
        return DEFAULT_ASSUMPTIONS[cell.benchmark]
    seed = 7_000_003 + sum(map(ord, cell.name)) + 1000 * list(MODELS).index(model) + round(1e4 * abs(delta))
    rng = np.random.default_rng(seed)
    runs = [simulate(rng, replace(cell, infra=0.0), delta, model) for _ in range(PILOT_RUNS)]
    ref, cand = (np.concatenate([r[k] for r in runs]) for k in (0, 1))
    strata = np.concatenate([r[2] for r in runs]) if cell.mix is None else None
    return paired_pilot(cell.benchmark, ref, cand, strata, f"pilot ({model}, true delta {delta:+.3f}, {PILOT_RUNS} runs)")


def plan_entry(cell: Cell, alpha: float, delta: float, model: str, plan_from: str) -> dict:
    """The plan `gate plan` writes for this cell's design from its assumptions (looks after each repeat)."""
    assumed = assumptions(cell, delta, model, plan_from)
    return {"items": cell.items, "assumptions": asdict(assumed), "looks": plan_looks(assumed, cell.repeats, alpha)}


def plan_power(cell: Cell, policy, delta: float, model: str, plan_from: str = "pilot") -> float | None:
    """The power ``gate plan`` computes for this cell's design at a true delta (``design._power``) from
    the plan's assumptions (``assumptions``): for one 0/1 outcome per item exact (``stats.exact_power``
    at the outcome rates the assumptions give), else the normal approximation of the sequential rule at
    the gate's bound distances. None where ``gate plan`` makes no such design (infrastructure errors,
    naive looks)."""
    if cell.infra or cell.looks == "naive" or delta >= 0:
        return None
    margin, alpha = policy.of(cell.benchmark).margin, 1 - policy.confidence
    assumed = assumptions(cell, delta, model, plan_from)
    looks = plan_looks(assumed, cell.repeats, alpha, sequential_looks=bool(cell.looks))
    return _power(cell.benchmark, assumed, cell.items, cell.repeats, margin, -delta, looks)


def sequential_verdict(cell: Cell, ref: np.ndarray, cand: np.ndarray, strata, rules, policy, entry: dict
                       ) -> tuple[str, int]:
    """``(verdict, repeats used)`` of a run judged after each repeat, stopping at the first PASS or FAIL:
    at the level the gate gives each look from its observed information (``design.observed_levels``,
    what ``gate accuracy`` judges a planned look at) or, naively, at the policy's at every look."""
    # look k's level depends on the first k repeats alone (its fraction and the earlier looks'), so one call
    # on all of them gives every look the level the gate gives it when it has only those
    levels = [policy.confidence] * cell.repeats if cell.looks == "naive" else [lk["confidence"] for lk in observed_levels(
        cell.benchmark, entry, 1 - policy.confidence, ref, cand, strata)]
    for k, level in enumerate(levels, 1):
        verdict = judge(ref[:, :k].mean(axis=1), cand[:, :k].mean(axis=1), strata, rules,
                        policy.model_copy(update={"confidence": level}))[1]
        if verdict != "INCONCLUSIVE":
            break
    return verdict, k


def arms(rng: np.random.Generator, mix: Mix, n: int, repeats: int, discordance: float | None,
         delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Items x repeats of 0/1 outcomes with E[candidate - reference] = ``delta`` over items."""
    d = -delta if discordance is None else discordance
    loss, gain = (d - delta) / (2 * mix.mean), (d + delta) / (2 * (1 - mix.mean))
    assert 0 <= loss <= 1 and 0 <= gain <= 1, (loss, gain)
    per_item = lambda m: rng.beta(4 * m, 4 * (1 - m), n) if 0 < m < 1 else np.full(n, m)  # noqa: E731
    p, lose, win = mix.draw(rng, n), per_item(loss), per_item(gain)
    q = p * (1 - lose) + (1 - p) * win  # the candidate's success probability per item
    ref = rng.random((n, repeats)) < p[:, None]
    u = rng.random((n, repeats))
    coupled = np.where(ref, u >= lose[:, None], u < win[:, None])
    independent = rng.random((n, repeats)) < q[:, None]
    cand = np.where(rng.random((n, repeats)) < rng.beta(2, 1, n)[:, None], coupled, independent)
    return ref.astype(float), cand.astype(float)


def concentrated_arms(rng: np.random.Generator, mix: Mix, n: int, repeats: int, discordance: float | None,
                      delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The second item model: the damage falls on 10-20% of the items only (the
    quantization breaks some questions and leaves the rest), gains are spread over every item, and
    the arms' coupling varies by item. E[candidate - reference] = ``delta`` over items, as in ``arms``."""
    d = -delta if discordance is None else discordance
    lost_mass, won_mass = (d - delta) / 2, (d + delta) / 2  # expected shares of outcomes lost and won
    share = max(rng.uniform(0.10, 0.20), lost_mass / (0.95 * mix.mean))  # damaged items (never a loss odds above 0.95)
    damaged = rng.random(n) < share
    p = mix.draw(rng, n)
    lose = np.where(damaged, lost_mass / (share * mix.mean), 0.0)
    win = np.full(n, won_mass / (1 - mix.mean))
    q = p * (1 - lose) + (1 - p) * win
    ref = rng.random((n, repeats)) < p[:, None]
    u = rng.random((n, repeats))
    coupled = np.where(ref, u >= lose[:, None], u < win[:, None])
    independent = rng.random((n, repeats)) < q[:, None]
    cand = np.where(rng.random((n, repeats)) < rng.uniform(0, 1, n)[:, None], coupled, independent)
    return ref.astype(float), cand.astype(float)


MODELS = {"heterogeneous": arms, "concentrated": concentrated_arms}


def simulate(rng: np.random.Generator, cell: Cell, delta: float, model: str = "heterogeneous"
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """One simulated pair of runs: items x repeats of reference and candidate outcomes, the items'
    domains (tau2) and which reference simulations were lost to infrastructure errors."""
    domains = TAU2 if cell.mix is None else {None: (cell.items, cell.mix)}
    drawn = [MODELS[model](rng, mix, n, cell.repeats, cell.discordance, delta) for n, mix in domains.values()]
    ref, cand = (np.concatenate([d[k] for d in drawn]) for k in (0, 1))
    strata = np.repeat(list(domains), [n for n, _ in domains.values()]) if cell.mix is None else None
    infra = rng.random(ref.shape) < cell.infra
    ref[infra] = 0.0  # an errored simulation is recorded with reward 0
    return ref, cand, strata, infra


def rows(cell: Cell, ref: np.ndarray, cand: np.ndarray, strata: np.ndarray | None,
         infra: np.ndarray) -> list[tuple[dict, dict]]:
    """The (reference, candidate) rows of a bundle, as ``compare_benchmark`` pairs them."""
    pairs = []
    for i in range(len(ref)):
        for r in range(cell.repeats):
            row = {"benchmark": cell.benchmark, "item_id": str(i), "repeat": r, "filter": "f"}
            if strata is not None:
                row["domain"] = str(strata[i])
            pairs.append(({**row, "score": ref[i, r], "infra_error": bool(infra[i, r])},
                          {**row, "score": cand[i, r], "infra_error": False}))
    return pairs


def run(task: tuple[Cell, float, int, int, str, float | None, str]) -> Counter:
    """Verdicts of ``sims`` simulations: from ``evals.judge.gate.judge`` on the per-item scores (what
    ``compare_benchmark`` decides with), or, with infrastructure errors, from ``compare_benchmark``
    on the rows (dropping errored pairs happens there)."""
    cell, delta, sims, seed, model, confidence, plan_from = task
    policy, rng = load_policy(), np.random.default_rng(seed)
    if confidence is not None:  # a fixed cell judged at another one-sided level (a look's, e.g. 0.99)
        policy = policy.model_copy(update={"confidence": confidence})
    rules = policy.of(cell.benchmark)
    entry = plan_entry(cell, 1 - policy.confidence, delta, model, plan_from) if cell.looks == "planned" else None
    out: Counter = Counter()
    for _ in range(sims):
        ref, cand, strata, infra = simulate(rng, cell, delta, model)
        if cell.looks:
            verdict, used = sequential_verdict(cell, ref, cand, strata, rules, policy, entry)
            out[verdict] += 1
            out["repeats used"] += used
        elif cell.infra:
            out[compare_benchmark(cell.benchmark, rows(cell, ref, cand, strata, infra), policy).verdict] += 1
        else:
            out[judge(ref.mean(axis=1), cand.mean(axis=1), strata, rules, policy)[1]] += 1
    return out


def fixed_cases() -> list[str]:
    """The few-discordance cases (one or two of 200-300 items differ), judged once each."""
    out = []
    for n, b in ((200, 1), (300, 2)):
        rows = [({"benchmark": "gsm8k", "item_id": str(i), "repeat": 0, "filter": "f", "score": 1.0},
                 {"benchmark": "gsm8k", "item_id": str(i), "repeat": 0, "filter": "f", "score": float(i >= b)})
                for i in range(n)]
        r = compare_benchmark("gsm8k", rows, load_policy().with_margins({"gsm8k": 0.02}))
        out.append(f"n={n}, b={b}, c=0 at margin {r.margin}: {r.verdict} (lower bound {r.lower:+.4f}: {r.bound_method})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sims", type=int, default=2000, help="simulations per cell (default 2000)")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2; this is a shared machine)")
    parser.add_argument("--infra-sims", type=int, default=500,
                        help="simulations per cell with infrastructure errors (compare_benchmark on rows: ~15x slower)")
    parser.add_argument("--cells", default="",
                        help="name fragments separated by ';' (or, where no ';' is given, by ','), =NAME: that cell "
                             "only, e.g. '=GPQA 198x8, planned looks;=tau2 278x4'; default: every cell")
    parser.add_argument("--json", action="store_true", help="one JSON object per cell instead of the table")
    parser.add_argument("--at", default="0,-0.01,-margin,-margin-0.01",
                        help="true deltas to simulate, of 0,-0.01,-margin,-margin-0.01 (default: all four)")
    parser.add_argument("--confidence", type=float,
                        help="judge the fixed cells at this one-sided level instead of the policy's (e.g. 0.99: how a "
                             "look's bound holds a sequential look's level); false pass is then promised <= 1 - it")
    parser.add_argument("--seed", type=int, default=0,
                        help="added to every cell's random seed: another, independent set of simulations (a replicate)")
    parser.add_argument("--plan-from", choices=("pilot", "stated"), default="pilot",
                        help="the plan's assumptions (its power and, for the sequential cells, its looks): from a pilot "
                             "run of the cell's item model, as a user plans (default), or the stated DEFAULT_ASSUMPTIONS")
    parser.add_argument("--models", default="heterogeneous,concentrated",
                        help=f"item models, of {','.join(MODELS)} (default: both)")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models {args.models!r}: choose from {','.join(MODELS)}")
    if args.confidence is not None and not 0.5 < args.confidence < 1:
        parser.error(f"--confidence {args.confidence}: a one-sided level in (0.5, 1), e.g. 0.99")
    policy = load_policy()
    if args.confidence is not None:
        policy = policy.model_copy(update={"confidence": args.confidence})
    wanted = [f.strip().lower() for f in args.cells.split(";" if ";" in args.cells else ",") if f.strip()]
    cells = [c for c in CELLS if not wanted or any(c.name.lower() == f[1:] if f.startswith("=") else f in c.name.lower()
                                                   for f in wanted)]
    tasks, keys = [], []  # one task per (model, cell, delta): each line is printed as soon as its cell is done
    for m, model in enumerate(models):
        for k, cell in enumerate(cells):
            margin = policy.of(cell.benchmark).margin
            sims = min(args.sims, args.infra_sims) if cell.infra else args.sims
            for j, (label, delta) in enumerate((("0", 0.0), ("-0.01", -0.01), ("-margin", -margin),
                                                ("-margin-0.01", -margin - 0.01))):
                if label not in args.at.split(","):
                    continue
                tasks.append((cell, delta, sims, 1000 * (100 * k + 10 * j) + 7 * m + 100_003 * args.seed, model, args.confidence, args.plan_from))
                keys.append((f"{model[:5]}: {cell.name}", label, delta, margin, cell, model))
    order = sorted(range(len(tasks)), key=lambda i: keys[i][1] != "-margin")  # false pass first: it is the promise
    tasks, keys = [tasks[i] for i in order], [keys[i] for i in order]
    start = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.json:
        print("python3 -m tests.benchmarks.sim_gate " + shlex.join(sys.argv[1:]) + f"  (plans from: {args.plan_from})")
        print(f"{'model: cell':<39} {'margin':>6} {'true delta':>10} {'PASS':>13} {'INCONCL':>7} {'FAIL':>6} {'sims':>5}",
              flush=True)
    with Pool(args.workers) as pool:
        results = pool.imap(run, tasks, chunksize=1)
        for (name, label, delta, margin, cell, model), c in zip(keys, results):
            planned = plan_power(cell, policy, delta, model, args.plan_from) if label == "-0.01" else None
            report(name, label, delta, margin, c, args.json, planned, 1 - policy.confidence)
    if not args.json:
        print("\n".join(fixed_cases()))
        print(f"{len(tasks)} cells in {time.time() - start:.0f} s ({args.workers} workers)")


def report(name: str, label: str, delta: float, margin: float, c: Counter, as_json: bool,
           planned: float | None = None, promised: float = 0.05) -> None:
    """One cell's verdict rates, as a table row or a JSON object."""
    total = sum(c[v] for v in ("PASS", "INCONCLUSIVE", "FAIL"))
    rates = {v: c[v] / total for v in ("PASS", "INCONCLUSIVE", "FAIL")}
    used = c["repeats used"] / total if c["repeats used"] else None  # sequential cells only
    if as_json:
        print(json.dumps({"cell": name, "margin": margin, "delta": delta, "sims": total, **rates,
                          "pass_se": (rates["PASS"] * (1 - rates["PASS"]) / total) ** 0.5, "mean_repeats": used,
                          "plan_power": planned,
                          "simulated_minus_plan": None if planned is None else rates["PASS"] - planned}),
              flush=True)
        return
    flag = f"  <- false pass above {1.1 * promised:.2%}" if label == "-margin" and rates["PASS"] > 1.1 * promised else ""
    pm = (rates["PASS"] * (1 - rates["PASS"]) / total) ** 0.5  # the binomial standard error of the PASS rate
    print(f"{name:<39} {margin:>6} {delta:>+10.3f} {rates['PASS']:>6.3f}+-{pm:.3f} {rates['INCONCLUSIVE']:>7.3f} "
          f"{rates['FAIL']:>6.3f} {total:>5}" + (f"  mean repeats {used:.2f}" if used else "")
          + (f"  plan power {planned:.3f} (simulated - plan {rates['PASS'] - planned:+.3f}, "
             f"{(rates['PASS'] - planned) / pm if pm else 0:+.1f} SE)" if planned is not None else "") + flag, flush=True)


if __name__ == "__main__":
    main()
