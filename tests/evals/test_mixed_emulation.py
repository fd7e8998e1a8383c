"""A per-layer (mixed) Quark checkpoint evaluated as served: each module at the rung its tensors show (W4A4,
W4A8, W8A8, bf16), static FP8 activation scales and FP8 weight scales collapsed as vLLM 0.33.0 and sglang
0.5.23 collapse them (evals/served.py cites where)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals.bundle import pair, read_bundle
from evals.emulation import load_model
from evals.errors import BadInput
from quant.formats import fp8_tensor
from quant.formats.codecs import get_codec
from quant.rungs import FP8_MAX, RUNGS
from tests.evals.test_emulation import convert, logits
from tests.evals.test_run import GEN, data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.test_mixed_convert import linear_modules, quantize, write_sidecar

E4M3 = torch.float8_e4m3fn
LAYER0 = "model.layers.0.mlp"
EXPERTS = 4


def fp8_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 e4m3 as Quark writes it: one bf16 scale (amax / 448) for the whole tensor."""
    scale = fp8_tensor.weight_scale(weight)
    return fp8_tensor.quantize(weight, scale), scale


def fp8_qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The engines' static activation quantization, written out: x times the float32 reciprocal of s, clamped
    to +-448, e4m3, times s (vLLM QuantFP8.forward_native, sglang _static_quant_fp8)."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (x.float() * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * s


def w4a8_linear_qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM 0.33.0 QuarkW4A8_MXFP4_FP8._apply_emulation's, written out: x / s in x's dtype, clamp, e4m3, times s."""
    s = torch.tensor(scale, dtype=torch.float32)
    return ((x / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3).to(x.dtype) * s).to(x.dtype)


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


# the hand-written checkpoint's static activation scales: they differ per module so the collapse shows
GATE_IN, UP_IN, DOWN_IN = (float(scalar(v)) for v in (0.011, 0.017, 0.013))  # as stored: F32


def expert_input_scale(layer: int, expert: int, projection: str) -> float:
    """As stored: an F32 value."""
    return float(scalar((0.002 if projection == "down_proj" else 0.003) * (expert + 1) * layer))


def write_mixed(bf16: Path, w4a4: Path, dst: Path) -> Path:
    """The W4A4 conversion rewritten by hand into a mixed one: layer 1's routed experts FP8 W8A8, layer 2's
    W4A8, the dense layer 0's gate/up FP8 W8A8 (two weight scales, two input scales: one fused gate_up_proj
    when served) and its down_proj W4A8; the rest as converted. One shard, no manifest (hand-written)."""
    source = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        source.update(load_file(shard))
    tensors = {}
    for shard in sorted(w4a4.glob("*.safetensors")):
        tensors.update(load_file(shard))
    mxfp4 = get_codec("mxfp4")
    for layer in (1, 2):
        for expert in range(EXPERTS):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                module = f"model.layers.{layer}.mlp.experts.{expert}.{projection}"
                if layer == 1:
                    tensors[module + ".weight"], tensors[module + ".weight_scale"] = \
                        fp8_encode(source[module + ".weight"])
                # gate and up of one expert share their input, so they share its scale (as measured)
                tensors[module + ".input_scale"] = scalar(expert_input_scale(layer, expert, projection))
    for projection, input_scale in (("gate_proj", GATE_IN), ("up_proj", UP_IN)):
        module = f"{LAYER0}.{projection}"
        tensors[module + ".weight"], tensors[module + ".weight_scale"] = fp8_encode(source[module + ".weight"])
        tensors[module + ".input_scale"] = scalar(input_scale)
    down = f"{LAYER0}.down_proj"
    del tensors[down + ".weight"]
    tensors[down + ".weight"], tensors[down + ".weight_scale"] = mxfp4.quantize(source[down + ".weight"].float())
    tensors[down + ".input_scale"] = scalar(DOWN_IN)

    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (w4a4 / name).exists():
            (dst / name).write_bytes((w4a4 / name).read_bytes())
    config = json.loads((w4a4 / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [name for name in qc["exclude"] if not name.startswith(LAYER0 + ".")]
    qc["layer_quant_config"] = {
        "model.layers.1.mlp.experts*": RUNGS["fp8"].spec(),
        "model.layers.2.mlp.experts*": RUNGS["mxfp4_fp8"].spec(),
        f"{LAYER0}.gate_proj": RUNGS["fp8"].spec(), f"{LAYER0}.up_proj": RUNGS["fp8"].spec(),
        f"{LAYER0}.down_proj": RUNGS["mxfp4_fp8"].spec(),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def mixed(glm_ckpt, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("mixed")
    return write_mixed(glm_ckpt, convert(glm_ckpt, tmp / "w4a4", "mxfp4"), tmp / "mixed")


def capture(module, store: dict):
    """A module's raw input (before the emulation's own pre-hook) and its output."""
    module.register_forward_pre_hook(lambda m, args: store.setdefault("x", args[0]), prepend=True)
    module.register_forward_hook(lambda m, args, out: store.setdefault("out", out))


def test_each_module_is_emulated_at_its_stored_rung(mixed):
    model, record = load_model(mixed, dtype=torch.float32)
    assert record["scheme"] == "W4A4+W4A8+W8A8" and record["per_layer"]
    # the MTP layer's (3) experts stay W4A4; layer 0's down_proj and layer 2's experts W4A8; gate/up and layer 1 W8A8
    assert record["rungs"] == {"mxfp4": 3 * EXPERTS, "mxfp4_fp8": 1 + 3 * EXPERTS, "fp8": 2 + 3 * EXPERTS}
    assert {f"{LAYER0}.gate_proj", f"{LAYER0}.down_proj"} <= set(record["modules"]["linear"])
    layer1, layer2 = (model.get_submodule(f"model.layers.{n}.mlp.experts") for n in (1, 2))
    # one static scale per layer for the experts' gate/up input and one for their down input: the largest
    for layer, experts in ((1, layer1), (2, layer2)):
        assert experts.quantgate_qdq.scale == max(expert_input_scale(layer, e, "up_proj") for e in range(EXPERTS))
        assert experts.quantgate_qdq_down.scale == max(expert_input_scale(layer, e, "down_proj")
                                                       for e in range(EXPERTS))
    assert record["modules"]["not_loaded_by_transformers"] == ["model.layers.3.mlp.experts"]


def test_a_fused_fp8_linear_computes_the_engines_formula(mixed):
    """Layer 0's gate_proj, FP8 W8A8, fused with up_proj into gate_up_proj when served: its weight requantized
    to max(gate, up) weight scale (requantize_with_max_scale), its input quantized with max(gate, up) input
    scale; the W4A8 down_proj: MXFP4 weights, its own static input scale."""
    model, _ = load_model(mixed, dtype=torch.float32)
    stored = load_file(mixed / "model.safetensors")
    gate, down = {}, {}
    capture(model.get_submodule(f"{LAYER0}.gate_proj"), gate)
    capture(model.get_submodule(f"{LAYER0}.down_proj"), down)
    logits(model)

    scales = {p: float(stored[f"{LAYER0}.{p}.weight_scale"]) for p in ("gate_proj", "up_proj")}
    served = max(scales.values())
    assert scales["gate_proj"] != scales["up_proj"]
    dequantized = stored[f"{LAYER0}.gate_proj.weight"].to(torch.float16) * scalar(scales["gate_proj"])
    weight = fp8_qdq(dequantized.float(), served)
    expected = torch.nn.functional.linear(fp8_qdq(gate["x"], max(GATE_IN, UP_IN)), weight)
    assert torch.equal(gate["out"], expected)

    weight = get_codec("mxfp4").decode(stored[f"{LAYER0}.down_proj.weight"], stored[f"{LAYER0}.down_proj.weight_scale"],
                                       torch.float32)
    assert torch.equal(down["out"], torch.nn.functional.linear(w4a8_linear_qdq(down["x"], DOWN_IN), weight))


def test_fp8_experts_decode_with_gate_and_up_at_one_scale(mixed):
    """An FP8 expert's gate and up halves of gate_up_proj requantized to the larger of its two scales (the MoE
    methods' w13_weight_scale.max(dim=1)); down_proj decoded with its own."""
    model, _ = load_model(mixed, dtype=torch.float32)
    stored = load_file(mixed / "model.safetensors")
    experts = model.get_submodule("model.layers.1.mlp.experts")
    for e in range(EXPERTS):
        name = f"model.layers.1.mlp.experts.{e}"
        scales = {p: stored[f"{name}.{p}.weight_scale"] for p in ("gate_proj", "up_proj")}
        served = float(max(scales.values()))
        halves = []
        for p in ("gate_proj", "up_proj"):
            dequantized = stored[f"{name}.{p}.weight"].to(torch.float16) * scales[p].float()
            halves.append(fp8_qdq(dequantized.float(), served))
        assert torch.equal(experts.gate_up_proj[e], torch.cat(halves))
        down = stored[f"{name}.down_proj.weight"].float() * stored[f"{name}.down_proj.weight_scale"].float()
        assert torch.equal(experts.down_proj[e], down)


def test_evals_run_evaluates_a_mixed_checkpoint_and_pairs_with_bf16(glm_ckpt, mixed, data_dir, tmp_path):
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 2, *GEN]
    assert run_cli("--out", tmp_path / "bf16", "--model", glm_ckpt, *common) == 0
    assert run_cli("--out", tmp_path / "mixed", "--model", mixed, *common) == 0
    run, rows = read_bundle(tmp_path / "mixed")
    emulation = run["local"]["emulation"]
    assert emulation["scheme"] == "W4A4+W4A8+W8A8" and emulation["rungs"]["fp8"] == 2 + 3 * EXPERTS
    assert emulation["modules"]["experts"] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    assert len(pair(read_bundle(tmp_path / "bf16")[1], rows)) == 4


def edited(mixed: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of the mixed checkpoint with some tensors / its quantization_config changed."""
    dst.mkdir()
    for path in mixed.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    if tensors:
        stored = load_file(mixed / "model.safetensors")
        tensors(stored)
        save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        data = json.loads((mixed / "config.json").read_text())
        config(data["quantization_config"])
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def _zero_scale(t):
    t[f"{LAYER0}.up_proj.input_scale"] = scalar(0.0)


def _no_input_scale(t):
    del t[f"{LAYER0}.up_proj.input_scale"]


def _two_rungs_in_one_layer(t):
    del t["model.layers.2.mlp.experts.3.down_proj.input_scale"]


def _unknown_spec(qc):
    qc["layer_quant_config"]["model.layers.1.mlp.experts*"]["weight"]["dtype"] = "int8"


def _rung_not_in_config(qc):
    del qc["layer_quant_config"][f"{LAYER0}.down_proj"]
    qc["layer_quant_config"]["model.layers.2.mlp.experts*"] = RUNGS["fp8"].spec()


@pytest.mark.parametrize("tensors,config,named", [
    (_zero_scale, None, f"{LAYER0}.up_proj.input_scale is 0.0"),
    (_no_input_scale, None, f"{LAYER0}.up_proj.weight (F8_E4M3)"),
    (_two_rungs_in_one_layer, None, "model.layers.2.mlp.experts: the checkpoint stores this layer's experts"),
    (None, _unknown_spec, "layer_quant_config['model.layers.1.mlp.experts*'] (dtypes {'weight': 'int8'"),
    (None, _rung_not_in_config, f"{LAYER0}.down_proj is stored as mxfp4_fp8"),
])
def test_what_the_emulation_cannot_serve_is_refused_by_name(mixed, tmp_path, tensors, config, named):
    with pytest.raises(BadInput) as refused:  # EmulationRefused (a scheme) or MixedRefused (a tensor)
        load_model(edited(mixed, tmp_path / "edited", tensors, config))
    assert named in str(refused.value)


def test_evals_run_refuses_a_bad_static_scale_in_one_line(mixed, data_dir, tmp_path, capsys):
    ckpt = edited(mixed, tmp_path / "edited", _zero_scale)
    out = tmp_path / "refused"
    assert run_cli("--out", out, "--model", ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 1) == 2
    err = capsys.readouterr().err
    assert f"{LAYER0}.up_proj.input_scale is 0.0" in err and "Traceback" not in err and not (out / "run.json").exists()


RECIPE = """name: mixed
format: mxfp4
rules:
  - {role: routed_expert, layers: [1], action: quantize, format: fp8}
  - {role: routed_expert, layers: [2], action: quantize, format: mxfp4_fp8}
  - {role: routed_expert, action: quantize}
  - {role: dense_mlp, layers: [0], action: quantize, format: fp8}
  - {role: shared_expert, action: keep}
"""


def test_a_converted_mixed_recipe_is_evaluated_as_served(glm_ckpt, data_dir, tmp_path):
    """The converter's own output (layer 1's experts FP8, layer 2's W4A8, the dense MLP FP8, static scales from
    a sensitivity file's amax), evaluated by `evals run --model` in a real process: each module at its rung,
    gate and up (one fused gate_up_proj when served) at the larger of their measured scales."""
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    modules = linear_modules(glm_ckpt)
    amax = {m: 1.0 + i / 10 for i, m in enumerate(modules)}  # every module's own, so the collapse shows
    sidecar = write_sidecar(tmp_path / "sensitivity.json", modules, amax=amax.__getitem__)
    ckpt = tmp_path / "mixed"
    converted = quantize("--recipe", tmp_path / "recipe.yaml", "--sensitivity", sidecar, glm_ckpt, ckpt)
    assert converted.returncode == 0, converted.stderr

    model, record = load_model(ckpt)
    assert record["rungs"] == {"mxfp4": 3 * EXPERTS, "mxfp4_fp8": 3 * EXPERTS, "fp8": 3 + 3 * EXPERTS}
    gate_up = float(fp8_tensor.scale_of(max(amax[f"{LAYER0}.gate_proj"], amax[f"{LAYER0}.up_proj"])))
    for projection in ("gate_proj", "up_proj"):
        served = model.get_submodule(f"{LAYER0}.{projection}")._forward_pre_hooks
        assert [hook.qdq.scale for hook in served.values()] == [gate_up]

    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-c", "import sys; from evals.cli import evals_main; sys.exit(evals_main())",
                          "run", "--model", str(ckpt), "--out", str(out),
                          "--benchmarks", "gsm8k", "--data-dir", str(data_dir), "--limit", "2", *GEN],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert read_bundle(out)[0]["local"]["emulation"]["scheme"] == "W4A4+W4A8+W8A8"


# --- the engines' own code, run from the vLLM 0.33.0 wheel (tests/quant/engine_sources.py) -------------------------

VLLM = "vllm/model_executor/layers/quantization"


def _replace_parameter(layer, name, value):
    """vllm/model_executor/utils.py replace_parameter, as it acts on these plain tensors."""
    setattr(layer, name, torch.nn.Parameter(torch.as_tensor(value), requires_grad=False))


def test_a_w4a8_linear_is_emulated_as_vllms_scheme_computes_it(monkeypatch):
    """QuarkW4A8_MXFP4_FP8.process_weights_after_loading (a fused module's input scales -> their max) and
    _apply_emulation, run from the wheel, on a fused q/k/v of three stored input scales: equal, bit for bit in
    bf16, to the emulation's decode and StaticFP8 at the largest scale."""
    from types import ModuleType, SimpleNamespace

    from evals.emulation import StaticFP8, decode_weight
    from tests.quant import engine_sources

    mxfp4 = get_codec("mxfp4")
    utils = ModuleType("mxfp4_utils")  # the weight side: the engines' MXFP4 decode (bit-exact, tested elsewhere)
    utils.dequant_mxfp4 = lambda w, s, dtype: mxfp4.decode(w, s, dtype)
    monkeypatch.setitem(sys.modules, f"{VLLM.replace('/', '.')}.utils.mxfp4_utils", utils)
    scheme = engine_sources.methods(
        engine_sources.wheel("vllm", "0.33.0"), f"{VLLM}/quark/schemes/quark_w4a8_mxfp4_fp8.py", "QuarkW4A8_MXFP4_FP8",
        ["process_weights_after_loading", "_apply_emulation"],
        {"torch": torch, "F": torch.nn.functional, "replace_parameter": _replace_parameter})
    cls = scheme["cls"]
    this = SimpleNamespace(fp8_min=-FP8_MAX, fp8_max=FP8_MAX, fp8_dtype=E4M3)

    gen = torch.Generator().manual_seed(0)
    weight, scales = mxfp4.quantize(torch.randn(96, 64, generator=gen))
    stored = [0.004, 0.0075, 0.006]  # q, k, v: one input, measured three times
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = weight, scales
    layer.input_scale = torch.nn.Parameter(torch.tensor(stored), requires_grad=False)
    cls.process_weights_after_loading(this, layer)
    x = (torch.randn(5, 64, generator=gen) * 2).to(torch.bfloat16)
    served = cls._apply_emulation(this, layer, x)

    ours = StaticFP8(max(float(scalar(s)) for s in stored), divide=True)
    expected = torch.nn.functional.linear(ours(x), decode_weight(weight, scales, torch.bfloat16, mxfp4))
    assert float(layer.input_scale) == ours.scale and torch.equal(served, expected)


def test_fused_fp8_shards_decode_as_vllms_requantize_with_max_scale():
    """w8a8_utils.py requantize_with_max_scale and per_tensor_dequantize run from the wheel on a fused
    gate_up_proj of two FP8 shards; its static FP8 cast (the CUDA scaled_fp8_quant, not loadable here) is the
    float32-reciprocal one fp8_tensor reproduces. The emulation's decode of each shard at the served scale
    equals the requantized weight times the max scale."""
    from types import SimpleNamespace

    from evals.emulation import decode_weight
    from tests.quant import engine_sources

    def scaled_fp8_quant(x, scale):
        s = scale.to(torch.float32)
        return (x.to(torch.float32) * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(E4M3), s

    ns = engine_sources.load(engine_sources.wheel("vllm", "0.33.0"), f"{VLLM}/utils/w8a8_utils.py",
                             ["requantize_with_max_scale", "per_tensor_dequantize"],
                             {"torch": torch, "ops": SimpleNamespace(scaled_fp8_quant=scaled_fp8_quant)})
    gen = torch.Generator().manual_seed(1)
    shards = [fp8_encode(torch.randn(32, 64, generator=gen).to(torch.bfloat16) * k) for k in (1.0, 3.0)]
    weight = torch.cat([codes for codes, _ in shards])
    scale = torch.stack([s.to(torch.float32) for _, s in shards])  # the engine's float32 parameter
    served_scale, requantized = ns["requantize_with_max_scale"](weight.clone(), scale, [32, 32])
    served = (requantized.to(torch.float32) * served_scale).to(torch.bfloat16)
    ours = torch.cat([decode_weight(codes, s, torch.bfloat16, get_codec("mxfp4"), float(served_scale))
                      for codes, s in shards])
    assert not torch.equal(requantized[:32], weight[:32])  # the smaller-scale shard really moved
    assert torch.equal(ours, served)
