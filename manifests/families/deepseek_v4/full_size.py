"""DeepSeek-V4's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# deepseek-ai/DeepSeek-V4-Flash's sizes as transformers 5.24's DeepseekV4Config defaults them (its
# checkpoint deepseek-ai/DeepSeek-V4-Flash-Base): 43 layers (2 heavily compressed, then compressed
# sparse and heavily compressed alternating; the first 3 routed by the hash table), 256 routed + 1 shared
# experts, top-6, head_dim 512, hc_mult 4, one MTP module stored as mtp.0.*
V4_LAYERS = 43


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """DeepSeek-V4 at full size: transformers' DeepseekV4ForCausalLM on the meta device with every
    layer plus one for the MTP module, its names reverted by transformers' own revert_weight_conversion
    and then made the release's (tests/quant/family_checkpoints.py: unprefixed, attn.kv_norm, the last
    layer as mtp.0.* with its e_proj / h_proj, norms and hc_head_*)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import tiny_builder

    default = DeepseekV4Config(num_hidden_layers=V4_LAYERS)
    config = DeepseekV4Config(num_hidden_layers=V4_LAYERS + 1, tie_word_embeddings=False,
                              layer_types=[*default.layer_types, "sliding_attention"],
                              mlp_layer_types=[*default.mlp_layer_types, "moe"])
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    tiny = tiny_builder("deepseek_v4")
    state = tiny.release(revert_weight_conversion(model, dict(model.state_dict())), config, V4_LAYERS, 0)
    out = [(name, "I64" if name.endswith("tid2eid") else "BF16", tuple(t.shape)) for name, t in state.items()]
    saved = {**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"], "torch_dtype": "bfloat16"}
    tiny.release_config(saved, config, V4_LAYERS)
    return saved, out
