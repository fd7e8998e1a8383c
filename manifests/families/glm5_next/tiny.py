"""GLM-5.3-Flash's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's Glm5NextForConditionalGeneration, whose save_pretrained writes the
release's names (conversion_mapping.py "glm5_next" reverted: per-expert experts, self_attn.f_a_proj /
f_b_proj / A_log / dt_bias, q/k/v_conv1d, hc_* tensors), plus the MTP layer's own tensors beside decoder
layer num_hidden_layers (transformers does not build the MTP layer; both engines' drafts read eh_proj,
enorm, hnorm and shared_head.norm there: sglang glm5_next.py load_weights nextn_spec_weight_names, vLLM
glm5next/common/mtp.py Glm5NextMultiTokenPredictorLayer)."""

DRAFT_LAYERS = 1  # the MTP layer at index num_hidden_layers: an MLA + MoE decoder layer beside its own tensors


def _kinds(num_layers: int) -> tuple[list[str], list[str]]:
    """Attention and MLP kind per layer: KDA and MLA alternating (the release: three KDA layers per MLA
    layer), the last built layer (the MTP layer) MLA as both engines build it; the first layer dense."""
    attention = ["indexed_attention" if i % 2 else "linear_attention" for i in range(num_layers)]
    attention[-1] = "indexed_attention"
    return attention, ["dense"] + ["sparse"] * (num_layers - 1)


def build(num_hidden_layers: int, **overrides):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    attention, mlp = _kinds(num_hidden_layers)
    # text_config at zai-org/GLM-5.3-Flash's kinds of layers, scaled down: MLA without a rope part as the
    # release (qk_rope_head_dim 0), as many key-value heads as heads (the config requires it), a DSA indexer
    # whose top-k the key pool divides, the pad token inside the tiny vocabulary
    text = {**TINY, "head_dim": 0, "num_key_value_heads": TINY["num_attention_heads"], "pad_token_id": 2,
            "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 0, "v_head_dim": 32, "index_topk": 16, "index_kpool": 4, "index_head_dim": 16,
            "index_n_heads": 2, "linear_head_dim": 16, "linear_num_heads": 2, "layer_types": attention,
            "mlp_layer_types": mlp, **overrides}
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64,
              "projection_intermediate_size": 64}
    return Glm5NextConfig(text_config=text, vision_config=vision), Glm5NextForConditionalGeneration


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The MTP layer's own tensors beside its decoder layer."""
    from tests.quant.family_checkpoints import random_tensors

    h = config.text_config.hidden_size
    p = f"model.language_model.layers.{num_hidden_layers}."
    return {**tensors, **random_tensors({p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,),
                                         p + "hnorm.weight": (h,), p + "shared_head.norm.weight": (h,)}, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The MTP layer counted apart, and the keys the engines read as attributes that transformers' config
    does not define (vLLM's Glm5NextMoE compares config.topk_method; sglang's DeepseekV2MoE reads
    scoring_func and topk_method, defaults of its own Glm5NextTextConfig)."""
    text = saved["text_config"]
    text.update(num_hidden_layers=num_hidden_layers, layer_types=text["layer_types"][:num_hidden_layers],
                mlp_layer_types=text["mlp_layer_types"][:num_hidden_layers], num_nextn_predict_layers=1,
                first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid")
