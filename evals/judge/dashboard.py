"""The dashboard's logic: tables and figures from run bundles, a gate report and a checkpoint.

``notebooks/dashboard.ipynb`` only calls these and displays them; ``gate release --plots DIR``
writes the same figures as PNG and one HTML page (``evals.judge.page``), so everything here is tested
without Jupyter.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import (
    Figure,  # the object API: no global backend, works in scripts and notebooks
)
from matplotlib.patches import Rectangle
from matplotlib.ticker import ScalarFormatter

from evals.judge import render
from evals.errors import BadInput
from evals.judge.gate import accuracy_gate
from evals.judge.policy import load_policy
from quant.safe_files import read_json

_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp\.(?=(?:shared_)?experts\.))?(.+)\.weight$")
_EXPERT_INDEX = re.compile(r"(^|\.)experts\.\d+\.")


def load(candidate=None, reference=None, checkpoint=None, report=None, load_candidate=None,
         load_reference=None, policy=None, saved: dict | None = None) -> dict:
    """Everything the dashboard shows: from a gate report.json (given, or the one `gate release` wrote
    beside the candidate run for these two runs), or computed from the bundles by the gate's own
    ``accuracy_gate`` under ``policy`` (default: the release policy), so the notebook, the page and
    the CLI cannot disagree. A report judged under another policy than ``policy`` is refused.
    ``saved``: the report itself, as it is about to be written to ``report`` (the page is rendered
    before anything is written, so a release writes both or neither)."""
    data: dict = {"candidate": candidate, "reference": reference, "checkpoint": checkpoint}
    if load_candidate and load_reference:
        from evals.judge.knee import load_gate

        data["load"] = load_gate(Path(load_candidate), Path(load_reference))
    report = report or (release_report_beside(candidate, reference) if candidate and reference else None)
    if report:
        if saved is None:
            saved = read_json(Path(report), BadInput, "give the report.json that `gate release` wrote")
        if policy is not None:
            _same_policy(saved["accuracy"]["policy"], load_policy(policy), report)
        data["report"] = str(report)
        data["accuracy"], data["structure"] = saved["accuracy"], saved.get("structure")
        if "verdict" in saved:  # a gate release report: its verdict, reasons and kernel check head the page
            data["release"] = {k: saved.get(k) for k in ("verdict", "reasons", "checkpoint", "kernels", "provenance")}
        data["load"] = data.get("load") or saved.get("load")
        data["candidate"] = data["candidate"] or saved["accuracy"]["candidate"]
        data["reference"] = data["reference"] or saved["accuracy"]["reference"]
    elif candidate and reference:
        data["accuracy"] = accuracy_gate(Path(candidate), Path(reference), load_policy(policy))
    if checkpoint:
        from quant.verify import verify

        data["structure"] = data.get("structure") or verify(Path(checkpoint)).to_dict()
        manifest = Path(checkpoint) / "conversion_manifest.json"
        data["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
        config = Path(checkpoint) / "config.json"
        # layers from num_hidden_layers on are the MTP (next-n) draft's: model.layers.{num_hidden_layers + i}
        data["num_hidden_layers"] = json.loads(config.read_text()).get("num_hidden_layers") if config.exists() else None
    return data


def release_report_beside(candidate, reference) -> Path | None:
    """``CANDIDATE/report.json`` when `gate release` wrote it there (its default) for these two runs."""
    path = Path(candidate) / "report.json"
    if not path.is_file():
        return None
    saved = read_json(path, BadInput, "a report.json beside a run is written by `gate release`")
    accuracy = saved.get("accuracy") if isinstance(saved, dict) else None
    if not isinstance(accuracy, dict) or "verdict" not in saved:  # not a release report: nothing to show
        return None
    same = all(Path(str(accuracy.get(arm))).resolve() == Path(given).resolve()
               for arm, given in (("candidate", candidate), ("reference", reference)))
    return path if same else None


def _same_policy(judged: dict, given, report) -> None:
    """A saved report shown under ``policy`` must have been judged by that policy (margins and all)."""
    ours = given.to_dict()
    if {k: v for k, v in judged.items() if k != "source"} != {k: v for k, v in ours.items() if k != "source"}:
        how = "with other rules (e.g. a --margin override)" if judged.get("source") == ours["source"] else \
            f"not {ours['source']}"
        raise BadInput(f"{report}: judged under the policy {judged.get('source')}, {how}: rerun "
                       f"`gate release ... --policy {ours['source']}`, or leave policy unset to show the report")


def headline(data: dict) -> tuple[str, list[str]]:
    """The decision first, as every rendering shows it: the release verdict (RELEASE / BLOCK) when a
    `gate release` report is given, else the accuracy verdict, with the reasons that decided it."""
    release, accuracy = data.get("release"), data.get("accuracy")
    if release:
        return release["verdict"], list(release["reasons"])
    return accuracy["verdict"], list(accuracy["blocking"])


def published_table(data: dict) -> pd.DataFrame:
    """The comparison table (as in the published GLM-5.2 results), with n, 95% intervals, the paired delta and bounds, and the verdict."""
    return pd.DataFrame(render.table(data["accuracy"]), columns=render.COLUMNS)


def forest_plot(data: dict):
    """Paired delta per benchmark (percentage points) with its one-sided bounds and the margin line.
    The axis always spans from twice the largest margin below 0 to the margin above, so a small run's
    tight or empty interval does not blow the scale up into hundredths of a point."""
    from matplotlib.ticker import MaxNLocator

    benches = data["accuracy"]["benchmarks"]
    fig = Figure(figsize=(7, 1.2 + 0.8 * len(benches)))
    ax = fig.subplots()
    colours = {"PASS": "tab:green", "FAIL": "tab:red", "INCONCLUSIVE": "tab:orange"}
    widest = max(b["margin"] for b in benches)
    lo = max(-100.0, min([100 * b["lower"] for b in benches] + [-200 * widest]))
    hi = min(100.0, max([100 * b["upper"] for b in benches] + [100 * widest]))
    pad = 0.08 * (hi - lo)
    for y, b in enumerate(benches):
        ax.plot([100 * b["lower"], 100 * b["upper"]], [y, y], color=colours[b["verdict"]], linewidth=3)
        ax.plot([100 * b["delta"]], [y], "o", color="black")
        ax.plot([-100 * b["margin"]] * 2, [y - 0.35, y + 0.35], "--", color="grey")
        ax.annotate(b["verdict"], (min(max(100 * b["upper"], 0) + pad / 4, hi), y), va="center", fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(lo - pad, hi + 2 * pad)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax.set_yticks(range(len(benches)), [f"{b['benchmark']}\n{b['n_items']} x {b['repeats']}" for b in benches])
    ax.set_xlabel("paired delta, candidate - reference, percentage points\n(bar: one-sided bounds; dashed: -margin)")
    word, _ = headline(data)
    ax.set_title(f"verdict: {word}" + (f" (accuracy {data['accuracy']['verdict']})" if word != data["accuracy"]["verdict"]
                                        else ""))
    fig.tight_layout()
    return fig


def discordance_tables(data: dict) -> dict[str, pd.DataFrame]:
    """2x2 per benchmark over the gate's paired (item, repeat) outcomes: reference right/wrong x
    candidate right/wrong (from the gate's result, so a saved report.json is enough)."""
    out = {}
    for b in data["accuracy"]["benchmarks"]:
        a = b["agreement"]
        out[b["benchmark"]] = pd.DataFrame([[a["both_right"], a["reference_only"]], [a["candidate_only"], a["both_wrong"]]],
                                           index=["reference right", "reference wrong"],
                                           columns=["candidate right", "candidate wrong"])
    return out


def breakdown_tables(data: dict) -> dict[str, pd.DataFrame]:
    """Per-repeat (GPQA) and per-domain (tau2) scores."""
    return {b["benchmark"]: pd.DataFrame(b["per_stratum"]).T for b in data["accuracy"]["benchmarks"]
            if b.get("per_stratum")}


def structure_table(data: dict) -> pd.DataFrame:
    rows = []
    for engine, result in (data.get("structure") or {}).get("engines", {}).items():
        if not result["findings"]:
            rows.append({"engine": engine, "status": "OK", "module": "", "why": "", "fix": ""})
        rows += [{"engine": engine, "status": "PROBLEM", **{k: f[k] for k in ("module", "why", "fix")}}
                 for f in result["findings"]]
    return pd.DataFrame(rows)


def error_matrix(manifest: dict) -> pd.DataFrame:
    """Relative RMS quantization error, layer x projection kind (``experts.gate_proj``,
    ``shared_experts.up_proj``, ``self_attn.q_b_proj``, ...; routed experts averaged per layer)."""
    cells: dict[tuple[int, str], list[float]] = defaultdict(list)
    for shard in manifest["shards"]:
        for name, info in shard["quantized"].items():
            match = _LAYER_WEIGHT.match(name)
            if match:
                cells[(int(match.group(1)), _EXPERT_INDEX.sub(r"\1experts.", match.group(2)))].append(info["rel_rms_error"])
    frame = pd.Series({k: float(np.mean(v)) for k, v in cells.items()}).unstack()
    return frame.sort_index()[sorted(frame.columns, key=_kind_order)]


def _kind_order(kind: str) -> tuple:
    """Grouped by module (experts, mlp, shared_experts, self_attn...), gate/up/down in data-flow order."""
    group, _, projection = kind.rpartition(".")
    return group, {"gate_proj": 0, "up_proj": 1, "down_proj": 2}.get(projection, 3), projection


# The heatmap's colours span at least this much either side of the format's own error (+-10%): a cell a
# few percent off it stays pale, one 10% or more off it is full colour, and the scale widens to the worst cell.
MIN_SPAN = 0.10


def error_heatmap(data: dict):
    """Layers across, projection kinds down, one cell per (layer, kind); the figure grows with the
    model (GLM-5: 78 layers + the MTP layer) so every label stays readable, and the MTP draft's
    layers (from ``num_hidden_layers`` on) are labelled and framed.

    Colour is each cell's error against the format's own on Gaussian weights (``format_error``; the
    median cell where the format has none), in percent, on a diverging scale: white where a cell
    quantizes like Gaussian weights, red where worse, blue where better. An absolute scale from 0 put
    every cell of a conversion (all near the format's error) in one colour."""
    matrix = error_matrix(data["manifest"]).T  # kinds x layers
    kinds, layers = list(matrix.index), list(matrix.columns)
    first_mtp = data.get("num_hidden_layers")
    mtp = [i for i, layer in enumerate(layers) if first_mtp is not None and layer >= first_mtp]
    fig = Figure(figsize=(max(7.0, 3.0 + 0.17 * len(layers)), 2.0 + 0.32 * len(kinds)), layout="constrained")
    ax = fig.subplots()
    values = matrix.to_numpy(dtype=float)
    finite = values[np.isfinite(values)]
    fmt = (data["manifest"] or {}).get("format") or "mxfp4"
    expected = format_error(fmt)
    known = expected == expected and expected > 0
    median = float(np.median(finite)) if finite.size else 0.0
    centre = expected if known else (median if median > 0 else 1.0)
    percent = 100 * (values / centre - 1)
    worst = float(np.abs(percent[np.isfinite(percent)]).max()) / 100 if finite.size else 0.0
    span = 100 * max(MIN_SPAN, worst)
    colours = matplotlib.colormaps["RdBu_r"].with_extremes(bad="lightgrey")  # grey: no such projection there
    image = ax.imshow(np.ma.masked_invalid(percent), aspect="auto", cmap=colours, interpolation="nearest",
                      vmin=-span, vmax=span)
    ax.set_xticks(range(len(layers)), [f"{layer} MTP" if i in mtp else str(layer) for i, layer in enumerate(layers)],
                  rotation=90, fontsize=7)
    for i in mtp:  # framed in black: red and blue are the colours of the errors
        ax.get_xticklabels()[i].set_fontweight("bold")
        ax.add_patch(Rectangle((i - 0.5, -0.5), 1, len(kinds), fill=False, edgecolor="black", linewidth=2))
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_xlabel("decoder layer" + (" (framed: the MTP draft's layers)" if mtp else ""))
    yardstick = f"{fmt.upper()} on Gaussian weights" if known else "the median cell"
    fig.colorbar(image, ax=ax, label=f"relative RMS error, % vs\n{yardstick} ({centre:.3f})", fraction=0.03, pad=0.01)
    ax.set_title(f"{fmt.upper()} quantization error per layer and projection", fontsize=11)
    return fig


def format_error(name: str) -> float:
    """The relative RMS error a format gives on Gaussian weights (4096 x 64 standard normal values,
    fixed random seed): the yardstick the heatmap's colours are read against."""
    import torch

    from quant.formats.codecs import get_codec

    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    try:
        q = get_codec(name).quantize_dequantize(x).float()
    except (KeyError, ValueError, AttributeError, NotImplementedError):
        return float("nan")
    return float((x - q).norm() / x.norm())


def load_table(data: dict) -> pd.DataFrame:
    """Every load sweep of both arms, rate by rate (``evals load`` rows)."""
    cols = ["rate", "achieved_rps", "ttft_p50_s", "ttft_p95_s", "itl_p50_ms", "output_tok_s", "successful", "errored",
            "incomplete", "success_fraction"]
    return pd.DataFrame([{"run": name, "sweep": n, **{c: row.get(c) for c in cols}}
                         for name in ("reference", "candidate")
                         for n, sweep in enumerate(data["load"]["rates"][name], 1) for row in sweep])


def load_curves(data: dict):
    """TTFT p95 against achieved RPS for every sweep of both arms (log scale), the SLO line, each sweep's
    knee on it with its bootstrap interval, and the ratio's bounds in the title."""
    load_result = data["load"]
    slo = load_result["ttft_slo_s"]
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    for name, colour in (("reference", "tab:blue"), ("candidate", "tab:red")):
        for n, sweep in enumerate(load_result["rates"][name]):
            rows = [r for r in sorted(sweep, key=lambda r: r["rate"]) if r.get("ttft_p95_s") is not None]
            ax.plot([r["achieved_rps"] for r in rows], [r["ttft_p95_s"] for r in rows], "o-", color=colour,
                    alpha=0.55, markersize=3, linewidth=1, label=f"{name} sweeps" if n == 0 else None)
        for k in load_result["arms"][name]["sweeps"]:
            if k["bracketed"]:
                lo, hi = k["interval"] or (k["rps"], k["rps"])
                ax.errorbar([k["rps"]], [slo], xerr=[[k["rps"] - lo], [hi - k["rps"]]], fmt="D", color=colour,
                            markersize=6, capsize=4)
        geo = load_result["arms"][name]["knee_rps"]
        if geo:
            ax.axvline(geo, color=colour, linestyle=":", linewidth=1, label=f"{name} knee {geo:.3g} req/s")
    ax.axhline(slo, linestyle="--", color="grey", label=f"SLO {slo:g} s")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("achieved requests per second")
    ax.set_ylabel("TTFT p95 (s)")
    ratio = load_result.get("ratio")
    bounds = (f", ratio {ratio:.3f}" + (f" [{load_result['lower']:.3f}, {load_result['upper']:.3f}]"
                                        if load_result.get("lower") is not None else "")) if ratio else ""
    ax.set_title(f"serving load: {load_result['verdict']}{bounds}\n(diamonds: each sweep's knee, bootstrap 95%)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figures(data: dict) -> dict:
    out = {"forest": forest_plot(data)} if data.get("accuracy") else {}
    if data.get("load"):
        out["load"] = load_curves(data)
    if data.get("manifest"):
        out["heatmap"] = error_heatmap(data)
    return out
