"""MiMo-V2-Flash's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# XiaomiMiMo/MiMo-V2-Flash: 48 layers (full attention at layer 0 and every sixth, sliding-window elsewhere),
# the first dense (intermediate_size 16384), 256 routed experts (moe_intermediate_size 2048), top-8, no shared
# expert; 64 query heads of 192 (v 128), 4 key-value heads on full layers, 8 on sliding ones; three MTP layers.
# These are transformers 5.25's MiMoV2FlashConfig defaults ("Overrides from Glm4MoeConfig", documented with
# checkpoint XiaomiMiMo/MiMo-V2-Flash; its attention doubles the sliding layers' key-value heads); the three MTP
# layers as vLLM's mimo_v2_mtp.py says of the checkpoints ("MiMo-V2 checkpoints contain multiple MTP layers, but
# vLLM currently supports only the first layer") and LMDeploy's MiMo-V2-Flash support counts them (a three-layer
# MTP module). No published config.json was read: num_nextn_predict_layers counts them here.
TEXT = {"vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192,
        "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8}
MTP_LAYERS = 3



def _release_names(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """A decoder layer's tensor as the release stores it (transformers' conversion_mapping.py "mimo_v2_flash"
    reverted): per-expert experts, the sinks as attention_sink_bias, the router F32."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    if rest == "mlp.gate.weight":
        return [(rest, "F32", shape)]
    return [(rest.replace("self_attn.sinks", "self_attn.attention_sink_bias"), dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """MiMo-V2-Flash at full size: transformers' MiMoV2FlashForCausalLM on the meta device with one layer of
    each kind (full dense, sliding sparse, full sparse), repeated over the layers; the MTP layer's tensors
    (tiny.py's release(), at these sizes) under model.mtp.layers.0-2; the router weight F32 as the release
    stores it (transformers' _keep_in_fp32_modules_strict)."""
    import torch
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    from tests.quant.family_checkpoints import family_module, layer_entries

    layers = TEXT["num_hidden_layers"]
    config = MiMoV2FlashConfig(**TEXT)
    built = {("full_attention", "dense"): 0, ("sliding_attention", "sparse"): 1, ("full_attention", "sparse"): 2}
    with torch.device("meta"):
        model = MiMoV2FlashForCausalLM(MiMoV2FlashConfig(**{
            **TEXT, "num_hidden_layers": 3, "layer_types": [kind for kind, _ in built],
            "mlp_layer_types": [kind for _, kind in built]}))
    per_layer, out = layer_entries(model.state_dict(), "model.layers")
    for i in range(layers):
        template = built[(config.layer_types[i], config.mlp_layer_types[i])]
        out += [(f"model.layers.{i}.{name}", d2, s2) for rest, d, s in per_layer[template]
                for name, d2, s2 in _release_names(rest, d, s)]
    tiny = family_module("mimo_v2_flash", "tiny")
    with torch.device("meta"):
        mtp = tiny.release({}, config, layers, 0)
    out += [(name.replace(".layers.0.", f".layers.{i}."), "BF16", tuple(t.shape)) for i in range(MTP_LAYERS)
            for name, t in mtp.items()]
    saved = {**config.to_dict(), "architectures": ["MiMoV2FlashForCausalLM"], "torch_dtype": "bfloat16"}
    tiny.release_config(saved, config, layers)
    saved["num_nextn_predict_layers"] = MTP_LAYERS
    return saved, out
