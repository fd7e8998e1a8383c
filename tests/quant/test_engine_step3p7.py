"""Differential tests for Step-3.7-Flash (``step3p7``, Step3p7ForConditionalGeneration): each release read
(``manifests/families/step3p7/{sglang,vllm}.yaml``, over ``window_sample``) decides with its own code beside
``quant.engines``: the packed-modules mapping and weight mappers read from the same wheel, the exclude list
mapped by the wheel's own ``WeightsMapper`` (vLLM: the vision-language class's, then the text model's), Quark's
``should_ignore_layer`` on the mapped list, the prefixes the MoE block and the vision tower are built under and
with which quant config, and sglang's expert loader (``match_expert_and_shard_ids``), which takes the release's
stacked experts and no per-expert name: what ``fused_experts.writes: stacked`` writes. Then the tiny
checkpoint converted and checked by the real ``gate checkpoint`` in its own process, and an exclude list in the
release's own names (the way a Quark export lists them) rebuilt: sglang's mapper leaves model.layers.N.* as it
is, so the bf16 attention meets an MXFP4 slot there, while vLLM's renames it and loads.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import subprocess
import sys
import typing

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.match import Exclude
from quant.engines.replay import class_name, exclude_entries, excluded
from quant.engines.rules import release_states, releases_read, window
from quant.fused import pieces
from quant.layout import family_for
from quant.safetensors_io import TensorInfo
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    load,
    method_def,
    sglang_quark_loader_additions,
    source,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel, wheel

FAMILY = "step3p7"
CLASS = "Step3p7ForConditionalGeneration"
TEXT_CLASS = "Step3p5ForCausalLM"
MAIN = {"sglang": "sglang/srt/models/step3p7.py", "vllm": "vllm/model_executor/models/step3p7.py"}
TEXT = {"sglang": "sglang/srt/models/step3p5.py", "vllm": "vllm/model_executor/models/step3p5.py"}
CASES = [(r, v) for e in ENGINES for v in window_sample(e, FAMILY) for r in rule_sets(e, FAMILY)
         if r.covers(release_states(e, FAMILY)[v].rules_of)]
IDS = [f"{r.engine} {v}" for r, v in CASES]
# exclude entries in the release's own names (a Quark export's), and the built names quantgate writes too
STORED = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
          "model.layers.0.self_attn.g_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
          "model.layers.1.share_expert.gate_proj", "model.layers.1.share_expert.up_proj", "model.layers.1.moe.gate",
          "model.layers.1.moe", "vision_model.transformer.resblocks.0.mlp.c_fc", "vit_large_projector", "lm_head",
          "language_model.model.layers.0.self_attn.qkv_proj", "language_model.model.layers.1.mlp.experts",
          "language_model.model.layers.1.moe.experts", "language_model.model.layers.1.share_expert.gate_up_proj",
          "model.language_model.layers.0.self_attn.o_proj"]
# the modules each engine builds with the quant config and asks it for
MODULES = {"sglang": ["language_model.model.layers.0.self_attn.qkv_proj",
                      "language_model.model.layers.0.self_attn.o_proj",
                      "language_model.model.layers.0.mlp.gate_up_proj",
                      "language_model.model.layers.1.mlp.experts",
                      "language_model.model.layers.1.share_expert.gate_up_proj"],
           "vllm": ["language_model.model.layers.0.self_attn.qkv_proj",
                    "language_model.model.layers.0.self_attn.g_proj", "language_model.model.layers.0.self_attn.o_proj",
                    "language_model.model.layers.1.moe.experts",
                    "language_model.model.layers.1.moe.share_expert.gate_up_proj",
                    "vision_model.transformer.resblocks.0.mlp.fc1", "vit_large_projector"]}


def mapper_literal(whl, path: str, cls: str, name: str) -> dict[str, dict]:
    """A class's WeightsMapper literal: {orig_to_new_substr: ..., orig_to_new_prefix: ...}."""
    node = class_def(whl, path, cls)
    assign = next(s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == name)
    return {k.arg: ast.literal_eval(k.value) for k in assign.value.keywords}


def wheel_packed(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed-modules mapping the quant config keeps: sglang, the class's (it has none) with the loader's
    Quark additions; vLLM, the text model's, set last when init_vllm_registered_model builds it."""
    if engine == "sglang":
        assert class_constant(class_def(whl, MAIN["sglang"], CLASS), "packed_modules_mapping") is None
        return {k: list(v) for k, v in sglang_quark_loader_additions(whl).items()} if kind == "quark" else {}
    return {k: list(v) for k, v in class_constant(class_def(whl, TEXT["vllm"], TEXT_CLASS),
                                                  "packed_modules_mapping").items()}


def wheel_mappers(whl, engine: str) -> list:
    """The engine's own WeightsMapper objects applied to the exclude list, in order."""
    if engine == "sglang":
        mapper = load(whl, "sglang/srt/models/utils.py", ["WeightsMapper"])["WeightsMapper"]
        return [mapper(**mapper_literal(whl, MAIN["sglang"], CLASS, "hf_to_sglang_mapper"))]
    mapper = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper", "ShardIds", "ShardId"],
                  {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})["WeightsMapper"]
    return [mapper(**mapper_literal(whl, MAIN["vllm"], CLASS, "hf_to_vllm_mapper")),
            mapper(**mapper_literal(whl, TEXT["vllm"], TEXT_CLASS, "hf_to_vllm_mapper"))]


def mapped(mappers: list, entries: list[str]) -> list[str]:
    for mapper in mappers:
        entries = [m for e in entries if (m := mapper._map_name(e)) is not None] if hasattr(mapper, "_map_name") \
            and not hasattr(mapper, "get_rename_mapper") else mapper.get_rename_mapper().apply_list(entries)
    return entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["quark_fused"] == wheel_packed(whl, rules.engine, "quark")
    assert rules["fp8_skip"]["fused"] == wheel_packed(whl, rules.engine, "fp8")


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_exclude_mapper_is_the_classes_mappers(rules, release):
    """sglang: the class's hf_to_sglang_mapper (prefixes of the NVFP4 names only); vLLM: the class's mapper and
    the text model's, both applied to the list (configure_quant_config runs for each class built)."""
    whl = engine_wheel(rules, release)
    rule = rules["exclude_mapper"]
    if rules.engine == "sglang":
        theirs = mapper_literal(whl, MAIN["sglang"], CLASS, "hf_to_sglang_mapper")
    else:
        outer = mapper_literal(whl, MAIN["vllm"], CLASS, "hf_to_vllm_mapper")
        inner = mapper_literal(whl, TEXT["vllm"], TEXT_CLASS, "hf_to_vllm_mapper")
        assert set(inner) == {"orig_to_new_substr"}
        theirs = {**outer, "orig_to_new_substr": {**outer["orig_to_new_substr"], **inner["orig_to_new_substr"]}}
        assert "configure_quant_config" in source(whl, "vllm/model_executor/model_loader/utils.py")
    assert {k: rule.get(k) or {} for k in ("substr", "prefix", "suffix")} == \
        {k: theirs.get(f"orig_to_new_{k}", {}) for k in ("substr", "prefix", "suffix")}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_exclude_entries_map_as_the_wheels_mappers(rules, release):
    mappers = wheel_mappers(engine_wheel(rules, release), rules.engine)
    assert exclude_entries({"exclude": STORED}, rules, "quark") == mapped(mappers, STORED)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists as written: the replay decides every module the engine builds with the quant
    config as the wheel's should_ignore_layer on the list the wheel's mappers leave."""
    whl = engine_wheel(rules, release)
    engine, mappers, fused = _quark_engine(rules, whl), wheel_mappers(whl, rules.engine), \
        wheel_packed(whl, rules.engine, "quark")
    rng = random.Random(f"step3p7 {rules.engine} {release}")
    seen = 0
    for _ in range(150):
        listed = rng.sample(STORED, rng.randint(0, len(STORED)))
        ours, theirs_list = Exclude(exclude_entries({"exclude": listed}, rules, "quark")), mapped(mappers, listed)
        for name in MODULES[rules.engine]:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, theirs_list, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 50


def _builds(whl, path: str, cls: str, method: str, attr: str):
    return attribute_builds(method_def(class_def(whl, path, cls), method), attr)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_prefixes_and_quant_configs_are_the_classes(rules, release):
    """Where each module asks the quant config: sglang builds the MoE block (attribute moe) under prefix mlp and
    the vision tower and projector without the quant config; vLLM builds the MoE block under moe, the shared
    expert inside it, and the vision tower and projector with the quant config. The replay's names agree."""
    whl = engine_wheel(rules, release)
    vision = _builds(whl, MAIN[rules.engine], CLASS, "__init__", "vision_model")
    projector = _builds(whl, MAIN[rules.engine], CLASS, "__init__", "vit_large_projector")
    moe = _builds(whl, TEXT[rules.engine], "Step3p5DecoderLayer", "__init__", "moe")
    assert len(vision) == len(projector) == len(moe) == 1
    built_bf16 = rules.engine == "sglang"
    assert (vision[0].keywords["quant_config"] == "None") == built_bf16
    assert (projector[0].keywords["quant_config"] == "None") == built_bf16
    assert {"vision", "projector"} <= set(rules["unquantized_roles"]) if built_bf16 else \
        not {"vision", "projector"} & set(rules["unquantized_roles"])
    if rules.engine == "sglang":
        assert moe[0].keywords["prefix"] == "add_prefix('mlp', prefix)"
        assert class_name("model.layers.1.moe.experts.0.gate_proj", rules) == \
            "language_model.model.layers.1.mlp.experts.0.gate_proj"
        assert class_name("model.layers.1.moe.gate_proj.weight", rules) == \
            "language_model.model.layers.1.mlp.experts.gate_proj"
    else:
        assert moe[0].keywords["prefix"] == "f'{prefix}.moe'"
        share = _builds(whl, TEXT["vllm"], "FusedMoEBlock", "__init__", "share_expert")
        assert share[0].keywords["prefix"] == "f'{prefix}.share_expert'"
        assert class_name("model.layers.1.share_expert.gate_proj", rules) == \
            "language_model.model.layers.1.moe.share_expert.gate_proj"
        assert class_name("model.layers.1.moe.gate_proj.weight", rules) == \
            "language_model.model.layers.1.moe.experts.gate_proj"


def sglang_expert_match(whl):
    """sglang's own match_expert_and_shard_ids (nested in Step3p5ForCausalLM.load_weights) and the expert
    mapping its loader walks (FusedMoE.make_expert_params_mapping's weight names)."""
    fn = method_def(class_def(whl, TEXT["sglang"], TEXT_CLASS), "load_weights")
    nested = next(n for n in ast.walk(fn) if isinstance(n, ast.FunctionDef) and n.name == "match_expert_and_shard_ids")
    namespace: dict = {}
    exec(compile(ast.Module([nested], []), TEXT["sglang"], "exec"), namespace)  # noqa: S102 (the wheel's code)
    return namespace["match_expert_and_shard_ids"]


SGLANG = [c for c in CASES if c[0].engine == "sglang"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_sglang_loads_the_stacked_experts_only(rules, release, tmp_path):
    """sglang's expert loader matches a stored name's fifth component against the projection and loads
    loaded_weight[expert_id]: the stacked weight and scale quantgate writes match; the per-expert names vLLM's
    LLM-Compressor path reads match none (left unloaded: load_weights' final assertion fails)."""
    match = sglang_expert_match(engine_wheel(rules, release))
    expert_names = [f"experts.{e}.{p}." for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    src = write_family_checkpoint(tmp_path / "bf16", FAMILY)
    from quant.cli import main as quantize

    assert quantize(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
    index = json.loads((tmp_path / "mxfp4" / "model.safetensors.index.json").read_text())["weight_map"]
    routed = [n for n in index if ".moe." in n and "_proj." in n]
    assert routed and all(any(match(n, w) for w in expert_names) for n in routed), routed
    config = json.loads((src / "config.json").read_text())
    spec = family_for(config).fused_experts.tensors[0]
    per_expert = [p.name for p in pieces(TensorInfo("model.layers.1.moe.gate_proj.weight", "BF16", (4, 32, 64), 0,
                                                    4 * 32 * 64 * 2), spec, 32, 64)]
    assert per_expert[0] == "model.layers.1.moe.experts.0.gate_proj.weight"
    assert not any(match(n, w) for n in per_expert for w in expert_names)


def gate_process(folder, engine: str) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine", engine],
                         check=False, capture_output=True, text=True, timeout=120)
    return run.returncode, run.stdout + run.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from quant.cli import main as quantize

    root = tmp_path_factory.mktemp("step3p7")
    src = write_family_checkpoint(root / "bf16", FAMILY)
    assert quantize(["--to", "mxfp4", "-q", str(src), str(root / "mxfp4")]) == 0
    return root / "mxfp4"


def test_the_conversion_loads_in_the_newest_releases_in_real_processes(converted):
    for engine in ("sglang==0.5.23", "sglang==0.5.21", "vllm==0.34.0"):
        code, text = gate_process(converted, engine)
        assert code == 0 and "verdict: loads correctly" in text, (engine, text)


def test_an_exclude_list_in_the_releases_names_misses_sglangs_modules(converted, tmp_path):
    """A Quark export lists the kept modules by the release's names (model.layers.N.*): sglang's
    hf_to_sglang_mapper renames only the model.language_model. form, so its language_model.model.layers.N.*
    modules are built MXFP4 over bf16 weights; vLLM's mapper renames model. to language_model.model. and loads."""
    out = tmp_path / "stored-names"
    import shutil

    shutil.copytree(converted, out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.startswith("language_model.")]
    (out / "config.json").write_text(json.dumps(config))
    code, text = gate_process(out, "sglang==0.5.23")
    assert code == 1 and "language_model.model.layers.0.self_attn.qkv_proj" in text, text
    code, text = gate_process(out, "vllm==0.34.0")
    assert code == 0 and "verdict: loads correctly" in text, text


@pytest.mark.parametrize("engine", ENGINES)
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.13 (models/step3p7.py), vLLM from 0.23.0: the window's releases before
    are not built, the ones after read, carried or needing reading."""
    first = {"sglang": "0.5.13", "vllm": "0.23.0"}[engine]
    for release in (window(engine)[0], first, max(releases_read(engine, FAMILY), key=Version)):
        try:
            names = set(__import__("zipfile").ZipFile(wheel(engine, release)).namelist())
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (MAIN[engine] in names) == (Version(release) >= Version(first)), release
    for release, state in release_states(engine, FAMILY).items():
        built = Version(release.split(".post")[0]) >= Version(first)
        assert (state.state != "not built") == built, (release, state)


def stacked_mapping(whl, engine: str) -> dict[str, list[str]]:
    """The fused modules the loader stacks shards into: its stacked_params_mapping literal (sglang
    Step3p5ForCausalLM.load_weights, vLLM Step3p5Model.load_weights)."""
    cls = TEXT_CLASS if engine == "sglang" else "Step3p5Model"
    fn = method_def(class_def(whl, TEXT[engine], cls), "load_weights")
    assign = next(n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
                  and ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target) == "stacked_params_mapping")
    fused: dict[str, list[str]] = {}
    for param, shard, _ in ast.literal_eval(assign.value):
        fused.setdefault(param.strip("."), []).append(shard.strip("."))
    return fused


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_built_fused_and_draft_rules_are_the_loaders(rules, release):
    """The fused modules are the loader's stacked_params_mapping; the main class skips the MTP layers (a
    model.layers.N with N >= num_hidden_layers), whose draft class builds eh_proj as a plain nn.Linear; the
    MoE layers come from the config (moe_layers_enum / mlp_layer_types)."""
    whl = engine_wheel(rules, release)
    assert rules["built_fused"] == stacked_mapping(whl, rules.engine)
    text = source(whl, TEXT[rules.engine])
    skip = "layer_id >= self.config.num_hidden_layers" if rules.engine == "sglang" else \
        "layer_idx >= config.num_hidden_layers"
    assert skip in text and rules["mtp_naming"]["style"] == "dropped"
    assert "self.eh_proj = nn.Linear(" in source(whl, TEXT[rules.engine].replace("step3p5.py", "step3p5_mtp.py"))
    assert rules["eh_proj"] == "plain" and rules["draft_exclude"] == {FAMILY: "none"}
    assert "moe_layers_enum" in text and rules["moe_layers"] == "config"
    assert "num_fused_shared_experts = 0" in text if rules.engine == "sglang" else "shared_experts=" in text
    assert rules["shared_experts_fusion"] is None


def _config_attributes(fn: ast.FunctionDef) -> set[str]:
    """The keys a function reads as ``config.X`` attributes (a getattr with a default is no such read)."""
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "config"}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_router_reads_and_bias_are_the_classes(rules, release):
    """The router keys config.json must carry are those the MoE block reads as attributes that the engine's
    config class does not define (sglang: its own configs/step3p5.py Step3p5Config; vLLM: transformers'
    Step3p7TextConfig, fields and attribute_map); the router bias is created under use_moe_router_bias
    (sglang) or always (vLLM)."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    whl = engine_wheel(rules, release)
    block = "Step3p5MoEMLP" if rules.engine == "sglang" else "FusedMoEBlock"
    init = method_def(class_def(whl, TEXT[rules.engine], block), "__init__")
    if rules.engine == "sglang":
        config_init = method_def(class_def(whl, "sglang/srt/configs/step3p5.py", "Step3p5Config"), "__init__")
        defined = {n.attr for n in ast.walk(config_init) if isinstance(n, ast.Attribute)
                   and ast.unparse(n.value) == "self"}
    else:
        defined = {n for c in Step3p7TextConfig.__mro__ for n in getattr(c, "__annotations__", {})} | \
            set(Step3p7TextConfig.attribute_map)
    assert set(rules["router"]["reads"]) == _config_attributes(init) - defined
    bias = attribute_builds(init, "router_bias")
    assert len(bias) == 1
    assert rules["router"]["bias_when"] == ("config:use_moe_router_bias" if bias[0].under == [
        "self.use_moe_router_bias"] else "always" if not bias[0].under else bias[0].under)
