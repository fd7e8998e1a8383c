"""report.md / report.json for ``gate release``: the verdict, why, the accuracy table and structure.

A report is replaced only by the same release (checkpoint, runs, policy) unless ``--overwrite``,
and never away from its page: the page a replaced report names must be rewritten with it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from evals.errors import Refused
from evals.judge import binding, render
from quant.engines.serving import Serving
from quant.safe_files import read_json


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
             f"- serving setup: {Serving(**structure['serving']).label()}",
             f"- candidate run: `{acc['candidate']}`", f"- reference run: `{acc['reference']}`",
             *([f"- page: `{report['page']}`"] if report.get("page") else []),
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


def files(report: dict, out_dir: Path) -> dict[Path, bytes]:
    """report.json and report.md under ``out_dir``, as the bytes each will hold."""
    return {out_dir / "report.json": strict_json(report).encode(), out_dir / "report.md": markdown(report).encode()}


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _where(path) -> str | None:
    try:
        return str(Path(path).resolve()) if isinstance(path, str) else None
    except (OSError, ValueError):  # a report.json written by hand: a name no file can have
        return path


def release_of(report: dict) -> dict:
    """What makes one release, as its report records it: the checkpoint (its identity), both runs,
    the policy (its sha256 and --margin overrides). A report of another of these is another release."""
    prov, acc = _mapping(report.get("provenance")), _mapping(report.get("accuracy"))
    policy = _mapping(prov.get("policy"))
    margins = sorted((str(b), str(m)) for b, m in _mapping(policy.get("margin_overrides")).items())
    return {"checkpoint": prov.get("candidate_checkpoint_sha256") or _where(report.get("checkpoint")),
            "candidate run": _where(acc.get("candidate")), "reference run": _where(acc.get("reference")),
            "policy": f"sha256 {policy.get('sha256')}" + "".join(f", --margin {b}={m}" for b, m in margins)}


def check_replaceable(report: dict, out_dir: Path, overwrite: bool) -> None:
    """Refuse (exit 2, before anything is written) what writing ``report`` into ``out_dir`` would
    silently lose: a report there of another release (unless ``overwrite``), the page that report
    names left behind with the old verdict, or a page at ``report["page"]`` that is not this
    report's (unless ``overwrite``)."""
    js = out_dir / "report.json"
    saved = None
    if os.path.lexists(js) or os.path.lexists(out_dir / "report.md"):
        saved = read_json(js, Refused, follow=False) if os.path.lexists(js) else {}
        saved = saved if isinstance(saved, dict) and "verdict" in saved else {}
        old, new = release_of(saved) if saved else {}, release_of(json.loads(strict_json(report)))
        differs = [k for k in new if old.get(k) != new[k]]
        if differs and not overwrite:
            what = "; ".join(f"{k}: {old.get(k) or 'not recorded'}, this release's {new[k]}" for k in differs)
            raise Refused((f"{js} is the report of another release ({what})" if saved else
                           f"{out_dir} holds a report.md or report.json that is not a `gate release` report")
                          + ": pass --overwrite to replace it, or --report-dir another folder")
    old_page, page = (saved or {}).get("page"), report.get("page")
    if isinstance(old_page, str) and old_page != page and Path(old_page).name == "report.html" \
            and os.path.isfile(old_page):
        raise Refused(f"{old_page} is the page of {js}, which this release replaces: pass --plots "
                      f"{Path(old_page).parent} to rewrite it with the report (or remove it), so the two never "
                      "disagree")
    if page and old_page != page and os.path.lexists(page) and not overwrite:
        raise Refused(f"{page} is the page of another report than {js}: pass --overwrite to replace it, or "
                      "--plots another folder")
