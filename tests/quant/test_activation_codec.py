"""Activation quantize-dequantize: MX bit-exact with AMD Quark's own dynamic fake quantization (the
``input_tensors`` spec of a W4A4 / W6A6 checkpoint), block FP8 per token group against the e4m3 grid."""

from __future__ import annotations

import pytest
import torch

from quant.formats import fp8, mx
from quant.formats.constants import E2M1, E2M3, E3M2, ElementFormat, ScaleRule
from tests.quant.test_mxfp4 import edge_case_weight


def quark_dynamic_qdq(element: ElementFormat, rule: ScaleRule):
    """Quark 0.13's fake quantizer for a dynamic MX ``input_tensors`` spec, as its quantized Linear builds it.

    ``DynamicScaledFakeQuantize.forward`` sends bf16 MXFP4 'even' to ``kernel_ext.qdq_mxfp4``, a
    CUDA-only kernel; ``fake_quantize`` is its general path (observer + ``scaled_fake_quantize``), the
    one it takes for every other input.
    """
    from quark.torch.quantization.config.config import OCP_MXFP4Spec, OCP_MXFP6E2M3Spec, OCP_MXFP6E3M2Spec
    from quark.torch.quantization.tensor_quantize import DynamicScaledFakeQuantize

    spec = {E2M1: OCP_MXFP4Spec, E2M3: OCP_MXFP6E2M3Spec, E3M2: OCP_MXFP6E3M2Spec}[element]
    return DynamicScaledFakeQuantize(spec(ch_axis=-1, is_dynamic=True, scale_calculation_mode=rule.value)
                                     .to_quantization_spec()).fake_quantize


def activation_cases(dtype: torch.dtype) -> torch.Tensor:
    """Random activations at every scale, the weight edge cases (ties, saturation, zero and -0 blocks,
    the even rule's threshold, fp32 extremes) and subnormal blocks, as one [rows, 64] tensor."""
    gen = torch.Generator().manual_seed(1)
    spread = torch.randn(96, 64, generator=gen) * torch.exp2(torch.randint(-60, 60, (96, 1), generator=gen).float())
    mixed = torch.randn(16, 64, generator=gen) * torch.exp2(torch.randint(-40, 40, (16, 64), generator=gen).float())
    subnormal = torch.randn(8, 64, generator=gen) * torch.exp2(torch.randint(-149, -118, (8, 64), generator=gen).float())
    rows = [spread, mixed, subnormal, edge_case_weight().float(), torch.full((1, 64), -0.0)]
    return torch.cat(rows).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("element", [E2M1, E2M3, E3M2], ids=lambda e: e.name)
@pytest.mark.parametrize("rule", list(ScaleRule), ids=lambda r: r.value)
def test_mx_activation_qdq_is_bit_exact_with_quark(element, rule):
    quark = quark_dynamic_qdq(element, rule)
    for dtype in (torch.bfloat16, torch.float32):
        x = activation_cases(dtype)
        ours = mx.quantize_dequantize(x, element, rule)
        assert ours.dtype == dtype and torch.equal(bits(ours), bits(quark(x))), (element.name, rule, dtype)


def test_mx_activation_qdq_blocks_run_along_the_last_dim_of_any_shape():
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    flat = mx.quantize_dequantize(x.reshape(6, 96), E2M1, ScaleRule.EVEN)
    assert torch.equal(mx.quantize_dequantize(x, E2M1, ScaleRule.EVEN), flat.reshape(2, 3, 96))
    assert torch.equal(bits(flat), bits(quark_dynamic_qdq(E2M1, ScaleRule.EVEN)(x.reshape(6, 96))))


def test_mx_activation_qdq_is_the_weight_codec():
    """The same encode as the converter: on a weight, QDQ equals decode(encode) wherever the block's
    exponent is storable (all but blocks clamped at 2^-127, whose stored byte reads 2^-126)."""
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    packed, scales = mx.quantize(weight, E2M3, ScaleRule.FLOOR)
    decoded = mx.dequantize(packed, scales, E2M3, torch.bfloat16)
    assert torch.equal(mx.quantize_dequantize(weight, E2M3, ScaleRule.FLOOR), decoded)


def e4m3_grid() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


def test_fp8_activation_qdq_rounds_each_token_group_to_the_nearest_e4m3_value():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 320, generator=gen) * torch.exp2(torch.randint(-20, 20, (6, 320), generator=gen).float())
    x[0, :128] = 0.0  # a zero group stays zero
    out = fp8.quantize_dequantize(x)
    grid = e4m3_grid()
    for row in range(6):
        for start in range(0, 320, 128):  # the last group holds 64 values: quantized on its own
            g = x[row, start:start + 128]
            scale = g.abs().max().clamp(min=1e-10) * torch.tensor(1 / 448, dtype=torch.float32)
            distance = ((g / scale).clamp(-448, 448).unsqueeze(-1).double() - grid.double()).abs()
            two_nearest = distance.topk(2, dim=-1, largest=False)
            assert (two_nearest.values[:, 0] < two_nearest.values[:, 1]).all()  # no ties in this data
            expected = grid[two_nearest.indices[:, 0]] * scale
            assert torch.equal(out[row, start:start + 128], expected), (row, start)
            assert expected.abs().max() == (448 * scale if g.abs().max() > 0 else 0)  # amax maps to e4m3's max


def test_fp8_activation_qdq_keeps_dtype_and_shape():
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    out = fp8.quantize_dequantize(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out[1, 3], fp8.quantize_dequantize(x[1, 3:4])[0])
