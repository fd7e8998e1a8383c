"""NVFP4 decode: E2M1 codes, one FP8 E4M3 scale per 16 values along ``in``, one FP32 scale per tensor.

Both producers store the codes the same way (``[out, in / 2]`` uint8, element ``2i`` in the low
nibble, bit 3 the sign, E2M1 magnitudes 0 0.5 1 1.5 2 3 4 6) and the block scales as e4m3
``[out, in / 16]``; they differ in what the tensor scale means:

- compressed-tensors (``nvfp4-pack-quantized``): ``weight_global_scale`` divides,
  ``w = e2m1 * (scale / global)``. compressed-tensors 0.20.1 ``NVFP4PackedCompressor.decompress``
  (``compressors/nvfp4/base.py``) unpacks to bf16, casts the e4m3 scale to bf16 (exact) and calls
  ``forward_helpers._dequantize``: ``scale / global_scale`` (bf16 by an F32 ``[1]`` tensor: an fp32
  quotient), the codes times it in fp32, the product cast to bf16.
- ModelOpt (``quant_algo: NVFP4``): ``weight_scale_2`` multiplies, ``w = e2m1 * (scale * scale_2)``.
  nvidia-modelopt 0.47.0 ``NVFP4QTensor.dequantize`` (``torch/quantization/qtensor/nvfp4_tensor.py``,
  the non-``fast`` path): ``scale.to(float32) * double_scale`` (fp32), the fp32 code values times it,
  ``.to(bf16)``.

So each 16-value block has one fp32 effective scale (``effective_scales``: the quotient or the
product, rounded once to fp32 as those libraries round it) and every value is
``bf16(fp32(code value * effective scale))``, round to nearest even. A tensor's block scales are
e4m3 bytes and its tensor scale is one number, so there are 256 effective scales at most: the
results of every (scale byte, packed byte) pair are computed once per tensor (``decode_table``, with
the same fp32 operations) and the kernel is one table load per packed byte, as Quark MXFP4's.
"""

from __future__ import annotations

import numba
import numpy as np

from quant.formats.constants import E2M1_VALUES
from quant.formats.fp8_fast import _bf16, e4m3_values
from quant.formats.numba_threads import numba_threads

GROUP = 16  # values sharing one e4m3 scale
DIVIDE, MULTIPLY = "divide", "multiply"  # how the tensor scale applies: compressed-tensors, ModelOpt

# Code 8 (sign bit, zero magnitude): compressed-tensors multiplies 0 by -1 (-0.0); ModelOpt's table holds 0 (+0.0).
_CODE_VALUES = {DIVIDE: np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32),
                MULTIPLY: np.array(E2M1_VALUES + (0.0,) + tuple(-v for v in E2M1_VALUES[1:]), dtype=np.float32)}
_E4M3 = e4m3_values()


def effective_scales(block_scales: np.ndarray, tensor_scale: float | np.floating, applies: str) -> np.ndarray:
    """fp32 ``[rows, in / 16]`` scale of each block: the e4m3 ``block_scales`` (their bytes, uint8, or
    their values as float32) divided by (compressed-tensors) or multiplied by (ModelOpt) the fp32
    ``tensor_scale``, rounded once to fp32."""
    scales = _E4M3[block_scales] if block_scales.dtype == np.uint8 else block_scales.astype(np.float32)
    tensor = np.float32(tensor_scale)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # refused before: zero, NaN, Inf
        return scales / tensor if applies == DIVIDE else scales * tensor


@numba.njit(cache=True, nogil=True)
def _fill_table(scales, values, table):  # pragma: no cover
    for s in range(256):
        for byte in range(256):
            low = np.uint32(_bf16(values[byte & 15] * scales[s]))
            high = np.uint32(_bf16(values[byte >> 4] * scales[s]))
            table[s * 256 + byte] = low | (high << np.uint32(16))


def decode_table(tensor_scale: float | np.floating, applies: str) -> np.ndarray:
    """bf16 bits of both values of every (block scale byte, packed byte) pair of one tensor, one uint32
    per pair (low half: the low nibble's value): ``table[scale << 8 | byte]``. A tensor has one tensor
    scale, so its blocks have at most 256 effective scales, and every value is one of 256 x 16 products."""
    table = np.empty(256 * 256, dtype=np.uint32)
    _fill_table(effective_scales(np.arange(256, dtype=np.uint8), tensor_scale, applies), _CODE_VALUES[applies],
                table)
    return table


@numba.njit(parallel=True, cache=True, nogil=True)
def _decode_rows(packed, scales, table, out):  # pragma: no cover
    """One table load per packed byte writes both of its bf16 values (``out`` is uint32 pairs)."""
    rows, half = packed.shape
    for r in numba.prange(rows):
        for b in range(half // (GROUP // 2)):
            base = np.int32(scales[r, b]) << 8
            for j in range(b * (GROUP // 2), (b + 1) * (GROUP // 2)):
                out[r, j] = table[base + np.int32(packed[r, j])]


def decode_bf16(packed: np.ndarray, scales: np.ndarray, table: np.ndarray, threads: int | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16 ``[rows, in]``) of NVFP4 ``packed`` codes (uint8 ``[rows, in / 2]``) whose
    blocks' e4m3 scales are ``scales`` (their bytes, uint8 ``[rows, in / 16]``), by the tensor's ``decode_table``."""
    if packed.shape[1] % (GROUP // 2) or scales.shape != (packed.shape[0], packed.shape[1] // (GROUP // 2)):
        raise ValueError(f"NVFP4 {list(packed.shape)} bytes with {list(scales.shape)} scales: not whole 16-value "
                         "blocks, one scale each (the kernel would leave columns unwritten)")
    out = np.empty(packed.shape, dtype=np.uint32)
    with numba_threads(threads):
        _decode_rows(np.ascontiguousarray(packed), np.ascontiguousarray(scales, dtype=np.uint8), table, out)
    return out.view(np.uint16)
