"""A format is a registered codec object: what a quantized Linear weight becomes on disk, both
directions of the math, and the ``quantization_config`` that tells the engines how to load it.

One codec per ``--to`` name (``CODECS``; the CLI's choices come from it). A codec answers:

- ``outputs(name, shape)``: the two tensors written for a ``[out, in]`` weight (the weight and its
  scale: names, safetensors dtypes, shapes), and ``shape_problem`` / ``logical_shape``;
- ``encode(raw, dtype, rule)``: the executor's call, bytes in, bytes out. It picks the fastest
  exact kernel itself (MXFP4 from bf16 under the ``even`` rule and FP8 from bf16 run numba kernels;
  blocks those kernels flag go through the torch reference) and refuses NaN/Inf;
- ``decode_bytes(weight, scales)``: the executor's decode (MXFP4 and FP8 run numba kernels);
- ``quantize`` / ``decode``: the torch reference, both directions, on tensors;
- ``quantize_dequantize(x)``: what the format does to any tensor (activations included): the
  round trip along the last dimension, for emulating quantized numerics in evaluation;
- ``quantization_config(exclude, rule, weight_only)`` and ``matches_config`` for the reverse.

Importing this module loads neither torch nor numba: planning, ``--dry-run`` and ``--help`` only
need sizes and names; the math modules load on the first encode or decode.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from quant.errors import NonFiniteError
from quant.formats.constants import BLOCK, E2M1, E2M3, E3M2, E4M3_MAX, FP8_TILE, ElementFormat, ScaleRule
from quant.quark_config import config_kind, fp8_config, quantization_config

if TYPE_CHECKING:
    import numpy as np
    import torch

Entry = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape) of an output tensor
ERROR_ROW_STRIDE = 64  # the fast kernel measures error on every 64th row: cheap and representative


class Encoded(NamedTuple):
    weight: "np.ndarray"  # as stored: uint8 bytes (MX codes, e4m3) of shape [rows, ...]
    scales: "np.ndarray"
    err_sq: float  # sum of squared quantization error over the rows measured
    ref_sq: float  # sum of squared values over the same rows


def _non_finite(x: "torch.Tensor", row0: int) -> NonFiniteError:
    import torch

    row, col = (~torch.isfinite(x)).nonzero()[0].tolist()
    return NonFiniteError(f"NaN/Inf at row {row0 + row}, column {col}; fix the source checkpoint "
                          "(Quark would silently write garbage here)")


class Codec:
    """The interface and the torch reference path every codec shares."""

    name: str  # what --to and recipes call it
    family: str  # recipes of one family are interchangeable (an MX recipe can produce any MX format)
    default_recipe: str
    weight_dtype: str  # safetensors dtype of the stored weight
    scale_suffix: str  # the scale tensor is "<module>.weight" + this
    scale_dtype: str
    row_multiple: int  # row chunks must be multiples of this (FP8 scales cover 128-row tiles)
    bits: int  # stored bits per weight element
    warning: str | None = None  # said by every plan that uses the format

    def __reduce__(self):  # a worker process gets the registered codec itself, not a copy
        return get_codec, (self.name,)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        raise NotImplementedError

    def outputs(self, name: str, shape: tuple[int, int]) -> tuple[Entry, Entry]:
        weight = (shape[0], shape[1] * self.bits // 8)
        return (name, self.weight_dtype, weight), (name + self.scale_suffix, self.scale_dtype, self.scale_shape(shape))

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        """The ``[out, in]`` of a stored quantized weight."""
        return stored[0], stored[1] * 8 // self.bits

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        return None

    def stored_shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a stored weight of this shape is not one of this format (None: it is), before a byte
        of it is read: what the decoder refuses and ``gate checkpoint`` flags."""
        if len(shape) != 2:
            return f"shape {list(shape)} is not a 2-D weight"
        if 0 in shape:
            return f"shape {list(shape)} has no elements (an empty quantized weight has no scale layout)"
        return None

    def scale_problem(self, scales: "np.ndarray") -> str | None:
        """Why these scales (their raw bytes, ``[scale rows, bytes]`` uint8) are not valid ones."""
        return None

    def code_problem(self, weight: "np.ndarray", row0: int = 0) -> str | None:
        """Why these stored rows (uint8 ``[rows, stored bytes]``, the first one ``row0``) hold a code
        the format forbids (NaN)."""
        return None

    def may_overflow(self, scales: "np.ndarray") -> bool:
        """Whether some value under these (valid) scales may decode past bf16's largest finite value:
        only then is the decoded output searched for Inf (a pass over it costs ~15% of a decode)."""
        return True

    def quantize(self, x: "torch.Tensor", rule: ScaleRule = ScaleRule.EVEN) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(weight as stored, scales)`` of a ``[rows, in]`` float tensor (the torch reference)."""
        raise NotImplementedError

    def decode(self, weight: "torch.Tensor", scales: "torch.Tensor", dtype=None) -> "torch.Tensor":
        """Exact values of a stored weight, ``[rows, in]`` in ``dtype`` (bf16 by default)."""
        raise NotImplementedError

    def quantize_dequantize(self, x: "torch.Tensor", rule: ScaleRule = ScaleRule.EVEN) -> "torch.Tensor":
        raise NotImplementedError

    def decode_bytes(self, weight: "np.ndarray", scales: "np.ndarray", threads: int | None = None) -> "np.ndarray":
        """The executor's decode, bytes in, bytes out: bf16 bytes ``[rows, in * 2]`` of stored rows
        ``weight`` (uint8 ``[rows, stored bytes]``) whose scale rows are ``scales`` (their raw bytes).
        ``threads``: how many cores a CPU kernel may use (None: all); the torch path ignores it."""
        import torch

        from quant.safetensors_io import torch_dtype

        w = torch.frombuffer(bytearray(weight), dtype=torch.uint8).reshape(weight.shape)
        s = torch.frombuffer(bytearray(scales), dtype=torch_dtype(self.scale_dtype)).reshape(scales.shape[0], -1)
        return self.decode(w, s).view(torch.uint8).numpy()

    def quantization_config(self, exclude: list[str], rule: ScaleRule, weight_only: bool) -> dict:
        raise NotImplementedError

    def matches_config(self, qconfig: dict) -> bool:
        raise NotImplementedError

    def encode(self, raw: "np.ndarray", dtype: str, rule: ScaleRule = ScaleRule.EVEN, *, device: str = "cpu",
               row0: int = 0, threads: int | None = None) -> Encoded:
        """Rows of one weight given as raw bytes ``[rows, in * itemsize]`` of safetensors ``dtype``
        (read-only views of a mapped file are fine); ``row0`` is the first row's index in the
        weight, for messages and the error sample; ``threads`` as in ``decode_bytes``."""
        import torch

        from quant.safetensors_io import torch_dtype

        x = torch.frombuffer(bytearray(raw), dtype=torch_dtype(dtype)).reshape(raw.shape[0], -1).to(device)
        if not torch.isfinite(x).all():
            raise _non_finite(x.cpu(), row0)
        weight, scales = self.quantize(x, rule)
        xf = x.to(torch.float32)
        err = float(((self.decode(weight, scales, torch.float32) - xf) ** 2).sum())
        return Encoded(weight.cpu().numpy(), scales.cpu().numpy(), err, float((xf * xf).sum()))


class MXCodec(Codec):
    """Quark 0.13's MX formats: U8 codes (packed), one E8M0 byte per 32 values (``mx``)."""

    family = "mx"
    default_recipe = "mxfp4-w4a4-experts"
    weight_dtype = scale_dtype = "U8"
    scale_suffix = "_scale"
    row_multiple = 1

    def __init__(self, name: str, element: ElementFormat, warning: str | None = None):
        self.name, self.element, self.bits, self.warning = name, element, element.bits, warning

    def scale_shape(self, shape):
        return shape[0], shape[1] // BLOCK

    def shape_problem(self, shape):
        if shape[1] % BLOCK:
            return f"input dim {shape[1]} is not divisible by the {self.name} block ({BLOCK})"
        return None

    def stored_shape_problem(self, shape):
        if problem := super().stored_shape_problem(shape):
            return problem
        if shape[1] * 8 % self.bits:
            return (f"{shape[1]} bytes a row is not a whole number of {self.bits}-bit {self.name} codes "
                    f"({self.bits} bits: a row's bytes divide by {self.bits // math.gcd(self.bits, 8)})")
        if (values := self.logical_shape(shape)[1]) % BLOCK:
            return (f"{values} values a row is not a whole number of {BLOCK}-value blocks: the last block is partial, "
                    "which neither Quark nor the engines write")
        return None

    def scale_problem(self, scales):
        import numpy as np

        bad = np.flatnonzero(scales.reshape(-1) == 0xFF)
        if bad.size:
            row, block = divmod(int(bad[0]), scales.shape[1])
            return (f"scale byte 0xFF (E8M0 NaN) at row {row}, block {block} ({bad.size} such), which would decode "
                    "to NaN")
        return None

    def may_overflow(self, scales):
        # The largest element is below 2^(emax + 1), so 2^(byte - 127) times it stays below 2^128
        # (bf16's largest finite value rounds from just below it) while byte <= 254 - emax.
        return scales.size > 0 and int(scales.max()) > 254 - self.element.emax

    def quantize(self, x, rule=ScaleRule.EVEN):
        from quant.formats import mx

        return mx.quantize(x, self.element, rule)

    def decode(self, weight, scales, dtype=None):
        import torch

        from quant.formats import mx

        return mx.dequantize(weight, scales, self.element, dtype or torch.bfloat16)

    def quantize_dequantize(self, x, rule=ScaleRule.EVEN):
        """Blocks of 32 along the last dimension with Quark's dynamic exponents (``mx.quantize_dequantize``)."""
        from quant.formats import mx

        return mx.quantize_dequantize(x, self.element, rule)

    def decode_bytes(self, weight, scales, threads=None):
        if self.element == E2M1:  # a table lookup in numba: the same values as the reference decode
            from quant.formats import mxfp4_fast

            return mxfp4_fast.decode_bf16(weight, scales, threads).view("uint8")
        return super().decode_bytes(weight, scales)

    def encode(self, raw, dtype, rule=ScaleRule.EVEN, *, device="cpu", row0=0, threads=None):
        if self.element == E2M1 and dtype == "BF16" and rule is ScaleRule.EVEN and device == "cpu":
            return self._encode_fast(raw, row0, threads)
        return super().encode(raw, dtype, rule, device=device, row0=row0)

    def _encode_fast(self, raw, row0, threads):
        from quant.formats import mxfp4_fast

        packed, scales, flags, err, ref = mxfp4_fast.quantize_bf16(raw, ERROR_ROW_STRIDE, row0, threads)
        if flags.any():  # rare: only now load torch and the reference
            import numpy as np
            import torch

            from quant.formats import mxfp4

            x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(raw.shape[0], -1)
            if (flags == mxfp4_fast.ROW_NON_FINITE).any():
                raise _non_finite(x, row0)
            redo = np.flatnonzero(flags == mxfp4_fast.ROW_NEEDS_REFERENCE)  # tiny blocks: the reference is exact
            p, s = mxfp4.quantize(x[torch.from_numpy(redo)])
            packed[redo], scales[redo] = p.numpy(), s.numpy()
        return Encoded(packed, scales, float(err.sum()), float(ref.sum()))

    def quantization_config(self, exclude, rule, weight_only):
        return quantization_config(exclude, rule, weight_only, self.element.name)

    def matches_config(self, qconfig):
        weight = (qconfig.get("global_quant_config") or {}).get("weight") or {}
        return config_kind(qconfig) == "quark" and weight.get("dtype") == self.element.name


class BlockFP8Codec(Codec):
    """DeepSeek-V3-style block FP8: e4m3 weights, a float32 ``scale_inv`` per 128x128 tile (``fp8``)."""

    name = "fp8"
    family = "fp8"
    default_recipe = "fp8-block"
    weight_dtype = "F8_E4M3"
    scale_suffix = "_scale_inv"
    scale_dtype = "F32"
    row_multiple = FP8_TILE
    bits = 8

    def scale_shape(self, shape):
        return -(-shape[0] // FP8_TILE), -(-shape[1] // FP8_TILE)

    def scale_problem(self, scales):
        import numpy as np

        values = np.ascontiguousarray(scales).view("<f4").reshape(scales.shape[0], -1)
        bad = np.flatnonzero(~np.isfinite(values) | np.signbit(values))
        if bad.size:
            row, col = divmod(int(bad[0]), values.shape[1])
            return (f"scale_inv {values[row, col]} at tile ({row}, {col}) ({bad.size} such): a NaN, Inf or negative "
                    "scale would decode to NaN, Inf or sign-flipped weights")
        return None

    def may_overflow(self, scales):
        import numpy as np

        values = np.ascontiguousarray(scales).view("<f4")  # valid scales: finite and non-negative
        return values.size > 0 and float(values.max()) * E4M3_MAX >= 3.0e38  # bf16's largest: 3.39e38

    def code_problem(self, weight, row0=0):
        import numpy as np

        bad = np.flatnonzero((weight.reshape(-1) & 0x7F) == 0x7F)  # e4m3fn's NaN: exponent and mantissa all ones
        if bad.size:
            row, col = divmod(int(bad[0]), weight.shape[1])
            return f"e4m3 NaN code 0x{int(weight[row, col]):02X} at row {row0 + row}, column {col} ({bad.size} such)"
        return None

    def quantize(self, x, rule=ScaleRule.EVEN):
        import torch

        from quant.formats import fp8

        q, scale_inv = fp8.quantize(x)
        return q.view(torch.uint8), scale_inv

    def decode(self, weight, scales, dtype=None):
        import torch

        from quant.formats import fp8

        return fp8.dequantize(weight.view(torch.float8_e4m3fn), scales, dtype or torch.bfloat16)

    def decode_bytes(self, weight, scales, threads=None):
        """A numba kernel, the same bytes as the reference decode (``fp8_fast``)."""
        from quant.formats import fp8_fast

        return fp8_fast.decode_bf16(weight, scales, threads).view("uint8")

    def encode(self, raw, dtype, rule=ScaleRule.EVEN, *, device="cpu", row0=0, threads=None):
        """bf16 on the CPU runs the numba kernel (``fp8_fast``: the reference's bytes, no torch); a
        tile with NaN/Inf goes to the reference, which refuses it with its row and column."""
        if dtype == "BF16" and device == "cpu":
            from quant.formats import fp8_fast

            codes, scale_inv, flags, err, ref = fp8_fast.quantize_bf16(raw, ERROR_ROW_STRIDE, row0, threads)
            if not flags.any():
                return Encoded(codes, scale_inv, float(err.sum()), float(ref.sum()))
        return super().encode(raw, dtype, rule, device=device, row0=row0)

    def quantize_dequantize(self, x, rule=ScaleRule.EVEN):
        """Groups of 128 along the last dimension, vLLM's dynamic per-token-group FP8 (``fp8.quantize_dequantize``)."""
        from quant.formats import fp8

        return fp8.quantize_dequantize(x)

    def quantization_config(self, exclude, rule, weight_only):
        return fp8_config(exclude)

    def matches_config(self, qconfig):
        return config_kind(qconfig) == "fp8"


class TensorFP8Codec(Codec):
    """Per-tensor FP8 (the W8A8 rung of a mixed Quark checkpoint, never a whole-model ``--to``): e4m3 weights and
    ONE bf16 ``weight_scale`` of shape ``[]`` for the whole tensor, Quark 0.13's ``FP8E4M3PerTensorSpec``
    bytes (``fp8_tensor``). A weight's chunks share its scale: the caller takes ``amax`` over every row first
    (``amax``), then passes ``scale_of(amax)`` to each ``encode``."""

    name = "fp8_tensor"
    family = "fp8-tensor"
    default_recipe = ""
    weight_dtype = "F8_E4M3"
    scale_suffix = "_scale"
    scale_dtype = "BF16"
    row_multiple = 1
    bits = 8

    def scale_shape(self, shape):
        return ()

    code_problem = BlockFP8Codec.code_problem

    @staticmethod
    def _scale_value(scales) -> float:
        """The one bf16 scale whose raw bytes ``scales`` holds."""
        import numpy as np
        import torch

        return float(torch.frombuffer(bytearray(np.ascontiguousarray(scales).tobytes()), dtype=torch.bfloat16)[0])

    def scale_problem(self, scales):
        value = self._scale_value(scales)
        if not math.isfinite(value) or value <= 0:
            return f"weight_scale {value}: a NaN, Inf, zero or negative scale would decode to NaN, Inf or zeros"
        return None

    def amax(self, raw, dtype, *, row0=0, threads=None) -> float:
        """The largest magnitude of rows given as raw bytes; refuses NaN/Inf naming the row and column."""
        from quant.formats import fp8_tensor

        if dtype == "BF16":
            return fp8_tensor.amax_bf16(raw, row0, threads)
        return float(self._rows(raw, dtype, row0).abs().amax()) if raw.size else 0.0

    def scale_of(self, amax: float) -> float:
        """The weight's scale (a bf16 value) from its ``amax``."""
        from quant.formats import fp8_tensor

        return float(fp8_tensor.scale_of(amax))

    def quantize(self, x, rule=ScaleRule.EVEN):
        """The whole tensor: ``(codes as uint8, its 0-d bf16 scale)``."""
        import torch

        from quant.formats import fp8_tensor

        scale = fp8_tensor.weight_scale(x)
        return fp8_tensor.quantize(x, scale).view(torch.uint8), scale

    def decode(self, weight, scales, dtype=None):
        import torch

        from quant.formats import fp8_tensor

        return fp8_tensor.dequantize(weight, scales.reshape(-1)[0], dtype or torch.bfloat16)

    def decode_bytes(self, weight, scales, threads=None):
        """``fp8_fast``'s numba decode with the one scale in every tile: the same bytes as ``decode``."""
        import numpy as np

        from quant.formats import fp8_fast

        scale = self._scale_value(scales)
        tiles = np.full((-(-weight.shape[0] // FP8_TILE), -(-weight.shape[1] // FP8_TILE)), scale, dtype=np.float32)
        return fp8_fast.decode_bf16(weight, tiles, threads).view("uint8")

    def quantize_dequantize(self, x, rule=ScaleRule.EVEN):
        """What a weight becomes at this rung, its own per-tensor scale (``fp8_tensor.quantize_dequantize``)."""
        from quant.formats import fp8_tensor

        return fp8_tensor.quantize_dequantize(x)

    def encode(self, raw, dtype, rule=ScaleRule.EVEN, *, device="cpu", row0=0, threads=None, scale=None):
        """Rows of one weight under the whole weight's ``scale`` (required). ``Encoded.scales`` holds the
        scale's two bf16 bytes for the chunk at ``row0 == 0`` and nothing for the others, so concatenating
        the chunks' scales gives the ``[]`` tensor's bytes."""
        import numpy as np
        import torch

        from quant.formats import fp8_tensor

        if scale is None:
            raise ValueError("per-tensor FP8 encodes with the whole weight's scale: pass scale=scale_of(amax)")
        stored = torch.tensor(scale, dtype=torch.bfloat16).reshape(1)  # the value as stored is the one used
        scale = float(stored)
        scales = stored.view(torch.uint8).numpy() if row0 == 0 else np.empty(0, dtype=np.uint8)
        if dtype == "BF16" and device == "cpu":
            codes, flags, err, ref = fp8_tensor.encode_bf16(raw, scale, ERROR_ROW_STRIDE, row0, threads)
            if not flags.any():
                return Encoded(codes, scales, float(err.sum()), float(ref.sum()))
            self._rows(raw, dtype, row0)  # refuses the NaN/Inf with its row and column
        x = self._rows(raw, dtype, row0).to(device)
        codes = fp8_tensor.quantize(x, scale).view(torch.uint8)
        xf = x.to(torch.float32)
        err = float(((fp8_tensor.dequantize(codes, scale, torch.float32) - xf) ** 2).sum())
        return Encoded(codes.cpu().numpy(), scales, err, float((xf * xf).sum()))

    @staticmethod
    def _rows(raw, dtype, row0):
        import torch

        from quant.safetensors_io import torch_dtype

        x = torch.frombuffer(bytearray(raw), dtype=torch_dtype(dtype)).reshape(raw.shape[0], -1)
        if not torch.isfinite(x).all():
            raise _non_finite(x, row0)
        return x


class ThirdPartyCodec(Codec):
    """A checkpoint another tool wrote (compressed-tensors, ModelOpt), which quantgate decodes (``--to bf16``)
    and never writes: each module by its own scheme (``TensorPlan.scheme``, ``quant.formats.third_party_decode``)."""

    family = "third-party"
    row_multiple = 1

    def __init__(self, name: str):
        self.name = name


_MXFP6_WARNING = ("vLLM loads MXFP6 (emulated); sglang's Quark loader accepts only fp4 today and will refuse "
                  "this checkpoint")
CODECS: dict[str, Codec] = {c.name: c for c in (
    MXCodec("mxfp4", E2M1),
    MXCodec("mxfp6_e2m3", E2M3, _MXFP6_WARNING),
    MXCodec("mxfp6_e3m2", E3M2, _MXFP6_WARNING),
    BlockFP8Codec(),
)}


DECODED_ONLY: dict[str, Codec] = {c.name: c for c in (ThirdPartyCodec("compressed-tensors"),
                                                       ThirdPartyCodec("modelopt"))}


# A rung's weight codec that is no whole-model format (no --to name): a mixed recipe's modules use it.
RUNG_CODECS: dict[str, Codec] = {c.name: c for c in (TensorFP8Codec(),)}


def get_codec(name: str) -> Codec:
    try:
        return CODECS.get(name) or RUNG_CODECS.get(name) or DECODED_ONLY[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(CODECS)}") from None


def codec_for_config(config: dict) -> Codec:
    """The codec a checkpoint's ``config.json`` declares; ValueError says why there is none."""
    qconfig = config.get("quantization_config") or {}
    found = next((c for c in CODECS.values() if c.matches_config(qconfig)), None)
    if found:
        return found
    if config_kind(qconfig) == "quark":
        dtype = ((qconfig.get("global_quant_config") or {}).get("weight") or {}).get("dtype")
        raise ValueError(f"Quark weight dtype {dtype!r} is not one quantgate decodes (fp4, fp6_e2m3, fp6_e3m2)")
    raise ValueError(f"not a quantized checkpoint quantgate decodes (quant_method {qconfig.get('quant_method')!r}); "
                     "nothing to dequantize")
