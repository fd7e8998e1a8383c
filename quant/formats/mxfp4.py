"""MXFP4 (OCP microscaling, E2M1 elements, E8M0 block scales) as AMD Quark 0.13 writes it.

A Linear weight ``[out, in]`` is cut into blocks of 32 consecutive values along ``in``. Each block
shares one power-of-two scale ``2^e`` stored as the byte ``e + 127`` (``constants.ScaleRule``); each
element is the E2M1 code of ``x / 2^e`` rounded half-to-even onto the grid
``0, .5, 1, 1.5, 2, 3, 4, 6`` and saturated at 6. Two codes share a byte: element ``2j`` in the
low nibble, ``2j+1`` in the high one. See docs/reference.md §1; tests check every rule against Quark.

This is the torch reference for MXFP4 (``mx`` holds the machinery shared with MXFP6): its element
rounding is spelled as the tie table of docs/reference.md §1, which ``mxfp4_fast`` mirrors on bit patterns.
"""

from __future__ import annotations

import torch

from quant.formats import mx
from quant.formats.constants import BLOCK, E2M1, SCALE_BIAS, ScaleRule


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

    The caller guarantees ``in % 32 == 0`` and finite values.
    """
    rows, cols = weight.shape
    x = weight.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    exponent = mx.block_exponents(x.abs().amax(dim=-1), E2M1, rule, weight.dtype)
    # 2^e as an exact float32 (e >= -127 may be subnormal; ldexp keeps it exact).
    scale = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)
    codes = _e2m1_codes(x / scale.unsqueeze(-1)).reshape(rows, cols)
    # Byte 0 would decode as 2^-127; Quark never writes it, a clamped block gets byte 1.
    return mx.pack(codes, E2M1), (exponent + SCALE_BIAS).clamp_(min=1).to(torch.uint8)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact decode: ``E2M1 value x 2^(byte - 127)``, returned as ``[rows, in]`` in ``dtype``."""
    return mx.dequantize(packed, scales, E2M1, dtype)
