"""Differential tests: the replay's per-module decision equals the engines' own code, release by release.

For each rule set, the last release it covers is downloaded once (``tests/quant/engine_sources.py``)
and its own ``should_ignore_layer`` (Quark exclude), ``is_layer_skipped`` + ``Fp8Config.from_config``
(FP8 skip list), and, in sglang, the draft's ``_resolve_nextn_quant_config`` / ``_map_mtp_ckpt_name``
are run on generated cases beside ``quant.engines``. Without the registry the tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import random
import sys
import types

import pytest

from quant.engines import (
    Exclude,
    MixedShards,
    draft_exclude,
    draft_name,
    excluded,
    rule_sets,
)
from quant.engines.match import fp8_ignored_layers, fp8_skipped
from tests.quant.engine_sources import (
    WheelUnavailable,
    fake_quant_config,
    load,
    methods,
    source,
    wheel,
)

N = 3  # num_hidden_layers of the generated model: the MTP layer is model.layers.3
RULE_SETS = [r for engine in ("sglang", "vllm") for r in rule_sets(engine)]
CASES = 260  # per rule set and kind; 7 rule sets x (Quark + FP8 + draft) > 1,000


def engine_wheel(rules):
    try:
        return wheel(rules.engine, rules.last)
    except (WheelUnavailable, OSError) as exc:
        pytest.skip(f"cannot obtain {rules.engine}=={rules.last} from the package registry: {exc}")


def _quark_engine(rules, whl):
    if rules.engine == "vllm":
        cfg = load(whl, "vllm/model_executor/layers/quantization/utils/config_utils.py",
                   ["find_matching_patterns", "is_equal_or_regex_match"])
        ns = load(whl, "vllm/model_executor/layers/quantization/quark/utils.py", ["should_ignore_layer"], cfg)
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
        names = ["is_layer_skipped", "_module_path_match", "_FALLBACK_FUSED_SHARDS"] if rules.last != "0.5.10" \
            and rules.last != "0.5.9" else ["is_layer_skipped"]
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
                            "re:.*(q_a_proj|kv_a_proj_with_mqa)", "self_attn", "experts"]
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


@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: r.id)
def test_quark_exclude_decisions_equal_the_engines(rules):
    engine = _quark_engine(rules, engine_wheel(rules))
    modules, entries = _pool(rules)
    rng = random.Random(rules.id)
    fused = {k: list(v) for k, v in rules["quark_fused"].items()}
    disagree = []
    for _ in range(CASES):
        exclude = rng.sample(entries, rng.randint(0, 12))
        for name in rng.sample(modules, 4):
            moe = name.endswith(".experts")
            ours = _outcome(excluded, name, Exclude(exclude), rules, "quark", moe)
            theirs = _outcome(engine, name, exclude, fused, moe)
            if ours != theirs:
                disagree.append((name, exclude, ours, theirs))
    assert not disagree, disagree[:3]


@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: r.id)
def test_fp8_skip_decisions_equal_the_engines(rules):
    engine = _fp8_engine(rules, engine_wheel(rules))
    modules, entries = _pool(rules)
    entries = [e for e in entries if not e.startswith(("re:", "*"))] + [e.removeprefix("model.") for e in entries[:8]]
    rng = random.Random("fp8" + rules.id)
    skip = rules["fp8_skip"]
    disagree = []
    for _ in range(CASES):
        listed = rng.sample(entries, rng.randint(0, 12))
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        where = rng.choice(["ignored_layers", "modules_to_not_convert", "both", "empty_ignored"])
        if where == "both":
            qconfig.update(ignored_layers=listed[: len(listed) // 2], modules_to_not_convert=listed)
        elif where == "empty_ignored":
            qconfig.update(ignored_layers=[], modules_to_not_convert=listed)
        else:
            qconfig[where] = listed
        for name in rng.sample(modules, 4):
            ignored = fp8_ignored_layers(qconfig, skip["keys"], skip["keys_mode"], skip["model_prefix_variants"])
            ours = _outcome(fp8_skipped, name, ignored, skip["fused"], match=skip["match"], experts=skip["experts"],
                            fallback_fused=skip["fallback_fused"])
            theirs = _outcome(engine, name, qconfig, {k: list(v) for k, v in skip["fused"].items()})
            if ours != theirs:
                disagree.append((name, qconfig, ours, theirs))
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


@contextlib.contextmanager
def _served(name, **attrs):
    """The draft methods import helpers inside their body: serve the wheel's own ones under that name
    for the duration of the call only (no stub package outlives it)."""
    parts = name.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[name].__dict__.update(attrs)
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


class _Config:
    def __init__(self, num_hidden_layers):
        self.num_hidden_layers = num_hidden_layers


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize("rules", rule_sets("sglang"), ids=lambda r: r.id)
def test_sglang_draft_exclude_and_decisions_equal_the_engine(rules, family):
    engine = _sglang_draft_engine(engine_wheel(rules), family)
    quark = _quark_engine(rules, engine_wheel(rules))
    rng = random.Random(f"draft{rules.id}{family}")
    fused = {k: list(v) for k, v in rules["quark_fused"].items()}
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


@pytest.mark.parametrize("rules", [r for r in rule_sets("sglang")], ids=lambda r: r.id)
def test_sglang_draft_names_are_the_loaders(rules):
    """The MTP naming rule (spec names -> model.*, rest -> model.decoder.*, skipped names) is the loader's."""
    text = source(engine_wheel(rules), "sglang/srt/models/deepseek_common/deepseek_weight_loader.py")
    naming = rules["mtp_naming"]
    spec = text[text.index("nextn_spec_weight_names=["):]
    spec = spec[:spec.index("]")]
    assert sorted(s.strip().strip('",') for s in spec.split("[", 1)[1].split(",") if s.strip()) == \
        sorted(naming["top_level"])
    for skipped in naming["skipped"]:
        assert f'"{skipped}" in name' in text
    assert 'name.replace(layer_prefix, "model.decoder")' in text and "Only 1 nextn layer is supported" in text
