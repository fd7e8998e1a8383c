"""MiniMax-M3's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' MiniMaxM3SparseForConditionalGeneration, its last built layer as the
MTP module (language_model.model.mtp.layers.0, skipped by both engines' main models), with the
release's config keys; the full-size layout (full_size.py) reuses release_config."""

DRAFT_LAYERS = 1  # the MTP module's transformer_layer


def build(num_hidden_layers: int, **overrides):
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    from tests.quant.family_checkpoints import TINY

    # MiniMax-M3's text model scaled down: layer 0 dense with full attention, the others MoE with
    # sparse attention (the lightning indexer's index_q/k_proj, one index head as vLLM shards it by
    # the KV heads); the release's sparse_attention_config / moe_layer_freq are written back into
    # text_config by release_config. A one-layer CLIP vision tower.
    freq = [0] + [1] * (num_hidden_layers - 1)
    text = {**TINY, "intermediate_size": 32, "dense_intermediate_size": 128, "shared_intermediate_size": 32,
            "num_hidden_layers": num_hidden_layers, "num_local_experts": 4, "num_experts_per_tok": 2,
            "rotary_dim": 16, "index_n_heads": 1, "index_head_dim": 32, "index_block_size": 16,
            "index_topk_blocks": 2, "mlp_layer_types": ["sparse" if f else "dense" for f in freq],
            "layer_types": ["minimax_m3_sparse" if f else "full_attention" for f in freq], **overrides}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                               tie_word_embeddings=False)
    return config, MiniMaxM3SparseForConditionalGeneration


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The last built decoder layer becomes MTP module 0's transformer_layer
    (language_model.model.mtp.layers.0.transformer_layer.*, a sparse MoE layer as vLLM's MiniMaxM3MTP
    builds it: nvidia/mtp.py MiniMaxM3MultiTokenPredictorLayer.transformer_layer) with its own eh_proj and
    norms at language_model.model.mtp.layers.0.*."""
    import torch

    old, new = f"language_model.model.layers.{num_hidden_layers}.", "language_model.model.mtp.layers.0."
    out = {(new + "transformer_layer." + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}
    h = config.text_config.hidden_size
    gen = torch.Generator().manual_seed(num_hidden_layers)
    out[new + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "final_layernorm"):
        out[new + f"{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The text_config keys MiniMaxAI/MiniMax-M3's config.json carries that transformers' config does
    not keep (sglang and vLLM read them: sparse_attention_config and moe_layer_freq choose each layer's
    attention and MLP, n_shared_experts, scoring_func, use_routing_bias, num_mtp_modules), for the
    decoder layers only (the last built layer is the MTP module)."""
    text = saved["text_config"]
    freq = [0 if t == "dense" else 1 for t in text.pop("mlp_layer_types")][:num_hidden_layers]
    text.pop("layer_types")
    text.update(num_hidden_layers=num_hidden_layers, moe_layer_freq=freq, n_shared_experts=1, scoring_func="sigmoid",
                use_routing_bias=True, num_mtp_modules=1, use_qk_norm=True, qk_norm_type="per_head",
                use_gemma_norm=True, hidden_act="swigluoai",
                sparse_attention_config={"use_sparse_attention": True, "sparse_index_dim": text["index_head_dim"],
                                         "sparse_num_index_heads": text["index_n_heads"], "sparse_topk_blocks": 2,
                                         "sparse_block_size": 16, "sparse_disable_index_value": freq,
                                         "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": 1,
                                         "sparse_attention_freq": freq})
