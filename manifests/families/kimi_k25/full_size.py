"""Kimi-K2.5's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations


# moonshotai/Kimi-K2.5's text model (Kimi-K2's sizes, DeepSeek-V3's MLA): 61 layers (layer 0 dense),
# 384 routed + 1 shared experts, top-8, no next-n layer; the MoonViT vision tower at transformers'
# Kimi_K25VisionConfig defaults (27 layers, 1152 wide)
TEXT = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "num_nextn_predict_layers": 0, "tie_word_embeddings": False}
LAYERS = 61


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """transformers' Kimi_K25ForConditionalGeneration on the meta device with one dense and one MoE
    layer, its names reverted by transformers' own revert_weight_conversion (what save_pretrained
    writes) and then made the release's (tiny.py's RELEASE_NAMES), the MoE layer repeated."""
    import torch
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import layer_entries, tiny_builder

    with torch.device("meta"):
        model = Kimi_K25ForConditionalGeneration(Kimi_K25Config(text_config={**TEXT, "num_hidden_layers": 2},
                                                                tie_word_embeddings=False))
    state = tiny_builder("kimi_k25").release(revert_weight_conversion(model, dict(model.state_dict())), None, 2, 0)
    per_layer, out = layer_entries(state, "language_model.model.layers")
    for i in range(LAYERS):
        out += [(f"language_model.model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[min(i, 1)]]
    saved = Kimi_K25Config(text_config={**TEXT, "num_hidden_layers": LAYERS}, tie_word_embeddings=False).to_dict()
    saved["text_config"].update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    return {**saved, "architectures": ["KimiK25ForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
