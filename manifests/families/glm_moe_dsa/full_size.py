"""GLM-5's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` at zai-org/GLM-5's published sizes
(quant.example.glm5_config: 78 layers, 3 dense, 256 routed + 1 shared experts, one MTP layer), named
and shaped as quant.example writes the family (a test checks those against transformers)."""

from __future__ import annotations


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    from quant.example import glm5_config, tensor_shapes

    config = glm5_config()
    return config, [(name, "F32" if str(dtype) == "torch.float32" else "BF16", tuple(shape))
                    for name, (shape, dtype) in tensor_shapes(config).items()]
