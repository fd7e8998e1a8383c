"""Tiny compressed-tensors and ModelOpt checkpoints of the MoE families, quantized from a family's
tiny bf16 checkpoint (``family_checkpoints``).

compressed-tensors tensors are written by the compressed-tensors library itself (0.20.1: its
``calculate_qparams`` / ``generate_gparam`` for the scales, its registered compressor for the format).
ModelOpt's are written from the format's definition (as vLLM's ModelOpt methods load them): NVFP4 as
compressed-tensors NVFP4 with the global scale stored inverted (``weight_scale_2`` = 1 / global scale,
dequant = e2m1 * weight_scale * weight_scale_2), FP8 per tensor / per channel / per 128x128 block as
``weight`` E4M3 and an F32 ``weight_scale`` (dequant = fp8 * scale).

``stored`` (module name -> Scheme or None) writes a module otherwise than the config says, as the
incidents' checkpoints are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from quant.layout import family_named
from quant.third_party import CT, FP8_BLOCK, FP8_CHANNEL, MODELOPT, NVFP4, Config, Scheme, parse
from tests.quant.family_checkpoints import write_family_checkpoint, write_shards

FP8_MAX = 448.0


def nvfp4_ct(scheme_targets=("Linear",), ignore=("lm_head", "re:.*mlp\\.gate$"), static_input=True) -> dict:
    """A compressed-tensors NVFP4 (W4A4) quantization_config as llm-compressor writes it."""
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
           "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "config_groups": {"group_0": {
                "targets": list(scheme_targets), "format": "nvfp4-pack-quantized", "weights": fp4,
                "input_activations": {**fp4, "dynamic": "local"} if static_input else None}}}


def int4_ct(group_size: int = 32, symmetric: bool = True, ignore=("lm_head", "re:.*mlp\\.gate$")) -> dict:
    """compressed-tensors W4A16 (pack-quantized INT4, group scales)."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
                "symmetric": symmetric, "dynamic": False}}}}


def fp8_ct(strategy: str = "channel", ignore=("lm_head", "re:.*mlp\\.gate$")) -> dict:
    """compressed-tensors FP8 (float-quantized; channel or 32x32 block weights, dynamic per-token activations)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [32, 32]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}}}}


def modelopt_config(algo: str = "NVFP4", exclude=("lm_head", "*.mlp.gate")) -> dict:
    """An hf_quant_config.json of ModelOpt (its layout up to 0.29; later exports copy it into config.json)."""
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": list(exclude)}
    if algo == "NVFP4":
        quantization["group_size"] = 16
    return {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}


def write_third_party(dst: Path, family: str, qconfig: dict, *, hf_quant_config_only: bool = False,
                      stored: Callable[[str], Scheme | None] | None = None, num_hidden_layers: int = 3,
                      seed: int = 0) -> Path:
    """``family``'s tiny checkpoint quantized as ``qconfig`` says (compressed-tensors, or ModelOpt's
    hf_quant_config.json content), written into ``dst``: config.json's quantization_config, or with
    ``hf_quant_config_only`` hf_quant_config.json alone, as ModelOpt up to 0.29 exports."""
    dst = write_family_checkpoint(dst, family, num_hidden_layers=num_hidden_layers, seed=seed)
    fmt = MODELOPT if "producer" in qconfig or str(qconfig.get("quant_method", "")).startswith("modelopt") else CT
    config: Config = parse(fmt, qconfig)
    spec = family_named(family)
    tensors = {}
    for file in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    out = {}
    for name, tensor in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        role = spec.classify(name, num_hidden_layers)
        scheme = (stored or config.resolve)(module) if role.linear and tensor.dim() == 2 else None
        if scheme is None:
            out[name] = tensor
        else:
            out.update({f"{module}.{suffix}": t for suffix, t in quantized(scheme, tensor).items()})
    write_shards(out, dst)
    saved = json.loads((dst / "config.json").read_text())
    if hf_quant_config_only:
        (dst / "hf_quant_config.json").write_text(json.dumps(qconfig, indent=2))
    else:
        saved["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(saved, indent=2))
    return dst


def quantized(scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors ``scheme`` stores for one bf16 ``weight`` [out, in]."""
    if scheme.fmt == CT:
        return _ct(scheme, weight)
    if scheme.label == NVFP4:
        ct = _ct(Scheme(CT, NVFP4, "nvfp4-pack-quantized", 4, "tensor_group", scheme.group), weight)
        out = {"weight": ct["weight_packed"], "weight_scale": ct["weight_scale"],
               "weight_scale_2": (1 / ct["weight_global_scale"]).reshape(())}
        if scheme.input_scale:
            out["input_scale"] = torch.tensor(0.05, dtype=torch.float32)
        return out
    w = weight.float()
    if scheme.label == FP8_CHANNEL:
        scale = w.abs().amax(dim=1) / FP8_MAX
        codes = w / scale[:, None]
    elif scheme.label == FP8_BLOCK:
        rows, cols = scheme.block
        pad = torch.nn.functional.pad(w, (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
        blocks = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        codes = w / scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:w.shape[0], :w.shape[1]]
    else:
        scale = (w.abs().amax() / FP8_MAX).reshape(())
        codes = w / scale
    out = {"weight": codes.to(torch.float8_e4m3fn), "weight_scale": scale.to(torch.float32)}
    if scheme.input_scale:
        out["input_scale"] = torch.tensor(0.05, dtype=torch.float32)
    return out


def _ct(scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantization of ``weight``: its scales and its compressor's tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    kind = "int" if scheme.label.startswith("int") else "float"
    args = QuantizationArgs(num_bits=scheme.bits, type=kind, strategy=scheme.strategy, symmetric=scheme.symmetric,
                            group_size=scheme.group, block_structure=list(scheme.block) if scheme.block else None)
    activations = None
    if scheme.input_scale == "input_global_scale":
        activations = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                                       dynamic="local")
    qscheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=activations)
    w = weight.float()
    out_features, in_features = w.shape
    if scheme.strategy in ("group", "tensor_group"):
        view = w.reshape(out_features, in_features // scheme.group, scheme.group)
        lo, hi = view.amin(-1), view.amax(-1)
    elif scheme.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif scheme.strategy == "block":
        rows, cols = scheme.block
        view = w.reshape(out_features // rows, rows, in_features // cols, cols)
        lo, hi = view.amin((1, 3)), view.amax((1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    state = {"weight": weight}
    global_scale = None
    if scheme.strategy == "tensor_group":
        global_scale = generate_gparam(w.amin(), w.amax())
        state["weight_global_scale"] = global_scale
    lo, hi = torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))  # as its observers
    scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale.to(weight.dtype) if scheme.label != NVFP4 else scale
    if not scheme.symmetric:
        state["weight_zero_point"] = zero_point
    compressor = BaseCompressor.get_value_from_registry(scheme.storage)
    out = dict(compressor.compress(state, qscheme))
    if scheme.input_scale == "input_global_scale":
        out["input_global_scale"] = torch.tensor([20.0], dtype=torch.float32)
    elif scheme.input_scale:
        out["input_scale"] = torch.tensor([0.05], dtype=weight.dtype)
    return {k: v.contiguous() for k, v in out.items()}
