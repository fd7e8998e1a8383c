"""The fast CPU path of block FP8 for bf16 weights, both directions, without torch.

Encoding is the reference ``fp8.quantize`` step for step, in the same float32 operations, so the
bytes are the same: per 128x128 tile ``amax`` (compared as bf16 bit patterns, which order like the
magnitudes), ``scale_inv = amax / 448`` (1.0 for an all-zero tile), ``min(|x| / scale_inv, 448)``
and torch's float32 -> e4m3 conversion (c10 ``fp8e4m3fn_from_fp32_value``: round to nearest even,
subnormals through an added ``2^14`` whose rounding is the e4m3 one), the sign put back last (so
-0 and negatives that round to zero keep it, as in torch). Decoding is ``bf16(e4m3 value *
scale_inv)`` with torch's rounding (NaN as 0xFFFF, what its vectorized float32 -> bf16 writes).

Both are numba kernels on bit patterns (a float's bits are read with a no-op ``bitcast``), tiles
spread over the cores; tests hold them to the torch reference on edge values and every
tensor of the example checkpoint, and the float32 -> e4m3 step to torch on every float32 near a
rounding boundary. Compiled on first use and cached on disk, as ``mxfp4_fast``.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from quant.formats.constants import E4M3_MAX
from quant.formats.constants import FP8_TILE as TILE
from quant.formats.numba_threads import numba_threads

if sys.byteorder != "little":
    raise ImportError("the fast FP8 kernels read bf16 and float32 bit patterns as little-endian")


@intrinsic
def _bits(typingctx, x):
    """The uint32 bit pattern of a float32 (no conversion: LLVM's bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _float(typingctx, x):
    """The float32 whose bit pattern is the low 32 bits of the integer ``x`` (numba widens integer
    arithmetic to 64 bits; the truncation is free)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width > 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(x), codegen


_MAX = np.float32(E4M3_MAX)
_SUBNORMAL_MAGIC = np.float32(2.0 ** 14)  # adding it rounds a float32 below 2^-6 to a multiple of 2^-9


@numba.njit(inline="always", cache=True)
def _e4m3_magnitude(y):  # pragma: no cover
    """e4m3 byte of a float32 ``0 <= y <= 448``: c10 ``fp8e4m3fn_from_fp32_value``. Below
    ``121 << 23`` (2^-6, the smallest normal) it is the float32 sum with ``2^14`` less that bias;
    above, the exponent is rebased (``-120 << 23``) and the 20 bits below e4m3's mantissa round to
    nearest even (``0x7FFFF`` plus the kept bit's parity). Branch-free, so loops vectorize."""
    a = _bits(y)
    small = _bits(y + _SUBNORMAL_MAGIC) - np.uint32(141 << 23)
    normal = (a - np.uint32(120 << 23) + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    return small if a < np.uint32(121 << 23) else normal


@numba.njit(inline="always", cache=True)
def _e4m3(bf16, scale_inv):  # pragma: no cover
    """e4m3 byte of ``clamp(x / scale_inv, -448, 448)``, ``x`` a finite bf16 pattern: the magnitude's
    code, then ``x``'s sign (so -0 and negatives that round to zero keep it, as in torch)."""
    y = min(_float(np.uint32(bf16 & 0x7FFF) << np.uint32(16)) / scale_inv, _MAX)
    return np.uint8(_e4m3_magnitude(y) | ((bf16 >> 8) & 0x80))


@numba.njit(cache=True)
def _e4m3_array(values, out):  # pragma: no cover
    for i in range(values.size):
        out[i] = np.uint8(_e4m3_magnitude(abs(values[i])) | ((_bits(values[i]) >> np.uint32(24)) & np.uint32(0x80)))


def e4m3_from_float32(values: np.ndarray) -> np.ndarray:
    """e4m3 bytes of finite float32 ``values`` within +-448: the conversion step of the kernel alone
    (what the tests hold to torch's cast on every float32 near a rounding boundary)."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(values.size, dtype=np.uint8)
    _e4m3_array(values, out)
    return out


@numba.njit(parallel=True, cache=True, nogil=True)
def _quantize_tiles(words, values, error_stride, row_offset, out, scale_inv, flags, err_sq, ref_sq):  # pragma: no cover
    """One tile row (128 rows, or what is left) per task: the amax of each tile, its scale, the codes."""
    rows, cols = words.shape
    tile_cols = scale_inv.shape[1]
    for t in numba.prange(scale_inv.shape[0]):
        r0, r1 = t * TILE, min(rows, (t + 1) * TILE)
        amax = np.zeros(tile_cols, dtype=np.uint16)
        for r in range(r0, r1):
            for c in range(tile_cols):
                m = np.uint16(0)
                for j in range(c * TILE, min(cols, (c + 1) * TILE)):
                    m = max(m, np.uint16(words[r, j] & 0x7FFF))
                amax[c] = max(amax[c], m)
        flags[t] = 0
        for c in range(tile_cols):
            if amax[c] >= 0x7F80:  # Inf or NaN in the tile: the caller refuses the weight
                flags[t] = 1
            s = _float(np.uint32(amax[c]) << np.uint32(16)) / _MAX
            scale_inv[t, c] = np.float32(1.0) if s == 0 else s  # a zero tile (bf16 never underflows here)
        if flags[t]:
            continue
        for r in range(r0, r1):
            for c in range(tile_cols):
                s = scale_inv[t, c]
                for j in range(c * TILE, min(cols, (c + 1) * TILE)):
                    out[r, j] = _e4m3(words[r, j], s)
            # The error sample: what was just written, decoded, against the source (float64 sums).
            row_err = row_ref = 0.0
            if (r + row_offset) % error_stride == 0:
                for j in range(cols):
                    x = np.float64(_float(np.uint32(words[r, j]) << np.uint32(16)))
                    d = x - np.float64(values[out[r, j]] * scale_inv[t, j // TILE])
                    row_err += d * d
                    row_ref += x * x
            err_sq[r] = row_err
            ref_sq[r] = row_ref


def e4m3_values() -> np.ndarray:
    """float32 value of every e4m3fn byte: ``(1 + m/8) 2^(e-7)``, ``m/8 2^-6`` when ``e == 0``, NaN at
    0x7F and 0xFF (e4m3fn has no infinities)."""
    code = np.arange(256)
    e, m = (code >> 3) & 15, (code & 7).astype(np.float64)
    magnitude = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    magnitude[(code & 0x7F) == 0x7F] = np.nan
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.float32)


_VALUES = e4m3_values()
ROW_OK, ROW_NON_FINITE = 0, 1


def quantize_bf16(weight: np.ndarray, error_stride: int = 64, row_offset: int = 0, threads: int | None = None):
    """``(codes, scale_inv, tile_row_flags, err_sq, ref_sq)`` of a bf16 ``[rows, in]`` weight given as
    raw bytes ``[rows, in * 2]`` (uint8; a read-only mapped source is used without a copy).

    ``codes`` are the e4m3 bytes ``[rows, in]``, ``scale_inv`` float32 ``[ceil(rows/128), ceil(in/128)]``
    (a chunk of rows must start on a tile boundary). ``err_sq``/``ref_sq`` as in
    ``mxfp4_fast.quantize_bf16``. A tile row flagged ``ROW_NON_FINITE`` holds NaN/Inf: refuse it.
    """
    words = weight.view(np.uint16)
    rows, cols = words.shape
    codes = np.empty((rows, cols), dtype=np.uint8)
    scale_inv = np.empty((-(-rows // TILE), -(-cols // TILE)), dtype=np.float32)
    flags = np.empty(scale_inv.shape[0], dtype=np.uint8)
    err_sq = np.zeros(rows, dtype=np.float64)
    ref_sq = np.zeros(rows, dtype=np.float64)
    with numba_threads(threads):
        _quantize_tiles(words, _VALUES, error_stride, row_offset, codes, scale_inv, flags, err_sq, ref_sq)
    return codes, scale_inv, flags, err_sq, ref_sq


@numba.njit(inline="always", cache=True)
def _bf16(x):  # pragma: no cover
    """torch's float32 -> bf16: round to nearest even (c10 ``round_to_nearest_even``), NaN as 0xFFFF
    (what its vectorized conversion writes)."""
    u = _bits(x)
    return np.uint16(0xFFFF) if np.isnan(x) else np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(parallel=True, cache=True, nogil=True)
def _decode_tiles(words, scale_inv, values, out):  # pragma: no cover
    """One tile row per task. A tile has one scale, so its 256 possible bf16 results are computed
    once (``bf16(value * scale_inv)`` in float32, as the reference) and each byte is a lookup; four
    bytes are read as one uint32 and their four results written as one uint64 (measured 1.6x
    faster than a byte at a time)."""
    rows, row_words = words.shape
    tile_cols = scale_inv.shape[1]
    for t in numba.prange(scale_inv.shape[0]):
        table = np.empty((tile_cols, 256), dtype=np.uint64)
        for c in range(tile_cols):
            for k in range(256):
                table[c, k] = np.uint64(_bf16(values[k] * scale_inv[t, c]))
        for r in range(t * TILE, min(rows, (t + 1) * TILE)):
            for c in range(tile_cols):
                tab = table[c]
                for w in range(c * (TILE // 4), min(row_words, (c + 1) * (TILE // 4))):
                    q = words[r, w]
                    out[r, w] = (tab[q & 0xFF] | (tab[(q >> 8) & 0xFF] << 16) | (tab[(q >> 16) & 0xFF] << 32)
                                 | (tab[q >> 24] << 48))


def decode_bf16(codes: np.ndarray, scale_inv: np.ndarray, threads: int | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16 ``[rows, in]``) of e4m3 ``codes`` (uint8 ``[rows, in]``) whose tile
    scales are ``scale_inv`` (float32 ``[ceil(rows/128), ceil(in/128)]``, or its raw bytes): the same
    values as ``fp8.dequantize``."""
    rows, cols = codes.shape
    scale_inv = np.ascontiguousarray(scale_inv).view(np.float32).reshape(-(-rows // TILE), -1)
    if scale_inv.shape[1] != -(-cols // TILE):  # the kernel would leave columns unwritten
        raise ValueError(f"{scale_inv.shape[1]} scale columns for {cols} codes a row; expected {-(-cols // TILE)}")
    pad = -cols % 4  # the kernel reads four codes at a time; real widths are multiples of 128
    if pad:
        codes = np.pad(codes, ((0, 0), (0, pad)))
    out = np.empty((rows, (cols + pad) // 4), dtype=np.uint64)
    with numba_threads(threads):
        _decode_tiles(codes.view(np.uint32), scale_inv, _VALUES, out)
    return np.ascontiguousarray(out.view(np.uint16)[:, :cols]) if pad else out.view(np.uint16)
