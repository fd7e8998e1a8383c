"""A mixed recipe (rules with ``layers`` and a rung ``format``) converts into a Quark checkpoint with a
``layer_quant_config``: FP8 per-tensor or MXFP4 weights per layer, static FP8 input scales from a sensitivity
file (a MoE layer's experts share the layer's max, as both engines serve them), and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quant.rungs import FP8_MAX
from quant.static_scales import MIN_SCALE_TOKENS, Calibration, StaticScaleError, input_scales, scale_group

LAYER1_FP8 = """\
name: layer1-experts-fp8
format: mxfp4
rules:
  - {role: routed_expert, layers: [1], action: quantize, format: fp8}
  - {role: routed_expert, action: quantize}
  - {role: shared_expert, action: keep}
"""


def linear_modules(ckpt: Path) -> list[str]:
    weights = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted(n.removesuffix(".weight") for n in weights if n.endswith("_proj.weight"))


def write_sidecar(path: Path, modules: list[str], amax=lambda m: 2.0, tokens=lambda m: 100) -> Path:
    """A sensitivity file in the shape ``quant.sensitivity`` writes, with the measurements a conversion reads."""
    path.write_text(json.dumps({
        "kind": "quantgate-sensitivity", "version": 1, "source": {"path": "src", "config_sha256": ""},
        "calibration": {"source": "arith:train", "items": 8, "tokens": 400, "item_sha256": []},
        "rungs": ["mxfp4", "mxfp4_fp8", "fp8"], "units": [],
        "amax": {m: amax(m) for m in modules}, "tokens": {m: tokens(m) for m in modules},
        "expert_tokens": {}, "seconds": 0.1, "peak_rss_bytes": 0, "seconds_per_layer": []}))
    return path


def quantize(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def refused(proc: subprocess.CompletedProcess) -> str:
    """The one-line refusal of a run that exited 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture()
def recipe(tmp_path) -> Path:
    path = tmp_path / "mixed.yaml"
    path.write_text(LAYER1_FP8)
    return path


def test_static_scale_rung_without_sensitivity_is_refused_naming_module(glm_ckpt, recipe, tmp_path):
    dst = tmp_path / "out"
    line = refused(quantize("--recipe", recipe, glm_ckpt, dst))
    assert "model.layers.1.mlp.experts." in line and "--sensitivity" in line and "--calibration" in line
    assert not dst.exists()


def test_sensitivity_file_without_the_module_is_refused(glm_ckpt, recipe, tmp_path):
    modules = [m for m in linear_modules(glm_ckpt) if m != "model.layers.1.mlp.experts.2.up_proj"]
    sidecar = write_sidecar(tmp_path / "side.json", modules)
    line = refused(quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out"))
    assert "model.layers.1.mlp.experts.2.up_proj" in line and str(sidecar) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, said", [
    ("{not json", "side.json"),
    ('{"kind": "something-else"}', "not a quantgate sensitivity file"),
    ('{"kind": "quantgate-sensitivity", "amax": {"m": -1}}', "finite non-negative"),
])
def test_unreadable_sensitivity_file_is_refused(glm_ckpt, recipe, tmp_path, content, said):
    sidecar = tmp_path / "side.json"
    sidecar.write_text(content)
    line = refused(quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out", "--dry-run"))
    assert said in line and str(sidecar) in line
    missing = refused(quantize("--recipe", recipe, "--sensitivity", tmp_path / "nope.json", glm_ckpt,
                               tmp_path / "out", "--dry-run"))
    assert "nope.json" in missing


def test_mixed_recipe_with_weight_only_is_refused(glm_ckpt, recipe, tmp_path):
    sidecar = write_sidecar(tmp_path / "side.json", linear_modules(glm_ckpt))
    line = refused(quantize("--recipe", recipe, "--sensitivity", sidecar, "--weight-only", glm_ckpt,
                            tmp_path / "out", "--dry-run"))
    assert "--weight-only" in line and "fp8" in line


def test_one_moe_layer_at_two_rungs_is_refused(glm_ckpt, tmp_path):
    """A family whose manifest gives the experts' down projections a role of their own lets a recipe split a
    layer: refused, since a FusedMoE loads all of its experts with one scheme."""
    from quant.layout import manifests_root

    family = (manifests_root() / "families" / "glm_moe_dsa" / "family.yaml").read_text()
    split = r"  - {role: routed_expert, pattern: '\.mlp\.experts\.(?P<expert>\d+)\.(gate|up|down)_proj\.weight$', "
    assert split in family
    family = family.replace(split, r"  - {role: routed_down, pattern: '\.mlp\.experts\.(?P<expert>\d+)\.down_proj"
                                   r"\.weight$', linear: true}" + "\n" + split)
    (tmp_path / "family.yaml").write_text(family)
    recipe = tmp_path / "split.yaml"
    recipe.write_text("name: split\nformat: mxfp4\nrules:\n"
                      "  - {role: routed_down, layers: [2], action: quantize, format: mxfp4_fp8}\n"
                      "  - {role: routed_down, action: quantize}\n"
                      "  - {role: routed_expert, action: quantize}\n")
    sidecar = write_sidecar(tmp_path / "side.json", linear_modules(glm_ckpt))
    line = refused(quantize("--recipe", recipe, "--family-manifest", tmp_path / "family.yaml", "--sensitivity",
                            sidecar, glm_ckpt, tmp_path / "out", "--dry-run"))
    assert "model.layers.2.mlp.experts" in line and "mxfp4_fp8" in line and "mxfp4 (" in line


def calibration(amax: dict, tokens: dict) -> Calibration:
    return Calibration(Path("side.json"), "0" * 64, "arith:train", amax, tokens)


def test_moe_experts_share_their_layers_max_scale_and_few_tokens_are_named():
    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    amax = {m: float(i) for i, m in enumerate(experts)} | {"model.layers.1.self_attn.o_proj": 5.0}
    tokens = {m: 100 for m in experts} | {"model.layers.1.self_attn.o_proj": MIN_SCALE_TOKENS - 1}
    scales, record, warnings = input_scales([*experts, "model.layers.1.self_attn.o_proj"],
                                            calibration(amax, tokens))
    gate_up = max(amax[m] for m in experts if not m.endswith("down_proj")) / FP8_MAX
    down = max(amax[m] for m in experts if m.endswith("down_proj")) / FP8_MAX
    assert {scales[m] for m in experts if not m.endswith("down_proj")} == {gate_up}
    assert {scales[m] for m in experts if m.endswith("down_proj")} == {down}
    assert scales["model.layers.1.self_attn.o_proj"] == 5.0 / FP8_MAX
    assert record["model.layers.1.mlp.experts.*.gate_up"] == {"amax": gate_up * FP8_MAX, "tokens": 600,
                                                               "scale": gate_up}
    assert scale_group("model.layers.1.mlp.experts.2.down_proj") == "model.layers.1.mlp.experts.*.down"
    assert len(warnings) == 1 and "model.layers.1.self_attn.o_proj" in warnings[0] and \
        f"{MIN_SCALE_TOKENS - 1} calibration token" in warnings[0]


def test_a_scale_group_no_token_reached_is_refused():
    experts = [f"model.layers.1.mlp.experts.{e}.down_proj" for e in range(2)]
    with pytest.raises(StaticScaleError, match=r"model\.layers\.1\.mlp\.experts\.\*\.down: no calibration token"):
        input_scales(experts, calibration({m: 0.0 for m in experts}, {m: 0 for m in experts}))
