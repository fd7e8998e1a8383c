"""The fast CPU path of MXFP4 for bf16 weights under the ``even`` rule: integer work on bit patterns.

For a bf16 ``x`` and block exponent ``e``, ``y = x / 2^e`` is exact and its bit pattern is ``x``'s
with ``e`` subtracted from the exponent field. Bit patterns of non-negative floats order like the
floats, so the E2M1 code of ``y`` (ties, saturation) is a count of integer comparisons against
the rounding midpoints: branch-free integer work that vectorizes. One pass per block (amax,
scale, codes, packing) in a numba kernel, rows spread over the cores. Tests hold it to the
reference ``mxfp4.quantize`` on every bf16 bit pattern and to Quark's bytes.

Blocks whose exponent is tiny (``e < -119``, amax below about 2^-117) are flagged and redone by
the reference path: there a subnormal ``x`` can still scale to a non-zero code.

numba compiles the kernel on its first call and caches the machine code on disk (``cache=True``),
so importing quantgate costs nothing and later processes load the kernel in milliseconds.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numba
import numpy as np

from quant.formats.constants import BLOCK, E2M1_VALUES
from quant.formats.numba_threads import numba_threads

if TYPE_CHECKING:
    import torch

ROW_OK, ROW_NON_FINITE, ROW_NEEDS_REFERENCE = 0, 1, 2
if sys.byteorder != "little":
    raise ImportError("the fast MXFP4 kernel reads bf16 pairs as little-endian uint32")


# The float value of every bf16 bit pattern (a bf16 is the top half of a float32; non-finite ones
# never reach the error loop). No torch here: a converting process loads numpy and numba only.
with np.errstate(invalid="ignore"):  # the NaN patterns cast to NaN, as they should
    _BF16_VALUES = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
_VALUES = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float64)


@numba.njit(inline="always", cache=True)
def _code(x, shift):  # pragma: no cover
    """E2M1 code of bf16 ``x`` divided by ``2^e`` (``shift = e << 7``), branch-free so it vectorizes.

    ``a`` is the bit pattern of ``|x| / 2^e`` (negative or tiny when that is below 2^-126, which
    is code 0 anyway); the code counts the rounding midpoints below it, ``>`` where the tie goes
    down to an even code, ``>=`` where it goes up: 0.25 0.75 1.25 1.75 2.5 3.5 5.
    """
    a = np.int32(x & 0x7FFF) - shift
    code = (np.int32(a > 0x3E80) + np.int32(a >= 0x3F40) + np.int32(a > 0x3FA0) + np.int32(a >= 0x3FE0)
            + np.int32(a > 0x4020) + np.int32(a >= 0x4060) + np.int32(a > 0x40A0))
    return np.uint8(code | ((np.int32(x) >> 12) & 8 & -np.int32(code > 0)))


@numba.njit(parallel=True, cache=True, nogil=True)
def _quantize_rows(pairs, values, bf16_values, error_stride, row_offset, packed, scales, flags, err_sq, ref_sq):  # pragma: no cover
    """``pairs`` holds two bf16 per uint32 (element 2i in the low half, as memory is little-endian),
    which is exactly the pairing of one output byte: low nibble 2i, high nibble 2i+1."""
    rows, cols2 = pairs.shape
    for r in numba.prange(rows):
        flag = 0
        for b in range(cols2 // 16):
            block = pairs[r, b * 16:(b + 1) * 16]
            amax = np.uint32(0)
            for i in range(16):
                v = block[i] & np.uint32(0x7FFF7FFF)
                amax = max(amax, max(v & np.uint32(0xFFFF), v >> np.uint32(16)))
            amax = np.int32(amax)
            if amax >= 0x7F80:  # Inf or NaN somewhere in the block
                flag = 1
                break
            field = (amax + 32) >> 7  # the "even" rule: round amax up when its mantissa is >= 1.75
            e = 127 if field == 255 else max(field - 129, -127)
            if e < -119:
                flag = 2
            scales[r, b] = max(e + 127, 1)
            shift = np.int32(e << 7)
            for i in range(16):
                w = block[i]
                packed[r, b * 16 + i] = (_code(np.uint16(w & np.uint32(0xFFFF)), shift)
                                         | (_code(np.uint16(w >> np.uint32(16)), shift) << 4))
        flags[r] = flag
        # The error sample decodes what was just written, in its own loop: a branch inside the
        # block loop above kept it from vectorizing (measured: 3.5 -> 4.3 GB/s on one core).
        row_err = 0.0
        row_ref = 0.0
        if flag != 1 and (r + row_offset) % error_stride == 0:
            for b in range(cols2 // 16):
                scale = 2.0 ** (np.int32(scales[r, b]) - 127)
                for i in range(32):
                    x = np.uint16((pairs[r, b * 16 + i // 2] >> np.uint32(16 * (i % 2))) & np.uint32(0xFFFF))
                    xv = bf16_values[x]
                    d = xv - values[(packed[r, b * 16 + i // 2] >> (4 * (i % 2))) & 15] * scale
                    row_err += d * d
                    row_ref += xv * xv
        err_sq[r] = row_err
        ref_sq[r] = row_ref


def quantize_bf16(weight: torch.Tensor | np.ndarray, error_stride: int = 64, row_offset: int = 0,
                  threads: int | None = None):
    """``(packed, scales, row_flags, err_sq, ref_sq)`` for a bf16 ``[rows, in]`` weight.

    ``weight`` is a bf16 tensor, or its raw bytes as a ``[rows, in * 2]`` uint8 array (read-only
    is fine: a memory-mapped source is used without a copy). ``err_sq``/``ref_sq`` are per-row
    sums of squared quantization error and squared value, on rows whose index plus ``row_offset``
    is a multiple of ``error_stride`` (a sample keeps the error figure cheap), else 0. Callers
    handle rows flagged ``ROW_NON_FINITE`` (refuse) and ``ROW_NEEDS_REFERENCE`` (redo those rows
    with ``mxfp4.quantize``).
    """
    if not isinstance(weight, np.ndarray):  # a bf16 torch tensor (torch is loaded if one was given)
        import torch

        weight = weight.contiguous().view(torch.uint8).numpy()
    rows, cols = weight.shape[0], weight.shape[1] // 2
    pairs = weight.view(np.uint32)
    packed = np.empty((rows, cols // 2), dtype=np.uint8)
    scales = np.empty((rows, cols // BLOCK), dtype=np.uint8)
    flags = np.empty(rows, dtype=np.uint8)
    err_sq = np.empty(rows, dtype=np.float64)
    ref_sq = np.empty(rows, dtype=np.float64)
    with numba_threads(threads):
        _quantize_rows(pairs, _VALUES, _BF16_VALUES, error_stride, row_offset, packed, scales, flags, err_sq, ref_sq)
    return packed, scales, flags, err_sq, ref_sq


def _decode_table() -> np.ndarray:
    """bf16 bits of both codes of every (scale byte, packed byte) pair, as one uint32 per pair
    (low half: the low nibble's value, which comes first in memory): ``table[scale << 8 | byte]``.

    The reference decode is float32 ``value * 2^(scale - 127)`` rounded to bf16. E2M1 values have
    two significant bits, so every finite product is exact in bf16 (subnormals included) and its
    bits are the float32's top half; scale 255 is 2^128, which overflows to +-Inf (NaN for zero),
    and torch's vectorized float32 -> bf16 writes NaN as 0xFFFF. A test holds this table to the
    reference decode itself, for every scale byte and packed byte.
    """
    codes = np.arange(16)
    magnitudes = np.array(E2M1_VALUES, dtype=np.float32)[codes & 7]
    values = np.where(codes & 8, -magnitudes, magnitudes).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        factors = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)
        products = factors[:, None] * values[None, :]  # [scale, code]
    bits = (products.view(np.uint32) >> 16).astype(np.uint32)
    bits[np.isnan(products)] = 0xFFFF
    byte = np.arange(256)
    return (bits[:, byte & 15] | (bits[:, byte >> 4] << 16)).reshape(-1)


@numba.njit(parallel=True, cache=True, nogil=True)
def _decode_rows(packed, scales, table, out):  # pragma: no cover
    """One table load per packed byte writes both of its bf16 values (``out`` is uint32 pairs)."""
    rows, half = packed.shape
    for r in numba.prange(rows):
        for b in range(half // 16):
            base = np.int32(scales[r, b]) << 8
            for j in range(b * 16, b * 16 + 16):
                out[r, j] = table[base + np.int32(packed[r, j])]


_TABLE = None


def decode_bf16(packed: np.ndarray, scales: np.ndarray, threads: int | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16 ``[rows, in]``) of an MXFP4 weight stored as ``packed`` ``[rows, in/2]``
    and ``scales`` ``[rows, in/32]`` (uint8): a table lookup, the same values as ``mxfp4.dequantize``."""
    global _TABLE
    if packed.shape[1] % (BLOCK // 2) or scales.shape != (packed.shape[0], packed.shape[1] // (BLOCK // 2)):
        raise ValueError(f"MXFP4 {list(packed.shape)} bytes with {list(scales.shape)} scales: not whole 32-value "
                         "blocks, one scale each (the kernel would leave columns unwritten)")
    if _TABLE is None:
        _TABLE = _decode_table()
    out = np.empty((packed.shape[0], packed.shape[1]), dtype=np.uint32)
    with numba_threads(threads):
        _decode_rows(packed, scales, _TABLE, out)
    return out.view(np.uint16)
