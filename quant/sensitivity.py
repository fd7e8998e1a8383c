"""The sensitivity pass: how much each (decoder layer, role) loses at each rung of the precision ladder,
measured on calibration prompts with one decoder layer in memory at a time.

The prompts (``quant.calibration``) are tokenized with the checkpoint's tokenizer and embedded; then each
decoder layer in turn is built with transformers from the checkpoint's config on the meta device, its
weights read from the shards and assigned (bf16, or a block-FP8 source decoded), run, and freed. Per layer:

- a reference run of the unquantized layer records every Linear's input absolute max and how many tokens
  reached it (a routed expert's: the tokens routed to it), and each routed expert's token count;
- per unit (the layer's Linears of one role) and rung (``quant.rungs``), the same inputs run again with only
  that unit's weights and activations quantize-dequantized as the rung is served: MXFP4 weights and dynamic
  MXFP4 activations (W4A4), the same weights with static per-tensor FP8 activations (W4A8), per-tensor FP8
  weights and static FP8 activations (W8A8), with ``quant.formats.fp8_tensor``'s numerics. ``error`` is the
  relative L2 error of the layer's output against the reference run's, over the calibration tokens. A static
  scale is ``fp8_tensor.scale_of`` the reference run's amax (amax / 448); a layer's routed experts share the
  largest, one for gate/up and one for down, because the engines collapse per-expert input scales to their
  max for the fused MoE.

Each layer reads the reference output of the layer before it, so a unit's error is its own, not the sum of
what came before. The MTP (next-n) layer is not measured: transformers builds no module for it.
Prompts run in batches, right-padded: under the causal mask no real token sees a pad, and pads are left
out of every statistic. The result is a JSON sidecar (``SCHEMA`` below), written atomically, that the
ladder, the converter (static scales) and the conversion manifest read: ``load_sensitivity``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quant.calibration import Calibration, load_calibration
from quant.checkpoint import Checkpoint
from quant.errors import CheckpointError, QuantgateError
from quant.formats import fp8_tensor, mx
from quant.formats.codecs import CODECS
from quant.formats.constants import ScaleRule
from quant.hashing import sha256_of
from quant.layout import family_for
from quant.outputs import write_atomic
from quant.rungs import RUNGS, SCALAR_DTYPE
from quant.safetensors_io import DTYPE_BYTES
from quant.safe_files import read_json
from quant.schema import JsonValue, Schema, validate

KIND, VERSION = "quantgate-sensitivity", 1
MEASURED = ("mxfp4", "mxfp4_fp8", "fp8")  # the quantized rungs; bf16 is the reference itself
RARE_SHARE = 0.1  # an expert routed fewer tokens than this share of an even split is named as rarely routed
MXFP4 = CODECS["mxfp4"].element
SCALAR_BYTES = DTYPE_BYTES[SCALAR_DTYPE]  # a stored per-tensor scale


class SensitivityError(QuantgateError, ValueError):
    """A source or sidecar file the sensitivity pass cannot use; the message names it and the fix (exit 2)."""


class Unit(Schema):
    layer: int
    role: str
    mtp: bool = False
    error: dict[str, float]  # rung -> relative L2 error of the layer's output with this unit at the rung
    bytes: dict[str, int]  # rung -> bytes the unit's tensors take at it (bf16 included)


class Sensitivity(Schema):
    """The sidecar (``load_sensitivity``); module names are the checkpoint's
    (``model.layers.1.mlp.experts.0.gate_proj``)."""
    kind: str
    version: int
    source: dict[str, JsonValue]  # path, config_sha256
    calibration: dict[str, JsonValue]  # source, items, tokens, item_sha256
    scale_rule: str = "even"  # the MXFP4 weight scale rule measured
    dtype: str = "bfloat16"  # the compute dtype
    device: str = "cpu"
    rungs: list[str]
    units: list[Unit]
    amax: dict[str, float]  # Linear module -> its input's absolute max over the calibration tokens
    tokens: dict[str, int]  # Linear module -> the calibration tokens that reached it
    expert_tokens: dict[str, list[int]]  # layer -> tokens routed to each expert
    rare_experts: dict[str, list[int]] = {}  # layer -> experts routed fewer than RARE_SHARE of an even split
    seconds: float
    peak_rss_bytes: int
    peak_device_bytes: int = 0
    seconds_per_layer: list[float]

    def unit(self, layer: int, role: str) -> Unit | None:
        return next((u for u in self.units if u.layer == layer and u.role == role), None)

    def input_scale(self, module: str) -> float | None:
        """The static FP8 activation scale of ``module`` alone measured here (``fp8_tensor.scale_of`` its amax),
        None if unmeasured (a routed expert is served its layer's largest: ``quant.static_scales``)."""
        amax = self.amax.get(module)
        return None if amax is None else float(fp8_tensor.scale_of(amax))


def load_sensitivity(path: Path) -> Sensitivity:
    path = Path(path)
    fix = "measure it again with python -m quant.sensitivity (or quantize --ladder --calibration)"
    try:
        data = read_json(path, SensitivityError, fix)
    except OSError as exc:
        raise SensitivityError(f"{path}: cannot be read ({exc.strerror}); {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or data.get("version") != VERSION:
        raise SensitivityError(f"{path}: not a sensitivity file (kind {KIND!r}, version {VERSION}); {fix}")
    return validate(data, Sensitivity, path, "sensitivity file", SensitivityError, fix)


# --- the rungs' numerics ------------------------------------------------------------------------------------------

def mxfp4_weight_qdq(weight: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """A ``[rows, in]`` weight as its stored MXFP4 decodes (``mx.quantize`` then ``mx.dequantize``, on any device).
    A bf16 weight on the CPU takes the converter's own encode and decode (numba kernels, the same bytes)."""
    codec = CODECS["mxfp4"]
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and rule is ScaleRule.EVEN:
        encoded = codec.encode(weight.contiguous().view(torch.uint8).numpy(), "BF16", rule)
        decoded = codec.decode_bytes(encoded.weight, encoded.scales)
        return torch.from_numpy(decoded).view(torch.bfloat16).reshape(weight.shape)
    codes, exponent = mx.encode(weight, MXFP4, rule)
    exponent = exponent.clamp(min=1 - 127)  # an E8M0 byte is stored >= 1 (mx.quantize)
    values = mx.code_values(MXFP4).to(weight.device)[codes.long()]
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent).repeat_interleave(32, dim=-1)
    return (values * scale).to(weight.dtype)


def weight_qdq(weight: torch.Tensor, rung: str, rule: ScaleRule) -> torch.Tensor:
    """A checkpoint weight as the rung stores it: MXFP4 with ``rule``, or per-tensor FP8 (one scale for all of it)."""
    if RUNGS[rung].weight == "mxfp4":
        return mxfp4_weight_qdq(weight, rule)
    assert RUNGS[rung].weight == "fp8_tensor", rung  # a rung stored another way needs its numerics here
    return fp8_tensor.quantize_dequantize(weight)


def activation_qdq(rung: str, amax: float):
    """The function a rung applies to a Linear's input: dynamic MXFP4 blocks, or FP8 with the static scale."""
    if RUNGS[rung].activations == "fp8":
        scale = fp8_tensor.scale_of(amax)  # the input_scale a conversion stores for this amax
        return lambda x: fp8_tensor.fp8_static_qdq(x, scale)
    return lambda x: mx.quantize_dequantize(x, MXFP4, ScaleRule.EVEN)


def unit_bytes(shapes: list[tuple[int, int]]) -> dict[str, int]:
    """Bytes of a unit's stored tensors at each rung: weights, MX scales (one byte per 32 values), and the scalar
    ``weight_scale`` / ``input_scale`` a per-tensor rung stores per module."""
    out = {}
    for name, rung in RUNGS.items():
        total = 0
        for rows, cols in shapes:
            n = rows * cols
            if rung.weight is None:
                total += n * 2
                continue
            total += n * rung.bits // 8 + (n // 32 if rung.weight == "mxfp4" else SCALAR_BYTES)
            total += SCALAR_BYTES if rung.static_input_scale else 0
        out[name] = total
    return out


# --- one resident layer, instrumented ----------------------------------------------------------------------------

@dataclass
class Module:
    """A quantizable module of the resident layer: an ``nn.Linear`` or a fused experts module."""
    name: str  # in the layer (``self_attn.o_proj``, ``mlp.experts``)
    module: torch.nn.Module
    role: str
    checkpoint: list[str]  # the checkpoint modules it holds (per expert: gate_proj, up_proj, down_proj each)
    shapes: list[tuple[int, int]] = field(default_factory=list)


class Probe:
    """Hooks on one layer: records input amax and token counts while ``recording``; applies the active unit's
    activation quantization (``activations``: module -> function; experts: (module, "gate_up"/"down"))."""

    def __init__(self, modules: list[Module], prefix: str):
        self.recording = False
        self.valid: torch.Tensor | None = None  # [batch, tokens] bool: the real tokens of the running batch
        self.activations: dict = {}
        self.amax: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.expert_tokens: list[int] = []
        self.prefix = prefix
        self.handles = []
        for m in modules:
            if isinstance(m.module, torch.nn.Linear):
                self.handles.append(m.module.register_forward_pre_hook(self._linear_hook(m)))
            else:
                m.module.forward = self._experts_forward(m)
                self.expert_tokens = [0] * m.module.num_experts

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.valid is not None and x.shape[:2] == self.valid.shape:
            return x[self.valid]
        return x.reshape(-1, x.shape[-1])

    def _record(self, name: str, rows: torch.Tensor) -> None:
        if rows.shape[0]:
            self.amax[name] = max(self.amax.get(name, 0.0), rows.abs().amax().float().item())
        self.tokens[name] = self.tokens.get(name, 0) + rows.shape[0]

    def _linear_hook(self, m: Module):
        name = f"{self.prefix}.{m.name}"

        def hook(module, args):
            if self.recording:
                self._record(name, self._rows(args[0]))
            qdq = self.activations.get(module)
            return (qdq(args[0]), *args[1:]) if qdq else None
        return hook

    def _experts_forward(self, m: Module):
        """transformers' eager experts loop (``GlmMoeDsaExperts.forward``, ``DeepseekV3Experts.forward``), recording
        each expert's routed tokens and inputs, with the active unit's activation quantization on both matmuls."""
        experts, base = m.module, f"{self.prefix}.{m.name}"

        def forward(hidden_states, top_k_index, top_k_weights):
            valid = self.valid.reshape(-1) if self.valid is not None else None
            gate_up_qdq = self.activations.get((experts, "gate_up"))
            down_qdq = self.activations.get((experts, "down"))
            out = torch.zeros_like(hidden_states)
            inputs = gate_up_qdq(hidden_states) if gate_up_qdq else hidden_states
            with torch.no_grad():
                mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
            for e in range(experts.num_experts):
                top_k_pos, token_idx = torch.where(mask[e])
                if not token_idx.numel():
                    continue
                gate, up = torch.nn.functional.linear(inputs[token_idx], experts.gate_up_proj[e]).chunk(2, dim=-1)
                hidden = experts.act_fn(gate) * up
                if self.recording:
                    keep = valid[token_idx] if valid is not None else slice(None)
                    routed = hidden_states[token_idx][keep]
                    self.expert_tokens[e] += routed.shape[0]
                    for proj in ("gate_proj", "up_proj"):
                        self._record(f"{base}.{e}.{proj}", routed)
                    self._record(f"{base}.{e}.down_proj", hidden[keep])
                if down_qdq:
                    hidden = down_qdq(hidden)
                current = torch.nn.functional.linear(hidden, experts.down_proj[e])
                current = current * top_k_weights[token_idx, top_k_pos, None]
                out.index_add_(0, token_idx, current.to(out.dtype))
            return out
        return forward


def _experts_layout_problem(experts: torch.nn.Module) -> str | None:
    for attr, wrong in (("has_bias", True), ("is_transposed", True), ("has_gate", False)):
        if getattr(experts, attr, not wrong) == wrong:
            return f"{type(experts).__name__} {attr}={wrong}"
    if not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        return f"{type(experts).__name__} has no gate_up_proj / down_proj"
    return None


# --- the pass ------------------------------------------------------------------------------------------------------

class Source:
    """A bf16 (or block-FP8) checkpoint read tensor by tensor."""

    def __init__(self, folder: Path):
        try:
            self.checkpoint = Checkpoint.open(folder)
        except CheckpointError as exc:
            raise SensitivityError(str(exc)) from None
        self.folder = Path(folder)
        self.tensors = self.checkpoint.tensors()
        self.file_of = {name: file for file, header in self.checkpoint.headers.items() for name in header.tensors}
        qc = self.checkpoint.quantization_config
        self.codec = None
        if qc:
            if not (isinstance(qc, dict) and qc.get("quant_method") == "fp8"):
                raise SensitivityError(f"{self.checkpoint.quantization_config_source}: the sensitivity pass reads a "
                                       "bf16 or block-FP8 source; decode this one first (quantize --to bf16 SRC DST)")
            self.codec = CODECS["fp8"]
        self.family = family_for(self.checkpoint.config)
        self.layers = self.checkpoint.config_int(self.family.num_layers_key)

    def read(self, name: str, dtype: torch.dtype, device: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.checkpoint.path(self.file_of[name]), "pt", device="cpu") as f:
            tensor = f.get_tensor(name)
            scale = name + self.codec.scale_suffix if self.codec else None
            if scale and scale in self.file_of:
                with safe_open(self.checkpoint.path(self.file_of[scale]), "pt", device="cpu") as g:
                    tensor = self.codec.decode(tensor, g.get_tensor(scale), dtype)
        return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def _layer_state(source: Source, prefix: str, layer: torch.nn.Module, dtype: torch.dtype, device: str) -> dict:
    """The layer's state dict read from the shards; per-expert checkpoint tensors stacked into the fused experts
    parameters transformers builds (``gate_up_proj`` [E, 2I, H]: gate then up; ``down_proj`` [E, H, I])."""
    state = {}
    for key, tensor in layer.state_dict(keep_vars=True).items():
        name = f"{prefix}.{key}"
        if name in source.tensors:
            state[key] = source.read(name, dtype, device)
            continue
        experts, _, fused = key.rpartition(".")
        projections = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(fused)
        count = tensor.shape[0] if projections else 0
        names = [[f"{prefix}.{experts}.{e}.{p}.weight" for p in projections] for e in range(count)] if count else []
        if not names or any(n not in source.tensors for row in names for n in row):
            raise SensitivityError(f"{source.folder}: no tensor {name} (nor per-expert tensors to build it from) for "
                                   f"decoder layer {prefix}; the sensitivity pass reads checkpoints whose tensors "
                                   "transformers' model for the config loads")
        stacked = torch.empty(tensor.shape, dtype=dtype, device=device)  # filled expert by expert: no second copy
        for e, row in enumerate(names):
            stacked[e] = torch.cat([source.read(n, dtype, device) for n in row])
        state[key] = stacked
    return state


def layer_modules(layer: torch.nn.Module, prefix: str, family, num_layers: int) -> list[Module]:
    """The quantizable modules of a decoder layer (``prefix``: its checkpoint name, ``model.layers.1``), each with
    its role (``family.classify`` of its checkpoint weight) and the shapes of the checkpoint weights it holds."""
    found = []
    for name, module in layer.named_modules():
        checkpoint = f"{prefix}.{name}"
        if isinstance(module, torch.nn.Linear):
            role = family.classify(checkpoint + ".weight", num_layers)
            if role.linear and role.quantizable:
                found.append(Module(name, module, role.role, [checkpoint], [tuple(module.weight.shape)]))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
            if problem := _experts_layout_problem(module):
                raise SensitivityError(f"{checkpoint}: {problem}; the pass covers concatenated [gate; up] experts "
                                       "without bias")
            role = family.classify(f"{checkpoint}.0.gate_proj.weight", num_layers)
            if role.linear and role.quantizable:
                experts, inner, hidden = module.num_experts, module.down_proj.shape[2], module.down_proj.shape[1]
                names = [f"{checkpoint}.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
                shapes = [(inner, hidden), (inner, hidden), (hidden, inner)] * experts
                found.append(Module(name, module, role.role, names, shapes))
    return found


@dataclass
class Batch:
    hidden: torch.Tensor  # [batch, tokens, hidden]
    valid: torch.Tensor  # [batch, tokens] bool
    extra: dict = field(default_factory=dict)  # what the previous layer passes on (GLM-5: prev_topk_indices)


def _batches(source: Source, calibration: Calibration, *, max_tokens: int, batch_size: int, dtype, device):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.folder)
    except (OSError, ValueError) as exc:
        raise SensitivityError(f"{source.folder}: its tokenizer cannot be loaded ({exc}); the pass tokenizes the "
                               "calibration prompts with the checkpoint's own tokenizer") from None
    ids = [tokenizer(p)["input_ids"][:max_tokens] for p in calibration.prompts]
    ids.sort(key=len)  # similar lengths batch together: less padding
    embed_name = next((n for n in source.tensors if (r := source.family.classify(n, source.layers)).role == "embedding"
                       and r.layer is None), None)
    if embed_name is None:
        raise SensitivityError(f"{source.folder}: no embedding tensor (role embedding) to embed the prompts with")
    embed = source.read(embed_name, dtype, device)
    batches = []
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        width = max(map(len, chunk))
        tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(chunk), width, dtype=torch.bool, device=device)
        for row, seq in enumerate(chunk):
            tokens[row, :len(seq)] = torch.tensor(seq, device=device)
            valid[row, :len(seq)] = True
        batches.append(Batch(torch.nn.functional.embedding(tokens, embed), valid))
    return batches, sum(map(len, ids))


def _context(config, batch: Batch, rotary):
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(batch.hidden.shape[1], device=batch.hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=batch.hidden, attention_mask=None, cache=None,
                              position_ids=positions, allow_is_causal_skip=False)
    return {"attention_mask": mask, "position_ids": positions, "position_embeddings": rotary(batch.hidden, positions)}


def _run(layer, probe: Probe, batches: list[Batch], contexts: list[dict], passes_on: str | None):
    """The layer's output on every batch (and what it passes on to the next layer)."""
    outputs = []
    for batch, context in zip(batches, contexts):
        probe.valid = batch.valid
        out = layer(batch.hidden, **context, **batch.extra)
        hidden = out[0] if isinstance(out, tuple) else out
        extra = {passes_on: out[1]} if passes_on and isinstance(out, tuple) and len(out) > 1 else {}
        outputs.append(Batch(hidden, batch.valid, extra))
    probe.valid = None
    return outputs


def _relative_error(outputs: list[Batch], reference: list[Batch]) -> float:
    diff = sum(((o.hidden - r.hidden).float()[r.valid] ** 2).sum().item() for o, r in zip(outputs, reference))
    norm = sum((r.hidden.float()[r.valid] ** 2).sum().item() for r in reference)
    return (diff / norm) ** 0.5 if norm else 0.0


def _quantize_unit(modules: list[Module], probe: Probe, rung: str, rule: ScaleRule, cache: dict) -> list:
    """Put ``rung`` on a unit's modules: weights quantize-dequantized in place (their originals returned, to
    restore) and the activation functions set on the probe. ``cache``: weights already quantized for a rung
    of the same weight format (W4A4 and W4A8 store the same MXFP4 weights)."""
    originals, weights = [], RUNGS[rung].weight
    for key in [k for k in cache if k[1] != weights]:
        del cache[key]  # one weight format of one unit in memory at a time: a layer's experts are its largest part
    for m in modules:
        params = [m.module.weight] if isinstance(m.module, torch.nn.Linear) else \
            [m.module.gate_up_proj, m.module.down_proj]
        for param in params:
            originals.append((param, param.data))
            key = (id(param), weights)
            if key not in cache:
                cache[key] = _quantized_param(m, param, rung, rule)
            param.data = cache[key]
    for m in modules:
        if isinstance(m.module, torch.nn.Linear):
            probe.activations[m.module] = activation_qdq(rung, probe.amax.get(f"{probe.prefix}.{m.name}", 0.0))
            continue
        for kind, projection in (("gate_up", "gate_proj"), ("down", "down_proj")):
            amax = max((probe.amax.get(n, 0.0) for n in m.checkpoint if n.endswith(projection)), default=0.0)
            probe.activations[(m.module, kind)] = activation_qdq(rung, amax)  # the engines take the experts' max
    return originals


def _quantized_param(m: Module, param: torch.nn.Parameter, rung: str, rule: ScaleRule) -> torch.Tensor:
    """A parameter as the rung stores it: a Linear's weight whole; fused experts one expert (and, for gate_up,
    one projection: gate and up are separate checkpoint tensors with their own scales) at a time."""
    if isinstance(m.module, torch.nn.Linear):
        return weight_qdq(param.data, rung, rule)
    out = torch.empty_like(param.data)
    rows = param.shape[1] // (2 if param is m.module.gate_up_proj else 1)
    for e in range(param.shape[0]):
        for start in range(0, param.shape[1], rows):
            out[e, start:start + rows] = weight_qdq(param.data[e, start:start + rows], rung, rule)
    return out


def measure_layer(layer: torch.nn.Module, modules: list[Module], prefix: str, batches: list["Batch"],
                  contexts: list[dict], passes_on: str | None, rungs=MEASURED,
                  scale_rule: ScaleRule = ScaleRule.EVEN) -> tuple[list[dict], "Probe", list["Batch"]]:
    """One resident layer: its units' errors per rung, the probe holding its statistics, and its reference output
    (the next layer's input)."""
    probe = Probe(modules, prefix)
    probe.recording = True
    reference = _run(layer, probe, batches, contexts, passes_on)
    probe.recording = False
    for name in (n for m in modules for n in m.checkpoint):  # an expert no token was routed to: measured, on nothing
        probe.amax.setdefault(name, 0.0)
        probe.tokens.setdefault(name, 0)
    units, cache = [], {}
    for role in dict.fromkeys(m.role for m in modules):
        unit = [m for m in modules if m.role == role]
        errors = {}
        for rung in rungs:
            originals = _quantize_unit(unit, probe, rung, scale_rule, cache)
            errors[rung] = _relative_error(_run(layer, probe, batches, contexts, passes_on), reference)
            for param, data in originals:
                param.data = data
            probe.activations.clear()
        cache.clear()
        units.append({"layer": int(prefix.rpartition(".")[2]), "role": role, "mtp": False, "error": errors,
                      "bytes": unit_bytes([s for m in unit for s in m.shapes])})
    return units, probe, reference


def measure(src: Path, calibration: Calibration, *, rungs=MEASURED, scale_rule: ScaleRule = ScaleRule.EVEN,
            max_tokens: int = 512, batch_size: int = 16, device: str = "cpu",
            dtype: torch.dtype = torch.bfloat16, progress=None) -> dict:
    """The sidecar's content for checkpoint ``src`` (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    source = Source(src)
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # the classes and attention choice, no memory
    config = skeleton.config
    base = getattr(skeleton, skeleton.base_model_prefix)
    layer_class = type(base.layers[0])
    rotary = type(base.rotary_emb)(config=config).to(device)
    passes_on = "prev_topk_indices" if "prev_topk_indices" in inspect.signature(layer_class.forward).parameters \
        else None
    batches, tokens = _batches(source, calibration, max_tokens=max_tokens, batch_size=batch_size, dtype=dtype,
                               device=device)
    contexts = [_context(config, b, rotary) for b in batches]
    units, amax, counts, expert_tokens, rare, per_layer = [], {}, {}, {}, {}, []
    with torch.no_grad():
        for index in range(source.layers):
            layer_started = time.perf_counter()
            prefix = f"{source.family.layers_prefix}.{index}"
            with torch.device("meta"):
                layer = layer_class(config, index)
            layer.load_state_dict(_layer_state(source, prefix, layer, dtype, device), assign=True, strict=True)
            layer.eval()
            modules = layer_modules(layer, prefix, source.family, source.layers)
            layer_units, probe, reference = measure_layer(layer, modules, prefix, batches, contexts, passes_on,
                                                          rungs, scale_rule)
            units += layer_units
            amax.update(probe.amax)
            counts.update(probe.tokens)
            if probe.expert_tokens:
                expert_tokens[str(index)] = probe.expert_tokens
                even = sum(probe.expert_tokens) / len(probe.expert_tokens)
                rare[str(index)] = [e for e, n in enumerate(probe.expert_tokens) if n < RARE_SHARE * even]
            batches = reference
            del layer, probe, modules
            per_layer.append(round(time.perf_counter() - layer_started, 3))
            if progress:
                progress(index, per_layer[-1])
    peak_device = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return {
        "kind": KIND, "version": VERSION,
        "source": {"path": str(src), "config_sha256": sha256_of(source.checkpoint.config_path)},
        "calibration": {**calibration.to_dict(), "tokens": tokens, "max_tokens": max_tokens},
        "scale_rule": scale_rule.value, "dtype": str(dtype).removeprefix("torch."), "device": device,
        "rungs": list(rungs), "units": units, "amax": amax, "tokens": counts, "expert_tokens": expert_tokens,
        "rare_experts": rare, "seconds": round(time.perf_counter() - started, 3),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": peak_device, "seconds_per_layer": per_layer,
    }


def write_sensitivity(path: Path, data: dict) -> None:
    """The sidecar at ``path``, whole or not at all (validated against the schema first)."""
    validate(data, Sensitivity, path, "sensitivity file", SensitivityError, "a bug: report it")
    write_atomic(Path(path), json.dumps(data, indent=1) + "\n")


def run(src: Path, data: str, out: Path, *, items: int | None = 64, **options) -> Sensitivity:
    """Calibrate on ``data`` (``quant.calibration``), measure ``src`` and write the sidecar ``out``."""
    calibration = load_calibration(data, items)  # refused before any work when it overlaps evaluation items
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise SensitivityError(f"--out {out}: " + ("a folder; give the sidecar's file name, e.g. "
                               f"{out / 'sensitivity.json'}" if out.is_dir() else
                               f"its folder {out.parent} does not exist; create it first"))
    result = measure(Path(src), calibration, **options)
    write_sensitivity(out, result)
    return Sensitivity.model_validate(result)


def summary(sens: Sensitivity) -> str:
    lines = [f"{'layer':>5}  {'role':<14} " + " ".join(f"{r:>10}" for r in sens.rungs)]
    for u in sens.units:
        lines.append(f"{u.layer:>5}  {u.role:<14} " + " ".join(f"{u.error[r]:>10.4f}" for r in sens.rungs))
    for layer, experts in sens.rare_experts.items():
        if experts:
            counts = sens.expert_tokens[layer]
            lines.append(f"layer {layer}: experts rarely or never routed: " + ", ".join(
                f"{e} ({counts[e]} tokens)" for e in experts))
    lines.append(f"{sens.calibration['items']} prompts, {sens.calibration['tokens']} tokens; {sens.seconds:.1f} s, "
                 f"peak RSS {sens.peak_rss_bytes / 1e9:.2f} GB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quant.sensitivity", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a bf16 (or block-FP8) checkpoint folder")
    parser.add_argument("--calibration", required=True, metavar="DATA",
                        help="a JSONL file of prompts ('question' or 'text') or a benchmark (arith, gsm8k: its train "
                        "split)")
    parser.add_argument("--out", required=True, type=Path, help="the sidecar JSON to write")
    parser.add_argument("--items", type=int, default=64, help="calibration prompts to use (default 64)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per prompt at most (default 512)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--scale-rule", choices=[r.value for r in ScaleRule], default="even",
                        help="the MXFP4 weight scale rule the conversion will use")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        if args.items < 1 or args.max_tokens < 1 or args.batch_size < 1:
            raise SensitivityError("--items, --max-tokens and --batch-size take a positive count")
        sens = run(args.src, args.calibration, args.out, items=args.items, max_tokens=args.max_tokens,
                   batch_size=args.batch_size, scale_rule=ScaleRule(args.scale_rule), device=args.device,
                   dtype=getattr(torch, args.dtype),
                   progress=lambda i, s: print(f"layer {i}: {s:.2f} s", file=sys.stderr))
    except QuantgateError as exc:
        print(f"python -m quant.sensitivity: {exc}", file=sys.stderr)
        return exc.exit_code
    print(summary(sens))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
