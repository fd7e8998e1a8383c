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
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import stats as sps
from scipy.optimize import brentq
from scipy.special import betainc, gammaln

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


FEW_LOSSES = 5  # averaged items: at or below this many losing items the loss rate's exact bound is computed too


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


def pooled_df(shares: Sequence[float], differing: Sequence[float]) -> float:
    """The degrees of freedom of an averaged-items bound: the items that differ, less one, per stratum
    (the spread is theirs), pooled by Welch-Satterthwaite over the strata's shares of the variance."""
    dfs = [max(1.0, k - 1) for k in differing]
    total = sum(shares)
    return total ** 2 / sum(v * v / k for v, k in zip(shares, dfs)) if total > 0 else 1.0


def bound_distance(confidence: float, df: float) -> float:
    """How many standard errors an averaged-items bound lies from the delta at ``confidence`` (before
    BCa's bias and skew corrections): the t quantile at ``df``, expanded by sqrt((df + 1) / df)
    (``_bca``); ``gate plan`` computes power with the same distance (``design.gate_looks``)."""
    return float(math.sqrt((df + 1) / df) * sps.t.ppf(confidence, df))


def _bca(groups: list[np.ndarray], delta: float, confidence: float, resamples: int, seed: int
         ) -> tuple[float, float, bool]:
    """One-sided BCa bounds (Efron 1987): percentile bounds moved for the bootstrap's bias (``z0``,
    with ties counted half) and skew (``a``, the jackknife acceleration of a stratified mean), at
    an expanded level for small samples, each never nearer the delta than the expanded t bound
    (``bound_distance`` standard errors); the flag says whether that floor decided a bound."""
    boot = _bootstrap_means(groups, resamples, np.random.default_rng(seed))
    below = float(np.mean(boot < delta) + 0.5 * np.mean(boot == delta))
    if below in (0.0, 1.0):  # every resample equal: no spread to learn from (the exact bound covers it)
        return delta, delta, False
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
    z = bound_distance(confidence, pooled_df(shares, [int(np.count_nonzero(g)) for g in groups]))
    level = lambda zq: float(sps.norm.cdf(z0 + (z0 + zq) / (1 - a * (z0 + zq))))  # noqa: E731
    lower, upper = float(np.quantile(boot, level(-z))), float(np.quantile(boot, level(z)))
    # The bias and skew corrections are estimated from the same few items that differ as the spread; where
    # they moved a bound nearer the delta than the expanded t bound it was too near (a candidate at the
    # margin passed 5.6% +- 0.23 of 10,000 sequential GPQA 198 x 8 runs; with this floor 5.1%).
    # They may move a bound away from the delta (skewed losses, which the t bound alone passes too often).
    se = math.sqrt(sum(shares)) / len(groups)
    floor_lower, floor_upper = delta - z * se, delta + z * se
    return min(lower, floor_lower), max(upper, floor_upper), floor_lower < lower or floor_upper > upper


def _score_z(b, c, n: int, delta0: float):
    """Tango's (1998) score statistic for H0: delta = delta0 on paired 0/1 items (b reference-only,
    c candidate-only): ``(c - b - n delta0) / sqrt(n (2 p_b + delta0 - delta0^2))``, with p_b the
    restricted maximum-likelihood P(reference-only) under H0, the root of
    ``2n x^2 - ((b + c)(1 - delta0) - 2 delta0 (n - c)) x - b delta0 (1 - delta0) = 0``.
    ``b`` and ``c`` may be arrays (the exact test orders every outcome by it)."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    lin = (b + c) * (1 - delta0) - 2 * delta0 * (n - c)
    x = (lin + np.sqrt(np.maximum(lin * lin + 8 * n * b * delta0 * (1 - delta0), 0.0))) / (4 * n)
    var = np.maximum(n * (2 * x + delta0 - delta0 * delta0), 1e-300)
    z = (c - b - n * delta0) / np.sqrt(var)
    return float(z) if z.ndim == 0 else z


def score_bounds(b: int, c: int, n: int, confidence: float) -> tuple[float, float]:
    """One-sided asymptotic score bounds of the paired delta of 0/1 items (Tango 1998): the deltas
    where the score statistic equals +-z. The gate's bounds are the exact ones (``exact_bounds``),
    which order outcomes by this statistic; this is their normal approximation."""
    z = float(sps.norm.ppf(confidence))
    hat = (c - b) / n
    lower = -1.0 if _score_z(b, c, n, -1 + 1e-12) < z else brentq(lambda d: _score_z(b, c, n, d) - z, -1 + 1e-12, hat)
    upper = 1.0 if _score_z(b, c, n, 1 - 1e-12) > -z else brentq(lambda d: _score_z(b, c, n, d) + z, hat, 1 - 1e-12)
    return float(lower), float(upper)


# The exact unconditional test of H0: delta <= d0 for paired 0/1 items (docs/reference.md §7). The
# counts (b, c, n - b - c) are trinomial with P(reference-only) = (s - d0) / 2, P(candidate-only) =
# (s + d0) / 2 on the boundary delta = d0, s = P(discordant) the nuisance. Outcomes are ordered by
# Tango's statistic (larger: more evidence of delta > d0); the p-value is the largest probability
# of an outcome at least as extreme over the nuisance, restricted to a 1 - gamma confidence interval
# for s from the observed discordance, plus gamma (Berger & Boos 1994: exact for any gamma).
EXACT_GAMMA = 0.001  # Berger and Boos' choice for a 5% test
NUISANCE_POINTS = 32  # s is searched on this many points of its interval, then as many around the largest
_TAIL = 1e-13  # binomial tails below this are not summed (and are added to the p-value)


def _first_extreme(n: int, delta0: float, t_obs: float, discordant: np.ndarray) -> np.ndarray:
    """Per discordant count d: the fewest candidate-only items c whose outcome (d - c, c) is at
    least as extreme as ``t_obs`` (d + 1: none is). For a fixed d the statistic rises with c
    (checked in tests/evals/test_stats.py), so the extreme outcomes are c >= this: one bisection
    for all d at once."""
    lo, hi = np.zeros(len(discordant), dtype=int), discordant + 1
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        extreme = (_score_z(discordant - mid, mid, n, delta0) >= t_obs - 1e-9) & (mid <= discordant)
        open_ = lo < hi
        hi = np.where(open_ & extreme, mid, hi)
        lo = np.where(open_ & ~extreme, mid + 1, lo)
    return lo


def exact_p(b: int, c: int, n: int, delta0: float, gamma: float = EXACT_GAMMA) -> float:
    """The exact unconditional p-value of H0: delta <= ``delta0`` (one-sided; see above)."""
    d_obs = b + c
    t_obs = _score_z(b, c, n, delta0)
    s_lo = float(sps.beta.ppf(gamma / 2, d_obs, n - d_obs + 1)) if d_obs > 0 else 0.0  # Clopper-Pearson for s
    s_hi = float(sps.beta.ppf(1 - gamma / 2, d_obs + 1, n - d_obs)) if d_obs < n else 1.0
    s_lo, s_hi = max(s_lo, abs(delta0), 1e-12), min(s_hi, 1.0)
    if s_lo > s_hi:  # no nuisance of the interval lies in H0
        return gamma
    d_min, d_max = int(sps.binom.ppf(_TAIL, n, s_lo)), int(sps.binom.isf(_TAIL, n, s_hi))
    discordant = np.arange(max(0, d_min - 1), min(n, d_max + 1) + 1)
    c_min = _first_extreme(n, delta0, t_obs, discordant)

    def tail(s: np.ndarray) -> np.ndarray:  # P(an outcome at least as extreme) at each nuisance s
        share = np.clip((s + delta0) / (2 * s), 0.0, 1.0)  # P(candidate-only | discordant)
        return (_binom_pmf(discordant, n, s) * _binom_at_least(c_min, discordant, share)).sum(axis=1)

    coarse = np.linspace(s_lo, s_hi, NUISANCE_POINTS)
    at = tail(coarse)
    top = int(at.argmax())  # then the neighbourhood of the largest, finer
    fine = np.linspace(coarse[max(top - 1, 0)], coarse[min(top + 1, len(coarse) - 1)], NUISANCE_POINTS)
    return float(max(at.max(), tail(fine).max())) + gamma + 2 * _TAIL


def _binom_pmf(k: np.ndarray, n: int, p: np.ndarray) -> np.ndarray:
    """P(Binomial(n, p) = k) for every p (rows) and k (columns); scipy.special, not the slower
    distribution objects (the exact bound evaluates thousands per call)."""
    p = np.clip(p, 1e-300, 1 - 1e-16)[:, None]
    log = gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
    return np.exp(log[None, :] + k[None, :] * np.log(p) + (n - k)[None, :] * np.log1p(-p))


def _binom_at_least(c: np.ndarray, d: np.ndarray, p: np.ndarray) -> np.ndarray:
    """P(Binomial(d, p) >= c) for every p (rows) and (c, d) (columns): the regularized incomplete beta."""
    inside = (c >= 1) & (c <= d)
    cc, dd = np.where(inside, c, 1), np.where(inside, d, 1)
    out = betainc(cc[None, :].astype(float), (dd - cc + 1)[None, :].astype(float), p[:, None])
    return np.where(inside[None, :], out, np.where(c[None, :] <= 0, 1.0, 0.0))


def exact_passes(b: int, c: int, n: int, margin: float, confidence: float) -> bool:
    """Whether the exact test rejects delta <= -margin at ``confidence``: the gate's PASS rule for one
    0/1 outcome per item (``exact_bounds``'s lower bound is above -margin exactly then)."""
    return exact_p(b, c, n, -margin) <= 1 - confidence


@lru_cache(maxsize=65536)  # a function of four integers and a level: simulations and looks meet the same counts
def exact_bounds(b: int, c: int, n: int, confidence: float) -> tuple[float, float]:
    """One-sided exact lower and upper bounds of the paired delta of 0/1 items (b reference-only,
    c candidate-only of n): the largest delta0 the exact test rejects, found by bisection to 1e-7;
    the upper bound is the lower one with the arms swapped. Both discordant counts count: 4 lost and
    4 won of 200 give -0.0268 (the loss rate's Clopper-Pearson bound alone: -0.045); 1 lost, 0 won
    of 200 gives -0.0236, so it does not certify 0.02; none of 200: -0.0150 (the rule of three)."""
    alpha = 1 - confidence

    def lower(lost: int, won: int) -> float:
        lo, hi = -1 + 1e-9, (won - lost) / n  # rejected at lo (else the bound is -1), never at the estimate
        if exact_p(lost, won, n, lo) > alpha:
            return -1.0
        near = score_bounds(lost, won, n, confidence)[0]  # the exact bound lies near the asymptotic one
        for probe in (near - 0.003, near + 0.001, near - 0.02):
            if lo < probe < hi:
                if exact_p(lost, won, n, probe) <= alpha:
                    lo = max(lo, probe)
                else:
                    hi = min(hi, probe)
        # p rises with delta0 (in steps); brentq narrows the bracket [rejected, not rejected] to 1e-7
        excess = lambda d0: exact_p(lost, won, n, d0) - alpha  # noqa: E731
        if hi - lo > 1e-7:
            root = brentq(excess, lo, hi, xtol=5e-8)
            while excess(root) > 0:  # the root's rejected side
                root -= 5e-8
            lo = root
        return float(lo)

    return lower(b, c), -lower(c, b)


_PASS_THRESHOLDS: dict[tuple[int, float, float], dict[int, int]] = {}  # (n, margin, confidence) -> {d: c}


def pass_thresholds(n: int, margin: float, confidence: float, discordant: np.ndarray) -> np.ndarray:
    """Per discordant count d: the fewest candidate-only items c at which n paired 0/1 items PASS
    (``exact_passes``), d + 1 where none does. For a fixed d the p-value falls as c rises (the
    nuisance interval depends on d alone and the statistic rises with c), so PASS is c >= this.
    Searched from the previous d's answer (it moves by about one per d), and kept for reuse."""
    if len(_PASS_THRESHOLDS) > 256:  # a long simulation: keep the memory bounded
        _PASS_THRESHOLDS.clear()
    known = _PASS_THRESHOLDS.setdefault((n, round(margin, 12), round(confidence, 12)), {})
    passes = lambda d, c: exact_passes(d - c, c, n, margin, confidence)  # noqa: E731
    out, guess = [], None
    for d in (int(x) for x in discordant):
        if d not in known:
            if guess is None:  # bisection on c in [0, d + 1]
                lo, hi = 0, d + 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if passes(d, mid) else (mid + 1, hi)
                known[d] = lo
            else:
                c = min(guess, d + 1)
                while c <= d and not passes(d, c):
                    c += 1
                while c > 0 and passes(d, c - 1):
                    c -= 1
                known[d] = c
        guess = known[d]
        out.append(known[d])
    return np.array(out, dtype=int)


@lru_cache(maxsize=4096)
def exact_power(n: int, p_lost: float, p_won: float, margin: float, confidence: float, lost: int = 0, won: int = 0,
                observed: int = 0) -> float:
    """P(the gate PASSes n paired 0/1 items) when each item is reference-only with probability
    ``p_lost`` and candidate-only with ``p_won``, by exact enumeration of the trinomial counts
    (terms below 1e-10 left out). Items drawn at random from any population of items are such
    draws, whatever each item's own probabilities: the power of a one-outcome design holds under
    any item model. With ``observed`` items already run (``lost`` and ``won`` of them), it is the
    conditional power of running the other ``n - observed``."""
    m, s = n - observed, p_lost + p_won
    if m < 0:
        raise ValueError(f"{observed} items observed, more than the design's {n}")
    if s <= 0 or m == 0:
        return float(exact_passes(lost, won, n, margin, confidence)) if s <= 0 or m == 0 else 0.0
    lo, hi = int(sps.binom.ppf(1e-10, m, s)), int(sps.binom.isf(1e-10, m, s)) + 1
    new = np.arange(max(0, lo - 1), min(m, hi) + 1)  # discordant items among the new ones
    need = pass_thresholds(n, margin, confidence, lost + won + new) - won  # candidate-only among them
    return float((sps.binom.pmf(new, m, s) * sps.binom.sf(need - 1, new, p_won / s)).sum())


def exact_loss_bound(losing: int, n: int, confidence: float) -> float:
    """A lower bound on the delta from the count of items that lost: delta >= -P(an item loses), and
    that rate's one-sided Clopper-Pearson upper bound is exact. Used only where per-item deltas are
    not 0/1 (items averaged over repeats) and few lost: the bootstrap sees too little of the losses
    to bound them. 1 losing item of 200 gives -0.0234 at 95%, none gives about -3/n."""
    return -float(sps.beta.ppf(confidence, losing + 1, n - losing)) if losing < n else -1.0


def paired_se(ref: np.ndarray, cand: np.ndarray, strata: np.ndarray | None = None) -> float:
    """The standard error of the paired delta (of stratum deltas' mean, with ``strata``), as
    ``paired_delta`` reports it; the information a sequential look has is 1 / its square."""
    d = cand - ref
    groups = [d] if strata is None else [d[strata == s] for s in np.unique(strata)]
    return math.sqrt(sum(g.var(ddof=1) / len(g) for g in groups if len(g) > 1)) / len(groups) if len(d) else float("nan")


def paired_delta(ref: np.ndarray, cand: np.ndarray, confidence: float, resamples: int, seed: int,
                 strata: np.ndarray | None = None) -> Paired:
    """Paired delta (candidate - reference) of per-item scores with one-sided bounds at ``confidence``.

    Items are the unit (repeats are averaged per item before this), resampled with the same indices
    for both arms. With ``strata`` (tau2 domains) items are resampled within each stratum and the
    statistic is the mean of stratum deltas (the macro average), as the benchmark reports it.

    For one 0/1 outcome per item, unstratified, the bounds are exact (``exact_bounds``: the exact
    unconditional test on Tango's statistic, using both discordant counts). Otherwise they are BCa
    paired bootstrap bounds (the percentile bootstrap's lower bound passed a candidate at the margin
    too often when the deltas are skewed or the discordant items few); where at most ``FEW_LOSSES``
    items lost (unstratified) the bootstrap sees too little of the losses to bound them, so the
    exact bound on the loss rate (``exact_loss_bound``) is computed as well and the lower bound is
    the more conservative of the two; ``method`` says which one it is.
    """
    d = cand - ref
    n = len(d)
    groups = [d] if strata is None else [d[strata == s] for s in np.unique(strata)]
    delta = float(np.mean([g.mean() for g in groups]))
    se = paired_se(ref, cand, strata)
    sd = se * math.sqrt(n)
    where = "" if strata is None else " within domains"
    binary = strata is None and n > 0 and bool(np.isin(ref, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all())
    losing = int((d < 0).sum())
    if binary:  # one 0/1 outcome per item: exact, from both discordant counts
        lower, upper = exact_bounds(losing, int((d > 0).sum()), n, confidence)
        method = (f"exact unconditional bound on Tango's statistic ({losing} lost, {int((d > 0).sum())} won of "
                  f"{n} paired 0/1 items)")
    else:
        lower, upper, floored = _bca(groups, delta, confidence, resamples, seed)
        method = f"BCa paired bootstrap ({resamples} resamples of items{where}" + (
            "; no nearer the delta than the expanded t bound)" if floored else ")")
        if strata is None and losing <= FEW_LOSSES:
            exact = exact_loss_bound(losing, n, confidence)
            if exact < lower:
                method = (f"exact Clopper-Pearson bound on the loss rate ({losing} of {n} items lost; more "
                          f"conservative than the BCa paired bootstrap's {lower:+.4f})")
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


# the most repeats guidance suggests and `gate plan` plans; beyond it, more repeats barely move the bound
MAX_REPEATS = 16


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
    them), ``second_repeat`` (one repeat at a temperature: the noise between repeats is unknown), ``none``
    (no design within the benchmark reaches the power at the observed delta; under greedy decoding
    repeats reproduce the answers, so only items count) or ``loss`` (the observed delta is beyond the
    margin: more data would more likely FAIL it). Where no item differed, how often items differ is
    unmeasured: the powers are those at ``assumed_discordance``, the most often they may differ that the
    data leave plausible, or none is given (``power_at_observed`` None: a design's size alone is no promise)."""
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
    greedy: bool = False  # temperature 0: a repeat reproduces the answers, so more items are the only data to add
    assumed_discordance: float | None = None  # no item differed: the rate of differing items the powers assume


def unmeasured_discordance(n: int, confidence: float) -> float:
    """How often items may differ when none of ``n`` did: the one-sided exact (Clopper-Pearson) upper
    bound of 0 of n at ``confidence``, about 3 / n at 95%. Fewer differing items only raise a design's
    power at a delta of 0, so a power at this rate is one the design delivers at any rate the data allow."""
    return 1 - (1 - confidence) ** (1 / n)


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
             power: float = POWER, greedy: bool = False) -> Guidance:
    """The smallest design that reaches ``power`` at the observed delta, never one the run already has:
    more items at the current repeats while the benchmark has them, else more repeats (up to
    ``MAX_REPEATS``) on all of its items; never another repeat of a ``greedy`` run (temperature 0: it
    reproduces the answers). ``deltas``: items x repeats of paired deltas; ``p``: the comparison's
    ``paired_delta``."""
    between, within = variance_components(deltas)
    n, repeats = p.n, deltas.shape[1]
    # the gate's bound may lie further below the delta than z standard errors: powers use its distance
    z = max(float(sps.norm.ppf(confidence)), (p.delta - p.lower) / p.se) if p.se > 0 else None
    size = max(benchmark_items or n, n)
    var_now = p.se ** 2
    per_item = between + within / repeats
    one_outcome = repeats == 1 and p.method.startswith("exact unconditional")  # the gate's exact rule decides
    if one_outcome and p.delta > -margin:
        return _exact_guidance(int((deltas < 0).sum()), int((deltas > 0).sum()), p, margin, confidence, size,
                               benchmark_items, power, between, greedy)
    if var_now == 0:  # no item differs: only the exact bound (rule of three) limits it, and only items move it
        # The fewest items that could certify the margin were none of them to differ: a floor, not a design
        # with a power (how often items differ is unmeasured, and each one that does widens the bound).
        needed = math.floor(math.log(1 - confidence) / math.log(1 - margin)) + 1 if margin > 0 else None
        ok = needed is not None and n < needed <= size
        return Guidance(action="items" if ok else "none", observed_delta=p.delta, margin=margin, n_items=n,
                        repeats=repeats, benchmark_items=benchmark_items, items_needed=needed if ok else None,
                        repeats_needed=repeats if ok else None, design_items=needed if ok else n, design_repeats=repeats,
                        power_at_observed=None, power_at_zero=None, between=between, within=within,
                        best_margin=certified_margin(exact_loss_bound(0, size, confidence)),
                        certified_margin=certified_margin(p.lower), greedy=greedy)

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
    elif repeats < 2 and not greedy:
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
                    best_margin=certified_margin(best), certified_margin=certified_margin(p.lower), greedy=greedy)


def _exact_guidance(b: int, c: int, p: Paired, margin: float, confidence: float, size: int,
                    benchmark_items: int | None, power: float, between: float, greedy: bool = False) -> Guidance:
    """``guidance`` for one 0/1 outcome per item: the powers are the exact rule's (``exact_power`` of
    the items still to run, at the observed loss and win rates, and at a delta of 0 with the observed
    discordance). The design is found by the normal approximation with the exact bound's distance
    below the delta (each exact power costs ~0.3 s), then checked exactly and enlarged (up to three
    times) while its exact power falls short: the power printed is always the design's exact power.
    Where no item differed (b = c = 0) the rates are unmeasured: the powers are at a delta of 0 with
    items differing at ``unmeasured_discordance`` (the design is the fewest items reaching the power
    there, by bisection), never the certain pass of a design none of whose new items would differ."""
    n = p.n
    assumed = unmeasured_discordance(n, confidence) if b + c == 0 else None
    lost, won = (assumed / 2, assumed / 2) if assumed else (b / n, c / n)
    at_observed = lambda items: exact_power(items, lost, won, margin, confidence, b, c, n)  # noqa: E731
    tied = (lost + won) / 2
    at_zero = lambda items: exact_power(items, tied, tied, margin, confidence, b, c, n)  # noqa: E731
    if size <= n:
        design = None
    elif assumed:  # power rises with the items: the fewest that reach it, if all of them do
        design = None
        if at_observed(size) >= power:
            lo, hi = n + 1, size
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if at_observed(mid) >= power else (mid + 1, hi)
            design = hi
    else:
        z = max(float(sps.norm.ppf(confidence)), (p.delta - p.lower) / p.se)
        grid = np.arange(n + 1, size + 1)
        normal = conditional_power(p.delta, p.se ** 2, p.se ** 2 * n / grid, margin, confidence, p.delta, z)
        reach = np.flatnonzero(normal >= power)
        design = int(grid[reach[0]]) if len(reach) else size
        for _ in range(3):
            if at_observed(design) >= power or design == size:
                break
            design = min(size, design + max(1, design // 8))
    found = design if design is not None and at_observed(design) >= power else None
    shown = design if design is not None else size
    # what the largest design is expected to certify at the observed delta: its bound at the expected counts
    best = exact_bounds(round(lost * size), round(won * size), size, confidence)[0]
    # a second repeat can show how noisy repeats are only where they vary: not under greedy decoding,
    # and not where no item differed (a repeat would not make the items that differ fewer)
    action = "items" if found else ("second_repeat" if b + c and not greedy else "none")
    return Guidance(action=action, observed_delta=p.delta,
                    margin=margin, n_items=n, repeats=1, benchmark_items=benchmark_items, items_needed=found,
                    repeats_needed=1 if found else None, design_items=shown, design_repeats=1,
                    power_at_observed=at_observed(shown) if size > n else None,
                    power_at_zero=at_zero(shown) if size > n else None, between=between, within=0.0,
                    best_margin=certified_margin(best), certified_margin=certified_margin(p.lower), greedy=greedy,
                    assumed_discordance=assumed)


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
