"""The precision ladder's rungs: the per-layer schemes a mixed Quark checkpoint gives its Linears.

Cheapest first: ``mxfp4`` (W4A4: MXFP4 weights, activations MXFP4 quantized at run time), ``mxfp4_fp8``
(W4A8: the same MXFP4 weights, activations FP8 e4m3 with one static per-tensor scale), ``fp8`` (W8A8: FP8
e4m3 weights with one per-tensor scale, activations FP8 with a static per-tensor scale) and ``bf16`` (kept:
the module is in the exclude list). Each quantized rung is a Quark 0.13 ``layer_quant_config`` value
(``spec``); a static activation scale is ``amax / FP8_MAX`` measured on calibration data
(``quant.sensitivity``), the scale the engines divide activations by.

Stored tensors per module, what Quark 0.13's ``export_safetensors`` writes for a bf16 model (its
``mxfp4_fp8`` and ``fp8`` templates; tests/quant/test_fp8_tensor.py runs Quark and compares):
``mxfp4``: ``weight`` U8 ``[out, in/2]``, ``weight_scale`` U8 ``[out, in/32]``; ``mxfp4_fp8``: those and
``input_scale`` BF16 ``[]``; ``fp8``: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` BF16 ``[]``,
``input_scale`` BF16 ``[]``. The scalars are in the model's dtype, not float32: the engines copy them into
their float32 parameters, so a float32 (or ``[1]``) scalar loads too and is read as the same rung.

The specs are Quark 0.13's own templates as it exports them (``LLMTemplate`` ``mxfp4_fp8``: its input
``scale_type`` is null; ``fp8``: ``scale_type`` "float"); MX weight specs are ``quark_config.mx_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass

from quant.formats.constants import ScaleRule
from quant.quark_config import mx_spec

FP8_MAX = 448.0  # e4m3's largest finite value: a static scale maps the calibrated amax onto it
INPUT_SCALE = ".input_scale"  # a static activation scale: "<module>.input_scale", BF16 shape [] as Quark writes it
SCALAR_DTYPES = ("BF16", "F16", "F32")  # what a stored per-tensor scale may be: the engines cast it to float32
SCALAR_DTYPE = "BF16"  # how quantgate writes weight_scale (fp8) and input_scale: as Quark does for a bf16 model
SCALAR_SHAPE: tuple[int, ...] = ()  # the stored shape of a per-tensor scale (weight_scale, input_scale)


@dataclass(frozen=True)
class Rung:
    name: str  # what a recipe's ``format`` and the ladder call it
    label: str  # W4A4, W4A8, W8A8, W16A16
    weight: str | None  # the codec (quant.formats.codecs) its weights are stored in; None: bf16
    activations: str | None  # "mxfp4" (dynamic MX blocks), "fp8" (static per-tensor scale) or None
    bits: int  # stored bits per weight element, scales left out

    @property
    def static_input_scale(self) -> bool:
        """Whether the module stores ``<module>.input_scale`` (measured on calibration data)."""
        return self.activations == "fp8"

    def spec(self, scale_rule: ScaleRule = ScaleRule.EVEN) -> dict | None:
        """The Quark ``layer_quant_config`` value (None for bf16: kept modules go in ``exclude``)."""
        if self.weight is None:
            return None
        if self.weight == "fp8_tensor":  # Quark's "fp8" template: one spec for weight and input
            weight, inputs = fp8_tensor_spec(scale_type="float"), fp8_tensor_spec(scale_type="float")
        else:
            weight = mx_spec("fp4", scale_rule, is_dynamic=False)
            inputs = fp8_tensor_spec() if self.activations == "fp8" else mx_spec("fp4", ScaleRule.EVEN, is_dynamic=True)
        return {"input_tensors": inputs, "output_tensors": None, "weight": weight, "bias": None,
                "target_device": None}


def fp8_tensor_spec(scale_type: str | None = None) -> dict:
    """Quark 0.13's ``FP8E4M3PerTensorSpec(observer_method="min_max", scale_type=..., is_dynamic=False)`` as it
    exports it (``scale_type`` null in the ``mxfp4_fp8`` template, "float" in ``fp8``)."""
    return {"dtype": "fp8_e4m3", "is_dynamic": False, "qscheme": "per_tensor", "ch_axis": None, "group_size": None,
            "block_size": None, "symmetric": True, "round_method": "half_even", "scale_type": scale_type,
            "zero_point_type": "int32", "scale_format": None, "scale_calculation_mode": None,
            "mx_element_dtype": None, "observer_cls": "PerTensorMinMaxObserver", "is_scale_quant": False,
            "enable_buffer_reuse": False, "max_input_numel": 4194304}


RUNGS = {r.name: r for r in (
    Rung("mxfp4", "W4A4", "mxfp4", "mxfp4", 4),
    Rung("mxfp4_fp8", "W4A8", "mxfp4", "fp8", 4),
    Rung("fp8", "W8A8", "fp8_tensor", "fp8", 8),
    Rung("bf16", "W16A16", None, None, 16),
)}
LADDER = tuple(RUNGS)  # cheapest first: the ladder lifts a layer one rung at a time


def rung_of_spec(spec) -> str | None:
    """The rung a Quark layer spec is (its weight and input_tensors dtype/qscheme/dynamic), None if none."""
    if not isinstance(spec, dict):
        return None
    for rung in RUNGS.values():
        ours = rung.spec()
        if ours and all(_same(spec.get(part), ours[part]) for part in ("weight", "input_tensors")):
            return rung.name
    return None


def _same(theirs, ours: dict) -> bool:
    return isinstance(theirs, dict) and all(theirs.get(k) == ours[k] for k in ("dtype", "qscheme", "is_dynamic"))


def stored_rung(tensors: dict, module: str) -> str:
    """The rung a module's tensors show (``tensors``: name -> TensorInfo with ``dtype``): ``mxfp4`` (U8 weight
    and U8 ``weight_scale``), ``mxfp4_fp8`` (those and a float ``input_scale``), ``fp8`` (F8_E4M3 weight, float
    scalar ``weight_scale`` and ``input_scale``), ``bf16`` (a float weight); "" for anything else."""
    weight, scale = tensors.get(module + ".weight"), tensors.get(module + ".weight_scale")
    input_scale = tensors.get(module + INPUT_SCALE)
    has_input_scale = input_scale is not None and input_scale.dtype in SCALAR_DTYPES
    if weight is None:
        return ""
    if weight.dtype == "U8" and scale is not None and scale.dtype == "U8":
        return "mxfp4_fp8" if has_input_scale else "mxfp4"
    if weight.dtype == "F8_E4M3" and scale is not None and scale.dtype in SCALAR_DTYPES and has_input_scale:
        return "fp8"
    if weight.dtype in ("BF16", "F16", "F32") and scale is None:
        return "bf16"
    return ""
