"""The accuracy gate: paired candidate-vs-reference comparison per benchmark, a verdict per policy.

PASS: the one-sided lower bound of the paired delta is above -margin (and no absolute floor is
broken). FAIL: the upper bound is below -margin, or the floor is broken. INCONCLUSIVE: anything
else; the report says how many items would decide it at the observed per-item spread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

from evals.bundle import BundleError, pair, read_bundle
from evals import tau2_gate
from evals.stats import discordance, items_to_decide, macro_interval, mcnemar_exact_p, mean_ci, paired_delta, \
    wilson_interval
from quant.layout import manifests_root

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass
class BenchmarkResult:
    benchmark: str
    filter: str
    n_items: int
    repeats: int
    reference: dict  # score, ci_low, ci_high
    candidate: dict
    delta: float
    se: float
    lower: float
    upper: float
    normal_lower: float
    normal_upper: float
    margin: float
    confidence: float
    verdict: str
    rule: str
    required: bool
    discordant_ref_only: int | None = None  # b: reference right, candidate wrong
    discordant_cand_only: int | None = None  # c
    mcnemar_p: float | None = None
    items_to_decide: int | None = None
    per_stratum: dict | None = None  # GPQA per seed, tau2 per domain
    noise: dict | None = None
    decidable: bool = True  # False: too few items or too many infrastructure errors to judge at all
    infra: dict | None = None  # tau2: infrastructure errors per arm


def load_policy(path: Path | None = None) -> dict:
    return yaml.safe_load((path or manifests_root() / "gates" / "release.yaml").read_text())


def _item_scores(rows: list[dict]) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """Items in a stable order, their mean score over repeats, and their stratum (tau2 domain)."""
    by_item: dict[str, list[float]] = {}
    strata: dict[str, str] = {}
    for r in rows:
        by_item.setdefault(str(r["item_id"]), []).append(float(r["score"]))
        if "domain" in r:
            strata[str(r["item_id"])] = r["domain"]
    items = sorted(by_item)
    scores = np.array([np.mean(by_item[i]) for i in items])
    return items, scores, (np.array([strata[i] for i in items]) if strata else None)


def _per_stratum(pairs: list[tuple[dict, dict]], key: str) -> dict:
    out: dict = {}
    for ref, cand in pairs:
        s = out.setdefault(str(ref.get(key)), {"reference": [], "candidate": []})
        s["reference"].append(ref["score"])
        s["candidate"].append(cand["score"])
    return {k: {"n": len(v["reference"]), "reference": float(np.mean(v["reference"])),
                "candidate": float(np.mean(v["candidate"])),
                "delta": float(np.mean(v["candidate"]) - np.mean(v["reference"]))} for k, v in sorted(out.items())}


def _fails_anyway(pairs: list[tuple[dict, dict]], margin: float, confidence: float, resamples: int,
                  seed: int) -> bool:
    """Would the candidate still fail with its infrastructure errors scored 1 and the reference's 0?
    Then the errors did not cause the failure, and the gate may say FAIL despite them."""
    favour = lambda rows, value: [{**r, "score": value} if r.get("infra_error") else r for r in rows]  # noqa: E731
    _, ref, strata = _item_scores(favour([a for a, _ in pairs], 0.0))
    _, cand, _ = _item_scores(favour([b for _, b in pairs], 1.0))
    return paired_delta(ref, cand, confidence, resamples, seed, strata).upper < -margin


def compare_benchmark(benchmark: str, ref_rows: list[dict], cand_rows: list[dict], policy: dict,
                      rerun_rows: list[dict] | None = None) -> BenchmarkResult:
    rules = policy["benchmarks"].get(benchmark, {"margin": 0.02, "required": True, "floor": None})
    confidence, margin = float(policy["confidence"]), float(rules["margin"])
    pairs = pair(ref_rows, cand_rows)
    items, ref_scores, strata = _item_scores([a for a, _ in pairs])
    _, cand_scores, _ = _item_scores([b for _, b in pairs])
    boot = policy.get("bootstrap", {})
    p = paired_delta(ref_scores, cand_scores, confidence, int(boot.get("resamples", 10000)),
                     int(boot.get("seed", 0)), strata)
    repeats = len({a["repeat"] for a, _ in pairs})
    resamples, seed = int(boot.get("resamples", 10000)), int(boot.get("seed", 0))
    if strata is not None:  # tau2: the macro over domains, as the benchmark reports it
        ref_ci, cand_ci, per_domain = tau2_gate.macro_table(ref_scores, cand_scores, strata, confidence, resamples, seed)
    else:
        ref_ci, cand_ci = (dict(zip(("score", "ci_low", "ci_high"), wilson_interval(s, 0.95)))
                           for s in (ref_scores, cand_scores))
    floor, min_items = rules.get("floor"), int(rules.get("min_items") or 0)
    max_infra = rules.get("max_infra_error_rate")
    infra = {"reference": tau2_gate.infra_counts([a for a, _ in pairs]),
             "candidate": tau2_gate.infra_counts([b for _, b in pairs])} if max_infra is not None else None
    too_broken = [f"{arm}: {c['errors']}/{c['simulations']} simulations are infrastructure errors "
                  f"({c['rate']:.1%} > the policy's {max_infra:.0%})" for arm, c in (infra or {}).items()
                  if c["rate"] is not None and c["rate"] > max_infra]
    if too_broken and len(items) >= min_items and _fails_anyway(pairs, margin, confidence, resamples, seed):
        verdict, rule = FAIL, ("; ".join(too_broken) + f", yet even with every infrastructure error scored in the "
                               f"candidate's favour the one-sided upper bound stays below -{margin}")
        too_broken = []
    elif too_broken:
        verdict, rule = INCONCLUSIVE, ("; ".join(too_broken) + ": the measurement failed, not the model; fix the "
                                       "serving and rerun with `evals run --resume` (it runs them again)")
    elif len(items) < min_items:
        verdict, rule = INCONCLUSIVE, f"{len(items)} items, below the policy's minimum of {min_items} to judge"
    elif floor is not None and cand_ci["score"] < floor:
        verdict, rule = FAIL, f"candidate score {cand_ci['score']:.4f} is below the floor {floor}"
    elif p.lower > -margin:
        verdict, rule = PASS, f"one-sided {confidence:.0%} lower bound {p.lower:+.4f} > -{margin}"
    elif p.upper < -margin:
        verdict, rule = FAIL, f"one-sided {confidence:.0%} upper bound {p.upper:+.4f} < -{margin}"
    else:
        verdict, rule = INCONCLUSIVE, f"bounds [{p.lower:+.4f}, {p.upper:+.4f}] straddle -{margin}"
    result = BenchmarkResult(
        benchmark=benchmark, filter=pairs[0][0]["filter"], n_items=len(items), repeats=repeats,
        reference=ref_ci, candidate=cand_ci, delta=p.delta, se=p.se, lower=p.lower, upper=p.upper,
        normal_lower=p.normal_lower, normal_upper=p.normal_upper, margin=margin, confidence=confidence,
        verdict=verdict, rule=rule, required=bool(rules.get("required", True)),
        decidable=not too_broken and len(items) >= min_items, infra=infra)
    binary = repeats == 1 and set(np.unique(np.concatenate([ref_scores, cand_scores]))) <= {0.0, 1.0}
    if binary:
        b, c = discordance(ref_scores, cand_scores)
        result.discordant_ref_only, result.discordant_cand_only, result.mcnemar_p = b, c, mcnemar_exact_p(b, c)
    if verdict == INCONCLUSIVE and not too_broken:
        result.items_to_decide = items_to_decide(p.sd, margin, confidence)
    if strata is not None:
        result.per_stratum = per_domain
    elif repeats > 1:
        result.per_stratum = _per_stratum(pairs, "repeat")
    if rerun_rows is not None:
        result.noise = noise_floor(ref_rows, rerun_rows, cand_rows)
    return result


def noise_floor(ref_rows: list[dict], rerun_rows: list[dict], cand_rows: list[dict]) -> dict:
    """Reference-vs-reference discordance (a server's "greedy" is not bit-exact under batching)
    against candidate-vs-reference discordance: with d_noise and d_cand discordant items, the
    candidate is "within noise" when d_cand is not more than Binomial(d_noise + d_cand, 1/2) allows."""
    rerun_pairs = pair(ref_rows, rerun_rows)
    _, ref, _ = _item_scores([a for a, _ in rerun_pairs])
    _, rerun, _ = _item_scores([b for _, b in rerun_pairs])
    _, cand, _ = _item_scores([b for _, b in pair(ref_rows, cand_rows)])
    d_noise, d_cand = int((ref != rerun).sum()), int((ref != cand).sum())
    from scipy.stats import binom

    p = float(binom.sf(d_cand - 1, d_noise + d_cand, 0.5)) if d_noise + d_cand else 1.0
    return {"reference_self_discordant": d_noise, "candidate_discordant": d_cand, "n": len(ref),
            "p_more_than_noise": p, "within_noise": p > 0.05}


def accuracy_gate(candidate: Path, reference: Path, policy: dict, margins: dict[str, float] | None = None,
                  reference_rerun: Path | None = None) -> dict:
    """Per-benchmark results and the overall verdict. Raises BundleError on mismatched bundles."""
    policy = {**policy, "benchmarks": {k: dict(v) for k, v in policy["benchmarks"].items()}}
    for bench, margin in (margins or {}).items():
        policy["benchmarks"].setdefault(bench, {"required": True, "floor": None})["margin"] = margin
    cand_run, cand_rows = read_bundle(candidate)
    ref_run, ref_rows = read_bundle(reference)
    rerun_rows = read_bundle(reference_rerun)[1] if reference_rerun else None
    cand_b, ref_b = set(cand_run["benchmarks"]), set(ref_run["benchmarks"])
    if cand_b != ref_b:
        raise BundleError(f"the bundles cover different benchmarks: candidate {sorted(cand_b)}, reference {sorted(ref_b)}")
    results = []
    for bench in sorted(cand_b):
        primary = ref_run["benchmarks"][bench].get("primary_filter", "flexible-extract")
        if cand_run["benchmarks"][bench].get("primary_filter", primary) != primary:
            raise BundleError(f"{bench}: the runs score with different filters")
        for label, run in (("candidate", cand_run), ("reference", ref_run)):
            other = ref_run if label == "candidate" else cand_run
            mine, theirs = run["benchmarks"][bench].get("dataset"), other["benchmarks"][bench].get("dataset")
            if mine and theirs and mine["files"] != theirs["files"]:
                raise BundleError(f"{bench}: the runs used different data files (sha256 differ); rerun on the same data")
        if bench == "tau2":
            differences = tau2_gate.arm_differences(ref_run["benchmarks"][bench], cand_run["benchmarks"][bench])
            if differences:
                raise BundleError("tau2: the arms were run with different settings, so their delta would not be the "
                                  "model's: " + "; ".join(differences) + ". Rerun one arm with the other's settings")
        select = lambda rows: [r for r in rows if r["benchmark"] == bench and r["filter"] == primary]  # noqa: E731
        results.append(compare_benchmark(bench, select(ref_rows), select(cand_rows), policy,
                                         select(rerun_rows) if rerun_rows else None))
    blocking = []
    for r in results:
        mode = policy["benchmarks"].get(r.benchmark, {}).get("inconclusive", "block")
        if r.verdict == FAIL and r.required:
            blocking.append(f"{r.benchmark}: FAIL ({r.rule})")
        elif r.verdict == INCONCLUSIVE and r.required and (mode == "block" or not r.decidable):
            blocking.append(f"{r.benchmark}: INCONCLUSIVE ({r.rule}"
                            + (f"; ~{r.items_to_decide} items would decide it)" if r.items_to_decide else ")"))
    verdict = FAIL if any(r.verdict == FAIL and r.required for r in results) else (
        INCONCLUSIVE if blocking else PASS)
    return {"verdict": verdict, "blocking": blocking, "candidate": str(candidate), "reference": str(reference),
            "policy": policy, "benchmarks": [asdict(r) for r in results]}


def unpaired_against_reference(candidate: Path, reference_table: Path) -> list[dict]:
    """The weaker comparison against published summary scores (no per-item pairing possible)."""
    table = yaml.safe_load(Path(reference_table).read_text())
    run, rows = read_bundle(candidate)
    out = []
    for bench, ref in table["benchmarks"].items():
        if bench not in run["benchmarks"]:
            continue
        primary = run["benchmarks"][bench].get("primary_filter", "flexible-extract")
        _, scores, strata = _item_scores([r for r in rows if r["benchmark"] == bench and r["filter"] == primary])
        # tau2: the macro over domains, the number the table reports; else the normal interval the seed used
        mean, low, high = macro_interval(scores, strata) if strata is not None else mean_ci(scores)
        se_c = (high - low) / 2 / 1.959964 if np.isfinite(high) else float("nan")
        se = float(np.hypot(se_c, ref["se"])) if ref.get("se") else float("nan")
        out.append({"benchmark": bench, "kind": "UNPAIRED (weaker: summary scores only)", "reference": ref["score"],
                    "candidate": mean, "delta": mean - ref["score"], "se": se,
                    "ci95": [mean - ref["score"] - 1.96 * se, mean - ref["score"] + 1.96 * se]})
    return out
