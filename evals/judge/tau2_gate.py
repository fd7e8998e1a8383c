"""What the accuracy gate does differently for tau2: arms must share their settings, the score is
the macro over domains with its own interval, each domain gets a row, and infrastructure errors
are held against an arm.

- Comparable arms: the user simulator (model and sampling args; not its address), the agent's
  sampling args (temperature, seed, generation budget), trials, step and error limits, tau2's run
  seed, the task split, the domains and tau2's version, where both bundles record them. Any
  difference is a refusal naming each one: a different user simulator or step limit changes what
  a task asks of the model, so the delta would not be the quantization's.
- The macro: unweighted mean of the per-domain pass^1 (as tau2-bench results are reported), with
  a two-sided percentile interval from resampling tasks within each domain (stays inside [0, 1]);
  per domain: Wilson intervals per arm, the paired delta and its one-sided bootstrap bounds.
- Infrastructure errors (``infra_error`` on rows; see ``evals.tau2``) never decide a verdict: a
  (task, trial) pair where either arm had one is dropped from both arms (scored as a failure of the
  arm that had it, 13 airline errors failed an identical candidate and passed one 4.7 points worse).
  The policy's ``max_infra_error_rate`` applies per arm and per domain (13 errors are 4.7% of 278
  tasks but 26% of airline's 50); above it the measurement, not the model, failed: INCONCLUSIVE
  unless the candidate fails even with every dropped pair scored in its favour. Below it, a verdict
  the dropped pairs could overturn (scored all against, or all for, the candidate) is INCONCLUSIVE
  too. Either way ``evals run --resume`` runs the errored simulations again.
"""

from __future__ import annotations

import numpy as np

from evals.judge.stats import REPORTED_CONFIDENCE, macro_interval, paired_delta, wilson_interval

COMPARED = ("user_llm", "user_llm_args", "agent_llm_args", "num_trials", "max_steps", "max_errors", "seed",
            "task_split", "tau2_version", "domains")


def arm_differences(reference: dict, candidate: dict) -> list[str]:
    """Each setting that differs between two run.json ``tau2`` entries, as ``name: reference X, candidate Y``."""
    out = []
    for key in COMPARED:
        if key not in reference or key not in candidate:
            continue
        ref, cand = reference[key], candidate[key]
        if key == "domains":  # a list (settings) or a dict of per-domain summaries
            ref, cand = sorted(ref), sorted(cand)
        if ref != cand:
            out.append(f"{key}: reference {ref!r}, candidate {cand!r}")
    return out


def infra_counts(rows: list[dict]) -> dict:
    errors = sum(1 for r in rows if r.get("infra_error"))
    return {"errors": errors, "simulations": len(rows), "rate": errors / len(rows) if rows else None,
            "retries": sum(int(r.get("retries") or 0) for r in rows)}


def split_infra(pairs: list[tuple[dict, dict]]) -> tuple[list[tuple[dict, dict]], list[tuple[dict, dict]]]:
    """``(kept, dropped)``: a (task, trial) pair is dropped when either arm had an infrastructure error."""
    kept = [(a, b) for a, b in pairs if not (a.get("infra_error") or b.get("infra_error"))]
    return kept, [(a, b) for a, b in pairs if a.get("infra_error") or b.get("infra_error")]


def infra_report(pairs: list[tuple[dict, dict]], max_rate: float | None) -> tuple[dict, list[str]]:
    """Infrastructure errors per arm and per domain, the pairs dropped per domain, and each
    (arm, domain) above the ceiling as a line naming it."""
    domains = sorted({str(a.get("domain")) for a, _ in pairs})
    report: dict = {}
    breaches = []
    for side, arm in enumerate(("reference", "candidate")):
        rows = [p[side] for p in pairs]
        per_domain = {d: infra_counts([r for r in rows if str(r.get("domain")) == d]) for d in domains}
        report[arm] = {**infra_counts(rows), "domains": per_domain}
        breaches += [f"{arm} {d}: {c['errors']}/{c['simulations']} simulations are infrastructure errors "
                     f"({c['rate']:.1%} > the policy's {max_rate:.0%})" for d, c in per_domain.items()
                     if max_rate is not None and c["rate"] is not None and c["rate"] > max_rate]
    _, dropped = split_infra(pairs)
    report["dropped_pairs"] = len(dropped)
    report["dropped_by_domain"] = {d: n for d in domains
                                   if (n := sum(1 for a, _ in dropped if str(a.get("domain")) == d))}
    return report, breaches


def scored_as(dropped: list[tuple[dict, dict]], reference: float, candidate: float) -> list[tuple[dict, dict]]:
    """The dropped pairs with fixed scores: ``(1, 0)`` is the worst they could have been for the
    candidate, ``(0, 1)`` the best."""
    return [({**a, "score": reference}, {**b, "score": candidate}) for a, b in dropped]


def macro_table(ref: np.ndarray, cand: np.ndarray, strata: np.ndarray, confidence: float, resamples: int,
                seed: int) -> tuple[dict, dict, dict]:
    """``(reference, candidate, per_domain)``: per-item scores (trials averaged) in, the macro scores
    with 95% intervals and one row per domain out."""
    score = lambda values: dict(zip(("score", "ci_low", "ci_high"),  # noqa: E731
                                    macro_interval(values, strata, REPORTED_CONFIDENCE, resamples, seed)))
    domains = {}
    for domain in np.unique(strata):
        mask = strata == domain
        p = paired_delta(ref[mask], cand[mask], confidence, resamples, seed)
        r, c = wilson_interval(ref[mask]), wilson_interval(cand[mask])
        domains[str(domain)] = {"n": int(mask.sum()), "reference": r[0], "candidate": c[0], "delta": p.delta,
                                "reference_ci": [r[1], r[2]], "candidate_ci": [c[1], c[2]],
                                "lower": p.lower, "upper": p.upper}
    return score(ref), score(cand), domains
