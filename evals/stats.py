"""Paired statistics for the accuracy gate (docs/reference.md §7).

Items are the unit: repeats (GPQA seeds, tau2 trials) are averaged per item first, so a question
asked twice is one observation, not two. Everything is deterministic given the bootstrap seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar: Binomial(min(b, c); b + c, 1/2), doubled, capped at 1."""
    if b + c == 0:
        return 1.0
    return float(min(1.0, 2 * sps.binom.cdf(min(b, c), b + c, 0.5)))


def mean_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: two-sided normal interval over items, ``mean +/- z * sd / sqrt(n)``."""
    n = len(values)
    mean = float(values.mean()) if n else float("nan")
    if n < 2:
        return mean, float("nan"), float("nan")
    half = sps.norm.ppf(0.5 + confidence / 2) * float(values.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def wilson_interval(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Wilson score interval for a mean of per-item scores in [0, 1].

    Exact for 0/1 items, conservative for items averaged over repeats (their variance is below
    p(1 - p)); unlike ``mean +/- z * se`` it stays inside [0, 1] and is not zero-width at 0 or 1."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p = float(values.mean())
    z = sps.norm.ppf(0.5 + confidence / 2)
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, float(max(0.0, center - half)), float(min(1.0, center + half))


def macro_interval(values: np.ndarray, strata: np.ndarray, confidence: float = 0.95, resamples: int = 10000,
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


@dataclass(frozen=True)
class Paired:
    n: int
    delta: float
    se: float
    lower: float  # one-sided lower bound at the confidence (paired bootstrap)
    upper: float  # one-sided upper bound
    normal_lower: float
    normal_upper: float
    sd: float


def paired_delta(ref: np.ndarray, cand: np.ndarray, confidence: float, resamples: int, seed: int,
                 strata: np.ndarray | None = None) -> Paired:
    """Paired delta (candidate - reference) of per-item scores with bootstrap and normal bounds.

    The bootstrap resamples items with the same indices for both arms. With ``strata`` (tau2
    domains) it resamples within each stratum and the statistic is the mean of stratum deltas
    (the macro average), as the benchmark reports it.
    """
    d = cand - ref
    n = len(d)
    rng = np.random.default_rng(seed)
    if strata is None:
        delta = float(d.mean())
        boot = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        sd = float(d.std(ddof=1)) if n > 1 else 0.0
        se = sd / math.sqrt(n) if n else float("nan")
    else:
        groups = [d[strata == s] for s in np.unique(strata)]
        delta = float(np.mean([g.mean() for g in groups]))
        boot = np.mean([g[rng.integers(0, len(g), size=(resamples, len(g)))].mean(axis=1) for g in groups], axis=0)
        se = math.sqrt(sum(g.var(ddof=1) / len(g) for g in groups if len(g) > 1)) / len(groups)
        sd = se * math.sqrt(n)
    z = sps.norm.ppf(confidence)
    return Paired(n=n, delta=delta, se=se, lower=float(np.quantile(boot, 1 - confidence)),
                  upper=float(np.quantile(boot, confidence)), normal_lower=float(delta - z * se),
                  normal_upper=float(delta + z * se), sd=sd)


def items_to_decide(sd: float, margin: float, confidence: float, power: float = 0.8) -> int | None:
    """Items a non-inferiority test needs at this per-item sd to certify ``margin`` with ``power``
    when the true delta is 0: ``((z_conf + z_power) * sd / margin)^2``."""
    if margin <= 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 1
    return math.ceil(((sps.norm.ppf(confidence) + sps.norm.ppf(power)) * sd / margin) ** 2)


def discordance(ref: np.ndarray, cand: np.ndarray) -> tuple[int, int]:
    """``(b, c)`` over binary items: b = reference right and candidate wrong, c = the reverse."""
    return int(((ref == 1) & (cand == 0)).sum()), int(((ref == 0) & (cand == 1)).sum())
