"""Differential tests for Kimi-K3 (``kimi_k3``, KimiK3ForConditionalGeneration): each release read
(``manifests/families/kimi_k3/{sglang,vllm}.yaml``, sampled over the window by ``window_sample``) decides with its
own code beside ``quant.engines``: the packed-modules mapping the quant config holds, the class's weight mapper
(read from the wheel and applied by the wheel's own ``WeightsMapper``), the loader's renames, Quark's
``should_ignore_layer`` on the mapped list, and which modules each constructor builds with the quant config.
Then the tiny checkpoint converted and gated in real processes, and the load incident the rules predict: an
exclude list in the checkpoint's own names (a Quark export's) misses sglang's text model, built under
``model.layers.N`` with ``block_sparse_moe`` renamed ``mlp``, in every sglang release that builds the class;
vLLM's multimodal mapper keeps those names and loads it, but builds the vision tower with the quant config.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from quant.engines import rule_sets
from quant.engines.match import Exclude
from quant.engines.replay import (
    class_name,
    exclude_entries,
    excluded,
    stored_fused,
)
from quant.engines.rules import release_states, releases_read, window
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    load,
    method_def,
    packed_mapping,
    source,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel, wheel

FAMILY = "kimi_k3"
CLASS = "KimiK3ForConditionalGeneration"
SGLANG_MAIN = "sglang/srt/models/kimi_k3.py"
VLLM_MAIN = {"cuda": "vllm/models/kimi_k3/nvidia/model.py", "rocm": "vllm/models/kimi_k3/amd/model.py"}
VLLM_TEXT = {"cuda": "vllm/models/kimi_k3/nvidia/model.py", "rocm": "vllm/models/kimi_k3/amd/linear.py"}


def _cases(engine: str) -> list[tuple]:
    sample = window_sample(engine, FAMILY)
    read = releases_read(engine, FAMILY)
    return [(r, v) for r in rule_sets(engine, FAMILY) for v in sample if v in read and r.covers(read[v])]


SGLANG, VLLM = _cases("sglang"), _cases("vllm")
SG_IDS, V_IDS = [f"sglang {v}" for _, v in SGLANG], [f"vllm {v}" for _, v in VLLM]
# the tiny checkpoint's modules (layers 0, 1 KDA, layer 2 MLA; layer 0 dense) as a Quark export lists them
STORED = ["language_model.model.layers.0.self_attn.q_proj", "language_model.model.layers.0.self_attn.k_proj",
          "language_model.model.layers.0.self_attn.v_proj", "language_model.model.layers.0.self_attn.g_proj",
          "language_model.model.layers.0.self_attn.b_proj", "language_model.model.layers.0.self_attn.o_proj",
          "language_model.model.layers.0.mlp.gate_proj", "language_model.model.layers.0.mlp.up_proj",
          "language_model.model.layers.1.block_sparse_moe.experts.0.w1",
          "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj",
          "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj",
          "language_model.model.layers.2.self_attn.q_a_proj", "language_model.model.layers.2.self_attn.g_proj",
          "language_model.model.layers.2.self_attn.kv_a_proj_with_mqa", "language_model.lm_head",
          "mm_projector.proj.0", "vision_tower.encoder.blocks.0.wqkv"]
# the same modules in sglang's names (quantgate writes both)
SGLANG_NAMES = ["model.layers.0.self_attn.fused_qkvg_proj", "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.g_proj",
                "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.experts",
                "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa",
                "model.layers.2.self_attn.g_proj"]
# what sglang builds with the quant config and asks it for
SGLANG_MODULES = ["model.layers.0.self_attn.fused_qkvg_proj", "model.layers.0.self_attn.b_proj",
                  "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.experts",
                  "model.layers.1.mlp.shared_experts.gate_up_proj",
                  "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa", "model.layers.2.self_attn.g_proj"]
VLLM_NAMES = ["language_model.model.layers.0.self_attn.in_proj_qkvgfab",
              "language_model.model.layers.0.mlp.gate_up_proj",
              "language_model.model.layers.1.block_sparse_moe.experts",
              "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_up_proj",
              "language_model.model.layers.2.self_attn.fused_qkv_a_g_proj",
              "language_model.model.layers.2.self_attn.fused_qkv_a_proj", "mm_projector.linear_1"]
VLLM_MODULES = ["language_model.model.layers.0.self_attn.in_proj_qkvgfab",
                "language_model.model.layers.0.self_attn.o_proj", "language_model.model.layers.0.mlp.gate_up_proj",
                "language_model.model.layers.1.block_sparse_moe.experts",
                "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_up_proj",
                "language_model.model.layers.2.self_attn.fused_qkv_a_g_proj", "mm_projector.linear_1",
                "vision_tower.encoder.blocks.0.wqkv"]


def mapper_literal(whl, path: str, cls: str, name: str) -> dict[str, dict]:
    """A class's WeightsMapper literal: {orig_to_new_substr: ..., orig_to_new_prefix: ...}."""
    node = class_def(whl, path, cls)
    assign = next(s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == name)
    return {k.arg: ast.literal_eval(k.value) for k in assign.value.keywords}


def sglang_mapper(whl):
    mapper_cls = load(whl, "sglang/srt/models/utils.py", ["WeightsMapper"])["WeightsMapper"]
    return mapper_cls(**mapper_literal(whl, SGLANG_MAIN, CLASS, "hf_to_sglang_mapper"))


def vllm_mapper(whl, platform: str = "cuda"):
    path = "vllm/model_executor/models/utils.py"
    aliases = ["ShardIds", "ShardId"] if "\nShardIds:" in source(whl, path) else ["ShardId"]  # 0.29.0: no ShardIds
    utils = load(whl, path, ["WeightsMapper", *aliases],
                 {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})
    return utils["WeightsMapper"](**mapper_literal(whl, VLLM_MAIN[platform], CLASS, "hf_to_vllm_mapper"))


def vllm_packed(whl) -> dict[str, list[str]]:
    """The quant config's mapping on CUDA: KimiLinearModel's (SupportsQuant adds it when the text model is built;
    the multimodal class has none)."""
    assert class_constant(class_def(whl, VLLM_MAIN["cuda"], CLASS), "packed_modules_mapping") is None
    return {k: list(v) for k, v in class_constant(class_def(whl, VLLM_TEXT["cuda"], "KimiLinearModel"),
                                                  "packed_modules_mapping").items()}


@pytest.mark.parametrize(("rules", "release"), SGLANG + VLLM, ids=SG_IDS + V_IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    """sglang: the class's packed_modules_mapping (none before 0.5.19: the loader's fresh dict) with the loader's
    Quark additions; vLLM: KimiLinearModel's, whose in_proj_qkvgfab lists no g_proj shard."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        assert rules["quark_fused"] == packed_mapping(whl, SGLANG_MAIN, CLASS, "sglang", "quark")
        assert rules["fp8_skip"]["fused"] == packed_mapping(whl, SGLANG_MAIN, CLASS, "sglang", "fp8")
        return
    assert rules["quark_fused"] == rules["fp8_skip"]["fused"] == vllm_packed(whl)
    assert "g_proj" not in rules["quark_fused"]["in_proj_qkvgfab"]


@pytest.mark.parametrize(("rules", "release"), SGLANG + VLLM, ids=SG_IDS + V_IDS)
def test_exclude_mapper_is_the_class_mapper(rules, release):
    """The class's own hf_to_*_mapper literal (vLLM: the same in nvidia/ and amd/)."""
    whl = engine_wheel(rules, release)
    rule = rules["exclude_mapper"]
    if rules.engine == "sglang":
        theirs = mapper_literal(whl, SGLANG_MAIN, CLASS, "hf_to_sglang_mapper")
    else:
        theirs = mapper_literal(whl, VLLM_MAIN["cuda"], CLASS, "hf_to_vllm_mapper")
        assert theirs == mapper_literal(whl, VLLM_MAIN["rocm"], CLASS, "hf_to_vllm_mapper")
    assert {k: rule.get(k) or {} for k in ("substr", "prefix", "suffix")} == \
        {k: theirs.get(f"orig_to_new_{k}", {}) for k in ("substr", "prefix", "suffix")}


WEIGHTS = [f"{m}.weight" for m in STORED] + ["language_model.model.layers.1.block_sparse_moe.gate.weight",
                                            "mm_projector.proj.2.weight"]


@pytest.mark.parametrize(("rules", "release"), SGLANG + VLLM, ids=SG_IDS + V_IDS)
def test_module_names_are_the_loaders(rules, release):
    """sglang: what KimiK3ForConditionalGeneration.load_weights hands the text model (the class mapper, then
    language_model. dropped); vLLM: what the class mapper renames a stored weight to."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        fn = method_def(class_def(whl, SGLANG_MAIN, CLASS), "load_weights")
        (strip,) = [tuple(ast.literal_eval(a) for a in c.args) for c in ast.walk(fn)
                    if isinstance(c, ast.Call) and ast.unparse(c.func) == "name.replace"]
        mapper = sglang_mapper(whl)
        for weight in WEIGHTS:
            theirs = mapper._map_name(weight)
            theirs = theirs if theirs.startswith(("vision_tower", "mm_projector")) else theirs.replace(*strip)
            assert class_name(weight.removesuffix(".weight"), rules) + ".weight" == theirs, weight
        return
    mapper = vllm_mapper(whl)
    for weight in WEIGHTS:
        assert class_name(weight.removesuffix(".weight"), rules) + ".weight" == mapper._map_name(weight), weight


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SG_IDS)
def test_sglang_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists of stored and sglang names: the replay decides every module sglang builds as the
    wheel's should_ignore_layer on the list the wheel's mapper leaves. Stored names alone never exclude a
    text module (they stay under language_model.)."""
    whl = engine_wheel(rules, release)
    engine, mapper = _quark_engine(rules, whl), sglang_mapper(whl)
    fused = packed_mapping(whl, SGLANG_MAIN, CLASS, "sglang", "quark")
    assert exclude_entries({"exclude": STORED}, rules, "quark") == [mapper._map_name(e) for e in STORED]
    rng = random.Random(f"kimi_k3 sglang {release}")
    seen = 0
    for _ in range(120):
        listed = rng.sample(STORED + SGLANG_NAMES, rng.randint(0, len(STORED + SGLANG_NAMES)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        theirs_list = [mapper._map_name(e) for e in listed]
        for name in SGLANG_MODULES:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, theirs_list, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 100
    for name in SGLANG_MODULES:
        assert _outcome(engine, name, [mapper._map_name(e) for e in STORED], fused, name.endswith(".experts")) \
            is not True, name


@pytest.mark.parametrize(("rules", "release"), VLLM, ids=V_IDS)
def test_vllm_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists as written: the replay decides each module vLLM builds as the wheel's
    should_ignore_layer on the list the class's WeightsMapper leaves (vLLM's own), with KimiLinearModel's
    mapping (CUDA)."""
    whl = engine_wheel(rules, release)
    engine, mapper, fused = _quark_engine(rules, whl), vllm_mapper(whl), vllm_packed(whl)
    rng = random.Random(f"kimi_k3 vllm {release}")
    seen = 0
    for _ in range(120):
        listed = rng.sample(STORED + VLLM_NAMES, rng.randint(0, len(STORED + VLLM_NAMES)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        theirs_list = mapper.get_rename_mapper().apply_list(listed)
        for name in VLLM_MODULES:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, theirs_list, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 100


def _built(whl, path: str, cls: str, attr: str) -> list[str]:
    """The quant_config keyword each ``self.<attr> = ...`` of the class's __init__ passes ('absent' when none;
    a module moved to its device, ``self.<attr>.to(...)``, is no build)."""
    return [b.keywords.get("quant_config", "absent")
            for b in attribute_builds(method_def(class_def(whl, path, cls), "__init__"), attr)
            if not b.call.endswith(".to")]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SG_IDS)
def test_sglang_builds_these_without_the_quant_config(rules, release):
    """unquantized_roles: the router, the attention-residual scores, the latent projections (None, or
    latent_quant_config: None unless the config supports K3's quantized latent projections, no Quark or FP8
    config does) and the vision tower and projector (no quant config at all) are bf16 whatever the list says."""
    whl = engine_wheel(rules, release)
    assert _built(whl, SGLANG_MAIN, "KimiK3MoE", "gate") == ["None"]
    latent = set(_built(whl, SGLANG_MAIN, "KimiK3MoE", "routed_expert_down_proj") +
                 _built(whl, SGLANG_MAIN, "KimiK3MoE", "routed_expert_up_proj"))
    assert latent in ({"None"}, {"latent_quant_config"}), latent
    if latent == {"latent_quant_config"}:
        init = ast.unparse(method_def(class_def(whl, SGLANG_MAIN, "KimiK3MoE"), "__init__"))
        assert "'supports_kimi_k3_quantized_latent_projections', False) else None" in init
    for attr in ("self_attention_res_proj", "mlp_res_proj"):
        assert _built(whl, SGLANG_MAIN, "KimiK3DecoderLayer", attr) == ["None"]
    assert _built(whl, SGLANG_MAIN, "KimiK3LinearModel", "output_attn_res_proj") == ["None"]
    for attr in ("vision_tower", "mm_projector"):
        (call,) = [ast.unparse(s.value) for s in ast.walk(method_def(class_def(whl, SGLANG_MAIN, CLASS), "__init__"))
                   if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == f"self.{attr}"]
        assert call.endswith("(config.vision_config)"), call
    assert {"router", "latent_proj", "attn_res", "vision", "projector"} <= set(rules["unquantized_roles"])
    assert _built(whl, SGLANG_MAIN, "KimiK3DeltaAttention", "fused_qkvg_proj") == ["quant_config"]
    # the loader stacks q, k, v, g into it (KimiK3LinearForCausalLM.load_weights' full-rank-gate mapping)
    stacked = ast.unparse(method_def(class_def(whl, SGLANG_MAIN, "KimiK3LinearForCausalLM"), "load_weights"))
    shards = [p for p in ("q_proj", "k_proj", "v_proj", "g_proj") if f"('.fused_qkvg_proj', '.{p}'" in stacked]
    assert rules["built_fused"]["fused_qkvg_proj"] == shards == ["q_proj", "k_proj", "v_proj", "g_proj"]


@pytest.mark.parametrize(("rules", "release"), VLLM, ids=V_IDS)
def test_vllm_builds_these_with_or_without_the_quant_config(rules, release):
    """CUDA: the latent projections with the quant config from 0.31.0 (None before: role latent_proj bf16), the
    router and residual scores without, the vision tower and projector with it unless compressed-tensors."""
    whl = engine_wheel(rules, release)
    path = VLLM_TEXT["cuda"]
    assert _built(whl, path, "KimiMoE", "gate") == ["absent"]
    latent = set(_built(whl, path, "KimiMoE", "routed_expert_down_proj") +
                 _built(whl, path, "KimiMoE", "routed_expert_up_proj"))
    assert latent == ({"None"} if "latent_proj" in rules["unquantized_roles"] else {"quant_config"}), latent
    assert _built(whl, path, "KimiDecoderLayer", "self_attention_res_proj") == ["None"]
    assert "attn_res" in rules["unquantized_roles"]
    for attr in ("vision_tower", "mm_projector"):
        assert _built(whl, VLLM_MAIN["cuda"], CLASS, attr) == ["self._maybe_ignore_quant_config(quant_config)"]
        assert {"vision", "projector"}.isdisjoint(rules["unquantized_roles"])
    mla = method_def(class_def(whl, "vllm/models/kimi_k3/nvidia/mla.py", "MultiHeadLatentAttention"), "__init__")
    assert attribute_builds(mla, "fused_qkv_a_g_proj")
    assert rules["built_fused"]["fused_qkv_a_g_proj"] == ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"]
    rocm = attribute_builds(method_def(class_def(whl, VLLM_TEXT["rocm"], "KimiMLAAttention"), "__init__"),
                            "fused_qkv_a_proj")
    gate = ["g_proj"] if any(b.call == "KimiK3MergedQKVGateLinear" for b in rocm) else []
    assert rules["built_fused"]["fused_qkv_a_proj"] == ["q_a_proj", "kv_a_proj_with_mqa", *gate]


@pytest.mark.parametrize(("rules", "release"), SGLANG + VLLM, ids=SG_IDS + V_IDS)
def test_the_router_bias_is_created_as_the_wheels_do(rules, release):
    """sglang: DeepSeek-V2's MoEGate creates e_score_correction_bias under topk_method == 'noaux_tc' (KimiLinearConfig
    defines it); vLLM: KimiMoE.__init__ assigns gate.e_score_correction_bias under no condition."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        builds = attribute_builds(method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "MoEGate"), "__init__"),
                                  "e_score_correction_bias")
        assert builds and all(any("config.topk_method == 'noaux_tc'" in u for u in b.under) for b in builds)
        assert rules["router"]["bias_when"] == "noaux_tc"
        return
    init = method_def(class_def(whl, VLLM_TEXT["cuda"], "KimiMoE"), "__init__")
    assigned = [s for s in init.body if isinstance(s, ast.Assign)
                and ast.unparse(s.targets[0]) == "self.gate.e_score_correction_bias"]
    assert assigned and rules["router"]["bias_when"] == "always"


def test_g_proj_is_fused_by_the_shards_its_layer_stores():
    """A shard two fused modules list goes into the one whose other shards its layer stores (Kimi-K3's g_proj:
    KDA fused_qkvg_proj, MLA fused_qkv_a_g_proj); a shard stored without any sibling is built on its own
    (sglang's MLA g_proj); one fused module with stored siblings is left to fused_into."""
    fused = {"fused_qkvg_proj": ["q_proj", "k_proj", "v_proj", "g_proj"],
             "fused_qkv_a_g_proj": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"]}
    kda = {f"l.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "g_proj")}
    mla = {f"l.2.self_attn.{p}" for p in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")}
    assert stored_fused("l.0.self_attn.g_proj", fused, kda) == "fused_qkvg_proj"
    assert stored_fused("l.2.self_attn.g_proj", fused, mla) == "fused_qkv_a_g_proj"
    only_kda = {"fused_qkvg_proj": fused["fused_qkvg_proj"]}
    assert stored_fused("l.2.self_attn.g_proj", only_kda, mla) is None
    assert stored_fused("l.0.self_attn.g_proj", only_kda, kda) is False
    assert stored_fused("l.0.self_attn.o_proj", fused, kda) is False


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.17 (models/kimi_k3.py), vLLM from 0.27.0 (models/kimi_k3/): every release
    of the window that has it is read or named in NOTES.md as not read; none before it builds it."""
    path = {"sglang": SGLANG_MAIN, "vllm": "vllm/models/kimi_k3/__init__.py"}[engine]
    first = {"sglang": "0.5.17", "vllm": "0.27.0"}[engine]
    notes = " ".join((Path(__file__).parents[2] / "manifests/families/kimi_k3/NOTES.md").read_text().split())
    for release in (window(engine)[0], first, max(releases_read(engine, FAMILY), key=Version)):
        try:
            with zipfile.ZipFile(wheel(engine, release)) as z:
                names = set(z.namelist())
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (path in names) == (Version(release) >= Version(first)), release
    states = release_states(engine, FAMILY)
    for release in window(engine):
        if Version(release) >= Version(first):
            assert states[release].state in ("read", "carried") or release in notes, release
        else:
            assert states[release].state == "not built", states[release]


# --- the tiny checkpoint in real processes ----------------------------------------------------------------


def run(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny release converted --to mxfp4 and --to fp8 by quantgate, and a copy of the MXFP4 output whose
    exclude list names only modules the checkpoint stores (as a Quark export writes it)."""
    root = tmp_path_factory.mktemp("kimi_k3")
    src = write_family_checkpoint(root / "bf16", FAMILY)
    for to in ("mxfp4", "fp8"):
        done = run("quant.cli", "-q", "--to", to, src, root / to)
        assert done.returncode == 0, done.stdout + done.stderr
    stored = root / "stored"
    shutil.copytree(root / "mxfp4", stored)
    modules = {name.rsplit(".", 1)[0] for name in
               json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]}
    config = json.loads((stored / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"] if e in modules]
    (stored / "config.json").write_text(json.dumps(config, indent=2))
    return src, root


def test_only_routed_experts_become_mxfp4_and_both_engines_load(converted):
    """--to mxfp4 packs the routed experts alone; the exclude list names sglang's model.layers.N.mlp.* /
    self_attn.* and vLLM's fused and renamed modules beside the stored names; every release read loads it,
    and the block FP8 output too."""
    src, root = converted
    index = json.loads((root / "mxfp4" / "model.safetensors.index.json").read_text())["weight_map"]
    scales = {n.removesuffix(".weight_scale") for n in index if n.endswith(".weight_scale")}
    assert scales and all(".block_sparse_moe.experts." in n for n in scales)
    exclude = set(json.loads((root / "mxfp4" / "config.json").read_text())["quantization_config"]["exclude"])
    assert {"model.layers.0.self_attn.fused_qkvg_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
            "model.layers.1.mlp.routed_expert_down_proj", "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa",
            "language_model.model.layers.0.self_attn.in_proj_qkvgfab",
            "language_model.model.layers.2.self_attn.fused_qkv_a_g_proj", "mm_projector.linear_1",
            "vision_tower.encoder.blocks.0.wqkv"} <= exclude
    for folder in ("mxfp4", "fp8"):
        done = run("evals.cli", "checkpoint", root / folder)
        assert done.returncode == 0 and "loads correctly in every release read" in done.stdout, done.stdout


def test_bf16_decode_restores_the_release_names(converted, tmp_path):
    """--to bf16 decodes the MXFP4 output back into the release's names and shapes."""
    src, root = converted
    done = run("quant.cli", "-q", "--to", "bf16", root / "mxfp4", tmp_path / "bf16")
    assert done.returncode == 0, done.stdout + done.stderr
    names = [sorted(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
             for d in (src, tmp_path / "bf16")]
    assert names[0] == names[1]


def test_an_exclude_list_in_the_stored_names_fails_every_sglang_release(converted):
    """sglang 0.5.17-0.5.23 build the text model under model.layers.N (block_sparse_moe as mlp) and map a stored
    entry only to language_model.model.layers.N.mlp.*: the KDA, shared-expert and dense Linears are looked up
    as MXFP4 over bf16 weights. vLLM keeps the stored names and loads."""
    _, root = converted
    for release in ("0.5.17", "0.5.23"):
        failed = run("evals.cli", "checkpoint", root / "stored", "--engine", f"sglang=={release}")
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "model.layers.0.self_attn.fused_qkvg_proj" in failed.stdout
        assert "model.layers.1.mlp.shared_experts.gate_up_proj" in failed.stdout
    loads = run("evals.cli", "checkpoint", root / "stored", "--engine", "vllm==0.34.0")
    assert loads.returncode == 0, loads.stdout + loads.stderr


def test_vllm_needs_the_vision_tower_listed(converted, tmp_path):
    """vLLM builds the MoonViT tower and projector with the Quark config: without their entries the bf16
    weights meet MXFP4 slots; sglang builds them as plain nn.Linear and loads either way."""
    _, root = converted
    broken = tmp_path / "no_vision"
    shutil.copytree(root / "mxfp4", broken)
    config = json.loads((broken / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.startswith(("vision_tower.", "mm_projector."))]
    (broken / "config.json").write_text(json.dumps(config))
    failed = run("evals.cli", "checkpoint", broken, "--engine", "vllm==0.34.0")
    assert failed.returncode == 1 and "vision_tower.encoder.blocks.0.wqkv" in failed.stdout, failed.stdout
    assert run("evals.cli", "checkpoint", broken, "--engine", "sglang==0.5.23").returncode == 0


def test_a_release_before_the_class_is_refused(converted):
    """sglang 0.5.16 has no models/kimi_k3.py: it cannot serve the family; refused in one line."""
    _, root = converted
    refused = run("evals.cli", "checkpoint", root / "mxfp4", "--engine", "sglang==0.5.16")
    assert refused.returncode == 2 and "0.5.16" in refused.stderr and "Traceback" not in refused.stderr
