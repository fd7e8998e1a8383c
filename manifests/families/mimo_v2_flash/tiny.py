"""MiMo-V2-Flash's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's MiMoV2FlashForCausalLM, whose save_pretrained writes the release's
names (conversion_mapping.py "mimo_v2_flash" reverted: per-expert experts, self_attn.attention_sink_bias),
plus the MTP layer under model.mtp.layers.0 (transformers skips model.mtp.*; both engines' drafts read it:
sglang mimo_v2_nextn.py MiMoV2MTP.load_weights / map_model_name_to_mtp_param_name, vLLM mimo_v2_mtp.py
MiMoV2MTP.load_weights and its module docstring: enorm, hnorm, eh_proj, input_layernorm, self_attn.*,
pre_mlp_layernorm, a dense mlp.*, final_layernorm), and the config keys the engines read that transformers'
config does not define."""

# The releases the tests' MXFP4 conversion is for (tests/quant/family_checkpoints.py serve_args): sglang
# 0.5.21-0.5.23 cannot load Quark MXFP4 routed experts of this class (sglang.yaml: expert_scales_renamed), so
# quantize refuses the output unless it names the engine it serves; vLLM loads it.
SERVE = ("vllm==0.34.0",)


def _kinds(num_layers: int) -> list[str]:
    """The first layer full attention, the rest sliding-window (the release: one full layer in six)."""
    return ["full_attention"] + ["sliding_attention"] * (num_layers - 1)


def build(num_hidden_layers: int, **overrides):
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    from tests.quant.family_checkpoints import TINY

    # XiaomiMiMo/MiMo-V2-Flash's kinds of layers, scaled down: v heads narrower than q/k heads (192 / 128 in
    # the release), sliding-window layers with twice the key-value heads and attention sinks, the first
    # layer dense, the pad token inside the tiny vocabulary
    config = MiMoV2FlashConfig(**{**TINY, "v_head_dim": 16, "num_hidden_layers": num_hidden_layers,
                                  "n_routed_experts": 4, "num_experts_per_tok": 2, "sliding_window": 9,
                                  "pad_token_id": 2, "layer_types": _kinds(num_hidden_layers), **overrides})
    return config, MiMoV2FlashForCausalLM


def _swa(config) -> tuple[int, int]:
    """Heads and key-value heads of a sliding-window layer (transformers' MiMoV2FlashAttention: twice the
    key-value heads of a full-attention layer)."""
    return config.num_attention_heads, 2 * config.num_key_value_heads


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The MTP layer: an SWA attention layer with a dense MLP, its own norms and eh_proj."""
    from tests.quant.family_checkpoints import random_tensors

    h, inter = config.hidden_size, config.intermediate_size
    heads, kv = _swa(config)
    qk, v = config.head_dim, config.v_head_dim
    p = "model.mtp.layers.0."
    shapes = {"eh_proj.weight": (h, 2 * h), "self_attn.q_proj.weight": (heads * qk, h),
              "self_attn.k_proj.weight": (kv * qk, h), "self_attn.v_proj.weight": (kv * v, h),
              "self_attn.o_proj.weight": (h, heads * v), "self_attn.attention_sink_bias": (heads,),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
              **{f"{n}.weight": (h,) for n in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm",
                                               "final_layernorm")}}
    return {**tensors, **random_tensors({p + name: shape for name, shape in shapes.items()}, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The keys both engines read as attributes that transformers' config does not define: the layer
    pattern (hybrid_layer_pattern 1 = sliding window, moe_layer_freq 1 = MoE), the sliding-window layers'
    geometry (swa_*), layernorm_epsilon, the sinks' switches, the router's topk_method / scoring_func
    (sglang mimo_v2.py MoEGate / MiMoV2MoE) and the one MTP layer."""
    heads, kv = _swa(config)
    saved.update(hybrid_layer_pattern=[int(k == "sliding_attention") for k in saved["layer_types"]],
                 moe_layer_freq=[int(k == "sparse") for k in saved["mlp_layer_types"]],
                 swa_num_attention_heads=heads, swa_num_key_value_heads=kv, swa_head_dim=config.head_dim,
                 swa_v_head_dim=config.v_head_dim, sliding_window_size=config.sliding_window - 1,
                 layernorm_epsilon=config.rms_norm_eps, add_swa_attention_sink_bias=True,
                 add_full_attention_sink_bias=False, topk_method="noaux_tc", scoring_func="sigmoid",
                 num_nextn_predict_layers=1)
