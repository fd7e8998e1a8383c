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
from evals.stats import discordance, items_to_decide, mcnemar_exact_p, mean_ci, paired_delta
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
    floor = rules.get("floor")
    cand_mean = float(cand_scores.mean())
    if floor is not None and cand_mean < floor:
        verdict, rule = FAIL, f"candidate score {cand_mean:.4f} is below the floor {floor}"
    elif p.lower > -margin:
        verdict, rule = PASS, f"one-sided {confidence:.0%} lower bound {p.lower:+.4f} > -{margin}"
    elif p.upper < -margin:
        verdict, rule = FAIL, f"one-sided {confidence:.0%} upper bound {p.upper:+.4f} < -{margin}"
    else:
        verdict, rule = INCONCLUSIVE, f"bounds [{p.lower:+.4f}, {p.upper:+.4f}] straddle -{margin}"
    ci = lambda s: dict(zip(("score", "ci_low", "ci_high"), mean_ci(s, 0.95)))  # noqa: E731
    result = BenchmarkResult(
        benchmark=benchmark, filter=pairs[0][0]["filter"], n_items=len(items), repeats=repeats,
        reference=ci(ref_scores), candidate=ci(cand_scores), delta=p.delta, se=p.se, lower=p.lower, upper=p.upper,
        normal_lower=p.normal_lower, normal_upper=p.normal_upper, margin=margin, confidence=confidence,
        verdict=verdict, rule=rule, required=bool(rules.get("required", True)))
    binary = repeats == 1 and set(np.unique(np.concatenate([ref_scores, cand_scores]))) <= {0.0, 1.0}
    if binary:
        b, c = discordance(ref_scores, cand_scores)
        result.discordant_ref_only, result.discordant_cand_only, result.mcnemar_p = b, c, mcnemar_exact_p(b, c)
    if verdict == INCONCLUSIVE:
        result.items_to_decide = items_to_decide(p.sd, margin, confidence)
    strat_key = "domain" if strata is not None else ("repeat" if repeats > 1 else None)
    if strat_key:
        result.per_stratum = _per_stratum(pairs, strat_key)
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
        select = lambda rows: [r for r in rows if r["benchmark"] == bench and r["filter"] == primary]  # noqa: E731
        results.append(compare_benchmark(bench, select(ref_rows), select(cand_rows), policy,
                                         select(rerun_rows) if rerun_rows else None))
    blocking = []
    for r in results:
        mode = policy["benchmarks"].get(r.benchmark, {}).get("inconclusive", "block")
        if r.verdict == FAIL and r.required:
            blocking.append(f"{r.benchmark}: FAIL ({r.rule})")
        elif r.verdict == INCONCLUSIVE and r.required and mode == "block":
            blocking.append(f"{r.benchmark}: INCONCLUSIVE ({r.rule}; ~{r.items_to_decide} items would decide it)")
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
        _, scores, _ = _item_scores([r for r in rows if r["benchmark"] == bench and r["filter"] == primary])
        mean, low, high = mean_ci(scores)
        se_c = (high - low) / 2 / 1.959964 if np.isfinite(high) else float("nan")
        se = float(np.hypot(se_c, ref["se"])) if ref.get("se") else float("nan")
        out.append({"benchmark": bench, "kind": "UNPAIRED (weaker: summary scores only)", "reference": ref["score"],
                    "candidate": mean, "delta": mean - ref["score"], "se": se,
                    "ci95": [mean - ref["score"] - 1.96 * se, mean - ref["score"] + 1.96 * se]})
    return out
