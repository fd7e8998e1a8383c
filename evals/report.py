"""report.md / report.json for ``gate release``: the seed's table, with CIs, verdicts and structure."""

from __future__ import annotations

import json
import math
from pathlib import Path

CONVENTION = ("Scores: mean over items (repeats averaged per item) with a two-sided 95% Wilson interval; tau2: the "
              "macro (mean of per-domain pass^1) with a 95% interval from resampling tasks within domains. Delta: "
              "paired (candidate - reference, same items); bounds: one-sided paired bootstrap "
              "(resampling items; tau2 within domains) at the policy's confidence.")


def _finite(obj):
    """NaN / inf -> None, numpy scalars -> Python numbers, recursively."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def strict_json(obj) -> str:
    """Strict JSON (RFC 8259): an undefined number (an interval over one item) is null, never NaN."""
    return json.dumps(_finite(obj), indent=2, allow_nan=False)


def _fmt(score: dict) -> str:
    return f"{score['score']:.4f} [{score['ci_low']:.4f}, {score['ci_high']:.4f}]"


def markdown(report: dict) -> str:
    acc = report["accuracy"]
    lines = [f"# Release gate: {report['verdict']}", "",
             f"- checkpoint: `{report['checkpoint']}` - structure: "
             f"{'loads correctly in ' + ', '.join(report['structure']['engines']) if report['structure']['ok'] else 'WOULD NOT LOAD'}",
             f"- candidate run: `{acc['candidate']}`", f"- reference run: `{acc['reference']}`", "",
             "| eval | n items x repeats | reference | candidate | delta | one-sided bounds | margin | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for b in acc["benchmarks"]:
        lines.append(f"| {b['benchmark']} ({b['filter']}) | {b['n_items']} x {b['repeats']} | {_fmt(b['reference'])} | "
                     f"{_fmt(b['candidate'])} | {b['delta']:+.4f} | [{b['lower']:+.4f}, {b['upper']:+.4f}] | "
                     f"-{b['margin']} | **{b['verdict']}** |")
    lines += ["", CONVENTION, ""]
    for b in acc["benchmarks"]:
        extra = [f"rule: {b['rule']}"]
        if b["mcnemar_p"] is not None:
            extra.append(f"discordant: reference-only {b['discordant_ref_only']}, candidate-only "
                         f"{b['discordant_cand_only']}, exact McNemar p = {b['mcnemar_p']:.4f}")
        if b["items_to_decide"]:
            extra.append(f"about {b['items_to_decide']} items would decide it at this per-item spread (80% power)")
        if b["noise"]:
            extra.append(f"noise floor: reference rerun differs on {b['noise']['reference_self_discordant']} items, "
                         f"candidate on {b['noise']['candidate_discordant']}: "
                         f"{'within noise' if b['noise']['within_noise'] else 'beyond noise'}")
        if b["per_stratum"]:
            extra.append("per " + ("domain" if b["benchmark"] == "tau2" else "seed (repeat)") + ": " + ", ".join(
                f"{k}: {v['reference']:.3f} -> {v['candidate']:.3f}" for k, v in b["per_stratum"].items()))
        lines += [f"**{b['benchmark']}**: " + "; ".join(extra), ""]
    if acc["blocking"]:
        lines += ["## Blocking", *[f"- {x}" for x in acc["blocking"]], ""]
    if report.get("kernels"):
        kern = report["kernels"]
        lines += [f"## MoE kernels ({'blocking' if kern['blocking'] else 'warning'})", "", f"- {kern['summary']}", ""]
    if report.get("load"):
        lines += load_markdown(report["load"])
    problems = [f for e in report["structure"]["engines"].values() for f in e["findings"]]
    if problems:
        lines += ["## Structure problems", *[f"- [{f['check']}] `{f['module']}`: {f['why']} (fix: {f['fix']})"
                                             for f in problems], ""]
    return "\n".join(lines)


def load_markdown(load: dict) -> list[str]:
    """The serving-load section: each sweep's knee at the TTFT SLO and the ratio (``gate load``)."""
    cell = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"## Serving load: {load['verdict']}", "",
             f"SLO: TTFT p95 <= {load['ttft_slo_s']:g} s, success >= {load['min_success']:.0%}; margin {load['margin']:g}",
             "", "| run | knee rate | RPS | output tok/s | TTFT p95 | bracket |", "|---|---|---|---|---|---|"]
    for name in ("candidate", "reference"):
        k = load["knees"][name]
        lines.append(f"| {name} | {cell(k['rate'], 'g')} | {cell(k['rps'], '.3f')} | {cell(k['tok_s'], '.1f')} | "
                     f"{cell(k['ttft_p95_s'], '.2f')} | {k['why']} |")
    return lines + ["", f"{load['why']}", ""]


def write(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "report.md", out_dir / "report.json"
    js.write_text(strict_json(report))
    md.write_text(markdown(report))
    return md, js
