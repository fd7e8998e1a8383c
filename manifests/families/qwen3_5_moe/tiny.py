"""Qwen3.5 MoE's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Qwen3_5MoeForConditionalGeneration in the release's layout (main
layers' experts fused, [E, 2I, H] and [E, H, I]; the draft under mtp.layers.0 with per-expert experts,
plus mtp.fc and its norms)."""

DRAFT_LAYERS = 1  # one layer more is built: the draft's


def build(num_hidden_layers: int, **overrides):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    # text_config as Qwen/Qwen3.5-397B-A17B's config.json carries it, scaled down: full_attention_interval
    # 2 (the release: 4), so that three layers hold both kinds and the extra layer built for the draft
    # is a full-attention one; the shared expert as wide as a routed one (as the release); a one-block
    # vision tower without deepstack mergers
    interval = overrides.pop("full_attention_interval", 2)
    text = {**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": TINY["moe_intermediate_size"], "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(num_hidden_layers)], **overrides}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 16}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.text_config.full_attention_interval = interval  # config.json carries it (sglang reads it)
    return config, Qwen3_5MoeForConditionalGeneration


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The release's layout: each main layer's routed experts fused, gate_up_proj [E, 2I, H] (gate then
    up) and down_proj [E, H, I] (transformers 5.24 saves them per expert: its qwen2_moe conversion),
    and the last built decoder layer as the draft, mtp.layers.0.*, its experts per expert."""
    import torch

    from tests.quant.family_checkpoints import draft_fc_shapes, random_tensors, renamed

    out = renamed(tensors, f"model.language_model.layers.{num_hidden_layers}.", "mtp.layers.0.")
    experts = config.text_config.num_experts
    for main in range(num_hidden_layers):
        p = f"model.language_model.layers.{main}.mlp.experts."
        gate, up, down = ([out.pop(f"{p}{e}.{proj}.weight") for e in range(experts)]
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        out[p + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up, strict=True)]).contiguous()
        out[p + "down_proj"] = torch.stack(down).contiguous()
    return {**out, **random_tensors(draft_fc_shapes(config.text_config.hidden_size), seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The draft's layer was built beside the decoder's: the release counts it apart."""
    text = saved["text_config"]
    text.update(num_hidden_layers=num_hidden_layers, layer_types=text["layer_types"][:num_hidden_layers],
                mtp_num_hidden_layers=1, full_attention_interval=config.text_config.full_attention_interval)
