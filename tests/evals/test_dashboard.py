"""The dashboard: figures and tables from the package, and the notebook executed headless."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evals.judge import dashboard
from evals.cli import main as gate
from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from tests.evals.test_gate import binary_pair, bundle, evaluated
from tests.evals.test_load import REFERENCE, load_bundle

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "dashboard.ipynb"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, glm_ckpt):
    root = tmp_path_factory.mktemp("dash")
    ref, cand = binary_pair(200, 6, 2)
    rng = np.random.default_rng(0)
    gref = rng.integers(0, 2, size=(20, 2))
    gcand = gref.copy()
    gcand[:3, 0] = 1 - gcand[:3, 0]
    for name, gsm, gpqa in (("ref", ref, gref), ("cand", cand, gcand)):
        bundle(root / name / "g", "gsm8k", gsm)
        bundle(root / name / "q", "gpqa_diamond", gpqa, repeats=2)
        rows = [json.loads(line) for sub in ("g", "q") for line in (root / name / sub / "samples.jsonl").read_text().splitlines()]
        (root / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / name / "run.json").write_text(json.dumps({"benchmarks": {
            "gsm8k": {"primary_filter": "flexible-extract"}, "gpqa_diamond": {"primary_filter": "flexible-extract"}}}))
    load_bundle(root / "load-ref", REFERENCE)
    load_bundle(root / "load-cand", [(1, 0.99, 1.1, 1), (2, 1.9, 6.0, 1), (3, 2.2, 9.0, 1)])  # knee at half the load
    ckpt = root / "mxfp4"
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), shared_experts="mxfp4")), ckpt, show_progress=False)
    return evaluated(root / "cand", ckpt), root / "ref", ckpt


def test_figures_and_tables_are_not_empty(runs):
    cand, ref, ckpt = runs
    data = dashboard.load(cand, ref, ckpt)
    table = dashboard.published_table(data)
    assert list(table["eval"]) == ["gpqa_diamond", "gsm8k"] and set(table["verdict"]) <= {"PASS", "FAIL", "INCONCLUSIVE"}
    forest = dashboard.forest_plot(data)
    assert len(forest.axes[0].lines) >= 3 * 2  # bound bar, point and margin line per benchmark
    two_by_two = dashboard.discordance_tables(data)["gsm8k"]
    assert two_by_two.loc["reference right", "candidate wrong"] == 6
    assert two_by_two.loc["reference wrong", "candidate right"] == 2
    assert set(dashboard.breakdown_tables(data)["gpqa_diamond"].index) == {"0", "1"}
    matrix = dashboard.error_matrix(data["manifest"])
    assert list(matrix.index) == [1, 2, 3] and "shared_experts.gate_proj" in matrix.columns
    assert ((matrix > 0.05) & (matrix < 0.2)).all().all()
    heat = dashboard.error_heatmap(data)
    assert heat.axes[0].images[0].get_array().shape == matrix.T.shape  # projection kinds down, layers across
    assert set(dashboard.structure_table(data)["status"]) == {"OK"}


def test_gate_release_plots(runs, tmp_path, capsys):
    cand, ref, ckpt = runs
    code = gate(["release", str(ckpt), "--candidate", str(cand), "--reference", str(ref), "--report-dir",
                 str(tmp_path), "--plots", str(tmp_path / "plots"), "--load-candidate", str(cand.parent / "load-cand"),
                 "--load-reference", str(cand.parent / "load-ref")])
    capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and report["verdict"] == "BLOCK" and report["load"]["verdict"] == "FAIL"  # load alone blocks
    assert "## Serving load: FAIL" in (tmp_path / "report.md").read_text()
    for name in ("forest.png", "heatmap.png", "load.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    html = (tmp_path / "plots" / "report.html").read_text()
    assert "data:image/png;base64," in html and "gsm8k" in html and "Serving load <span class='tag bad'>FAIL</span>" in html


def test_load_curves_for_both_sweeps(runs):
    cand, ref, _ = runs
    data = dashboard.load(cand, ref, load_candidate=cand.parent / "load-cand", load_reference=cand.parent / "load-ref")
    table = dashboard.load_table(data)
    assert set(table["run"]) == {"reference", "candidate"} and len(table) == 18  # 3 sweeps x 3 rates per arm
    ax = dashboard.load_curves(data).axes[0]
    sweeps = [line for line in ax.lines if line.get_linestyle() == "-" and len(line.get_xdata()) == 3]
    assert len(sweeps) == 6 and {line.get_color() for line in sweeps} == {"tab:blue", "tab:red"}
    assert [list(line.get_ydata()) for line in sweeps[:3]] == [[1.0, 2.2, 8.0]] * 3  # the reference's, every sweep
    assert list(sweeps[0].get_xdata()) == pytest.approx([0.99 * 0.98, 1.98 * 0.98, 2.5 * 0.98])
    curves = {line.get_label(): line for line in ax.lines}
    assert list(curves["SLO 5 s"].get_ydata()) == [5.0, 5.0]
    knees = [k["rps"] for k in data["load"]["arms"]["reference"]["sweeps"]]
    assert curves[f"reference knee {math.exp(np.mean(np.log(knees))):.3g} req/s"]  # the arm's geometric-mean knee
    assert "ratio" in ax.get_title() and data["load"]["verdict"] in ax.get_title()


def test_notebook_executes_headless(runs, tmp_path):
    papermill = pytest.importorskip("papermill")
    cand, ref, ckpt = runs
    out = tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), parameters={
        "candidate": str(cand), "reference": str(ref), "checkpoint": str(ckpt),
        "load_candidate": str(cand.parent / "load-cand"), "load_reference": str(cand.parent / "load-ref")},
        kernel_name="python3",
        cwd=str(NOTEBOOK.parents[1]), progress_bar=False)
    executed = json.loads(out.read_text())
    outputs = [o for c in executed["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # forest plot, load curves and heatmap


def test_the_readme_notebook_command_runs_from_any_folder(runs, tmp_path):
    """The README's headless command as written, started in a folder that is not the clone (its
    ``$CLONE`` is the clone, its runs and checkpoint the test's): it named the policy by its path in
    the clone, manifests/gates/release.yaml, found only from the clone's root."""
    pytest.importorskip("papermill")
    cand, ref, ckpt = runs
    command = re.search(r"`(papermill [^`]+)`", (NOTEBOOK.parents[1] / "README.md").read_text()).group(1)
    argv = shlex.split(command.replace("$CLONE", str(NOTEBOOK.parents[1])).replace("/ckpt/GLM-5-mxfp4", str(ckpt)))
    for run, copy in ((cand, "runs/mxfp4"), (ref, "runs/fp8")):
        shutil.copytree(run, tmp_path / copy)
    done = subprocess.run([sys.executable, "-m", *argv, "--kernel", "python3", "--no-progress-bar"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [o.get("text", "") for c in json.loads((tmp_path / "out.ipynb").read_text())["cells"]
               for o in c.get("outputs", [])]
    assert any("verdict:" in "".join(t) for t in printed) and any("release.yaml" in "".join(t) for t in printed)


def test_scales_a_reader_can_trust(runs):
    """Percent and points, an axis that always shows the margin, colours centred on the format's error."""
    cand, ref, ckpt = runs
    data = dashboard.load(cand, ref, ckpt)
    row = dashboard.published_table(data).iloc[0]
    assert row["reference"].endswith("]") and "%" in row["reference"] and row["delta"].endswith(" pts")
    ax = dashboard.forest_plot(data).axes[0]
    widest = max(b["margin"] for b in data["accuracy"]["benchmarks"])
    low, high = ax.get_xlim()
    assert low <= -200 * widest and high >= 100 * widest and len(ax.get_xticks()) <= 10
    expected = dashboard.format_error("mxfp4")
    assert 0.05 < expected < 0.2  # E2M1 with a shared power-of-two scale on Gaussian weights
    vmin, vmax = dashboard.error_heatmap(data).axes[0].images[0].get_clim()  # percent off the format's error
    assert vmin == -vmax and vmax >= 100 * dashboard.MIN_SPAN
    assert dashboard.headline(data) == (data["accuracy"]["verdict"], data["accuracy"]["blocking"])
    released = {**data, "release": {"verdict": "BLOCK", "reasons": ["accuracy: INCONCLUSIVE"]}}
    assert dashboard.headline(released) == ("BLOCK", ["accuracy: INCONCLUSIVE"])
