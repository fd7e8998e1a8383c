"""The public load incidents of compressed-tensors and ModelOpt checkpoints, each rebuilt as a tiny checkpoint
with the names, ignore / exclude lists and stored scales its report gives, and replayed on the releases it hit
(exit 1 naming the module and the mechanism) and on the releases that fixed it (exit 0). Every broken and
fixed release was read in the released wheels, not taken from the reports' dates.

Where a report's model family is not read for its broken releases (Qwen3.5 MoE: vLLM 0.32.0-0.33.0 only),
the same config and tensors are rebuilt in Qwen3-MoE, whose rules cover the whole window: the mechanism is
the engine's quantization layer, the same for every model class.

Not caught, and why (each pinned by a test below, never skipped):
- compressed-tensors' ignore list not applied to the FusedMoE (vllm#27607, fixed by vllm#28878 and
  sglang#17828): every release of both windows has the fix; the rebuilt checkpoint loads on all of them.
- llm-compressor#2060 (every routed Llama-4 expert in ignore, stored bf16 3-D): the window's releases load
  it (the experts bf16, as ignored); the report's KeyError was a loader before the window.
- vllm#57532 (GLM-5.3-Flash's MTP head built NVFP4, its weight_scale never loaded: NaN), broken in vLLM
  0.30.0 only: GLM-5-Next's vLLM rules are not read for 0.30.0, so that release is not replayed.
- A legacy language_model.layers.N prefix rewritten by a newer mapper: no public incident in these formats
  within the window was found (the engines' ModelOpt matchers strip or swap the prefix in every release).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from quant.third_party import CT, MODELOPT, parse
from tests.quant.family_checkpoints import write_shards
from tests.quant.test_fusion import run_gate
from tests.quant.third_party_checkpoints import (
    fp8_ct,
    modelopt_config,
    nvfp4_ct,
    quantized,
    write_third_party,
)

ROOT = Path(__file__).resolve().parents[2]
ROUTER = "re:.*mlp\\.gate$"


def rewrite(folder: Path, change) -> Path:
    """``folder``'s shards written again as ``change(tensors)`` returns them."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    write_shards(change(tensors), folder)
    return folder


def set_quantization_config(folder: Path, qconfig: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def quantize_module(tensors: dict, module: str, scheme) -> dict:
    """``tensors`` with ``module``'s bf16 weight replaced by what ``scheme`` stores for it."""
    weight = tensors.pop(f"{module}.weight")
    return {**tensors, **{f"{module}.{suffix}": t for suffix, t in quantized(scheme, weight).items()}}


def per_expert(tensors: dict, experts: str, scheme=None) -> dict:
    """transformers' fused 3-D experts under ``experts`` (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    as the exports store them, one module per expert and projection, each bf16 or in ``scheme``."""
    gate_up, down = tensors.pop(f"{experts}.gate_up_proj"), tensors.pop(f"{experts}.down_proj")
    out = dict(tensors)
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2, dim=0)
        for proj, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down[e])):
            module = f"{experts}.{e}.{proj}"
            out[f"{module}.weight"] = weight.contiguous()
            if scheme is not None:
                out = quantize_module(out, module, scheme)
    return out


def findings(capsys, folder: Path, engine: str) -> tuple[int, dict[str, str]]:
    """gate checkpoint's exit code on one release and its findings, module -> their whys (one a line)."""
    code, report = run_gate(capsys, folder, "--engine", engine, "--json")
    found: dict[str, str] = {}
    for f in (f for r in report["engines"].values() for f in r["findings"]):
        found[f["module"]] = "\n".join(filter(None, (found.get(f["module"]), f["why"])))
    return code, found


# ---- compressed-tensors: the ignore list and the FusedMoE (vllm#27607, vllm#28878, sglang#17828) ----------

@pytest.fixture(scope="module")
def qwen3_nvfp4_bf16_mixed(tmp_path_factory) -> Path:
    """Benasd/Qwen3-30B-A3B-Instruct-2507-NVFP4-BF16-MIXED as vllm#27607 describes it: llm-compressor NVFP4
    (W4A4, targets Linear) with one decoder layer kept bf16, its Linear modules listed by name in ignore
    (every expert's gate/up/down_proj and the attention), as llm-compressor writes the modules it skipped."""
    bf16_layer = "model.layers.1"
    kept = [f"{bf16_layer}.self_attn.{p}_proj" for p in "qkvo"]
    kept += [f"{bf16_layer}.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    qconfig = nvfp4_ct(ignore=("lm_head", ROUTER, *kept))
    return write_third_party(tmp_path_factory.mktemp("i1") / "ck", "qwen3_moe", qconfig, num_hidden_layers=2)


@pytest.mark.parametrize("engine", ["vllm==0.16.0", "vllm==0.25.1", "vllm==0.34.0", "sglang==0.5.9",
                                    "sglang==0.5.16", "sglang==0.5.23"])
def test_bf16_moe_layer_in_ignore_loads_in_every_release_of_the_window(qwen3_nvfp4_bf16_mixed, capsys, engine):
    """Every release of both windows probes the FusedMoE's expert 0 against ignore (vLLM
    compressed_tensors_moe.py: CompressedTensorsMoEMethod.get_moe_method, sglang compressed_tensors.py:
    CompressedTensorsConfig.get_moe_scheme): the listed bf16 layer's experts are built bf16. The releases that
    built every MoE NVFP4 (vLLM < 0.12, sglang < 0.5.9) are before the window: not caught there."""
    code, text = run_gate(capsys, qwen3_nvfp4_bf16_mixed, "--engine", engine)
    assert code == 0, text


# ---- Qwen3.5's MTP experts stored bf16 but not in ignore (vllm#41994, open) ---------------------------------

@pytest.fixture(scope="module")
def qwen35_ct_mtp_experts_bf16(tmp_path_factory) -> Path:
    """A compressed-tensors NVFP4 Qwen3.5 MoE as vllm#41994 reports it: the routed experts NVFP4 per expert,
    the MTP draft bf16, its ignore entries naming mtp.fc, the draft's attention and shared expert but not its
    experts (stored bf16 per expert, as the family's draft is; the report's are fused: the same FusedMoE)."""
    ignore = ("lm_head", ROUTER, "re:.*shared_expert_gate$", "re:.*linear_attn.*", "re:model\\.visual.*",
              "mtp.fc", "re:mtp\\.layers\\.0\\.self_attn.*", "re:mtp\\.layers\\.0\\.mlp\\.shared_expert.*")
    qconfig = nvfp4_ct(ignore=ignore)
    config = parse(CT, qconfig)
    folder = write_third_party(tmp_path_factory.mktemp("i1b") / "ck", "qwen3_5_moe", qconfig, num_hidden_layers=2,
                               stored=lambda module: None if module.startswith("mtp.") else config.resolve(module))
    scheme = config.schemes[0]
    layers = [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]

    def main_experts_nvfp4(tensors):
        for experts in layers:
            tensors = per_expert(tensors, experts, scheme)
        return tensors

    return rewrite(folder, main_experts_nvfp4)


@pytest.mark.parametrize("engine", ["vllm==0.33.0", "sglang==0.5.11", "sglang==0.5.18", "sglang==0.5.23"])
def test_qwen35_mtp_experts_bf16_not_ignored_meet_an_nvfp4_fused_moe(qwen35_ct_mtp_experts_bf16, capsys, engine):
    """vLLM's get_moe_method probes mtp.layers.0.mlp.experts.0.* (not ignored): an NVFP4 MoE method whose
    w13_weight_packed the bf16 experts cannot fill (the report's KeyError 'layers.0.mlp.experts.w2_weight');
    sglang keeps a compressed-tensors config for the draft (qwen3_5_mtp.py: _mtp_quant_config drops only
    ModelOpt's). No release fixes it; the checkpoint's way out is listing the experts in ignore."""
    code, found = findings(capsys, qwen35_ct_mtp_experts_bf16, engine)
    assert code == 1, found
    assert f"bf16 on disk, but {engine.split('==')[0]} builds this FusedMoE as nvfp4" in \
        found["mtp.layers.0.mlp.experts"], found


def test_qwen35_mtp_experts_listed_in_ignore_load(qwen35_ct_mtp_experts_bf16, tmp_path, capsys):
    config = json.loads((qwen35_ct_mtp_experts_bf16 / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:mtp\\.layers\\.0\\.mlp\\.experts.*")
    folder = tmp_path / "ck"
    folder.mkdir()
    for file in qwen35_ct_mtp_experts_bf16.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for engine in ("vllm==0.33.0", "sglang==0.5.23"):
        code, text = run_gate(capsys, folder, "--engine", engine)
        assert code == 0, text


# ---- a quantized lm_head (vllm#44081, vllm#45102 -> vllm#42124; vllm#37291; sglang#34895, #35358 -> #35228) ---

def modelopt_nvfp4(exclude) -> dict:
    """config.json's quantization_config as ModelOpt >= 0.31 writes it (vLLM reads its ``ignore``)."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": list(exclude),
            "kv_cache_scheme": None}


def with_quantized_lm_head(tmp_path_factory, name: str, family: str, qconfig: dict) -> Path:
    """``family``'s tiny checkpoint in ``qconfig``, which quantizes its lm_head (written in that scheme)."""
    folder = write_third_party(tmp_path_factory.mktemp(name) / "ck", family, qconfig, num_hidden_layers=2)
    assert any(name.startswith("lm_head.weight_scale") for name in index(folder)), "the config must quantize lm_head"
    return folder


def index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.fixture(scope="module")
def qwen3_modelopt_lm_head(tmp_path_factory) -> Path:
    """nvidia/Qwen3.6-35B-A3B-NVFP4's lm_head as vllm#44081 lists it (lm_head.weight U8, weight_scale F8_E4M3,
    weight_scale_2 and input_scale F32) and its ModelOpt NVFP4 config, lm_head not excluded; in Qwen3-MoE,
    whose vLLM rules cover the releases that failed."""
    qconfig = modelopt_nvfp4(("*self_attn*", "*mlp.gate"))
    return with_quantized_lm_head(tmp_path_factory, "i3a", "qwen3_moe", qconfig)


@pytest.mark.parametrize("release", ["0.16.0", "0.19.1", "0.22.1"])
def test_modelopt_quantized_lm_head_fails_before_0_23_0(qwen3_modelopt_lm_head, capsys, release):
    """vLLM modelopt.py: ModelOptQuantConfigBase.get_quant_method dispatches LinearBase only up to 0.22.1: the
    ParallelLMHead gets no quant method, only lm_head.weight, and 'There is no module or parameter named
    lm_head.input_scale'."""
    code, found = findings(capsys, qwen3_modelopt_lm_head, f"vllm=={release}")
    assert code == 1 and list(found) == ["lm_head"], found
    assert "nvfp4 on disk, but vllm builds this module unquantized" in found["lm_head"]
    assert "ModelOptQuantConfigBase.get_quant_method" in found["lm_head"]


@pytest.mark.parametrize("release", ["0.23.0", "0.28.0", "0.34.0"])
def test_modelopt_quantized_lm_head_loads_from_0_23_0(qwen3_modelopt_lm_head, capsys, release):
    code, text = run_gate(capsys, qwen3_modelopt_lm_head, "--engine", f"vllm=={release}")
    assert code == 0, text


@pytest.fixture(scope="module")
def qwen3_ct_fp8_lm_head(tmp_path_factory) -> Path:
    """sglang#34895's lm_head (compressed-tensors FP8 W8A8 per channel, targeted by name beside NVFP4 experts:
    lm_head.weight F8_E4M3 [V, H], lm_head.weight_scale [V, 1]), in Qwen3-MoE (the report's model is a dense
    Qwen3.8, not a family quantgate reads)."""
    nvfp4 = nvfp4_ct(scheme_targets=("re:.*mlp\\.experts.*",), ignore=(ROUTER,))
    fp8 = fp8_ct("channel")["config_groups"]["group_0"]
    qconfig = {**nvfp4, "format": "mixed-precision", "config_groups": {
        **nvfp4["config_groups"],
        "group_1": {**fp8, "format": "float-quantized", "targets": ["re:.*self_attn.*", "re:.*lm_head"]}}}
    return with_quantized_lm_head(tmp_path_factory, "i3c", "qwen3_moe", qconfig)


@pytest.mark.parametrize("release", ["0.5.9", "0.5.15.post1", "0.5.18"])
def test_ct_quantized_lm_head_loads_wrong_before_sglang_0_5_19(qwen3_ct_fp8_lm_head, capsys, release):
    """sglang compressed_tensors.py: CompressedTensorsConfig.get_quant_method dispatches LinearBase and FusedMoE
    only up to 0.5.18: the ParallelLMHead falls back to UnquantizedEmbeddingMethod, the FP8 codes are cast
    into a bf16 weight and lm_head.weight_scale is dropped ('Parameter lm_head.weight_scale not found in
    params_dict'): it loads and writes garbage."""
    code, found = findings(capsys, qwen3_ct_fp8_lm_head, f"sglang=={release}")
    assert code == 1, found  # (releases that read no group's own format under "mixed-precision" fail more)
    assert "fp8-channel on disk, but sglang builds this module unquantized" in found["lm_head"]
    assert "CompressedTensorsConfig.get_quant_method" in found["lm_head"]


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_ct_quantized_lm_head_loads_from_sglang_0_5_19(qwen3_ct_fp8_lm_head, capsys, release):
    """0.5.19's get_lm_head_scheme: a target naming lm_head (exact, re: or dotted suffix) quantizes it."""
    code, text = run_gate(capsys, qwen3_ct_fp8_lm_head, "--engine", f"sglang=={release}")
    assert code == 0, text


@pytest.mark.parametrize("release, code", [("0.16.0", 1), ("0.19.1", 1), ("0.20.0", 0), ("0.34.0", 0)])
def test_ct_quantized_lm_head_in_vllm_needs_0_20_0(qwen3_ct_fp8_lm_head, capsys, release, code):
    """vLLM compressed_tensors.py: CompressedTensorsConfig.get_quant_method takes a ParallelLMHead from 0.20.0
    (vllm#37291)."""
    got, found = findings(capsys, qwen3_ct_fp8_lm_head, f"vllm=={release}")
    assert got == code and list(found) == ["lm_head"] * code, found
    if code:
        assert "fp8-channel on disk, but vllm builds this module unquantized" in found["lm_head"]


@pytest.fixture(scope="module")
def qwen35_modelopt_lm_head(tmp_path_factory) -> Path:
    """nvidia/Qwen3.6-35B-A3B-NVFP4 as vllm#44081 and vllm#45102 give it, in its own family: routed experts and
    lm_head NVFP4 (lm_head.weight U8, weight_scale F8_E4M3, weight_scale_2 and input_scale F32), attention,
    routers, the vision tower and the MTP draft bf16 and excluded."""
    qconfig = modelopt_nvfp4(("*self_attn*", "*linear_attn*", "*mlp.gate", "*shared_expert*", "model.visual*",
                              "mtp*"))
    folder = with_quantized_lm_head(tmp_path_factory, "i3a_qwen35", "qwen3_5_moe", qconfig)
    scheme = parse(MODELOPT, qconfig).schemes[0]
    layers = [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]

    def main_experts_nvfp4(tensors):
        for experts in layers:
            tensors = per_expert(tensors, experts, scheme)
        return tensors

    return rewrite(folder, main_experts_nvfp4)


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_qwen36_nvfp4_lm_head_loads_where_qwen35_is_read(qwen35_modelopt_lm_head, capsys, release):
    """The releases that failed (0.17.0-0.22.1: qwen3_5.py built lm_head without quant_config, and ModelOpt's
    get_quant_method took no ParallelLMHead) are not read for Qwen3.5 MoE: the Qwen3-MoE rebuild above is caught
    there. The releases read build lm_head NVFP4 (0.23.0+)."""
    code, text = run_gate(capsys, qwen35_modelopt_lm_head, "--engine", f"vllm=={release}")
    assert code == 0, text


def test_lm_head_excluded_but_stored_nvfp4_fails_in_every_release(tmp_path_factory, capsys):
    """vllm#45132's reading of the same checkpoint: hf_quant_config.json's exclude_modules has 'lm_head*' while
    lm_head is stored NVFP4. An excluded lm_head is built unquantized in every release (0.23.0+:
    UnquantizedLinearMethod; before: no quant method at all), so its scales have no parameter; no release fixes
    it (the PR was closed): drop 'lm_head*' from the exclude list."""
    qconfig = modelopt_config("NVFP4", exclude=("*self_attn*", "*mlp.gate", "lm_head*"))
    nvfp4 = parse(MODELOPT, qconfig)
    folder = write_third_party(tmp_path_factory.mktemp("i3a_excluded") / "ck", "qwen3_moe", qconfig,
                               hf_quant_config_only=True, num_hidden_layers=2,
                               stored=lambda m: nvfp4.schemes[0] if m == "lm_head" else nvfp4.resolve(m))
    for release in ("0.22.1", "0.23.0", "0.34.0"):
        code, found = findings(capsys, folder, f"vllm=={release}")
        assert code == 1 and list(found) == ["lm_head"], found
        assert "nvfp4 on disk, but vllm builds this module unquantized" in found["lm_head"]


# ---- experts with no input_scale: zero in the slot, an infinite global scale (vllm#45212, open) ---------------

@pytest.fixture(scope="module")
def qwen3_modelopt_uncalibrated_experts(tmp_path_factory) -> tuple[Path, Path]:
    """A ModelOpt NVFP4 MoE as vllm#45212 reports it (there a Gemma 4 MoE, not a family quantgate reads):
    experts calibration never routed to export no input_scale (layer 1's experts 1 and 2); beside it the same
    checkpoint with every input_scale."""
    root = tmp_path_factory.mktemp("i6")
    qconfig = modelopt_config("NVFP4", exclude=("lm_head", "*self_attn*", "*mlp.gate"))
    complete = write_third_party(root / "complete", "qwen3_moe", qconfig, hf_quant_config_only=True,
                                 num_hidden_layers=2)
    uncalibrated = root / "uncalibrated"
    uncalibrated.mkdir()
    for file in complete.iterdir():
        (uncalibrated / file.name).write_bytes(file.read_bytes())
    gone = [f"model.layers.1.mlp.experts.{e}.{p}.input_scale" for e in (1, 2)
            for p in ("gate_proj", "up_proj", "down_proj")]
    rewrite(uncalibrated, lambda tensors: {n: t for n, t in tensors.items() if n not in gone})
    return complete, uncalibrated


def test_experts_without_input_scale_are_named_by_deep_in_every_vllm_release(qwen3_modelopt_uncalibrated_experts):
    """vLLM modelopt.py: ModelOptNvFp4FusedMoE.create_weights allocates the experts' input scales with
    torch.empty and nothing writes the missing ones; fused_moe/oracle/nvfp4.py: make_nvfp4_moe_quant_config
    inverts them (a1_gscale = 1.0 / a13_scale): every release 0.16.0..0.34.0, no fix merged (vllm#45320,
    vllm#54444 open). --deep names the layer's experts; the checkpoint with every input_scale passes."""
    complete, uncalibrated = qwen3_modelopt_uncalibrated_experts
    for folder, code in ((uncalibrated, 1), (complete, 0)):
        run = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine", "vllm",
                              "--deep", "--json"], check=False, capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == code, run.stdout + run.stderr
        report = json.loads(run.stdout)
        found = [f for r in report["engines"].values() for f in r["findings"] if f["check"] == "values"]
        if code:
            assert {f["module"] for f in found} == {"model.layers.1.mlp.experts"}
            assert "model.layers.1.mlp.experts.1.gate_proj.input_scale" in found[0]["why"]
            assert "1.0 / a13_scale" in found[0]["why"]
        else:
            assert not found


# ---- fused 3-D experts left out of the quantization: every expert in ignore (llm-compressor#2060) -------------

@pytest.fixture(scope="module")
def llama4_every_expert_ignored(tmp_path_factory) -> Path:
    """Llama-4-Maverick NVFP4 as llm-compressor#2060 reports its export: llama4_example.py's recipe (NVFP4,
    targets Linear, attention, router and vision ignored), every routed expert of every layer listed in ignore
    by name and stored bf16 as transformers keeps them (fused 3-D gate_up_proj / down_proj), the shared expert
    NVFP4."""
    experts = [f"language_model.model.layers.{i}.feed_forward.experts.{e}.{p}" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")]
    ignore = ("re:.*lm_head", "re:.*self_attn", "re:.*router", "re:vision_model.*", "re:multi_modal_projector.*",
              "Llama4TextAttention", *experts)
    return write_third_party(tmp_path_factory.mktemp("i2") / "ck", "llama4", nvfp4_ct(ignore=ignore),
                             num_hidden_layers=2)


@pytest.mark.parametrize("engine", ["vllm==0.16.0", "vllm==0.34.0", "sglang==0.5.9", "sglang==0.5.23"])
def test_every_routed_expert_in_ignore_loads_bf16_in_the_window(llama4_every_expert_ignored, capsys, engine):
    """Not caught: the report's KeyError ('layers.17.feed_forward.experts.126.w1_weight') was a loader before
    the window. Every release of the window asks the FusedMoE as expert 0 (listed in ignore: unquantized) and
    loads the bf16 3-D experts into it; that no routed expert is quantized is the export's bug, not a load
    failure."""
    code, text = run_gate(capsys, llama4_every_expert_ignored, "--engine", engine)
    assert code == 0, text


# ---- the MTP head built NVFP4, its weight_scale never loaded (vllm#57532; vllm#52501, fixed by vllm#55442) -----

@pytest.fixture(scope="module")
def glm53_flash_nvfp4(tmp_path_factory) -> Path:
    """LibertAIDAI/GLM-5.3-Flash-NVFP4 as vllm#57532 reports it: ModelOpt NVFP4 MLPs and routed experts, the
    attention, routers, shared experts, eh_proj, vision tower and lm_head bf16 and excluded, an MTP layer that
    stores its shared_head.norm but no shared_head.head (the draft reuses the target's lm_head)."""
    qconfig = modelopt_nvfp4(("lm_head", "*self_attn*", "*mlp.gate", "*shared_experts*", "*eh_proj", "model.visual*"))
    return write_third_party(tmp_path_factory.mktemp("i4") / "ck", "glm5_next", qconfig, num_hidden_layers=2)


@pytest.mark.parametrize("release", ["0.31.0", "0.34.0"])
def test_glm53_mtp_head_is_not_built_from_0_31_0(glm53_flash_nvfp4, capsys, release):
    """glm5next/common/mtp.py builds the draft's SharedHead with defer_lm_head=True: no head of its own."""
    code, text = run_gate(capsys, glm53_flash_nvfp4, "--engine", f"vllm=={release}")
    assert code == 0, text


def test_glm53_nan_head_release_is_not_replayed(glm53_flash_nvfp4, capsys):
    """Not caught: vLLM 0.30.0 (glm5next/nvidia/mtp.py: SharedHead(quant_config=quant_config) builds
    shared_head.head NVFP4; modelopt.py: KNvfp4Static.process raises on its NaN weight_scale) is the only
    release it fails in, and GLM-5-Next's vLLM rules are not read for 0.30.0: gate checkpoint refuses to vouch
    for it (exit 2) rather than replay it. A replay would also need the module the draft builds with no tensor
    on disk."""
    code, text = run_gate(capsys, glm53_flash_nvfp4, "--engine", "vllm==0.30.0")
    assert code == 2, text
    assert "vllm 0.30.0 has not been read for family glm5_next" in text
