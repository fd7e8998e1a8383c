"""How each module of a per-layer (mixed) Quark checkpoint is served: its rung, read from its own tensors
(``quant.rungs.stored_rung``), and the static scales the engines really use after loading it.

The engines collapse stored per-module scales when they build fused modules, and emulation applies the
collapsed value (read in vLLM 0.33.0 and sglang 0.5.23; tests/evals/test_mixed_emulation.py runs them):
- a static FP8 activation scale of a fused Linear (``built_fused``: gate_up_proj, fused_qkv_a_proj, qkv_proj)
  is the largest of its shards': vLLM quark/schemes/quark_w8a8_fp8.py QuarkW8A8Fp8.process_weights_after_loading
  and quark/schemes/quark_w4a8_mxfp4_fp8.py QuarkW4A8_MXFP4_FP8.process_weights_after_loading
  (``input_scale.max()``); sglang quark/schemes/quark_w8a8_fp8.py QuarkW8A8Fp8.process_weights_after_loading;
- a layer's routed experts run one activation scale for the gate/up input (w13) and one for the down input
  (w2), the largest over the layer's experts: vLLM quark/quark_moe.py QuarkW8A8Fp8MoEMethod
  .process_weights_after_loading (FP8) and fused_moe/oracle/mxfp4.py
  convert_gpt_oss_weight_to_mxfp4_moe_kernel_format (W4A8 ``w_mxfp4_a_fp8``); sglang
  quark/schemes/quark_w8a8_fp8_moe.py QuarkW8A8FP8MoE and quark_w4a8_mxfp4_moe.py QuarkW4A8MXFp4MoE
  .process_weights_after_loading (``w13_input_scale.max()``, ``w2_input_scale.max()``);
- FP8 per-tensor weights of a fused Linear are requantized to the largest shard scale
  (vLLM and sglang w8a8_utils.py requantize_with_max_scale, called by QuarkW8A8Fp8), and an expert's FP8
  gate and up weights to the larger of its two scales (the MoE methods above: ``w13_weight_scale.max(dim=1)``).
"""

from __future__ import annotations

import math

from evals.errors import BadInput
from quant.checkpoint import Checkpoint
from quant.rungs import INPUT_SCALE, RUNGS, SCALAR_DTYPES, stored_rung
from quant.static_scales import scale_group

QUANTIZED_RUNGS = tuple(name for name, rung in RUNGS.items() if rung.weight)
# the releases whose fused modules group the Linears (both build the same ones for the families read)
RULES_OF = ("vllm", "0.33.0")


class MixedRefused(BadInput):
    """A per-layer checkpoint whose tensors do not say how a module is served (exit 2, names the tensor)."""


def module_rungs(tensors: dict) -> dict[str, str]:
    """Checkpoint module -> its quantized rung (mxfp4, mxfp4_fp8, fp8), by its stored tensors; a weight stored
    in no rung's form (an FP8 weight without its input scale, a U8 weight without its scales) is refused."""
    rungs = {}
    for name in sorted(tensors):
        if not name.endswith(".weight"):
            continue
        module = name.removesuffix(".weight")
        rung = stored_rung(tensors, module)
        if rung in QUANTIZED_RUNGS:
            rungs[module] = rung
        elif not rung:
            raise MixedRefused(f"{name} ({tensors[name].dtype}) and its companions match no rung a per-layer Quark "
                               "checkpoint stores (" + ", ".join(f"{n}: {RUNGS[n].label}" for n in QUANTIZED_RUNGS)
                               + "; see quant/rungs.py): reconvert it with quantize")
    return rungs


def _scalars(checkpoint: Checkpoint, names: set[str]) -> dict[str, float]:
    """The one-value float tensors ``names`` (Quark writes them in the model's dtype, bf16; the engines load any
    float into their float32 parameters), read from the shards, each checked finite and positive."""
    from safetensors import safe_open

    tensors, values = checkpoint.tensors(), {}
    for file, header in checkpoint.headers.items():
        wanted = sorted(names & header.tensors.keys())
        if not wanted:
            continue
        with safe_open(str(checkpoint.path(file)), "pt") as handle:
            for name in wanted:
                info = tensors[name]
                if info.dtype not in SCALAR_DTYPES or math.prod(info.shape) != 1:
                    raise MixedRefused(f"{name}: {info.dtype} {list(info.shape)}, but a per-tensor scale is one "
                                       f"{'/'.join(SCALAR_DTYPES)} value: reconvert it with quantize")
                value = float(handle.get_tensor(name).reshape(()))
                if not math.isfinite(value) or value <= 0:
                    raise MixedRefused(f"{name} is {value}, but a scale the engines divide by must be finite and "
                                       "positive: measure it again (quantize --sensitivity / --calibration)")
                values[name] = value
    return values


def _fused_groups(modules, config: dict) -> dict[str, str]:
    """Checkpoint module -> the module it is served in: a routed expert's ``<experts>.*.gate_up`` / ``.down``,
    a fused Linear's shard its fused module (the family's ``built_fused`` in ``RULES_OF``), else itself."""
    from quant.engines.replay import fused_into, shards_of
    from quant.engines.rules import rule_sets
    from quant.layout import UnknownFamilyError, family_for

    try:
        sets = rule_sets(RULES_OF[0], family_for(config))
        fused = shards_of(next(r for r in sets if r.covers(RULES_OF[1]))["built_fused"])
    except (UnknownFamilyError, StopIteration):
        fused = {}
    # a routed expert's projection: its FusedMoE's w13 or w2 scale, as the converter writes it (scale_group)
    return {module: group if (group := scale_group(module)) != module else fused_into(module, fused) or module
            for module in modules}


def _group_max(values: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    """Each module's value replaced by the largest in its group (only modules in ``values`` count)."""
    largest: dict[str, float] = {}
    for module, value in values.items():
        largest[groups[module]] = max(value, largest.get(groups[module], value))
    return {module: largest[groups[module]] for module in values}


def served_input_scales(checkpoint: Checkpoint, rungs: dict[str, str]) -> dict[str, float]:
    """Module -> the static FP8 activation scale it is served with, for every module at a static-scale rung."""
    static = [m for m, rung in rungs.items() if RUNGS[rung].static_input_scale]
    stored = _scalars(checkpoint, {m + INPUT_SCALE for m in static})
    return _group_max({m: stored[m + INPUT_SCALE] for m in static}, _fused_groups(static, checkpoint.config))


def served_weight_scales(checkpoint: Checkpoint, rungs: dict[str, str]) -> dict[str, float]:
    """FP8 Linear (not a routed expert: the decode sees an expert's gate and up together) -> the per-tensor
    weight scale the engines requantize it to, where that differs from its own (a fused module's shard)."""
    fp8 = [m for m, rung in rungs.items() if rung == "fp8" and scale_group(m) == m]
    own = _scalars(checkpoint, {m + ".weight_scale" for m in fp8})
    stored = {m: own[m + ".weight_scale"] for m in fp8}
    served = _group_max(stored, _fused_groups(fp8, checkpoint.config))
    return {m: scale for m, scale in served.items() if scale != stored[m]}
