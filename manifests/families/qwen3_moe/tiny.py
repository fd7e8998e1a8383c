"""Qwen3-MoE's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' Qwen3MoeForCausalLM as saved."""


def build(num_hidden_layers: int, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.quant.family_checkpoints import TINY

    config = Qwen3MoeConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4,
                               "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                               "norm_topk_prob": True, **overrides})
    return config, Qwen3MoeForCausalLM
