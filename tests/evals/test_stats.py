"""The paired bounds hold their level where the percentile bootstrap did not: the exact bound of paired
0/1 items checked by enumeration at small n, its known values and the cases an older bound misjudged, degenerate data,
and the method named with every bound."""

from __future__ import annotations

import time

import numpy as np
import pytest
from scipy.special import gammaln, xlogy

from evals.judge.gate import compare_benchmark
from evals.judge.policy import load_policy
from evals.judge.stats import (_score_z, exact_bounds, exact_loss_bound, exact_p, exact_passes, exact_power,
                         bound_distance, paired_delta, score_bounds)
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


def test_exact_bounds_known_values():
    """Both discordant counts count; few discordances are bounded as exactly as the loss rate's own bound."""
    assert exact_bounds(4, 4, 200, 0.95) == pytest.approx((-0.0268, 0.0268), abs=1e-4)  # loss rate alone: -0.045
    assert exact_bounds(1, 0, 200, 0.95)[0] == pytest.approx(-0.0236, abs=1e-4)  # Clopper-Pearson alone: -0.0234
    assert exact_bounds(2, 3, 250, 0.95)[0] == pytest.approx(-0.0136, abs=1e-4)  # the trained example: -0.0250 before
    assert exact_bounds(0, 0, 200, 0.95)[0] == pytest.approx(-0.0150, abs=1e-4)  # about the rule of three, not 0
    assert exact_bounds(3, 1, 200, 0.95)[0] < score_bounds(3, 1, 200, 0.95)[0] < 0  # Tango's normal approximation
    # the bound is where the exact test stops rejecting: just below it rejects, just above it does not
    low = exact_bounds(4, 4, 200, 0.95)[0]
    assert exact_p(4, 4, 200, low - 1e-6) <= 0.05 < exact_p(4, 4, 200, low + 1e-6)


@pytest.mark.parametrize("n, b, c, margin, verdict", [
    (200, 4, 4, 0.035, "PASS"),  # was INCONCLUSIVE while the loss rate's bound (-0.045) overrode Tango's
    (200, 1, 0, 0.02, "INCONCLUSIVE"),  # the few-discordance guarantee
    (300, 2, 0, 0.02, "INCONCLUSIVE"),
    (250, 2, 3, 0.025, "PASS"),
])
def test_the_gate_judges_paired_0_1_items_by_the_exact_bound(n, b, c, margin, verdict):
    result = compare_benchmark("gsm8k", pairs_of(*binary_pair(n, b, c)), load_policy().with_margins({"gsm8k": margin}))
    assert result.verdict == verdict and result.bound_method.startswith("exact unconditional")
    assert result.lower == pytest.approx(exact_bounds(b, c, n, 0.95)[0])
    assert (result.verdict == "PASS") == exact_passes(b, c, n, margin, 0.95)  # the rule power is computed from
    assert result.discordant_ref_only == b and result.discordant_cand_only == c


def test_tangos_statistic_rises_with_the_wins_at_a_fixed_discordance():
    """The exact test's extreme outcomes at discordance d are c >= a threshold; that needs this."""
    for n in (30, 200, 1319):
        for d0 in np.linspace(-0.3, 0.3, 13):
            for d in range(0, n + 1, max(1, n // 40)):
                c = np.arange(d + 1)
                assert np.all(np.diff(_score_z(d - c, c, n, d0)) >= -1e-12), (n, d0, d)


def _trinomial(n: int, p_lost: np.ndarray, p_won: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every outcome (b, c) of n items and its probability under each (p_lost, p_won) (rows)."""
    b, c = (x.ravel() for x in np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij"))
    b, c = b[b + c <= n], c[b + c <= n]
    log = gammaln(n + 1) - gammaln(b + 1) - gammaln(c + 1) - gammaln(n - b - c + 1)
    rest = np.clip(1 - p_lost - p_won, 0, 1)[:, None]
    return b, c, np.exp(log + xlogy(b, p_lost[:, None]) + xlogy(c, p_won[:, None]) + xlogy(n - b - c, rest))


@pytest.mark.parametrize("n, delta", [(30, -0.1), (30, -0.03), (30, 0.0), (60, -0.05)])
def test_the_exact_bound_covers_at_the_worst_nuisance(n, delta):
    """Exactness by enumeration: at a true delta, the bound lies above it exactly when the test at
    that delta rejects (checked on outcomes); so the bound's miss rate is the probability of the
    rejected outcomes, summed over every trinomial outcome at 400 discordance rates (all of them,
    not only the interval the test searches): never above 5%."""
    b, c, _ = _trinomial(n, np.array([0.1]), np.array([0.1]))
    rejected = np.array([exact_p(int(x), int(y), n, delta) <= 0.05 for x, y in zip(b, c)])
    s = np.linspace(abs(delta) + 1e-9, 1, 400)  # P(discordant); P(lost) and P(won) on the boundary delta
    _, _, prob = _trinomial(n, (s - delta) / 2, (s + delta) / 2)
    miss = prob[:, rejected].sum(axis=1)
    assert miss.max() <= 0.05 and miss.max() > 0.01  # exact, and not trivially so
    for i in np.random.default_rng(n).choice(len(b), 6, replace=False):  # the bound and the test agree
        assert (exact_bounds(int(b[i]), int(c[i]), n, 0.95)[0] > delta) == rejected[i]


def test_exact_power_is_the_sum_over_outcomes_the_rule_passes():
    n, margin, p_lost, p_won = 40, 0.1, 0.08, 0.06
    b, c, prob = _trinomial(n, np.array([p_lost]), np.array([p_won]))
    passes = np.array([exact_passes(int(x), int(y), n, margin, 0.95) for x, y in zip(b, c)])
    assert exact_power(n, p_lost, p_won, margin, 0.95) == pytest.approx(prob[0, passes].sum(), abs=1e-9)
    # conditional on 20 items already run (3 lost, 1 won): the outcomes that contain them
    sub = (b >= 3) & (c >= 1) & (b - 3 + c - 1 <= 20)
    _, _, rest = _trinomial(20, np.array([p_lost]), np.array([p_won]))
    bb, cc, _ = _trinomial(20, np.array([0.1]), np.array([0.1]))
    cond = sum(rest[0, k] for k in range(len(bb)) if exact_passes(int(bb[k]) + 3, int(cc[k]) + 1, n, margin, 0.95))
    assert sub.any() and exact_power(n, p_lost, p_won, margin, 0.95, 3, 1, 20) == pytest.approx(cond, abs=1e-9)


def test_exact_bounds_are_fast_at_gsm8k_size():
    start = time.process_time()
    exact_bounds(300, 300, 1319, 0.95)  # the most discordance: the widest nuisance interval
    exact_bounds(40, 22, 1319, 0.95)
    assert time.process_time() - start < 2.0  # ~0.25 s on one core


def test_averaged_items_with_few_losses_still_take_the_loss_rates_exact_bound():
    """Two repeats per item (deltas in halves): the BCa bootstrap, and where at most 5 items lost the
    loss rate's Clopper-Pearson bound too, the more conservative of the two, named."""
    ref, cand = np.ones(300), np.ones(300)
    cand[:5] = 0.5
    few = paired_delta(ref, cand, 0.95, 10000, 0)
    assert few.lower == pytest.approx(-0.0347, abs=1e-4) and "5 of 300 items lost" in few.method


def test_bca_bounds_are_never_nearer_the_delta_than_the_expanded_t_bound():
    """Two items of 300 lost half their repeats: the bootstrap sees 2 differing items, so its bound sits where
    its resamples end; the t bound at 1 degree of freedom (the items that differ, less one) lies further
    out (-0.0243, beyond the loss rate's exact -0.0208), and decides; the report says so."""
    ref, cand = np.ones(300), np.ones(300)
    cand[:2] = 0.5
    p = paired_delta(ref, cand, 0.95, 10000, 0)
    floor = p.delta - bound_distance(0.95, 1) * p.se
    assert p.lower == pytest.approx(floor) and p.lower == pytest.approx(-0.0243, abs=1e-4)
    assert "no nearer the delta than the expanded t bound" in p.method and p.upper == pytest.approx(p.delta + p.delta - floor)


def test_score_bounds_take_the_variance_under_the_tested_delta():
    lower, upper = score_bounds(4, 4, 200, 0.95)
    assert lower == pytest.approx(-upper) and lower == pytest.approx(-0.0266, abs=1e-4)
    assert lower < paired_delta(*(np.array(x, float) for x in binary_pair(200, 4, 4)), 0.95, 10, 0).normal_lower
    # at the bound the statistic is exactly z: the bound is the root, not an approximation of it
    assert _score_z(4, 4, 200, lower) == pytest.approx(1.6449, abs=1e-4)


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
