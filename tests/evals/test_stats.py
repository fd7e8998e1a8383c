"""The paired bounds hold their level where the percentile bootstrap did not: few discordant items,
degenerate data, and the method named with every bound."""

from __future__ import annotations

import numpy as np
import pytest

from evals.gate import compare_benchmark
from evals.policy import load_policy
from evals.stats import _score_z, exact_loss_bound, paired_delta, score_bounds
from tests.evals.test_gate import binary_pair


def pairs_of(ref, cand, benchmark="gsm8k"):
    row = lambda i, s: {"benchmark": benchmark, "item_id": str(i), "repeat": 0, "filter": "flexible-extract",  # noqa: E731
                        "score": float(s)}
    return [(row(i, r), row(i, c)) for i, (r, c) in enumerate(zip(ref, cand))]


def bound(n, b, c):
    ref, cand = binary_pair(n, b, c)
    return paired_delta(np.array(ref, float), np.array(cand, float), 0.95, 10000, 0)


def test_exact_loss_bound_known_values():
    assert exact_loss_bound(1, 200, 0.95) == pytest.approx(-0.0234, abs=1e-4)
    assert exact_loss_bound(2, 300, 0.95) == pytest.approx(-0.0208, abs=1e-4)
    assert exact_loss_bound(0, 200, 0.95) == pytest.approx(-(1 - 0.05 ** (1 / 200)))  # the rule of three, exactly


@pytest.mark.parametrize("n, b", [(200, 1), (300, 2)])
def test_few_losses_do_not_certify_a_two_point_margin(n, b):
    """The percentile bootstrap passed both (lower bounds -0.015 and -0.0167)."""
    result = compare_benchmark("gsm8k", pairs_of(*binary_pair(n, b, 0)), load_policy().with_margins({"gsm8k": 0.02}))
    assert result.verdict != "PASS" and result.lower <= -0.02
    assert result.discordant_ref_only == b and result.discordant_cand_only == 0


def test_no_discordance_is_bounded_by_the_rule_of_three_not_zero():
    p = bound(200, 0, 0)
    assert p.delta == 0 and p.lower == pytest.approx(exact_loss_bound(0, 200, 0.95)) and "Clopper-Pearson" in p.method
    assert p.lower < -0.01  # the bootstrap alone says 0: every resample is 0


def test_the_more_conservative_bound_is_taken_and_named():
    few = bound(300, 2, 0)
    assert few.lower == pytest.approx(-0.0208, abs=1e-4) and "2 of 300 items lost" in few.method
    assert "Tango score bound's -0.01" in few.method  # the score bound alone would have passed it
    many = bound(1319, 20, 20)  # many discordant items: the score bound, not the exact one
    assert many.method.startswith("Tango score bound") and -0.012 < many.lower < -0.005
    assert many.lower < many.delta < many.upper


def test_score_bounds_take_the_variance_under_the_tested_delta():
    lower, upper = score_bounds(4, 4, 200, 0.95)
    assert lower == pytest.approx(-upper) and lower == pytest.approx(-0.0266, abs=1e-4)
    assert lower < paired_delta(*(np.array(x, float) for x in binary_pair(200, 4, 4)), 0.95, 10, 0).normal_lower
    # at the bound the statistic is exactly z: the bound is the root, not an approximation of it
    assert _score_z(4, 4, 200, lower) == pytest.approx(1.6449, abs=1e-4)
    low, high = score_bounds(0, 0, 200, 0.95)  # no discordance: about -z^2 / n, not 0
    assert low == pytest.approx(-1.6449 ** 2 / (200 + 1.6449 ** 2), rel=1e-3) and high == pytest.approx(-low)


def test_bca_moves_the_bound_for_skew():
    """Two repeats per item, losses only (skewed deltas): BCa's lower bound lies below the percentile bootstrap's."""
    ref = np.ones(1319)
    cand = np.ones(1319)
    cand[:24] = 0.5  # 24 items lost one of their two repeats
    d = cand - ref
    rng = np.random.default_rng(0)
    percentile = np.quantile(d[rng.integers(0, len(d), size=(10000, len(d)))].mean(axis=1), 0.05)
    p = paired_delta(ref, cand, 0.95, 10000, 0)
    assert p.method.startswith("BCa") and p.lower < percentile


def test_the_rule_and_report_name_the_method(tmp_path):
    result = compare_benchmark("gsm8k", pairs_of(*binary_pair(1000, 3, 3)), load_policy())
    assert result.verdict == "PASS" and result.bound_method in result.rule


def test_strata_resample_within_domains_and_stay_deterministic():
    rng = np.random.default_rng(2)
    strata = np.array(["airline"] * 50 + ["retail"] * 114 + ["telecom"] * 114)
    ref = (rng.random(278) < 0.8).astype(float)
    cand = np.where(rng.random(278) < 0.1, 1 - ref, ref)
    p = paired_delta(ref, cand, 0.95, 10000, 0, strata)
    assert "within domains" in p.method and p.lower < p.delta < p.upper
    assert p.delta == pytest.approx(np.mean([(cand - ref)[strata == s].mean() for s in np.unique(strata)]))
    assert p == paired_delta(ref, cand, 0.95, 10000, 0, strata)
