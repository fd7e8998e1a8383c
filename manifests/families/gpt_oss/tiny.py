"""gpt-oss's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers' GptOssForCausalLM as saved (its experts stored fused)."""


def build(num_hidden_layers: int, **overrides):
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.quant.family_checkpoints import TINY

    # intermediate_size and hidden_size multiples of 32: the MXFP4 blocks run along both (gate_up's
    # input is H, down's is I); the release's sliding/full attention alternation and YaRN rope
    kinds = [("sliding_attention", "full_attention")[i % 2] for i in range(num_hidden_layers)]
    config = GptOssConfig(**{**TINY, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
                             "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                             "layer_types": kinds, **overrides})
    return config, GptOssForCausalLM
