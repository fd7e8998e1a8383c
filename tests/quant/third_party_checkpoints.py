"""Tiny compressed-tensors and ModelOpt checkpoints of the MoE families, quantized from a family's
tiny bf16 checkpoint (``family_checkpoints``).

compressed-tensors tensors are written by the compressed-tensors library itself (0.20.1: its
``calculate_qparams`` / ``generate_gparam`` for the scales, its registered compressor for the format).
ModelOpt's by nvidia-modelopt 0.47.0's own export functions (NVFP4: dequant = e2m1 * weight_scale *
weight_scale_2; FP8 per tensor / per channel / per 128x128 block: dequant = fp8 * weight_scale; MXFP8).

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
from quant.third_party import CT, FP8_BLOCK, FP8_CHANNEL, MODELOPT, MXFP8, NVFP4, Config, Scheme, parse
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
            step = scheme.block[1] if scheme.block else scheme.group or 1
            if tensor.shape[1] % step:  # the producers refuse (or pad) it: a test ignores such a module
                raise ValueError(f"{module} {list(tensor.shape)}: its columns are not a multiple of {step}; "
                                 "ignore it in the config")
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
    return _modelopt(scheme, weight)


def _modelopt(scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """nvidia-modelopt 0.47.0's own export of ``weight`` (torch/export/quant_utils.py ``to_quantized_weight``
    and the QTensor classes it calls), scales as its export computes them from the weight's amax."""
    from modelopt.torch.export.model_config import QUANTIZATION_FP8, QUANTIZATION_FP8_PC_PT
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP8QTensor, NVFP4QTensor

    if scheme.label == NVFP4:
        scale_2 = NVFP4QTensor.get_weights_scaling_factor_2(weight)
        scale, _ = NVFP4QTensor.get_weights_scaling_factor(weight, scheme.group, scale_2)
        codes = NVFP4QTensor.quantize(weight, scheme.group, scale, scale_2)[0]._quantized_data
        out = {"weight": codes, "weight_scale": scale, "weight_scale_2": scale_2.float().reshape(())}
    elif scheme.label == FP8_BLOCK:
        codes, scale = FP8QTensor.quantize(weight, block_sizes={-1: scheme.block[1], -2: scheme.block[0]})
        out = {"weight": codes._quantized_data, "weight_scale": scale.float()}
    elif scheme.label == MXFP8:
        codes, scale = MXFP8QTensor.quantize(weight)
        out = {"weight": codes._quantized_data, "weight_scale": scale}
    elif scheme.label == FP8_CHANNEL:
        scale = weight.float().abs().amax(dim=1) / FP8_MAX
        out = {"weight": to_quantized_weight(weight, scale, QUANTIZATION_FP8_PC_PT), "weight_scale": scale}
    else:
        scale = (weight.float().abs().amax() / FP8_MAX).reshape(())
        out = {"weight": to_quantized_weight(weight, scale, QUANTIZATION_FP8), "weight_scale": scale}
    if scheme.input_scale:
        out["input_scale"] = torch.tensor(0.05, dtype=torch.float32)
    return {k: v.contiguous() for k, v in out.items()}


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
