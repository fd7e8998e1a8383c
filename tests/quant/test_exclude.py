"""The exclude list is what sglang and vLLM match: exact names, MTP draft names, fused names, aggregates,
all taken from the engine rule sets."""

from __future__ import annotations

import pytest

from quant.engines import draft_name, rule_sets
from quant.example import tiny_config, write_checkpoint
from quant.plan import make_plan
from quant.recipe import Recipe, RecipeError, Rule, load_recipe, with_overrides
from quant.serving import NamingError, build_exclude


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """One MoE layer (0) and the MTP layer (1), 2 experts: small enough to spell the list out."""
    config = tiny_config("glm_moe_dsa", num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=2)
    return write_checkpoint(tmp_path_factory.mktemp("mtp") / "bf16", config)


def layer_modules(prefix: str) -> list[str]:
    return [prefix + m for m in (
        "mlp.gate", "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.up_proj",
        "self_attn.fused_qkv_a_proj", "self_attn.fused_qkv_a_proj_with_mqa",
        "self_attn.indexer.weights_proj", "self_attn.indexer.wk",
        "self_attn.indexer.wq_b", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj", "self_attn.q_a_proj", "self_attn.q_b_proj")]


def test_exact_exclude_list_with_sglang_aliases(mtp_ckpt):
    exclude = list(make_plan(mtp_ckpt, load_recipe()).exclude)
    expected = sorted(
        ["lm_head", "model.eh_proj", "model.layers.1.eh_proj"]
        + layer_modules("model.layers.0.") + layer_modules("model.layers.1.") + layer_modules("model.decoder."))
    assert exclude == expected
    # The Wafer write-up's bug, the other way round: the module sglang looks up is there.
    assert "model.decoder.mlp.shared_experts.gate_proj" in exclude
    assert not any("*" in name or "?" in name for name in exclude)


def test_mtp_experts_bf16_adds_both_expert_aggregates(mtp_ckpt):
    plan = make_plan(mtp_ckpt, with_overrides(load_recipe(), mtp_experts="bf16"))
    exclude = set(plan.exclude)
    assert {"model.layers.1.mlp.experts", "model.decoder.mlp.experts",
            "model.layers.1.mlp.experts.0.gate_proj", "model.decoder.mlp.experts.1.down_proj"} <= exclude
    assert "model.layers.0.mlp.experts" not in exclude  # main-layer experts are still MXFP4
    assert sum(t.action == "encode" for t in plan.tensors) == 6  # layer 0: 2 experts x 3


def test_shared_experts_mxfp4_leaves_no_shared_entry(mtp_ckpt):
    exclude = make_plan(mtp_ckpt, with_overrides(load_recipe(), shared_experts="mxfp4")).exclude
    assert not [name for name in exclude if "shared_experts" in name]


def test_draft_names_follow_num_hidden_layers_not_78():
    sglang, vllm = rule_sets("sglang")[-1], rule_sets("vllm")[-1]
    assert draft_name("model.layers.61.mlp.shared_experts.up_proj", sglang, 61) == \
        "model.decoder.mlp.shared_experts.up_proj"
    assert draft_name("model.layers.61.eh_proj", sglang, 61) == "model.eh_proj"
    assert draft_name("model.layers.61.shared_head.norm", sglang, 61) == "model.shared_head.norm"
    assert draft_name("model.layers.61.shared_head.head", sglang, 61) is None  # sglang skips it at load
    assert draft_name("model.layers.60.mlp.gate", sglang, 61) == "model.layers.60.mlp.gate"
    assert draft_name("model.layers.78.mlp.gate", sglang, 78) == "model.decoder.mlp.gate"
    assert draft_name("model.layers.61.eh_proj", vllm, 61) == "model.layers.61.eh_proj"


def test_deepseek_family_mtp_at_its_own_index(dsv3_ckpt):
    plan = make_plan(dsv3_ckpt, load_recipe())
    assert plan.num_hidden_layers == 4
    assert {"model.layers.4.mlp.shared_experts.gate_proj", "model.decoder.mlp.shared_experts.gate_proj",
            "model.eh_proj"} <= set(plan.exclude)
    assert not [n for n in plan.exclude if "indexer" in n]


def test_partial_expert_quantization_is_refused(mtp_ckpt):
    recipe = Recipe("partial", "mxfp4", load_recipe().scale_rule, False,
                    (Rule("routed_expert", "quantize"),))
    plan = make_plan(mtp_ckpt, recipe)  # whole layers: fine
    assert plan.exclude
    with pytest.raises(NamingError, match="model.layers.0.mlp.experts: 1 routed-expert weights stay bf16"):
        build_exclude({"model.layers.0.mlp.experts.0.gate_proj"},
                      {"model.layers.0.mlp.experts.1.gate_proj", "model.layers.0.mlp.experts.0.up_proj"}, 1)


def test_fused_shards_must_agree(mtp_ckpt):
    recipe = Recipe("split-qkv", "mxfp4", load_recipe().scale_rule, False, (Rule("attention", "quantize"),))
    plan = make_plan(mtp_ckpt, recipe)  # q_a and kv_a both quantized: agree
    assert "model.layers.0.self_attn.q_a_proj" not in plan.exclude
    with pytest.raises(NamingError, match="different quantization schemes"):
        build_exclude({"model.layers.0.mlp.shared_experts.gate_proj"},
                      {"model.layers.0.mlp.shared_experts.up_proj"}, 1)


def test_eh_proj_can_never_be_quantized(mtp_ckpt):
    recipe = Recipe("bad", "mxfp4", load_recipe().scale_rule, False, (Rule("mtp_proj", "quantize"),))
    with pytest.raises(RecipeError, match="eh_proj.weight"):
        make_plan(mtp_ckpt, recipe)
