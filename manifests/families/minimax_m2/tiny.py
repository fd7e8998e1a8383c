"""MiniMax-M2's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' MiniMaxM2ForCausalLM as saved, with the release's config keys."""

DRAFT_LAYERS = 1  # the MTP module (model.layers.{num_hidden_layers}): a decoder layer, skipped by both engines


def build(num_hidden_layers: int, **overrides):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    from tests.quant.family_checkpoints import TINY

    # the keys MiniMaxAI/MiniMax-M2's config.json carries beyond transformers' MiniMaxM2Config (the
    # engines read scoring_func as an attribute, use_routing_bias and num_mtp_modules via getattr; vLLM
    # 0.32.0's MiniMaxM2DecoderLayer reads config.rotary_dim: here the whole head, as transformers rotates it)
    release = {"scoring_func": "sigmoid", "use_routing_bias": True, "num_mtp_modules": 1, "use_qk_norm": True,
               "qk_norm_type": "per_layer", "rotary_dim": TINY["head_dim"]}
    config = MiniMaxM2Config(**{**TINY, "intermediate_size": 32, "num_hidden_layers": num_hidden_layers,
                                "num_local_experts": 4, "num_experts_per_tok": 2, **release, **overrides})
    return config, MiniMaxM2ForCausalLM
