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
from scipy.optimize import brentq

REPORTED_CONFIDENCE = 0.95  # two-sided, for every score's interval and the unpaired comparison
NOISE_ALPHA = 0.05  # a candidate is "beyond noise" when its excess discordance has p <= this
POWER = 0.8  # of the non-inferiority test, for the designs guidance suggests


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
    boot = _bootstrap_means(groups, resamples, np.random.default_rng(seed))
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
    scaling_lower: float  # the score or BCa bound alone: the one that scales with more data (guidance)
    normal_lower: float
    normal_upper: float
    sd: float


def _lattice(values: np.ndarray) -> int | None:
    """The smallest q <= 64 making every value an integer multiple of 1 / q (per-item means of 0/1
    scores over R repeats are multiples of 1 / R), or None."""
    for q in range(1, 65):
        scaled = values * q
        if np.allclose(scaled, np.round(scaled), rtol=0, atol=1e-9):
            return q
    return None


def _resampled_sums(values: np.ndarray, counts: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Sums of n = counts.sum() draws with replacement from ``values`` (weights ``counts``), ``resamples`` times.

    On a lattice the sum's exact distribution is the n-fold convolution of one draw's (an FFT power),
    sampled by its inverse CDF: one uniform per resample. Otherwise a chain of binomials draws the
    multinomial counts."""
    n = int(counts.sum())
    q = _lattice(values)
    if q is not None:
        steps = np.round(values * q).astype(int)
        low, width = int(steps.min()), int(steps.max() - steps.min())
        if width == 0:
            return np.full(resamples, values[0] * n)
        one = np.zeros(n * width + 1)
        np.add.at(one, steps - low, counts / n)  # np.unique may split one lattice point (1/3 computed two ways)
        size = 1 << int(np.ceil(np.log2(len(one))))
        pmf = np.clip(np.fft.irfft(np.fft.rfft(one, size) ** n, size)[:len(one)], 0, None)
        cdf = np.cumsum(pmf)
        drawn = np.minimum(np.searchsorted(cdf, rng.random(resamples) * cdf[-1], side="right"), len(one) - 1)
        return (drawn + low * n) / q
    total, left, rest = np.zeros(resamples), np.full(resamples, n), n
    for value, count in zip(values[:-1], counts[:-1]):
        drawn = rng.binomial(left, count / rest)
        total += value * drawn
        left, rest = left - drawn, rest - count
    return total + values[-1] * left


def _bootstrap_means(groups: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The statistic (mean of stratum means) of ``resamples`` resamples of items within each stratum.

    Resampling n items is a multinomial draw over the items' distinct values (per-item deltas take
    few: 2R + 1 for R repeats of 0/1 scores), so only the sum of each resample is drawn
    (``_resampled_sums``): the same bootstrap as drawing item indices, at a cost that does not grow
    with n."""
    total = np.zeros(resamples)
    for g in groups:
        values, counts = np.unique(g, return_counts=True)
        total += _resampled_sums(values, counts, resamples, rng) / len(g)
    return total / len(groups)


def _bca(groups: list[np.ndarray], delta: float, confidence: float, resamples: int, seed: int) -> tuple[float, float]:
    """One-sided BCa bounds (Efron 1987): percentile bounds moved for the bootstrap's bias (``z0``,
    with ties counted half) and skew (``a``, the jackknife acceleration of a stratified mean), at
    an expanded level for small samples."""
    boot = _bootstrap_means(groups, resamples, np.random.default_rng(seed))
    below = float(np.mean(boot < delta) + 0.5 * np.mean(boot == delta))
    if below in (0.0, 1.0):  # every resample equal: no spread to learn from (the exact bound covers it)
        return delta, delta
    z0 = float(sps.norm.ppf(below))
    # theta - theta_(i) of the jackknife; for a mean of stratum means it is (d_i - mean_s) / ((n_s - 1) S)
    u = np.concatenate([(g - g.mean()) / ((len(g) - 1) * len(groups)) for g in groups if len(g) > 1] or [np.zeros(0)])
    spread = float((u ** 2).sum())
    a = float((u ** 3).sum()) / (6 * spread ** 1.5) if spread > 0 else 0.0
    # Expanded (Hesterberg 2015): the bootstrap's spread is sqrt(df / (df + 1)) of the sampling spread and
    # its tails are normal, not t; widen by both. The degrees of freedom are the items that differ, less
    # one (the spread is theirs: 198 GPQA questions of which 50 differ estimate it like 50 items); with
    # strata, Welch-Satterthwaite's over the strata's shares of the variance (airline's 50 tasks weigh most).
    shares = [float(g.var(ddof=1)) / len(g) if len(g) > 1 else 0.0 for g in groups]
    dfs = [max(1, int(np.count_nonzero(g)) - 1) for g in groups]
    df = sum(shares) ** 2 / sum(v * v / k for v, k in zip(shares, dfs)) if sum(shares) > 0 else 1.0
    z = float(math.sqrt((df + 1) / df) * sps.t.ppf(confidence, df))
    level = lambda zq: float(sps.norm.cdf(z0 + (z0 + zq) / (1 - a * (z0 + zq))))  # noqa: E731
    return (float(np.quantile(boot, level(-z))),
            float(np.quantile(boot, level(z))))


def _score_z(b: int, c: int, n: int, delta0: float) -> float:
    """Tango's (1998) score statistic for H0: delta = delta0 on paired 0/1 items (b reference-only,
    c candidate-only): ``(c - b - n delta0) / sqrt(n (2 p_b + delta0 - delta0^2))``, with p_b the
    restricted maximum-likelihood P(reference-only) under H0, the root of
    ``2n x^2 - ((b + c)(1 - delta0) - 2 delta0 (n - c)) x - b delta0 (1 - delta0) = 0``."""
    lin = (b + c) * (1 - delta0) - 2 * delta0 * (n - c)
    x = (lin + math.sqrt(max(lin * lin + 8 * n * b * delta0 * (1 - delta0), 0.0))) / (4 * n)
    var = max(n * (2 * x + delta0 - delta0 * delta0), 1e-300)
    return (c - b - n * delta0) / math.sqrt(var)


def score_bounds(b: int, c: int, n: int, confidence: float) -> tuple[float, float]:
    """One-sided score bounds of the paired delta of 0/1 items (Tango 1998): the deltas where the
    score statistic equals +-z. Unlike the bootstrap (or any mean +- z se) its variance is taken
    under each tested delta, so a run that happened to lose few items is not also credited with a
    small spread (the bootstrap passed GSM8K 1319 x 1 at the margin 6% of the time, this 5%)."""
    z = float(sps.norm.ppf(confidence))
    hat = (c - b) / n
    lower = -1.0 if _score_z(b, c, n, -1 + 1e-12) < z else brentq(lambda d: _score_z(b, c, n, d) - z, -1 + 1e-12, hat)
    upper = 1.0 if _score_z(b, c, n, 1 - 1e-12) > -z else brentq(lambda d: _score_z(b, c, n, d) + z, hat, 1 - 1e-12)
    return float(lower), float(upper)


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

    The bounds are BCa paired bootstrap bounds (the percentile bootstrap's lower bound passed a
    candidate at the margin too often when the deltas are skewed or the discordant items few); for
    one 0/1 outcome per item, unstratified, Tango's score bounds (``score_bounds``). When
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
    binary = strata is None and n > 0 and bool(np.isin(ref, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all())
    if binary:  # one 0/1 outcome per item: the score bound, whose variance follows the tested delta
        lower, upper = score_bounds(int((d < 0).sum()), int((d > 0).sum()), n, confidence)
        method = "Tango score bound (paired 0/1 items)"
    else:
        lower, upper = _bca(groups, delta, confidence, resamples, seed)
        method = f"BCa paired bootstrap ({resamples} resamples of items{where})"
    scaling_lower = lower
    losing = int((d < 0).sum())
    if strata is None and losing <= FEW_LOSSES:
        exact = exact_loss_bound(losing, n, confidence)
        if exact < lower:
            method = (f"exact Clopper-Pearson bound on the loss rate ({losing} of {n} items lost; more conservative "
                      f"than the {method.split(' (')[0]}'s {lower:+.4f})")
            lower = exact
    z = sps.norm.ppf(confidence)
    return Paired(n=n, delta=delta, se=se, lower=lower, upper=upper, method=method, scaling_lower=scaling_lower,
                  normal_lower=float(delta - z * se), normal_upper=float(delta + z * se), sd=sd)


def items_to_decide(sd: float, margin: float, confidence: float, power: float = POWER) -> int | None:
    """Items a non-inferiority test needs at this per-item sd to certify ``margin`` with ``power``
    when the true delta is 0: ``((z_conf + z_power) * sd / margin)^2``."""
    if margin <= 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 1
    return math.ceil(((sps.norm.ppf(confidence) + sps.norm.ppf(power)) * sd / margin) ** 2)


MAX_REPEATS = 16  # the most repeats guidance suggests; beyond it, more repeats barely move the bound


def certified_margin(lower: float) -> float:
    """The margin a one-sided lower bound certifies, rounded up to 0.001 (a bound of -0.0304 does not
    certify 0.030)."""
    return max(0.0, math.ceil(round(-lower * 1000, 6)) / 1000)


def conditional_power(delta_now: float, var_now: float, var_final, margin: float, confidence: float,
                      true_delta: float, z: float | None = None):
    """P(the final one-sided lower bound clears -margin | the data so far), were the true delta
    ``true_delta``: Lan and Wittes' B-value. With information I = 1 / var, B = (delta + margin) * I
    grows by independent increments of mean (true_delta + margin) * dI and variance dI; the final test
    passes when B_final > z * sqrt(I_final). ``var_final`` may be an array of designs; ``z`` (default the
    normal quantile of ``confidence``) is how many standard errors the gate's bound lies below the delta."""
    i_now, i_final = 1 / var_now, 1 / np.asarray(var_final, dtype=float)
    z = sps.norm.ppf(confidence) if z is None else z
    b_now = (delta_now + margin) * i_now
    added = np.maximum(i_final - i_now, 1e-300)
    mean = b_now + (true_delta + margin) * added
    power = np.where(i_final > i_now, sps.norm.cdf((mean - z * np.sqrt(i_final)) / np.sqrt(added)),
                     float(b_now > z * math.sqrt(i_now)))
    return float(power) if power.ndim == 0 else power


@dataclass(frozen=True)
class Guidance:
    """What it takes from here to decide an INCONCLUSIVE comparison, at the observed delta.

    The mean delta of N items x R repeats has variance ``(between + within / R) / N``: ``between`` is
    the spread of the items' true deltas (only more items lower it), ``within`` the sampling noise
    of one repeat's delta (more repeats at the same temperature lower it), estimated from the
    disagreement between an item's repeats. A design is what the run would be after adding data;
    its conditional power (``conditional_power``) is shown at the observed delta and at 0.
    ``action``: ``items`` (run more of the benchmark's items), ``repeats`` (more repeats on all of
    them), ``second_repeat`` (one repeat: the noise between repeats is unknown), ``none`` (no design
    within the benchmark reaches the power at the observed delta) or ``loss`` (the observed delta is
    beyond the margin: more data would more likely FAIL it)."""
    action: str
    observed_delta: float
    margin: float
    n_items: int
    repeats: int
    benchmark_items: int | None
    items_needed: int | None  # the design that reaches the power: its items (all of them, not the ones to add)
    repeats_needed: int | None  # ... and its repeats; None: no design within the benchmark does
    design_items: int  # the design the powers are of: the one that reaches it, else the largest one
    design_repeats: int
    power_at_observed: float | None  # the design's conditional power at the observed delta; None: no design adds data
    power_at_zero: float | None  # ... were the true delta 0
    between: float
    within: float
    best_margin: float  # what the largest design is expected to certify at the observed delta (rounded up)
    certified_margin: float  # what the data certify now (rounded up)


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


def guidance(deltas: np.ndarray, p: Paired, margin: float, confidence: float, benchmark_items: int | None,
             power: float = POWER) -> Guidance:
    """The smallest design that reaches ``power`` at the observed delta, never one the run already has:
    more items at the current repeats while the benchmark has them, else more repeats (up to
    ``MAX_REPEATS``) on all of its items. ``deltas``: items x repeats of paired deltas; ``p``: the
    comparison's ``paired_delta``."""
    between, within = variance_components(deltas)
    n, repeats = p.n, deltas.shape[1]
    # the gate's score or BCa bound may lie further below the delta than z standard errors: powers use its
    # distance in standard errors (not the exact bound's: it applies to a few losses, not to more data)
    z = max(float(sps.norm.ppf(confidence)), (p.delta - p.scaling_lower) / p.se) if p.se > 0 else None
    size = max(benchmark_items or n, n)
    var_now = p.se ** 2
    per_item = between + within / repeats
    if var_now == 0:  # no item differs: only the exact bound (rule of three) limits it, and only items move it
        needed = math.floor(math.log(1 - confidence) / math.log(1 - margin)) + 1 if margin > 0 else None
        ok = needed is not None and n < needed <= size
        return Guidance(action="items" if ok else "none", observed_delta=p.delta, margin=margin, n_items=n,
                        repeats=repeats, benchmark_items=benchmark_items, items_needed=needed if ok else None,
                        repeats_needed=repeats if ok else None, design_items=needed if ok else n, design_repeats=repeats,
                        power_at_observed=1.0 if ok else None, power_at_zero=1.0 if ok else None,
                        between=between, within=within,
                        best_margin=certified_margin(exact_loss_bound(0, size, confidence)),
                        certified_margin=certified_margin(p.lower))

    def var(items, reps):  # the current variance scaled to other designs (arrays of items and repeats)
        return var_now * (n / items) * ((between + within / reps) / per_item if per_item > 0 else 1.0)

    designs = [(items, repeats) for items in range(n + 1, size + 1)]
    if repeats > 1 and within > 0:
        designs += [(size, reps) for reps in range(repeats + 1, MAX_REPEATS + 1)]
    grid = np.array(designs or [(n, repeats)], dtype=float)
    variances = var(grid[:, 0], grid[:, 1])
    at_observed = np.atleast_1d(conditional_power(p.delta, var_now, variances, margin, confidence, p.delta, z))
    reaches = np.flatnonzero(at_observed >= power) if designs and p.delta > -margin else []
    found = designs[reaches[0]] if len(reaches) else None
    if p.delta <= -margin:
        action = "loss"
    elif found:
        action = "items" if found[1] == repeats else "repeats"
    elif repeats < 2:
        action = "second_repeat"
    else:
        action = "none"
    pick = reaches[0] if found else len(grid) - 1
    design = tuple(int(x) for x in grid[pick])
    best = p.delta - z * math.sqrt(variances[-1])
    cp = lambda at: float(conditional_power(p.delta, var_now, variances[pick], margin, confidence, at, z))  # noqa: E731
    return Guidance(action=action, observed_delta=p.delta, margin=margin, n_items=n, repeats=repeats,
                    benchmark_items=benchmark_items, items_needed=design[0] if found else None,
                    repeats_needed=design[1] if found else None, design_items=design[0], design_repeats=design[1],
                    power_at_observed=cp(p.delta) if designs else None,
                    power_at_zero=cp(0.0) if designs else None, between=between, within=within,
                    best_margin=certified_margin(best), certified_margin=certified_margin(p.lower))


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
