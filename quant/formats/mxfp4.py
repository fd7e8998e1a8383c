"""MXFP4 (OCP microscaling, E2M1 elements, E8M0 block scales) as AMD Quark 0.13 writes it.

A Linear weight ``[out, in]`` is cut into blocks of 32 consecutive values along ``in``. Each block
shares one power-of-two scale ``2^e`` stored as the byte ``e + 127``; each element is the E2M1 code
of ``x / 2^e`` rounded half-to-even onto the grid ``0, .5, 1, 1.5, 2, 3, 4, 6`` and saturated at 6.
Two codes share a byte: element ``2j`` in the low nibble, ``2j+1`` in the high one.
See SPEC section 1; tests check every rule against Quark itself.
"""

from __future__ import annotations

import enum

import torch

BLOCK = 32
ELEMENT_MAX = 6.0
ELEMENT_EMAX = 2  # floor(log2(6)): the scale exponent is floor(log2(amax)) - 2
MANTISSA_BITS = 1  # E2M1
SCALE_BIAS = 127
# Magnitudes of codes 0..7; codes 8..15 are the same with the sign bit (bit 3) set.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP32_MANTISSA_BITS = 23
ZERO_BLOCK_FALLBACK_EXP = -23  # Quark's floor/ceil fall back to float32 eps for an all-zero block


class ScaleRule(str, enum.Enum):
    """How the shared exponent ``e`` of a block follows from its largest magnitude ``amax``.

    - ``even`` (Quark's default): ``floor(log2(amax))`` after rounding ``amax`` up to the next
      power of two when its mantissa is >= 1.75 (the value that would round past the grid's top),
      then minus 2. Implemented as ``exponent(amax_bits + 2^21) - 2`` on the fp32 bit pattern.
    - ``floor`` (plain OCP): ``floor(log2(amax)) - 2``.
    - ``ceil``: ``ceil(log2(amax)) - 2``.
    ``e`` is clamped to [-127, 127]; the stored byte is ``e + 127`` but at least 1.
    """

    EVEN = "even"
    FLOOR = "floor"
    CEIL = "ceil"


def _block_exponents(amax: torch.Tensor, rule: ScaleRule, source_dtype: torch.dtype) -> torch.Tensor:
    """Unbiased scale exponent per block (int32), clamped to [-127, 127].

    ``even`` works on the fp32 bit pattern; a round-up that carries into the all-ones exponent
    field means +inf, which Quark clamps to 127. ``floor``/``ceil`` follow Quark, which takes
    ``log2`` in the weight's own dtype: bf16 rounds the logarithm to 8 significant bits, so e.g.
    log2 = -57.05 becomes -57.0 and floors to -57 (plain math says -58). An all-zero block gets
    Quark's fallback scale, float32 eps = 2^-23.
    """
    if rule is ScaleRule.EVEN:
        bits = amax.view(torch.int32) + (1 << (FP32_MANTISSA_BITS - MANTISSA_BITS - 1))
        field = (bits >> FP32_MANTISSA_BITS) & 0xFF
        exponent = torch.where(field == 255, 127 + ELEMENT_EMAX, field - 127)
    else:
        log2 = torch.log2(amax.to(source_dtype)).to(torch.float32)
        log2 = log2.floor() if rule is ScaleRule.FLOOR else log2.ceil()
        exponent = torch.where(amax == 0, ZERO_BLOCK_FALLBACK_EXP + ELEMENT_EMAX, log2.clamp(-200, 200))
        exponent = exponent.to(torch.int32)
    return (exponent - ELEMENT_EMAX).clamp_(-127, 127)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8, 0..15) of each scaled value, round half to even, saturating at 6.

    Each comparison moves the code one grid step up; ``>`` at a midpoint whose lower neighbour
    has the even code keeps ties down, ``>=`` where the upper neighbour is even moves them up.
    """
    a = y.abs()
    code = (a > 0.25).to(torch.uint8)
    code += a >= 0.75
    code += a > 1.25
    code += a >= 1.75
    code += a > 2.5
    code += a >= 3.5
    code += a > 5.0
    # A value rounding to zero is stored as +0: the sign bit only goes with a non-zero code.
    code |= ((y < 0) & (code > 0)).to(torch.uint8) << 3
    return code


def quantize(weight: torch.Tensor, rule: ScaleRule = ScaleRule.EVEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[rows, in]`` weight to ``(packed [rows, in/2] uint8, scales [rows, in/32] uint8)``.

    The caller guarantees ``in % 32 == 0`` and finite values (see ``check_quantizable``).
    """
    rows, cols = weight.shape
    x = weight.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)
    exponent = _block_exponents(amax, rule, weight.dtype)
    # 2^e as an exact float32 (e >= -127 may be subnormal; ldexp keeps it exact).
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    codes = _e2m1_codes(x / scale.unsqueeze(-1)).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # Byte 0 would decode as 2^-127; Quark never writes it, a clamped block gets byte 1.
    scale_bytes = (exponent + 127).clamp_(min=1).to(torch.uint8)
    return packed, scale_bytes


_LUT = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact decode: ``E2M1 value x 2^(byte - 127)``, returned as ``[rows, in]`` in ``dtype``."""
    rows = packed.shape[0]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1).long()
    values = _LUT[codes].reshape(rows, -1, BLOCK)
    factor = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32), scales.to(torch.int32) - SCALE_BIAS)
    return (values * factor.unsqueeze(-1)).reshape(rows, -1).to(dtype)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """On-disk shapes of ``(weight, weight_scale)`` for a ``[out, in]`` weight."""
    out, cols = shape
    return (out, cols // 2), (out, cols // BLOCK)
