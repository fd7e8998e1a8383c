"""More formats: MXFP6 (byte parity with Quark), block FP8 (the reference), and their plumbing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from evals.cli import main as gate
from quant.cli import main as quantize
from quant.formats import fp8, mx
from quant.formats.codecs import CODECS, get_codec
from quant.formats.constants import E2M1, E2M3, E3M2, ScaleRule
from quant.layout import manifests_root
from quant.recipe import RecipeError, load_recipe
from tests.conftest import QUARK_DEFAULT_RECIPE_EXCLUDES, load_tensors, quark_convert
from tests.quant.test_mxfp4 import edge_case_weight, quark_single_tensor


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2"])
def test_mxfp6_edge_cases_match_quark(tmp_path, fmt):

    weight = edge_case_weight()
    q_packed, q_scales = quark_single_tensor(tmp_path, weight, "even", scheme=fmt)
    packed, scales = mx.quantize(weight, get_codec(fmt).element, ScaleRule.EVEN)
    assert packed.shape == (weight.shape[0], weight.shape[1] * 3 // 4)
    assert torch.equal(scales, q_scales) and torch.equal(packed, q_packed)


@pytest.mark.parametrize("ckpt", ["glm_ckpt", "dsv3_ckpt"])
@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2"])
def test_mxfp6_checkpoints_match_quark(request, tmp_path, ckpt, fmt):
    src = request.getfixturevalue(ckpt)
    quark_config = quark_convert(src, tmp_path / "quark", QUARK_DEFAULT_RECIPE_EXCLUDES, scheme=fmt)
    assert quantize(["--to", fmt, "-q", str(src), str(tmp_path / "ours")]) == 0
    assert load_tensors(tmp_path / "ours") == load_tensors(tmp_path / "quark")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    assert ours["global_quant_config"] == quark_config["quantization_config"]["global_quant_config"]


def test_generic_mx_equals_the_mxfp4_reference_for_e2m1():
    from quant.formats import mxfp4

    weight = edge_case_weight()
    for rule in ScaleRule:
        assert all(torch.equal(a, b) for a, b in zip(mx.quantize(weight, E2M1, rule), mxfp4.quantize(weight, rule)))


def test_mx_decode_inverts_encode_on_grid_values():
    for element in (E2M3, E3M2):
        values = mx.code_values(element)
        grid = values[torch.isfinite(values)][: 32 * (len(values) // 32)].reshape(-1, 32)
        grid[:, 0] = element.max  # pin every block to scale 2^0
        packed, scales = mx.quantize(grid.to(torch.bfloat16), element)
        assert (scales == 127).all()
        assert torch.equal(mx.dequantize(packed, scales, element, torch.float32), grid)


def test_fp8_edge_tiles():
    w = torch.zeros(300, 200)
    w[128:256, 0:128] = torch.linspace(-1000, 1000, 128 * 128).reshape(128, 128)  # beyond 448 before scaling
    w[256:, 128:] = 1e-3
    q, scale_inv = fp8.quantize(w.to(torch.bfloat16))
    assert scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    assert scale_inv[0, 0] == 1.0 and (q[:128, :128].to(torch.float32) == 0).all()  # all-zero tile
    assert scale_inv[1, 0] == pytest.approx(1000 / 448)
    assert q.to(torch.float32).abs().max() == 448  # the tile's amax lands exactly on e4m3's max, never beyond
    assert scale_inv[2, 1] == pytest.approx(float(torch.tensor(1e-3, dtype=torch.bfloat16)) / 448)


def test_fp8_round_trip_error_bound():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=gen) * torch.logspace(-3, 2, 384)).to(torch.bfloat16)
    q, scale_inv = fp8.quantize(w)
    deq = fp8.dequantize(q, scale_inv, torch.float32)
    x = w.to(torch.float32)
    tile_scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 on normals; absolute <= 2^-10 * scale in subnormals
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, tile_scale * 2.0 ** -10) * (1 + 1e-6)).all()


def test_fp8_checkpoint_config_gate_and_decode(glm_ckpt, tmp_path, capsys):
    assert quantize(["--to", "fp8", "-q", str(glm_ckpt), str(tmp_path / "fp8")]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("quant_method", "activation_scheme", "fmt", "weight_block_size")} == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert "model.layers.3.eh_proj" in config["modules_to_not_convert"]
    tensors = load_file(str(tmp_path / "fp8" / "model-00001-of-00003.safetensors"))
    name = "model.layers.0.self_attn.q_a_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn and tensors[name + "_scale_inv"].shape == (1, 1)
    assert gate(["checkpoint", str(tmp_path / "fp8")]) == 0
    capsys.readouterr()
    assert quantize(["--to", "bf16", "-q", str(tmp_path / "fp8"), str(tmp_path / "deq")]) == 0
    decoded = load_file(str(tmp_path / "deq" / "model-00001-of-00003.safetensors"))[name]
    assert torch.equal(decoded, fp8.dequantize(tensors[name], tensors[name + "_scale_inv"]))


def test_mxfp6_gate_and_decode(glm_ckpt, tmp_path, capsys):
    assert quantize(["--to", "mxfp6_e3m2", str(glm_ckpt), str(tmp_path / "m6")]) == 0
    assert "sglang's Quark loader accepts only fp4" in capsys.readouterr().out
    assert gate(["checkpoint", str(tmp_path / "m6"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["engines"]["vllm 0.30.0..0.34.0"]["ok"] and not report["engines"]["sglang 0.5.22..0.5.23"]["ok"]
    assert quantize(["--to", "bf16", "-q", str(tmp_path / "m6"), str(tmp_path / "deq")]) == 0
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    file = json.loads((tmp_path / "m6" / "model.safetensors.index.json").read_text())["weight_map"][name]
    stored = load_file(str(tmp_path / "m6" / file))
    assert stored[name].shape == (64, 32 * 3 // 4) and stored[name + "_scale"].shape == (64, 1)
    decoded = load_file(str(tmp_path / "deq" / file))[name]
    assert torch.equal(decoded, mx.dequantize(stored[name], stored[name + "_scale"], E3M2))


def test_dry_run_sizes_each_format(glm_ckpt, tmp_path, capsys):
    sizes = {}
    for fmt in ("mxfp4", "mxfp6_e2m3", "fp8"):
        assert quantize(["--to", fmt, "--dry-run", "--json", str(glm_ckpt), str(tmp_path / fmt)]) == 0
        sizes[fmt] = json.loads(capsys.readouterr().out)
    expert = 32 * 64  # elements of one tiny routed-expert weight
    delta = sizes["mxfp6_e2m3"]["bytes_out"] - sizes["mxfp4"]["bytes_out"]
    assert delta == pytest.approx(36 * (expert * 3 // 4 - expert // 2), abs=4096)  # 6 vs 4 bits, headers aside
    assert sizes["fp8"]["tensors_quantized"] == 68 and sizes["fp8"]["recipe"]["format"] == "fp8"


def test_mixed_formats_outside_the_ladder_are_refused(tmp_path):
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("name: mixed\nformat: mxfp4\nrules:\n  - {role: routed_expert, action: quantize}\n"
                      "  - {role: shared_expert, action: quantize, format: mxfp6_e2m3}\n")
    with pytest.raises(RecipeError, match="Only an mxfp4 recipe mixes formats, with the ladder's rungs"):
        load_recipe(recipe)
    recipe.write_text("name: mixed\nformat: mxfp4\nrules:\n  - {role: routed_expert, layers: [1], action: quantize, "
                      "format: fp8}\n  - {role: routed_expert, action: quantize}\n")
    assert load_recipe(recipe).mixed
    fp8_recipe = manifests_root() / "recipes" / "fp8-block.yaml"
    with pytest.raises(RecipeError, match="a fp8 recipe cannot produce --to mxfp4"):
        load_recipe(fp8_recipe, "mxfp4")


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8"])
def test_codec_quantize_dequantize_works_on_activations_of_any_rank(name):
    """What evaluation uses to emulate a format on activations: blocks along the last dimension."""
    codec = get_codec(name)
    x = (torch.randn(2, 3, 256) * 3).to(torch.bfloat16)
    y = codec.quantize_dequantize(x)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.equal(y, x)
    if codec.family == "mx":  # the same numbers a weight's rows get, and a fixed point
        rows = x.reshape(6, 256)
        assert torch.equal(y.reshape(6, 256), codec.decode(*codec.quantize(rows)))
        assert torch.equal(codec.quantize_dequantize(y), y)
    else:  # 1x128 groups: each group scaled by its own amax, so its largest value survives exactly
        groups = x.reshape(-1, 128).float()
        top = groups.abs().argmax(dim=1)
        assert torch.equal(y.reshape(-1, 128).float().gather(1, top[:, None]), groups.gather(1, top[:, None]))


def test_cli_choices_come_from_the_codec_registry():
    from quant.cli import build_parser
    from quant.formats.codecs import CODECS

    to = next(a for a in build_parser()._actions if a.dest == "to")
    assert to.choices == [*CODECS, "bf16"]


def test_a_codec_sent_to_a_worker_is_the_registered_one():
    import pickle

    assert all(pickle.loads(pickle.dumps(c)) is c for c in CODECS.values())
