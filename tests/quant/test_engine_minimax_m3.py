"""Differential tests for MiniMax-M3 (``minimax_m3``, MiniMaxM3SparseForConditionalGeneration): each
release read (``manifests/families/minimax_m3/{sglang,vllm}.yaml``) decides with its own code beside
``quant.engines``: Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` fed the class's
packed-modules mapping read from the same wheel, on the exclude list as the class's weight mapper
(read from the wheel) leaves it; sglang's shared-expert fusion decision (the class's own
``shared_experts_fusion_disable_reason``, hardware queries stubbed); the MTP modules the main models
skip (sglang's own ``get_spec_layer_idx_from_weight_name``); and how the router, the vision tower,
the MoE block and the fused attention projections are built, read from the constructors and loaders.
vLLM's class comes from a per-platform file (``models/minimax_m3/__init__.py``: ``amd/model.py`` on
ROCm, ``nvidia/model.py`` elsewhere): each vLLM check runs on both, the exclude list through vLLM's own
``WeightsMapper`` built from that file's ``hf_to_vllm_mapper``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import random
import types
import typing

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
)
from quant.engines.rules import releases_read
from quant.engines.serving import serving
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    load,
    method_def,
    methods,
    sglang_quark_loader_additions,
    source,
)
from tests.quant.test_engine_sources import (
    GPUS,
    _fp8_engine,
    _quark_engine,
    _stubs,
    engine_wheel,
    fp8_disagreements,
    quark_disagreements,
)

FAMILY = "minimax_m3"
VL = "MiniMaxM3SparseForConditionalGeneration"
TEXT = "MiniMaxM3SparseForCausalLM"
MAIN = {"sglang": "sglang/srt/models/minimax_m3_vl.py", "vllm": "vllm/models/minimax_m3/nvidia/model.py"}
TEXT_PATH = {"sglang": "sglang/srt/models/minimax_m3.py", "vllm": "vllm/models/minimax_m3/nvidia/model.py"}
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
# vLLM 0.33.0's model files per platform (models/minimax_m3/__init__.py: amd/ when current_platform.is_rocm())
VLLM_FILES = {"cuda": "vllm/models/minimax_m3/nvidia/", "rocm": "vllm/models/minimax_m3/amd/"}
VLLM = [c for c in CASES if c[0].engine == "vllm"]


def platforms(engine: str) -> list[str]:
    """The platforms whose files differ: vLLM's two model files, sglang's one."""
    return list(VLLM_FILES) if engine == "vllm" else ["rocm"]


def main_path(engine: str, platform: str) -> str:
    return VLLM_FILES[platform] + "model.py" if engine == "vllm" else MAIN[engine]


def text_path(engine: str, platform: str) -> str:
    return VLLM_FILES[platform] + "model.py" if engine == "vllm" else TEXT_PATH[engine]


def wheel_mapping(whl, engine: str, kind: str, platform: str = "cuda") -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds: the VL class's literal (vLLM: also the text
    class's, which configure_quant_config sets when it builds it; they must agree), plus sglang's
    loader additions for Quark."""
    mapping = dict(class_constant(class_def(whl, main_path(engine, platform), VL), "packed_modules_mapping") or {})
    if engine == "vllm":
        assert class_constant(class_def(whl, text_path(engine, platform), TEXT), "packed_modules_mapping") == mapping
    if engine == "sglang" and kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    return {k: list(v) for k, v in mapping.items()}


def wheel_mapper(whl, engine: str, platform: str = "cuda") -> dict[str, dict[str, str]]:
    """The VL class's weight mapper as the wheel writes it: {orig_to_new_prefix: ..., orig_to_new_substr: ...}."""
    node = class_def(whl, main_path(engine, platform), VL)
    name = "hf_to_sglang_mapper" if engine == "sglang" else "hf_to_vllm_mapper"
    assign = next(s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == name)
    return {k.arg: ast.literal_eval(k.value) for k in assign.value.keywords}


def vllm_mapper(whl, platform: str):
    """vLLM's own WeightsMapper (models/utils.py) built from the platform file's hf_to_vllm_mapper literal."""
    ns = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper", "ShardIds", "ShardId"],
              {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})
    return ns["WeightsMapper"](**wheel_mapper(whl, "vllm", platform))


def vllm_exclude(whl, platform: str):
    """The exclude list as QuarkConfig.apply_vllm_mapper leaves it (model_loader/utils.py:
    configure_quant_config passes hf_to_vllm_mapper.get_rename_mapper(); apply_list)."""
    rename = vllm_mapper(whl, platform).get_rename_mapper()
    return rename.apply_list


def engine_exclude(entries: list[str], mapper: dict, engine: str) -> list[str]:
    """The exclude list after the loader applied the mapper (WeightsMapper.apply_list: substrings,
    then prefixes); sglang's QuarkConfig.apply_weight_name_mapper also adds each language_model.*
    entry without that prefix."""
    out = []
    for entry in entries:
        for old, new in mapper.get("orig_to_new_substr", {}).items():
            entry = entry.replace(old, new)
        for old, new in mapper.get("orig_to_new_prefix", {}).items():
            if entry.startswith(old):
                entry = new + entry[len(old):]
        out.append(entry)
        if engine == "sglang" and entry.startswith("language_model."):
            out.append(entry.removeprefix("language_model."))
    return out


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    for platform in platforms(rules.engine):
        assert wheel_mapping(whl, rules.engine, "quark", platform) == rules["quark_fused"]
        assert wheel_mapping(whl, rules.engine, "fp8", platform) == rules["fp8_skip"]["fused"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_names_are_the_class_mapper(rules, release):
    """sglang's mapper renames block_sparse_moe to mlp (and _load_llm_weight does the same to the
    weights); vLLM's renames the projector and patch merger under vision_tower and the tower's
    .mlp.fc1./.mlp.fc2. (ROCm's amd/model.py: .mlp.fc1/.mlp.fc2): the replay's module_names give each
    checkpoint weight the mapper's name on either platform (vLLM: its own WeightsMapper)."""
    whl = engine_wheel(rules, release)
    modules = ("language_model.model.layers.1.block_sparse_moe.gate",
               "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj",
               "language_model.model.layers.0.mlp.gate_proj", "multi_modal_projector.linear_1",
               "patch_merge_mlp.linear_2", "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
               "vision_tower.vision_model.encoder.layers.0.mlp.fc1", "vision_tower.vision_model.encoder.layers.3.mlp.fc2")
    for platform in platforms(rules.engine):
        if rules.engine == "vllm":
            rename = vllm_mapper(whl, platform).map_name
        else:
            rename = functools.partial(lambda name, mapper: engine_exclude([name], mapper, "vllm")[0],
                                       mapper=wheel_mapper(whl, rules.engine))
        for module in modules:
            assert class_name(module, rules) + ".weight" == rename(module + ".weight"), (platform, module)


# exclude entries as a checkpoint may list them: stored names, the built names, regexes over either
EXCLUDE_POOL = ["vision_tower.vision_model.encoder.layers.0.mlp.fc1", "vision_tower.vision_model.encoder.layers.0.mlp.fc2",
                "vision_tower.vision_model.encoder.layers.2.fc1", "re:.*mlp\\.fc1.*", "re:.*\\.mlp\\.fc2$",
                "multi_modal_projector.linear_1", "multi_modal_projector", "patch_merge_mlp.linear_2",
                "vision_tower.multi_modal_projector.linear_2", "re:^multi_modal_projector\\..*",
                "language_model.model.layers.0.mlp.gate_proj", "language_model.model.layers.1.block_sparse_moe.gate",
                "language_model.model.mtp.layers.0.eh_proj", "language_model.lm_head", "re:.*vision_tower.*",
                "mlp.fc1.", "language_model.model.layers.0.mlp.fc1_x"]


@pytest.mark.parametrize(("rules", "release"), VLLM, ids=[f"vllm {v}" for _, v in VLLM])
@pytest.mark.parametrize("platform", list(VLLM_FILES))
def test_vllm_exclude_list_is_renamed_as_each_platform_class_renames_it(rules, release, platform):
    """exclude_mapper on ``platform`` equals vLLM's own rename mapper built from that platform's file,
    on random lists: the prefixes rename on both, the tower's mlp.fc1 / mlp.fc2 entries on ROCm only."""
    whl = engine_wheel(rules, release)
    theirs = vllm_exclude(whl, platform)
    setup = serving(platform)
    rng = random.Random(f"m3-mapper{platform}")
    for _ in range(300):
        entries = rng.sample(EXCLUDE_POOL, rng.randint(0, len(EXCLUDE_POOL)))
        assert exclude_entries({"exclude": entries}, rules, "quark", setup) == theirs(entries), entries
    fc1 = "vision_tower.vision_model.encoder.layers.0.mlp.fc1"
    renamed = exclude_entries({"exclude": [fc1]}, rules, "quark", setup) == [fc1.replace(".mlp.fc1", ".fc1")]
    assert renamed == (platform == "rocm")  # what differs between the two files


LAYERS = ["language_model.model.layers.0.", "language_model.model.layers.1."]
# the modules each engine builds (sglang: the MoE block as mlp, the indexer as index_qkv_proj; vLLM:
# block_sparse_moe, the indexer inside qkv_proj)
BUILT = {"sglang": ["self_attn.qkv_proj", "self_attn.o_proj", "self_attn.index_qkv_proj", "mlp.gate_up_proj",
                    "mlp.down_proj", "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", "mlp.experts",
                    "mlp.gate"],
         "vllm": ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                  "block_sparse_moe.shared_experts.gate_up_proj", "block_sparse_moe.shared_experts.down_proj",
                  "block_sparse_moe.experts", "block_sparse_moe.gate"]}
STORED = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.index_q_proj",
          "self_attn.index_k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
          "block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj",
          "block_sparse_moe.shared_experts.down_proj", "block_sparse_moe.experts", "block_sparse_moe.gate",
          "block_sparse_moe.experts.0.w1", "mlp.experts"]
VISION = ["vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj",
          "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj",
          "vision_tower.vision_model.encoder.layers.0.fc1", "vision_tower.multi_modal_projector.linear_1",
          "vision_tower.patch_merge_mlp.linear_2"]
VISION_STORED = ["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
                 "vision_tower.vision_model.encoder.layers.0.self_attn.k_proj",
                 "vision_tower.vision_model.encoder.layers.0.self_attn.v_proj",
                 "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj",
                 "vision_tower.vision_model.encoder.layers.0.mlp.fc1", "vision_tower.vision_model.encoder.layers.0.fc1",
                 "multi_modal_projector.linear_1", "patch_merge_mlp.linear_2"]


QUARK_CASES = [(r, v, p) for r, v in CASES for p in platforms(r.engine)]


@pytest.mark.parametrize(("rules", "release", "platform"), QUARK_CASES,
                         ids=[f"{r.engine} {v} {p}" for r, v, p in QUARK_CASES])
def test_quark_exclude_decisions_equal_the_engines(rules, release, platform):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "quark", platform)
    modules = [p + m for p in LAYERS for m in BUILT[rules.engine]] + VISION
    entries = [p + m for p in LAYERS for m in STORED] + VISION_STORED + \
        ["re:.*shared_experts.*", "re:.*vision_tower.*", "re:.*index_.*", "language_model.lm_head", "mlp.gate"]
    rng = random.Random(f"minimax_m3{rules.id}{release}{platform}")

    # the writer lists each entry in the mapper's names too (quant/serving.py); the engine sees that list
    # after its mapper. vLLM: also a list in the stored names only (a checkpoint quantgate did not write),
    # which the replay maps with exclude_mapper for the platform
    def written(exclude):
        return exclude + [class_name(e, rules) for e in exclude]

    if rules.engine == "vllm":
        setup = serving(platform)
        theirs = vllm_exclude(whl, platform)
        ways = [(lambda ex, w=w: exclude_entries({"exclude": w(ex)}, rules, "quark", setup),
                 lambda ex, w=w: theirs(w(ex))) for w in (written, list)]
    else:
        mapper = wheel_mapper(whl, rules.engine)
        ways = [(written, lambda exclude: engine_exclude(written(exclude), mapper, rules.engine))]
    for ours, theirs_list in ways:
        disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=22,
                                             names=5, ours=ours, theirs=theirs_list)
        assert not disagree, disagree[:3]
        assert seen > 30


@pytest.mark.parametrize(("rules", "release", "platform"), QUARK_CASES,
                         ids=[f"{r.engine} {v} {p}" for r, v, p in QUARK_CASES])
def test_fp8_skip_decisions_equal_the_engines(rules, release, platform):
    """FP8's own from_config and is_layer_skipped on the class's mapping; vLLM's ignored_layers pass the
    platform class's rename mapper first (Fp8Config.apply_vllm_mapper), sglang hands FP8 configs none.
    The replay's side is exclude_entries (exclude_mapper for the platform) and match.fp8_skipped."""
    whl = engine_wheel(rules, release)
    decide = _fp8_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "fp8", platform)
    mapper = vllm_exclude(whl, platform) if rules.engine == "vllm" else list
    setup = serving(platform)
    modules = [p + m for p in LAYERS for m in BUILT[rules.engine]] + VISION
    entries = [p + m for p in LAYERS for m in STORED + BUILT[rules.engine]] + VISION + VISION_STORED + \
        ["language_model.lm_head"]
    rng = random.Random(f"fp8minimax_m3{rules.id}{release}{platform}")
    disagree, seen = fp8_disagreements(decide, rules["fp8_skip"], fused, modules, entries, rng, draws=200, most=16,
                                       names=4, listed_by=lambda q: exclude_entries(q, rules, "fp8", setup),
                                       theirs=mapper)
    assert not disagree, disagree[:3]
    assert seen > 30


def _fusion_engine(whl):
    """(text config, kind, serving) -> whether the release fuses MiniMax-M3's shared expert: the VL
    class's own shared_experts_fusion_disable_reason, then its count (0.5.23) or its
    _determine_num_fused_shared_experts (0.5.21, 0.5.22), as layers/moe/utils.py calls them."""
    names = ["shared_experts_fusion_disable_reason", "num_fusable_shared_experts", "_determine_num_fused_shared_experts"]
    holder = methods(whl, MAIN["sglang"], VL, [n for n in names if f"def {n}(" in source(whl, MAIN["sglang"])])["cls"]
    if "shared_experts_fusion_disable_reason" not in holder.__dict__:  # 0.5.17: the model decides in __init__
        return _determine_engine(whl, holder)
    gate = holder.__dict__["shared_experts_fusion_disable_reason"].__func__
    count = holder.__dict__.get("num_fusable_shared_experts")

    def decide(text, kind, setup) -> bool:
        cap = setup.capability
        gate.__globals__.update(_stubs(whl, setup, None), _device_sm=cap[0] * 10 + cap[1] if setup.platform == "cuda"
                                else None, _is_gfx95_supported=setup.platform == "rocm" and cap >= (9, 5))
        hf = types.SimpleNamespace(text_config=types.SimpleNamespace(**text))
        disabled = setup.disable_shared_experts_fusion or \
            gate(holder, hf, types.SimpleNamespace(get_name=lambda: kind)) is not None
        if count is not None:  # 0.5.23: resolve_shared_experts_config
            return not disabled and count.__func__(holder, hf) > 0
        fn = holder.__dict__["_determine_num_fused_shared_experts"]
        fn.__globals__.update(is_shared_experts_fusion_disabled=lambda: disabled)
        model = types.SimpleNamespace(config=hf, num_fused_shared_experts=0)
        fn(model)
        return bool(model.num_fused_shared_experts)
    return decide


def _determine_engine(whl, holder):
    """sglang 0.5.17: the model's own _determine_num_fused_shared_experts, run on a stand-in instance."""
    fn = holder.__dict__["_determine_num_fused_shared_experts"]

    def decide(text, kind, setup) -> bool:
        cap = setup.capability
        flags = _stubs(whl, setup, None)
        fn.__globals__.update(flags, _device_sm=cap[0] * 10 + cap[1] if setup.platform == "cuda" else None)
        hf = types.SimpleNamespace(text_config=types.SimpleNamespace(**text))
        model = types.SimpleNamespace(config=hf, num_fused_shared_experts=0,
                                      quant_config=types.SimpleNamespace(get_name=lambda: kind))
        from tests.quant.test_engine_sources import _served

        with _served("sglang.srt.arg_groups.overrides", declare_load_time_override=lambda *a: None):
            fn(model)
        return bool(model.num_fused_shared_experts)
    return decide


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_shared_expert_fusion_decisions_are_the_engines(rules, release):
    engine = _fusion_engine(engine_wheel(rules, release))
    rng = random.Random(f"m3-fusion{release}")
    disagree, fused = [], 0
    for _ in range(150):
        text = {"num_hidden_layers": 60, "num_local_experts": rng.choice([128, 256, 4]),
                "n_shared_experts": rng.choice([1, 1, 1, None, 0]), "num_mtp_modules": 1}
        exclude = rng.sample(["language_model.model.layers.3.block_sparse_moe.shared_experts.gate_proj",
                              "re:.*shared_experts.*", "language_model.lm_head"], rng.randint(0, 2))
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 1, 8]), disable_shared_experts_fusion=rng.random() < 0.15)
        theirs = engine(text, kind, setup)
        ours = no_fusion_reason(rules, FAMILY, text, kind, exclude, setup, False) is None
        fused += theirs
        if theirs != ours:
            disagree.append((text, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert 0 < fused < 150


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_mtp_modules_are_skipped_as_the_wheel_skips_them(rules, release):
    """sglang's own get_spec_layer_idx_from_weight_name (applied by _load_llm_weight after stripping
    language_model.) names the MTP modules the main model skips: the replay builds nothing from exactly
    those, and builds every decoder layer."""
    whl = engine_wheel(rules, release)
    load_llm = ast.unparse(method_def(class_def(whl, MAIN["sglang"], VL), "_load_llm_weight"))
    assert "get_spec_layer_idx_from_weight_name(self.config.text_config, name)" in load_llm
    spec = load(whl, TEXT_PATH["sglang"], ["get_spec_layer_idx_from_weight_name"],
                {"PretrainedConfig": object})["get_spec_layer_idx_from_weight_name"]
    config = types.SimpleNamespace(num_hidden_layers=60, num_mtp_modules=2)
    for name in ("language_model.model.layers.0.block_sparse_moe.experts.3.w1",
                 "language_model.model.layers.59.self_attn.q_proj", "language_model.model.mtp.layers.0.eh_proj",
                 "language_model.model.mtp.layers.1.transformer_layer.block_sparse_moe.experts.0.w2"):
        skipped = spec(config, name.removeprefix("language_model.") + ".weight") is not None
        assert skipped == (draft_name(name, rules, 60) is None), name


@pytest.mark.parametrize("platform", list(VLLM_FILES))
def test_vllm_main_model_skips_the_mtp_modules(platform):
    rules, release = VLLM[0]
    whl = engine_wheel(rules, release)
    load_weights = ast.unparse(method_def(class_def(whl, main_path("vllm", platform), "MiniMaxM3Model"), "load_weights"))
    assert "if 'mtp.' in name:\n            continue" in load_weights.replace('"', "'")
    assert draft_name("language_model.model.layers.0.self_attn.q_proj", rules, 60) == \
        "language_model.model.layers.0.self_attn.q_proj"
    # the draft class (built only under --speculative-config): its eh_proj takes the quant config, looked
    # up by Quark and FP8 alike (ReplicatedLinear is a LinearBase)
    mtp = class_def(whl, VLLM_FILES[platform] + "mtp.py", "MiniMaxM3MultiTokenPredictorLayer")
    eh = attribute_builds(method_def(mtp, "__init__"), "eh_proj")
    assert eh[0].call == "ReplicatedLinear" and eh[0].keywords.get("prefix") == "f'{prefix}.eh_proj'"
    assert rules["eh_proj"] == ("any_quant_config" if eh[0].keywords.get("quant_config") == "quant_config" else "plain")


DRAFT_STORED = ["language_model.model.mtp.layers.0.eh_proj", "language_model.model.mtp.layers.1.transformer_layer.self_attn.q_proj",
                "language_model.model.mtp.layers.0.transformer_layer.self_attn.index_k_proj",
                "language_model.model.mtp.layers.0.transformer_layer.self_attn.o_proj",
                "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.7.w2",
                "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.shared_experts.up_proj",
                "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.gate"]


@pytest.mark.parametrize("platform", list(VLLM_FILES))
def test_vllm_draft_names_are_the_wheels(platform):
    """MiniMaxM3MTP's own _map_checkpoint_name gives each stored MTP module the name the replay builds
    (model.layers.{i}.*), and the prefixes its constructors pass (model -> layers.{idx} -> eh_proj; the
    decoder layer built with the layer's own prefix, no transformer_layer) are the ones the exclude list is
    matched against; a main-model name maps to None (the draft does not own it)."""
    rules, release = VLLM[0]
    whl = engine_wheel(rules, release)
    path = VLLM_FILES[platform] + "mtp.py"
    cls = methods(whl, path, "MiniMaxM3MTP", ["_map_checkpoint_name"])["cls"]
    # the parameter it loads into: the module's attribute path (model.layers.{idx}.transformer_layer.*);
    # the name the quant config was asked for: the prefix passed down (the same path less transformer_layer)
    for name in DRAFT_STORED:
        param = cls._map_checkpoint_name(None, name + ".weight")
        assert param.startswith("model.layers.") and param.removesuffix(".weight").replace(".transformer_layer.", ".", 1) \
            == draft_name(name, rules, 60), name
    assert cls._map_checkpoint_name(None, "language_model.model.layers.3.self_attn.q_proj.weight") is None
    init = ast.unparse(method_def(class_def(whl, path, "MiniMaxM3MTP"), "__init__"))
    assert "MiniMaxM3MultiTokenPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, 'model'))" in init
    pred = ast.unparse(method_def(class_def(whl, path, "MiniMaxM3MultiTokenPredictor"), "__init__"))
    assert "f'{prefix}.layers.{idx}'" in pred and "range(self.num_mtp_layers)" in pred
    assert "self.num_mtp_layers = config.num_mtp_modules" in pred and rules["mtp_naming"]["max_layers"] is None
    layer = attribute_builds(method_def(class_def(whl, path, "MiniMaxM3MultiTokenPredictorLayer"), "__init__"),
                             "transformer_layer")
    assert layer[0].keywords["prefix"] == "prefix"  # the decoder layer's Linears: model.layers.{idx}.self_attn...
    # no mapper, no packed mapping of its own: the target's (shared) quant config is used as the target left it
    draft = class_def(whl, path, "MiniMaxM3MTP")
    assert class_constant(draft, "hf_to_vllm_mapper") is None and class_constant(draft, "packed_modules_mapping") is None
    assert rules["draft_exclude"] == {FAMILY: "none"}


def _env_default(whl, name: str):
    """The value vllm/envs.py's own lambda for ``name`` gives with the variable unset."""
    tree = ast.parse(source(whl, "vllm/envs.py"))
    table = next(n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 and ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target) == "environment_variables")
    fn = next(v for k, v in zip(table.keys, table.values) if isinstance(k, ast.Constant) and k.value == name)
    saved = os.environ.pop(name, None)
    try:
        return eval(compile(ast.Expression(fn), "envs.py", "eval"), {"os": os})()  # the wheel's own lambda
    finally:
        if saved is not None:
            os.environ[name] = saved


# the draft's Linears as MiniMaxM3MTP builds them (model.layers.{idx}.*: a sparse-attention MoE layer and
# eh_proj; its router is a GateLinear without quant config), and the names an exclude list may hold
DRAFT_BUILT = ["self_attn.qkv_proj", "self_attn.o_proj", "block_sparse_moe.shared_experts.gate_up_proj",
               "block_sparse_moe.shared_experts.down_proj", "block_sparse_moe.experts", "eh_proj"]
DRAFT_LAYERS = ["model.layers.0.", "model.layers.1."]


def _draft_entries() -> list[str]:
    stored = [f"language_model.model.mtp.layers.{i}.transformer_layer." + m for i in (0, 1) for m in STORED] + \
        [f"language_model.model.mtp.layers.{i}.eh_proj" for i in (0, 1)]
    return stored + [p + m for p in DRAFT_LAYERS for m in STORED + DRAFT_BUILT] + \
        [p + m for p in LAYERS for m in ("self_attn.q_proj", "block_sparse_moe.experts", "eh_proj")] + \
        ["re:.*shared_experts.*", "re:.*eh_proj.*", "re:.*mtp.*"]


@pytest.mark.parametrize("platform", list(VLLM_FILES))
def test_vllm_draft_quark_and_fp8_decisions_equal_the_engines(platform):
    """The draft shares the target's quant config (llm_base_proposer.py: _create_draft_vllm_config) with
    the main class's mapper applied and its packed mapping: vLLM's own should_ignore_layer and
    is_layer_skipped on the draft's module names, against the replay's draft_exclude and decisions, for
    random lists in stored, draft and main names; and quantgate's writer (each stored MTP name also
    listed as draft_name gives it) makes the draft's module unquantized exactly when its stored shards are."""
    rules, release = VLLM[0]
    whl = engine_wheel(rules, release)
    setup = serving(platform)
    modules = [p + m for p in DRAFT_LAYERS for m in DRAFT_BUILT]
    entries = _draft_entries()
    theirs = vllm_exclude(whl, platform)

    def ours(exclude):
        return draft_exclude(exclude_entries({"exclude": exclude}, rules, "quark", setup), rules, FAMILY, 60, "quark")[0]

    def written(exclude):
        return exclude + [draft_name(e, rules, 60) for e in exclude if e.startswith("language_model.model.mtp.")]

    engine = _quark_engine(rules, whl)
    fused = wheel_mapping(whl, "vllm", "quark", platform)
    rng = random.Random(f"minimax_m3 draft {platform}")
    for way in (list, written):
        disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=16, names=4,
                                             ours=lambda ex, w=way: ours(w(ex)), theirs=lambda ex, w=way: theirs(w(ex)))
        assert not disagree, disagree[:3]
        assert seen > 30
    # a list in stored names only (quantgate's before the draft was replayed) excludes none of the draft's
    # modules; with each entry's draft name too, all of them
    stored_only = [e for e in entries if e.startswith("language_model.model.mtp.") and "experts.0" not in e]
    assert not any(engine(m, theirs(stored_only), fused, m.endswith(".experts")) for m in modules)
    assert all(engine(m, theirs(written(stored_only)), fused, m.endswith(".experts")) for m in modules)

    decide = _fp8_engine(rules, whl)
    fp8_fused = wheel_mapping(whl, "vllm", "fp8", platform)
    disagree, seen = fp8_disagreements(
        decide, rules["fp8_skip"], fp8_fused, modules, entries, rng, draws=200, most=12, names=3, theirs=theirs,
        listed_by=lambda q: draft_exclude(exclude_entries(q, rules, "fp8", setup), rules, FAMILY, 60, "fp8")[0],
        decided_by=lambda name, listed: excluded(name, Exclude(listed), rules, "fp8", name.endswith(".experts")))
    assert not disagree, disagree[:3]
    assert seen > 30


def test_vllm_shared_expert_fusion_is_a_rocm_opt_in_left_off():
    """shared_experts_fusion null for vLLM: nvidia/model.py builds the shared expert whenever
    n_shared_experts is set; amd/model.py leaves it out (fused as expert num_local_experts) only when
    VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS is set, whose default (envs.py's own lambda) is off, and
    outside expert parallelism, if is_shared_expert_quant_fse_compatible allows it."""
    rules, release = VLLM[0]
    whl = engine_wheel(rules, release)
    assert rules["shared_experts_fusion"] is None
    nvidia = method_def(class_def(whl, main_path("vllm", "cuda"), "MiniMaxM3MoE"), "__init__")
    assert [b.under for b in attribute_builds(nvidia, "shared_experts") if b.call == "MiniMaxM3MLP"] == \
        [["self.n_shared_experts"]]
    amd = method_def(class_def(whl, main_path("vllm", "rocm"), "MiniMaxM3MoE"), "__init__")
    assert [b.under for b in attribute_builds(amd, "shared_experts") if b.call == "MiniMaxM3MLP"] == \
        [["self.n_shared_experts and (not self.is_fused_shared_expert_enabled)"]]
    text = ast.unparse(amd)
    assert "fse_requested = envs.VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS" in text
    gate = next(n for n in ast.walk(amd) if isinstance(n, ast.If) and "fse_requested" in ast.unparse(n.test))
    assert ast.unparse(gate.test).startswith("fse_requested and")
    assert "not get_current_vllm_config().parallel_config.enable_expert_parallel" in ast.unparse(gate.test)
    assert "is_shared_expert_quant_fse_compatible(" in ast.unparse(gate)
    assert _env_default(whl, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS") is False


def _stacked(whl, engine: str, platform: str = "cuda") -> dict[str, list[str]]:
    """The fused modules the loader stacks checkpoint shards into (stacked_params_mapping of the
    class's load_weights), leading dots dropped."""
    if engine == "sglang":
        fn = method_def(class_def(whl, MAIN["sglang"], VL), "load_weights")
    else:
        fn = method_def(class_def(whl, main_path("vllm", platform), "MiniMaxM3Model"), "load_weights")
    out: dict[str, list[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and all(isinstance(e, ast.Constant) for e in node.elts[:2]):
            fused, shard = (e.value.lstrip(".") for e in node.elts[:2])
            if fused.endswith("_proj") and shard.endswith("_proj"):
                out.setdefault(fused, []).append(shard)
    return out


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fused_modules_are_the_loaders_stacking(rules, release):
    """built_fused is what load_weights stacks: sglang index_qkv_proj (index_v_proj is never stored: no
    layer of the release builds it), vLLM one qkv_proj of q, k, v, index_q, index_k."""
    for platform in platforms(rules.engine):
        stacked = _stacked(engine_wheel(rules, release), rules.engine, platform)
        if rules.engine == "sglang":
            assert stacked.pop("index_qkv_proj") == ["index_q_proj", "index_k_proj", "index_v_proj"]
            assert rules["built_fused"]["index_qkv_proj"] == ["index_q_proj", "index_k_proj"]
        assert stacked == {k: v for k, v in rules["built_fused"].items() if k != "index_qkv_proj"}, platform


@pytest.mark.parametrize(("rules", "release", "platform"), QUARK_CASES,
                         ids=[f"{r.engine} {v} {p}" for r, v, p in QUARK_CASES])
def test_router_vision_and_moe_block_are_built_as_the_rules_say(rules, release, platform):
    whl = engine_wheel(rules, release)
    text = source(whl, text_path(rules.engine, platform))
    moe = method_def(class_def(whl, text_path(rules.engine, platform), "MiniMaxM3MoE"), "__init__")
    gates = attribute_builds(moe, "gate")
    vl_init = method_def(class_def(whl, main_path(rules.engine, platform), VL), "__init__")
    vision = attribute_builds(vl_init, "vision_tower")
    if rules.engine == "sglang":
        router_plain = bool(gates) and all(b.keywords.get("quant_config") == "None" for b in gates)
        vision_plain = bool(vision) and all(b.keywords.get("quant_config") == "None" for b in vision)
        layer = method_def(class_def(whl, TEXT_PATH["sglang"], "MiniMaxM3DecoderLayer"), "__init__")
        moe_prefix = attribute_builds(layer, "mlp")[0].keywords["prefix"]
        assert "name.replace('block_sparse_moe', 'mlp')" in ast.unparse(
            method_def(class_def(whl, MAIN["sglang"], VL), "_load_llm_weight"))
        # read as an attribute of the release's text_config (no config class supplies it)
        assert ("scoring_func" in rules["router"]["reads"]) == ("scoring_func=config.scoring_func" in ast.unparse(moe))
    else:
        router_plain = bool(gates) and all(b.call == "GateLinear" and "quant_config" not in b.keywords for b in gates)
        vision_plain = not (vision and all(b.keywords.get("quant_config") == "self.quant_config" for b in vision))
        layer = method_def(class_def(whl, text_path("vllm", platform), "MiniMaxM3DecoderLayer"), "__init__")
        moe_prefix = attribute_builds(layer, "block_sparse_moe")[0].keywords["prefix"]
        # vLLM's own MiniMaxM3TextConfig supplies scoring_func: nothing is read that may be missing
        supplied = "self.scoring_func = scoring_func" in ast.unparse(class_def(
            whl, "vllm/transformers_utils/configs/minimax_m3.py", "MiniMaxM3TextConfig"))
        assert rules["router"]["reads"] == ([] if supplied else ["scoring_func"])
    assert router_plain == ("router" in rules["unquantized_roles"])
    assert vision_plain == ({"vision", "projector"} <= set(rules["unquantized_roles"]))
    renamed = moe_prefix == "add_prefix('mlp', prefix)"
    assert renamed or moe_prefix == "f'{prefix}.block_sparse_moe'"
    assert (".block_sparse_moe." in (rules.values.get("module_names") or {})) == renamed
    biases = attribute_builds(moe, "e_score_correction_bias")
    assert {u for b in biases for u in b.under} == {"self.use_routing_bias"}
    assert rules["router"]["bias_when"] == "config:use_routing_bias"
    assert "getattr(config, 'use_routing_bias', False)" in ast.unparse(moe)
    assert "def get_spec_layer_idx_from_weight_name" in text or rules.engine == "vllm"


def test_every_required_release_is_read_and_has_one_rule_set():
    sglang = ["0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
    for engine, required in {"sglang": sglang, "vllm": ["0.33.0"]}.items():
        read = releases_read(engine, FAMILY)
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert sum(r.covers(read[release]) for r in rule_sets(engine, FAMILY)) == 1
