"""Hunyuan-V4's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# tencent/Hy4-preview's sizes as transformers 5.25's HYV4Config defaults them (its docstring checkpoint), the
# same as sglang 0.5.23's configs/hy_v4.py and vLLM 0.34.0's transformers_utils/configs/hy_v4.py HYV4Config
# defaults: 34 layers (the first dense), hidden 2816, 256 routed experts (moe_intermediate_size 768) + 1 shared,
# top-8, MLA (q_lora_rank 1536, kv_lora_rank 512, qk 192 + 64, v 256), a DSA indexer (16 heads of 128) on layer 0
# and every fourth from 1, hc_mult 4, one MTP layer (num_nextn_predict_layers 1). No published config.json was read.
HY4_LAYERS = 34


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Hunyuan-V4 at full size: transformers' HYV4ForCausalLM on the meta device with every layer plus the MTP
    layer, its names reverted by transformers' own revert_weight_conversion (what save_pretrained writes) and
    then made the release's by tiny.py (per-expert experts, hc_pre inside the layer part, the MTP layer as
    model.mtp_layers.0.* with eh_proj, enorm, hnorm and final_layernorm)."""
    import torch
    from transformers import HYV4Config, HYV4ForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import tiny_builder

    tiny = tiny_builder("hy_v4")
    layers = HY4_LAYERS + tiny.DRAFT_LAYERS
    config = HYV4Config(num_hidden_layers=layers, indexer_types=tiny._indexer_types(layers))
    with torch.device("meta"):
        model = HYV4ForCausalLM(config)
    state = tiny.release(revert_weight_conversion(model, dict(model.state_dict())), config, HY4_LAYERS, 0)
    out = [(name, "F32" if "correction_bias" in name else "BF16", tuple(t.shape)) for name, t in state.items()]
    saved = {**config.to_dict(), "architectures": ["HYV4ForCausalLM"], "torch_dtype": "bfloat16"}
    tiny.release_config(saved, config, HY4_LAYERS)
    return saved, out
