"""The release report page, rendered by a real browser: headless Chromium (Debian's ``chromium``;
``.ci/run`` installs it, so its absence fails here rather than skipping)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from evals.cli import main as gate
from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from tests.evals.test_gate import binary_pair, bundle, evaluated


def seed_sized_runs(root: Path) -> tuple[Path, Path]:
    """Reference and candidate runs shaped like the Wafer write-up's: GSM8K 200 x 1 (greedy), GPQA-Diamond
    198 x 2 repeats at temperature 1.0, a candidate about 2 points lower on GPQA (synthetic scores)."""
    rng = np.random.default_rng(1)
    p = rng.beta(2.0, 0.2, 198)
    gpqa = {"ref": (rng.random((198, 2)) < p[:, None]).astype(int).tolist(),
            "cand": (rng.random((198, 2)) < np.clip(p - 0.02, 0, 1)[:, None]).astype(int).tolist()}
    gsm = dict(zip(("ref", "cand"), binary_pair(200, 4, 3, wrong_both=10)))
    for name in ("ref", "cand"):
        bundle(root / name / "g", "gsm8k", gsm[name])
        bundle(root / name / "q", "gpqa_diamond", gpqa[name], repeats=2)
        rows = "".join((root / name / sub / "samples.jsonl").read_text() for sub in ("g", "q"))
        (root / name / "samples.jsonl").write_text(rows)
        (root / name / "run.json").write_text(json.dumps({"benchmarks": {
            "gsm8k": {"primary_filter": "flexible-extract"}, "gpqa_diamond": {"primary_filter": "flexible-extract"}}}))
    return root / "cand", root / "ref"


def release_page(tmp: Path, glm_ckpt: Path) -> Path:
    """``gate release --plots`` on the comparison at the Wafer write-up's sizes; the page it writes."""
    cand, ref = seed_sized_runs(tmp / "runs")
    ckpt = tmp / "mxfp4"
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), shared_experts="mxfp4")), ckpt, show_progress=False)
    policy = tmp / "policy.yaml"  # the two benchmarks of the published GLM-5.2 table, both required
    policy.write_text("benchmarks:\n  gsm8k: {margin: 0.02, required: true}\n  gpqa_diamond: {margin: 0.03, required: true}\n")
    code = gate(["release", str(ckpt), "--candidate", str(evaluated(cand, ckpt)), "--reference", str(ref),
                 "--policy", str(policy), "--report-dir", str(tmp / "report"), "--plots", str(tmp / "plots")])
    assert code == 1  # seed-sized: GPQA cannot be decided, so the release is blocked
    return tmp / "plots" / "report.html"


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "chromium is not installed: apt-get install -y chromium (.ci/run does)"
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory, glm_ckpt) -> Path:
    return release_page(tmp_path_factory.mktemp("page"), glm_ckpt)


def test_page_is_self_contained_with_every_section(page):
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<style>" in html and "border=" not in html
    assert not re.search(r"(src|href)=['\"](?!data:)", html)  # nothing fetched: every image is a data URI
    assert html.count("data:image/png;base64,") == 2  # forest plot and error heatmap
    order = [html.index(s) for s in ("id='verdict'", "<h2>Accuracy", "forest plot", "<h2>Discordance",
                                     "<h2>Per seed and per domain", "<h2>Checkpoint check")]
    assert order == sorted(order)  # verdict first
    report_md = (page.parent.parent / "report" / "report.md").read_text()
    guidance = re.search(r"[^;*]*; the data certify a margin of [\d.]+ \(the one-sided lower bound, rounded up\)",
                         report_md).group(0)
    assert guidance in html.replace("&#x27;", "'")  # the same sentence in report.md and the page


def test_chromium_renders_the_page_with_the_verdict_visible_and_no_console_errors(page, tmp_path):
    shot = tmp_path / "page.png"
    run = chromium("--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=1280,2000",
                   f"file://{page}", profile=tmp_path / "profile")
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    image = Image.open(shot)
    assert image.size == (1280, 2000)
    colours = image.convert("RGB").resize((64, 100)).getcolors(64 * 100)
    assert len(colours) > 50  # not a blank page
    # the banner at the top is the verdict's colour (BLOCK: red)
    top = image.convert("RGB").crop((100, 60, 1180, 120)).resize((1, 1)).getpixel((0, 0))
    assert top[0] > 150 and top[1] < 110 and top[2] < 110, top
    dom = chromium("--dump-dom", f"file://{page}", profile=tmp_path / "profile").stdout
    verdict = re.search(r"<section class=\"verdict bad\" id=\"verdict\"><div class=\"word\">(\w+)</div>", dom)
    assert verdict and verdict.group(1) == "BLOCK"
    assert "do not release" in dom and "gpqa_diamond" in dom
