"""``gate checkpoint`` over the release window: every registry release of each engine answered for,
failing and loading releases named as ranges, releases not replayed named (never vouched for), the MTP
draft as a switch, and the shared-expert fusion and MoE shape of each release even where it loads.

The checkpoints are quantgate's own output for GLM-5's layout at 256 routed experts (headers over
holes, tests/quant/test_fusion.py), whose class is read for every sglang release of the window.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import quantgate
from evals.cli import main as gate
from quant.example import tiny_config
from quant.layout import manifests_root
from quant.recipe import Rule, load_recipe, with_overrides
from tests.conftest import write_sparse_checkpoint
from tests.quant.test_fusion import write_planned

REPO = Path(__file__).parents[2]
AITER = REPO / "tests" / "quant" / "data" / "aiter_configs"
MTP_SHARED = [f"model.layers.2.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-5 at 256 routed experts (layer 0 dense, layer 1 MoE, MTP layer 2) in three of quantgate's outputs."""
    root = tmp_path_factory.mktemp("window")
    write_sparse_checkpoint(root / "bf16", tiny_config("glm_moe_dsa", num_hidden_layers=2, n_routed_experts=256),
                            shards=2)
    # the default recipe: bf16 shared experts beside MXFP4 routed ones (fused: they clash up to 0.5.17)
    write_planned(root / "bf16", root / "default", load_recipe())
    # MXFP4 shared experts, the draft's routed experts bf16: the draft's fused shared expert clashes
    write_planned(root / "bf16", root / "draft", with_overrides(load_recipe(), shared_experts="mxfp4",
                                                                  mtp_experts="bf16"))
    # MXFP4 main-model shared experts, the MTP layer's experts bf16 and its three shared-expert projections
    # listed by their checkpoint names: sglang 0.5.18 reads those entries as a veto on fusion for every layer
    base = load_recipe()
    veto = replace(base, rules=(Rule("shared_expert", "keep", mtp=True), Rule("routed_expert", "keep", mtp=True),
                                Rule("shared_expert", "quantize")) + base.rules)

    def checkpoint_names(q):
        q["exclude"] = [e for e in q["exclude"] if not e.startswith("model.decoder.mlp.shared_experts")] + MTP_SHARED

    write_planned(root / "bf16", root / "veto", veto, checkpoint_names)
    return root


def run_gate(capsys, *args) -> tuple[int, dict | str]:
    code = gate(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in args else out.out + out.err)


def verdict(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("verdict: "))


def test_default_run_names_the_failing_and_loading_ranges(glm, capsys):
    code, text = run_gate(capsys, glm / "default", "--engine", "sglang")
    assert code == 1, text
    # one range per outcome, .postN releases inside the range of the release whose rules they follow
    assert "\nsglang 0.5.9-0.5.15.post1: 2 problem(s)\n" in text and "\nsglang 0.5.16-0.5.17: 1 problem(s)\n" in text
    assert "\nsglang 0.5.18-0.5.23: OK\n" in text
    assert "[fusion] model.layers.1.mlp.experts" in text and "[fusion] model.decoder.mlp.experts" in text
    assert verdict(text) == "verdict: would NOT load correctly (sglang 0.5.9-0.5.17)"
    code, report = run_gate(capsys, glm / "default", "--engine", "sglang", "--json")
    releases = {r["release"]: r for r in report["releases"]["sglang"]}
    assert list(releases)[:3] == ["0.5.9", "0.5.10", "0.5.10.post1"] and list(releases)[-1] == "0.5.23"
    assert releases["0.5.10.post1"]["rules"] == releases["0.5.10"]["rules"] == "sglang 0.5.10"
    assert [v for v, r in releases.items() if not r["ok"]][-1] == "0.5.17" and releases["0.5.18"]["ok"]
    assert {r["state"] for r in releases.values()} == {"read"} and report["verdict"] == verdict(text)[9:]


def test_a_release_not_replayed_is_named_and_the_verdict_qualified(glm, tmp_path):
    """A real process over a copy of the package's manifests whose window lists a release no rule file
    has read: it is named, never replayed, and the verdict no longer says an unqualified "loads correctly"."""
    args = [sys.executable, "-m", "evals.cli", "checkpoint", str(glm / "default"), "--engine", "sglang",
            "--disable-shared-experts-fusion"]
    out = subprocess.run(args, check=False, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and verdict(out.stdout) == "verdict: loads correctly", out.stdout + out.stderr
    shutil.copytree(manifests_root(), tmp_path / "manifests")
    window = tmp_path / "manifests" / "engines" / "releases.yaml"
    window.write_text(window.read_text().replace("0.5.22, 0.5.23]", "0.5.22, 0.5.23, 0.5.24]", 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run(args, check=False, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\nsglang 0.5.9-0.5.23: OK\n" in out.stdout and "\nsglang 0.5.24: needs reading, not replayed" in out.stdout
    assert verdict(out.stdout) == "verdict: loads correctly in every release read; not read: sglang 0.5.24 " \
                                  "(needs reading)"
    pinned = subprocess.run(args + ["--engine", "sglang==0.5.24"], check=False, capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert pinned.returncode == 2 and "sglang 0.5.24 has not been read" in pinned.stderr, pinned.stderr
    assert "Traceback" not in pinned.stderr and len(pinned.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spec, says", [
    ("sglang==0.5.99", "sglang 0.5.99 is not a registry release in the window quantgate reads (0.5.9..0.5.23"),
    ("vllm==0.15.0", "vllm 0.15.0 is not a registry release in the window quantgate reads (0.16.0.."),
    ("sglang==latest", "'latest' is not a version"),
])
def test_a_release_outside_the_window_is_one_line_exit_2(glm, spec, says, capsys):
    code, text = run_gate(capsys, glm / "default", "--engine", spec)
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1, text


def test_pinned_release_names_the_rules_it_follows(glm, capsys):
    code, text = run_gate(capsys, glm / "default", "--engine", "sglang==0.5.13.post1")
    assert code == 1 and "\nsglang 0.5.13.post1 (rules of 0.5.13..0.5.14): 2 problem(s)\n" in text, text
    assert verdict(text) == "verdict: would NOT load correctly (sglang 0.5.13.post1)"


def test_the_draft_is_a_switch(glm, capsys):
    """The draft's fused shared expert clashes in sglang 0.5.9-0.5.15.post1 and 0.5.22-0.5.23: with the draft
    (the default, stated) that fails; served without it the same checkpoint loads, the draft's findings apart."""
    code, text = run_gate(capsys, glm / "draft", "--engine", "sglang")
    assert code == 1 and "draft       checked with the MTP draft (--speculative, the default" in text
    assert verdict(text) == "verdict: would NOT load correctly (sglang 0.5.9-0.5.15.post1, 0.5.22-0.5.23)"
    assert "[fusion] model.decoder.mlp.experts" in text and "[fusion] model.layers.1.mlp.experts" not in text
    code, text = run_gate(capsys, glm / "draft", "--engine", "sglang", "--no-speculative")
    assert code == 0 and "draft       served without the MTP draft (--no-speculative)" in text, text
    assert "\nsglang 0.5.9-0.5.23: OK\n" in text and "rocm gfx950 (mi355x), tp 8, no MTP draft" in text
    assert "with the MTP draft (--speculative), sglang 0.5.9-0.5.15.post1, 0.5.22-0.5.23 would also find: " \
           "[fusion] model.decoder.mlp.experts" in text
    code, report = run_gate(capsys, glm / "draft", "--engine", "sglang", "--no-speculative", "--json")
    assert report["ok"] and report["serving"]["speculative"] is False
    apart = report["engines"]["sglang 0.5.22..0.5.23"]
    assert not apart["findings"] and [f["module"] for f in apart["draft_findings"]] == ["model.decoder.mlp.experts"]
    assert quantgate.check(glm / "draft", "sglang==0.5.23", speculative=False).ok
    assert not quantgate.check(glm / "draft", "sglang==0.5.23").ok


def test_fusion_and_moe_shape_per_release_with_a_perf_note(glm, capsys):
    """It loads in every release, but sglang 0.5.18 reads the MTP layer's shared-expert exclude entries
    as a veto on fusion for every layer: the MoE runs 256 experts top-2 instead of 257 top-3."""
    code, text = run_gate(capsys, glm / "veto", "--engine", "sglang", "--no-speculative")
    assert code == 0, text
    assert "\nsglang 0.5.9-0.5.17, 0.5.19-0.5.23: MoE 257 experts, top-3 (fused as expert 256 (topk + 1))\n" in text
    assert "\nsglang 0.5.18: MoE 256 experts, top-2 (not fused: the exclude list keeps shared experts unquantized " \
           "('model.layers.2.mlp.shared_experts.down_proj'" in text
    assert "  perf: sglang 0.5.18: the shared expert is not fused, so the MoE runs 256 experts, top-2 where sglang " \
           "0.5.23 runs 257 experts, top-3 (it loads either way; the kernels are tuned per shape: gate kernels " \
           "--engine sglang==0.5.18)" in text
    code, report = run_gate(capsys, glm / "veto", "--json", "--no-speculative")
    assert report["engines"]["sglang 0.5.18"]["moe"] == {"experts": 256, "topk": 2, "fused_shared": 0}
    assert report["engines"]["sglang 0.5.19..0.5.20"]["moe"] == {"experts": 257, "topk": 3, "fused_shared": 1}
    vllm = [e for e in report["engines"] if e.startswith("vllm")]
    assert vllm and all(report["engines"][e]["moe"]["experts"] == 256 for e in vllm)  # the shared expert runs apart


@pytest.mark.parametrize("spec, experts, topk", [("sglang==0.5.18", 256, 2), ("sglang==0.5.19", 257, 3),
                                                 ("all", 257, 3)])
def test_gate_kernels_takes_the_release_fusion(glm, spec, experts, topk, capsys):
    code = gate(["kernels", str(glm / "veto"), "--engine", spec, "--tp", "1", "--aiter-configs", str(AITER)])
    out = capsys.readouterr().out
    assert code in (0, 1) and f"experts {experts}, topk {topk}" in out, out
