"""Differential tests: the replay's per-module decision equals the engines' own code, release by release.

For each rule set, its first and last release and every ``.postN`` mapped to it are downloaded once
(``tests/quant/engine_sources.py``; a first run fetches ~20 wheels, ~700 MB, about a minute here)
and their own ``should_ignore_layer`` (Quark exclude, fed the packed-modules mapping read from the
same wheel, not the YAML under test), ``is_layer_skipped`` + ``Fp8Config.from_config`` (FP8 skip
list), the draft's ``_resolve_nextn_quant_config`` / ``_map_mtp_ckpt_name``, and the shared-expert
fusion decision (``determine_num_fused_shared_experts`` / ``shared_experts_fusion_disable_reason``
with ``QuarkConfig.can_fuse_shared_expert``, hardware queries stubbed) are run on generated cases
beside ``quant.engines``; how modules are built (eh_proj, indexer, router, fused modules, MTP count)
is read from the model classes' constructors. Without the registry the tests skip, saying why.
"""

from __future__ import annotations

import ast
import random
import types

import pytest
from packaging.version import Version

from quant.engines import (
    ENGINES,
    Exclude,
    MixedShards,
    draft_exclude,
    draft_name,
    excluded,
    rule_sets,
)
from quant.engines.match import fp8_fused_first, fp8_ignored_layers, fp8_skipped
from quant.engines.rules import release_states, releases_read
from tests.quant.engine_sources import (
    Built,
    WheelUnavailable,
    attribute_builds,
    class_constant,
    class_def,
    fake_quant_config,
    load,
    method_def,
    methods,
    parsed,
    served_modules,
    sglang_quark_loader_additions,
    source,
    wheel,
    window_sample,
)

N = 3  # num_hidden_layers of the generated model: the MTP layer is model.layers.3
CASES = 120  # per release and kind; 25 releases x (Quark + FP8 + draft) > 1,000


def _releases() -> list[tuple]:
    """(rule set, release): each set's first and last release, the .postN releases mapped to it, and a sample
    of the releases carried over to it by identical cited source (engine_sources.window_sample)."""
    out = []
    for engine in ENGINES:
        states = release_states(engine)
        carried = [v for v in window_sample(engine) if states[v].state == "carried"]
        for rules in rule_sets(engine):
            mine = {v for v, base in releases_read(engine).items() if rules.covers(base)
                    and (v in (rules.first, rules.last) or v != base)}
            mine |= {v for v in carried if rules.covers(states[v].rules_of)}
            out += [(rules, v) for v in sorted(mine, key=Version)]
    return out


RELEASES = _releases()
SGLANG_RELEASES = [(r, v) for r, v in RELEASES if r.engine == "sglang"]


def release_ids(cases) -> list[str]:
    return [f"{rules.engine} {release}" for rules, release in cases]


def engine_wheel(rules, release):
    try:
        return wheel(rules.engine, release)
    except (WheelUnavailable, OSError) as exc:
        pytest.skip(f"cannot obtain {rules.engine}=={release} from the package registry: {exc}")


def _quark_engine(rules, whl):
    if rules.engine == "vllm":
        utils = "vllm/model_executor/layers/quantization/quark/utils.py"
        if "find_matching_patterns" in source(whl, utils):  # >= 0.30.0: the matching moved to config_utils.py
            cfg = load(whl, "vllm/model_executor/layers/quantization/utils/config_utils.py",
                       ["find_matching_patterns", "is_equal_or_regex_match"])
            ns = load(whl, utils, ["should_ignore_layer"], cfg)
        else:
            ns = load(whl, utils, ["should_ignore_layer", "check_equal_or_regex_match", "_is_equal_or_regex_match"])
        if "check_children" not in source(whl, utils):  # < 0.26.0: the routed experts are asked like any module
            return lambda name, exclude, fused, moe: ns["should_ignore_layer"](name, exclude, fused)
        return lambda name, exclude, fused, moe: ns["should_ignore_layer"](name, exclude, fused, check_children=moe)
    ns = load(whl, "sglang/srt/layers/quantization/quark/utils.py",
              ["should_ignore_layer", "check_equal_or_regex_match", "_is_equal_or_regex_match"])
    return lambda name, exclude, fused, moe: ns["should_ignore_layer"](name, exclude, fused)


def _fp8_engine(rules, whl):
    if rules.engine == "vllm":
        skip = load(whl, "vllm/model_executor/layers/quantization/utils/quant_utils.py", ["is_layer_skipped"])
        from_config = methods(whl, "vllm/model_executor/layers/quantization/fp8.py", "Fp8Config", ["from_config"])
        base = "vllm/model_executor/layers/quantization/base_config.py"
    else:
        text = source(whl, "sglang/srt/layers/quantization/utils.py")
        names = ["is_layer_skipped"] + [n for n in ("_module_path_match", "_FALLBACK_FUSED_SHARDS") if n in text]
        skip = load(whl, "sglang/srt/layers/quantization/utils.py", names)
        from_config = methods(whl, "sglang/srt/layers/quantization/fp8.py", "Fp8Config", ["from_config"])
        base = "sglang/srt/layers/quantization/base_config.py"
    keys = methods(whl, base, "QuantizationConfig", ["get_from_keys", "get_from_keys_or"])

    class Fp8Config:  # the real from_config and key lookups; the constructor just keeps its arguments
        get_from_keys = staticmethod(keys["cls"].get_from_keys)
        get_from_keys_or = staticmethod(keys["cls"].get_from_keys_or)

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    keys["ns"]["QuantizationConfig"] = Fp8Config
    from_config["ns"].update(is_npu=lambda: False, envs=None)
    parse = from_config["cls"].__dict__["from_config"].__func__

    def decide(name, qconfig, fused):
        ignored = parse(Fp8Config, qconfig).kwargs["ignored_layers"] or []
        return skip["is_layer_skipped"](name, ignored, fused)
    return decide


# Names the generator draws from: both engines' fused names, shards, experts (aggregate, per expert),
# sglang's draft names, regexes, globs and prefixes.
def _pool(rules):
    qkv = next(f for f in rules["built_fused"] if f != "gate_up_proj")
    layers = ["model.layers.0.", "model.layers.1.", "model.decoder."] if rules.engine == "sglang" else \
        ["model.layers.0.", "model.layers.1.", f"model.layers.{N}."]
    modules, entries = [], ["lm_head", "model.decoder", "mlp.gate", "re:.*shared_experts.*", "*shared_experts*",
                            "re:.*experts.*", "re:model\\.layers\\.1\\..*", "re:.*gate_up_proj", "model.layers.1",
                            "re:.*(q_a_proj|kv_a_proj_with_mqa)", "self_attn", "experts",
                            "re:model\\.layers\\.1\\.mlp", "re:.*shared_experts"]  # re: is anchored at the start only
    for p in layers:
        modules += [p + m for m in (f"self_attn.{qkv}", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                                    "self_attn.indexer.wq_b", "mlp.gate_up_proj", "mlp.down_proj",
                                    "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", "mlp.experts")]
        entries += [p + m for m in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.fused_qkv_a_proj",
                                    "self_attn.fused_qkv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.o_proj",
                                    "self_attn.indexer.wq_b", "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj",
                                    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                    "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", "mlp.experts",
                                    "mlp.experts.0.gate_proj", "mlp.experts.1.down_proj", "mlp.gate")]
    return modules, entries


def _outcome(decide, *args, **kwargs):
    try:
        return decide(*args, **kwargs)
    except (ValueError, MixedShards) as exc:
        return f"raises {str(exc).removeprefix('ValueError: ')}"


def quark_disagreements(engine, rules, fused, modules, entries, rng, *, draws, most, names, ours=None, theirs=None):
    """Random exclude lists (up to ``most`` of ``entries``), each asked for ``names`` random ``modules``: the
    cases where the replay's Quark decision differs from the engine's own function, and how many times the
    engine excluded. ``ours`` / ``theirs`` turn a drawn list into what the replay / the engine sees (the
    writer's list, the engine's mapper); by default both see it as drawn."""
    disagree, seen = [], 0
    for _ in range(draws):
        exclude = rng.sample(entries, rng.randint(0, most))
        listed, given = (ours or list)(exclude), (theirs or list)(exclude)
        for name in rng.sample(modules, names):
            moe = name.endswith(".experts")
            mine = _outcome(excluded, name, Exclude(listed), rules, "quark", moe)
            engines = _outcome(engine, name, given, fused, moe)
            seen += engines is True
            if mine != engines:
                disagree.append((name, exclude, mine, engines))
    return disagree, seen


def _fp8_config(listed: list, where: str) -> dict:
    """An FP8 quantization_config listing ``listed`` under ``where`` ("both": half in ignored_layers, all in
    modules_to_not_convert; "empty_ignored": an empty ignored_layers beside modules_to_not_convert)."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if where == "both":
        qconfig.update(ignored_layers=listed[: len(listed) // 2], modules_to_not_convert=listed)
    elif where == "empty_ignored":
        qconfig.update(ignored_layers=[], modules_to_not_convert=listed)
    else:
        qconfig[where] = listed
    return qconfig


def fp8_disagreements(engine, skip, fused, modules, entries, rng, *, draws, most, names,
                      where=("ignored_layers", "modules_to_not_convert"), listed_by=None, decided_by=None, theirs=None):
    """Random FP8 configs (up to ``most`` of ``entries`` listed under one of ``where``), each asked for ``names``
    random ``modules``: where the replay's skip decision (rule data ``skip``) differs from the engine's own
    function fed ``fused``, and how many times the engine skipped. ``listed_by(qconfig)``: the replay's
    list (default: its FP8 keys read as ``skip`` says); ``decided_by(name, listed)``: the replay's decision
    (default: match.fp8_skipped); ``theirs(list)``: what the engine's loader makes of each listed key first
    (a class's weight mapper; default: nothing)."""
    def listed_default(qconfig):
        return fp8_ignored_layers(qconfig, skip["keys"], skip["keys_mode"], skip["model_prefix_variants"])

    def decided_default(name, listed):
        return fp8_skipped(name, listed, skip["fused"], match=skip["match"], experts=skip["experts"],
                           fallback_fused=skip["fallback_fused"], fused_first=fp8_fused_first(skip))

    listed_by, decided_by = listed_by or listed_default, decided_by or decided_default
    disagree, seen = [], 0
    for _ in range(draws):
        qconfig = _fp8_config(rng.sample(entries, rng.randint(0, most)), rng.choice(where))
        given = {k: theirs(v) if theirs and k in ("ignored_layers", "modules_to_not_convert") else v
                 for k, v in qconfig.items()}
        listed = listed_by(qconfig)
        for name in rng.sample(modules, names):
            mine = _outcome(decided_by, name, listed)
            engines = _outcome(engine, name, given, fused)
            seen += engines is True
            if mine != engines:
                disagree.append((name, qconfig, mine, engines))
    return disagree, seen


@pytest.mark.parametrize(("rules", "release"), RELEASES, ids=release_ids(RELEASES))
def test_quark_packed_mapping_is_the_wheels(rules, release):
    assert wheel_quark_mapping(engine_wheel(rules, release), rules.engine) == \
        {k: list(v) for k, v in rules["quark_fused"].items()}


@pytest.mark.parametrize(("rules", "release"), RELEASES, ids=release_ids(RELEASES))
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    modules, entries = _pool(rules)
    rng = random.Random(rules.id + release)
    fused = wheel_quark_mapping(whl, rules.engine)  # the engine's own mapping, not the rule data under test
    disagree, _ = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=CASES, most=12, names=4)
    assert not disagree, disagree[:3]


@pytest.mark.parametrize(("rules", "release"), RELEASES, ids=release_ids(RELEASES))
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    engine = _fp8_engine(rules, engine_wheel(rules, release))
    modules, entries = _pool(rules)
    entries = [e for e in entries if not e.startswith(("re:", "*"))] + [e.removeprefix("model.") for e in entries[:8]]
    rng = random.Random("fp8" + rules.id + release)
    skip = rules["fp8_skip"]
    disagree, _ = fp8_disagreements(engine, skip, {k: list(v) for k, v in skip["fused"].items()}, modules, entries,
                                    rng, draws=CASES, most=12, names=4,
                                    where=("ignored_layers", "modules_to_not_convert", "both", "empty_ignored"))
    assert not disagree, disagree[:3]


def _sglang_draft_engine(whl, family):
    """The draft class's own exclude rewrite, chosen by what the wheel holds (not by the rules under
    test): exclude list -> the list the draft is built with, or None when the whole draft is built
    without quant config. The loader first applies the class's hf_to_sglang_mapper (apply_list)."""
    util = load(whl, "sglang/srt/layers/quantization/quark/utils.py",
                ["should_ignore_layer", "check_equal_or_regex_match", "_is_equal_or_regex_match"])
    mapper_cls = load(whl, "sglang/srt/models/utils.py", ["WeightsMapper", "WeightsMapping"])["WeightsMapper"]
    extra = {"WeightsMapper": mapper_cls, "should_apply_glm_nextn_moe_ptpc": lambda *a: False}
    wanted = ["_resolve_nextn_quant_config", "_map_mtp_ckpt_name", "_NEXTN_SPEC_WEIGHT_NAMES", "hf_to_sglang_mapper",
              "get_hf_to_sglang_mapper"]
    if family == "glm_moe_dsa" and "class GlmMoeDsaForCausalLMNextN" in source(whl, "sglang/srt/models/glm4_moe.py"):
        draft = methods(whl, "sglang/srt/models/glm4_moe.py", "GlmMoeDsaForCausalLMNextN", wanted, extra)["cls"]
        if not hasattr(draft, "get_hf_to_sglang_mapper"):  # inherited from DeepseekV3ForCausalLMNextN
            draft.get_hf_to_sglang_mapper = classmethod(lambda cls, config: cls.hf_to_sglang_mapper)
    else:  # DeepSeek, and GLM drafts before GlmMoeDsaForCausalLMNextN existed (configs/model_config.py)
        draft = methods(whl, "sglang/srt/models/deepseek_nextn.py", "DeepseekV3ForCausalLMNextN", wanted, extra)["cls"]
    mapper = getattr(draft, "hf_to_sglang_mapper", None)

    def rewrite(exclude, num_layers):
        mapped = mapper.apply_list(exclude) if mapper is not None else list(exclude)
        if not hasattr(draft, "_resolve_nextn_quant_config"):
            return mapped
        with _served("sglang.srt.layers.quantization.quark.utils", should_ignore_layer=util["should_ignore_layer"]):
            out = draft()._resolve_nextn_quant_config(_Config(num_layers), fake_quant_config("quark", mapped))
        return None if out is None else out.exclude_layers
    return rewrite


def _served(name, **attrs):
    """The draft methods import helpers inside their body: serve the wheel's own ones under that name
    for the duration of the call only (no stub package outlives it)."""
    return served_modules({name: attrs})


class _Config:
    def __init__(self, num_hidden_layers):
        self.num_hidden_layers = num_hidden_layers


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize(("rules", "release"), SGLANG_RELEASES, ids=release_ids(SGLANG_RELEASES))
def test_sglang_draft_exclude_and_decisions_equal_the_engine(rules, release, family):
    whl = engine_wheel(rules, release)
    engine = _sglang_draft_engine(whl, family)
    quark = _quark_engine(rules, whl)
    rng = random.Random(f"draft{rules.id}{release}{family}")
    fused = wheel_quark_mapping(whl, "sglang")
    disagree, checked = [], 0
    for _ in range(CASES // 4):
        num_layers = rng.choice([3, 61, 78])
        mtp = f"model.layers.{num_layers}."
        pool = [mtp + m for m in ("eh_proj", "self_attn.q_b_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa",
                                  "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.experts.0.up_proj",
                                  "mlp.experts", "shared_head.norm", "self_attn.indexer.wq_b")]
        pool += ["model.layers.61.mlp.gate", "model.decoder.mlp.experts", f"model.layers.{num_layers}", "lm_head",
                 "re:model\\.decoder\\..*"]
        exclude = rng.sample(pool, rng.randint(0, 9))
        theirs = engine(exclude, num_layers)
        ours, whole_bf16 = draft_exclude(exclude, rules, family, num_layers, "quark")
        if (theirs is None) != whole_bf16 or (theirs is not None and sorted(set(theirs)) != sorted(set(ours))):
            disagree.append((num_layers, exclude, theirs, ours))
            continue
        if theirs is None:
            continue
        for module in pool[:10]:  # the draft module each checkpoint module becomes, decided by both
            name = draft_name(module, rules, num_layers)
            if name is None:
                continue
            moe = name.endswith(".experts")
            checked += 1
            if _outcome(excluded, name, Exclude(ours), rules, "quark", moe) != _outcome(quark, name, theirs, fused, moe):
                disagree.append((name, exclude))
    assert not disagree, disagree[:3]
    assert checked > 50


@pytest.mark.parametrize(("rules", "release"), SGLANG_RELEASES, ids=release_ids(SGLANG_RELEASES))
def test_sglang_draft_names_are_the_loaders(rules, release):
    """The MTP naming rule (spec names -> model.*, rest -> model.decoder.*, skipped names) is the loader's."""
    text = source(engine_wheel(rules, release), "sglang/srt/models/deepseek_common/deepseek_weight_loader.py")
    naming = rules["mtp_naming"]
    spec = text[text.index("nextn_spec_weight_names=["):]
    spec = spec[:spec.index("]")]
    assert sorted(s.strip().strip('",') for s in spec.split("[", 1)[1].split(",") if s.strip()) == \
        sorted(naming["top_level"])
    for skipped in naming["skipped"]:
        assert f'"{skipped}" in name' in text
    assert 'name.replace(layer_prefix, "model.decoder")' in text and "Only 1 nextn layer is supported" in text


# --- The packed-modules mapping, read from the wheel -------------------------------------------

def wheel_quark_mapping(whl, engine) -> dict[str, list[str]]:
    """The packed_modules_mapping a release hands the Quark config of an MLA model with q_lora_rank:
    DeepseekV2ForCausalLM's class literal, the entries its __init__ adds (not the use_mha ones), and
    in sglang the loader's additions for quantization == "quark" (model_loader/loader.py)."""
    path = "vllm/model_executor/models/deepseek_v2.py" if engine == "vllm" else "sglang/srt/models/deepseek_v2.py"
    cls = class_def(whl, path, "DeepseekV2ForCausalLM")
    mapping = dict(class_constant(cls, "packed_modules_mapping") or {})
    for stmt in ast.walk(method_def(cls, "__init__")):
        if isinstance(stmt, ast.If) and "use_mha" not in ast.unparse(stmt.test):
            for inner in stmt.body:
                target = inner.targets[0] if isinstance(inner, ast.Assign) else None
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "self.packed_modules_mapping":
                    mapping[ast.literal_eval(target.slice)] = ast.literal_eval(inner.value)
    if engine == "sglang":
        mapping.update(sglang_quark_loader_additions(whl))
    return {k: list(v) for k, v in mapping.items()}


# --- How modules are built, read from the constructors -------------------------------------------

def _quantized_by(builds: list[Built]) -> str:
    """quant_config when the (non-fused) construction passes the quant config, else bf16."""
    plain = [b for b in builds if not any("use_dsa_indexer_fusion" in u and not u.startswith("not") for u in b.under)]
    return "quant_config" if any(b.keywords.get("quant_config") not in (None, "None") for b in plain) else "bf16"


def _sglang_construction(whl) -> dict:
    nextn = method_def(class_def(whl, "sglang/srt/models/deepseek_nextn.py", "DeepseekModelNextN"), "__init__")
    eh = attribute_builds(nextn, "eh_proj")
    indexer_path = next(p for p in ("sglang/srt/layers/attention/dsa/dsa_indexer.py",
                                    "sglang/srt/layers/attention/nsa/nsa_indexer.py") if _has(whl, p))
    init = method_def(class_def(whl, indexer_path, "Indexer"), "__init__")
    fusion = next((n for n in ast.walk(init) if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "self.use_dsa_indexer_fusion"), None)
    fused_wk = attribute_builds(init, "wk_weights_proj")
    loader = source(whl, "sglang/srt/models/deepseek_common/deepseek_weight_loader.py")
    dequant = loader[loader.find("def _load_fused_indexer_wk"):] if "def _load_fused_indexer_wk" in loader else ""
    models = source(whl, "sglang/srt/models/deepseek_v2.py")
    gate = method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "MoEGate"), "__init__")
    moe = method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "DeepseekV2MoE"), "__init__")
    return {
        "eh_proj": "quant_config" if any(b.call == "ReplicatedLinear" and b.keywords.get("quant_config") not in
                                         (None, "None") for b in eh) else "plain",
        "indexer": {leaf: _quantized_by(attribute_builds(init, leaf)) for leaf in ("wq_b", "wk", "weights_proj")}
        | {"wk_fused_bf16_on_cuda": bool(fused_wk) and fusion is not None
           and {"_is_cuda", "is_neox_style"} <= {n.id for n in ast.walk(fusion.value) if isinstance(n, ast.Name)}
           and all("quant_config" not in b.keywords for b in fused_wk),
           "wk_dequantized": ["fp8"] if "float8_e4m3fn" in dequant and "block_quant_dequant" in dequant else []},
        "router_plain": any(b.call == "nn.Parameter" for b in attribute_builds(gate, "weight")),
        "router_reads": _config_reads(gate) | _config_reads(moe),
        "built_fused": {name for name in ("gate_up_proj", "fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj")
                        if f"self.{name} = " in models},
        "max_nextn": 1 if "Only 1 nextn layer is supported" in loader else None,
    }


def _vllm_construction(whl) -> dict:
    # the drafts: DeepSeekMTP (deepseek_mtp.py) always, DeepseekV32MTP (GLM-5's from 0.29.0) where the release has it
    layers = [("vllm/model_executor/models/deepseek_mtp.py", "DeepSeekMultiTokenPredictorLayer")] + [
        (p, "DeepseekV32MultiTokenPredictorLayer") for p in ("vllm/models/deepseek_v32/nvidia/mtp.py",
                                                             "vllm/models/deepseek_v32/amd/mtp.py") if _has(whl, p)]
    ehs = [b for p, cls in layers for b in attribute_builds(method_def(class_def(whl, p, cls), "__init__"), "eh_proj")]
    indexers = [method_def(class_def(whl, "vllm/model_executor/models/deepseek_v2.py", "Indexer"), "__init__")] + [
        method_def(class_def(whl, p, "DeepseekV32Indexer"), "__init__")
        for p in ("vllm/models/deepseek_v32/attention.py",) if _has(whl, p)
        and class_def(whl, p, "DeepseekV32Indexer") is not None]
    models = source(whl, "vllm/model_executor/models/deepseek_v2.py")
    dequant = models[models.find("def _try_load_fp8_indexer_wk"):] if "def _try_load_fp8_indexer_wk" in models else ""
    # wk and weights_proj: one fused wk_weights_proj from 0.20.0, two ReplicatedLinear before
    fused = {_quantized_by(attribute_builds(i, "wk_weights_proj") or attribute_builds(i, "wk")) for i in indexers}
    weights = {_quantized_by(attribute_builds(i, "wk_weights_proj") or attribute_builds(i, "weights_proj"))
               for i in indexers}
    moe = method_def(class_def(whl, "vllm/model_executor/models/deepseek_v2.py", "DeepseekV2MoE"), "__init__")
    gate = attribute_builds(moe, "gate")
    return {
        "eh_proj": "plain" if ehs and all(b.call == "nn.Linear" for b in ehs) else "quant_config",
        "indexer": {"wq_b": _quantized_by([b for i in indexers for b in attribute_builds(i, "wq_b")]),
                    "wk": fused.pop() if len(fused) == 1 else "mixed",
                    "weights_proj": weights.pop() if len(weights) == 1 else "mixed",
                    "wk_fused_bf16_on_cuda": False,
                    "wk_dequantized": ["fp8"] if "float8_e4m3fn" in dequant and "scaled_dequantize" in dequant else []},
        "router_plain": bool(gate) and all(b.keywords.get("quant_config") in (None, "None") for b in gate),
        "router_reads": _config_reads(moe),
        "built_fused": {name for name in ("gate_up_proj", "fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj")
                        if f"self.{name} = " in models},
        "max_nextn": None,
    }


def _has(whl, path) -> bool:
    try:
        source(whl, path)
    except KeyError:
        return False
    return True


ROUTER_KEYS = {"topk_method", "n_group", "topk_group", "scoring_func", "norm_topk_prob"}
NOT_TAKEN = ("is_hash", "is_deepseek_v4")  # branches GLM-5 / DeepSeek-V3 never take (hash routing, V4)


def _config_reads(fn) -> set[str]:
    """Router keys read as ``config.<key>`` attributes (a missing key raises; getattr does not) on
    the path GLM-5 / DeepSeek-V3 take through the constructor."""
    reads: set[str] = set()

    def attrs(node):
        reads.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                     and n.value.id == "config" and n.attr in ROUTER_KEYS)

    def visit(body):
        for stmt in body:
            if isinstance(stmt, ast.If):
                attrs(stmt.test)
                taken = [stmt.orelse] if any(k in ast.unparse(stmt.test) for k in NOT_TAKEN) else [stmt.body, stmt.orelse]
                for branch in taken:
                    visit(branch)
            elif not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                attrs(stmt)
    visit(fn.body)
    return reads


def _supplied_by_transformers() -> set[str]:
    """Router keys both families' transformers config classes define (no AttributeError when absent)."""
    from transformers import DeepseekV3Config, GlmMoeDsaConfig

    return {k for k in ROUTER_KEYS if all(hasattr(c(), k) for c in (DeepseekV3Config, GlmMoeDsaConfig))}


@pytest.mark.parametrize(("rules", "release"), RELEASES, ids=release_ids(RELEASES))
def test_module_construction_is_the_engine_classes(rules, release):
    whl = engine_wheel(rules, release)
    built = (_vllm_construction if rules.engine == "vllm" else _sglang_construction)(whl)
    assert built["eh_proj"] == rules["eh_proj"]
    assert built["indexer"] == rules["indexer"]
    assert built["router_plain"] == ("router" in rules["unquantized_roles"])
    reads = set(rules["router"]["reads"])  # a key the engine reads directly, and one a config lacks raises on
    assert reads <= built["router_reads"] and built["router_reads"] - _supplied_by_transformers() <= reads
    assert built["built_fused"] == set(rules["built_fused"])
    assert built["max_nextn"] == rules["mtp_naming"]["max_layers"]


# --- Shared-expert fusion, decided by the engine's own functions ---------------------------------

GPUS = [("rocm", "gfx950"), ("rocm", "gfx942"), ("rocm", "gfx90a"), ("cuda", "sm90"), ("cuda", "sm80"),
        ("cuda", "sm75")]


class _Flags(types.SimpleNamespace):
    """Server args / runtime flags: only the fusion switches are read; anything else is off."""

    def __getattr__(self, name):
        return False


def _stubs(whl, serving, quant_blocks) -> dict:
    cap = serving.capability
    flags = _Flags(disable_shared_experts_fusion=serving.disable_shared_experts_fusion,
                   enforce_shared_experts_fusion=False, ep_num_redundant_experts=0)
    flags.moe = flags
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_capability=lambda *a: cap),
                                  musa=types.SimpleNamespace(get_device_capability=lambda *a: (0, 0)),
                                  nn=types.SimpleNamespace(Module=object))
    off = lambda *a, **k: False
    backend = types.SimpleNamespace(is_deepep=off, is_mori=off, is_marlin=off)
    return {"_is_cuda": serving.platform == "cuda", "_is_hip": serving.platform == "rocm", "_is_musa": False,
            "torch": torch, "get_global_server_args": lambda: flags, "get_server_args": lambda: flags,
            "get_exec": lambda: flags, "get_flags": lambda: flags,
            "get_parallel": lambda: types.SimpleNamespace(moe_ep_size=serving.ep, tp_size=serving.tp),
            "get_moe_expert_parallel_world_size": lambda: serving.ep, "get_moe_a2a_backend": lambda: backend,
            "get_moe_runner_backend": lambda: backend, "is_sbo_enabled": off, "is_tbo_enabled": off,
            "is_deepep_class_backend": off, "is_wint4afp8_or_wint4a16_config": off, "is_sm90_supported": off,
            "should_apply_glm_nextn_moe_ptpc": off, "log_info_on_rank0": lambda *a: None,
            "quant_blocks_shared_experts_fusion": quant_blocks}


def _draft_config_arch(whl, main_arch: str) -> str:
    """The architecture configs/model_config.py gives a draft of ``main_arch`` (the last rewrite wins)."""
    arch = main_arch
    for node in ast.walk(parsed(whl, "sglang/srt/configs/model_config.py")):
        if isinstance(node, ast.If) and "is_draft_model" in ast.unparse(node.test) and arch in {
                c.value for c in ast.walk(node.test) if isinstance(c, ast.Constant)}:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "self.hf_config.architectures[0]":
                    arch = ast.literal_eval(stmt.value)
    return arch


def _class_arch(whl, family: str, draft: bool) -> str:
    """The architecture the model class compares: the argument it passes to
    determine_num_fused_shared_experts (<= 0.5.17) or its fused_shared_experts_architecture."""
    glm = class_def(whl, "sglang/srt/models/glm4_moe.py", "GlmMoeDsaForCausalLMNextN" if draft else
                    "GlmMoeDsaForCausalLM") if family == "glm_moe_dsa" else None
    deepseek = class_def(whl, "sglang/srt/models/deepseek_nextn.py", "DeepseekV3ForCausalLMNextN") if draft else \
        class_def(whl, "sglang/srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM")
    for cls in (glm, deepseek):
        if cls is None:
            continue
        if (arch := class_constant(cls, "fused_shared_experts_architecture")) is not None:
            return arch
        for call in ast.walk(cls):
            if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("determine_num_fused_shared_experts") \
                    and call.args:
                return ast.literal_eval(call.args[0])
    default = method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM"),
                         "determine_num_fused_shared_experts")
    return ast.literal_eval(default.args.defaults[0])


def _fusion_engine(whl, family: str, draft: bool):
    """(config, exclude, kind, serving) -> whether this release fuses, decided by its own functions."""
    model = "sglang/srt/models/deepseek_v2.py"
    names = {"shared_experts_fusion_disable_reason", "determine_num_fused_shared_experts",
             "fused_shared_experts_architecture"}
    cls = methods(whl, model, "DeepseekV2ForCausalLM", names)["cls"]
    gate = cls.__dict__.get("shared_experts_fusion_disable_reason")
    quark = None
    if gate is not None:
        qpath = "sglang/srt/layers/quantization/quark/quark.py"
        consts = load(whl, qpath, [n for n in ("_MOE_SHARED_EXPERT_QUANT_LAYER0_BASES", "_SHARED_EXPERT_BODY_PROJ_SUFFIXES",
                                               "_MOE_SHARED_EXPERT_QUANT_DRAFT_BASES") if n in source(whl, qpath)])
        wanted = ["can_fuse_shared_expert", "shared_expert_excluded_from_quant", "_is_draft_layer",
                  "shared_expert_online_mxfp4_supported", "_warn_online_mxfp4_unavailable"]
        quark = methods(whl, qpath, "QuarkConfig", wanted)
        blocks = load(whl, "sglang/srt/models/deepseek_common/utils.py", ["quant_blocks_shared_experts_fusion"])
    class_arch = _class_arch(whl, family, draft)
    main_arch = "GlmMoeDsaForCausalLM" if family == "glm_moe_dsa" else "DeepseekV3ForCausalLM"
    config_arch = _draft_config_arch(whl, main_arch) if draft else main_arch

    def decide(config, exclude, kind, serving) -> bool:
        hf = types.SimpleNamespace(**{**config, "architectures": [config_arch]})
        if kind == "quark":
            qc = object.__new__(quark["cls"]) if quark else types.SimpleNamespace()
            qc.exclude_layers, qc.quant_config = list(exclude), {"exclude": list(exclude), "layer_quant_config": {}}
            qc.num_hidden_layers, qc.num_nextn_predict_layers = config["num_hidden_layers"], 1
            qc.get_name = lambda: "quark"
        else:
            qc = types.SimpleNamespace(get_name=lambda: kind)
        if gate is None:  # <= 0.5.17: the model instance decides in __init__
            stubs = _stubs(whl, serving, None)
            fn = cls.__dict__["determine_num_fused_shared_experts"]
            fn.__globals__.update(stubs)
            model_self = types.SimpleNamespace(config=hf, quant_config=qc)
            with _served("sglang.srt.arg_groups.overrides", declare_load_time_override=lambda *a: None):
                fn(model_self, class_arch)
            return model_self.num_fused_shared_experts > 0
        blocks["quant_blocks_shared_experts_fusion"].__globals__.update(blocks)
        quark["ns"].update(consts, **_stubs(whl, serving, None), is_hip=lambda: serving.platform == "rocm")
        stubs = _stubs(whl, serving, blocks["quant_blocks_shared_experts_fusion"])
        fn = gate.__func__
        fn.__globals__.update(stubs)
        owner = type("Model", (), {"fused_shared_experts_architecture": class_arch})
        disabled = serving.disable_shared_experts_fusion  # resolve_shared_experts_config / install_..._decision
        return not disabled and fn(owner, hf, qc) is None
    return decide


@pytest.mark.parametrize("draft", [False, True], ids=["main", "draft"])
@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize(("rules", "release"), SGLANG_RELEASES, ids=release_ids(SGLANG_RELEASES))
def test_shared_expert_fusion_decisions_are_the_engines(rules, release, family, draft):
    from quant.engines.fusion import loader_mapped, no_fusion_reason
    from quant.engines.serving import serving

    engine = _fusion_engine(engine_wheel(rules, release), family, draft)
    rng = random.Random(f"fusion{release}{family}{draft}")
    layers = 61 if family == "deepseek_v3" else 78
    pool = [f"model.layers.{n}.mlp.shared_experts.{p}" for n in (3, layers) for p in ("gate_proj", "down_proj")] + [
        "re:.*shared_experts.*", "mtp.layers.0.mlp.shared_experts.up_proj", "model.decoder.mlp.shared_experts.gate_proj",
        "model.layers.3.mlp.shared_expert_gate", f"model.layers.{layers}.mlp.experts", "model.layers.3.mlp.experts",
        "lm_head", "model.layers.3.self_attn.q_a_proj"]
    disagree, fused = [], 0
    for _ in range(CASES):
        config = {"num_hidden_layers": layers, "n_routed_experts": rng.choice([256, 256, 384, 160]),
                  "n_shared_experts": rng.choice([1, 1, 1, 2]), "num_nextn_predict_layers": 1}
        exclude = rng.sample(pool, rng.randint(0, 4))
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 1, 8]),
                        disable_shared_experts_fusion=rng.random() < 0.15)
        entries = loader_mapped(exclude, rules, family) if draft else exclude
        theirs = engine(config, entries, kind, setup)
        ours = no_fusion_reason(rules, family, {**config, "architectures": [
            "GlmMoeDsaForCausalLM" if family == "glm_moe_dsa" else "DeepseekV3ForCausalLM"]}, kind, entries, setup,
            draft) is None
        fused += theirs
        if theirs != ours:
            disagree.append((config, exclude, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert fused or (family, draft) == ("glm_moe_dsa", True)  # the cases reach both answers
