"""Llama-4's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Llama4ForConditionalGeneration as saved (routed experts fused,
[E, H, 2I] gate_up_proj and [E, I, H] down_proj, as the release stores them)."""


def build(num_hidden_layers: int, **overrides):
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    # text_config as meta-llama/Llama-4-Maverick's config.json carries it, scaled down: MoE every
    # second layer (interleave_moe_layer_step 2; transformers derives moe_layers from it), one shared
    # expert, experts intermediate_size wide and the dense layers intermediate_size_mlp; a one-layer
    # vision tower with its pixel-shuffle adapter and projector
    text = {**TINY, "intermediate_size": 32, "intermediate_size_mlp": 128, "num_hidden_layers": num_hidden_layers,
            "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "pad_token_id": 2,
            "attention_chunk_size": 1024, **overrides}
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 56, "patch_size": 14, "projector_input_dim": 128, "projector_output_dim": 64,
              "vision_output_dim": 64, "pixel_shuffle_ratio": 0.5}
    config = Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return config, Llama4ForConditionalGeneration
