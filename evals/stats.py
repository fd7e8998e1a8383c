"""All statistics of the accuracy gate (docs/reference.md §7); nothing else in the package computes a
p-value or a bound.

Items are the unit: repeats (GPQA seeds, tau2 trials) are averaged per item first, so a question
asked twice is one observation, not two. Everything is deterministic given the bootstrap seed.
The bounds of the paired delta are BCa bootstrap bounds, or the exact bound on the loss rate when
few items lost and it is more conservative (``paired_delta``; §7).
Known values (tests/evals/test_gate.py): exact McNemar p for 8 vs 0 discordant items is 0.0078,
for 7 vs 1 it is 0.070; 200 items with 4 + 4 discordant have a paired se of 0.0141.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

REPORTED_CONFIDENCE = 0.95  # two-sided, for every score's interval and the unpaired comparison
NOISE_ALPHA = 0.05  # a candidate is "beyond noise" when its excess discordance has p <= this
POWER = 0.8  # of the non-inferiority test, for "items that would decide it"


def z_two_sided(confidence: float = REPORTED_CONFIDENCE) -> float:
    """The normal quantile of a two-sided interval (1.959964 at 95%)."""
    return float(sps.norm.ppf(0.5 + confidence / 2))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar: the binomial test of b successes in b + c trials at 1/2."""
    if b + c == 0:
        return 1.0
    return float(sps.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def noise_floor_p(d_noise: int, d_cand: int) -> float:
    """p that the candidate's ``d_cand`` discordant items exceed what a reference rerun's ``d_noise``
    allows: under "the candidate differs no more than noise", each of the ``d_noise + d_cand``
    discordances is equally likely to come from either comparison (one-sided binomial test at 1/2)."""
    if d_noise + d_cand == 0:
        return 1.0
    return float(sps.binomtest(d_cand, d_noise + d_cand, 0.5, alternative="greater").pvalue)


def mean_ci(values: np.ndarray, confidence: float = REPORTED_CONFIDENCE) -> tuple[float, float, float]:
    """``(mean, low, high)``: two-sided normal interval over items, ``mean +/- z * sd / sqrt(n)``."""
    n = len(values)
    mean = float(values.mean()) if n else float("nan")
    if n < 2:
        return mean, float("nan"), float("nan")
    half = z_two_sided(confidence) * float(values.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def wilson_interval(values: np.ndarray, confidence: float = REPORTED_CONFIDENCE) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Wilson score interval for a mean of per-item scores in [0, 1].

    Exact for 0/1 items, conservative for items averaged over repeats (their variance is below
    p(1 - p)); unlike ``mean +/- z * se`` it stays inside [0, 1] and is not zero-width at 0 or 1."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p = float(values.mean())
    z = z_two_sided(confidence)
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, float(max(0.0, center - half)), float(min(1.0, center + half))


def macro_interval(values: np.ndarray, strata: np.ndarray, confidence: float = REPORTED_CONFIDENCE, resamples: int = 10000,
                   seed: int = 0) -> tuple[float, float, float]:
    """``(macro, low, high)``: the unweighted mean of stratum means (tau2's macro over domains) and
    its two-sided percentile interval from resampling items within each stratum."""
    groups = [values[strata == s] for s in np.unique(strata)]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boot = np.mean([g[rng.integers(0, len(g), size=(resamples, len(g)))].mean(axis=1) for g in groups], axis=0)
    tail = (1 - confidence) / 2
    macro = float(np.mean([g.mean() for g in groups]))
    return macro, float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))


FEW_LOSSES = 5  # at or below this many losing items the exact bound is computed too (see paired_delta)


@dataclass(frozen=True)
class Paired:
    n: int
    delta: float
    se: float
    lower: float  # one-sided lower bound at the confidence (``method``)
    upper: float  # one-sided upper bound
    method: str  # how ``lower`` was obtained, for the report
    normal_lower: float
    normal_upper: float
    sd: float


def _bootstrap_deltas(groups: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The statistic (mean of stratum means) of ``resamples`` resamples of items within each stratum.

    A resample of n items from the empirical distribution is a multinomial draw over the items'
    distinct values (per-item deltas take few: 2R + 1 for R repeats of 0/1 scores), so drawing the
    counts is the same bootstrap as drawing item indices, at a cost that does not grow with n."""
    total = np.zeros(resamples)
    for g in groups:
        values, counts = np.unique(g, return_counts=True)
        total += rng.multinomial(len(g), counts / len(g), size=resamples) @ values / len(g)
    return total / len(groups)


def _bca(groups: list[np.ndarray], delta: float, confidence: float, resamples: int, seed: int) -> tuple[float, float]:
    """One-sided BCa bounds (Efron 1987): percentile bounds moved for the bootstrap's bias (``z0``,
    with ties counted half) and skew (``a``, the jackknife acceleration of a stratified mean)."""
    boot = _bootstrap_deltas(groups, resamples, np.random.default_rng(seed))
    below = float(np.mean(boot < delta) + 0.5 * np.mean(boot == delta))
    if below in (0.0, 1.0):  # every resample equal: no spread to learn from (the exact bound covers it)
        return delta, delta
    z0 = float(sps.norm.ppf(below))
    # theta - theta_(i) of the jackknife; for a mean of stratum means it is (d_i - mean_s) / ((n_s - 1) S)
    u = np.concatenate([(g - g.mean()) / ((len(g) - 1) * len(groups)) for g in groups if len(g) > 1] or [np.zeros(0)])
    spread = float((u ** 2).sum())
    a = float((u ** 3).sum()) / (6 * spread ** 1.5) if spread > 0 else 0.0
    z = float(sps.norm.ppf(confidence))
    level = lambda zq: float(sps.norm.cdf(z0 + (z0 + zq) / (1 - a * (z0 + zq))))  # noqa: E731
    return (float(np.quantile(boot, level(-z), method="lower")),
            float(np.quantile(boot, level(z), method="higher")))


def exact_loss_bound(losing: int, n: int, confidence: float) -> float:
    """A lower bound on the delta from the count of items that lost: delta >= -P(an item loses), and
    that rate's one-sided Clopper-Pearson upper bound is exact. Items that gained are ignored, so
    it is conservative when there are some; 1 losing item of 200 gives -0.0234 at 95%, none gives
    about -3/n (the rule of three)."""
    return -float(sps.beta.ppf(confidence, losing + 1, n - losing)) if losing < n else -1.0


def paired_delta(ref: np.ndarray, cand: np.ndarray, confidence: float, resamples: int, seed: int,
                 strata: np.ndarray | None = None) -> Paired:
    """Paired delta (candidate - reference) of per-item scores with one-sided bounds at ``confidence``.

    Items are the unit (repeats are averaged per item before this), resampled with the same indices
    for both arms. With ``strata`` (tau2 domains) items are resampled within each stratum and the
    statistic is the mean of stratum deltas (the macro average), as the benchmark reports it.

    The bounds are BCa paired bootstrap bounds: the percentile bootstrap's lower bound passed a
    candidate at the margin too often when the deltas are skewed or the discordant items few. When
    at most ``FEW_LOSSES`` items lost (unstratified), the bootstrap sees too little of the losses to
    bound them, so the exact bound on the loss rate (``exact_loss_bound``) is computed as well and
    the lower bound is the more conservative of the two; ``method`` says which one it is.
    """
    d = cand - ref
    n = len(d)
    groups = [d] if strata is None else [d[strata == s] for s in np.unique(strata)]
    delta = float(np.mean([g.mean() for g in groups]))
    se = math.sqrt(sum(g.var(ddof=1) / len(g) for g in groups if len(g) > 1)) / len(groups) if n else float("nan")
    sd = se * math.sqrt(n)
    where = "" if strata is None else " within domains"
    lower, upper = _bca(groups, delta, confidence, resamples, seed)
    method = f"BCa paired bootstrap ({resamples} resamples of items{where})"
    losing = int((d < 0).sum())
    if strata is None and losing <= FEW_LOSSES:
        exact = exact_loss_bound(losing, n, confidence)
        if exact < lower:
            method = (f"exact Clopper-Pearson bound on the loss rate ({losing} of {n} items lost; more conservative "
                      f"than the BCa bootstrap's {lower:+.4f})")
            lower = exact
    z = sps.norm.ppf(confidence)
    return Paired(n=n, delta=delta, se=se, lower=lower, upper=upper, method=method,
                  normal_lower=float(delta - z * se), normal_upper=float(delta + z * se), sd=sd)


def items_to_decide(sd: float, margin: float, confidence: float, power: float = POWER) -> int | None:
    """Items a non-inferiority test needs at this per-item sd to certify ``margin`` with ``power``
    when the true delta is 0: ``((z_conf + z_power) * sd / margin)^2``."""
    if margin <= 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 1
    return math.ceil(((sps.norm.ppf(confidence) + sps.norm.ppf(power)) * sd / margin) ** 2)


@dataclass(frozen=True)
class Guidance:
    """What would decide an INCONCLUSIVE comparison, within what the benchmark can give.

    The per-item mean delta of R repeats has variance ``between + within / R``: ``between`` is the
    spread of the items' true deltas (only more items lower it), ``within`` the sampling noise of
    one repeat's delta (more repeats at the same temperature lower it). ``within`` is estimated from
    the disagreement between an item's repeats, ``between`` as the rest of the observed variance."""
    items_needed: int | None  # at the current repeats (``items_to_decide``)
    benchmark_items: int | None  # the benchmark's size; None when unknown
    repeats: int  # now
    between: float
    within: float
    repeats_needed: int | None  # at the benchmark's size, to reach the same power; None: none would
    certifiable_margin: float  # the margin the current data certifies: the one-sided lower bound's magnitude
    floor_margin: float  # the smallest margin any number of repeats could certify at the benchmark's size

    @property
    def exceeds_benchmark(self) -> bool:
        return bool(self.items_needed and self.benchmark_items and self.items_needed > self.benchmark_items)


def variance_components(deltas: np.ndarray) -> tuple[float, float]:
    """``(between, within)`` from an items x repeats array of paired deltas (candidate - reference,
    repeat r of one arm against repeat r of the other): ``within`` is the mean over items of the
    variance across an item's repeats; ``between`` is the variance of the per-item mean delta less
    ``within / R``, floored at 0. With one repeat, nothing separates them: all of it is ``between``."""
    n, repeats = deltas.shape
    total = float(deltas.mean(axis=1).var(ddof=1)) if n > 1 else 0.0
    if repeats < 2:
        return total, 0.0
    within = float(deltas.var(axis=1, ddof=1).mean())
    return max(0.0, total - within / repeats), within


def guidance(deltas: np.ndarray, sd: float, lower: float, margin: float, confidence: float,
             benchmark_items: int | None, power: float = POWER) -> Guidance:
    """How to decide at ``margin`` with ``power``: more items when the benchmark has them; else
    the repeats that reach the same power on all of its items, ``within / (N * target - between)``
    with ``target = (margin / (z_conf + z_power))^2`` the variance of the mean delta that decides
    it; else (and always) the margin the current data certifies, ``-lower``."""
    between, within = variance_components(deltas)
    items_needed = items_to_decide(sd, margin, confidence, power)  # sd: of the per-item mean delta
    z = sps.norm.ppf(confidence) + sps.norm.ppf(power)
    repeats_needed = floor_margin = None
    if benchmark_items:
        slack = benchmark_items * (margin / z) ** 2 - between
        if slack > 0:
            repeats_needed = max(1, math.ceil(within / slack)) if within > 0 else 1
        floor_margin = z * math.sqrt(between / benchmark_items)
    return Guidance(items_needed=items_needed, benchmark_items=benchmark_items, repeats=deltas.shape[1],
                    between=between, within=within,
                    repeats_needed=repeats_needed, certifiable_margin=max(0.0, -lower),
                    floor_margin=float("nan") if floor_margin is None else float(floor_margin))


def discordance(ref: np.ndarray, cand: np.ndarray) -> tuple[int, int]:
    """``(b, c)`` over binary items: b = reference right and candidate wrong, c = the reverse."""
    return int(((ref == 1) & (cand == 0)).sum()), int(((ref == 0) & (cand == 1)).sum())


@dataclass(frozen=True)
class Unpaired:
    delta: float
    se: float
    low: float  # two-sided interval at REPORTED_CONFIDENCE
    high: float


def unpaired_delta(candidate: float, candidate_se: float, reference_score: float,
                   reference_se: float | None) -> Unpaired:
    """A candidate score against a published summary score (no pairing possible): the standard
    errors add in quadrature, so per-question difficulty does not cancel and the interval is wide."""
    se = float(np.hypot(candidate_se, reference_se)) if reference_se else float("nan")
    delta = float(candidate) - reference_score
    half = z_two_sided() * se
    return Unpaired(delta=delta, se=se, low=delta - half, high=delta + half)
