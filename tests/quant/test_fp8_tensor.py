"""Per-tensor FP8 (the W8A8 rung's weights, the W4A8/W8A8 static activations) against AMD Quark 0.13 itself
and the engines' own activation quantization, and what Quark exports for W4A8 and W8A8 Linears."""

from __future__ import annotations

import ast
import json
import logging
import typing

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quant.errors import NonFiniteError
from quant.formats import fp8_tensor
from quant.formats.codecs import get_codec
from quant.rungs import (
    INPUT_SCALE,
    RUNGS,
    SCALAR_DTYPE,
    SCALAR_SHAPE,
    rung_of_spec,
    stored_rung,
)
from quant.safetensors_io import TensorInfo

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def quark_fp8(tmp_path_factory):
    return quark_export(tmp_path_factory.mktemp("quark"), "fp8")


@pytest.fixture(scope="module")
def quark_w4a8(tmp_path_factory):
    return quark_export(tmp_path_factory.mktemp("quark"), "mxfp4_fp8")


def quark_export(tmp_path, scheme: str):
    """A one-layer bf16 Llama quantized by Quark 0.13 (``ModelQuantizer`` calibrated on 4 random prompts,
    ``export_safetensors``) with its template ``scheme``. Returns (source weights, each Linear's input amax
    seen in calibration, exported tensors as (safetensors dtype, shape, tensor), the layer spec Quark wrote,
    the exported folder)."""
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("quark").setLevel(logging.WARNING)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    calibration = [torch.randint(0, 128, (1, 16)) for _ in range(4)]
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith(LINEARS):
            def record(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for ids in calibration:
            model(ids)
    for hook in hooks:
        hook.remove()
    quant_config = LLMTemplate.get("llama").get_config(scheme=scheme, exclude_layers=["lm_head"])
    model = ModelQuantizer(quant_config).quantize_model(model, calibration)
    export_safetensors(model, str(tmp_path / scheme))
    tensors = {}
    for path in (tmp_path / scheme).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            tensors.update({n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()), f.get_tensor(n))
                            for n in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    qconfig = json.loads((tmp_path / scheme / "config.json").read_text())["quantization_config"]
    return source, amax, tensors, qconfig["global_quant_config"], tmp_path / scheme


def infos(tensors) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, dtype, shape, 0, 0) for n, (dtype, shape, _) in tensors.items()}


def test_w8a8_bytes_names_and_scalars_equal_quark(quark_fp8):
    source, amax, tensors, spec, _ = quark_fp8
    codec = get_codec(RUNGS["fp8"].weight)
    assert rung_of_spec(spec) == "fp8" and RUNGS["fp8"].spec() == spec
    for linear in LINEARS:
        module = f"model.layers.0.{'mlp' if linear in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{linear}"
        weight = source[module + ".weight"]
        assert {n for n in tensors if n.startswith(module + ".")} == {
            module + s for s in (".weight", ".weight_scale", INPUT_SCALE)}
        assert tensors[module + ".weight"][:2] == ("F8_E4M3", tuple(weight.shape))
        assert tensors[module + ".weight_scale"][:2] == tensors[module + INPUT_SCALE][:2] == (SCALAR_DTYPE,
                                                                                            SCALAR_SHAPE)
        assert stored_rung(infos(tensors), module) == "fp8"
        # the torch reference: Quark's scale and codes, bit for bit
        scale = fp8_tensor.weight_scale(weight)
        assert scale.view(torch.int16) == tensors[module + ".weight_scale"][2].view(torch.int16)
        assert torch.equal(fp8_tensor.quantize(weight, scale).view(torch.uint8),
                           tensors[module + ".weight"][2].view(torch.uint8))
        # the executor's path: amax over row chunks, then each chunk encoded with the one scale
        raw = weight.view(torch.uint8).numpy()
        chunks = [raw[i:i + 24] for i in range(0, raw.shape[0], 24)]
        scale_value = codec.scale_of(max(codec.amax(c, "BF16", row0=24 * i) for i, c in enumerate(chunks)))
        encoded = [codec.encode(c, "BF16", row0=24 * i, scale=scale_value) for i, c in enumerate(chunks)]
        assert np.array_equal(np.concatenate([e.weight for e in encoded]),
                              tensors[module + ".weight"][2].view(torch.uint8).numpy())
        assert np.concatenate([e.scales for e in encoded]).tobytes() == \
            tensors[module + ".weight_scale"][2].reshape(1).view(torch.uint8).numpy().tobytes()
        # the static input scale: amax / 448 of what reached the Linear in calibration, as Quark stores it
        assert fp8_tensor.scale_of(amax[module]).view(torch.int16) == tensors[module + INPUT_SCALE][2].view(torch.int16)


def test_w4a8_names_and_scalars_equal_quark(quark_w4a8):
    source, amax, tensors, spec, _ = quark_w4a8
    assert rung_of_spec(spec) == "mxfp4_fp8" and RUNGS["mxfp4_fp8"].spec() == spec
    mxfp4 = get_codec(RUNGS["mxfp4_fp8"].weight)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        out, inputs = source[module + ".weight"].shape
        assert {n: t[:2] for n, t in tensors.items() if n.startswith(module + ".")} == {
            module + ".weight": ("U8", (out, inputs // 2)), module + ".weight_scale": ("U8", (out, inputs // 32)),
            module + INPUT_SCALE: (SCALAR_DTYPE, SCALAR_SHAPE)}
        assert stored_rung(infos(tensors), module) == "mxfp4_fp8"
        packed, scales = mxfp4.quantize(source[module + ".weight"])
        assert torch.equal(packed, tensors[module + ".weight"][2])
        assert torch.equal(scales, tensors[module + ".weight_scale"][2])
        assert fp8_tensor.scale_of(amax[module]).view(torch.int16) == tensors[module + INPUT_SCALE][2].view(torch.int16)


@pytest.mark.parametrize("export", ["quark_fp8", "quark_w4a8"])
def test_quark_exports_pass_the_rung_layout_check_and_their_scales_are_read(export, request):
    """gate checkpoint's rung layout check and the emulation's scale reader take Quark's bf16 scalars."""
    from evals.served import _scalars
    from quant.checkpoint import Checkpoint
    from quant.verify import _rung_findings

    _, amax, tensors, _, folder = request.getfixturevalue(export)
    assert _rung_findings(infos(tensors)) == []
    scales = _scalars(Checkpoint.open(folder), {m + INPUT_SCALE for m in amax})
    assert scales == {m + INPUT_SCALE: float(fp8_tensor.scale_of(a)) for m, a in amax.items()}


def test_stored_rung_reads_float32_and_shape_one_scalars_the_engines_also_load():
    tensors = {"m.weight": TensorInfo("m.weight", "F8_E4M3", (8, 32), 0, 0),
               "m.weight_scale": TensorInfo("m.weight_scale", "F32", (1,), 0, 0),
               "m.input_scale": TensorInfo("m.input_scale", "F32", (), 0, 0)}
    assert stored_rung(tensors, "m") == "fp8"
    tensors["m.input_scale"] = TensorInfo("m.input_scale", "U8", (), 0, 0)
    assert stored_rung(tensors, "m") == ""


def every_bf16() -> torch.Tensor:
    """Every finite bf16 value, [256, 256] (NaN/Inf patterns set to zero)."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


@pytest.mark.parametrize("amax", [448.0, 1.0, 3.1e-5, 7.5e10, 2.0 ** -120, 0.0])
def test_numba_kernel_equals_the_reference_on_every_bf16_value(amax):
    x, codec = every_bf16(), get_codec("fp8_tensor")
    scale = fp8_tensor.scale_of(amax)
    out = codec.encode(x.view(torch.uint8).numpy(), "BF16", scale=float(scale))
    assert np.array_equal(out.weight, fp8_tensor.quantize(x, scale).view(torch.uint8).numpy())
    assert out.err_sq > 0 and out.ref_sq > 0  # the sampled rows were measured


def test_decode_bytes_equals_the_reference_decode():
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    codec = get_codec("fp8_tensor")
    codes, scale = codec.quantize(x)
    fast = codec.decode_bytes(codes.numpy(), scale.reshape(1).view(torch.uint8).numpy())
    assert np.array_equal(fast, codec.decode(codes, scale.reshape(1)).view(torch.uint8).numpy())
    assert float((codec.decode(codes, scale.reshape(1)).float() - x.float()).norm() / x.float().norm()) < 0.05


def test_outputs_are_the_weight_and_a_bf16_scalar_scale():
    assert get_codec("fp8_tensor").outputs("m.weight", (16, 64)) == (("m.weight", "F8_E4M3", (16, 64)),
                                                                      ("m.weight_scale", "BF16", ()))


def test_non_finite_weights_and_scales_are_refused_by_name():
    x = torch.ones(40, 64, dtype=torch.bfloat16)
    x[33, 5] = float("nan")
    codec = get_codec("fp8_tensor")
    with pytest.raises(NonFiniteError, match="row 35, column 5"):
        codec.amax(x.view(torch.uint8).numpy()[1:], "BF16", row0=3)
    with pytest.raises(NonFiniteError, match="row 33, column 5"):
        codec.encode(x.view(torch.uint8).numpy(), "BF16", scale=1.0)
    with pytest.raises(NonFiniteError, match="row 33, column 5"):
        fp8_tensor.weight_scale(x)
    with pytest.raises(NonFiniteError, match="amax inf"):
        fp8_tensor.scale_of(float("inf"))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(NonFiniteError, match="input_scale"):
            fp8_tensor.fp8_static_qdq(torch.ones(2, 4), bad)
    with pytest.raises(ValueError, match="scale=scale_of"):
        codec.encode(x.view(torch.uint8).numpy()[:2], "BF16")


def activations() -> tuple[torch.Tensor, torch.Tensor]:
    """A million bf16 activations with outliers past the calibrated amax (so clamping is exercised), and the
    static scale of the calibrated amax."""
    x = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(2)) * 3
    x[::97, ::13] *= 40
    return x.to(torch.bfloat16), fp8_tensor.scale_of(20.0)


def test_static_qdq_equals_vllm_0_33_quant_fp8_forward_native():
    """vLLM's own ``QuantFP8.forward_native`` (static, per tensor), run from the 0.33.0 wheel."""
    from types import SimpleNamespace

    from tests.quant.engine_sources import WheelUnavailable, load, methods, wheel

    try:
        whl = wheel("vllm", "0.33.0")
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    utils = load(whl, "vllm/model_executor/layers/quantization/utils/quant_utils.py",
                 ["_GroupShape", "GroupShape", "group_broadcast", "prep_scale_for_group_broadcast"],
                 extra={"torch": torch, "NamedTuple": typing.NamedTuple, "ClassVar": typing.ClassVar})
    holder = methods(whl, "vllm/model_executor/layers/quantization/input_quant_fp8.py", "QuantFP8",
                     ["forward_native"], extra={"torch": torch, "F": torch.nn.functional, **utils,
                                                "_FP8_DTYPE": torch.float8_e4m3fn, "_FP8_MIN": -448.0,
                                                "_FP8_MAX": 448.0, "_FP8_MIN_SCALING_FACTOR": 1 / (448 * 512)})["cls"]
    op = SimpleNamespace(is_group_quant=False, static=True, group_shape=utils["GroupShape"](-1, -1),
                         num_token_padding=None)
    x, scale = activations()
    codes, used = holder.forward_native(op, x, scale.to(torch.float32).reshape(1))
    assert torch.equal(fp8_tensor.fp8_static_qdq(x, scale), (codes.to(torch.float32) * used).to(torch.bfloat16))


def test_static_qdq_equals_sglang_0_5_23_native_static_quant_fp8():
    """sglang's ROCm fallback ``_native_static_quant_fp8`` (it divides where the Triton/CUDA kernels multiply by
    the reciprocal), run from the 0.5.23 wheel: the same codes on these activations."""
    from tests.quant.engine_sources import WheelUnavailable, parsed, wheel

    try:
        whl = wheel("sglang", "0.5.23")
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    tree = parsed(whl, "sglang/kernels/ops/quantization/fp8_kernel.py")
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_native_static_quant_fp8")
    ns = {"torch": torch, "fp8_min": -448.0, "fp8_max": 448.0, "fp8_dtype": torch.float8_e4m3fn}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), whl.name, "exec"), ns)  # noqa: S102 (the engine's code)
    x, scale = activations()
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    ns["_native_static_quant_fp8"](codes, x, scale.to(torch.float32).reshape(1))
    assert torch.equal(fp8_tensor.fp8_static_qdq(x, scale), (codes.to(torch.float32) * scale.float()).to(x.dtype))


def test_static_qdq_clamps_past_the_calibrated_amax():
    scale = fp8_tensor.scale_of(20.0)  # bf16(20 / 448): the largest code is 448 times it, a hair above 20
    top = 448 * float(scale)
    x = torch.tensor([[0.0, -top, 50.0, -1e6]])
    assert fp8_tensor.fp8_static_qdq(x, scale).tolist()[0] == [0.0, -top, top, -top]
