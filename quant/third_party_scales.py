"""The scale values of compressed-tensors and ModelOpt checkpoints, as the engines use them
(``gate checkpoint --deep``; docs/reference.md §2b).

Both producers write every scale finite and positive, so a zero, negative, NaN or Inf scale was
never theirs (a checkpoint edited, merged or cut short since): compressed-tensors 0.20.1
(``quantization/utils/helpers.py``: ``calculate_qparams`` replaces a zero scale by its dtype's eps,
``generate_gparam`` a NaN/Inf global scale by 1.0) and ModelOpt 0.47.0
(``torch/quantization/qtensor/nvfp4_tensor.py``: ``get_weights_scaling_factor`` sets a zero block
scale to 1.0 and clamps it to [2^-9, 448], ``get_activation_scaling_factor`` asserts a positive input
scale and exports none for an input never calibrated). The engines take each scale as it is, unchecked:
they invert the global and input scales (``SCALE_USES``: a zero one is an infinite scale) and multiply
the others in.

A scheme with a static activation scale (``quant.third_party.Scheme.input_scale``) needs it for every
module and expert: the engines never write a missing one and invert what its slot held
(``MISSING``). Every mechanism cites the function of the releases read (``Cite``; the tests find each
quoted expression in those releases' wheels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from quant.engines import Finding
from quant.formats.third_party_decode import as_float, stored
from quant.safetensors_io import DTYPE_BYTES, TensorInfo
from quant.third_party import OnDisk

VLLM_Q = "vllm/model_executor/layers/quantization"
SGLANG_Q = "sglang/srt/layers/quantization"
VLLM_CT_LINEAR = f"{VLLM_Q}/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py"
VLLM_CT_MOE = f"{VLLM_Q}/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py"
VLLM_MODELOPT = f"{VLLM_Q}/modelopt.py"
VLLM_NVFP4_MOE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
SGLANG_CT_MOE = f"{SGLANG_Q}/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4_moe.py"
SGLANG_MODELOPT = f"{SGLANG_Q}/modelopt_quant.py"
SHOWN = 4  # modules named in one finding


@dataclass(frozen=True)
class Cite:
    """``code`` (as ``ast.unparse`` writes it) in ``function`` of ``path``, in every release ``first``..``last``."""
    engine: str
    first: str
    last: str
    path: str
    function: str  # "Class.method" or "function"
    code: str

    def __str__(self) -> str:
        span = self.first if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.engine} {span} {self.path.rpartition('/')[2]}: {self.function}, {self.code}"


@dataclass(frozen=True)
class ScaleUse:
    what: str  # the scale in a finding's words
    effect: str  # what a bad value does in the engines
    cites: tuple[Cite, ...] = ()

    def told(self) -> str:
        return self.effect + (f" ({'; '.join(map(str, self.cites))})" if self.cites else "")


_INVERTED = "the engines invert it unchecked: a zero one is an infinite {0}, NaN for every token through the module"
SCALE_USES: dict[str, ScaleUse] = {
    "weight_global_scale": ScaleUse(
        "compressed-tensors NVFP4's global weight scale (stored as a divisor)", _INVERTED.format("weight scale"), (
            Cite("vllm", "0.16.0", "0.34.0", VLLM_CT_LINEAR, "CompressedTensorsW4A4Fp4.process_weights_after_loading",
                 "1.0 / weight_global_scale"),
            Cite("sglang", "0.5.9", "0.5.23", SGLANG_CT_MOE,
                 "CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading", "1 / layer.w13_weight_global_scale"))),
    "input_global_scale": ScaleUse(
        "compressed-tensors NVFP4's static activation global scale", _INVERTED.format("activation scale"), (
            Cite("vllm", "0.16.0", "0.34.0", VLLM_CT_LINEAR, "CompressedTensorsW4A4Fp4.process_weights_after_loading",
                 "1.0 / input_global_scale_inv"),
            Cite("vllm", "0.20.0", "0.34.0", VLLM_CT_MOE,
                 "CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading",
                 "1.0 / layer.w13_input_global_scale"),
            Cite("sglang", "0.5.9", "0.5.23", SGLANG_CT_MOE,
                 "CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading", "1 / w13_input_global_scale"))),
    "weight_scale_2": ScaleUse(
        "ModelOpt NVFP4's global weight scale", "the engines multiply it into the GEMM's alpha unchecked: a zero one "
        "zeroes the module's output, a NaN/Inf one poisons it", (
            Cite("sglang", "0.5.9", "0.5.23", SGLANG_MODELOPT,
                 "ModelOptNvFp4FusedMoEMethod.process_weights_after_loading",
                 "w2_input_scale * layer.w2_weight_scale_2"),
        )),
    "input_scale": ScaleUse(
        "the static activation scale (ModelOpt NVFP4 / FP8, compressed-tensors static FP8 / INT8)",
        _INVERTED.format("activation global scale") + " or expert", (
            Cite("vllm", "0.16.0", "0.34.0", VLLM_NVFP4_MOE, "make_nvfp4_moe_quant_config", "1.0 / a13_scale"),
            Cite("sglang", "0.5.9", "0.5.23", SGLANG_MODELOPT,
                 "ModelOptNvFp4FusedMoEMethod.process_weights_after_loading", "1 / w13_input_scale"))),
    "weight_scale": ScaleUse(
        "the weight's block, group, channel or tensor scale", "the engines multiply the weight by it: a zero one "
        "zeroes those weights, a NaN/Inf one poisons every output it reaches"),
}

# A static activation scale missing from disk: what the engines' slot for it then holds.
MISSING: dict[str, ScaleUse] = {
    "input_scale": ScaleUse(
        "input_scale", "the engines never write a missing one and invert what its slot holds: vLLM and sglang up to "
        "0.5.17 allocate the expert slots uninitialised (zero in the public reports: an infinite activation global "
        "scale, NaN for every token routed to the expert), sglang 0.5.18+ fill them with 1.0 (a finite scale that "
        "is not the expert's calibration)", (
            Cite("vllm", "0.16.0", "0.34.0", VLLM_MODELOPT, "ModelOptNvFp4FusedMoE.create_weights",
                 "torch.empty(global_sf_num_experts, w13_num_shards"),
            Cite("sglang", "0.5.9", "0.5.16", SGLANG_MODELOPT, "ModelOptNvFp4FusedMoEMethod.create_weights",
                 "torch.empty(w13_input_scale_shape"),
            Cite("sglang", "0.5.17", "0.5.17", SGLANG_MODELOPT, "ModelOptNvFp4FusedMoEMethod.create_weights",
                 "input_scale_fill = 1.0 if is_nvfp4_online else None"),
            Cite("sglang", "0.5.18", "0.5.23", SGLANG_MODELOPT, "ModelOptNvFp4FusedMoEMethod.create_weights",
                 "input_scale_fill = 1.0 if not is_nvfp4_online else None"),
            *SCALE_USES["input_scale"].cites)),
    "input_global_scale": ScaleUse(
        "input_global_scale", "the engines never write a missing one and invert what its slot holds: the expert "
        "slots are allocated uninitialised (zero: an infinite activation scale, NaN for every token routed to the "
        "expert)", (
            Cite("vllm", "0.20.0", "0.34.0", VLLM_CT_MOE, "CompressedTensorsW4A4Nvfp4MoEMethod.create_weights",
                 "torch.empty(num_experts, w13_num_shards"),
            Cite("sglang", "0.5.9", "0.5.23", SGLANG_CT_MOE, "CompressedTensorsW4A4Nvfp4MoE.create_weights",
                 "torch.empty(num_experts, 2"),
            *SCALE_USES["input_global_scale"].cites)),
}

FIX = ("re-export the checkpoint (llm-compressor and ModelOpt write every scale finite and positive); "
       "if its publisher shipped it so, report it there")
MISSING_FIX = ("re-export with calibration data that reaches every expert (or a weight-only scheme, whose config "
               "says so); copying another expert's scale only hides the gap")
SCALE_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")  # the float dtypes a scale is stored in (E8M0 aside)
SCALE_CHUNK = 1 << 22  # scale values read at a time (a per-group weight scale is 1/8 of an NVFP4 weight's bytes)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def scale_suffix(name: str) -> str | None:
    """The scale a tensor name stores (a ``SCALE_USES`` key), None for any other tensor."""
    suffix = name.rpartition(".")[2]
    return suffix if suffix in SCALE_USES else None


def scale_findings(info: TensorInfo, read) -> list[Finding]:
    """What one scale tensor's NaN, Inf, negative or zero values do in the engines; ``read(info,
    offset, nbytes)`` gives its bytes, ``SCALE_CHUNK`` values at a time."""
    suffix = scale_suffix(info.name)
    if suffix is None or info.dtype not in SCALE_DTYPES:
        return []  # the layout findings name a scale of the wrong dtype
    item = DTYPE_BYTES[info.dtype]
    elements = info.nbytes // item
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for start in range(0, elements, SCALE_CHUNK):
        count = min(SCALE_CHUNK, elements - start)
        values = as_float(info.dtype, stored(read(info, start * item, count * item), info.dtype, (count,)))
        for kind, bad in (("NaN", np.isnan(values)), ("Inf", np.isinf(values)), ("negative", values < 0),
                          ("zero", values == 0)):
            if (where := np.flatnonzero(bad)).size:
                counts[kind] = counts.get(kind, 0) + int(where.size)
                first.setdefault(kind, start + int(where[0]))
    if not counts:
        return []
    use = SCALE_USES[suffix]
    kind = next(iter(counts))
    at = [int(i) for i in np.unravel_index(first[kind], info.shape)] if info.shape else []
    found = ", ".join(f"{n} {k}" for k, n in counts.items())
    return [Finding("values", None, info.name, f"{use.what}: {found} of {elements} value(s), the first {kind} at "
                    f"{at}; {use.told()}", FIX)]


def missing_scale_findings(tensors: dict[str, TensorInfo], modules: dict[str, OnDisk]) -> list[Finding]:
    """Modules (``read_modules``' first result) whose scheme has a static activation scale but whose checkpoint
    holds none: one finding per scale and layer's experts (``...mlp.experts``, naming the experts) or other module."""
    lacking: dict[tuple[str, str], list[str]] = {}
    for module, disk in sorted(modules.items()):
        suffix = disk.scheme.input_scale if disk.scheme else None
        if suffix and f"{module}.{suffix}" not in tensors:
            m = _EXPERT.search(module + ".")
            group = module[:m.start()] + ".experts" if m else module
            lacking.setdefault((group, suffix), []).append(module)
    findings = []
    for (group, suffix), missing in lacking.items():
        label = modules[missing[0]].label
        shown = ", ".join(f"{m}.{suffix}" for m in missing[:SHOWN]) + (" ..." if len(missing) > SHOWN else "")
        findings.append(Finding("values", None, group, f"{len(missing)} {label} module(s) whose scheme has a static "
                                f"activation scale store no {suffix} ({shown}): {MISSING[suffix].told()}",
                                MISSING_FIX))
    return findings
