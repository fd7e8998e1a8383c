"""Quantized checkpoints evaluated as served: exact weight decode, activations quantize-dequantized
through transformers' quantizer and experts hooks, checked module by module against AMD Quark."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.bundle import pair, read_bundle
from evals.cli import main as gate
from evals.emulation import EmulationRefused, emulation_of, load_model
from quant.cli import main as quantize
from quant.formats.constants import E2M1, E3M2, ScaleRule
from quant.quark_config import fp8_config, quantization_config
from tests.evals.test_run import GEN, data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.test_activation_codec import quark_dynamic_qdq

TOKENS = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0))


def convert(src, dst, fmt, *flags):
    assert quantize(["--to", fmt, "-q", *flags, str(src), str(dst)]) == 0
    return dst


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_weight_only_emulation_is_the_exactly_decoded_checkpoint(glm_ckpt, tmp_path):
    """W4A16: the quantizer's load-time decode gives the same weights, and the same logits, as
    `quantize --to bf16` loaded by plain transformers (eager experts)."""
    w4a16 = convert(glm_ckpt, tmp_path / "w4a16", "mxfp4", "--weight-only")
    model, record = load_model(w4a16, dtype=torch.float32)
    assert record["scheme"] == "W4A16" and record["activations"] is None
    assert record["modules"]["experts"] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    assert record["modules"]["not_loaded_by_transformers"] == ["model.layers.3.mlp.experts"]  # the MTP layer
    decoded = convert(w4a16, tmp_path / "decoded", "bf16")
    reference = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32, experts_implementation="eager")
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(logits(model), logits(reference))


def test_fp8_weights_decode_like_quantize_to_bf16(glm_ckpt, tmp_path):
    fp8 = convert(glm_ckpt, tmp_path / "fp8", "fp8")
    model, record = load_model(fp8, dtype=torch.bfloat16)
    assert (record["scheme"], record["activation_group"]) == ("W8A8", 128)
    assert "model.layers.0.self_attn.q_a_proj" in record["modules"]["linear"]
    reference = AutoModelForCausalLM.from_pretrained(convert(fp8, tmp_path / "decoded", "bf16"), dtype=torch.bfloat16)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def capture(module, store: dict):
    """Record a module's raw inputs (before the emulation's own pre-hook) and its output."""
    module.register_forward_pre_hook(lambda m, args: store.setdefault("args", args), prepend=True)
    module.register_forward_hook(lambda m, args, out: store.setdefault("out", out))


@pytest.mark.parametrize("fmt,element", [("mxfp4", E2M1), ("mxfp6_e3m2", E3M2)])
def test_quantized_modules_see_quarks_activation_qdq(glm_ckpt, tmp_path, fmt, element):
    """W4A4 / W6A6: a quantized Linear computes linear(Quark_QDQ(x), W); a layer's routed experts
    compute, per token, the sum over its top-k of w * down(Quark_QDQ(act(gate(q)) * up(q))), q = Quark_QDQ(x)."""
    ckpt = convert(glm_ckpt, tmp_path / fmt, fmt, "--shared-experts", "quantize")
    model, record = load_model(ckpt, dtype=torch.float32)  # the placement of each QDQ, free of bf16 rounding
    assert record["scheme"] in ("W4A4", "W6A6") and record["activation_scale_rule"] == "even"
    shared = "model.layers.1.mlp.shared_experts.down_proj"
    assert shared in record["modules"]["linear"]
    quark = quark_dynamic_qdq(element, ScaleRule.EVEN)
    linear, experts = {}, {}
    capture(model.get_submodule(shared), linear)
    capture(model.get_submodule("model.layers.1.mlp.experts"), experts)
    logits(model)

    weight = model.get_submodule(shared).weight
    assert torch.equal(linear["out"], torch.nn.functional.linear(quark(linear["args"][0]), weight))

    module = model.get_submodule("model.layers.1.mlp.experts")
    hidden, top_k_index, top_k_weights = experts["args"]
    expected = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        q = quark(hidden[token:token + 1])
        for k, e in enumerate(top_k_index[token].tolist()):
            gate, up = (q @ module.gate_up_proj[e].T).chunk(2, dim=-1)
            down = quark(module.act_fn(gate) * up) @ module.down_proj[e].T
            expected[token] += top_k_weights[token, k] * down[0]
    assert torch.allclose(experts["out"], expected, rtol=1e-5, atol=1e-6)
    unquantized = module.__class__.forward.__wrapped__(module, hidden, top_k_index, top_k_weights)
    assert not torch.allclose(experts["out"], unquantized, rtol=1e-3, atol=1e-4)  # the QDQ really ran


QUARK = quantization_config(["lm_head"], ScaleRule.EVEN, weight_only=False)


def quark_with(**changes) -> dict:
    config = copy.deepcopy(QUARK)
    for path, value in changes.items():
        node = config
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return {"quantization_config": config}


@pytest.mark.parametrize("config,named", [
    (quark_with(global_quant_config__weight__dtype="int4"), "dtype 'int4'"),
    (quark_with(global_quant_config__input_tensors__dtype="fp8_e4m3"), "input_tensors dtype 'fp8_e4m3'"),
    (quark_with(global_quant_config__input_tensors__is_dynamic=False), "'is_dynamic': False"),
    (quark_with(global_quant_config__weight__group_size=16), "'group_size': 16"),
    (quark_with(layer_quant_config={"*o_proj": {}}), "layer_quant_config"),
    (quark_with(kv_cache_quant_config={"*k_proj": {}}), "kv_cache_quant_config"),
    (quark_with(algo_config=[{"name": "rotation"}]), "'rotation'"),
    ({"quantization_config": {**fp8_config([]), "weight_block_size": None}}, "'weight_block_size': None"),
    ({"quantization_config": {**fp8_config([]), "activation_scheme": "static"}}, "'activation_scheme': 'static'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
])
def test_schemes_the_emulation_does_not_cover_are_refused_by_name(config, named):
    with pytest.raises(EmulationRefused, match="not emulated") as refused:
        emulation_of(config)
    assert named in str(refused.value)


def test_covered_schemes():
    assert emulation_of({}) is None
    assert emulation_of(quark_with(algo_config=[{"name": "awq"}])).scheme == "W4A4"  # baked into the weights
    weight_only = quantization_config([], ScaleRule.FLOOR, weight_only=True, dtype="fp6_e2m3")
    e = emulation_of({"quantization_config": weight_only})
    assert (e.scheme, e.weights, e.weight_scale_rule, e.activations) == ("W6A16", "mxfp6_e2m3", "floor", None)
    assert emulation_of({"quantization_config": fp8_config([])}).scheme == "W8A8"


def test_evals_run_evaluates_mxfp4_and_fp8_as_served_and_pairs_with_bf16(glm_ckpt, data_dir, tmp_path):
    """The CI check: the example's MXFP4 (W4A4) and FP8 (W8A8) conversions evaluated locally with
    emulation; run.json says what was emulated; the bundles pair with the bf16 reference run."""
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 2, *GEN]
    assert run_cli("--out", tmp_path / "bf16", "--model", glm_ckpt, *common) == 0
    reference, reference_rows = read_bundle(tmp_path / "bf16")
    assert reference["local"]["dtype"] == "bfloat16" and reference["local"]["emulation"] is None
    for fmt, scheme in (("mxfp4", "W4A4"), ("fp8", "W8A8")):
        out = tmp_path / f"run-{fmt}"
        assert run_cli("--out", out, "--model", convert(glm_ckpt, tmp_path / fmt, fmt), *common) == 0
        run, rows = read_bundle(out)
        emulation = run["local"]["emulation"]
        assert emulation["scheme"] == scheme and emulation["weights"] == fmt
        assert emulation["modules"]["experts"] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
        assert len(pair(reference_rows, rows)) == 4  # 2 items x 2 filters
        assert gate(["accuracy", "--candidate", str(out), "--reference", str(tmp_path / "bf16")]) in (0, 1)


def test_evals_run_refuses_an_uncovered_scheme_by_name(glm_ckpt, data_dir, tmp_path, capsys):
    ckpt = convert(glm_ckpt, tmp_path / "mxfp4", "mxfp4")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["kv_cache_quant_config"] = {"*k_proj": {"dtype": "fp8_e4m3"}}
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "refused"
    assert run_cli("--out", out, "--model", ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 1) == 2
    assert "kv_cache_quant_config" in capsys.readouterr().err and not (out / "run.json").exists()
    assert run_cli("--out", out, "--model", glm_ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir,
                   "--device", "cuda") == (0 if torch.cuda.is_available() else 2)
