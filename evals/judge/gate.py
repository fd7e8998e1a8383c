"""The accuracy gate and the release verdict: every verdict of ``gate`` is made here.

Per benchmark, a paired candidate-vs-reference comparison judged against the policy
(``evals.judge.policy``): PASS when the one-sided lower bound of the paired delta is above -margin (and
no absolute floor is broken); FAIL when the upper bound is below -margin or the floor is broken;
INCONCLUSIVE otherwise, with what would decide it at the observed per-item spread: more items
while the benchmark has them, else more repeats at the same temperature, and the margin the
current data certifies (``stats.guidance``).

Only comparable runs are compared. Each benchmark entry of ``run.json`` carries ``settings``:
everything that defines its measurement (API, generation budget, sampling, few-shot sampler and
seed, stop sequences, request timeout, ...; a benchmark declares its own, e.g. tau2's user
simulator). Two runs whose settings differ, or whose prompts differ item by item
(``prompt_hash``), are refused naming each difference, unless the caller allows it; the result
then says so. Different data, items or scoring filters are always refused.

The overall verdict needs every required benchmark compared: one left out blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from evals.bundle import RUN_JSON, BundleError, pair, read_bundle
from evals.errors import BadInput, Refused
from evals.judge import binding, design, render, tau2_gate
from evals.judge.plan_file import plan_under_policy
from evals.judge.policy import BenchmarkPolicy, GatePolicy
from evals.judge.reference_table import load_reference_table
from evals.judge.stats import (
    NOISE_ALPHA,
    Paired,
    discordance,
    guidance,
    macro_interval,
    mcnemar_exact_p,
    mean_ci,
    noise_floor_p,
    paired_delta,
    unpaired_delta,
    wilson_interval,
    z_two_sided,
)

if TYPE_CHECKING:
    from quant.verify import Report

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
RELEASE, BLOCK = "RELEASE", "BLOCK"
DEFAULT_FILTER = "flexible-extract"
# Items each benchmark has at most, so the gate never asks for more than exist: GPQA-Diamond's
# questions, GSM8K's test split, tau2-bench's tasks (airline 50 + retail 114 + telecom 114), and
# the built-in example's arith test split (evals/benchmarks/data/arith/test.jsonl).
BENCHMARK_ITEMS = {"gpqa_diamond": 198, "gsm8k": 1319, "tau2": 278, "arith": 250}


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
    bound_method: str  # how the lower bound was obtained (stats.paired_delta)
    margin: float
    confidence: float
    verdict: str
    rule: str
    required: bool
    agreement: dict  # (item, repeat) outcomes: both_right, reference_only, candidate_only, both_wrong
    discordant_ref_only: int | None = None  # b: reference right, candidate wrong (per item, single repeat)
    discordant_cand_only: int | None = None  # c
    mcnemar_p: float | None = None
    items_to_decide: int | None = None
    guidance: dict | None = None  # stats.Guidance of an INCONCLUSIVE result: items, repeats or a margin
    per_stratum: dict | None = None  # GPQA per seed, tau2 per domain
    noise: dict | None = None
    setting_differences: list[str] | None = None  # set only when compared despite them
    decidable: bool = True  # False: too few items or too many infrastructure errors to judge at all
    infra: dict | None = None  # tau2: infrastructure errors per arm
    look: dict | None = None  # a planned run: its look, the level it was judged at, whether final (evals.judge.design)


def _item_scores(rows: list[dict]) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """Items in a stable order, their mean score over repeats, and their stratum (tau2 domain)."""
    by_item: dict[str, list[float]] = {}
    strata: dict[str, str] = {}
    for r in rows:
        by_item.setdefault(r["item_id"], []).append(r["score"])
        if "domain" in r:
            strata[r["item_id"]] = r["domain"]
    items = sorted(by_item)
    scores = np.array([sum(by_item[i]) / len(by_item[i]) for i in items])  # not np.mean: 1000s of tiny lists
    return items, scores, (np.array([strata[i] for i in items]) if strata else None)


def _delta_matrix(pairs: list[tuple[dict, dict]]) -> np.ndarray:
    """Items x repeats of paired deltas (candidate - reference, same item and repeat); items with
    a missing repeat are left out (the repeats of the others still show the between-repeat noise)."""
    by_item: dict[str, dict[int, float]] = {}
    for ref, cand in pairs:
        by_item.setdefault(ref["item_id"], {})[ref["repeat"]] = cand["score"] - ref["score"]
    repeats = sorted({r for d in by_item.values() for r in d})
    rows = [[d[r] for r in repeats] for d in by_item.values() if len(d) == len(repeats)]
    return np.array(rows, dtype=float).reshape(len(rows), len(repeats))


def _per_stratum(pairs: list[tuple[dict, dict]], key: str) -> dict:
    out: dict = {}
    for ref, cand in pairs:
        s = out.setdefault(str(ref.get(key)), {"reference": [], "candidate": []})
        s["reference"].append(ref["score"])
        s["candidate"].append(cand["score"])
    return {k: {"n": len(v["reference"]), "reference": float(np.mean(v["reference"])),
                "candidate": float(np.mean(v["candidate"])),
                "delta": float(np.mean(v["candidate"]) - np.mean(v["reference"]))} for k, v in sorted(out.items())}


def _agreement(pairs: list[tuple[dict, dict]]) -> dict:
    """Outcome counts over paired (item, repeat) rows; a score of 0.5 or more counts as right."""
    counts = {"both_right": 0, "reference_only": 0, "candidate_only": 0, "both_wrong": 0}
    names = {(True, True): "both_right", (True, False): "reference_only", (False, True): "candidate_only",
             (False, False): "both_wrong"}
    for ref, cand in pairs:
        counts[names[ref["score"] >= 0.5, cand["score"] >= 0.5]] += 1
    return counts


def _bounds(pairs: list[tuple[dict, dict]], confidence: float, policy: GatePolicy) -> Paired:
    """The paired delta of (reference, candidate) rows with its bounds (``stats.paired_delta``)."""
    _, ref, strata = _item_scores([a for a, _ in pairs])
    _, cand, _ = _item_scores([b for _, b in pairs])
    return paired_delta(ref, cand, confidence, policy.bootstrap.resamples, policy.bootstrap.seed, strata)


def _rule(p: Paired, rules, cand_score: float, n_items: int, confidence: float) -> tuple[str, str]:
    """The verdict of the bounds alone, and the rule that decided it."""
    margin = rules.margin
    if n_items < rules.min_items:
        return INCONCLUSIVE, f"{n_items} items, below the policy's minimum of {rules.min_items} to judge"
    if rules.floor is not None and cand_score < rules.floor:
        return FAIL, f"candidate score {cand_score:.4f} is below the floor {rules.floor}"
    lower, upper = render.versus(p.lower, -margin), render.versus(p.upper, -margin)  # a hair from it shows
    if p.lower > -margin:
        return PASS, f"one-sided {confidence:.0%} lower bound {lower} > -{margin} ({p.method})"
    if p.upper < -margin:
        return FAIL, f"one-sided {confidence:.0%} upper bound {upper} < -{margin}"
    return INCONCLUSIVE, f"bounds [{lower}, {upper}] straddle -{margin} ({p.method})"


def judge(ref: np.ndarray, cand: np.ndarray, strata: np.ndarray | None, rules: BenchmarkPolicy,
          policy: GatePolicy) -> tuple[Paired, str, str]:
    """``(bounds, verdict, rule)`` of per-item scores (repeats averaged; tau2: with their domains) by
    a benchmark's rules, before infrastructure errors are weighed. Every comparison is decided here
    (``tests/benchmarks/sim_gate.py`` measures this function's error rates)."""
    p = paired_delta(ref, cand, policy.confidence, policy.bootstrap.resamples, policy.bootstrap.seed, strata)
    score = float(cand.mean()) if strata is None else float(np.mean([cand[strata == s].mean() for s in np.unique(strata)]))
    return (p, *_rule(p, rules, score, len(ref), policy.confidence))


def _infra_verdict(verdict: str, rule: str, kept: list, dropped: list, breaches: list[str], margin: float,
                   confidence: float, policy: GatePolicy) -> tuple[str, str, bool]:
    """``(verdict, rule, decidable)`` once the pairs dropped for infrastructure errors are weighed:
    above the ceiling the measurement failed (INCONCLUSIVE) unless the candidate fails even with
    every dropped pair scored in its favour; below it, a PASS or FAIL the dropped pairs could
    overturn is INCONCLUSIVE. ``evals run --resume`` runs the errored simulations again."""
    rerun = "rerun them with `evals run --resume` (it runs infrastructure errors again)"
    best = _bounds(kept + tau2_gate.scored_as(dropped, 0.0, 1.0), confidence, policy) if dropped else None
    if breaches:
        if verdict == FAIL and best.upper < -margin:
            return FAIL, ("; ".join(breaches) + f", yet even with the {len(dropped)} dropped pairs scored in the "
                          f"candidate's favour the one-sided upper bound {render.versus(best.upper, -margin)} stays below -{margin}"), True
        return INCONCLUSIVE, "; ".join(breaches) + ": the measurement failed, not the model; fix the serving and " + rerun, False
    if verdict == PASS:
        worst = _bounds(kept + tau2_gate.scored_as(dropped, 1.0, 0.0), confidence, policy)
        if worst.lower <= -margin:
            return INCONCLUSIVE, (f"{rule}, but the {len(dropped)} (task, trial) pairs dropped for infrastructure errors "
                                  f"could overturn it (scored as losses the lower bound is {render.versus(worst.lower, -margin)}); {rerun}"), False
    if verdict == FAIL and best.upper >= -margin:
        return INCONCLUSIVE, (f"{rule}, but the {len(dropped)} (task, trial) pairs dropped for infrastructure errors "
                              f"could overturn it (scored as gains the upper bound is {render.versus(best.upper, -margin)}); {rerun}"), False
    return verdict, rule, True


def greedy_decoding(benchmark: str, entry: dict | None = None) -> bool:
    """Whether a repeat reproduces the answers (temperature 0), so no guidance asks for another: as the
    run recorded its sampling (``settings``: lm-eval's ``do_sample`` and ``temperature``), else as the
    benchmark's protocol decodes (``design.MAX_REPEATS``: one repeat for the greedy ones; tau2's trials
    vary through its user simulator)."""
    settings = (entry or {}).get("settings") or {}
    if "do_sample" in settings or "temperature" in settings:
        return settings.get("do_sample") is False or settings.get("temperature") == 0
    return design.MAX_REPEATS.get(benchmark) == 1


def compare_benchmark(benchmark: str, pairs: list[tuple[dict, dict]], policy: GatePolicy,
                      rerun_pairs: list[tuple[dict, dict]] | None = None,
                      greedy: bool | None = None) -> BenchmarkResult:
    """The paired comparison of one benchmark's (reference, candidate) rows, judged by the policy.

    ``policy.confidence`` is the level of the one-sided bounds; a caller judging repeated looks at
    one run passes a policy with the adjusted level (``policy.model_copy``). ``greedy``: whether
    repeats reproduce the answers (default: as the benchmark's protocol decodes, ``greedy_decoding``)."""
    rules = policy.of(benchmark)
    confidence, margin = policy.confidence, rules.margin
    infra, breaches, kept, dropped = None, [], pairs, []
    if rules.max_infra_error_rate is not None or any(a.get("infra_error") or b.get("infra_error") for a, b in pairs):
        infra, breaches = tau2_gate.infra_report(pairs, rules.max_infra_error_rate)
        kept, dropped = tau2_gate.split_infra(pairs)
    pairs = kept or pairs  # nothing left to pair: the numbers are the recorded ones, the verdict INCONCLUSIVE
    items, ref_scores, strata = _item_scores([a for a, _ in pairs])
    _, cand_scores, _ = _item_scores([b for _, b in pairs])
    resamples, seed = policy.bootstrap.resamples, policy.bootstrap.seed
    p, verdict, rule = judge(ref_scores, cand_scores, strata, rules, policy)
    repeats = len({a["repeat"] for a, _ in pairs})
    if strata is not None:  # tau2: the macro over domains, as the benchmark reports it
        ref_ci, cand_ci, per_domain = tau2_gate.macro_table(ref_scores, cand_scores, strata, confidence, resamples, seed)
    else:
        ref_ci, cand_ci = (dict(zip(("score", "ci_low", "ci_high"), wilson_interval(s))) for s in (ref_scores, cand_scores))
    decidable = len(items) >= rules.min_items
    if dropped or breaches:
        verdict, rule, infra_decidable = _infra_verdict(verdict, rule, kept, dropped,
                                                        breaches, margin, confidence, policy)
        decidable = decidable and infra_decidable
    result = BenchmarkResult(
        benchmark=benchmark, filter=pairs[0][0]["filter"], n_items=len(items), repeats=repeats,
        reference=ref_ci, candidate=cand_ci, delta=p.delta, se=p.se, lower=p.lower, upper=p.upper,
        normal_lower=p.normal_lower, normal_upper=p.normal_upper, bound_method=p.method, margin=margin, confidence=confidence,
        verdict=verdict, rule=rule, required=rules.required, agreement=_agreement(pairs),
        decidable=decidable, infra=infra)
    binary = repeats == 1 and set(np.unique(np.concatenate([ref_scores, cand_scores]))) <= {0.0, 1.0}
    if binary:
        b, c = discordance(ref_scores, cand_scores)
        result.discordant_ref_only, result.discordant_cand_only, result.mcnemar_p = b, c, mcnemar_exact_p(b, c)
    if verdict == INCONCLUSIVE and result.decidable:  # the bounds straddle the margin: what would settle it
        g = guidance(_delta_matrix(pairs), p, margin, confidence, BENCHMARK_ITEMS.get(benchmark),
                     greedy=greedy_decoding(benchmark) if greedy is None else greedy)
        result.items_to_decide = g.items_needed
        result.guidance = asdict(g)
    if strata is not None:
        result.per_stratum = per_domain
    elif repeats > 1:
        result.per_stratum = _per_stratum(pairs, "repeat")
    if rerun_pairs is not None:
        result.noise = noise_floor(rerun_pairs, pairs)
    return result


def noise_floor(rerun_pairs: list[tuple[dict, dict]], pairs: list[tuple[dict, dict]]) -> dict:
    """Reference-vs-reference discordance (a server's "greedy" is not bit-exact under batching)
    against candidate-vs-reference discordance, on the same items (``stats.noise_floor_p``)."""
    _, ref, _ = _item_scores([a for a, _ in rerun_pairs])
    _, rerun, _ = _item_scores([b for _, b in rerun_pairs])
    _, cand, _ = _item_scores([b for _, b in pairs])
    d_noise, d_cand = int((ref != rerun).sum()), int((ref != cand).sum())
    p = noise_floor_p(d_noise, d_cand)
    return {"reference_self_discordant": d_noise, "candidate_discordant": d_cand, "n": len(ref),
            "p_more_than_noise": p, "within_noise": p > NOISE_ALPHA}


def setting_differences(benchmark: str, reference: dict, candidate: dict,
                        pairs: list[tuple[dict, dict]]) -> list[str]:
    """Each way two runs of ``benchmark`` measured differently: the settings the benchmark declares
    (lm-eval benchmarks: their recorded ``settings``, key by key; tau2: ``tau2_gate.COMPARED``), and
    the prompts item by item (``prompt_hash``)."""
    if benchmark == "tau2":
        ref_s = cand_s = None
        out = [f"tau2: {d}" for d in tau2_gate.arm_differences(reference, candidate)]
    else:
        ref_s, cand_s = reference.get("settings"), candidate.get("settings")
        out = []
    if benchmark != "tau2" and (ref_s is None) != (cand_s is None):
        out.append(f"{benchmark}: settings recorded only in the {'reference' if ref_s is not None else 'candidate'} "
                   "run (the other predates settings recording); rerun it")
    for key in sorted((ref_s or {}).keys() | (cand_s or {}).keys()) if ref_s is not None and cand_s is not None else []:
        if ref_s.get(key, "(unrecorded)") != cand_s.get(key, "(unrecorded)"):
            out.append(f"{benchmark}: {key}: reference {json.dumps(ref_s.get(key, '(unrecorded)'))}, "
                       f"candidate {json.dumps(cand_s.get(key, '(unrecorded)'))}")
    differ = [a["item_id"] for a, b in pairs if a["prompt_hash"] != b["prompt_hash"]]
    if differ:
        items = len({a["item_id"] for a, _ in pairs})
        out.append(f"{benchmark}: prompt_hash: the prompts differ on {len(set(differ))} of {items} items "
                   f"(e.g. item {differ[0]})")
    return out


def _select(rows: list[dict], benchmark: str, filter_: str) -> list[dict]:
    return [r for r in rows if r["benchmark"] == benchmark and r["filter"] == filter_]


def _check_same_data(bench: str, ref_entry: dict, cand_entry: dict) -> str:
    primary = ref_entry.get("primary_filter", DEFAULT_FILTER)
    if cand_entry.get("primary_filter", DEFAULT_FILTER) != primary:
        raise BundleError(f"{bench}: the runs score with different filters: reference {primary}, "
                          f"candidate {cand_entry.get('primary_filter', DEFAULT_FILTER)}")
    ref_data, cand_data = ref_entry.get("dataset"), cand_entry.get("dataset")
    if ref_data and cand_data and ref_data["files"] != cand_data["files"]:
        raise BundleError(f"{bench}: the runs used different data files (sha256 differ: reference "
                          f"{ref_data['files']}, candidate {cand_data['files']}); rerun on the same data")
    return primary


def _observed_look(look: dict, bench: str, plan: dict, pairs: list[tuple[dict, dict]], alpha: float) -> dict:
    """``look`` judged at the level its observed information gives (``design.observed_levels``), with
    the looks so far recorded (their repeats, information fractions and levels)."""
    kept = [(a, b) for a, b in pairs if not (a.get("infra_error") or b.get("infra_error"))] or pairs
    items, _, ref = design.arm_matrix([a for a, _ in kept])
    _, _, cand = design.arm_matrix([b for _, b in kept])
    domains = {a["item_id"]: a["domain"] for a, _ in kept if "domain" in a}
    strata = np.array([domains[i] for i in items]) if domains else None
    levels = design.observed_levels(bench, plan["benchmarks"][bench], alpha, ref, cand, strata)
    return {**look, "confidence": levels[-1]["confidence"], "observed": levels}


def accuracy_gate(candidate: Path, reference: Path, policy: GatePolicy, reference_rerun: Path | None = None, *,
                  allow_setting_differences: bool = False, benchmarks: list[str] | None = None) -> dict:
    """Per-benchmark results and the overall verdict.

    ``benchmarks`` limits the comparison (and so the verdict) to those named, each of which then
    decides it as a required benchmark would; otherwise every
    benchmark of the bundles is compared and every benchmark the policy requires must be among
    them. Raises BundleError on bundles that cannot pair, Refused on runs measured differently.
    """
    ref_run, ref_rows = read_bundle(reference)
    cand_run, cand_rows = read_bundle(candidate)
    binding.distinct_arms(candidate, reference, cand_run, ref_run)
    rerun = read_bundle(reference_rerun) if reference_rerun else None
    ref_b, cand_b = set(ref_run["benchmarks"]), set(cand_run["benchmarks"])
    if benchmarks:
        missing = sorted(set(benchmarks) - (ref_b & cand_b))
        if missing:
            raise BadInput(f"--benchmarks {','.join(benchmarks)}: {missing} not in both runs (reference has "
                           f"{sorted(ref_b)}, candidate {sorted(cand_b)})")
        compared = sorted(set(benchmarks))
    elif ref_b != cand_b:
        raise BundleError(f"the bundles cover different benchmarks: reference {sorted(ref_b)}, candidate "
                          f"{sorted(cand_b)}; compare the common ones with --benchmarks")
    else:
        compared = sorted(ref_b)
    if rerun and not set(compared) <= set(rerun[0]["benchmarks"]):
        raise BundleError(f"the reference rerun lacks {sorted(set(compared) - set(rerun[0]['benchmarks']))}")
    all_pairs, differences = {}, {}
    # a run made by `evals run --plan` is judged at its looks, at levels from the policy (never the bundle's)
    plan = plan_under_policy(cand_run.get("plan"), policy, f"{Path(candidate) / RUN_JSON}: plan")
    for bench in compared:
        primary = _check_same_data(bench, ref_run["benchmarks"][bench], cand_run["benchmarks"][bench])
        ref_sel, cand_sel = _select(ref_rows, bench, primary), _select(cand_rows, bench, primary)
        if bench in plan["benchmarks"]:
            ref_sel = design.restrict_reference(ref_sel, cand_sel)
        all_pairs[bench] = pair(ref_sel, cand_sel)
        if not all_pairs[bench]:
            raise BundleError(f"{bench}: no rows scored with the {primary} filter in either run")
        found = setting_differences(bench, ref_run["benchmarks"][bench], cand_run["benchmarks"][bench],
                                    all_pairs[bench])
        if found:
            differences[bench] = found
    if differences and not allow_setting_differences:
        lines = [d for found in differences.values() for d in found]
        raise Refused("the runs are not comparable: they measured differently\n  " + "\n  ".join(lines) +
                      "\nRerun one arm with the other's settings; or pass --allow-setting-differences to compare "
                      "them anyway (the result is then labelled as such)")
    results = []
    for bench in compared:
        rerun_pairs = None
        if rerun:
            primary = all_pairs[bench][0][0]["filter"]
            ref_sel, rerun_sel = _select(ref_rows, bench, primary), _select(rerun[1], bench, primary)
            if bench in plan["benchmarks"]:  # the noise floor over the look's items and repeats
                cand_sel = [b for _, b in all_pairs[bench]]
                ref_sel, rerun_sel = (design.restrict_reference(rows, cand_sel) for rows in (ref_sel, rerun_sel))
            rerun_pairs = pair(ref_sel, rerun_sel)
        look = None
        if bench in plan["benchmarks"]:
            look = design.planned_look(plan, bench, len({a["item_id"] for a, _ in all_pairs[bench]}),
                                       len({a["repeat"] for a, _ in all_pairs[bench]}), policy.confidence)
            if look["follows"]:  # the level spends alpha on the information observed, not the plan's guess of it
                look = _observed_look(look, bench, plan, all_pairs[bench], 1 - policy.confidence)
        level = policy.model_copy(update={"confidence": look["confidence"]}) if look and look["follows"] else policy
        result = compare_benchmark(bench, all_pairs[bench], level, rerun_pairs,
                                   greedy_decoding(bench, ref_run["benchmarks"][bench]))
        if look:
            design.judge_look(result, look)
        result.setting_differences = differences.get(bench)
        # A benchmark the caller names decides the scoped verdict even where the policy makes it optional:
        # `gate accuracy --benchmarks arith` on a FAIL must not exit 0.
        result.required = result.required or bool(benchmarks)
        results.append(result)
    blocking = []
    for r in results:
        if r.verdict == FAIL and r.required:
            blocking.append(f"{r.benchmark}: FAIL ({r.rule})")
        elif r.verdict == INCONCLUSIVE and r.required and (policy.of(r.benchmark).inconclusive == "block"
                                                           or not r.decidable):
            blocking.append(f"{r.benchmark}: INCONCLUSIVE ({r.rule}"
                            + (f"; {render.guidance(r.guidance)})" if r.guidance else ")"))
    not_compared = [] if benchmarks else [b for b in policy.required if b not in compared]
    blocking += [f"{b}: required by the policy but not compared (the runs do not hold it)" for b in not_compared]
    verdict = FAIL if any(r.verdict == FAIL and r.required for r in results) else (
        INCONCLUSIVE if blocking else PASS)
    return {"verdict": verdict, "blocking": blocking, "candidate": str(candidate), "reference": str(reference),
            "scope": compared if benchmarks else None, "not_compared": not_compared,
            "setting_differences": differences or None, "policy": policy.to_dict(),
            "benchmarks": [asdict(r) for r in results]}


def release_verdict(structure: Report, accuracy: dict, kernels: dict | None = None,
                    load: dict | None = None) -> tuple[str, list[str]]:
    """RELEASE only when the checkpoint loads correctly in every engine, the accuracy gate passes on
    every required benchmark, (when the policy makes kernels blocking) every MoE shape has a tuned
    kernel, and (when load sweeps are given) the serving-load gate passes; otherwise BLOCK with the
    reasons."""
    reasons = [f"structure: {engine} would not load it correctly ({len(found)} problem(s))"
               for engine in structure.engines if (found := structure.for_engine(engine))]
    if accuracy["scope"]:
        reasons.append("accuracy: a release verdict needs every benchmark of the policy compared, not a scope")
    if accuracy["verdict"] != PASS:
        reasons += [f"accuracy: {b}" for b in accuracy["blocking"]] or [f"accuracy: {accuracy['verdict']}"]
    if kernels and kernels["blocking"] and not kernels["ok"]:
        reasons.append(f"kernels: {kernels['summary']}")
    if load and load["verdict"] != PASS:
        reasons.append(f"load: {load['verdict']} ({load['why']})")
    return (BLOCK if reasons else RELEASE), reasons


def release_report(checkpoint: Path, structure: Report, accuracy: dict, kernels: dict | None = None,
                   load: dict | None = None, provenance: dict | None = None) -> dict:
    """The release verdict with everything it rests on; ``provenance`` (``binding.provenance``): the
    policy, tool, date, recipe and both arms' checkpoint hashes. ``structure`` is ``gate checkpoint``'s
    report as its type, read by its fields; the returned dict is report.json's content."""
    verdict, reasons = release_verdict(structure, accuracy, kernels, load)
    return {"verdict": verdict, "reasons": reasons, "checkpoint": str(checkpoint), "provenance": provenance,
            "structure": structure.to_dict(), "accuracy": accuracy, "kernels": kernels, "load": load}


def unpaired_against_reference(candidate: Path, reference_table: Path) -> list[dict]:
    """The weaker comparison against published summary scores (no per-item pairing possible)."""
    published = load_reference_table(Path(reference_table)).benchmarks
    run, rows = read_bundle(candidate)
    out = []
    for bench, ref in published.items():
        if bench not in run["benchmarks"]:
            continue
        primary = run["benchmarks"][bench].get("primary_filter", DEFAULT_FILTER)
        _, scores, strata = _item_scores(_select(rows, bench, primary))
        # tau2: the macro over domains, the number the table reports; else the normal interval the Wafer write-up used
        mean, low, high = macro_interval(scores, strata) if strata is not None else mean_ci(scores)
        se = (high - low) / 2 / z_two_sided() if np.isfinite(high) else float("nan")
        u = unpaired_delta(mean, se, ref.score, ref.se)
        out.append({"benchmark": bench, "kind": "UNPAIRED (weaker: summary scores only)", "reference": ref.score,
                    "candidate": mean, "delta": u.delta, "se": u.se, "ci95": [u.low, u.high]})
    return out
