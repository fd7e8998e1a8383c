"""Per-tensor FP8 e4m3: the W8A8 rung's weights, and the static activations of the W4A8 and W8A8 rungs.

Weights, as Quark 0.13 computes them for ``FP8E4M3PerTensorSpec`` (tested byte for byte against Quark's
own ``ModelQuantizer`` + ``export_safetensors``): ONE scale for the whole ``[out, in]`` tensor,
``scale = amax / 448`` computed in bf16 (``PerTensorMinMaxObserver`` keeps min/max in the weight's dtype and
``ObserverBase.get_scale(scale_format="float32")`` divides in it; float32's eps where that is 0), and
``codes = e4m3(clamp(w / scale, -448, 448))`` with the division in bf16 as well
(``real_quantize_fp8_per_tensor_with_scale``): the quotient is rounded to bf16, then to e4m3. Quark stores
the scale as ``<module>.weight_scale``, a bf16 scalar of shape ``[]`` for a bf16 model. Decoding is
``e4m3 * scale`` in float32, what the engines' GEMMs do.

The executor encodes a weight in row chunks, so the scale is an argument: one pass for ``amax`` over every
row (``amax_bf16`` / ``weight_scale``), then ``encode_bf16`` (or ``quantize``) per chunk with that scale.

Activations: a static ``input_scale`` is ``scale_of(amax)`` of the calibration activations (the same rule:
Quark's static observer sees bf16 activations); served as ``fp8_static_qdq``.

The numba kernel is the torch reference step for step on bf16 bit patterns (``fp8_fast``'s helpers).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from quant.errors import NonFiniteError
from quant.formats.constants import E4M3_MAX
from quant.formats.fp8_fast import _MAX, _VALUES, _bf16, _e4m3_magnitude, _float
from quant.formats.numba_threads import numba_threads

SCALE_DTYPE = torch.bfloat16  # Quark's scalars (weight_scale, input_scale) are in the model's dtype: bf16
_EPS = torch.finfo(torch.float32).eps  # Quark's observer eps, put where amax / 448 is 0


def scale_of(amax: float | torch.Tensor) -> torch.Tensor:
    """The per-tensor scale of a tensor (weights or activations) whose largest magnitude is ``amax``: a bf16
    0-d tensor, ``bf16(amax) / 448`` rounded to bf16, float32's eps (in bf16) where that is 0."""
    amax = torch.as_tensor(amax).to(SCALE_DTYPE)
    if not torch.isfinite(amax) or amax < 0:
        raise NonFiniteError(f"amax {float(amax)} is not a finite magnitude; no FP8 scale can be made from it")
    scale = amax / E4M3_MAX
    return torch.where(scale == 0, torch.tensor(_EPS, dtype=SCALE_DTYPE), scale)


def weight_scale(weight: torch.Tensor) -> torch.Tensor:
    """``scale_of`` the weight's amax; refuses NaN/Inf with its row and column."""
    _refuse_non_finite(weight)
    return scale_of(weight.abs().amax() if weight.numel() else 0.0)


def quantize(weight: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """e4m3 codes (``torch.float8_e4m3fn``, same shape) of ``weight`` (any rows of it) under the tensor's
    ``scale``: ``clamp(weight / scale, +-448)``, the quotient in bf16 for a bf16 weight (Quark's arithmetic:
    it divides in the model's dtype), in float32 for any other."""
    _refuse_non_finite(weight)
    dtype = SCALE_DTYPE if weight.dtype == SCALE_DTYPE else torch.float32
    x = weight.to(dtype) / torch.as_tensor(scale).to(dtype)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``e4m3 * scale`` in float32 (codes as ``float8_e4m3fn`` or their uint8 bytes), returned in ``dtype``."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return (codes.to(torch.float32) * torch.as_tensor(scale).to(torch.float32)).to(dtype)


def quantize_dequantize(weight: torch.Tensor) -> torch.Tensor:
    """What a weight becomes at the W8A8 rung (its own per-tensor scale), in its dtype."""
    scale = weight_scale(weight)
    return dequantize(quantize(weight, scale), scale, weight.dtype)


def fp8_static_qdq(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """What a static per-tensor FP8 activation becomes as the engines serve it: ``x`` in float32 times the
    float32 reciprocal of ``input_scale``, clamped to +-448, cast to e4m3 (round to nearest even), times the
    scale again (the GEMM's dequantization), returned in ``x``'s dtype.

    vLLM 0.33.0 ``QuantFP8.forward_native`` (``model_executor/layers/quantization/input_quant_fp8.py``,
    static per-tensor: ``x.to(float32) * scale.to(float32).reciprocal()``, clamp, ``.to(fp8)``; the CUDA
    ``static_scaled_fp8_quant`` multiplies by the inverted scale too), sglang 0.5.23 ``_static_quant_fp8``
    (``kernels/ops/quantization/fp8_kernel.py``, Triton: ``y * (1.0 / y_s)``, clamp, cast). sglang's ROCm
    fallback without aiter (``_native_static_quant_fp8``) divides instead, which can differ in the last
    float32 bit before the cast (tested: equal on a million normal values). Refuses a scale that is not a
    finite positive number (a bad checkpoint value would turn every activation into NaN or Inf).
    """
    scale = torch.as_tensor(input_scale, device=x.device).to(torch.float32).reshape(-1)
    if scale.numel() != 1 or not torch.isfinite(scale).all() or not (scale > 0).all():
        raise NonFiniteError(f"input_scale {scale.tolist()} is not one finite positive value; a static FP8 "
                             "activation scale is amax / 448 of calibration activations")
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(x.dtype)


def _refuse_non_finite(x: torch.Tensor, row0: int = 0) -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        where = f"row {row0 + bad[0]}, column {bad[1]}" if len(bad) == 2 else f"index {bad}"
        raise NonFiniteError(f"NaN/Inf at {where}; fix the source checkpoint (Quark would silently write garbage "
                             "here)")


# The fast CPU path for bf16 weights: raw bytes in, e4m3 bytes out, no torch.

@numba.njit(parallel=True, cache=True, nogil=True)
def _amax_rows(words, out):  # pragma: no cover
    """Per row, the largest magnitude's bf16 pattern (patterns order like magnitudes); >= 0x7F80 is Inf/NaN."""
    for r in numba.prange(words.shape[0]):
        m = np.uint16(0)
        for j in range(words.shape[1]):
            m = max(m, np.uint16(words[r, j] & 0x7FFF))
        out[r] = m


def amax_bf16(raw: np.ndarray, row0: int = 0, threads: int | None = None) -> float:
    """The largest magnitude of bf16 rows given as raw bytes ``[rows, in * 2]``; refuses NaN/Inf naming the
    row (``row0``: the first row's index in the weight). Max over chunks is the weight's amax."""
    words = raw.view(np.uint16)
    per_row = np.empty(words.shape[0], dtype=np.uint16)
    with numba_threads(threads):
        _amax_rows(words, per_row)
    if per_row.size and int(per_row.max()) >= 0x7F80:
        row = int(np.flatnonzero(per_row >= 0x7F80)[0])
        col = int(np.flatnonzero((words[row] & 0x7FFF) >= 0x7F80)[0])
        raise NonFiniteError(f"NaN/Inf at row {row0 + row}, column {col}; fix the source checkpoint (Quark would "
                             "silently write garbage here)")
    return float(np.array(int(per_row.max()) << 16 if per_row.size else 0, dtype=np.uint32).view(np.float32))


@numba.njit(parallel=True, cache=True, nogil=True)
def _encode_rows(words, scale, values, error_stride, row_offset, out, flags, err_sq, ref_sq):  # pragma: no cover
    """Per row: ``|x| / scale`` in float32 rounded to bf16 (torch's bf16 division), ``min(., 448)``, its e4m3
    magnitude, ``x``'s sign put back (so -0 and negatives that round to zero keep it, as in torch). A row
    holding NaN/Inf is flagged (its codes are garbage: the caller refuses the weight)."""
    rows, cols = words.shape
    for r in numba.prange(rows):
        largest = np.uint16(0)
        for j in range(cols):
            w = words[r, j]
            largest = max(largest, np.uint16(w & 0x7FFF))
            y = _float(np.uint32(_bf16(_float(np.uint32(w & 0x7FFF) << np.uint32(16)) / scale)) << np.uint32(16))
            out[r, j] = np.uint8(_e4m3_magnitude(min(y, _MAX)) | ((w >> 8) & 0x80))
        flags[r] = largest >= 0x7F80
        if flags[r]:
            continue
        row_err = row_ref = 0.0
        if (r + row_offset) % error_stride == 0:  # the error sample, float64 sums
            for j in range(cols):
                x = np.float64(_float(np.uint32(words[r, j]) << np.uint32(16)))
                d = x - np.float64(values[out[r, j]]) * np.float64(scale)
                row_err += d * d
                row_ref += x * x
        err_sq[r] = row_err
        ref_sq[r] = row_ref


def encode_bf16(raw: np.ndarray, scale: float, error_stride: int = 64, row_offset: int = 0,
                threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(codes uint8 [rows, in], row_flags, err_sq, ref_sq)`` of bf16 rows given as raw bytes ``[rows, in * 2]``
    under the weight's ``scale`` (a bf16 value, from ``scale_of``). A flagged row holds NaN/Inf: refuse it.
    ``err_sq``/``ref_sq`` as in ``mxfp4_fast.quantize_bf16``."""
    words = raw.view(np.uint16)
    codes = np.empty(words.shape, dtype=np.uint8)
    flags = np.zeros(words.shape[0], dtype=np.bool_)
    err_sq = np.zeros(words.shape[0], dtype=np.float64)
    ref_sq = np.zeros(words.shape[0], dtype=np.float64)
    with numba_threads(threads):
        _encode_rows(words, np.float32(scale), _VALUES, error_stride, row_offset, codes, flags, err_sq, ref_sq)
    return codes, flags, err_sq, ref_sq
