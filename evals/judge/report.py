"""report.md / report.json for ``gate release``: the verdict, why, the accuracy table and structure."""

from __future__ import annotations

import json
import math
from pathlib import Path

from evals.judge import binding, render
from quant.outputs import write_atomic


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


def markdown(report: dict) -> str:
    acc, structure = report["accuracy"], report["structure"]
    loads = ("loads correctly in " + ", ".join(structure["engines"])) if structure["ok"] else "WOULD NOT LOAD"
    lines = [f"# Release gate: {report['verdict']}", "",
             f"- checkpoint: `{report['checkpoint']}` - structure: {loads}",
             f"- candidate run: `{acc['candidate']}`", f"- reference run: `{acc['reference']}`",
             *[f"- {label}: {text}" for label, text in binding.lines(report.get("provenance"))], "",
             *render.markdown(acc)]
    if report["reasons"]:
        lines += ["## Blocking", *[f"- {x}" for x in report["reasons"]], ""]
    if report.get("kernels"):
        kern = report["kernels"]
        lines += [f"## MoE kernels ({'blocking' if kern['blocking'] else 'warning'})", "", f"- {kern['summary']}", ""]
    if report.get("load"):
        lines += load_markdown(report["load"])
    problems = [f for e in structure["engines"].values() for f in e["findings"]]
    if problems:
        lines += ["## Structure problems", *[f"- [{f['check']}] `{f['module']}`: {f['why']} (fix: {f['fix']})"
                                             for f in problems], ""]
    return "\n".join(lines)


LOAD_COLUMNS = ("run", "sweeps", "knee RPS", "per sweep: knee RPS [bootstrap 95%]")


def load_summary(load: dict) -> tuple[str, list[dict]]:
    """The serving-load section's SLO and ratio line and its rows (each arm's knees), as every rendering writes them."""
    from evals.judge.knee import knee_text

    slo = f"SLO: TTFT p95 <= {load['ttft_slo_s']:g} s, success >= {load['min_success']:.0%}; margin {load['margin']:g}"
    if load.get("ratio") is not None:
        slo += f"; knee ratio {load['ratio']:.3f}"
        if load.get("lower") is not None:
            slo += f", one-sided 95% bounds [{load['lower']:.3f}, {load['upper']:.3f}]"
    rows = []
    for name in ("candidate", "reference"):
        arm = load["arms"][name]
        knee = "-" if arm["knee_rps"] is None else f"{arm['knee_rps']:.3f}"
        rows.append(dict(zip(LOAD_COLUMNS, (name, str(arm["n"]), knee,
                                            "; ".join(knee_text(k) for k in arm["sweeps"])))))
    return slo, rows


def load_markdown(load: dict) -> list[str]:
    """The serving-load section: each sweep's knee at the TTFT SLO and the ratio (``gate load``)."""
    slo, rows = load_summary(load)
    lines = [f"## Serving load: {load['verdict']}", "", slo, "", "| " + " | ".join(LOAD_COLUMNS) + " |",
             "|" + "---|" * len(LOAD_COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in LOAD_COLUMNS) + " |" for r in rows]
    return lines + ["", f"{load['why']}", ""]


def write(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "report.md", out_dir / "report.json"
    write_atomic(js, strict_json(report))
    write_atomic(md, markdown(report))
    return md, js
