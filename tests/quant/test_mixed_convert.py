"""A mixed recipe (rules with ``layers`` and a rung ``format``) converts into a Quark checkpoint with a
``layer_quant_config``: FP8 per-tensor or MXFP4 weights per layer, static FP8 input scales from a sensitivity
file (a MoE layer's experts share the layer's max, as both engines serve them), and the refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quant.rungs import FP8_MAX
from quant.static_scales import MIN_SCALE_TOKENS, MeasuredInputs, StaticScaleError, input_scales, scale_group

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


def calibration(amax: dict, tokens: dict) -> MeasuredInputs:
    return MeasuredInputs(Path("side.json"), "0" * 64, "arith:train", amax, tokens)


def test_moe_experts_share_their_layers_max_scale_and_few_tokens_are_named():
    from quant.formats import fp8_tensor

    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    amax = {m: float(i) for i, m in enumerate(experts)} | {"model.layers.1.self_attn.o_proj": 5.0}
    tokens = {m: 100 for m in experts} | {"model.layers.1.self_attn.o_proj": MIN_SCALE_TOKENS - 1}
    scales, record, warnings = input_scales([*experts, "model.layers.1.self_attn.o_proj"],
                                            calibration(amax, tokens))
    gate_up_amax = max(amax[m] for m in experts if not m.endswith("down_proj"))
    gate_up = float(fp8_tensor.scale_of(gate_up_amax))
    down = float(fp8_tensor.scale_of(max(amax[m] for m in experts if m.endswith("down_proj"))))
    assert {scales[m] for m in experts if not m.endswith("down_proj")} == {gate_up}
    assert {scales[m] for m in experts if m.endswith("down_proj")} == {down}
    assert scales["model.layers.1.self_attn.o_proj"] == pytest.approx(5.0 / FP8_MAX, rel=1 / 128)  # bf16
    assert record["model.layers.1.mlp.experts.*.gate_up"] == {"amax": gate_up_amax, "tokens": 600, "scale": gate_up}
    assert scale_group("model.layers.1.mlp.experts.2.down_proj") == "model.layers.1.mlp.experts.*.down"
    assert len(warnings) == 1 and "model.layers.1.self_attn.o_proj" in warnings[0] and \
        f"{MIN_SCALE_TOKENS - 1} calibration token" in warnings[0]


def test_a_scale_group_no_token_reached_is_refused():
    experts = [f"model.layers.1.mlp.experts.{e}.down_proj" for e in range(2)]
    with pytest.raises(StaticScaleError, match=r"model\.layers\.1\.mlp\.experts\.\*\.down: no calibration token"):
        input_scales(experts, calibration({m: 0.0 for m in experts}, {m: 0 for m in experts}))


def gate_checkpoint(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from evals.cli import main; sys.exit(main())",
                           "checkpoint", str(folder)], capture_output=True, text=True, timeout=300)


def amax_of(module: str) -> float:
    """Distinct per module, so a scale shows which modules' amax it came from."""
    return 1.0 + sum(map(ord, module)) % 97 / 10


@pytest.fixture(scope="module")
def mixed(glm_ckpt, tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The hand-written mixed recipe (layer 1's routed experts FP8 W8A8, the rest MXFP4 W4A4) converted."""
    tmp = tmp_path_factory.mktemp("mixed")
    (tmp / "mixed.yaml").write_text(LAYER1_FP8)
    sidecar = write_sidecar(tmp / "side.json", linear_modules(glm_ckpt), amax=amax_of)
    proc = quantize("--recipe", tmp / "mixed.yaml", "--sensitivity", sidecar, glm_ckpt, tmp / "out")
    return tmp / "out", sidecar, proc


def test_hand_written_mixed_recipe_converts_with_a_layer_quant_config(mixed):
    from quant.rungs import rung_of_spec

    out, _, proc = mixed
    assert proc.returncode == 0, proc.stderr
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(qconfig["layer_quant_config"]) == ["model.layers.1.mlp.experts*"]
    assert rung_of_spec(qconfig["layer_quant_config"]["model.layers.1.mlp.experts*"]) == "fp8"
    assert rung_of_spec(qconfig["global_quant_config"]) == "mxfp4"
    assert not any("experts." in name and ".shared_experts" not in name for name in qconfig["exclude"])


def test_fp8_experts_are_per_tensor_e4m3_with_the_layers_max_input_scale(mixed, glm_ckpt):
    import torch
    from safetensors.torch import load_file

    from quant.formats import fp8_tensor

    out, _, _ = mixed
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    source = {k: v for f in glm_ckpt.glob("*.safetensors") for k, v in load_file(f).items()}
    experts = [m.removesuffix(".weight") for m in source if m.startswith("model.layers.1.mlp.experts.")]
    gate_up = fp8_tensor.scale_of(max(amax_of(m) for m in experts if not m.endswith("down_proj")))
    down = fp8_tensor.scale_of(max(amax_of(m) for m in experts if m.endswith("down_proj")))
    for module in experts:
        weight, scale = written[module + ".weight"], written[module + ".weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16 and scale.shape == ()
        reference = source[module + ".weight"]
        assert torch.equal(scale, fp8_tensor.weight_scale(reference))  # the codec's bytes: Quark's
        assert torch.equal(weight, fp8_tensor.quantize(reference, scale))
        error = (weight.float() * scale.float() - reference.float()).norm() / reference.float().norm()
        assert float(error) < 0.05  # e4m3's 3 mantissa bits
        input_scale = written[module + ".input_scale"]
        assert input_scale.dtype == torch.bfloat16 and input_scale.shape == ()
        assert torch.equal(input_scale, down if module.endswith("down_proj") else gate_up)
    layer2 = "model.layers.2.mlp.experts.0.gate_proj"
    assert written[layer2 + ".weight"].dtype == torch.uint8 and layer2 + ".input_scale" not in written


def test_gate_checkpoint_reads_the_rungs_and_says_both_engines_load_it(mixed):
    out, _, _ = mixed
    proc = gate_checkpoint(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: loads correctly" in proc.stdout
    # the stored rungs are what the replay compares: the FP8 spec moved to the MXFP4 layer flags both
    broken = out.parent / "broken"
    shutil.copytree(out, broken)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"]["model.layers.2.mlp.experts*"] = \
        config["quantization_config"]["layer_quant_config"].pop("model.layers.1.mlp.experts*")
    (broken / "config.json").write_text(json.dumps(config))
    flagged = gate_checkpoint(broken)
    assert flagged.returncode == 1
    assert "model.layers.1.mlp.experts" in flagged.stdout and "model.layers.2.mlp.experts" in flagged.stdout


def test_manifest_records_the_recipe_rules_rung_per_unit_and_scales(mixed):
    out, sidecar, _ = mixed
    manifest = json.loads((out / "conversion_manifest.json").read_text())
    rules = manifest["recipe"]["rules"]
    assert rules[0]["layers"] == [1] and rules[0]["format"] == "fp8"
    units = {(u["layer"], u["role"], u["mtp"]): u for u in manifest["mixed"]["units"]}
    assert units[1, "routed_expert", False]["rung"] == "fp8" and units[1, "routed_expert", False]["label"] == "W8A8"
    assert units[2, "routed_expert", False]["rung"] == "mxfp4"
    assert units[1, "shared_expert", False]["rung"] == "bf16"
    # bytes per rung: e4m3 codes and two bf16 scalars per FP8 module
    fp8 = units[1, "routed_expert", False]
    tensors = {k: v for s in manifest["shards"] for k, v in s["quantized"].items()}
    layer1 = [t for name, t in tensors.items() if name.startswith("model.layers.1.mlp.experts.")]
    assert fp8["bytes"] == sum(r * c + 4 for r, c in (t["shape"] for t in layer1)) and fp8["modules"] == len(layer1)
    assert all(t["rung"] == "fp8" for t in layer1)
    assert manifest["mixed"]["calibration"]["path"] == str(sidecar)
    assert set(manifest["mixed"]["static_scales"]) == {"model.layers.1.mlp.experts.*.gate_up",
                                                       "model.layers.1.mlp.experts.*.down"}


def test_dry_run_shows_rungs_and_bytes(glm_ckpt, mixed, tmp_path):
    _, sidecar, _ = mixed
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(LAYER1_FP8)
    proc = quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "rungs       mxfp4 W4A4 " in proc.stdout and ", fp8 W8A8 12 Linears" in proc.stdout
    assert any(line.split()[:5] == ["layer", "1", "routed_expert", "fp8", "W8A8"] for line in proc.stdout.splitlines())
    assert not (tmp_path / "out").exists()
    plan = json.loads(quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out", "--dry-run",
                               "--json").stdout)
    assert plan["rungs"]["fp8"]["modules"] == 12 and plan["rungs"]["mxfp4"]["modules"] == 24


def test_serve_refuses_a_rung_the_release_does_not_build(glm_ckpt, tmp_path):
    """W4A8 experts: sglang builds them from 0.5.15 (quark_layers.sglang.yaml); --serve an older one refuses."""
    recipe = tmp_path / "w4a8.yaml"
    recipe.write_text(LAYER1_FP8.replace("format: fp8", "format: mxfp4_fp8"))
    sidecar = write_sidecar(tmp_path / "side.json", linear_modules(glm_ckpt))
    line = refused(quantize("--recipe", recipe, "--sensitivity", sidecar, "--serve", "sglang==0.5.14", glm_ckpt,
                            tmp_path / "out"))
    assert "--serve sglang==0.5.14" in line and "model.layers.1.mlp.experts" in line and "mxfp4_fp8" in line
    assert not (tmp_path / "out").exists()
    served = quantize("--recipe", recipe, "--sensitivity", sidecar, "--serve", "sglang==0.5.23", "--serve",
                      "vllm==0.33.0", glm_ckpt, tmp_path / "out", "--dry-run")
    assert served.returncode == 0, served.stderr


def test_w4a8_layer_converts_with_mxfp4_weights_and_a_static_input_scale(glm_ckpt, tmp_path):
    """W4A8 (mxfp4_fp8): the same MXFP4 bytes as W4A4, plus the layer's input scale; sglang 0.5.23 and vLLM
    0.33.0 / 0.34.0 load it."""
    import torch
    from safetensors.torch import load_file

    from quant.rungs import rung_of_spec

    recipe = tmp_path / "w4a8.yaml"
    recipe.write_text(LAYER1_FP8.replace("format: fp8", "format: mxfp4_fp8"))
    sidecar = write_sidecar(tmp_path / "side.json", linear_modules(glm_ckpt), amax=amax_of)
    proc = quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    reference = quantize(glm_ckpt, tmp_path / "w4a4")  # the default recipe: routed experts W4A4
    assert reference.returncode == 0, reference.stderr
    qconfig = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert rung_of_spec(qconfig["layer_quant_config"]["model.layers.1.mlp.experts*"]) == "mxfp4_fp8"
    written, w4a4 = ({k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
                     for folder in (tmp_path / "out", tmp_path / "w4a4"))
    module = "model.layers.1.mlp.experts.3.up_proj"
    for suffix in (".weight", ".weight_scale"):
        assert torch.equal(written[module + suffix], w4a4[module + suffix])
    assert written[module + ".input_scale"].dtype == torch.bfloat16 and module + ".input_scale" not in w4a4
    for engine in ("sglang==0.5.23", "vllm==0.33.0", "vllm==0.34.0"):
        gate = subprocess.run([sys.executable, "-c", "import sys; from evals.cli import main; sys.exit(main())",
                               "checkpoint", "--engine", engine, str(tmp_path / "out")], capture_output=True,
                              text=True, timeout=300)
        assert gate.returncode == 0 and "verdict: loads correctly" in gate.stdout, (engine, gate.stdout)


def test_fused_experts_at_another_rung_are_refused(tmp_path):
    """Qwen3.5-MoE stores each layer's experts as one fused tensor, which the converter writes at the recipe's own
    format only: a rule giving them another rung is refused naming the tensor, nothing written."""
    from tests.quant.family_checkpoints import write_family_checkpoint

    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_5_moe")
    recipe = tmp_path / "fused.yaml"
    recipe.write_text(LAYER1_FP8.replace("layers: [1]", "layers: [0]"))
    line = refused(quantize("--recipe", recipe, src, tmp_path / "out"))
    assert "stores its routed experts fused" in line and ".mlp.experts" in line
    assert not (tmp_path / "out").exists()


def test_a_scale_from_few_tokens_is_named_in_a_warning(glm_ckpt, recipe, tmp_path):
    sidecar = write_sidecar(tmp_path / "side.json", linear_modules(glm_ckpt), tokens=lambda m: 1)
    proc = quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stdout.splitlines() if line.startswith("warning") and "calibration token" in line]
    assert {w.split()[1] for w in warned} == {"model.layers.1.mlp.experts.*.gate_up:",
                                              "model.layers.1.mlp.experts.*.down:"}
