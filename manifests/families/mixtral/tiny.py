"""Mixtral's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' MixtralForCausalLM as saved."""


def build(num_hidden_layers: int, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.quant.family_checkpoints import TINY

    config = MixtralConfig(**{**TINY, "intermediate_size": 32, "num_hidden_layers": num_hidden_layers,
                              "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    return config, MixtralForCausalLM
