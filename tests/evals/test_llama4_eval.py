"""Llama-4 (``llama4``) evaluated locally as served. transformers builds the text model as
Llama4ForCausalLM with fused experts (Llama4TextExperts: gate_up_proj [E, H, 2I], the router weight
multiplied into the routed input); a conversion stores them per expert, so the emulation loads them
into transformers' own per-expert form of that class (SequentialLlama4TextExperts, one Llama4TextMLP
per expert) and hooks each expert's Linears. Checked here: that form computes what the fused class
computes; the emulated FP8 and MXFP4 conversions equal a reference built without the emulation (the
conversion decoded by ``quantize --to bf16``, loaded by plain transformers, its fused experts'
forward rewritten by this file with the activation QDQ on both bmm inputs); ``evals run --model`` on
the bf16 source, its decoded conversion and both conversions."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.quantizers.base import SequentialLlama4TextExperts

from evals.bundle import read_bundle
from evals.emulation import load_model
from quant.cli import main as quantize
from quant.formats import fp8
from quant.formats.constants import E2M1, ScaleRule
from tests.evals.test_family_emulation import fp8_decoded, logits, stored_quantized
from tests.evals.test_run import data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_activation_codec import quark_dynamic_qdq

EXPERTS = "model.layers.1.feed_forward.experts"  # the MoE layer (interleave_moe_layer_step 2)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    write_family_checkpoint(root / "bf16", "llama4", num_hidden_layers=2)
    for fmt in ("mxfp4", "fp8"):
        assert quantize(["--to", fmt, "-q", str(root / "bf16"), str(root / fmt)]) == 0
        assert quantize(["--to", "bf16", "-q", str(root / fmt), str(root / f"{fmt}-decoded")]) == 0
    return root


def test_the_per_expert_form_computes_what_the_fused_experts_compute(llama4):
    fused = AutoModelForCausalLM.from_pretrained(llama4 / "bf16", dtype=torch.float32).eval()
    moe = fused.model.layers[1].feed_forward
    per_expert = SequentialLlama4TextExperts(fused.config.get_text_config())
    inter = moe.experts.expert_dim
    with torch.no_grad():
        for e, mlp in enumerate(per_expert):  # gate_up_proj [E, H, 2I]: gate the first half of 2I
            mlp.gate_proj.weight.copy_(moe.experts.gate_up_proj[e, :, :inter].T)
            mlp.up_proj.weight.copy_(moe.experts.gate_up_proj[e, :, inter:].T)
            mlp.down_proj.weight.copy_(moe.experts.down_proj[e].T)
        expected = logits(fused)
        moe.experts = per_expert
        got = logits(fused)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()


def reference(folder, fmt: str, decoded):
    """The decoded conversion in plain transformers (FP8 weights decoded here in float32), the
    activation QDQ put on by hand: each Linear the checkpoint stores quantized sees QDQ(x); the fused
    experts compute bmm(QDQ(act(gate) * up), down) with gate, up from bmm(QDQ(routed input), gate_up)."""
    model = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32).eval()
    qdq = quark_dynamic_qdq(E2M1, ScaleRule.EVEN) if fmt == "mxfp4" else fp8.quantize_dequantize
    stored = {m.removeprefix("language_model.") for m in stored_quantized(folder, fmt)}
    modules = dict(model.named_modules())
    linears = sorted(m for m in stored if isinstance(modules.get(m), torch.nn.Linear))
    for m in linears:
        modules[m].register_forward_pre_hook(lambda mod, args: (qdq(args[0]), *args[1:]))
    experts = modules[EXPERTS]
    assert {f"{EXPERTS}.{e}.{p}" for e in range(experts.num_experts) for p in ("gate_proj", "up_proj", "down_proj")} <= stored
    if fmt == "fp8":
        with torch.no_grad():
            for m in linears:
                modules[m].weight.copy_(fp8_decoded(folder, "language_model." + m))
            for e in range(experts.num_experts):
                expert = f"language_model.{EXPERTS}.{e}."
                experts.gate_up_proj[e] = torch.cat([fp8_decoded(folder, expert + p) for p in ("gate_proj", "up_proj")]).T
                experts.down_proj[e] = fp8_decoded(folder, expert + "down_proj").T

    def experts_reference(module, routed_in):
        x = qdq(routed_in).view(module.num_experts, -1, module.hidden_size)
        gate, up = torch.bmm(x, module.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(qdq(up * module.act_fn(gate)), module.down_proj).view(-1, module.hidden_size)

    experts.forward = experts_reference.__get__(experts)
    return model, stored


@pytest.mark.parametrize("fmt,scheme", [("mxfp4", "W4A4"), ("fp8", "W8A8")])
def test_emulated_logits_equal_the_reference(llama4, fmt, scheme):
    model, record = load_model(llama4 / fmt, dtype=torch.float32)
    ref, stored = reference(llama4 / fmt, fmt, llama4 / f"{fmt}-decoded")
    assert record["scheme"] == scheme and record["modules"]["per_expert_form"] == [EXPERTS]
    assert sorted(record["modules"]["linear"]) == sorted(stored)  # every quantized module hooked, experts included
    assert type(model.model.layers[1].feed_forward.experts) is SequentialLlama4TextExperts
    emulated, expected = logits(model), logits(ref)
    assert torch.allclose(emulated, expected, rtol=1e-5, atol=1e-5), (emulated - expected).abs().max()
    decoded_only = AutoModelForCausalLM.from_pretrained(llama4 / f"{fmt}-decoded", dtype=torch.float32).eval()
    assert not torch.allclose(emulated, logits(decoded_only), rtol=1e-3, atol=1e-4)  # the QDQ really ran


@pytest.mark.parametrize("ckpt,scheme", [("bf16", None), ("mxfp4-decoded", None), ("mxfp4", "W4A4"), ("fp8", "W8A8")])
def test_evals_run(llama4, ckpt, scheme, data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", llama4 / ckpt, "--benchmarks", "gsm8k", "--data-dir", data_dir,
                   "--limit", 1, "--max-gen-toks", 2) == 0
    run, rows = read_bundle(out)
    emulation = run["local"]["emulation"]
    assert rows and run["local"]["dtype"] == "bfloat16" and (emulation and emulation["scheme"]) == scheme
