"""The gate on tau2 bundles imported from results files built with tau2's own models: the macro and
its interval, per-domain rows, comparable arms only, infrastructure errors, tiny arms, strict JSON,
and a verdict line that shows every benchmark."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from evals.judge import render
from evals.cli import evals_main
from evals.cli import main as gate
from evals.judge.gate import compare_benchmark
from evals.judge.policy import load_policy
from tests.evals.test_gate import bundle
from tests.evals.test_tau2 import results_file

PUBLISHED_TABLE = Path(__file__).resolve().parents[2] / "manifests" / "references" / "glm-5.2-fp8-published.yaml"


def tau2_bundle(path: Path, domains: dict[str, list[float]], **kw) -> Path:
    """``evals import-tau2`` of one results file per domain (task ids 0..n-1, one trial)."""
    files = [results_file(path.parent / f"{path.name}-{d}.json", d, {str(i): [s] for i, s in enumerate(scores)}, **kw)
             for d, scores in domains.items()]
    assert evals_main(["import-tau2", *files, "--out", str(path)]) == 0
    return path


def strict(text: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def run_gate(capsys, *args, as_json=True) -> tuple[int, dict | str]:
    code = gate([*map(str, args), *(["--json"] if as_json else [])])
    out = capsys.readouterr()
    if as_json and out.out.strip():
        return code, strict(out.out)
    return code, out.out + out.err


def test_the_macro_with_its_interval_and_domain_rows(tmp_path, capsys):
    """The issue's case: airline 1 task, retail 3; pooled means 0.75 vs 0.25 but both macros 0.5."""
    ref = tau2_bundle(tmp_path / "ref", {"airline": [0], "retail": [1, 1, 1]})
    cand = tau2_bundle(tmp_path / "cand", {"airline": [1], "retail": [0, 0, 0]})
    capsys.readouterr()
    code, result = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref,
                            "--reference-table", PUBLISHED_TABLE)
    (bench,) = result["benchmarks"]
    assert bench["reference"]["score"] == pytest.approx(0.5) and bench["candidate"]["score"] == pytest.approx(0.5)
    assert bench["delta"] == pytest.approx(0.0)  # mean of domain deltas: (+1 - 1) / 2
    for arm in ("reference", "candidate"):
        assert 0.0 <= bench[arm]["ci_low"] <= bench[arm]["score"] <= bench[arm]["ci_high"] <= 1.0
    rows = bench["per_stratum"]
    assert rows["airline"]["n"] == 1 and rows["retail"]["n"] == 3 and rows["retail"]["delta"] == pytest.approx(-1.0)
    assert all(0.0 <= x <= 1.0 for d in rows.values() for x in d["reference_ci"] + d["candidate_ci"])
    # 4 tasks is below the policy's minimum: not evidence either way, and it blocks
    assert bench["verdict"] == "INCONCLUSIVE" and "below the policy's minimum of 60" in bench["rule"]
    assert code == 1 and result["verdict"] == "INCONCLUSIVE"
    (unpaired,) = result["unpaired"]
    assert unpaired["candidate"] == pytest.approx(0.5) and unpaired["reference"] == 0.819  # the macro, not 0.25
    _, text = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref, "--reference-table", PUBLISHED_TABLE,
                       as_json=False)
    assert "tau2 macro" in text and "\n  airline " in text and "\n  retail " in text
    assert "UNPAIRED vs published tau2: 0.5000 vs 0.8190" in text


def test_one_task_per_arm_is_inconclusive_and_json_is_strict(tmp_path, capsys):
    ref = tau2_bundle(tmp_path / "ref", {"airline": [1]})
    cand = tau2_bundle(tmp_path / "cand", {"airline": [1]})
    capsys.readouterr()
    code, result = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref,
                            "--reference-table", PUBLISHED_TABLE)
    assert code == 1 and result["benchmarks"][0]["verdict"] == "INCONCLUSIVE"  # not PASS on bounds [0, 0]
    assert result["unpaired"][0]["se"] is None  # one item has no spread: null, not NaN


@pytest.mark.parametrize("differ, named", [({"user_llm": "another-user-model"}, "user_llm"),
                                          ({"max_steps": 30}, "max_steps")])
def test_arms_run_with_different_settings_are_refused(tmp_path, capsys, differ, named):
    ref = tau2_bundle(tmp_path / "ref", {"airline": [1, 0]})
    cand = tau2_bundle(tmp_path / "cand", {"airline": [1, 0]}, **differ)
    capsys.readouterr()
    code, result = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref)
    assert code == 2
    assert "the runs are not comparable" in result and "--allow-setting-differences" in result
    assert f"{named}: reference" in result and str(next(iter(differ.values()))) in result


def test_an_arm_made_of_infrastructure_errors_does_not_pass(tmp_path, capsys):
    scores = {"airline": [1.0] * 60, "retail": [1.0] * 60}
    ref = tau2_bundle(tmp_path / "ref", scores)
    # every candidate simulation raised with no recorded reason: infrastructure errors, reward 0
    cand = tau2_bundle(tmp_path / "cand", scores, reasons={str(i): ("agent_error", True) for i in range(60)})
    capsys.readouterr()
    code, result = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref)
    (bench,) = result["benchmarks"]
    assert {k: bench["infra"]["candidate"][k] for k in ("errors", "simulations", "rate")} == {"errors": 120, "simulations": 120, "rate": 1.0}
    assert bench["infra"]["dropped_pairs"] == 120
    assert bench["verdict"] == "INCONCLUSIVE"
    assert "candidate airline: 60/60 simulations are infrastructure errors" in bench["rule"]
    assert code == 1 and any("infrastructure errors" in b for b in result["blocking"])


def test_a_failure_the_infrastructure_errors_cannot_explain_is_a_fail(tmp_path, capsys):
    ref = tau2_bundle(tmp_path / "ref", {"airline": [1.0] * 60, "retail": [1.0] * 60})
    # retail collapses; tasks 0-9 of each domain raised: 20/120 infrastructure errors, above the 5% allowed
    cand = tau2_bundle(tmp_path / "cand", {"airline": [0.0] * 10 + [1.0] * 50, "retail": [0.0] * 60},
                       reasons={str(i): ("agent_error", True) for i in range(10)})
    capsys.readouterr()
    code, result = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref)
    (bench,) = result["benchmarks"]
    assert bench["infra"]["candidate"]["errors"] == 20
    assert code == 1 and bench["verdict"] == "FAIL" and "in the candidate's favour" in bench["rule"]


def test_a_tau2_collapse_blocks_and_the_verdict_line_shows_every_benchmark(tmp_path, capsys):
    """40/40 -> 0/40 with GSM8K passing used to print "verdict: PASS" (tau2 was optional)."""
    def arm(path, gsm8k, tau2):
        g, t = bundle(path / "g", "gsm8k", gsm8k), bundle(path / "t", "tau2", tau2, domains=["airline"] * 40 +
                                                          ["retail"] * 40 + ["telecom"] * 40)
        path.joinpath("b").mkdir()
        samples = (g / "samples.jsonl").read_text() + (t / "samples.jsonl").read_text()
        path.joinpath("b", "samples.jsonl").write_text(samples)
        path.joinpath("b", "run.json").write_text(json.dumps({"benchmarks": {
            "gsm8k": {"primary_filter": "flexible-extract"}, "tau2": {"primary_filter": "flexible-extract"}}}))
        return path / "b"
    ref = arm(tmp_path / "r", [1] * 200, [1] * 120)
    cand = arm(tmp_path / "c", [1] * 200, [1] * 80 + [0] * 40)  # telecom collapses
    code, text = run_gate(capsys, "accuracy", "--candidate", cand, "--reference", ref, as_json=False)
    verdict = [line for line in text.splitlines() if line.startswith("verdict:")][0]
    assert code == 1 and verdict.startswith("verdict: FAIL [gsm8k PASS, tau2 FAIL]")
    assert "\n  telecom " in text


# ---- infrastructure errors never decide a verdict (the gate's own decision function, on tau2 rows) ----

DOMAIN_TASKS = {"airline": 50, "retail": 114, "telecom": 114}


def tau2_pairs(trials: int = 1, seed: int = 0, flips: dict[str, int] | None = None) -> list[tuple[dict, dict]]:
    """278 tasks x ``trials``: reference outcomes at tau2-like rates per domain, the candidate equal to
    it except ``flips[domain]`` reference successes turned into failures (trial 0)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for domain, n in DOMAIN_TASKS.items():
        scores = (rng.random((n, trials)) < {"airline": 0.6, "retail": 0.8, "telecom": 0.85}[domain]).astype(float)
        lost = set(np.flatnonzero(scores[:, 0] == 1)[:(flips or {}).get(domain, 0)])
        for task in range(n):
            for trial in range(trials):
                row = {"benchmark": "tau2", "domain": domain, "item_id": f"{domain}/{task}", "repeat": trial,
                       "filter": "reward", "score": float(scores[task, trial]), "infra_error": False}
                cand = {**row, "score": 0.0} if trial == 0 and task in lost else dict(row)
                pairs.append((row, cand))
    return pairs


def with_infra_errors(pairs, side: int, domain: str, count: int):
    """``count`` simulations of ``domain`` in one arm (0 reference, 1 candidate) lost to infrastructure
    errors, chosen among that arm's successes: reward 0, ``infra_error`` set."""
    out, left = [], count
    for pair in pairs:
        row = pair[side]
        if left and row["domain"] == domain and row["score"] == 1.0:
            pair = tuple({**r, "score": 0.0, "infra_error": True} if i == side else r for i, r in enumerate(pair))
            left -= 1
        out.append(pair)
    assert left == 0
    return out


def test_reproduction_a_an_identical_candidate_with_13_airline_errors_does_not_fail():
    """Scored as the candidate's failures, 13 airline errors (4.7% of 278, under the old per-arm
    ceiling) made an identical candidate FAIL."""
    result = compare_benchmark("tau2", with_infra_errors(tau2_pairs(), 1, "airline", 13), load_policy())
    assert result.verdict == "INCONCLUSIVE" and not result.decidable
    assert "candidate airline: 13/50 simulations are infrastructure errors (26.0% > the policy's 5%)" in result.rule
    assert "evals run --resume" in result.rule
    assert result.delta == 0 and result.infra["dropped_pairs"] == 13 and result.infra["dropped_by_domain"] == {"airline": 13}


def test_reproduction_b_a_worse_candidate_does_not_pass_on_the_references_errors():
    """The candidate ~4.9 points worse; the reference's 13 airline errors used to lift it to a PASS."""
    worse = tau2_pairs(flips={"airline": 3, "retail": 5, "telecom": 5})
    plain = compare_benchmark("tau2", worse, load_policy())
    assert plain.delta == pytest.approx(-(3 / 50 + 5 / 114 + 5 / 114) / 3) and plain.verdict != "PASS"
    result = compare_benchmark("tau2", with_infra_errors(worse, 0, "airline", 13), load_policy())
    assert result.verdict != "PASS" and "reference airline: 13/50" in result.rule


def test_a_few_errors_below_the_ceiling_are_dropped_from_both_arms_and_reported(capsys):
    pairs = tau2_pairs(trials=4)  # identical arms, 1112 simulations each
    for domain in ("airline", "retail", "telecom"):
        pairs = with_infra_errors(pairs, 1, domain, 1)
    result = compare_benchmark("tau2", pairs, load_policy())
    assert result.verdict == "PASS" and result.decidable  # 3 dropped pairs cannot overturn a lossless 278 x 4
    assert result.infra["dropped_pairs"] == 3 and result.agreement["reference_only"] == 0
    assert result.infra["candidate"]["domains"]["airline"] == {"errors": 1, "simulations": 200, "rate": 0.005,
                                                                 "retries": 0}
    note = [n for n in render.notes(asdict(result)) if n.startswith("infrastructure errors")][0]
    assert note == ("infrastructure errors: reference 0/1112, candidate 3/1112; 3 (task, trial) pairs dropped from "
                    "both arms (airline 1, retail 1, telecom 1)")
    # simulations that evals run retried (and that then scored) are counted per arm
    retried = [(a, {**b, "retries": 2} if i < 2 else b) for i, (a, b) in enumerate(pairs)]
    result = compare_benchmark("tau2", retried, load_policy())
    assert result.infra["candidate"]["retries"] == 4 and result.infra["reference"]["retries"] == 0
    note = [n for n in render.notes(asdict(result)) if n.startswith("infrastructure errors")][0]
    assert note.startswith("infrastructure errors: reference 0/1112, candidate 3/1112 (4 retried); ")


def test_a_pass_the_dropped_pairs_could_overturn_is_inconclusive():
    pairs = with_infra_errors(tau2_pairs(trials=1, flips={"retail": 1, "telecom": 1}), 1, "airline", 2)  # 4% of airline
    policy = load_policy().with_margins({"tau2": 0.03})
    result = compare_benchmark("tau2", pairs, policy)
    assert result.verdict == "INCONCLUSIVE" and "could overturn it (scored as losses the lower bound is" in result.rule
    assert "evals run --resume" in result.rule
    clean = compare_benchmark("tau2", tau2_pairs(trials=1, flips={"retail": 1, "telecom": 1}), policy)
    assert clean.verdict == "PASS"  # without the errors the same data passes
