"""Looks without inflation: group-sequential boundaries by Lan-DeMets O'Brien-Fleming alpha spending.

A plan fixes the looks before the run: look k happens at information fraction ``t_k`` (the share
of the final look's information, ``t_K = 1``). The one-sided level ``alpha`` (1 - the policy's
confidence) is spent over the looks by the O'Brien-Fleming-like function of Lan & DeMets (1983),

    alpha(t) = 2 - 2 * Phi(z_{1 - alpha/2} / sqrt(t)),

which spends almost nothing early and nearly all of ``alpha`` at the last look. The boundary of
look k is the ``c_k`` with P(no earlier crossing, Z_k >= c_k) = alpha(t_k) - alpha(t_{k-1}) when
the true delta sits exactly at the margin, the Z_k being those of Brownian motion seen at ``t_k``
(corr(Z_j, Z_k) = sqrt(t_j / t_k)); it is computed by numerical integration on a grid (Jennison &
Turnbull, Group Sequential Methods, 2000, ch. 19). So however many looks the plan has, a candidate
at the margin passes at some look with probability at most ``alpha``.

The fractions the gate spends on are the observed ones (``observed_fractions``: each look's
information, 1 / its observed variance, over the larger of the plan's final information and the
final information the look's own data predict; the plan's last look is 1), not the plan's guess
of them: Lan and DeMets' spending function needs the information actually seen, and an audit
measured 6.4% false pass for GPQA 198 x 8 judged at the plan's fractions. Each look's
boundary depends only on the fractions so far (``look_boundaries``).

The gate judges look k at the one-sided confidence ``Phi(c_k)`` (``nominal_confidence``): PASS
when the lower bound at that confidence is above -margin, FAIL when the upper bound at the same
confidence is below it (the mirror boundary: a candidate exactly at the margin is failed with
probability at most ``alpha`` too), otherwise the run continues to the next look; INCONCLUSIVE is
final only at the last look. Both boundaries are non-binding when they are computed: each is
spent as if the other did not stop the run, which keeps each error rate at most ``alpha``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, signal
from scipy.special import ndtr
from scipy import stats as sps

GRID_STEP = 0.01  # on the Brownian scale S(t) = Z(t) * sqrt(t); the boundaries are good to ~1e-4 in z
_SPAN = 9.0  # the grid covers the drift path +/- 9 standard deviations


def spent(t: float, alpha: float) -> float:
    """Alpha spent by information fraction ``t`` (Lan-DeMets O'Brien-Fleming); ``spent(1) == alpha``."""
    if t <= 0:
        return 0.0
    return float(2 - 2 * sps.norm.cdf(sps.norm.ppf(1 - alpha / 2) / math.sqrt(min(t, 1.0))))


def _check(fractions: Sequence[float], to_one: bool = True) -> np.ndarray:
    t = np.asarray(fractions, dtype=float)
    if len(t) == 0 or np.any(np.diff(t) <= 0) or t[0] <= 0 or t[-1] > 1 + 1e-9 or (to_one and abs(t[-1] - 1) > 1e-9):
        raise ValueError(f"information fractions must rise strictly to 1, got {list(fractions)}")
    return t


def _beyond(level: float, start: np.ndarray, weight: np.ndarray, shift: float, sd: float) -> float:
    """P(S_k >= level) for paths at ``start`` with probability ``weight`` moving by N(shift, sd^2)."""
    return float(weight @ ndtr((start + shift - level) / sd))  # ndtr(-x) is sf(x), without the distribution's checks


def _excess(level: float, start: np.ndarray, weight: np.ndarray, shift: float, sd: float, target: float) -> float:
    return _beyond(level, start, weight, shift, sd) - target


def _walk(fractions: Sequence[float], upper: Sequence[float | None], lower: Sequence[float | None] | None,
          drift: float, alpha: float | None = None, to_one: bool = True) -> tuple[list[float], list[float], list[float]]:
    """``(upper boundaries, P(cross upper at k), P(cross lower at k))`` for Brownian motion with
    ``drift`` (E Z_K = drift) seen at ``fractions``. An upper boundary given as None is solved so
    that look k spends ``spent(t_k) - spent(t_{k-1})`` of ``alpha``; a lower boundary (z) stops paths
    as well (None or no list: no lower boundary)."""
    t = _check(fractions, to_one)
    lower = list(lower) if lower is not None else [None] * len(t)
    grid = np.arange(min(0.0, drift) - _SPAN, max(0.0, drift) + _SPAN + GRID_STEP, GRID_STEP)
    bounds, up, down = [], [], []
    mass = None  # probability mass of the paths still running, per grid cell, after the previous look
    prev_t = 0.0
    for k, tk in enumerate(t):
        step = tk - prev_t
        mean_shift, sd = drift * step, math.sqrt(step)
        # the first look: S(t_1) ~ N(drift * t_1, t_1), one point mass at 0 carried forward
        start, weight = (grid, mass) if mass is not None else (np.zeros(1), np.ones(1))
        if upper[k] is None:
            target = spent(tk, alpha) - spent(prev_t, alpha)
            b = optimize.brentq(_excess, -20, 40, args=(start, weight, mean_shift, sd, target), xtol=1e-10)
            z = b / math.sqrt(tk)
        else:
            z = float(upper[k])
            b = z * math.sqrt(tk)
        a = -math.inf if lower[k] is None else float(lower[k]) * math.sqrt(tk)
        bounds.append(z)
        up.append(_beyond(b, start, weight, mean_shift, sd))
        down.append(float(weight.sum()) - _beyond(a, start, weight, mean_shift, sd) if math.isfinite(a) else 0.0)
        # the density of S(t_k) on the grid, then only the part between the boundaries carries on
        if mass is None:
            density = sps.norm.pdf((grid - mean_shift) / sd) / sd
        else:
            offsets = np.arange(-(len(grid) - 1), len(grid)) * GRID_STEP  # y - x on the grid
            kernel = sps.norm.pdf((offsets - mean_shift) / sd) / sd
            density = np.maximum(signal.fftconvolve(mass, kernel)[len(grid) - 1:2 * len(grid) - 1], 0)
        lo_edge, hi_edge = grid - GRID_STEP / 2, grid + GRID_STEP / 2
        share = np.clip((np.minimum(hi_edge, b) - np.maximum(lo_edge, a)) / GRID_STEP, 0, 1)  # cells cut at a, b
        mass = density * GRID_STEP * share
        prev_t = tk
    return bounds, up, down


def boundaries(fractions: Sequence[float], alpha: float) -> list[float]:
    """The z boundary of each look (crossing it: the bound at that look clears the margin)."""
    return _walk(fractions, [None] * len(fractions), None, 0.0, alpha)[0]


def observed_fractions(information: Sequence[float], final_estimates: Sequence[float], planned_final: float,
                       last_is_final: bool) -> list[float]:
    """Information fractions of the looks so far from what each look observed (Lan & DeMets 1983 spend
    alpha on information, not on the plan's guess of it): look j's information ``information[j]``
    (1 / its observed variance) over the larger of the plan's final information and the final
    information look j's data predict (``final_estimates[j]``), so an item model with more noise
    than planned never makes a look spend early what it had not yet seen. The plan's last look is
    fraction 1 (it spends what is left); the others rise strictly and stay below 1."""
    out: list[float] = []
    for k, (now, final) in enumerate(zip(information, final_estimates)):
        if last_is_final and k == len(information) - 1:
            out.append(1.0)
            break
        t = min(now / max(planned_final, final, now), 0.999)  # below 1: the plan's last look spends the rest
        out.append(max(t, out[-1] + 1e-6) if out else max(t, 1e-6))
    return out


def look_boundaries(fractions: Sequence[float], alpha: float) -> list[float]:
    """The z boundary of each look so far at these fractions (the last may be below 1: looks to come
    spend the rest); a look's boundary depends only on its own and the earlier looks' fractions."""
    return _walk(fractions, [None] * len(fractions), None, 0.0, alpha, to_one=False)[0]


def nominal_confidence(z: float) -> float:
    """The one-sided confidence at which a look with boundary ``z`` is judged."""
    return float(sps.norm.cdf(z))


def operating(fractions: Sequence[float], bounds: Sequence[float], drift: float) -> dict:
    """What the sequential design does at ``drift`` (E Z_K of the non-inferiority statistic
    ``(delta + margin) / se_K``): per look, the chance to PASS (cross the upper boundary) and to
    FAIL (cross the mirror one), each path stopping at its first crossing."""
    _, up, down = _walk(fractions, bounds, [-z for z in bounds], drift)
    return {"pass": float(sum(up)), "fail": float(sum(down)), "pass_by_look": up, "fail_by_look": down,
            "stop_by_look": [u + d for u, d in zip(up, down)]}
