"""Llama-4's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout(variant) -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
one per VARIANTS (Maverick, Scout), written as sparse files (headers, no tensor data)."""

from __future__ import annotations


# meta-llama/Llama-4-Maverick-17B-128E-Instruct and Llama-4-Scout-17B-16E-Instruct: 48 layers, MoE every
# interleave_moe_layer_step-th (Maverick 2: 128 routed experts, top-1, one shared expert, dense layers
# between; Scout 1: 16 experts, every layer), routed experts fused as the release stores them
# (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]); a 34-layer vision tower and projector
_LLAMA4_TEXT = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                "num_experts_per_tok": 1, "attention_chunk_size": 8192, "tie_word_embeddings": False}
_LLAMA4_VISION = {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34, "num_attention_heads": 16,
                  "image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
                  "projector_output_dim": 4096, "vision_output_dim": 4096}
VARIANTS = {"maverick": {**_LLAMA4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2},
            "scout": {**_LLAMA4_TEXT, "num_local_experts": 16, "interleave_moe_layer_step": 1}}


def layout(variant: str) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Llama-4 at full size: transformers' Llama4ForConditionalGeneration on the meta device with one
    layer of each kind (its state_dict names are the release's, experts fused), the decoder layers
    repeated on the interleave_moe_layer_step grid."""
    import torch

    from tests.quant.family_checkpoints import layer_entries
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = VARIANTS[variant]
    step = text["interleave_moe_layer_step"]
    with torch.device("meta"):
        model = Llama4ForConditionalGeneration(Llama4Config(text_config={**text, "num_hidden_layers": step},
                                                            vision_config=_LLAMA4_VISION))
    per_layer, out = layer_entries(model.state_dict(), "language_model.model.layers")
    for i in range(text["num_hidden_layers"]):
        out += [(f"language_model.model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[i % step]]
    config = Llama4Config(text_config=text, vision_config=_LLAMA4_VISION, tie_word_embeddings=False).to_dict()
    return {**config, "architectures": ["Llama4ForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
