"""``--to bf16`` of the third-party schemes (``quant.third_party.Scheme``): rows of a stored weight and
the module's other tensors (its scales, zero points) in, bf16 bit patterns out, exactly what the
producer's own dequantization gives in bf16:

- NVFP4 (compressed-tensors and ModelOpt): ``quant.formats.nvfp4``.
- MXFP4 (compressed-tensors ``mxfp4-pack-quantized``): compressed-tensors 0.20.1
  ``MXFP4PackedCompressor`` decodes the E8M0 byte as ``2^(byte - 127)`` in bf16 and multiplies the
  bf16 E2M1 value by it, which is exact: the same values as Quark's MXFP4 (``mxfp4_fast``).
- INT4 / INT8 (``pack-quantized`` int32 words, ``quant.formats.int_packed``; ``int-quantized`` int8) and
  FP8 E4M3 (``float-quantized``; tensor, channel or block scales): compressed-tensors
  ``forward_helpers._dequantize`` computes in the scale's dtype: ``(q - zero_point) * scale``, the
  integers or e4m3 values exact there, one rounding of the product to the scale's dtype (bf16, fp16
  or fp32), then (ours) to bf16. ModelOpt FP8 (``FP8QTensor.dequantize(dtype=bf16)``,
  ``torch/quantization/qtensor/fp8_tensor.py``) casts its fp32 scale to bf16 first, then multiplies in bf16.

Scales and zero points are small beside the weight (a value per 16 or more, or per row): they are read
whole (``params``), the weight in chunks of rows; a chunk's output is bounded like the other formats'.
"""

from __future__ import annotations

import numpy as np

from quant.formats import int_packed, nvfp4
from quant.formats.fp8_fast import e4m3_values

_E4M3 = e4m3_values()
_NUMPY = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}


def stored(raw: bytes | np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored tensor's bytes as an array of its element type without a copy: bf16 as its uint16 bit
    patterns, e4m3 as its uint8 bytes (``as_float`` gives their values, a slice at a time)."""
    data = np.frombuffer(raw, np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw.reshape(-1)
    return data.view(_NUMPY.get(dtype, "<u2" if dtype == "BF16" else "u1")).reshape(shape)


def as_float(dtype: str, values: np.ndarray) -> np.ndarray:
    """float32 values (exact) of a ``stored`` array (or a slice of one) of safetensors ``dtype``."""
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        return _E4M3[values]
    return values.astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (torch's; NaN as 0xFFFF)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    out[np.isnan(x)] = 0xFFFF
    return out


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (float32) rounded to ``dtype`` and held as float32 again (exact)."""
    if dtype == "BF16":
        return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    return x


def _per_value(scheme, array: np.ndarray, start: int, count: int, cols: int) -> np.ndarray:
    """What ``array`` (a scale or zero point, as stored) gives every value of rows ``start .. start + count``:
    an array broadcastable to ``[count, cols]``."""
    if scheme.strategy == "tensor":
        return array.reshape(1, 1)
    if scheme.strategy == "channel":
        return array.reshape(-1, 1)[start:start + count]
    if scheme.strategy == "block":
        rows, columns = scheme.block
        grid = array.reshape(array.shape[-2], array.shape[-1])
        return grid[(start + np.arange(count)) // rows][:, np.arange(cols) // columns]
    return np.repeat(array.reshape(array.shape[0], -1)[start:start + count], scheme.group, axis=1)[:, :cols]


def load_params(scheme, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], out: int, cols: int
                ) -> dict[str, tuple[str, np.ndarray]]:
    """The module's tensors beside its weight (suffix -> (dtype, shape, bytes)) as ``decode_rows`` takes
    them: ``stored`` arrays, packed zero points unpacked; ValueError says why they do not fit
    (``weight_shape`` holding another shape than the one decoded)."""
    params = {suffix: (dtype, stored(raw, dtype, shape)) for suffix, (dtype, shape, raw) in tensors.items()}
    if "weight_shape" in params:
        found = [int(v) for v in params["weight_shape"][1].reshape(-1)]
        if found != [out, cols]:
            raise ValueError(f"weight_shape holds {found}, but the packed weight and its scales make it "
                             f"[{out}, {cols}] (an input width that is not a multiple of {32 // scheme.bits} is not "
                             "decoded)")
    if "weight_zero_point" in params and scheme.storage == "pack-quantized" and scheme.strategy in ("group", "channel"):
        dtype, words = params["weight_zero_point"]
        params["weight_zero_point"] = dtype, int_packed.unpack_zero_points(words, scheme.bits, out)
    return params


def _not_finite(dtype: str, values: np.ndarray) -> np.ndarray:
    """Flat indices of the NaN/Inf values of a ``stored`` array (E8M0's NaN is 0xFF, e4m3's 0x7F/0xFF)."""
    flat = values.reshape(-1)
    if dtype == "U8":
        return np.flatnonzero(flat == 0xFF)
    if dtype == "F8_E4M3":
        return np.flatnonzero(flat & 0x7F == 0x7F)
    if dtype == "BF16":
        return np.flatnonzero(flat & 0x7F80 == 0x7F80)
    return np.flatnonzero(~np.isfinite(flat))


def param_problem(scheme, params: dict[str, tuple[str, np.ndarray]]) -> str | None:
    """Why the module's scales (``params``: suffix -> (dtype, values)) cannot be decoded: a NaN or Inf
    scale, a zero or negative tensor scale (NVFP4's divides or multiplies every block's)."""
    for suffix, (dtype, values) in params.items():
        if not suffix.endswith(("scale", "scale_2")):
            continue
        bad, what = _not_finite(dtype, values), "NaN/Inf"
        if not bad.size and suffix in ("weight_global_scale", "weight_scale_2"):
            bad, what = np.flatnonzero(as_float(dtype, values.reshape(-1)) <= 0), "zero or negative"
        if bad.size:
            return (f"{suffix} holds {what} values ({bad.size} of {values.size}, the first at flat index "
                    f"{int(bad[0])}): it would decode to NaN/Inf or garbage")
    return None


def _tensor_scale(params, suffix: str) -> np.float32:
    dtype, values = params[suffix]
    return np.float32(as_float(dtype, values.reshape(-1)[:1])[0])


def decode_rows(scheme, codes: np.ndarray, start: int, cols: int, params: dict[str, tuple[str, np.ndarray]],
                threads: int | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16 ``[count, cols]``) of the stored rows ``codes`` (uint8
    ``[count, stored bytes]``) from row ``start`` of a module stored in ``scheme``; ``params``: the
    module's other tensors (suffix -> (stored dtype, ``stored`` array), whole; only this chunk's rows of
    them are turned into float32)."""
    count = codes.shape[0]
    label = scheme.label
    if label == "nvfp4":
        applies = nvfp4.DIVIDE if scheme.fmt == "compressed-tensors" else nvfp4.MULTIPLY
        tensor_suffix = "weight_global_scale" if applies == nvfp4.DIVIDE else "weight_scale_2"
        blocks = params["weight_scale"][1].reshape(-1, cols // nvfp4.GROUP)[start:start + count]  # e4m3 bytes
        return nvfp4.decode_bf16(codes, blocks, nvfp4.decode_table(_tensor_scale(params, tensor_suffix), applies),
                                 threads)
    if label == "mxfp4":
        from quant.formats import mxfp4_fast

        scales = params["weight_scale"][1].reshape(-1, cols // 32)[start:start + count]
        return mxfp4_fast.decode_bf16(codes, np.ascontiguousarray(scales, dtype=np.uint8), threads)
    scale_dtype, scale = params["weight_scale"]
    if scheme.storage == "pack-quantized":
        values = int_packed.unpack_rows(codes, scheme.bits, cols).astype(np.float32)
    elif label in ("int4", "int8"):
        values = codes.view(np.int8).astype(np.float32)
    else:
        values = _E4M3[codes]
    if "weight_zero_point" in params:
        dtype, zero = params["weight_zero_point"]
        values = values - as_float(dtype, _per_value(scheme, zero, start, count, cols))  # integers: exact
    scale = as_float(scale_dtype, _per_value(scheme, scale, start, count, cols))
    if scheme.fmt == "modelopt":  # FP8QTensor.dequantize: the fp32 scale cast to the output dtype first
        scale, scale_dtype = _round_to(scale, "BF16"), "BF16"
    product = values * scale  # exact unless the scale is fp32
    return bf16_bits(_round_to(product.astype(np.float32), scale_dtype))

