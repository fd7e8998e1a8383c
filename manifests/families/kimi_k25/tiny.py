"""Kimi-K2.5's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Kimi_K25ForConditionalGeneration, saved under the release's names."""

# the architecture the release's config.json names (transformers' class name differs)
ARCHITECTURE = "KimiK25ForConditionalGeneration"
# transformers 5.24's save_pretrained reverts its kimi_k25 renames only in part (conversion_mapping.py
# "kimi_k25": its blocks -> layers rule is reverted on the text layers too): the release's names
RELEASE_NAMES = [("language_model.model.blocks.", "language_model.model.layers."),
                 ("model.mm_projector.", "mm_projector."),
                 ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")]


def build(num_hidden_layers: int, **overrides):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    # text_config as moonshotai/Kimi-K2.5's config.json carries it (model_type kimi_k2, the router
    # keys sglang reads as attributes, the architecture its fusion check compares; no next-n layer),
    # at DeepSeek-V3's MLA shapes scaled down; a one-block MoonViT vision tower
    text = {**TINY, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": num_hidden_layers, "num_key_value_heads": 2, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 32,
            "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "n_group": 1,
            "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
            **overrides}
    vision = {"patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                            tie_word_embeddings=False)
    return config, Kimi_K25ForConditionalGeneration


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    from tests.quant.family_checkpoints import renamed

    for old, new in RELEASE_NAMES:
        tensors = renamed(tensors, old, new)
    return tensors


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The text_config keys the release's config.json carries that transformers rewrites on save."""
    saved["text_config"].update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
