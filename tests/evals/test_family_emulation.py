"""Every family evaluated locally as served: GLM-4.5, Qwen3-MoE, Qwen3-Next, Mixtral,
MiniMax-M2, DeepSeek-V4 (its release names unprefixed, renamed by transformers on load) and Qwen3.5 MoE (routed experts fused [E, 2I, H] in its bf16 release, per expert
in a conversion, which transformers' own converters merge back) tiny checkpoints named as their releases, converted --to mxfp4 and --to fp8, loaded by
evals.emulation and checked against a reference built without it: the conversion decoded by
``quantize --to bf16``, loaded by plain transformers (its own eager experts), with the activation
QDQ applied by this file (Quark's own fake quantizer for MX, the e4m3 rule pinned in
test_activation_codec for FP8) on the modules the checkpoint stores quantized. The MTP draft, which
transformers does not build (GLM-4.5's model.layers.N, Qwen3-Next's and Qwen3.5's mtp.*), is neither emulated nor compared."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from evals.bundle import read_bundle
from evals.emulation import EmulationRefused, load_model
from quant.cli import main as quantize
from quant.formats import fp8
from quant.formats.constants import E2M1, ScaleRule
from tests.evals.test_run import data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_activation_codec import quark_dynamic_qdq

FAMILIES = ["glm4_moe", "qwen3_moe", "qwen3_next", "mixtral", "minimax_m2", "qwen3_5_moe", "deepseek_v4", "exaone_moe",
            "longcat_flash", "dots3_note"]
# how each release names a layer's experts and their (gate, up, down) projections
EXPERTS = {"glm4_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "qwen3_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "qwen3_next": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
           "minimax_m2": ("block_sparse_moe.experts", "w1", "w3", "w2"),
           "qwen3_5_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "deepseek_v4": ("ffn.experts", "w1", "w3", "w2"),
           "exaone_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "longcat_flash": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
           "dots3_note": ("mlp.experts", "gate_proj", "up_proj", "down_proj")}
# where a release keeps its decoder layers (the model's model.layers.N): Qwen3.5 MoE under its
# multimodal model's language_model, routed experts fused [E, 2I, H] in the bf16 release
LAYERS = {"qwen3_5_moe": "model.language_model.layers.", "deepseek_v4": "layers."}
# releases whose module names transformers renames on load (DeepSeek-V4: attn.wq_b -> self_attn.q_b_proj,
# its own conversion_mapping.py "deepseek_v4"), and stores without the base model's "model." prefix
RENAMED = {"deepseek_v4"}


def transformers_names(model):
    """checkpoint module -> transformers' module name, by transformers' own rename of the weight names
    (conversion_mapping + core_model_loading.rename_source_key, as from_pretrained renames them), the
    base model's prefix added where the base model holds that module."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    base = getattr(model, model.base_model_prefix)

    def name(module: str) -> str:
        renamed = rename_source_key(module + ".weight", renamings, converters)[0].removesuffix(".weight")
        return f"{model.base_model_prefix}.{renamed}" if hasattr(base, renamed.partition(".")[0]) else renamed
    return name
TOKENS = torch.randint(3, 380, (2, 16), generator=torch.Generator().manual_seed(0))
SCALE = {"mxfp4": ".weight_scale", "fp8": ".weight_scale_inv"}


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = write_family_checkpoint(root / "bf16", request.param)
    for fmt in ("mxfp4", "fp8"):
        assert quantize(["--to", fmt, "-q", str(src), str(root / fmt)]) == 0
    return request.param, root


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def stored_quantized(folder, fmt: str) -> set[str]:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    modules = {name.removesuffix(".weight") for name in weight_map if name.endswith(".weight")}
    return {m for m in modules if m + SCALE[fmt] in weight_map}


def fp8_decoded(folder, module: str) -> torch.Tensor:
    """e4m3 codes times their 128x128 tile's float32 scale_inv, in float32 (quantize --to bf16 rounds
    the product to bf16; an FP8 GEMM does not)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    w, s = (load_file(str(folder / weight_map[module + k]))[module + k] for k in (".weight", ".weight_scale_inv"))
    tiles = s.repeat_interleave(fp8.TILE, 0).repeat_interleave(fp8.TILE, 1)[: w.shape[0], : w.shape[1]]
    return w.to(torch.float32) * tiles


def reference(name: str, folder, fmt: str, tmp_path):
    """The decoded conversion in plain transformers (FP8 weights decoded here in float32), with the
    activation QDQ put on by hand: each Linear
    the checkpoint stores quantized sees QDQ(x); each quantized layer's experts compute, expert by
    expert over every token, w * down_e(QDQ(act(gate_e(q)) * up_e(q))), q = QDQ(x)."""
    decoded = tmp_path / f"{fmt}-decoded"
    assert quantize(["--to", "bf16", "-q", str(folder), str(decoded)]) == 0
    model = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32, experts_implementation="eager").eval()
    qdq = quark_dynamic_qdq(E2M1, ScaleRule.EVEN) if fmt == "mxfp4" else fp8.quantize_dequantize
    layers_at = LAYERS.get(name, "model.layers.")
    to_model = transformers_names(model) if name in RENAMED else \
        (lambda m: "model.layers." + m.removeprefix(layers_at) if m.startswith(layers_at) else m)
    stored = stored_quantized(folder, fmt)
    stored_as = {to_model(m): m for m in stored}  # the model's name -> the checkpoint's
    modules = dict(model.named_modules())
    linears = sorted(m for m in stored_as if isinstance(modules.get(m), torch.nn.Linear))
    for m in linears:
        modules[m].register_forward_pre_hook(lambda mod, args: (qdq(args[0]), *args[1:]))
    prefix, gate, up, down = EXPERTS[name]
    layers = [i for i in range(model.config.num_hidden_layers) if f"{layers_at}{i}.{prefix}.0.{gate}" in stored]
    experts = [f"model.layers.{i}.mlp.experts" for i in layers]
    if fmt == "fp8":
        with torch.no_grad():
            for m in linears:
                modules[m].weight.copy_(fp8_decoded(folder, stored_as[m]))
            for i in layers:
                module = modules[f"model.layers.{i}.mlp.experts"]
                for e in range(module.num_experts):
                    stored = f"{layers_at}{i}.{prefix}.{e}."
                    module.gate_up_proj[e] = torch.cat([fp8_decoded(folder, stored + gate), fp8_decoded(folder, stored + up)])
                    module.down_proj[e] = fp8_decoded(folder, stored + down)

    def experts_reference(module, hidden, top_k_index, top_k_weights):
        q = qdq(hidden)
        out = torch.zeros_like(hidden)
        limit = getattr(module, "limit", None)  # DeepSeek-V4's swiglu_limit: gate clamped above, up both ways
        for e in range(module.num_experts):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)  # 0 where e is not routed
            gate, up = torch.nn.functional.linear(q, module.gate_up_proj[e]).chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            out += weight * torch.nn.functional.linear(qdq(module.act_fn(gate) * up), module.down_proj[e])
        return out

    for m in experts:
        modules[m].forward = experts_reference.__get__(modules[m])
    return model, linears, experts


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_bf16_emulation_is_transformers_eager(family):
    """A bf16 checkpoint runs the emulation's experts loop with nothing quantized: transformers' own."""
    _, root = family
    ours, record = load_model(root / "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(root / "bf16", dtype=torch.float32, experts_implementation="eager")
    assert record is None and torch.equal(logits(ours), logits(theirs.eval()))


@pytest.mark.parametrize("fmt,scheme", [("mxfp4", "W4A4"), ("fp8", "W8A8")])
@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_emulated_logits_equal_the_reference(family, fmt, scheme, tmp_path):
    name, root = family
    model, record = load_model(root / fmt, dtype=torch.float32)  # QDQ placement, free of bf16 rounding
    ref, linears, experts = reference(name, root / fmt, fmt, tmp_path)
    assert record["scheme"] == scheme
    assert sorted(record["modules"]["linear"]) == linears and record["modules"]["experts"] == experts
    assert experts and (fmt == "fp8") == bool(linears)  # MXFP4: routed experts only; FP8: attention too
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)  # exact decode
    emulated, expected = logits(model), logits(ref)
    assert torch.allclose(emulated, expected, rtol=1e-5, atol=1e-5), (emulated - expected).abs().max()
    decoded_only = AutoModelForCausalLM.from_pretrained(tmp_path / f"{fmt}-decoded", dtype=torch.float32,
                                                        experts_implementation="eager").eval()
    assert not torch.allclose(emulated, logits(decoded_only), rtol=1e-3, atol=1e-4)  # the QDQ really ran


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_evals_run_on_each_familys_mxfp4_conversion(family, data_dir, tmp_path):  # noqa: F811
    _, root = family
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", root / "mxfp4", "--benchmarks", "gsm8k", "--data-dir", data_dir,
                   "--limit", 1, "--max-gen-toks", 2) == 0
    run, rows = read_bundle(out)
    emulation = run["local"]["emulation"]
    assert (emulation["scheme"], emulation["weights"]) == ("W4A4", "mxfp4") and emulation["modules"]["experts"]
    assert rows and run["local"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_a_layer_with_some_experts_left_bf16_is_refused_in_one_line(family, data_dir, tmp_path, capsys):  # noqa: F811
    """One expert's w1 stored bf16 (its scale dropped): the engines quantize a layer's experts all or
    none, so the emulation cannot say what is served; exit 2, never evaluated as bf16."""
    _, root = family
    ckpt = tmp_path / "mixed"
    assert quantize(["--to", "mxfp4", "-q", str(root / "bf16"), str(ckpt)]) == 0
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    target = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    source = load_file(str(root / "bf16" / json.loads((root / "bf16" / "model.safetensors.index.json")
                                                      .read_text())["weight_map"][target]))[target]
    shard = ckpt / weight_map[target]
    tensors = load_file(str(shard))
    tensors[target] = source
    del tensors[target.removesuffix(".weight") + ".weight_scale"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][target.removesuffix(".weight") + ".weight_scale"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "conversion_manifest.json").unlink()  # an edited shard is no longer what quantize wrote and recorded
    with pytest.raises(EmulationRefused, match="model.layers.1.mlp.experts: 11 of 12"):
        load_model(ckpt)
    out = tmp_path / "refused"
    assert run_cli("--out", out, "--model", ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 1) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]  # less progress bars
    assert len(said) == 1 and "evals: error: model.layers.1.mlp.experts: 11 of 12" in said[0]
    assert not (out / "run.json").exists()


@pytest.mark.parametrize("family", ["kimi_k25", "minimax_m3", "glm5_next", "step3p7", "kimi_k3"])
def test_a_family_without_a_causal_lm_class_is_refused_in_one_line(data_dir, tmp_path, capsys, family):  # noqa: F811
    """Kimi-K2.5 (kimi_k25), MiniMax-M3 (minimax_m3_vl), GLM-5.3-Flash (glm5_next) and Step-3.7-Flash
    (step3p7): transformers builds them as image-text-to-text only; Kimi-K3 (kimi_k3) it does not build at all;
    bf16 and MXFP4 alike exit 2 naming the model type and the way out, nothing written."""
    src = write_family_checkpoint(tmp_path / "bf16", family)
    assert quantize(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
    for ckpt in (src, tmp_path / "mxfp4"):
        out = tmp_path / f"run-{ckpt.name}"
        capsys.readouterr()
        assert run_cli("--out", out, "--model", ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir,
                       "--limit", 1) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]
        model_type = {"kimi_k25": "kimi_k25", "minimax_m3": "minimax_m3_vl", "glm5_next": "glm5_next",
                      "step3p7": "step3p7", "kimi_k3": "kimi_k3"}[family]
        assert len(said) == 1 and f"model_type '{model_type}' has no transformers causal-LM class" in said[0], said
        assert "--base-url" in said[0] and not (out / "run.json").exists()


@pytest.mark.parametrize("fmt,scheme", [("bf16", None), ("fp8", "W8A8")])
@pytest.mark.parametrize("family", ["deepseek_v4"], indirect=True)
def test_evals_run_on_deepseek_v4s_bf16_and_fp8(family, data_dir, tmp_path, fmt, scheme):  # noqa: F811
    """DeepSeek-V4's release names (layers.N.attn.wq_b, no model. prefix) load into transformers'
    DeepseekV4ForCausalLM by its own renames; its bf16 source and FP8 conversion (attention and
    experts W8A8, the MTP module not built by transformers) run end to end like the MXFP4 one."""
    _, root = family
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", root / fmt, "--benchmarks", "gsm8k", "--data-dir", data_dir,
                   "--limit", 1, "--max-gen-toks", 2) == 0
    run, rows = read_bundle(out)
    emulation = run["local"]["emulation"]
    assert rows and (emulation is None if scheme is None else emulation["scheme"] == scheme), emulation
    if scheme:
        assert emulation["modules"]["linear"] and emulation["modules"]["experts"]
        assert "mtp.0.mlp.experts" in emulation["modules"]["not_loaded_by_transformers"]

