"""GLM-5's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): quant.example writes it by the release's names and shapes (its MTP layer at index
num_hidden_layers), the layout ``quantize --example`` and most tests use."""


def write(dst, *, num_hidden_layers: int, seed: int, **overrides):
    from quant.example import tiny_config, write_checkpoint

    config = tiny_config("glm_moe_dsa", num_hidden_layers=num_hidden_layers, **overrides)
    return write_checkpoint(dst, config, seed=seed)
