"""GLM-4.5's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Glm4MoeForCausalLM, plus the next-n (MTP) layer's own tensors."""

DRAFT_LAYERS = 1  # the next-n layer at index num_hidden_layers: a full decoder layer beside its own tensors


def build(num_hidden_layers: int, **overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from tests.quant.family_checkpoints import TINY

    config = Glm4MoeConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4,
                              "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                              "num_nextn_predict_layers": 1, "attention_bias": True, "n_group": 1, "topk_group": 1,
                              "partial_rotary_factor": 0.5, **overrides})
    return config, Glm4MoeForCausalLM


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The next-n layer's own tensors as GLM-4.5 / DeepSeek-V3 store them (beside a full decoder layer)."""
    from tests.quant.family_checkpoints import random_tensors

    h, v = config.hidden_size, config.vocab_size
    p = f"model.layers.{num_hidden_layers}."
    return {**tensors, **random_tensors({p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,),
                                         p + "hnorm.weight": (h,), p + "shared_head.norm.weight": (h,),
                                         p + "shared_head.head.weight": (v, h), p + "embed_tokens.weight": (v, h)},
                                        seed)}
