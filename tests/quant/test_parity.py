"""Whole-checkpoint byte parity with AMD Quark 0.13's file-to-file exporter, both naming families."""

from __future__ import annotations

import json

import pytest

from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from tests.conftest import QUARK_DEFAULT_RECIPE_EXCLUDES, load_tensors, quark_convert


@pytest.mark.parametrize("ckpt", ["glm_ckpt", "dsv3_ckpt"])
@pytest.mark.parametrize("rule", ["even", "floor"])
def test_checkpoint_bytes_and_config_match_quark(request, tmp_path, ckpt, rule):
    src = request.getfixturevalue(ckpt)
    quark_config = quark_convert(src, tmp_path / "quark", QUARK_DEFAULT_RECIPE_EXCLUDES, scale_rule=rule)
    plan = make_plan(src, with_overrides(load_recipe(), scale_rule=rule))
    convert(plan, tmp_path / "ours", show_progress=False)

    ours, theirs = load_tensors(tmp_path / "ours"), load_tensors(tmp_path / "quark")
    assert sorted(ours) == sorted(theirs)
    mismatched = [name for name in ours if ours[name] != theirs[name]]
    assert mismatched == []
    assert sum(1 for dtype, _, _ in ours.values() if dtype == "U8") == 2 * 3 * 4 * (
        json.loads((src / "config.json").read_text())["num_hidden_layers"]
        - json.loads((src / "config.json").read_text())["first_k_dense_replace"] + 1)

    our_config = json.loads((tmp_path / "ours" / "config.json").read_text())
    ours_q, theirs_q = our_config.pop("quantization_config"), quark_config.pop("quantization_config")
    assert our_config == quark_config  # every source key kept, num_nextn_predict_layers included
    # Same schema and values; the exclude lists differ only by the engine names Quark omits.
    assert {k: v for k, v in ours_q.items() if k != "exclude"} == {k: v for k, v in theirs_q.items() if k != "exclude"}
    assert set(theirs_q["exclude"]) <= set(ours_q["exclude"])
    extra = set(ours_q["exclude"]) - set(theirs_q["exclude"])
    assert extra and all(name.startswith("model.decoder.") or name == "model.eh_proj"
                         or name.endswith(("gate_up_proj", "fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj",
                                           "wk_weights_proj"))
                         for name in extra), sorted(extra)

    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    quark_index = json.loads((tmp_path / "quark" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == quark_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(p.stat().st_size for p in (tmp_path / "ours").glob("*.safetensors"))
    aux = {p.name for p in src.iterdir()} - {p.name for p in src.glob("*.safetensors")}
    assert aux <= {p.name for p in (tmp_path / "ours").iterdir()}


def test_shared_experts_mxfp4_matches_quark(glm_ckpt, tmp_path):
    excludes = [e for e in QUARK_DEFAULT_RECIPE_EXCLUDES if e != "*shared_experts*"]
    quark_convert(glm_ckpt, tmp_path / "quark", excludes)
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), shared_experts="mxfp4")), tmp_path / "ours",
            show_progress=False)
    assert load_tensors(tmp_path / "ours") == load_tensors(tmp_path / "quark")


def test_weight_only_config_matches_quark(glm_ckpt, tmp_path):
    quark_config = quark_convert(glm_ckpt, tmp_path / "quark", QUARK_DEFAULT_RECIPE_EXCLUDES, weight_only=True)
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), weight_only=True)), tmp_path / "ours",
            show_progress=False)
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    theirs = quark_config["quantization_config"]
    assert ours["global_quant_config"] == theirs["global_quant_config"]
    assert ours["global_quant_config"]["input_tensors"] is None
    assert load_tensors(tmp_path / "ours") == load_tensors(tmp_path / "quark")
