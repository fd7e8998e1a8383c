"""GLM-5.3-Flash's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# zai-org/GLM-5.3-Flash: 45 layers (three Kimi-Delta-Attention layers per MLA + DSA layer), the first three
# dense, 288 routed experts (moe_intermediate_size 2048) + 1 shared, top-8, one MTP layer at index 45, a
# 24-block vision tower. These are transformers 5.25's Glm5NextTextConfig / Glm5NextVisionConfig defaults,
# the same as sglang 0.5.23's configs/glm5_next.py Glm5NextTextConfig defaults and the geometry its
# glm5_next.py shared_experts_fusion_disable_reason checks for "the GLM-5.3-Flash E=288/topk=8 expert
# geometry" (hidden_size 4096, moe_intermediate_size 2048, swiglu_limit 10).
TEXT = {"vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 288,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "linear_head_dim": 128, "linear_num_heads": 64}
FIRST_SPARSE = 3  # first_k_dense_replace
# transformers' names in memory -> the release's (conversion_mapping.py "glm5_next", reverted on save)
RENAMES = [("self_attn.forget_gate.", "self_attn."), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_")]


def _kinds(num_layers: int) -> tuple[list[str], list[str]]:
    attention = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    return attention, ["dense" if i < FIRST_SPARSE else "sparse" for i in range(num_layers)]


def _release_names(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """A decoder layer's tensor as the release stores it: per-expert experts, q/k/v short convs apart."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    if rest == "self_attn.conv1d.weight":
        return [(f"self_attn.{p}_conv1d.weight", dtype, (shape[0] // 3, *shape[1:])) for p in "qkv"]
    for old, new in RENAMES:
        rest = rest.replace(old, new)
    return [(rest, dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """GLM-5.3-Flash at full size: transformers' Glm5NextForConditionalGeneration on the meta device with one
    layer of each kind (KDA dense, MLA sparse, KDA sparse), repeated over the layers in the release's names;
    the MLA sparse layer again as the MTP layer 45 with its eh_proj, enorm, hnorm and shared_head.norm."""
    import torch

    from tests.quant.family_checkpoints import layer_entries
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    layers = TEXT["num_hidden_layers"]
    attention, mlp = _kinds(layers)
    # built layers: 0 KDA dense, 1 MLA sparse, 2 KDA sparse
    built = {("linear_attention", "dense"): 0, ("indexed_attention", "sparse"): 1, ("linear_attention", "sparse"): 2}
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config={
            **TEXT, "num_hidden_layers": 3, "layer_types": [kind for kind, _ in built],
            "mlp_layer_types": [kind for _, kind in built]}))
    per_layer, out = layer_entries(model.state_dict(), "model.language_model.layers")
    out = [entry for name, d, s in out for entry in _release_names(name, d, s)]
    h = TEXT["hidden_size"]
    for i in range(layers + 1):  # the MTP layer last: an MLA sparse layer
        template = built[("indexed_attention", "sparse") if i == layers else (attention[i], mlp[i])]
        out += [(f"model.language_model.layers.{i}.{name}", d2, s2) for rest, d, s in per_layer[template]
                for name, d2, s2 in _release_names(rest, d, s)]
    out += [(f"model.language_model.layers.{layers}.{n}", "BF16", (h,)) for n in
            ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")]
    out.append((f"model.language_model.layers.{layers}.eh_proj.weight", "BF16", (h, 2 * h)))
    config = Glm5NextConfig(text_config={**TEXT, "layer_types": attention, "mlp_layer_types": mlp}).to_dict()
    config["text_config"].update(num_nextn_predict_layers=1, first_k_dense_replace=FIRST_SPARSE,
                                 topk_method="noaux_tc", scoring_func="sigmoid")
    return {**config, "architectures": ["Glm5NextForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
