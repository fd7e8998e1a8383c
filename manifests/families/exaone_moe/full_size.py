"""K-EXAONE's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this module):
``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes, written as sparse
files (headers, no tensor data)."""

from __future__ import annotations

# LGAI-EXAONE/K-EXAONE-236B-A23B as its config.json gives it (recalled, not read here: no hub access): 48 layers,
# the first dense (first_k_dense_replace 1), 128 routed experts (moe_intermediate_size 2048) + 1 shared, top-8,
# GQA 64 heads / 8 key-value heads of 128, three 128-token sliding-window layers per full-attention layer, a
# 153,600-token vocabulary, one MTP draft layer under mtp.*. Checked against the model card (transformers'
# docs/source/en/model_doc/exaone_moe.md): 236B parameters in all, 23B active, a ~150k vocabulary, 3:1 hybrid
# attention with a 128-token window; these sizes give 237B with the draft layer, about 24B active.
TEXT = {"vocab_size": 153600, "hidden_size": 6144, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "sliding_window": 128, "sliding_window_pattern": 4, "max_position_embeddings": 262144,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False}


def _per_expert(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """transformers' fused experts as the release stores them: per expert (conversion_mapping.py reverted)."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    return [(rest.replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"), dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """K-EXAONE at full size: transformers' ExaoneMoeForCausalLM on the meta device with one dense and one MoE
    layer, repeated over the layers in the release's names; the dense layer again as the draft's mtp.layers.0
    beside mtp.fc and its norms (both engines build the draft's layer dense)."""
    import torch
    from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM

    from tests.quant.family_checkpoints import draft_fc_shapes, layer_entries

    with torch.device("meta"):
        model = ExaoneMoeForCausalLM(ExaoneMoeConfig(**{**TEXT, "num_hidden_layers": 2}))
    per_layer, out = layer_entries(model.state_dict(), "model.layers")
    per_layer = {i: [e for rest, d, s in entries for e in _per_expert(rest, d, s)] for i, entries in per_layer.items()}
    layers, dense = TEXT["num_hidden_layers"], TEXT["first_k_dense_replace"]
    for i in range(layers):
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[0 if i < dense else 1]]
    out += [(f"mtp.layers.0.{rest}", d, s) for rest, d, s in per_layer[0]]
    out += [(name, "BF16", shape) for name, shape in draft_fc_shapes(TEXT["hidden_size"]).items()]
    config = ExaoneMoeConfig(**TEXT).to_dict()
    config["is_moe_layer"] = [kind == "sparse" for kind in config["mlp_layer_types"]]
    return {**config, "architectures": ["ExaoneMoEForCausalLM"], "torch_dtype": "bfloat16"}, out
