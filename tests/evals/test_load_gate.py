"""``gate load`` on synthetic sweeps: the knee as defined, its bootstrap, the verdict's interval and refusals,
and the rate planner of ``evals load``."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from evals.judge.knee import bootstrap_p95, knee, load_gate, p95_rank, sweeps_to_decide
from evals.load import LoadSpec, next_rate
from tests.evals.test_load import REFERENCE, load_bundle, run_gate

HALF = [(1, 0.99, 1.1, 1), (2, 1.9, 6.0, 1), (3, 2.2, 9.0, 1)]


def row(rate, rps, ttft, ok=1.0, ttft_s=None):
    return {"rate": rate, "achieved_rps": rps, "output_tok_s": 1000 * rps, "ttft_p95_s": ttft, "successful": 100,
            "errored": 0, "success_fraction": ok, **({"ttft_s": ttft_s} if ttft_s is not None else {})}


def interpolated(a, b, slo=5.0):
    """The knee between rows a = (rps, ttft) meeting and b breaking the SLO: log TTFT linear in RPS."""
    share = (math.log(slo) - math.log(a[1])) / (math.log(b[1]) - math.log(a[1]))
    return a[0] + share * (b[0] - a[0])


def test_knee_interpolates_log_ttft_between_the_bracketing_rates():
    k = knee([row(r, rps, t) for r, rps, t, _ in REFERENCE], 5.0, 0.99)
    assert k["bracketed"] and k["rps"] == pytest.approx(interpolated((1.98, 2.2), (2.5, 8.0)))  # 2.311
    assert (k["met"]["rate"], k["broken_at"]["rate"]) == (2, 3) and k["interval"] is None  # no requests: no bootstrap
    assert k["tok_s"] == pytest.approx(1000 * k["rps"])


def test_all_rates_sweep_with_one_noisy_breach_gives_the_maximum_interpolated():
    # --all-rates: 1.0 req/s breaks the SLO by noise, 1.5 and 2.0 meet it again, 2.5 breaks it for real
    rows = [row(0.5, 0.5, 1.0), row(1.0, 1.0, 5.5), row(1.5, 1.5, 2.0), row(2.0, 2.0, 3.0), row(2.5, 2.45, 9.0)]
    k = knee(rows, 5.0, 0.99)
    assert k["rps"] == pytest.approx(interpolated((2.0, 3.0), (2.45, 9.0)))  # 2.21, not the 0.5 of the first breach
    assert 2.0 < k["rps"] < 2.45 and k["why"].startswith("2 req/s met the SLO, 2.5 broke it")


def test_a_rate_broken_by_errors_gives_no_slope():
    k = knee([row(1, 1.0, 1.0), row(2, 2.0, 2.0), row(3, 2.9, 3.0, ok=0.9)], 5.0, 0.99)
    assert k["rps"] == 2.0 and "success 90.0% < 99%" in k["why"]
    # a saturated server whose achieved RPS fell at the breaking rate: the meeting rate's RPS
    assert knee([row(1, 1.0, 1.0), row(2, 1.9, 4.0), row(3, 1.8, 30.0)], 5.0, 0.99)["rps"] == 1.9


def test_bootstrap_p95_matches_brute_force_resampling():
    rng = np.random.default_rng(1)
    x = rng.exponential(1.0, 57)
    fast = bootstrap_p95(list(x), 20000, np.random.default_rng(2))
    slow = np.sort(rng.choice(x, size=(20000, 57), replace=True), axis=1)[:, p95_rank(57) - 1]
    # the same distribution over the sample's values: every quantile agrees to within sampling noise
    qs = [0.05, 0.25, 0.5, 0.75, 0.95]
    assert np.quantile(fast, qs) == pytest.approx(np.quantile(slow, qs), rel=0.05)
    assert set(np.unique(fast)) <= set(x)


def test_p95_rank_is_guidellms_percentile():
    """guidellm 0.8.1's own Percentiles.from_pdf on the same samples (in a subprocess: importing guidellm
    installs uvloop's event-loop policy process-wide)."""
    samples = [list(np.random.default_rng(n).exponential(1.0, n)) for n in (1, 2, 19, 20, 21, 57, 100, 333)]
    code = ("import json, sys, numpy as np; from guidellm.schemas.base.statistics import Percentiles\n"
            "out = []\nfor s in json.load(sys.stdin):\n"
            "    v = np.sort(np.array(s)); pdf = np.stack([v, np.full(len(v), 1 / len(v))], axis=1)\n"
            "    out.append(Percentiles.from_pdf(pdf).p95)\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(samples), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [sorted(s)[p95_rank(len(s)) - 1] for s in samples]


def test_the_bootstrap_interval_narrows_with_more_requests():
    rng = np.random.default_rng(0)

    def sweep(n):
        rows = []
        for rate, p95 in ((1.0, 1.0), (2.0, 3.0), (3.0, 9.0)):
            ttft = list(rng.exponential(p95 / math.log(20), n))
            rows.append(row(rate, rate, sorted(ttft)[p95_rank(n) - 1], ttft_s=ttft))
        return knee(rows, 5.0, 0.99)

    few, many = sweep(60), sweep(2000)
    for k in (few, many):
        assert k["interval"][0] <= k["rps"] <= k["interval"][1] and k["log_var"] > 0
    assert many["interval"][1] - many["interval"][0] < few["interval"][1] - few["interval"][0]


@pytest.mark.parametrize("bad, says", [(float("nan"), "ttft_p95_s=nan"), (None, "ttft_p95_s=None")])
def test_broken_numbers_are_errors_naming_the_rate(tmp_path, capsys, bad, says):
    ref = load_bundle(tmp_path / "ref", REFERENCE)
    cand = load_bundle(tmp_path / "cand", REFERENCE)
    path = cand / "sweep-2" / "load.json"
    data = json.loads(path.read_text())
    data["rates"][1]["ttft_p95_s"] = bad  # a NaN p95 never meets nor breaks an SLO: it must stop the gate
    path.write_text(json.dumps(data))
    code, out = run_gate(capsys, "load", "--candidate", cand, "--reference", ref)
    assert code == 2 and "sweep-2: 2 req/s" in out and says in out and "Traceback" not in out


@pytest.mark.parametrize("rows, verdict, code, says", [
    (REFERENCE, "PASS", 0, "the lower bound is >= 0.9"),
    (HALF, "FAIL", 1, "the upper bound is < 0.9"),
    ([(1, 0.99, 1.0, 1), (2, 1.98, 2.2, 1), (3, 2.3, 8.0, 1)], "INCONCLUSIVE", 1, "sweeps per arm would decide it"),
    ([(1, 0.99, 1.1, 1), (2, 1.9, 2.5, 0.95), (3, 2.2, 9.0, 1)], "FAIL", 1, "upper bound"),  # errors break the SLO
    ([(1, 0.99, 1.1, 1), (2, 1.95, 2.5, 1), (3, 2.9, 4.0, 1)], "INCONCLUSIVE", 1, "add higher --rates"),
])
def test_gate_load_verdicts(tmp_path, capsys, rows, verdict, code, says):
    ref = load_bundle(tmp_path / "ref", REFERENCE, spread=0.04)
    cand = load_bundle(tmp_path / "cand", rows, spread=0.04)
    got, result = run_gate(capsys, "load", "--candidate", cand, "--reference", ref, "--json")
    assert (got, result["verdict"]) == (code, verdict) and says in result["why"]
    assert [round(k["rps"], 3) for k in result["arms"]["reference"]["sweeps"]] == [
        round(interpolated((1.98 * s, 2.2), (2.5 * s, 8.0)), 3) for s in (0.96, 1.0, 1.04)]
    if result["lower"] is not None:
        assert result["lower"] < result["ratio"] < result["upper"]
    got, text = run_gate(capsys, "load", "--candidate", cand, "--reference", ref)
    assert got == code and f"verdict: {verdict}" in text


def test_inconclusive_says_how_many_sweeps_decide_it():
    d, var, threshold = math.log(0.93), 0.03 ** 2, math.log(0.9)
    n = sweeps_to_decide(d, var, threshold, 3)
    from scipy import stats

    clears = lambda k: abs(d - threshold) >= stats.t.ppf(0.95, 2 * k - 2) * math.sqrt(var * 2 / k)  # noqa: E731
    assert n is not None and n > 3 and clears(n) and not clears(n - 1)
    assert sweeps_to_decide(threshold, var, threshold, 3) is None  # a ratio on the margin is never decided


def test_one_sweep_per_arm_cannot_decide(tmp_path, capsys):
    ref, cand = load_bundle(tmp_path / "ref", REFERENCE, repeats=0), load_bundle(tmp_path / "cand", HALF, repeats=0)
    code, result = run_gate(capsys, "load", "--candidate", cand, "--reference", ref, "--json")
    assert code == 1 and result["verdict"] == "INCONCLUSIVE" and "--repeats 3" in result["why"]
    assert result["ratio"] == pytest.approx(result["arms"]["candidate"]["knee_rps"] / result["arms"]["reference"]["knee_rps"])


def test_a_margin_below_the_reference_a_a_spread_is_refused(tmp_path, capsys):
    ref = load_bundle(tmp_path / "ref", REFERENCE, spread=0.10)  # sweeps 10% apart
    cand = load_bundle(tmp_path / "cand", REFERENCE, spread=0.10)
    code, out = run_gate(capsys, "load", "--candidate", cand, "--reference", ref, "--margin", 0.05)
    spread = math.sqrt(2) * float(np.std([math.log(interpolated((1.98 * s, 2.2), (2.5 * s, 8.0))) for s in (0.9, 1, 1.1)],
                                         ddof=1))
    assert code == 2 and f"A/A spread {spread:.3f}" in out and "--margin 0.15 or more" in out
    code, result = run_gate(capsys, "load", "--candidate", cand, "--reference", ref, "--margin", 0.2, "--json")
    assert code == 0 and result["aa_spread"] == pytest.approx(spread)


def test_reference_knee_zero_and_a_candidate_below_every_rate(tmp_path, capsys):
    never = [(1, 0.9, 5.5, 1), (2, 1.5, 9.0, 1)]  # the lowest rate already breaks the SLO
    ref, cand = load_bundle(tmp_path / "ref", never), load_bundle(tmp_path / "cand", REFERENCE)
    code, result = run_gate(capsys, "load", "--candidate", cand, "--reference", ref, "--json")
    assert code == 1 and result["verdict"] == "INCONCLUSIVE" and "reference's knee is 0" in result["why"]
    assert result["ratio"] is None  # no division by a zero knee
    code, result = run_gate(capsys, "load", "--candidate", ref, "--reference", cand, "--json")
    assert code == 1 and result["verdict"] == "FAIL" and "broke the SLO at its lowest rate in every sweep" in result["why"]


def test_sweeps_that_do_not_pair_are_refused(tmp_path, capsys):
    ref = load_bundle(tmp_path / "ref", REFERENCE)
    other = load_bundle(tmp_path / "other", REFERENCE, prompt_tokens=8000)
    code, out = run_gate(capsys, "load", "--candidate", other, "--reference", ref)
    assert code == 2 and "different workloads" in out and "prompt_tokens" in out
    unfinished = load_bundle(tmp_path / "unfinished", REFERENCE)
    data = json.loads((unfinished / "sweep-3" / "load.json").read_text())
    (unfinished / "sweep-3" / "load.json").write_text(json.dumps(data | {"state": "running"}))
    code, out = run_gate(capsys, "load", "--candidate", unfinished, "--reference", ref)
    assert code == 2 and "did not finish" in out and "sweep-3" in out
    code, out = run_gate(capsys, "load", "--candidate", tmp_path, "--reference", ref)
    assert code == 2 and "not a load bundle" in out


def test_load_gate_result_is_deterministic(tmp_path):
    """The bootstrap has a fixed random seed per sweep: the same bundles give the same bounds."""
    ref, cand = load_bundle(tmp_path / "ref", REFERENCE), load_bundle(tmp_path / "cand", HALF)
    assert load_gate(cand, ref) == load_gate(cand, ref)


# --- the rate planner of evals load -------------------------------------------------------------------------


def plan(truth, all_rates=False, step=0.1, rates=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0)):
    """Run the planner against ``truth(rate) -> TTFT p95``; returns the rates in the order measured."""
    spec = LoadSpec("http://x", "m", "t", None, rates=list(rates), stop_at_knee=not all_rates, refine_step=step)
    rows = []
    while (rate := next_rate(spec, rows, 0.99)) is not None:
        rows.append(row(rate, rate, truth(rate)))
        assert len(rows) < 30
    return [r["rate"] for r in rows]


def test_the_planner_walks_the_grid_then_bisects_the_bracket():
    order = plan(lambda r: 2.0 if r <= 1.8 else 9.0)  # knee between 1.8 and 1.85
    assert order[:4] == [0.5, 1.0, 1.5, 2.0] and order[4:] == [1.75, 1.875, 1.8125]
    met, broke = max(r for r in order if r <= 1.8), min(r for r in order if r > 1.8)
    assert broke - met <= 0.1
    assert plan(lambda r: 9.0) == [0.5]  # nothing meets the SLO: nothing to bisect
    assert plan(lambda r: 1.0) == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]  # everything meets it


def test_the_planner_with_all_rates_bisects_above_the_highest_meeting_rate():
    noisy = lambda r: 6.0 if r == 1.0 else (2.0 if r <= 2.2 else 9.0)  # noqa: E731
    order = plan(noisy, all_rates=True)
    assert order[:6] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0] and order[6:] == [2.25, 2.125, 2.1875]
