"""Differential tests for GLM-5.3-Flash (``glm5_next``, Glm5NextForConditionalGeneration): each release read
(``manifests/families/glm5_next/{sglang,vllm}.yaml``) decides with its own code beside ``quant.engines``: the
class's packed-modules mapping and weight mappers read from the same wheel, the exclude list mapped by the
wheel's own ``WeightsMapper`` (sglang: the main class's, and the draft class's
``Glm5NextForConditionalGenerationNextN.get_hf_to_sglang_mapper``), Quark's ``should_ignore_layer`` on the
mapped list; and the releases that build the class at all. Then its load incidents, rebuilt as tiny
checkpoints and checked by the real ``gate checkpoint`` in its own process: a vision tower and MTP experts
excluded under their stored names only (the way a Quark export lists them) are missed by sglang 0.5.20 (the
fused vision qkv_proj and the per-expert draft experts) and by vLLM's draft (the multimodal mapper renames the
entries away from the draft's module names), while quantgate's own exclude list loads in every release read.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.fusion import no_fusion_reason
from quant.engines.match import Exclude
from quant.engines.replay import (
    class_name,
    draft_exclude,
    draft_name,
    exclude_entries,
    excluded,
    mapped_entry,
    nextn_mapper,
)
from quant.engines.rules import release_states, releases_read, window
from quant.engines.serving import serving
from tests.quant.engine_sources import class_constant, class_def, load, methods, sglang_quark_loader_additions
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel, wheel

FAMILY = "glm5_next"
CLASS = "Glm5NextForConditionalGeneration"
MAIN = {"sglang": "sglang/srt/models/glm5_next.py", "vllm": "vllm/models/glm5next/common/model.py"}
NEXTN = "sglang/srt/models/glm5_next_nextn.py"
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
LAYERS = 3  # the tiny checkpoint's decoder layers; its MTP layer is layer 3
# exclude entries as the checkpoint stores the modules (a Quark export's names)
STORED = ["model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj", "model.visual.blocks.0.mlp.gate_proj",
          "model.visual.blocks.0.mlp.up_proj", "model.visual.merger.proj", "lm_head",
          "model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.0.self_attn.k_proj",
          "model.language_model.layers.0.self_attn.v_proj", "model.language_model.layers.1.mlp.experts.0.gate_proj",
          "model.language_model.layers.1.mlp.shared_experts.gate_proj",
          "model.language_model.layers.3.mlp.experts.0.gate_proj",
          "model.language_model.layers.3.mlp.experts.1.up_proj", "model.language_model.layers.3.self_attn.q_a_proj",
          "model.language_model.layers.3.self_attn.kv_a_proj_with_mqa", "model.language_model.layers.3.eh_proj",
          "model.language_model.layers.3", "model.layers.3.mlp.experts.0.down_proj",
          "model.decoder.mlp.experts.0.gate_proj", "visual.blocks.0.attn.q_proj", "visual.blocks.0.attn.k_proj",
          "visual.blocks.0.attn.v_proj", "model.layers.1.mlp.experts", "model.decoder.self_attn.q_a_proj"]
# the modules sglang builds and looks up (main model, then the draft)
MAIN_MODULES = ["visual.blocks.0.attn.qkv_proj", "visual.blocks.0.attn.proj", "visual.blocks.0.mlp.gate_up_proj",
                "visual.merger.proj", "model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.experts",
                "model.layers.1.mlp.shared_experts.gate_up_proj"]
DRAFT_MODULES = ["model.decoder.mlp.experts", "model.decoder.self_attn.fused_qkv_a_proj_with_mqa", "model.eh_proj",
                 "model.decoder.mlp.shared_experts.gate_up_proj"]


def wheel_packed(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The class's packed_modules_mapping as the wheel writes it (sglang 0.5.21+ spreads
    Glm5NextLinearAttention._PACKED_MODULES_MAPPING into it), plus sglang's loader additions for Quark."""
    node = class_def(whl, MAIN[engine], CLASS)
    assign = next(s for s in node.body
                  if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "packed_modules_mapping")
    mapping: dict = {}
    for key, value in zip(assign.value.keys, assign.value.values, strict=True):
        if key is None:  # **Owner.CONSTANT
            owner, _, constant = ast.unparse(value).partition(".")
            mapping.update(class_constant(class_def(whl, MAIN[engine], owner), constant))
        else:
            mapping[ast.literal_eval(key)] = ast.literal_eval(value)
    if engine == "sglang" and kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    return {k: list(v) for k, v in mapping.items()}


def mapper_literal(whl, path: str, cls: str, name: str) -> dict[str, dict]:
    """A class's WeightsMapper literal: {orig_to_new_substr: ..., orig_to_new_prefix: ..., ...}."""
    node = class_def(whl, path, cls)
    assign = next(s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == name)
    return {k.arg: ast.literal_eval(k.value) for k in assign.value.keywords}


def sglang_mappers(whl):
    """sglang's own WeightsMapper built from the main class's literal, and the draft class's mapper as its
    get_hf_to_sglang_mapper builds it (for the tiny config: num_hidden_layers 3)."""
    mapper_cls = load(whl, "sglang/srt/models/utils.py", ["WeightsMapper"])["WeightsMapper"]
    main = mapper_cls(**mapper_literal(whl, MAIN["sglang"], CLASS, "hf_to_sglang_mapper"))
    nextn = methods(whl, NEXTN, "Glm5NextForConditionalGenerationNextN", ["get_hf_to_sglang_mapper"],
                    {"WeightsMapper": mapper_cls, CLASS: types.SimpleNamespace(hf_to_sglang_mapper=main)})["cls"]
    config = types.SimpleNamespace(text_config=types.SimpleNamespace(num_hidden_layers=LAYERS))
    return main, nextn.get_hf_to_sglang_mapper(config)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["quark_fused"] == wheel_packed(whl, rules.engine, "quark")
    assert rules["fp8_skip"]["fused"] == wheel_packed(whl, rules.engine, "fp8")


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_exclude_mapper_is_the_class_mapper(rules, release):
    """sglang: the class's own hf_to_sglang_mapper (0.5.20 without the .attn.qkv suffix rule); vLLM: the
    mapper Glm5NextForConditionalGeneration inherits from Glm4vForConditionalGeneration (it defines none)."""
    whl = engine_wheel(rules, release)
    rule = rules["exclude_mapper"]
    if rules.engine == "sglang":
        theirs = mapper_literal(whl, MAIN["sglang"], CLASS, "hf_to_sglang_mapper")
    else:
        assert class_constant(class_def(whl, MAIN["vllm"], CLASS), "hf_to_vllm_mapper") is None
        assert "Glm4vForConditionalGeneration" in [ast.unparse(b) for b in class_def(whl, MAIN["vllm"], CLASS).bases]
        theirs = mapper_literal(whl, "vllm/model_executor/models/glm4_1v.py", "Glm4vForConditionalGeneration",
                                "hf_to_vllm_mapper")
    assert {k: rule.get(k) or {} for k in ("substr", "prefix", "suffix")} == \
        {k: theirs.get(f"orig_to_new_{k}", {}) for k in ("substr", "prefix", "suffix")}


def loader_renames(whl, path: str, cls: str, method: str) -> list[tuple[str, str]]:
    """The constant ``name.replace(old, new)`` calls of a loader method, in source order."""
    fn = next(n for n in class_def(whl, path, cls).body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [(ast.literal_eval(c.args[0]), ast.literal_eval(c.args[1])) for c in ast.walk(fn)
            if isinstance(c, ast.Call) and ast.unparse(c.func) == "name.replace" and len(c.args) >= 2
            and all(isinstance(a, ast.Constant) for a in c.args[:2])]


# stored weights of the main model and of the MTP layer (layer 3)
WEIGHTS = ["model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.mlp.gate_proj.weight",
           "model.visual.merger.proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight",
           "model.language_model.layers.1.mlp.experts.0.gate_proj.weight", "lm_head.weight"]
DRAFT_WEIGHTS = ["model.language_model.layers.3.mlp.experts.0.gate_proj.weight",
                 "model.language_model.layers.3.self_attn.q_a_proj.weight"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_names_are_the_loaders(rules, release):
    """sglang: the main model's names are what Glm5NextForConditionalGeneration.load_weights renames a stored
    weight to before its stacking (language_model. dropped, model.visual. -> visual., the vision attn.qkv. ->
    attn.qkv_proj.); vLLM: what the class's mapper renames it to, and the draft's what Glm5NextMTP.load_weights
    does (model.language_model. -> model.)."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        steps = [(old, new) for old, new in loader_renames(whl, MAIN["sglang"], CLASS, "load_weights")
                 if old in ("language_model.", "model.visual.", "attn.qkv.")]
        assert len(steps) == 3, steps
        for weight in WEIGHTS:
            theirs = weight
            for old, new in steps:
                theirs = theirs.replace(old, new) if old != "attn.qkv." or "visual" in theirs else theirs
            assert class_name(weight.removesuffix(".weight"), rules) + ".weight" == theirs
        return
    for weight in WEIGHTS:
        ours = class_name(weight.removesuffix(".weight"), rules) + ".weight"
        assert ours == mapped_entry(weight, rules["exclude_mapper"])
    renames = loader_renames(whl, "vllm/models/glm5next/common/mtp.py", "Glm5NextMTP", "load_weights")
    assert renames[0] == ("model.language_model.", "model."), renames
    for weight in DRAFT_WEIGHTS:
        assert draft_name(weight.removesuffix(".weight"), rules, LAYERS) == \
            weight.replace(*renames[0], 1).removesuffix(".weight")


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_exclude_entries_map_as_the_wheels_mappers(rules, release):
    """Each stored-name entry as the wheel's WeightsMapper maps it: the main class's (exclude_mapper) and the
    draft class's (draft_exclude: nextn_mapper in 0.5.20, the target's joined with the draft layer's after)."""
    main, draft = sglang_mappers(engine_wheel(rules, release))
    assert exclude_entries({"exclude": STORED}, rules, "quark") == [main._map_name(e) for e in STORED]
    ours, _ = draft_exclude([], rules, FAMILY, LAYERS, "quark", raw=STORED)
    assert ours == [draft._map_name(e) for e in STORED]
    how = rules["draft_exclude"][FAMILY]
    assert mapped_entry(f"model.layers.{LAYERS}", nextn_mapper(how, LAYERS, rules["exclude_mapper"])) == \
        draft._map_name(f"model.layers.{LAYERS}")


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_quark_decisions_equal_the_engines(rules, release):
    """Random stored-name exclude lists: the replay decides every main and draft module as the wheel's own
    should_ignore_layer on the list its mappers leave (Glm5NextForConditionalGenerationNextN's for the draft)."""
    whl = engine_wheel(rules, release)
    engine, (main, draft) = _quark_engine(rules, whl), sglang_mappers(whl)
    fused = wheel_packed(whl, "sglang", "quark")
    rng = random.Random(f"glm5_next{release}")
    seen = 0
    for _ in range(150):
        listed = rng.sample(STORED, rng.randint(0, len(STORED)))
        ours_main = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        ours_draft = Exclude(draft_exclude([], rules, FAMILY, LAYERS, "quark", raw=listed)[0])
        for modules, ours, mapper in ((MAIN_MODULES, ours_main, main), (DRAFT_MODULES, ours_draft, draft)):
            for name in modules:
                moe = name.endswith(".experts")
                theirs = _outcome(engine, name, [mapper._map_name(e) for e in listed], fused, moe)
                assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
                seen += theirs is True
    assert seen > 100


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_shared_expert_fusion_decisions_are_the_wheels(rules, release):
    """The class's own shared_experts_fusion_disable_reason (hardware and parallel state stubbed) on the tiny
    config: fused on CUDA sm80+ without expert parallelism whatever the exclude list says, never on ROCm at
    this geometry (0.5.20: ROCm never; later: only at the release's E=288 / top-8 geometry, not replayed)."""
    whl = engine_wheel(rules, release)
    text = {"n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64,
            "moe_intermediate_size": 32, "num_hidden_layers": LAYERS, "first_k_dense_replace": 1,
            "model_type": "glm5_next_text", "hidden_act": "silu", "swiglu_limit": 10.0}
    hf_config = types.SimpleNamespace(text_config=types.SimpleNamespace(**text))
    quark = types.SimpleNamespace(get_name=lambda: "quark", can_fuse_shared_expert=lambda: False)
    off = types.SimpleNamespace(is_deepep=lambda: False, is_none=lambda: True)
    for platform, sm, ep in (("cuda", 90, 1), ("cuda", 80, 1), ("cuda", 75, 1), ("cuda", 90, 8), ("rocm", 0, 1)):
        parallel = types.SimpleNamespace(moe_ep_size=ep, tp_size=8, moe_tp_size=8)
        stubs = {"_is_cuda": platform == "cuda", "_device_sm": sm, "_use_aiter_gfx95": platform == "rocm",
                 "get_parallel": lambda p=parallel: p, "get_moe_a2a_backend": lambda: off,
                 "is_layer_skipped": lambda *a, **k: False}
        decide = methods(whl, MAIN["sglang"], CLASS, ["shared_experts_fusion_disable_reason",
                                                      "_quark_mxfp4_shared_fusion_disable_reason"], stubs)["cls"]
        theirs = decide.shared_experts_fusion_disable_reason(hf_config, quark)
        setup = serving(platform, tp=8, ep=ep, gpu_arch={90: "sm90", 80: "sm80", 75: "sm75", 0: "gfx950"}[sm])
        ours = no_fusion_reason(rules, FAMILY, text, "quark", [], setup, draft=False)
        assert (ours is None) == (theirs is None), (release, platform, sm, ep, ours, theirs)


VLLM = [c for c in CASES if c[0].engine == "vllm"]
# the modules vLLM builds with the quant config (attention, indexer and vision are built without): main, draft
VLLM_MODULES = ["language_model.model.layers.1.mlp.experts",
                "language_model.model.layers.1.mlp.shared_experts.gate_up_proj",
                "language_model.model.layers.0.mlp.gate_up_proj", "model.layers.3.mlp.experts",
                "model.layers.3.mlp.shared_experts.gate_up_proj"]
VLLM_STORED = ["model.language_model.layers.1.mlp.experts.0.gate_proj", "model.language_model.layers.1.mlp.experts",
               "model.language_model.layers.1.mlp.shared_experts.gate_proj",
               "model.language_model.layers.1.mlp.shared_experts.up_proj",
               "model.language_model.layers.0.mlp.gate_proj",
               "model.language_model.layers.0.mlp.up_proj", "model.language_model.layers.3.mlp.experts.0.gate_proj",
               "model.layers.3.mlp.experts.0.gate_proj", "model.layers.3.mlp.shared_experts.gate_proj",
               "model.layers.3.mlp.shared_experts.up_proj", "language_model.model.layers.1.mlp.experts"]


@pytest.mark.parametrize(("rules", "release"), VLLM, ids=[f"vllm {v}" for _, v in VLLM])
def test_vllm_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists as written: the replay decides the main model's and the draft's modules as the
    wheel's should_ignore_layer on the list Glm4v's mapper (vLLM's own WeightsMapper) leaves; the draft
    (Glm5NextMTP) shares that list and builds model.layers.3.*, so a stored draft entry never reaches it."""
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    utils = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper", "ShardIds", "ShardId"],
                 {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})
    mapper = utils["WeightsMapper"](**mapper_literal(whl, "vllm/model_executor/models/glm4_1v.py",
                                                     "Glm4vForConditionalGeneration", "hf_to_vllm_mapper"))
    packed = class_constant(class_def(whl, MAIN["vllm"], CLASS), "packed_modules_mapping")
    fused = {k: list(v) for k, v in packed.items()}
    rng = random.Random(f"glm5_next vllm{release}")
    seen = 0
    for _ in range(150):
        listed = rng.sample(VLLM_STORED, rng.randint(0, len(VLLM_STORED)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        assert draft_exclude(ours.entries, rules, FAMILY, LAYERS, "quark", raw=listed) == (ours.entries, False)
        theirs_list = mapper.get_rename_mapper().apply_list(listed)
        for name in VLLM_MODULES:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, theirs_list, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 50


@pytest.mark.parametrize("engine", ENGINES)
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.20 (models/glm5_next.py), vLLM from 0.30.0 (models/glm5next/): every
    release of the window that has the class is read or listed in NOTES.md as not read; none before it."""
    path = {"sglang": MAIN["sglang"], "vllm": "vllm/models/glm5next/__init__.py"}[engine]
    first = {"sglang": "0.5.20", "vllm": "0.30.0"}[engine]
    read = releases_read(engine, FAMILY)
    notes = " ".join((Path(__file__).parents[2] / "manifests/families/glm5_next/NOTES.md").read_text().split())
    for release in (window(engine)[0], first, max(read, key=Version)):
        try:
            names = set(_names(wheel(engine, release)))
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (path in names) == (Version(release) >= Version(first)), release
    states = release_states(engine, FAMILY)
    for release in window(engine):
        if Version(release) >= Version(first):
            assert release in read or f"{engine} {release}" in notes, release
            assert states[release].state in ("read", "carried", "needs reading"), states[release]
        else:  # the window's lock says so from the wheels' model registries
            assert states[release].state == "not built", states[release]


def _names(whl) -> list[str]:
    import zipfile

    with zipfile.ZipFile(whl) as z:
        return z.namelist()


# --- the incidents, in real processes --------------------------------------------------------------------


def gate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """quantgate's own MXFP4 conversion with the MTP layer's experts kept bf16 (listed per expert), and the
    same checkpoint with the exclude list a Quark export writes: the stored module names only."""
    root = tmp_path_factory.mktemp("glm5_next")
    src = write_family_checkpoint(root / "bf16", FAMILY, num_hidden_layers=LAYERS)
    ours = root / "ours"
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "--mtp-experts", "bf16", str(src),
                           str(ours)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    stored = root / "stored"
    shutil.copytree(ours, stored)
    index = json.loads((stored / "model.safetensors.index.json").read_text())["weight_map"]
    modules = {name.rsplit(".", 1)[0] for name in index}
    config = json.loads((stored / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    config["quantization_config"]["exclude"] = [e for e in exclude if e in modules]
    assert any(".layers.3.mlp.experts.0." in e for e in config["quantization_config"]["exclude"])
    (stored / "config.json").write_text(json.dumps(config, indent=2))
    return ours, stored


def test_sglang_0_5_20_misses_the_stored_vision_qkv_and_per_expert_entries(converted):
    """sglang 0.5.20: the class mapper has no .attn.qkv suffix rule and Quark looks the fused qkv_proj up by
    shards the release does not store; the draft class maps only model.layers.3 (not the stored
    model.language_model.layers.3) and the FusedMoE is not matched by per-expert entries. 0.5.21 fixed both."""
    _, stored = converted
    failed = gate(stored, "--engine", "sglang==0.5.20")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "visual.blocks.0.attn.qkv_proj" in failed.stdout and "model.decoder.mlp.experts" in failed.stdout
    for release in ("0.5.21", "0.5.23"):
        fixed = gate(stored, "--engine", f"sglang=={release}")
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_vllm_draft_matches_no_entry_the_multimodal_mapper_renamed(converted):
    """vLLM 0.33.0: Glm4v's mapper renames model.language_model.layers.3.* to language_model.model.layers.3.*,
    but the MTP draft (Glm5NextMTP, sharing the quant config) builds model.layers.3.*: its bf16 experts are
    looked up as quantized."""
    _, stored = converted
    failed = gate(stored, "--engine", "vllm==0.33.0")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "model.layers.3.mlp.experts" in failed.stdout
    # served without the draft (the main model's entries are renamed to its own names), it loads
    without_draft = gate(stored, "--engine", "vllm==0.33.0", "--no-speculative")
    assert without_draft.returncode == 0, without_draft.stdout + without_draft.stderr


def test_quantgates_own_exclude_list_loads_in_every_release_read(converted):
    """quantgate writes the draft's names (sglang model.decoder.*, vLLM model.layers.3.*) and, for the stored
    fused vision qkv, the shards sglang 0.5.20 looks up under the built name (visual.blocks.0.attn.q_proj, ...)."""
    ours, _ = converted
    exclude = json.loads((ours / "config.json").read_text())["quantization_config"]["exclude"]
    assert {"visual.blocks.0.attn.q_proj", "model.decoder.mlp.experts", "model.layers.3.mlp.experts"} <= set(exclude)
    for args in ((), ("--engine", "sglang==0.5.20")):
        done = gate(ours, *args)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_release_before_the_class_is_refused(converted):
    """sglang 0.5.19 has no models/glm5_next.py: it cannot serve the family, and is never replayed."""
    ours, _ = converted
    refused = gate(ours, "--engine", "sglang==0.5.19")
    assert refused.returncode == 2 and "0.5.19" in refused.stderr and "Traceback" not in refused.stderr
