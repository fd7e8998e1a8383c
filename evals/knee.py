"""``gate load``: the knee of each load sweep at the TTFT SLO, candidate against reference.

The knee of a sweep is the last offered rate that meets the SLO (some requests succeeded, the
success fraction is at least ``min_success``, TTFT p95 <= SLO) before the first rate that breaks
it, read as that rate's achieved RPS and output tok/s: the load the server sustains within the
SLO. It is *bracketed* only when such a breaking rate exists above a rate that met it; otherwise
the sweep says only that the knee lies above its highest rate or below its lowest, and the verdict
is INCONCLUSIVE, naming the rates to add. With both knees bracketed the candidate passes when
both its RPS and its tok/s are at least ``(1 - margin)`` times the reference's.
"""

from __future__ import annotations

from pathlib import Path

from evals.bundle import BundleError
from evals.load import read_load_bundle, slo_breach

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
# What must be equal for two sweeps to be compared: the same requests against the same API.
PAIRED = ("prompt_tokens", "output_tokens", "prefix_hit", "ignore_eos", "api")


def knee(bundle: dict, ttft_slo_s: float, min_success: float) -> dict:
    rows = sorted(bundle["rates"], key=lambda r: r["rate"])
    breaches = [slo_breach(r, ttft_slo_s, min_success) for r in rows]
    first = next((i for i, b in enumerate(breaches) if b), None)
    out = {"bracketed": False, "rate": None, "rps": None, "tok_s": None, "ttft_p95_s": None, "broken_at": None,
           "why": None}
    if not rows:
        return out | {"why": "no rate was measured"}
    if first is None:
        return out | {"why": f"every rate up to {rows[-1]['rate']:g} req/s met the SLO: add higher --rates"}
    out["broken_at"] = {"rate": rows[first]["rate"], "why": breaches[first]}
    if first == 0:
        return out | {"why": f"the lowest rate, {rows[0]['rate']:g} req/s, already broke the SLO ({breaches[0]}): "
                             "add lower --rates"}
    last = rows[first - 1]
    return out | {"bracketed": True, "rate": last["rate"], "rps": last["achieved_rps"], "tok_s": last["output_tok_s"],
                  "ttft_p95_s": last["ttft_p95_s"],
                  "why": f"{last['rate']:g} req/s met the SLO, {rows[first]['rate']:g} broke it ({breaches[first]})"}


def load_gate(candidate: Path, reference: Path, margin: float = 0.05, ttft_slo_s: float | None = None,
              min_success: float | None = None) -> dict:
    cand, ref = read_load_bundle(candidate), read_load_bundle(reference)
    differ = {k: (cand["workload"][k], ref["workload"][k]) for k in PAIRED if cand["workload"][k] != ref["workload"][k]}
    if differ:
        raise BundleError(f"the sweeps ran different workloads {differ} (candidate, reference): rerun one of them")
    if ttft_slo_s is None:
        if cand["ttft_slo_s"] != ref["ttft_slo_s"]:
            raise BundleError(f"the sweeps used different SLOs ({cand['ttft_slo_s']} s, {ref['ttft_slo_s']} s): "
                              "give --ttft-slo")
        ttft_slo_s = cand["ttft_slo_s"]
    min_success = cand.get("min_success", 0.99) if min_success is None else min_success
    kc, kr = knee(cand, ttft_slo_s, min_success), knee(ref, ttft_slo_s, min_success)
    result = {"candidate": str(candidate), "reference": str(reference), "ttft_slo_s": ttft_slo_s,
              "min_success": min_success, "margin": margin, "workload": cand["workload"],
              "tools": {"candidate": cand["tool"], "reference": ref["tool"]},
              "knees": {"candidate": kc, "reference": kr},
              "rates": {"candidate": cand["rates"], "reference": ref["rates"]},
              "rps_ratio": None, "tok_s_ratio": None}
    if not (kc["bracketed"] and kr["bracketed"]):
        why = "; ".join(f"{name}: {k['why']}" for name, k in (("candidate", kc), ("reference", kr)) if not k["bracketed"])
        return result | {"verdict": INCONCLUSIVE, "why": f"no bracketed knee: {why}"}
    rps, tok = kc["rps"] / kr["rps"], kc["tok_s"] / kr["tok_s"]
    result |= {"rps_ratio": rps, "tok_s_ratio": tok}
    worst = min(rps, tok)
    if worst >= 1 - margin:
        return result | {"verdict": PASS, "why": f"candidate sustains {worst:.1%} of the reference's load "
                                                  f"within the SLO (>= {1 - margin:.0%})"}
    return result | {"verdict": FAIL, "why": f"candidate sustains only {worst:.1%} of the reference's load within "
                                              f"the SLO (< {1 - margin:.0%})"}


def human(result: dict) -> str:
    lines = [f"{'':<10} {'knee rate':>10} {'RPS':>8} {'tok/s':>9} {'TTFT p95 s':>10}  bracket"]
    cell = lambda x, f, width: format("-" if x is None else format(x, f), f">{width}")  # noqa: E731
    for name in ("candidate", "reference"):
        k = result["knees"][name]
        lines.append(f"{name:<10} {cell(k['rate'], 'g', 10)} {cell(k['rps'], '.3f', 8)} {cell(k['tok_s'], '.1f', 9)} "
                     f"{cell(k['ttft_p95_s'], '.2f', 10)}  {k['why']}")
    if result["rps_ratio"] is not None:
        lines.append(f"ratio (candidate / reference): RPS {result['rps_ratio']:.3f}, tok/s {result['tok_s_ratio']:.3f}; "
                     f"margin {result['margin']:g}")
    lines.append(f"SLO: TTFT p95 <= {result['ttft_slo_s']:g} s and success >= {result['min_success']:.0%}")
    lines.append(f"verdict: {result['verdict']} ({result['why']})")
    return "\n".join(lines)
