"""OCP microscaling formats with any small float element (E2M1, E2M3, E3M2), as Quark 0.13 writes them.

Same block scheme as ``mxfp4`` (32 values along ``in`` share an E8M0 scale ``2^e``); the element
is the minifloat nearest to ``x / 2^e`` (round half to even, saturating at the format's max).
MXFP6 packs 4 six-bit codes (bit 5 = sign) into 3 bytes little-endian:
``c = v0 | v1 << 6 | v2 << 12 | v3 << 18`` -> ``c & 0xFF, c >> 8 & 0xFF, c >> 16``.
"""

from __future__ import annotations

import math

import torch

from quant.formats.constants import BLOCK, SCALE_BIAS, ElementFormat, ScaleRule

ZERO_BLOCK_FALLBACK_EXP = -23  # Quark's floor/ceil fall back to float32 eps for an all-zero block


def block_exponents(amax: torch.Tensor, fmt: ElementFormat, rule: ScaleRule, source_dtype: torch.dtype,
                    *, stored: bool = True) -> torch.Tensor:
    """Quark's unbiased shared exponent per block (int32); see ``ScaleRule``.

    ``stored``: clamped to [-127, 127], what an E8M0 byte holds (weights). Otherwise Quark's dynamic
    (activation) scale, ``PerBlockMXObserver.get_scale``: ``even`` clamps the same way, but
    ``floor``/``ceil`` take ``2^e`` in the source dtype unclamped, and where it underflows to 0
    use float32 eps (2^-23) instead.
    """
    if rule is ScaleRule.EVEN:
        bits = amax.view(torch.int32) + (1 << (23 - fmt.mbits - 1))
        field = (bits >> 23) & 0xFF
        exponent = torch.where(field == 255, 127 + fmt.emax, field - 127)
    else:
        log2 = torch.log2(amax.to(source_dtype)).to(torch.float32)
        log2 = log2.floor() if rule is ScaleRule.FLOOR else log2.ceil()
        exponent = torch.where(amax == 0, ZERO_BLOCK_FALLBACK_EXP + fmt.emax, log2.clamp(-200, 200))
        exponent = exponent.to(torch.int32)
    exponent = exponent - fmt.emax
    if stored or rule is ScaleRule.EVEN:
        return exponent.clamp_(-127, 127)
    finfo = torch.finfo(source_dtype)
    smallest_subnormal = round(math.log2(finfo.smallest_normal * finfo.eps))
    return torch.where(exponent < smallest_subnormal, ZERO_BLOCK_FALLBACK_EXP, exponent)


def element_codes(y: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Code (sign | exponent field | mantissa) of the minifloat nearest to ``y``, ties to even."""
    a = y.abs().clamp(max=fmt.max)
    k = torch.floor(torch.log2(a.clamp(min=2.0 ** fmt.min_exp))).clamp(max=fmt.emax)  # exponent of a's binade
    step = torch.ldexp(torch.ones_like(a), (k - fmt.mbits).to(torch.int32))
    q = torch.round(a / step) * step  # exact: a / step and the product are powers-of-two rescalings
    q = q.clamp(max=fmt.max)
    normal = q >= 2.0 ** fmt.min_exp
    kq = torch.floor(torch.log2(torch.where(normal, q, torch.ones_like(q))))
    mant_normal = (q / torch.ldexp(torch.ones_like(q), kq.to(torch.int32)) - 1) * (1 << fmt.mbits)
    mant_sub = q / 2.0 ** (fmt.min_exp - fmt.mbits)
    field = torch.where(normal, kq + fmt.bias, torch.zeros_like(q))
    mant = torch.where(normal, mant_normal, mant_sub)
    code = (field.to(torch.int32) << fmt.mbits) | mant.round().to(torch.int32)
    sign = ((y < 0) & (code > 0)).to(torch.int32) << (fmt.ebits + fmt.mbits)  # +0 only
    return (code | sign).to(torch.uint8)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    # 2^e as an exact float32 (e >= -127 may be subnormal; ldexp keeps it exact).
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32, device=exponent.device), exponent)


def encode(x: torch.Tensor, fmt: ElementFormat, rule: ScaleRule = ScaleRule.EVEN,
           *, stored: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., n] uint8, exponents [..., n / 32] int32)`` of a tensor cut into 32-blocks along its last dim."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    exponent = block_exponents(blocks.abs().amax(dim=-1), fmt, rule, x.dtype, stored=stored)
    codes = element_codes(blocks / _power_of_two(exponent).unsqueeze(-1), fmt)
    return codes.reshape(x.shape), exponent


def quantize(weight: torch.Tensor, fmt: ElementFormat, rule: ScaleRule = ScaleRule.EVEN):
    """``(packed, scales)`` for a ``[rows, in]`` weight: packed ``[rows, in * bits / 8]`` uint8."""
    codes, exponent = encode(weight, fmt, rule)
    return pack(codes, fmt), (exponent + 127).clamp_(min=1).to(torch.uint8)


def quantize_dequantize(x: torch.Tensor, fmt: ElementFormat, rule: ScaleRule = ScaleRule.EVEN) -> torch.Tensor:
    """What a dynamic MX activation becomes (Quark's ``input_tensors`` fake quantization): ``x`` of any shape,
    blocks of 32 along its last dim, each element replaced by its code's value x 2^e, in ``x``'s dtype.

    Same ``encode`` as the weights, with Quark's dynamic exponents (``block_exponents(stored=False)``)
    and the exact ``2^e`` as the scale (a block at e = -127 keeps 2^-127, where a stored byte says 2^-126).
    """
    codes, exponent = encode(x, fmt, rule, stored=False)
    values = code_values(fmt).to(x.device)[codes.long()].reshape(*exponent.shape, BLOCK)
    return (values * _power_of_two(exponent).unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def pack(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    rows, cols = codes.shape
    if fmt.bits == 4:
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    c = codes.to(torch.int32).reshape(rows, cols // 4, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1).reshape(rows, -1).to(torch.uint8)


def unpack(packed: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    rows = packed.shape[0]
    if fmt.bits == 4:
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1)
    b = packed.to(torch.int32).reshape(rows, -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).reshape(rows, -1).to(torch.uint8)


def code_values(fmt: ElementFormat) -> torch.Tensor:
    """The value of every code, for decoding."""
    codes = torch.arange(1 << fmt.bits)
    mag = codes & ((1 << (fmt.ebits + fmt.mbits)) - 1)
    field, mant = mag >> fmt.mbits, mag & ((1 << fmt.mbits) - 1)
    value = torch.where(field > 0, (1 + mant / (1 << fmt.mbits)) * torch.pow(2.0, field - fmt.bias),
                        mant / (1 << fmt.mbits) * 2.0 ** fmt.min_exp)
    return torch.where((codes >> (fmt.ebits + fmt.mbits)) & 1 == 1, -value, value).to(torch.float32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    values = code_values(fmt)[unpack(packed, fmt).long()]
    rows = values.shape[0]
    factor = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32), scales.to(torch.int32) - SCALE_BIAS)
    return (values.reshape(rows, -1, BLOCK) * factor.unsqueeze(-1)).reshape(rows, -1).to(dtype)

