"""The release report as one self-contained HTML page (``gate release --plots DIR``), rendered with
its figures before the release writes anything.

Inline CSS, figures embedded as base64 PNG data URIs, no script and nothing fetched: the page
opens the same from a file, a mail attachment or an artifact store. Verdict first (colour and
words), then the accuracy table, forest plot, discordance, per-repeat and per-domain breakdowns,
the checkpoint check, and kernel-readiness and load when present. Every sentence and table cell
comes from ``evals.judge.render`` / ``evals.judge.report``, as in report.md, the CLI and the notebook.
"""

from __future__ import annotations

import base64
import io
from html import escape
from pathlib import Path

import pandas as pd

from evals.judge import binding, dashboard, render
from evals.judge.report import LOAD_COLUMNS, load_summary

TONE = {"RELEASE": "good", "PASS": "good", "OK": "good", "BLOCK": "bad", "FAIL": "bad", "PROBLEM": "bad",
        "INCONCLUSIVE": "unsure"}
WORDS = {"RELEASE": "release: every gate passed", "BLOCK": "do not release",
         "PASS": "accuracy: the candidate is within every margin", "FAIL": "accuracy: the candidate is worse",
         "INCONCLUSIVE": "accuracy: the data cannot decide"}
CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#f4f6f9;margin:0}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d5dae3;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
.verdict{border-radius:10px;padding:18px 22px;color:#fff;margin-bottom:18px}
.verdict .word{font-size:34px;font-weight:800;letter-spacing:.04em}
.verdict ul{margin:8px 0 0;padding-left:20px}
.good{background:#1f8a4c} .bad{background:#c0392b} .unsure{background:#d68910}
.tag{display:inline-block;border-radius:4px;padding:1px 8px;color:#fff;font-weight:700;font-size:13px}
.caveat{background:#fff3cd;border-left:5px solid #d68910;padding:8px 12px;margin:8px 0}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px;font-size:13.5px}
th,td{border:1px solid #d5dae3;padding:5px 9px;text-align:left;vertical-align:top}
th{background:#e9edf3} tr:nth-child(even) td{background:#f9fafc}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.notes{margin:2px 0 12px;padding-left:20px;font-size:13.5px} .small{color:#5a6375;font-size:12.5px}
figure{margin:8px 0 16px;background:#fff;padding:8px;border:1px solid #d5dae3;border-radius:6px}
figure img{max-width:100%;height:auto;display:block} code{font-size:12.5px}
.grid{display:flex;flex-wrap:wrap;gap:18px}
"""


def _tag(word: str) -> str:
    return f"<span class='tag {TONE.get(word, 'unsure')}'>{escape(word)}</span>"


def _table(columns, rows: list[dict], tagged: tuple[str, ...] = ()) -> str:
    """A table of strings; cells named in ``tagged`` (verdicts) get their colour."""
    head = "".join(f"<th>{escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_tag(r[c])}</td>" if c in tagged else f"<td>{escape(str(r[c]))}</td>"
                                     for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _frame(frame: pd.DataFrame, index_name: str = "") -> str:
    def cell(x, column: str) -> str:
        if column == "n":  # a count, made float by the transposed frame
            return str(int(x))
        if isinstance(x, float):
            return f"{x:.4f}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(cell(v, "") for v in x) + "]"
        return str(x)

    rows = [{index_name: str(i), **{str(c): cell(v, str(c)) for c, v in row.items()}} for i, row in frame.iterrows()]
    return _table([index_name, *map(str, frame.columns)], rows)


def _figure(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    return f"<figure><img alt='{escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'/></figure>"


def _verdict(data: dict) -> str:
    word, reasons = dashboard.headline(data)
    items = "".join(f"<li>{escape(r)}</li>" for r in reasons)
    return (f"<section class='verdict {TONE.get(word, 'unsure')}' id='verdict'><div class='word'>{escape(word)}</div>"
            f"<div>{escape(WORDS.get(word, ''))}</div>{f'<ul>{items}</ul>' if items else ''}</section>")


def html(data: dict, pngs: dict[str, bytes]) -> str:
    """The page for what ``dashboard.load`` gathered, with the figures' PNG bytes."""
    acc, release = data.get("accuracy"), data.get("release") or {}
    out = [_verdict(data) if (acc or release) else ""]
    runs = [("checkpoint", release.get("checkpoint") or data.get("checkpoint")), ("candidate run", data.get("candidate")),
            ("reference run", data.get("reference"))]
    out.append("<p class='small'>" + " &middot; ".join(f"{k}: <code>{escape(str(v))}</code>" for k, v in runs if v)
               + "</p>")
    prov = binding.lines(release.get("provenance"))  # what judged it: policy, tool, date, recipe, checkpoint hashes
    if prov:
        out.append("<table class='small' id='provenance'><tbody>" + "".join(
            f"<tr><th>{escape(k)}</th><td><code>{escape(v)}</code></td></tr>" for k, v in prov) + "</tbody></table>")
    if acc:
        out += [f"<div class='caveat'>{escape(c)}</div>" for c in render.caveats(acc)]
        out += ["<h2>Accuracy</h2>", _table(render.COLUMNS, render.table(acc), tagged=("verdict",)),
                f"<p class='small'>{escape(render.CONVENTION)}</p>"]
        for b in acc["benchmarks"]:
            out += [f"<h3>{escape(b['benchmark'])} {_tag(b['verdict'])}</h3>", "<ul class='notes'>"
                    + "".join(f"<li>{escape(n)}</li>" for n in render.notes(b)) + "</ul>"]
        out += [_figure(pngs.get("forest"), "forest plot: paired delta per benchmark with its bounds and margin"),
                "<h2>Discordance (paired item x repeat outcomes)</h2><div class='grid'>"]
        out += [f"<div><h3>{escape(name)}</h3>{_frame(t)}</div>" for name, t in dashboard.discordance_tables(data).items()]
        out.append("</div>")
        breakdowns = dashboard.breakdown_tables(data)
        if breakdowns:
            out.append("<h2>Per seed and per domain</h2>")
            out += [f"<h3>{escape(name)} (per {'domain' if name == 'tau2' else 'seed'})</h3>{_frame(t, 'stratum')}"
                    for name, t in breakdowns.items()]
    if data.get("structure"):
        structure = dashboard.structure_table(data)
        out += ["<h2>Checkpoint check</h2>",
                _table(list(structure.columns), structure.to_dict("records"), tagged=("status",))]
    out.append(_figure(pngs.get("heatmap"), "quantization error per layer and projection"))
    kernels = release.get("kernels")
    if kernels:
        out += [f"<h2>MoE kernels {_tag('OK' if kernels.get('ok') else 'BLOCK' if kernels['blocking'] else 'INCONCLUSIVE')}"
                f"</h2><p>{escape(kernels['summary'])} ({'blocking' if kernels['blocking'] else 'warning'})</p>"]
    if data.get("load"):
        load = data["load"]
        slo, rows = load_summary(load)
        out += [f"<h2>Serving load {_tag(load['verdict'])}</h2><p>{escape(slo)}</p>", _table(LOAD_COLUMNS, rows),
                f"<p>{escape(load['why'])}</p>", _figure(pngs.get("load"), "TTFT p95 against achieved requests per second")]
    title = (release.get("verdict") or (acc or {}).get("verdict") or "report")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width,initial-scale=1'>"
            f"<title>quantgate release report: {escape(title)}</title><style>{CSS}</style></head><body><main>"
            "<h1>quantgate release report</h1>" + "\n".join(x for x in out if x) + "</main></body></html>")


def files(data: dict, out_dir: Path) -> dict[Path, bytes]:
    """A PNG per figure and ``report.html``, the page with all of them embedded, as the bytes each
    file under ``out_dir`` will hold (``gate release`` renders them before it writes anything)."""
    pngs, out = {}, {}
    for name, fig in dashboard.figures(data).items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        pngs[name] = out[out_dir / f"{name}.png"] = buf.getvalue()
    out[out_dir / "report.html"] = html(data, pngs).encode()
    return out
