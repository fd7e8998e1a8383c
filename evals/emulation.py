"""Evaluate what will be served: a quantized checkpoint loaded into transformers with its weights
decoded exactly and its activations quantize-dequantized the way the serving engines quantize them.

Schemes covered (anything else is refused, naming the scheme, never evaluated as bf16):
- Quark MX (``quant_method: quark``): weights MXFP4 / MXFP6 (E2M1, E2M3, E3M2; 32-blocks, E8M0
  scales, any scale rule); activations per ``input_tensors``: the same kind of MX spec, dynamic
  (W4A4, W6A6, ...), or none (weight-only, W4A16). Codec: ``quant.formats.mx.quantize_dequantize``,
  bit-exact with Quark's own ``DynamicScaledFakeQuantize``.
- Block FP8 (``quant_method: fp8``, DeepSeek-V3 style): weights e4m3 with 128x128 float32 scales;
  activations dynamic per token in groups of 128, e4m3 (``quant.formats.fp8.quantize_dequantize``).
- gpt-oss's own MXFP4 (``quant_method: mxfp4``, ``*_blocks`` / ``*_scales``): its config names no
  activation scheme and the engines' backends differ (``GPT_OSS_ACTIVATIONS``), so it is evaluated
  only when the user chooses: ``--activations bf16``, W4A16 (transformers' own Mxfp4 dequantization).
The rules, and the Quark and vLLM functions they come from: docs/reference.md §2.

Which modules are quantized is read from the shards themselves (a weight with its scale tensor):
that is what an engine multiplies. transformers' extension points used (transformers 5.24):
- ``transformers.quantizers.auto.register_quantization_config`` / ``register_quantizer``: the
  ``quantgate-emulation`` quantizer below. The checkpoint's config is loaded, its
  ``quantization_config`` replaced by ours, and passed to ``from_pretrained(config=...)``.
- ``HfQuantizer.get_load_operations()["dequantize"]`` (``quantizers/base.py``): our op decodes every
  (weight, scale) pair; ``HfQuantizer.update_weight_conversions`` runs it before the model's own
  converters merge per-expert tensors into the fused ``experts.gate_up_proj`` / ``down_proj``.
- ``HfQuantizer._process_model_before_weight_loading``: a forward pre-hook
  (``torch.nn.Module.register_forward_pre_hook``) on each quantized Linear quantize-dequantizes its input.
- ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (``ExpertsInterface.register``) +
  ``from_pretrained(experts_implementation=...)``: ``experts_forward`` is transformers' eager experts
  loop (``DeepseekV3Experts.forward``) with the inputs of both expert matmuls quantize-dequantized.
  The same loop is ``Glm4MoeExperts``, ``Qwen3MoeExperts``, ``MixtralExperts`` and
  ``MiniMaxM2Experts.forward`` (concatenated [gate; up], no bias, not transposed: checked per module).
- ``conversion_mapping.get_model_conversion_mapping`` + ``core_model_loading.rename_source_key``: a
  checkpoint module's name in the model, by transformers' own renamings (Mixtral's and MiniMax-M2's
  ``block_sparse_moe.experts.E.{w1,w2,w3}`` load as ``mlp.experts.{gate_up_proj,down_proj}``).
- ``transformers.quantizers.base.SequentialLlama4TextExperts``: swapped in, on the meta device as
  ``HfQuantizer._convert_model_for_quantization`` swaps it, for a fused experts class whose checkpoint
  stores per-expert weights (Llama-4's ``Llama4TextExperts``), so they load into per-expert Linears.
No transformers code is patched.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from evals.errors import BadInput
from evals.served import module_rungs, served_input_scales, served_weight_scales
from quant.checkpoint import Checkpoint, config_int
from quant.errors import CheckpointError
from quant.formats import fp8, fp8_tensor, mx
from quant.formats.codecs import CODECS, Codec, get_codec
from quant.formats.constants import BLOCK, E4M3_MAX, ScaleRule
from quant.quark_config import config_kind
from quant.rungs import RUNGS, rung_of_spec
from quant.static_scales import scale_group

METHOD = "quantgate-emulation"
EXPERTS_IMPLEMENTATION = "quantgate-emulation"
# Quark algorithms whose effect is baked into the stored weights (nothing left to emulate at run time).
BAKED_ALGORITHMS = {"smooth", "autosmoothquant", "awq", "gptq", "gptaq", "autoround", "qronos"}
# a per-expert weight after transformers' renaming: merged into its experts module's fused tensors
FUSED_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?:gate_up_proj|down_proj)$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# a per-expert weight transformers does not rename: its experts module is fused under another layout
PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.\w+$")


class EmulationRefused(BadInput):
    """The checkpoint's quantization scheme is not one this emulation reproduces; says which (exit 2)."""


class StaticFP8:
    """An activation quantized to FP8 e4m3 with one static per-tensor scale and dequantized, as served: in
    float32 times the scale's reciprocal (``fp8_tensor.fp8_static_qdq``: the FP8 kernels and MoE methods), or,
    for a W4A8 Linear (``divide``), divided by the scale in the activation's own dtype: vLLM 0.33.0
    quark/schemes/quark_w4a8_mxfp4_fp8.py QuarkW4A8_MXFP4_FP8._apply_emulation and _apply_aiter_kernel compute
    ``x / input_scale`` with a 0-d float32 scale, which leaves a bf16 ``x`` bf16 (sglang 0.5.23 builds no W4A8
    Linear)."""

    def __init__(self, scale: float, divide: bool = False):
        self.scale, self.divide = scale, divide

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.divide:
            return fp8_tensor.fp8_static_qdq(x, self.scale)
        scale = torch.tensor(self.scale, dtype=torch.float32)
        codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (codes.to(x.dtype) * scale).to(x.dtype)

    def __repr__(self):
        return f"StaticFP8({self.scale}{', divide' if self.divide else ''})"


@dataclass(frozen=True)
class Emulation:
    """What a quantized checkpoint computes: its weight format and how activations are quantized."""

    source: str  # "quark", "fp8" or "mxfp4" (gpt-oss's): the quantization_config it was read from
    weights: str  # quant.formats name: mxfp4, mxfp6_e2m3, mxfp6_e3m2, fp8
    weight_scale_rule: str | None  # MX only
    activations: str | None  # None: weight-only (W4A16 / W8A16)
    activation_scale_rule: str | None = None  # MX only
    activation_group: int | None = None  # values sharing a scale, along the last dim, per token
    # Element rounding of weights and activations: to nearest, ties to even, as Quark 0.13's HIP kernel
    # (``qdq_mxfp4``, what ROCm serving runs) and its fake quantization round; FP8's e4m3 cast rounds
    # the same way (docs/reference.md §2).
    rounding: str = "half_even"
    modules: list[str] = field(default_factory=list)  # checkpoint modules with quantized weights
    # A per-layer Quark checkpoint (``layer_quant_config``): each quantized module's rung (quant.rungs), read
    # from its tensors; the static FP8 activation scale each static-scale module is served with and the FP8
    # weight scale a fused shard is requantized to, both as the engines collapse them (evals.served).
    per_layer: bool = False
    rungs: dict[str, str] = field(default_factory=dict)
    input_scales: dict[str, float] = field(default_factory=dict)
    weight_scales: dict[str, float] = field(default_factory=dict)

    @property
    def weight_format(self) -> Codec:
        return get_codec(self.weights)

    @property
    def scheme(self) -> str:
        if self.rungs:  # the rungs present, cheapest first: W4A4+W8A8
            return "+".join(rung.label for name, rung in RUNGS.items() if name in self.rungs.values())
        bits = {"mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "fp8": 8}
        act = f"A{bits[self.activations]}" if self.activations else "A16"
        return f"W{bits[self.weights]}{act}"

    def activation_qdq(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "fp8":
            return fp8.quantize_dequantize(x, self.activation_group)
        return mx.quantize_dequantize(x, get_codec(self.activations).element, ScaleRule(self.activation_scale_rule))

    def module_qdq(self, module: str):
        """What a checkpoint module's input goes through: a per-layer checkpoint's static-scale rung quantizes it
        to FP8 with the module's served scale; every other module, the checkpoint's activation scheme."""
        rung = self.rungs.get(module)
        if rung and RUNGS[rung].static_input_scale:
            return StaticFP8(self.input_scales[module], divide=rung == "mxfp4_fp8" and scale_group(module) == module)
        return self.activation_qdq

    def to_dict(self) -> dict:
        return asdict(self)


def _quark_mx_format(spec: dict, role: str, dynamic: bool) -> tuple[str, str]:
    """(format name, scale rule) of a Quark MX tensor spec, or EmulationRefused naming what differs."""
    names = {c.element.name: name for name, c in CODECS.items() if c.family == "mx"}
    dtype = spec.get("dtype")
    if dtype not in names:
        raise EmulationRefused(f"Quark {role} dtype {dtype!r} (qscheme {spec.get('qscheme')!r}) is not emulated; "
                               f"covered: {sorted(names)} per_group 32 with e8m0 scales")
    expected = {"qscheme": "per_group", "group_size": BLOCK, "ch_axis": -1, "scale_format": "e8m0",
                "is_dynamic": dynamic, "mx_element_dtype": None}
    wrong = {k: spec.get(k) for k, v in expected.items() if spec.get(k) != v}
    if spec.get("round_method") not in (None, "half_even"):
        wrong["round_method"] = spec["round_method"]
    rule = spec.get("scale_calculation_mode") or "even"
    if rule not in {r.value for r in ScaleRule}:
        wrong["scale_calculation_mode"] = rule
    if wrong:
        raise EmulationRefused(f"Quark {role} spec {dtype} with {wrong} is not emulated; covered: OCP MX "
                               f"{expected} with round_method half_even and scale_calculation_mode even/floor/ceil")
    return names[dtype], rule


def _from_quark(qc: dict) -> Emulation:
    glob = qc.get("global_quant_config") or {}
    if not glob.get("weight"):
        raise EmulationRefused("Quark config without a global weight spec is not emulated")
    weights, weight_rule = _quark_mx_format(glob["weight"], "weight", dynamic=False)
    activations = act_rule = None
    if glob.get("input_tensors"):
        activations, act_rule = _quark_mx_format(glob["input_tensors"], "input_tensors", dynamic=True)
    unsupported = {k: qc.get(k) for k in ("layer_type_quant_config", "kv_cache_quant_config") if qc.get(k)}
    unsupported.update({k: glob[k] for k in ("output_tensors", "bias") if glob.get(k)})
    if qc.get("softmax_quant_spec"):
        unsupported["softmax_quant_spec"] = qc["softmax_quant_spec"]
    algorithms = [a.get("name") if isinstance(a, dict) else a for a in (qc.get("algo_config") or [])]
    if set(algorithms) - BAKED_ALGORITHMS:
        unsupported["algo_config"] = algorithms
    export = qc.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized" or export.get("pack_method", "reorder") != "reorder":
        unsupported["export"] = {k: export.get(k) for k in ("weight_format", "pack_method")}
    if unsupported:
        raise EmulationRefused(f"Quark {weights} checkpoint with {sorted(unsupported)} = {unsupported} is not emulated "
                               "(only a global weight / input_tensors MX spec is, with a layer_quant_config of "
                               "the rungs in quant/rungs.py)")
    per_layer = bool(qc.get("layer_quant_config"))
    if per_layer:
        _check_layer_specs(qc["layer_quant_config"], weights, act_rule)
    return Emulation("quark", weights, weight_rule, activations, act_rule, BLOCK if activations else None,
                     per_layer=per_layer)


def _check_layer_specs(layers, weights: str, act_rule: str | None) -> None:
    """A ``layer_quant_config`` emulated: a W4A4 global spec and, per key, a rung's spec (quant.rungs), an MX
    one with the global spec's activation scale rule (the one every MX activation is quantized with)."""
    if weights != "mxfp4" or act_rule is None:
        raise EmulationRefused(f"Quark {weights} checkpoint without MXFP4 activations and with a layer_quant_config "
                               "is not emulated; covered: a W4A4 (mxfp4) global spec with per-layer rungs")
    if not isinstance(layers, dict):
        raise EmulationRefused(f"Quark layer_quant_config is {type(layers).__name__}, not an object of name "
                               "patterns to layer specs: not emulated")
    for key, spec in layers.items():
        rung = rung_of_spec(spec)
        if rung is None:
            parts = {part: ((spec or {}).get(part) or {}).get("dtype") for part in ("weight", "input_tensors")}
            raise EmulationRefused(f"Quark layer_quant_config[{key!r}] (dtypes {parts}) is no rung and is not "
                                   "emulated; covered: " + ", ".join(f"{n} ({r.label})" for n, r in RUNGS.items()
                                                                     if r.weight) + " as quant/rungs.py specs them")
        if RUNGS[rung].weight == "mxfp4":
            _quark_mx_format(spec["weight"], f"layer_quant_config[{key!r}] weight", dynamic=False)
        if RUNGS[rung].activations == "mxfp4":
            _, rule = _quark_mx_format(spec["input_tensors"], f"layer_quant_config[{key!r}] input_tensors", True)
            if rule != act_rule:
                raise EmulationRefused(f"Quark layer_quant_config[{key!r}] input_tensors scale rule {rule!r} differs "
                                       f"from the global spec's {act_rule!r}: not emulated")


def _from_fp8(qc: dict) -> Emulation:
    scheme = {k: qc.get(k) for k in ("fmt", "activation_scheme", "weight_block_size", "scale_fmt")}
    if (qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme") != "dynamic"
            or list(qc.get("weight_block_size") or []) != [fp8.TILE, fp8.TILE] or qc.get("scale_fmt") not in (None, "float32")):
        raise EmulationRefused(f"FP8 scheme {scheme} is not emulated; covered: fmt e4m3, activation_scheme dynamic, "
                               f"weight_block_size [128, 128], float32 scales")
    return Emulation("fp8", "fp8", None, "fp8", None, fp8.TILE)


# gpt-oss's own MXFP4 layout names no activation scheme, and the engines' backends choose differently:
# - vLLM 0.33.0, model_executor/layers/quantization/mxfp4.py GptOssMxfp4MoEMethod.__init__ calls
#   fused_moe/oracle/mxfp4.py select_mxfp4_moe_backend(moe) with no activation key; with --moe-backend
#   auto and no quantization_config.moe.activation override (_resolve_activation_key),
#   _filter_by_activation(_get_priority_backends_for_gpt_oss(), None) keeps only the backends whose
#   _backend_activation_key is None: bf16 activations on every GPU.
# - sglang 0.5.23, srt/arg_groups/model_overrides/gpt_oss.py _gpt_oss_overrides (moe_runner_backend
#   auto, quant_method mxfp4): SM100 and SM120 get flashinfer_mxfp4, whose default precision runs MXFP8
#   activations (srt/layers/moe/moe_runner/flashinfer_trtllm.py
#   _fused_experts_flashinfer_mxfp4_sm100_trtllm_gen -> _prepare_flashinfer_mxfp8_activations; SM120:
#   srt/layers/quantization/mxfp4.py, cutlass_fused_moe MXFP8 x MXFP4); ROCm with SGLANG_USE_AITER
#   keeps auto (aiter's kernel choice); otherwise (SM90: ep_size 1, triton_kernels present, no
#   --quantization) triton_kernel, bf16 activations.
# Run from the wheels' own code by tests/evals/test_gpt_oss_activation_rules.py.
GPT_OSS_ACTIVATIONS = ("vLLM 0.33.0 runs bf16 activations on every GPU (select_mxfp4_moe_backend); sglang 0.5.23 "
                       "runs MXFP8 activations on SM100/SM120 (flashinfer_mxfp4), bf16 on SM90 (triton_kernel) and "
                       "aiter's choice on ROCm (_gpt_oss_overrides)")


def emulation_of(config: dict, activations: str | None = None) -> Emulation | None:
    """The emulation a model config asks for; None for an unquantized model. ``activations``
    ("bf16", ``evals run --activations``): the user's choice where the config names no activation
    scheme (gpt-oss's quant_method mxfp4); a config that declares quantized activations is refused it."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = config_kind(qc)
    if method == "mxfp4":  # gpt-oss's own layout (quant.blocks): weight-only on disk, activations the backend's
        if activations != "bf16":
            raise EmulationRefused("quantization_config quant_method 'mxfp4' (gpt-oss's own *_blocks layout) names no "
                                   f"activation scheme and the engines differ: {GPT_OSS_ACTIVATIONS}; pass "
                                   "--activations bf16 to evaluate it as W4A16, or serve it and use evals run --base-url")
        return Emulation("mxfp4", "mxfp4", None, None)
    if method == "quark":
        emulation = _from_quark(qc)
    elif method == "fp8":
        emulation = _from_fp8(qc)
    else:
        raise EmulationRefused(f"quantization_config quant_method {qc.get('quant_method')!r} is not emulated; "
                               "covered: quark (MXFP4/MXFP6), fp8 (128x128 block, dynamic activations) and mxfp4 "
                               "(gpt-oss, with --activations bf16)")
    if activations and emulation.activations:
        raise EmulationRefused(f"--activations {activations}: the checkpoint's config declares its activations "
                               f"({emulation.scheme}, {method}), which is what is evaluated; --activations is for a "
                               "config that names none (gpt-oss's quant_method mxfp4)")
    return emulation


def quantized_modules(tensors: dict, fmt: Codec) -> list[str]:
    """Checkpoint modules whose weight is stored quantized (weight in the format's dtype + its scale)."""
    return sorted(name.removesuffix(".weight") for name, info in tensors.items()
                  if name.endswith(".weight") and info.dtype == fmt.weight_dtype and name + fmt.scale_suffix in tensors)


# --- activations ------------------------------------------------------------------------------------------------

class ActivationQDQ:
    """Forward pre-hook: the input of a quantized Linear, quantize-dequantized."""

    def __init__(self, qdq):
        self.qdq = qdq

    def __call__(self, module, args):
        return (self.qdq(args[0]), *args[1:])

    def __repr__(self):
        return f"ActivationQDQ({self.qdq!r})"


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5.24's eager experts loop (``DeepseekV3Experts.forward``, ``GlmMoeDsaExperts.forward``),
    with the input of ``gate_up_proj`` and of ``down_proj`` quantize-dequantized where this layer's
    experts are quantized (``self.quantgate_qdq``; the down input's ``self.quantgate_qdq_down`` where it
    differs: a static FP8 scale of its own). Activation blocks (or one static scale) run along each token's
    features, so quantizing the hidden states once equals quantizing every routed copy."""
    qdq = getattr(self, "quantgate_qdq", None) or (lambda t: t)
    qdq_down = getattr(self, "quantgate_qdq_down", None) or qdq
    final_hidden_states = torch.zeros_like(hidden_states)
    hidden_states = qdq(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate_up = _expert_linear(self, hidden_states[token_idx], "gate_up_proj", expert_idx)
        current = _expert_linear(self, qdq_down(self._apply_gate(gate_up)), "down_proj", expert_idx)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _expert_linear(self, x: torch.Tensor, projection: str, expert: int) -> torch.Tensor:
    """One expert's projection as its experts class stores it: ``[out, in]`` (``linear``), or
    transposed ``[in, out]`` with a bias beside it (gpt-oss's GptOssExperts: ``x @ W + b``, its own
    eager forward's order of operations)."""
    weight = getattr(self, projection)[expert]
    out = x @ weight if getattr(self, "is_transposed", False) else torch.nn.functional.linear(x, weight)
    if getattr(self, "has_bias", False):
        out = out + getattr(self, projection + "_bias")[expert]
    return out


def _model_names(model: torch.nn.Module):
    """checkpoint module -> the name transformers loads its weight under, less ``.weight``
    (``rename_source_key`` with the model's own conversion mapping, as ``from_pretrained`` renames)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]

    # a causal-LM class loaded from its multimodal release (Llama4ForCausalLM, base_model_prefix
    # language_model): transformers strips that prefix where the model has no module by its name
    prefix = model.base_model_prefix + "."
    strip = bool(model.base_model_prefix) and not hasattr(model, model.base_model_prefix)
    # a release stored without that prefix (DeepSeek-V4: layers.N.*, embed.*): transformers adds it to
    # the names the base model holds a module for
    base = getattr(model, model.base_model_prefix, None) if model.base_model_prefix else None

    def model_name(module: str) -> str:
        name = rename_source_key(module + ".weight", renamings, converters)[0].removesuffix(".weight")
        if strip:
            return name.removeprefix(prefix)
        if base is not None and not name.startswith(prefix) and hasattr(base, name.partition(".")[0]):
            return prefix + name
        return name

    return model_name


def _per_expert_forms() -> dict:
    """Fused experts class -> transformers' own per-expert form of it, into which a checkpoint's
    per-expert weights load (one Linear each, so the Linear hooks apply). Llama-4's
    Llama4TextExperts (gate_up_proj [E, H, 2I]) -> ``SequentialLlama4TextExperts``
    (``transformers.quantizers.base``, 5.24: what transformers itself swaps in for compressed-tensors
    and bitsandbytes checkpoints): every expert a Llama4TextMLP run on its own slice of the routed
    input, which ``Llama4TextMoe.forward`` has already multiplied by the router weight. That is
    where vLLM quantizes it too: ``apply_router_weight_on_input=True`` (``models/llama4.py``), and
    ``MoEPrepareAndFinalizeNoDPEP.prepare`` (``fused_moe/prepare_finalize/no_dp_ep.py``, vLLM
    0.33.0) computes ``a1 * topk_weights`` before ``_quantize_input``."""
    from transformers.quantizers.base import SequentialLlama4TextExperts

    return {"Llama4TextExperts": SequentialLlama4TextExperts}


def _fused_experts_of(loaded: str, named: dict) -> str | None:
    """The model's experts module a per-expert checkpoint weight belongs to, where transformers keeps
    no per-expert name for it (the checkpoint's multimodal prefix dropped: language_model.)."""
    match = PER_EXPERT.match(loaded)
    if not match:
        return None
    experts = match["experts"]
    return next((n for n in (experts, experts.partition(".")[2]) if n in named), None)


def install_activation_emulation(model: torch.nn.Module, emulation: Emulation, num_hidden_layers: int,
                                 mtp_prefix: str | None = None) -> dict:
    """Hook every module the checkpoint quantizes; returns which modules were hooked and which were not loaded."""
    named = dict(model.named_modules())
    linears, experts, not_loaded = {}, {}, set()  # linears: model name -> checkpoint module
    model_name = _model_names(model)
    per_expert_forms = []
    for name in emulation.modules:  # first: fused experts the checkpoint stores per expert
        loaded = model_name(name)
        if isinstance(named.get(loaded), torch.nn.Linear) or not (fused := _fused_experts_of(loaded, named)):
            continue
        per_expert = _per_expert_forms().get(type(named[fused]).__name__)
        if per_expert is None:
            raise EmulationRefused(f"the checkpoint quantizes {name}, but {type(model).__name__} builds "
                                   f"{fused} as {type(named[fused]).__name__}, fused experts with no per-expert "
                                   "form to load it into: evaluate its bf16 conversion (quantize --to bf16) "
                                   "locally, or serve it and use evals run --base-url")
        parent, _, child = fused.rpartition(".")
        with torch.device("meta"):  # as HfQuantizer._convert_model_for_quantization swaps it
            named[parent]._modules[child] = per_expert(model.config.get_text_config())
        named = dict(model.named_modules())
        per_expert_forms.append(fused)
    for name in emulation.modules:
        loaded = model_name(name)
        match = FUSED_EXPERT.match(loaded)
        if match and match["experts"] in named and hasattr(named[match["experts"]], "gate_up_proj"):
            experts.setdefault(match["experts"], set()).add(name)
        elif isinstance(named.get(loaded), torch.nn.Linear):
            linears[loaded] = name
        elif ((layer := LAYER.match(name)) and int(layer[1]) >= num_hidden_layers) or \
                (mtp_prefix and name.startswith(mtp_prefix + ".")):
            # the MTP (next-n) layer, or the draft under its own prefix (Qwen3-Next's mtp.layers.0):
            # transformers builds no module for it
            not_loaded.add(match["experts"] if match else loaded)
        else:
            raise EmulationRefused(f"the checkpoint quantizes {name}, which {type(model).__name__} has no Linear or "
                                   "experts module for: cannot emulate it")
    for name, projections in experts.items():
        module = named[name]
        if len(projections) != 3 * module.num_experts:
            raise EmulationRefused(f"{name}: {len(projections)} of {3 * module.num_experts} expert projections are "
                                   "quantized; the engines quantize a layer's experts all or none")
        if module.has_bias or module.is_transposed or not module.has_gate or module.has_post_expert_norm:
            raise EmulationRefused(f"{name}: {type(module).__name__} has a layout the emulated experts loop does not "
                                   "cover (bias, transposed, ungated or post-norm experts)")
        if emulation.per_layer and len(rungs := {emulation.rungs[p] for p in projections}) > 1:
            raise EmulationRefused(f"{name}: the checkpoint stores this layer's experts at several rungs "
                                   f"({', '.join(sorted(rungs))}); the engines serve one scheme per layer's experts")
    if emulation.activations:
        for name, module in linears.items():
            named[name].register_forward_pre_hook(ActivationQDQ(emulation.module_qdq(module)))
        for name, projections in experts.items():
            gate_up = next(p for p in sorted(projections) if scale_group(p).endswith(".gate_up"))
            down = next(p for p in sorted(projections) if scale_group(p).endswith(".down"))
            named[name].quantgate_qdq = emulation.module_qdq(gate_up)
            named[name].quantgate_qdq_down = emulation.module_qdq(down)
    return {"linear": sorted(linears), "experts": sorted(experts), "not_loaded_by_transformers": sorted(not_loaded),
            "per_expert_form": per_expert_forms}


def decode_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmt: Codec,
                  served_scale: float | None = None) -> torch.Tensor:
    """A stored weight decoded into ``dtype``: an FP8 per-tensor one (e4m3 with one scalar scale: a per-layer
    checkpoint's fp8 rung) requantized to ``served_scale`` first where the engines serve it with another
    (evals.served), any other by the checkpoint's format."""
    if weight.dtype == torch.float8_e4m3fn and scale.numel() == 1:
        if served_scale is None or served_scale == float(scale):
            return fp8_tensor.dequantize(weight, scale, dtype)
        # w8a8_utils.py requantize_with_max_scale: per_tensor_dequantize (e4m3 in float16 times the float32
        # scale: a float16 product), then scaled_fp8_quant at the served scale, decoded as the GEMM does
        dequantized = weight.to(torch.float16) * scale.to(torch.float32).reshape(())
        return fp8_tensor.fp8_static_qdq(dequantized.to(torch.float32), served_scale).to(dtype)
    return fmt.decode(weight, scale, dtype)


def emulation_record(emulation: Emulation) -> dict:
    """What run.json records of an emulation: its scheme and settings; a per-layer checkpoint's modules
    counted per rung (the checkpoint's hash names the rest)."""
    record = {k: v for k, v in emulation.to_dict().items()
              if k not in ("modules", "rungs", "input_scales", "weight_scales")}
    if emulation.per_layer:
        record["rungs"] = {name: list(emulation.rungs.values()).count(name) for name in RUNGS
                           if name in emulation.rungs.values()}
    return {**record, "scheme": emulation.scheme}


# --- the transformers quantizer ----------------------------------------------------------------------------------

def _register() -> None:
    """Register the quantizer, its config and the experts implementation with transformers (once)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if METHOD in AUTO_QUANTIZER_MAPPING:
        return
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import get_module_from_name

    class EmulationConfig(QuantizationConfigMixin):
        def __init__(self, emulation: dict, num_hidden_layers: int = 0, mtp_prefix: str | None = None, **_):
            self.quant_method = METHOD
            self.emulation = emulation
            self.num_hidden_layers = num_hidden_layers
            self.mtp_prefix = mtp_prefix
            self.dequantize = True  # weights are decoded on load (HfQuantizer.get_weight_conversions)

        def to_dict(self) -> dict:
            return {"quant_method": METHOD, "emulation": self.emulation, "num_hidden_layers": self.num_hidden_layers,
                    "mtp_prefix": self.mtp_prefix}

    class DecodeWeights(ConversionOps):
        """Every (weight, scale) pair collected by a converter, decoded exactly into the model's dtype."""

        def __init__(self, hf_quantizer):
            self.hf_quantizer = hf_quantizer  # marks a load op: transformers leaves dtypes to it

        def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
            fmt = self.hf_quantizer.emulation.weight_format
            dtype = None
            if model is not None and full_layer_name is not None:
                module, tensor_name = get_module_from_name(model, full_layer_name)
                dtype = getattr(getattr(module, tensor_name, None), "dtype", None)
            out = {}
            for key, value in input_dict.items():
                if key.endswith(fmt.scale_suffix):
                    continue
                weights = value if isinstance(value, list) else [value]
                scales = input_dict.get(key + fmt.scale_suffix)
                if scales is None:
                    decoded = [w if dtype is None else w.to(dtype) for w in weights]
                else:
                    scales = scales if isinstance(scales, list) else [scales]
                    served = self.served_scales(input_dict, full_layer_name, fmt.scale_suffix, len(weights))
                    decoded = [decode_weight(w, s, dtype or torch.bfloat16, fmt, served[i])
                               for i, (w, s) in enumerate(zip(weights, scales, strict=True))]
                out[full_layer_name if key == "weight" and full_layer_name else key] = (
                    decoded if isinstance(value, list) else decoded[0])
            return out

        def served_scales(self, input_dict, full_layer_name, suffix: str, count: int) -> list:
            """Per collected weight, the FP8 per-tensor scale the engines serve it with (None: its own). A
            Linear's from the checkpoint's fused modules (evals.served); a fused experts parameter's per expert,
            the largest over the projections merged into it (an expert's gate and up: w13)."""
            if not self.hf_quantizer.emulation.per_layer:
                return [None] * count
            if not (full_layer_name and FUSED_EXPERT.match(full_layer_name)):
                return [self.hf_quantizer.served_weight_scales.get(full_layer_name)] * count
            per_tensor = [v if isinstance(v, list) else [v] for k, v in input_dict.items() if k.endswith(suffix)]
            per_tensor = [scales for scales in per_tensor if all(s.numel() == 1 for s in scales)]
            return [max(float(scales[i]) for scales in per_tensor) if per_tensor else None for i in range(count)]

    class EmulationQuantizer(HfQuantizer):
        requires_calibration = False

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self.emulation = Emulation(**quantization_config.emulation)
            self.serialized_names = {"weight": ["weight", "weight" + self.emulation.weight_format.scale_suffix]}

        def get_load_operations(self):
            return {"dequantize": DecodeWeights}

        def _process_model_before_weight_loading(self, model, **kwargs):
            hooked = install_activation_emulation(model, self.emulation, self.quantization_config.num_hidden_layers,
                                                  self.quantization_config.mtp_prefix)
            model_name = _model_names(model)
            self.served_weight_scales = {model_name(m) + ".weight": s for m, s in self.emulation.weight_scales.items()}
            model.quantgate_emulation = {**emulation_record(self.emulation), "modules": hooked}

        def is_serializable(self):
            return False

        @property
        def is_trainable(self):
            return False

    register_quantization_config(METHOD)(EmulationConfig)
    register_quantizer(METHOD)(EmulationQuantizer)
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def _refuse_without_a_causal_lm_class(checkpoint: Checkpoint) -> None:
    """Local evaluation loads a text decoder with ``AutoModelForCausalLM``; a model type transformers
    maps to no causal-LM class (Kimi-K2.5's ``kimi_k25``: vision tower + text model, an
    image-text-to-text class) is refused naming it, never loaded some other way."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = checkpoint.config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise EmulationRefused(f"{checkpoint.config_path}: model_type {model_type!r} has no transformers causal-LM "
                               "class (AutoModelForCausalLM), so it cannot be evaluated locally; serve it and use "
                               "evals run --base-url")


def refuse_unbuildable(folder: Path) -> None:
    """``_refuse_without_a_causal_lm_class`` on a checkpoint folder, for a caller that asks transformers for the
    model's config before loading it (a model type transformers does not know at all, Kimi-K3's ``kimi_k3``,
    would raise there)."""
    try:
        checkpoint = Checkpoint.open(folder)
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None
    _refuse_without_a_causal_lm_class(checkpoint)


def _refuse_unloaded_experts(checkpoint: Checkpoint, info: dict) -> None:
    """transformers initialises a weight its conversion mapping finds no checkpoint tensor for and runs anyway
    (Hunyuan-V4's ``hy_v4`` mapping merges no per-expert experts into its fused ones): a model whose routed experts
    were not loaded would be evaluated on random weights, so it is refused naming the first of them."""
    missing = sorted(k for k in info.get("missing_keys", ()) if ".experts." in k)
    if missing:
        raise EmulationRefused(f"{checkpoint.config_path}: transformers loads none of the checkpoint's tensors into "
                               f"{missing[0]} ({len(missing)} expert weights left uninitialised: its conversion "
                               f"mapping for model_type {checkpoint.config.get('model_type')!r} does not read the "
                               "release's expert names), so it cannot be evaluated locally; serve it and use "
                               "evals run --base-url")


def _mtp_prefix(config: dict) -> str | None:
    """Where the family's manifest keeps a draft outside model.layers (Qwen3-Next: mtp.layers), if it does."""
    from quant.layout import UnknownFamilyError, family_for

    try:
        return family_for(config).mtp_prefix
    except UnknownFamilyError:
        return None


def _num_layers_key(config: dict) -> str:
    """The config key counting the decoder layers, as the family's manifest names it (LongCat-Flash: num_layers,
    where transformers' num_hidden_layers counts its two attention sublayers per layer)."""
    from quant.layout import UnknownFamilyError, family_for

    try:
        return family_for(config).num_layers_key
    except UnknownFamilyError:
        return "num_hidden_layers"


def _load_gpt_oss_mxfp4(checkpoint: Checkpoint, emulation: Emulation, device: str, dtype: torch.dtype):
    """gpt-oss's own MXFP4 layout as W4A16: transformers' Mxfp4 quantizer decodes the *_blocks /
    *_scales into the fused GptOssExperts (``Mxfp4Config(dequantize=True)``: its Mxfp4Dequantize op,
    equal to quantgate's decode), which then run the emulated experts loop with bf16 inputs."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    names = checkpoint.tensors()
    experts = sorted(n.removesuffix("_blocks") for n in names if n.endswith("_blocks") and
                     n.removesuffix("_blocks") + "_scales" in names)
    if not experts:
        raise EmulationRefused(f"{checkpoint.config_path} declares quant_method 'mxfp4' but no shard holds a "
                               "*_blocks tensor with its *_scales: nothing to emulate")
    model = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=dtype, device_map=device,
                                                 quantization_config=Mxfp4Config(dequantize=True),
                                                 experts_implementation=EXPERTS_IMPLEMENTATION)
    record = {**{k: v for k, v in emulation.to_dict().items() if k != "modules"}, "scheme": emulation.scheme,
              "activations_from": "--activations bf16", "modules": {"experts_blocks": experts}}
    return model.eval(), record


def _per_layer(checkpoint: Checkpoint, emulation: Emulation) -> Emulation:
    """A per-layer checkpoint's modules, each at the rung its tensors show (one its config names) with the
    scales the engines serve it with (evals.served)."""
    rungs = module_rungs(checkpoint.tensors())
    named = {"mxfp4"} | {rung_of_spec(spec) for spec in checkpoint.config["quantization_config"]["layer_quant_config"]
                         .values()}
    if stray := sorted(m for m, rung in rungs.items() if rung not in named):
        raise EmulationRefused(f"{checkpoint.config_path}: {stray[0]} is stored as {rungs[stray[0]]} "
                               f"({RUNGS[rungs[stray[0]]].label}), a rung its quantization_config names for no "
                               f"module ({len(stray)} such modules): reconvert it with quantize")
    return replace(emulation, modules=sorted(rungs), rungs=rungs, input_scales=served_input_scales(checkpoint, rungs),
                   weight_scales=served_weight_scales(checkpoint, rungs))


def load_model(folder: Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
               activations: str | None = None):
    """``(model, emulation record or None)``: a local HF checkpoint ready for lm-eval, a quantized one emulated.

    ``dtype`` is the compute dtype: bfloat16 by default, as the engines compute (activations are
    quantize-dequantized in it, as vLLM's emulation does). Every checkpoint, quantized or not, runs
    the same experts loop (``experts_forward``), so a conversion differs from its bf16 source by
    the quantization alone. Raises ``BadInput`` (an unreadable folder) or ``EmulationRefused`` (a
    scheme not covered). ``activations``: see ``emulation_of``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        checkpoint = Checkpoint.open(folder)
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None
    _refuse_without_a_causal_lm_class(checkpoint)
    emulation = emulation_of(checkpoint.config, activations)
    _register()
    if emulation is not None and emulation.source == "mxfp4":
        return _load_gpt_oss_mxfp4(checkpoint, emulation, device, dtype)
    if emulation is None:
        model, info = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=dtype, device_map=device,
                                                           experts_implementation=EXPERTS_IMPLEMENTATION,
                                                           output_loading_info=True)
        _refuse_unloaded_experts(checkpoint, info)
        return model.eval(), None
    fmt = emulation.weight_format
    if emulation.per_layer:
        emulation = _per_layer(checkpoint, emulation)
    else:
        emulation = replace(emulation, modules=quantized_modules(checkpoint.tensors(), fmt))
    if not emulation.modules:
        raise EmulationRefused(f"{checkpoint.config_path} declares {emulation.weights} but no shard holds a "
                               f"{fmt.weight_dtype} weight with its {fmt.scale_suffix}: nothing to emulate")
    config = AutoConfig.from_pretrained(checkpoint.folder)
    # a multimodal release (Llama-4) keeps the text model's layer count under text_config
    text = checkpoint.config.get("text_config")
    layers = config_int(text, "num_hidden_layers", checkpoint.config_path) if isinstance(text, dict) else \
        checkpoint.config_int(_num_layers_key(checkpoint.config))
    config.quantization_config = {"quant_method": METHOD, "emulation": emulation.to_dict(), "num_hidden_layers": layers,
                                  "mtp_prefix": _mtp_prefix(checkpoint.config)}
    model = AutoModelForCausalLM.from_pretrained(checkpoint.folder, config=config, dtype=dtype, device_map=device,
                                                 experts_implementation=EXPERTS_IMPLEMENTATION)
    return model.eval(), model.quantgate_emulation


__all__ = ["Emulation", "EmulationRefused", "emulation_of", "experts_forward", "load_model", "quantized_modules"]
