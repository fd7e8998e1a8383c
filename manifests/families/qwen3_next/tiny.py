"""Qwen3-Next's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Qwen3NextForCausalLM, its extra decoder layer moved under the
draft's prefix mtp.layers.0 beside mtp.fc and its norms."""

DRAFT_LAYERS = 1  # one layer more is built: the draft's


def build(num_hidden_layers: int, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from tests.quant.family_checkpoints import TINY

    # Gated DeltaNet heads scaled down; full_attention_interval 2 (the release: 4), so that three layers
    # hold both kinds (linear, full, linear) and the extra layer built for the draft is a full-attention one
    interval = overrides.pop("full_attention_interval", 2)
    config = Qwen3NextConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4,
                                "num_experts_per_tok": 2,
                                "shared_expert_intermediate_size": TINY["moe_intermediate_size"],
                                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                                "full_attention_interval": interval, **overrides})
    config.full_attention_interval = interval  # config.json carries it (sglang reads it; transformers pops it)
    return config, Qwen3NextForCausalLM


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    from tests.quant.family_checkpoints import draft_fc_shapes, random_tensors, renamed

    tensors = renamed(tensors, f"model.layers.{num_hidden_layers}.", "mtp.layers.0.")
    return {**tensors, **random_tensors(draft_fc_shapes(config.hidden_size), seed)}
