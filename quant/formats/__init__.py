"""Numeric formats: pure encode/decode functions, one module per format, and this registry.

A ``WeightFormat`` says what a quantized Linear weight becomes on disk (the weight and its scale
tensor: names, dtypes, shapes), what input shapes it accepts, and how to encode/decode rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.formats import fp8, mx
from quant.formats.mx import BLOCK, ScaleRule


@dataclass(frozen=True)
class WeightFormat:
    name: str  # what --to and recipes call it
    weight_dtype: str  # safetensors dtype of the stored weight
    scale_suffix: str  # the scale tensor is "<module>.weight" + this
    scale_dtype: str
    row_multiple: int  # chunks of rows must be multiples of this (FP8 tiles are 128 rows)
    element: mx.ElementFormat | None = None  # MX formats

    def outputs(self, name: str, shape: tuple[int, int]) -> tuple[tuple, tuple]:
        weight, scale = fp8.packed_shapes(shape) if self.element is None else mx.packed_shapes(shape, self.element)
        return (name, self.weight_dtype, weight), (name + self.scale_suffix, self.scale_dtype, scale)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        if self.element is not None and shape[1] % BLOCK:
            return f"input dim {shape[1]} is not divisible by the {self.name} block ({BLOCK})"
        return None

    def quantize(self, x: torch.Tensor, rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
        if self.element is None:
            q, scale = fp8.quantize(x)
            return q.view(torch.uint8), scale
        return mx.quantize(x, self.element, rule)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        if self.element is None:
            return fp8.dequantize(weight.view(torch.float8_e4m3fn), scale, dtype)
        return mx.dequantize(weight, scale, self.element, dtype)


FORMATS = {name: WeightFormat(name, "U8", "_scale", "U8", 1, element) for name, element in mx.FORMATS.items()}
FORMATS["fp8"] = WeightFormat("fp8", "F8_E4M3", "_scale_inv", "F32", fp8.TILE)


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {sorted(FORMATS)}") from None


def format_of_quark_dtype(dtype: str) -> WeightFormat | None:
    """The MX format of a Quark config's weight dtype (fp4, fp6_e2m3, fp6_e3m2)."""
    return next((f for f in FORMATS.values() if f.element is not None and f.element.name == dtype), None)


def checkpoint_format(config: dict) -> WeightFormat:
    """The quantized format a config declares (Quark MXFP4/MXFP6 or DeepSeek-style block FP8)."""
    qconfig = config.get("quantization_config") or {}
    if qconfig.get("quant_method") == "fp8":
        return weight_format("fp8")
    if qconfig.get("quant_method") == "quark":
        dtype = ((qconfig.get("global_quant_config") or {}).get("weight") or {}).get("dtype")
        fmt = format_of_quark_dtype(dtype)
        if fmt:
            return fmt
        raise ValueError(f"Quark weight dtype {dtype!r} is not one quantgate decodes (fp4, fp6_e2m3, fp6_e3m2)")
    raise ValueError(f"not a quantized checkpoint quantgate decodes (quant_method {qconfig.get('quant_method')!r}); "
                    "nothing to dequantize")


def logical_shape(fmt: WeightFormat, stored: tuple[int, ...]) -> tuple[int, int]:
    """The ``[out, in]`` of a stored quantized weight."""
    bits = fmt.element.bits if fmt.element else 8
    return stored[0], stored[1] * 8 // bits
