"""A design before the run (``gate plan``): items x repeats per benchmark for a target power, with
its sequential looks fixed in advance, and the check that a run follows its plan.

The variance model is the gate's (``stats.Guidance``): the per-item mean delta over R repeats has
variance ``between + within / R``. ``between`` is the spread of the items' true deltas (only more
items lower it), ``within`` the sampling noise of one repeat's delta (repeats at the same
temperature lower it). tau2's macro (mean of domain means) costs ``TAU2_MACRO_FACTOR`` times the
variance of a plain mean over the same tasks at equal spreads. Both components come from a pilot
(a reference and a candidate bundle: ``paired_pilot`` of their paired outcomes, tau2's per domain at
the macro's weights, with the share of items that differ per repeats, which sets the gate's degrees
of freedom; a reference alone with two or more repeats gives ``within``), or from stated
assumptions (``DEFAULT_ASSUMPTIONS``).

Power is that of the gate's rule at the plausible drop ``d`` (true delta ``-d``). For one 0/1
outcome per item (one repeat, no domains) it is exact: ``stats.exact_power`` sums the trinomial
probability of every outcome the gate's exact rule passes, which holds under any item model. Else
it is the normal approximation of the sequential rule at the gate's own distances: the
non-inferiority statistic ``(delta + margin) / se`` drifts to ``(margin - d) / se_K`` at the last
look, and passes look k where it clears the distance the gate's bound lies from the delta at the
look's level (``gate_looks``: ``stats.bound_distance``, a t quantile expanded, not the normal one);
``sequential.operating`` integrates the looks exactly; tests/benchmarks/sim_gate.py
prints it beside the simulated power. A design never has more items than the benchmark
(``gate.BENCHMARK_ITEMS``) nor more repeats than allowed, and tau2 designs have every task; when
none reaches the power the plan says so and gives the margin the largest design can certify.

The plan's looks carry levels at its assumed information fractions; the gate judges a look at the
level its observed information gives (``observed_levels``), so a world noisier than the plan's
cannot make an early look spend alpha it has not earned.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml
from scipy import optimize
from scipy import stats as sps

from evals.judge import sequential
from evals.bundle import pair, read_bundle
from evals.errors import BadInput
from evals.judge.plan_file import PLAN_VERSION
from evals.judge.policy import finite_number, policies_naming
from evals.judge import stats
from evals.judge.stats import exact_power, variance_components
from quant.outputs import write_atomic

DEFAULT_DROP = 0.01
DEFAULT_POWER = 0.8
# tau2's macro over airline 50, retail 114, telecom 114 tasks (docs/reference.md §6), tasks drawn in
# proportion: var(macro) = var / (D^2 n) * sum(1 / share_d) = 1.16 var / n.
TAU2_DOMAIN_TASKS = {"airline": 50, "retail": 114, "telecom": 114}
TAU2_MACRO_FACTOR = sum(sum(TAU2_DOMAIN_TASKS.values()) / t for t in TAU2_DOMAIN_TASKS.values()) / len(
    TAU2_DOMAIN_TASKS) ** 2


@dataclass(frozen=True)
class Assumptions:
    between: float  # variance of the items' true paired deltas
    within: float  # variance of one repeat's paired delta about its item's true delta
    source: str
    # measured by a pilot (``paired_pilot``): the share of items whose arms differ after 1, 2, ... repeats
    # (``differing_share``); empty: the independent repeats of the stated variance (``expected_df``)
    differing: tuple[float, ...] = ()


# Stated assumptions when no pilot is given; a pilot replaces them (a plan names its source). They are
# the variance components of the item model tests/benchmarks/sim_gate.py simulates (always-right,
# always-wrong and Beta-distributed items; per-item loss and gain odds) at a drop of 0.01, measured on
# 200,000 simulated items, so a plan and the operating-characteristics table describe the same world.
DEFAULT_ASSUMPTIONS = {
    # greedy: a repeat reproduces the answer (within 0); ~4% of items discordant
    "gsm8k": Assumptions(0.043, 0.0, "stated: sim_gate's GSM8K items (greedy, 4% discordant)"),
    # temperature 1.0 at ~0.91: a quarter of the questions succeed only sometimes; 10% discordant
    "gpqa_diamond": Assumptions(0.025, 0.088, "stated: sim_gate's GPQA-Diamond items (temperature 1.0, 10% "
                                              "discordant per repeat)"),
    # three domains at their own levels, trials at temperature; 15% discordant per trial (pooled)
    "tau2": Assumptions(0.045, 0.12, "stated: sim_gate's tau2 tasks (15% discordant per trial)"),
    # the built-in example (greedy, like GSM8K): its MXFP4 and FP8 arms differ on 5 of 250 items (README)
    "arith": Assumptions(0.02, 0.0, "stated: the built-in example's MXFP4 vs FP8 (greedy, 2% discordant)"),
}
MAX_REPEATS = {"gsm8k": 1, "gpqa_diamond": 8, "tau2": 8, "arith": 1}  # repeats allowed by default (greedy: 1)
# Benchmarks run in whole task sets: `evals run --plan` runs every tau2 task of its domains, so a design
# with fewer tasks could never be followed (the gate would say "does not follow its plan" forever).
WHOLE_SETS = {"tau2"}


def tau2_tasks_per_domain(items: int, domains: tuple[str, ...] | list[str]) -> int | None:
    """The ``num_tasks`` per domain a tau2 plan of ``items`` tasks runs: every task of the domains
    (None), or the first N tasks of each (a plan of N x len(domains) items: whole task sets of N, as
    `gate plan --items tau2=6` writes for a small trial run); any other count cannot be run as planned
    (BadInput, before any server is asked)."""
    whole = sum(TAU2_DOMAIN_TASKS.get(d, 0) for d in domains)
    if items == whole:
        return None
    fewest = min(TAU2_DOMAIN_TASKS.get(d, 0) for d in domains)
    if domains and items % len(domains) == 0 and 0 < items // len(domains) < fewest:
        return items // len(domains)
    raise BadInput(f"the plan has {items} tau2 tasks, which no run of {', '.join(domains)} has: a tau2 plan runs every "
                   f"task ({whole}) or the first N of each domain ({len(domains)} x N, N below {fewest}); plan again "
                   "with `gate plan --items tau2=N`")


def se_of(benchmark: str, assumptions: Assumptions, items: int, repeats: int) -> float:
    """Standard error of the benchmark's delta at ``items`` x ``repeats``."""
    factor = TAU2_MACRO_FACTOR if benchmark == "tau2" else 1.0
    return math.sqrt(factor * (assumptions.between + assumptions.within / repeats) / items)


def look_fractions(assumptions: Assumptions, repeats: int) -> list[float]:
    """Information fractions of a look after each repeat 1..R (information = 1 / variance)."""
    var = [assumptions.between + assumptions.within / r for r in range(1, repeats + 1)]
    return [var[-1] / v for v in var]


def plan_looks(assumptions: Assumptions, repeats: int, alpha: float, sequential_looks: bool = True) -> list[dict]:
    if not sequential_looks or repeats == 1 or assumptions.within <= 0:
        # one look, at the end: repeats that add no information are no look of their own
        return [{"look": 1, "repeats": repeats, "information_fraction": 1.0, "alpha_spent": alpha,
                 "z": float(sps.norm.ppf(1 - alpha)), "confidence": 1 - alpha}]
    fractions = look_fractions(assumptions, repeats)
    z = sequential.boundaries(fractions, alpha)
    return [{"look": k + 1, "repeats": k + 1, "information_fraction": t, "alpha_spent": sequential.spent(t, alpha),
             "z": zk, "confidence": sequential.nominal_confidence(zk)} for k, (t, zk) in enumerate(zip(fractions, z))]


def observed_levels(benchmark: str, entry: dict, alpha: float, ref: np.ndarray, cand: np.ndarray,
                    strata: np.ndarray | None = None) -> list[dict]:
    """The one-sided level of each look so far, from the information the run observed (not the plan's
    assumed fractions): ``ref`` and ``cand`` are items x repeats of the looks' scores (the current
    look's repeats; look j saw the first ``looks[j]['repeats']`` of them). Look j's information is
    1 / the paired delta's variance over those repeats; the final information it predicts scales
    that by the variance components of its own deltas (``stats.variance_components``), or, at a
    look of one repeat where repeats show no noise yet, by the most repeats could add (all of the
    variance within items: R times). The plan's final information is that of its stated item model
    (``se_of``). Returns, per look so far, ``repeats``, ``information_fraction``, ``z``, ``confidence``."""
    from evals.judge.stats import paired_se  # the gate's standard error, as the gate computes it

    looks = [lk for lk in entry["looks"] if lk["repeats"] <= ref.shape[1]]
    final_repeats = entry["looks"][-1]["repeats"]
    # The plan's stated variances can only lower the fractions (a larger planned information spends less
    # early), never raise them: numbers a bundle carries cannot make a look more lenient than its data allow.
    stated = entry.get("assumptions") if isinstance(entry.get("assumptions"), dict) else {}
    between, within = stated.get("between"), stated.get("within")
    sane = all(finite_number(v) and v >= 0 for v in (between, within)) and between + within > 0
    planned = 1 / se_of(benchmark, Assumptions(float(between), float(within), ""), entry["items"],
                        final_repeats) ** 2 if sane else 0.0  # none stated: the data's own estimate alone
    information, final = [], []
    for lk in looks:
        r = lk["repeats"]
        se = paired_se(ref[:, :r].mean(axis=1), cand[:, :r].mean(axis=1), strata)
        info = 1 / se ** 2 if se > 0 else math.inf
        if r == 1:
            ahead = final_repeats * info
        else:
            between, within = variance_components(cand[:, :r] - ref[:, :r])
            now, then = between + within / r, between + within / final_repeats
            ahead = info * now / then if then > 0 else math.inf
        information.append(info)
        final.append(ahead)
    if any(math.isinf(i) for i in information):  # no item differs yet: nothing to spend on; judge at the plan's level
        return [{"repeats": lk["repeats"], "information_fraction": lk.get("information_fraction"), "z": lk.get("z"),
                 "confidence": lk["confidence"]} for lk in looks]
    fractions = sequential.observed_fractions(information, final, planned, looks[-1]["repeats"] == final_repeats)
    z = sequential.look_boundaries(fractions, alpha)
    return [{"repeats": lk["repeats"], "information_fraction": t, "z": zk, "confidence": sequential.nominal_confidence(zk)}
            for lk, t, zk in zip(looks, fractions, z)]


def operating(looks: list[dict], drift: float) -> dict:
    return sequential.operating([lk["information_fraction"] for lk in looks], [lk["z"] for lk in looks], drift)


def differing_share(deltas: np.ndarray) -> tuple[float, ...]:
    """The share of items whose arms differ after the first 1, 2, ..., R repeats (items x repeats of
    paired deltas of 0/1 outcomes): the items the gate's bound counts its degrees of freedom over
    (``stats._bca``: the nonzero per-item mean deltas). Summed, not averaged: a sum of integers is
    exact, so an item whose arms tie over its repeats counts as tied."""
    sums = np.cumsum(np.asarray(deltas, dtype=float), axis=1)
    return tuple(float(np.mean(np.abs(sums[:, r]) > 1e-9)) for r in range(sums.shape[1])) if len(sums) else ()


def paired_pilot(benchmark: str, ref: np.ndarray, cand: np.ndarray, strata: np.ndarray | None = None,
                 source: str = "pilot") -> Assumptions:
    """The assumptions a pilot's paired outcomes give (items x repeats of each arm, repeat r of one arm
    paired with repeat r of the other): the variance components of the paired deltas
    (``stats.variance_components``) and the share of items that differ per repeats (``differing_share``).
    With ``strata`` (tau2's domains) the components are the domains' own, weighted as the macro weighs
    them at the benchmark's task shares, so ``se_of`` gives the macro's standard error whatever each
    domain's spread (the stated model assumes them equal): between = sum_d between_d / share_d over
    sum_d 1 / share_d, within likewise."""
    deltas = np.asarray(cand, dtype=float) - np.asarray(ref, dtype=float)
    if deltas.ndim == 1:
        deltas = deltas[:, None]
    n, repeats = deltas.shape
    where = f"{source}, {n} items x {repeats} repeats"
    if strata is None:
        between, within = variance_components(deltas)
        return Assumptions(between, within, where, differing_share(deltas))
    strata = np.asarray(strata)
    names = sorted(set(strata.tolist()))
    known = benchmark == "tau2" and all(d in TAU2_DOMAIN_TASKS for d in names)
    sizes = {d: TAU2_DOMAIN_TASKS[d] if known else int(np.sum(strata == d)) for d in names}
    weights = {d: sum(sizes.values()) / sizes[d] for d in names}  # 1 / each domain's share of the tasks
    parts = {d: variance_components(deltas[strata == d]) for d in names}
    between = sum(weights[d] * parts[d][0] for d in names) / sum(weights.values())
    within = sum(weights[d] * parts[d][1] for d in names) / sum(weights.values())
    return Assumptions(between, within, f"{where} in {len(names)} domains", differing_share(deltas))


def expected_df(benchmark: str, assumptions: Assumptions, items: int, repeats: int, drop: float) -> float:
    """The degrees of freedom the gate's bound will have (``stats.pooled_df``: the items that differ, less
    one, pooled over tau2's domains), expected under the plan's item model: the share a pilot measured
    at these repeats (``Assumptions.differing``; past the pilot's repeats, its last extended as
    independent repeats); else, stated, an (item, repeat) is discordant with probability
    ``between + within + drop^2`` (``outcome_rates``) and an item differs once one of its repeats is
    (independent repeats: an upper estimate; where the same items differ again and again, as under
    damage concentrated on a few items, fewer differ and the bound lies further out)."""
    seen = assumptions.differing
    if seen and repeats <= len(seen):
        differ = seen[repeats - 1]
    elif seen:
        differ = 1 - (1 - min(seen[-1], 1.0)) ** (repeats / len(seen))
    else:
        discordant = sum(outcome_rates(assumptions, drop))
        differ = 1 - (1 - min(discordant, 1.0)) ** repeats
    if benchmark != "tau2":
        return stats.pooled_df([1.0], [items * differ])
    sizes = [items * t / sum(TAU2_DOMAIN_TASKS.values()) for t in TAU2_DOMAIN_TASKS.values()]
    return stats.pooled_df([1 / n for n in sizes], [n * differ for n in sizes])  # equal spread, shares 1 / n_d


def gate_looks(benchmark: str, assumptions: Assumptions, items: int, looks: list[dict], drop: float) -> list[dict]:
    """The looks with the distance at which the gate decides (``z``): its bound for averaged items lies
    ``stats.bound_distance`` standard errors from the delta at the look's level, not the normal quantile
    (e.g. 1.70, not 1.645, for GPQA 198 x 2 at 95%), so power computed on the normal boundary overstated it."""
    return [{**lk, "z": stats.bound_distance(lk["confidence"], expected_df(benchmark, assumptions, items,
                                                                             lk["repeats"], drop))} for lk in looks]


def one_outcome(benchmark: str, repeats: int) -> bool:
    """A design the gate judges by its exact rule for paired 0/1 items: one repeat, no strata (not tau2)."""
    return repeats == 1 and benchmark != "tau2"


def outcome_rates(assumptions: Assumptions, drop: float) -> tuple[float, float]:
    """``(P(reference-only), P(candidate-only))`` of one paired 0/1 outcome at a true delta of -drop: the
    per-item delta's variance at one repeat, ``between + within``, is P(discordant) - drop^2."""
    discordant = max(assumptions.between + assumptions.within + drop * drop, abs(drop))
    return (discordant + drop) / 2, (discordant - drop) / 2


def _power(benchmark, assumptions, items, repeats, margin, drop, looks) -> float:
    """The gate's power at the drop: for one-outcome designs exact (``stats.exact_power``: the sum over
    the trinomial outcomes the exact rule passes); otherwise the normal approximation of the
    sequential rule at the distances the gate's bound lies from the delta (``gate_looks``,
    ``sequential.operating``)."""
    if margin <= drop:
        return 0.0
    if one_outcome(benchmark, repeats):
        return exact_power(items, *outcome_rates(assumptions, drop), margin, looks[-1]["confidence"])
    return operating(gate_looks(benchmark, assumptions, items, looks, drop),
                     (margin - drop) / se_of(benchmark, assumptions, items, repeats))["pass"]


def certifiable_margin(benchmark: str, assumptions: Assumptions, items: int, repeats: int, drop: float,
                       looks: list[dict], power: float) -> float:
    """The smallest margin this design passes with ``power`` when the true drop is ``drop`` (one-outcome
    designs: by bisection on the exact power, to 0.0005)."""
    se = se_of(benchmark, assumptions, items, repeats)
    decided = gate_looks(benchmark, assumptions, items, looks, drop)
    drift = optimize.brentq(lambda th: operating(decided, th)["pass"] - power, 0.0, 20.0, xtol=1e-6)
    if not one_outcome(benchmark, repeats):
        return drop + drift * se
    lo, hi = drop, drop + 2 * drift * se  # the exact bound lies further below the delta than the normal one
    while _power(benchmark, assumptions, items, repeats, hi, drop, looks) < power:
        lo, hi = hi, hi + drift * se
    while hi - lo > 5e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _power(benchmark, assumptions, items, repeats, mid, drop, looks) >= power else (mid, hi)
    printed = math.floor(round(hi * 1000, 6)) / 1000  # the plan prints it rounded up: the 0.001 below, if it holds
    return printed if printed > lo and _power(benchmark, assumptions, items, repeats, printed, drop, looks) >= power else hi


@dataclass
class Design:
    benchmark: str
    items: int
    repeats: int  # at most; looks may stop sooner
    margin: float
    drop: float
    power: float  # of the sequential rule at the drop
    feasible: bool  # power reaches the target within the limits
    certifiable_margin: float  # at the target power and the drop
    expected_repeats: float  # at the drop, with the looks stopping early
    looks: list[dict]
    assumptions: dict
    benchmark_items: int
    max_repeats: int
    gpu_hours: dict | None = None  # per arm, where a throughput is given
    note: str = ""


def design(benchmark: str, assumptions: Assumptions, margin: float, drop: float, alpha: float, power: float,
           benchmark_items: int, max_repeats: int, min_items: int = 1, sequential_looks: bool = True,
           throughput: float | None = None) -> Design:
    """The cheapest items x repeats (fewest answers per arm) whose sequential rule passes a candidate
    ``drop`` worse than the reference with ``power``; else the largest design, marked infeasible."""
    best = None
    for repeats in range(1, max_repeats + 1):
        if repeats > 1 and assumptions.within <= 0:
            break  # repeats add nothing when an item's answers do not vary
        looks = plan_looks(assumptions, repeats, alpha, sequential_looks)
        if _power(benchmark, assumptions, benchmark_items, repeats, margin, drop, looks) < power:
            continue
        lo, hi = max(1, min_items), benchmark_items  # power rises with items: the fewest that reach it
        if benchmark in WHOLE_SETS:
            lo = hi  # a run has all of its tasks (`evals run --plan` runs every one): only the repeats vary
        # one-outcome designs to 0.5% of the items: their exact power steps with the lattice, and each costs ~0.5 s
        step = max(1, benchmark_items // 200) if one_outcome(benchmark, repeats) else 1
        while hi - lo >= step:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _power(benchmark, assumptions, mid, repeats, margin, drop, looks) >= power else (mid + 1, hi)
        lo = hi
        if best is None or lo * repeats < best[0] * best[1]:
            best = (lo, repeats, looks)
    feasible = best is not None
    if not feasible:
        repeats = max_repeats if assumptions.within > 0 else 1
        best = (benchmark_items, repeats, plan_looks(assumptions, repeats, alpha, sequential_looks))
    items, repeats, looks = best
    se = se_of(benchmark, assumptions, items, repeats)
    ops = operating(gate_looks(benchmark, assumptions, items, looks, drop), (margin - drop) / se) if margin > drop else None
    p = _power(benchmark, assumptions, items, repeats, margin, drop, looks)  # exact for one-outcome designs
    stop = ops["stop_by_look"] if ops else [0.0] * len(looks)
    expected = sum(s * lk["repeats"] for s, lk in zip(stop, looks)) + (1 - sum(stop)) * repeats
    cert = certifiable_margin(benchmark, assumptions, items, repeats, drop, looks, power)
    note = "" if feasible else (
        f"no design within {benchmark_items} items x {max_repeats} repeats certifies a margin of {margin} at a true "
        f"drop of {drop} with {power:.0%} power (this one: {p:.0%}); it certifies {math.ceil(cert * 1000) / 1000:.3f}")
    hours = None
    if throughput:
        hours = {"answers_per_gpu_hour": throughput, "max": items * repeats / throughput,
                 "expected_at_drop": items * expected / throughput}
    return Design(benchmark=benchmark, items=items, repeats=repeats, margin=margin, drop=drop, power=p,
                  feasible=feasible, certifiable_margin=cert, expected_repeats=expected, looks=looks,
                  assumptions={**asdict(assumptions), "differing": list(assumptions.differing)},
                  benchmark_items=benchmark_items, max_repeats=max_repeats,
                  gpu_hours=hours, note=note)


def arm_matrix(rows: list[dict]) -> tuple[list[str], int, np.ndarray]:
    """Items x repeats of one arm's scores (items with every repeat), and how many items there were."""
    by_item: dict[str, dict[int, float]] = {}
    for r in rows:
        by_item.setdefault(r["item_id"], {})[r["repeat"]] = r["score"]
    repeats = sorted({k for d in by_item.values() for k in d})
    items = sorted(i for i, d in by_item.items() if len(d) == len(repeats))
    return items, len(by_item), np.array([[by_item[i][k] for k in repeats] for i in items],
                                         dtype=float).reshape(len(items), len(repeats))


def _arm_matrix(rows: list[dict], where: str) -> tuple[list[str], np.ndarray]:
    """``arm_matrix`` of a pilot: fewer than two items with every repeat cannot show a variance
    (BadInput naming ``where``)."""
    items, seen, matrix = arm_matrix(rows)
    if len(items) < 2:
        raise BadInput(f"{where}: {len(items)} of {seen} items have every repeat ({matrix.shape[1]}); a pilot "
                       "needs at least two such items to show a variance: finish the pilot (`evals run --resume`), or "
                       "give one whose items all have the same repeats")
    return items, matrix


def pilot_assumptions(benchmark: str, reference: Path, candidate: Path | None, stated: Assumptions) -> Assumptions:
    """Variance components from a pilot: with both arms, ``paired_pilot`` of their paired outcomes
    (tau2 per domain, and the share of items that differ per repeats); with the reference alone,
    ``within`` from its repeats (two independent arms: twice one arm's variance
    between repeats) and ``between`` as stated."""
    ref_run, ref_rows = read_bundle(reference)
    if benchmark not in ref_run["benchmarks"]:
        held = sorted(ref_run["benchmarks"])
        raise BadInput(f"--pilot-reference {reference}: holds no {benchmark} (it has {held}); plan what it holds under "
                       f"a policy that names it: {policies_naming(held)}")
    primary = ref_run["benchmarks"][benchmark].get("primary_filter", "flexible-extract")
    pick = lambda rows: [r for r in rows if r["benchmark"] == benchmark and r["filter"] == primary]
    if candidate is not None:
        _, cand_rows = read_bundle(candidate)
        pairs = pair(pick(ref_rows), pick(cand_rows))
        where = f"--pilot-reference {reference} --pilot-candidate {candidate}: {benchmark}"
        items, ref = _arm_matrix([a for a, _ in pairs], where)
        _, cand = _arm_matrix([b for _, b in pairs], where)
        domains = {a["item_id"]: a["domain"] for a, _ in pairs if "domain" in a}  # tau2: each task's domain
        strata = np.array([domains[i] for i in items]) if items and all(i in domains for i in items) else None
        return paired_pilot(benchmark, ref, cand, strata, f"pilot: {reference} vs {candidate}")
    _, ref = _arm_matrix(pick(ref_rows), f"--pilot-reference {reference}: {benchmark}")
    if ref.shape[1] < 2:
        raise BadInput(f"--pilot-reference {reference}: {benchmark} has one repeat, which shows no sampling noise; "
                       "give --pilot-candidate too, or a pilot with two or more repeats")
    within = 2 * float(ref.var(axis=1, ddof=1).mean())
    return Assumptions(stated.between, within, f"pilot: {reference} repeats ({len(ref)} items x {ref.shape[1]}) for "
                                               f"within; between {stated.source}")


def make_plan(designs: list[Design], policy, power: float) -> dict:
    return {"plan_version": PLAN_VERSION, "made_by": "gate plan", "alpha": round(1 - policy.confidence, 12),
            "confidence": policy.confidence, "policy": policy.source, "power": power,
            "spending": "Lan-DeMets O'Brien-Fleming, one-sided, pass and mirror fail boundaries",
            "benchmarks": {d.benchmark: {**asdict(d), "seeds": list(range(d.repeats))} for d in designs}}


class _NoAliases(yaml.SafeDumper):
    """Every value written out: the plan reader refuses aliases (``safe_files.read_yaml``)."""

    def ignore_aliases(self, data) -> bool:
        return True


def write_plan(plan: dict, path: Path) -> None:
    """YAML for .yaml/.yml, else JSON; written whole or not at all."""
    text = yaml.dump(plan, Dumper=_NoAliases, sort_keys=False) if path.suffix in (".yaml", ".yml") else \
        json.dumps(plan, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


def planned_look(plan: dict, benchmark: str, items: int, repeats: int, confidence: float) -> dict:
    """Where a run of ``items`` x ``repeats`` stands in its plan: ``look``, ``of``, ``confidence`` (the
    level to judge it at), ``final``; and ``findings``, each way it does not follow the plan (then the
    look is not one the plan allowed for, and its verdict cannot be final)."""
    entry = plan["benchmarks"][benchmark]
    looks = entry["looks"]
    findings = []
    if items != entry["items"]:
        findings.append(f"{items} items compared, the plan has {entry['items']}")
    if abs(confidence - plan.get("confidence", confidence)) > 1e-12:
        findings.append(f"the policy's confidence {confidence} is not the plan's {plan['confidence']}")
    match = [lk for lk in looks if lk["repeats"] == repeats]
    if not match:
        findings.append(f"{repeats} repeats is no look of the plan (looks at {[lk['repeats'] for lk in looks]} repeats)")
    look = match[0] if match else None
    return {"look": look["look"] if look else None, "of": len(looks), "repeats": repeats,
            "confidence": look["confidence"] if look else None, "final": bool(look) and look is looks[-1],
            "findings": findings, "follows": not findings}


def restrict_reference(ref_rows: list[dict], cand_rows: list[dict]) -> list[dict]:
    """The reference rows of the candidate's (item, repeat)s: a look has run only the plan's first
    repeats, the reference all of them (the same seeds: their settings are compared as usual)."""
    keys = {(r["item_id"], r["repeat"]) for r in cand_rows}
    return [r for r in ref_rows if (r["item_id"], r["repeat"]) in keys]


def judge_look(result, look: dict) -> None:
    """Say where ``result`` (a ``gate.BenchmarkResult`` judged at the look's level) stands in the
    plan: a verdict at a look; not final yet; or no verdict at all, the run not following its plan
    (judged at an unplanned look, a rerun would inflate the false pass rate the plan holds)."""
    result.look = look
    if not look["follows"]:
        result.verdict, result.decidable = "INCONCLUSIVE", False
        result.rule = (f"the run does not follow its plan ({'; '.join(look['findings'])}): no planned look to judge "
                       "it at; run it as planned (`evals run --plan PLAN`)")
    elif result.verdict == "INCONCLUSIVE" and not look["final"]:
        result.rule += (f"; look {look['look']} of {look['of']} (one-sided {look['confidence']:.5f}): not final, the "
                        "plan's next look decides (`evals run --until-decided` continues)")
    else:
        result.rule += f"; look {look['look']} of {look['of']} of the plan, at one-sided {look['confidence']:.5f}"
