"""Qwen3.5 MoE's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations


# Qwen/Qwen3.5-397B-A17B: 60 layers (3 Gated DeltaNet + 1 full attention, repeated), 512 routed experts
# (moe_intermediate_size 1024: gate_up_proj [512, 2048, 4096] is 8.6 GB) + 1 shared expert, top-10, a
# 27-block vision tower, one MTP draft layer under mtp.* (its experts per expert)
QWEN3_5_TEXT = {"vocab_size": 248320, "hidden_size": 4096, "moe_intermediate_size": 1024,
                "shared_expert_intermediate_size": 1024, "num_hidden_layers": 60, "num_attention_heads": 32,
                "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 64, "full_attention_interval": 4,
                "mtp_num_hidden_layers": 1}
QWEN3_5_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096}


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Qwen3.5-397B-A17B at full size: transformers' Qwen3_5MoeForConditionalGeneration on the meta
    device with one period of layers (its parameters are the release's fused experts, gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]), repeated over the layers; the full-attention layer again as the
    draft, mtp.layers.0.*, with its experts per expert, plus mtp.fc and its norms."""
    import torch

    from tests.quant.family_checkpoints import layer_entries
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text, period = QWEN3_5_TEXT, QWEN3_5_TEXT["full_attention_interval"]
    kinds = ["full_attention" if (i + 1) % period == 0 else "linear_attention"
             for i in range(text["num_hidden_layers"])]
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
            text_config={**text, "num_hidden_layers": period, "layer_types": kinds[:period]},
            vision_config=QWEN3_5_VISION))
    per_layer, out = layer_entries(model.state_dict(), "model.language_model.layers")
    for i in range(text["num_hidden_layers"]):
        out += [(f"model.language_model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[i % period]]
    h, inter = text["hidden_size"], text["moe_intermediate_size"]
    for rest, d, s in per_layer[period - 1]:
        if rest.startswith("mlp.experts."):
            continue
        out.append((f"mtp.layers.0.{rest}", d, s))
    for e in range(text["num_experts"]):
        out += [(f"mtp.layers.0.mlp.experts.{e}.{proj}.weight", "BF16", shape)
                for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))]
    out += [("mtp.fc.weight", "BF16", (h, 2 * h))] + [(f"mtp.{n}.weight", "BF16", (h,))
                                                       for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    config = Qwen3_5MoeConfig(text_config={**text, "layer_types": kinds}, vision_config=QWEN3_5_VISION,
                              tie_word_embeddings=False).to_dict()
    config["text_config"].update(full_attention_interval=period, mtp_num_hidden_layers=1)
    return {**config, "architectures": ["Qwen3_5MoeForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
