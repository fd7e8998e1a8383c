"""``gate load``: the knee of each load sweep at the TTFT SLO, and a verdict on the knee ratio with an interval.

The knee of one sweep is the largest achieved RPS at which TTFT p95 <= SLO (the Wafer write-up's
figure: "2.4 RPS at TTFT p95 <= 5 s"): take the highest offered rate that meets the SLO (requests
succeeded, success >= ``min_success``, TTFT p95 <= SLO) and the next rate, which breaks it, and
interpolate log TTFT p95 linearly in achieved RPS between them to where it crosses the SLO. A rate
broken by errors rather than by TTFT gives no slope: the knee is then the meeting rate's RPS. A
noisy breach below a rate that meets the SLO again does not end the knee. Its uncertainty: the
requests of each rate are resampled (bootstrap) for a new p95 per rate and the knee recomputed.

The verdict compares the candidate's sweeps with the reference's on a log scale: the mean log
knee of each arm, the pooled spread of the sweeps around their arm's mean (never below the
within-sweep bootstrap variance), a one-sided 95% Student-t bound on each side. PASS when the
lower bound of the ratio is >= 1 - margin, FAIL when the upper bound is below it, INCONCLUSIVE
otherwise, with the sweeps per arm that would decide it at the observed spread. A margin below
the reference's own A/A spread (how far two of its sweeps differ: sqrt(2) x its sweep-to-sweep SD
of log knee) can never be certified, and is refused with that number.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from scipy import stats as sps

from evals.bundle import BundleError
from evals.errors import Refused
from evals.load import read_sweeps, slo_breach

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
# What must be equal for two sweeps to be compared: the same requests against the same API.
PAIRED = ("prompt_tokens", "output_tokens", "prefix_hit", "ignore_eos", "api")
CONFIDENCE = 0.95  # one-sided, as the accuracy gate's bounds
RESAMPLES = 1000
MAX_SWEEPS = 30  # the most sweeps per arm the INCONCLUSIVE guidance suggests
P95 = 0.95


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_rows(rows: list[dict], where: str) -> None:
    """A rate whose numbers cannot be read is an error naming it, never a rate that meets the SLO."""
    for row in rows:
        if not row["successful"]:
            continue  # nothing succeeded: it breaks the SLO whatever its (absent) latencies
        bad = [k for k in ("achieved_rps", "ttft_p95_s", "success_fraction") if not _finite(row.get(k))]
        if bad or row["ttft_p95_s"] < 0 or row["achieved_rps"] < 0:
            raise BundleError(f"{where}: {row['rate']:g} req/s has {row['successful']} successful requests but "
                              f"{', '.join(f'{k}={row.get(k)!r}' for k in bad) or 'a negative TTFT or RPS'}: "
                              "the sweep's numbers are broken; rerun that sweep")


def p95_rank(n: int) -> int:
    """1-based rank of guidellm's p95 among n sorted values: the first whose cumulative share reaches 0.95
    (guidellm 0.8.1 guidellm/schemas/base/statistics.py, ``Percentiles.from_pdf``: searchsorted on the CDF)."""
    return max(1, math.ceil(P95 * n - 1e-9))


def bootstrap_p95(ttft_s: list[float], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """p95 of ``resamples`` bootstrap resamples of the requests. The k-th smallest of n draws with
    replacement is the value at index floor(n U) with U the k-th order statistic of n uniforms, a
    Beta(k, n + 1 - k) draw: exact, and O(resamples) rather than O(resamples x n)."""
    x = np.sort(np.asarray(ttft_s, dtype=float))
    n = len(x)
    k = p95_rank(n)
    idx = np.minimum((rng.beta(k, n + 1 - k, size=resamples) * n).astype(int), n - 1)
    return x[idx]


def _knees(rps: np.ndarray, p95: np.ndarray, ok: np.ndarray, slo: float):
    """Knee per row of ``p95`` (replicates x rates, rates in offered order): returns (knee RPS or NaN,
    state code 0 bracketed / 1 every rate met / 2 none met, index of the meeting rate)."""
    meets = ok & (p95 <= slo)
    n_rates = meets.shape[1]
    any_met = meets.any(axis=1)
    top = n_rates - 1 - np.argmax(meets[:, ::-1], axis=1)  # highest offered rate that meets the SLO
    above = np.minimum(top + 1, n_rates - 1)
    state = np.where(~any_met, 2, np.where(top == n_rates - 1, 1, 0))
    rows = np.arange(len(p95))
    ta, tb = p95[rows, top], p95[rows, above]
    ra, rb = rps[top], rps[above]
    # the next rate broke it by its TTFT and carried more load: interpolate log TTFT p95 to the SLO
    slope = ok[above] & (tb > slo) & (rb > ra) & (ta > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = (math.log(slo) - np.log(np.where(slope, ta, 1.0))) / (np.log(np.where(slope, tb, 2.0))
                                                                     - np.log(np.where(slope, ta, 1.0)))
    knee = np.where(slope, ra + np.clip(frac, 0, 1) * (rb - ra), ra)
    best_met = np.where(meets, rps[None, :], -np.inf).max(axis=1)  # the largest RPS met, if not the top rate's
    knee = np.maximum(knee, best_met)
    return np.where(state == 0, knee, np.nan), state, top


def knee(rows: list[dict], ttft_slo_s: float, min_success: float, resamples: int = RESAMPLES, seed: int = 0,
         where: str = "sweep") -> dict:
    """The knee of one sweep: ``rps`` (None unless bracketed), its bootstrap 95% interval and log variance,
    the two rates it lies between, and ``why`` in words."""
    rows = sorted(rows, key=lambda r: r["rate"])
    check_rows(rows, where)
    out = {"state": "unmeasured", "bracketed": False, "rps": None, "tok_s": None, "interval": None, "log_var": None,
           "met": None, "broken_at": None, "lowest_rps": None, "why": "no rate was measured"}
    if not rows:
        return out
    breaches = [slo_breach(r, ttft_slo_s, min_success) for r in rows]
    rps = np.array([r["achieved_rps"] if r["successful"] else 0.0 for r in rows], dtype=float)
    p95 = np.array([r["ttft_p95_s"] if r["successful"] else np.inf for r in rows], dtype=float)
    ok = np.array([bool(r["successful"]) and r["success_fraction"] >= min_success for r in rows])
    point, state, top = _knees(rps, p95[None, :], ok, ttft_slo_s)
    state, top = int(state[0]), int(top[0])
    out["lowest_rps"] = float(rps[0])
    if state == 1:
        return out | {"state": "above", "why": f"every rate up to {rows[-1]['rate']:g} req/s met the SLO: "
                                               "add higher --rates"}
    if state == 2:
        return out | {"state": "below", "broken_at": {"rate": rows[0]["rate"], "why": breaches[0]},
                      "why": f"no rate met the SLO; the lowest, {rows[0]['rate']:g} req/s "
                             f"({rps[0]:.3g} achieved), already broke it ({breaches[0]}): add lower --rates"}
    a, b = rows[top], rows[top + 1]
    value = float(point[0])
    share = 0.0 if b["achieved_rps"] <= a["achieved_rps"] else (value - a["achieved_rps"]) / (
        b["achieved_rps"] - a["achieved_rps"])
    tok_s = a["output_tok_s"] + min(max(share, 0.0), 1.0) * ((b["output_tok_s"] or 0.0) - a["output_tok_s"])
    out |= {"state": "bracketed", "bracketed": True, "rps": value, "tok_s": tok_s,
            "met": {k: a[k] for k in ("rate", "achieved_rps", "ttft_p95_s")},
            "broken_at": {"rate": b["rate"], "achieved_rps": b["achieved_rps"], "ttft_p95_s": b["ttft_p95_s"],
                          "why": breaches[top + 1]},
            "why": f"{a['rate']:g} req/s met the SLO, {b['rate']:g} broke it ({breaches[top + 1]})"}
    # bootstrap: every rate with per-request TTFTs gets resampled p95s; the others keep their own
    rng = np.random.default_rng(seed)
    boot = np.repeat(p95[None, :], resamples, axis=0)
    sampled = False
    for i, r in enumerate(rows):
        if r["successful"] and r.get("ttft_s"):
            boot[:, i] = bootstrap_p95(r["ttft_s"], resamples, rng)
            sampled = True
    if sampled:
        reps, _, _ = _knees(rps, boot, ok, ttft_slo_s)
        reps = reps[np.isfinite(reps) & (reps > 0)]
        if len(reps) >= resamples // 2:
            lo, hi = np.quantile(reps, [0.025, 0.975])
            out |= {"interval": [float(lo), float(hi)], "log_var": float(np.var(np.log(reps), ddof=1))}
    return out


def _sweep_knees(sweeps: list[tuple[Path, dict]], slo: float, min_success: float, resamples: int,
                 seed: int) -> list[dict]:
    return [knee(b["rates"], slo, min_success, resamples, seed=seed + n, where=str(path)) | {"sweep": str(path)}
            for n, (path, b) in enumerate(sweeps)]


def _arm(knees: list[dict]) -> dict:
    logs = [math.log(k["rps"]) for k in knees if k["bracketed"] and k["rps"] > 0]
    mean = float(np.mean(logs)) if logs else None
    return {"sweeps": knees, "n": len(knees), "bracketed": len(logs),
            "knee_rps": None if mean is None else math.exp(mean),  # geometric mean over sweeps
            "log_sd": float(np.std(logs, ddof=1)) if len(logs) > 1 else None,
            "boot_var": float(np.mean(vs)) if (vs := [k["log_var"] for k in knees if k["log_var"] is not None]) else None}


def _t(df: int) -> float:
    return float(sps.t.ppf(CONFIDENCE, df))


def sweeps_to_decide(d: float, var: float, threshold: float, have: int) -> int | None:
    """Sweeps per arm (equal arms) at which the one-sided bound would clear ``threshold`` if the mean
    log ratio and the spread stay as observed; None when not within MAX_SWEEPS."""
    for n in range(max(have, 2), MAX_SWEEPS + 1):
        if abs(d - threshold) >= _t(2 * n - 2) * math.sqrt(var * 2 / n):
            return n
    return None


def ratio_verdict(cand: dict, ref: dict, margin: float) -> dict:
    """PASS / FAIL / INCONCLUSIVE on the log knee ratio of two arms of bracketed sweeps."""
    lc = [math.log(k["rps"]) for k in cand["sweeps"]]
    lr = [math.log(k["rps"]) for k in ref["sweeps"]]
    df = len(lc) + len(lr) - 2
    d = float(np.mean(lc) - np.mean(lr))
    threshold = math.log(1 - margin)
    pooled = (sum((x - np.mean(lc)) ** 2 for x in lc) + sum((x - np.mean(lr)) ** 2 for x in lr)) / df if df else 0.0
    floors = [a["boot_var"] for a in (cand, ref) if a["boot_var"] is not None]
    var = max(pooled, float(np.mean(floors)) if floors else 0.0)
    out = {"log_ratio": d, "ratio": math.exp(d), "df": df, "log_sd": math.sqrt(var), "lower": None, "upper": None,
           "threshold": 1 - margin, "sweeps_to_decide": None}
    if df < 1:
        n = sweeps_to_decide(d, var, threshold, 2) if var > 0 else 2
        return out | {"verdict": INCONCLUSIVE, "why": "one sweep per arm has no repeat spread to judge by: run "
                                                      "`evals load --repeats 3` (at least 2 sweeps in an arm)",
                      "sweeps_to_decide": n}
    half = _t(df) * math.sqrt(var * (1 / len(lc) + 1 / len(lr)))
    lower, upper = math.exp(d - half), math.exp(d + half)
    out |= {"lower": lower, "upper": upper}
    span = (f"knee ratio {math.exp(d):.3f}, one-sided 95% bounds [{lower:.3f}, {upper:.3f}] over "
            f"{len(lc)} + {len(lr)} sweeps")
    if lower >= 1 - margin:
        return out | {"verdict": PASS, "why": f"{span}: the lower bound is >= {1 - margin:.3g} (margin {margin:g})"}
    if upper < 1 - margin:
        return out | {"verdict": FAIL, "why": f"{span}: the upper bound is < {1 - margin:.3g} (margin {margin:g}); "
                                               "the candidate sustains less load within the SLO"}
    n = sweeps_to_decide(d, var, threshold, max(len(lc), len(lr)))
    more = (f"about {n} sweeps per arm would decide it at this spread (rerun evals load --repeats {n})" if n else
            f"more sweeps would not decide it within {MAX_SWEEPS} per arm: the ratio sits on the margin")
    return out | {"verdict": INCONCLUSIVE, "sweeps_to_decide": n,
                  "why": f"{span} straddle {1 - margin:.3g} (margin {margin:g}): {more}"}


def _unbracketed(cand: dict, ref: dict, margin: float) -> dict | None:
    """The verdict when some sweep did not bracket its knee; None when every sweep did."""
    loose = [(name, k) for name, arm in (("candidate", cand), ("reference", ref)) for k in arm["sweeps"]
             if not k["bracketed"]]
    if not loose:
        return None
    if all(k["state"] == "below" for k in ref["sweeps"]):
        return {"verdict": INCONCLUSIVE, "why": "the reference's knee is 0: no rate of any reference sweep met the "
                                                "SLO, so there is no load to compare against; loosen --ttft-slo or "
                                                "sweep lower --rates"}
    if ref["bracketed"] == ref["n"] and all(k["state"] == "below" for k in cand["sweeps"]):
        ceiling = max(k["lowest_rps"] for k in cand["sweeps"])  # the candidate's knee is below this in every sweep
        floor = min(k["rps"] for k in ref["sweeps"])
        if ceiling < (1 - margin) * floor:
            return {"verdict": FAIL, "why": f"the candidate broke the SLO at its lowest rate in every sweep "
                                            f"({ceiling:.3g} req/s achieved), below {1 - margin:.3g} x the "
                                            f"reference's smallest knee ({floor:.3g} req/s)"}
    return {"verdict": INCONCLUSIVE, "why": "no bracketed knee in " + "; ".join(f"{name} {k['sweep']}: {k['why']}"
                                                                             for name, k in loose)}


def _noise_floor(ref: dict, margin: float) -> float | None:
    """The reference's A/A spread: the SD of the log ratio of two of its sweeps; refused when above the margin."""
    logs = [math.log(k["rps"]) for k in ref["sweeps"] if k["bracketed"] and k["rps"] > 0]
    var = [v for v in ((float(np.var(logs, ddof=1)) if len(logs) > 1 else None), ref["boot_var"]) if v is not None]
    if not var:
        return None
    spread = math.sqrt(2 * max(var))
    if margin < spread:
        raise Refused(f"--margin {margin:g} is below the reference's own A/A spread {spread:.3f} (two of its "
                      f"{len(logs)} sweeps differ by that much, as SD of the log knee ratio): no candidate could be "
                      f"certified; give --margin {math.ceil(spread * 100) / 100:g} or more, or make the sweeps steadier")
    return spread


def load_gate(candidate: Path, reference: Path, margin: float = 0.10, ttft_slo_s: float | None = None,
              min_success: float | None = None, resamples: int = RESAMPLES) -> dict:
    cand_sweeps, ref_sweeps = read_sweeps(candidate), read_sweeps(reference)
    first_c, first_r = cand_sweeps[0][1], ref_sweeps[0][1]
    for path, b in cand_sweeps + ref_sweeps:
        differ = {k: (b["workload"][k], first_r["workload"][k]) for k in PAIRED if b["workload"][k] != first_r["workload"][k]}
        if differ:
            raise BundleError(f"the sweeps ran different workloads {differ} ({path}, {reference}): rerun one of them")
    if not 0 < margin < 1:
        raise BundleError(f"--margin {margin:g}: expected a fraction in (0, 1)")
    if (ttft_slo_s is not None and not ttft_slo_s > 0) or (min_success is not None and not 0 <= min_success <= 1):
        raise BundleError(f"--ttft-slo {ttft_slo_s} / --min-success {min_success}: expected seconds > 0 and a "
                          "fraction in [0, 1]")
    if ttft_slo_s is None:
        slos = {b["ttft_slo_s"] for _, b in cand_sweeps + ref_sweeps}
        if len(slos) > 1:
            raise BundleError(f"the sweeps used different SLOs ({', '.join(f'{s:g} s' for s in sorted(slos))}): "
                              "give --ttft-slo")
        ttft_slo_s = first_c["ttft_slo_s"]
    min_success = first_c.get("min_success", 0.99) if min_success is None else min_success
    arms = {name: _arm(_sweep_knees(sweeps, ttft_slo_s, min_success, resamples, seed))
            for name, sweeps, seed in (("candidate", cand_sweeps, 0), ("reference", ref_sweeps, 1000))}
    cand, ref = arms["candidate"], arms["reference"]
    result = {"candidate": str(candidate), "reference": str(reference), "ttft_slo_s": ttft_slo_s,
              "min_success": min_success, "margin": margin, "workload": first_c["workload"],
              "tools": {"candidate": first_c["tool"], "reference": first_r["tool"]},
              "arms": arms,  # every sweep's rows, without the per-request TTFTs (in the bundles)
              "rates": {name: [[{k: v for k, v in r.items() if k != "ttft_s"} for r in b["rates"]] for _, b in sweeps]
                        for name, sweeps in (("candidate", cand_sweeps), ("reference", ref_sweeps))},
              "ratio": None, "lower": None, "upper": None, "aa_spread": None, "sweeps_to_decide": None}
    early = _unbracketed(cand, ref, margin)
    if early:
        return result | early
    result["aa_spread"] = _noise_floor(ref, margin)
    verdict = ratio_verdict(cand, ref, margin)
    return result | {k: verdict[k] for k in ("ratio", "lower", "upper", "sweeps_to_decide", "verdict", "why", "df",
                                             "log_sd")}


def _cell(x, f: str) -> str:
    return "-" if x is None else format(x, f)


def knee_text(k: dict) -> str:
    """A sweep's knee in words: '2.41 req/s [2.35, 2.47]' or why there is none."""
    if not k["bracketed"]:
        return k["state"]
    span = f" [{k['interval'][0]:.3g}, {k['interval'][1]:.3g}]" if k["interval"] else ""
    return f"{k['rps']:.3g} req/s{span}"


def human(result: dict) -> str:
    lines = [f"{'':<10} {'sweep':<8} {'knee RPS':>9} {'bootstrap 95%':>16}  bracket"]
    for name in ("candidate", "reference"):
        arm = result["arms"][name]
        for k in arm["sweeps"]:
            span = f"[{k['interval'][0]:.3f}, {k['interval'][1]:.3f}]" if k["interval"] else "-"
            lines.append(f"{name:<10} {Path(k['sweep']).name:<8} {_cell(k['rps'], '.3f'):>9} {span:>16}  {k['why']}")
        lines.append(f"{name:<10} {'all':<8} {_cell(arm['knee_rps'], '.3f'):>9} {'':>16}  geometric mean of "
                     f"{arm['bracketed']} bracketed of {arm['n']} sweeps")
    if result["ratio"] is not None:
        lines.append(f"ratio (candidate / reference): {result['ratio']:.3f}"
                     + (f", one-sided 95% bounds [{result['lower']:.3f}, {result['upper']:.3f}]"
                        if result["lower"] is not None else "")
                     + f"; margin {result['margin']:g} (PASS needs the lower bound >= {1 - result['margin']:.3g})")
    if result["aa_spread"] is not None:
        lines.append(f"reference A/A spread (SD of the log ratio of two of its sweeps): {result['aa_spread']:.3f}")
    lines.append(f"SLO: TTFT p95 <= {result['ttft_slo_s']:g} s and success >= {result['min_success']:.0%}")
    lines.append(f"verdict: {result['verdict']} ({result['why']})")
    return "\n".join(lines)
