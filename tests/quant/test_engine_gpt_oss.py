"""Differential tests for gpt-oss (``gpt_oss``: GptOssForCausalLM in both engines) against the wheels'
own functions, for every release its rule files list (``manifests/families/gpt_oss/{sglang,vllm}.yaml``):

- the native MXFP4 config (``quant_method: mxfp4``, what gpt-oss ships and quantgate writes for it):
  each release's ``Mxfp4Config.from_config`` + ``get_quant_method`` run on a Linear and on the routed
  experts (the engines' classes stubbed by name), beside ``quant.engines.excluded(kind="mxfp4")``;
- vLLM's ``hf_to_vllm_mapper`` (its own ``WeightsMapper``, built from the class's literal) on the
  checkpoint's names, beside the rules' ``module_names``, and on the tensors quantgate writes;
- sglang's ``_load_mxfp4_experts_weights`` suffixes, the constructors' ``quant_config`` arguments
  (attention, router) and the packed-modules mappings, beside the rules.
"""

from __future__ import annotations

import ast
import types
import typing

import pytest
from packaging.version import Version

from quant.blocks import BLOCKS, SCALES
from quant.engines import ENGINES, Exclude, excluded, rule_sets
from quant.engines.replay import class_name
from quant.engines.rules import releases_read, window
from quant.layout import family_named
from tests.quant.engine_sources import (attribute_builds, class_constant, class_def, load, method_def, methods,
                                        parsed, served_modules, sglang_quark_loader_additions, source)
from tests.quant.test_engine_sources import engine_wheel

FAMILY = "gpt_oss"
MODEL = {"sglang": "sglang/srt/models/gpt_oss.py", "vllm": "vllm/model_executor/models/gpt_oss.py"}
MXFP4 = {"sglang": "sglang/srt/layers/quantization/mxfp4.py", "vllm": "vllm/model_executor/layers/quantization/mxfp4.py"}
# what openai/gpt-oss-20b's config.json carries (the manifest's blocks_config)
RELEASE_QCONFIG = family_named(FAMILY).fused_experts.blocks_config


def _cases():
    out = []
    for engine in ENGINES:
        read = releases_read(engine, FAMILY)
        for rules in rule_sets(engine, FAMILY):
            out += [(rules, v) for v in sorted(read, key=Version) if rules.covers(read[v])]
    return out


CASES = _cases()
IDS = [f"{rules.engine} {release}" for rules, release in CASES]


def test_every_release_named_is_read():
    """Every release of each engine's window (sglang from 0.5.9, .postN included; vLLM from 0.16.0), each
    replayed by one rule set; nothing replayed unread."""
    for engine in ENGINES:
        assert sorted(v for rules, v in CASES if rules.engine == engine) == sorted(window(engine))


class _Layer:
    pass


class LinearBase(_Layer):
    pass


class FusedMoE(_Layer):
    moe_config = None


class Attention(_Layer):
    pass


class Unquantized:
    pass


class MoEMethod:
    def __init__(self, *args, **kwargs):
        pass


def _quant_method(rules, whl, platform: str):
    """The release's own Mxfp4Config built from the release's config.json, and a function saying
    whether it quantizes a layer (True: an MXFP4 method; False: unquantized or no method)."""
    stubs = {"LinearBase": LinearBase, "FusedMoE": FusedMoE, "RoutedExperts": FusedMoE, "Attention": Attention,
             "UnquantizedLinearMethod": Unquantized, "Mxfp4MoEMethod": MoEMethod, "GptOssMxfp4MoEMethod": MoEMethod,
             "Mxfp4DynamicQuantMoEMethod": MoEMethod, "is_layer_skipped": lambda **k: True, "_is_hip": platform == "rocm",
             # ROCm MX support (<= 0.5.17: mxfp_supported)
             "is_gfx95_supported": lambda: True, "mxfp_supported": lambda: True,
             "logger": types.SimpleNamespace(debug_once=lambda *a, **k: None),
             "QuantizationMethods": str, "QuantizeMethodBase": object, "FusedMoEMethodBase": object,
             "FusedMoEConfig": object, "Optional": typing.Optional, "List": typing.List,
             "torch": types.SimpleNamespace(),
             # vLLM <= 0.18.1: an XPU method beside the MXFP4 MoE method (the platform is CUDA or ROCm here)
             "current_platform": types.SimpleNamespace(is_xpu=lambda: False), "XpuMxfp4MoEMethod": MoEMethod,
             "get_marlin_input_dtype": lambda prefix: None}
    names = ["__init__", "from_config", "get_quant_method", "get_name"]
    cls = methods(whl, MXFP4[rules.engine], "Mxfp4Config", names, stubs)["cls"]
    cls.get_from_keys = staticmethod(lambda config, keys: next(config[k] for k in keys if k in config))
    cls.packed_modules_mapping = {}
    cls._make_moe_method = lambda self, moe: MoEMethod(moe)
    _orig_init = cls.__init__

    def init(self, *args, **kwargs):  # QuantizationConfig.__init__ (the base) is not what is tested
        _orig_init.__globals__["super"] = lambda: types.SimpleNamespace(__init__=lambda: None)
        _orig_init(self, *args, **kwargs)
    cls.__init__ = init
    served = {"sglang.srt.layers.linear": {"LinearBase": LinearBase},
              "sglang.srt.layers.moe.fused_moe_triton": {"FusedMoE": FusedMoE},
              "sglang.srt.layers.quantization.unquant": {"UnquantizedLinearMethod": Unquantized}}
    with served_modules(served):
        config = cls.from_config(dict(RELEASE_QCONFIG))

    def quantizes(layer) -> bool:
        with served_modules(served):
            method = config.get_quant_method(layer, prefix="model.layers.0.x")
        return isinstance(method, MoEMethod)
    return config, quantizes


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("rules,release", CASES, ids=IDS)
def test_native_mxfp4_quantizes_the_experts_only(rules, release, platform):
    """The release's own Mxfp4Config on the release's config: it reads no exclude list (ignored_layers
    stays None whatever modules_to_not_convert says), the routed experts get its MXFP4 MoE method and
    a Linear none; the replay's decision is the same."""
    config, quantizes = _quant_method(rules, engine_wheel(rules, release), platform)
    assert config.ignored_layers is None
    assert rules["mxfp4_native"]["reads_exclude"] is False
    assert quantizes(FusedMoE()) is (not excluded("model.layers.0.mlp.experts", Exclude([]), rules, "mxfp4", True))
    assert quantizes(LinearBase()) is (not excluded("model.layers.0.self_attn.qkv_proj", Exclude([]), rules, "mxfp4",
                                                    False))
    assert quantizes(FusedMoE()) and not quantizes(LinearBase())


def _vllm_mapper(whl):
    path = "vllm/model_executor/models/utils.py"  # ShardId (0.25.0) and ShardIds (0.31.0) came later than WeightsMapper
    helpers = [n for n in ("ShardIds", "ShardId") if f"\n{n}" in source(whl, path) or f"class {n}" in source(whl, path)]
    ns = load(whl, path, ["WeightsMapper", *helpers], {"TypeAlias": typing.TypeAlias})
    node = class_def(whl, MODEL["vllm"], "GptOssForCausalLM")
    call = next(s.value for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "hf_to_vllm_mapper")
    mapper = ns["WeightsMapper"](**{k.arg: ast.literal_eval(k.value) for k in call.keywords})
    if not hasattr(mapper, "map_name"):  # <= 0.30.0: the same mapping under _map_name
        mapper.map_name = mapper._map_name
    return mapper


NAMES = [f"model.layers.{i}.self_attn.{p}" for i in (0, 11) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")] + \
    ["model.layers.3.mlp.router", "model.layers.3.mlp.experts", "lm_head"]  # the Linear modules (and FusedMoE)


@pytest.mark.parametrize("rules,release", [c for c in CASES if c[0].engine == "vllm"],
                         ids=[i for i in IDS if i.startswith("vllm")])
def test_vllm_mapper_renames_as_the_rules_say(rules, release):
    """vLLM's own WeightsMapper: module names (what its quant config looks up) as class_name gives
    them, and every tensor quantgate writes for the experts maps to a FusedMoE parameter."""
    mapper = _vllm_mapper(engine_wheel(rules, release))
    for name in NAMES:
        assert mapper.map_name(name + ".weight") == class_name(name, rules) + ".weight", name
    experts = "model.layers.0.mlp.experts."
    written = {experts + t for t in rules["mxfp4_native"]["tensors"]}
    mapped = {n: mapper.map_name(n) for n in written}
    assert mapped == {experts + "gate_up_proj_blocks": experts + "w13_weight",
                      experts + "gate_up_proj_scales": experts + "w13_weight_scale",
                      experts + "down_proj_blocks": experts + "w2_weight",
                      experts + "down_proj_scales": experts + "w2_weight_scale",
                      experts + "gate_up_proj_bias": experts + "w13_bias",
                      experts + "down_proj_bias": experts + "w2_bias"}


@pytest.mark.parametrize("rules,release", [c for c in CASES if c[0].engine == "sglang"],
                         ids=[i for i in IDS if i.startswith("sglang")])
def test_sglang_mxfp4_loader_reads_the_tensors_written(rules, release):
    """sglang's _load_mxfp4_experts_weights loads an expert tensor by the branch whose ``"<suffix>" in
    name`` holds: the suffixes it reads are the rules' (and quant.blocks writes <fused>_blocks / _scales)."""
    fn = method_def(class_def(engine_wheel(rules, release), MODEL["sglang"], "GptOssForCausalLM"),
                    "_load_mxfp4_experts_weights")
    suffixes = {node.left.value for node in ast.walk(fn) if isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Constant) and isinstance(node.ops[0], ast.In)
                and ast.unparse(node.comparators[0]) == "name"}
    assert sorted(suffixes) == sorted(rules["mxfp4_native"]["tensors"])
    assert {f"{p}{s}" for p in ("gate_up_proj", "down_proj") for s in (BLOCKS, SCALES)} <= set(suffixes)


def _quant_config_arg(whl, path, cls, method, attr) -> str | None:
    """The quant_config argument a constructor builds ``self.<attr>`` with (None: not passed)."""
    builds = attribute_builds(method_def(class_def(whl, path, cls), method), attr)
    assert builds, f"{cls}.{method} builds no self.{attr}"
    return builds[0].keywords.get("quant_config")


@pytest.mark.parametrize("rules,release", CASES, ids=IDS)
def test_unquantized_roles_are_the_constructors(rules, release):
    """Which modules are built without the quant config, read from the constructors: sglang's
    attention (GptOssDecoderLayer passes none) and router (quant_config=None); vLLM's router
    (GateLinear without one) while its attention gets the config."""
    whl = engine_wheel(rules, release)
    unquantized = set(rules["unquantized_roles"])
    if rules.engine == "sglang":
        attention = _quant_config_arg(whl, MODEL["sglang"], "GptOssDecoderLayer", "__init__", "self_attn")
        router = _quant_config_arg(whl, MODEL["sglang"], "GptOssSparseMoeBlock", "__init__", "router")
    else:
        attention = _quant_config_arg(whl, MODEL["vllm"], "OAIAttention", "__init__", "qkv_proj")
        router = _quant_config_arg(whl, MODEL["vllm"], "MLPBlock", "__init__", "router")
    assert ("attention" in unquantized) is (attention in (None, "None"))
    assert ("router" in unquantized) is (router in (None, "None"))
    assert "lm_head" in unquantized


@pytest.mark.parametrize("rules,release", CASES, ids=IDS)
def test_packed_modules_mapping_is_the_class(rules, release):
    """The Quark fused names: vLLM's class literal; sglang's class has none, so the loader's additions."""
    whl = engine_wheel(rules, release)
    literal = class_constant(class_def(whl, MODEL[rules.engine], "GptOssForCausalLM"), "packed_modules_mapping")
    if rules.engine == "vllm":
        assert {k: list(v) for k, v in literal.items()} == rules["quark_fused"]
        assert rules["fp8_skip"]["fused"] == rules["quark_fused"]
    else:
        assert literal is None
        assert {k: list(v) for k, v in sglang_quark_loader_additions(whl).items()} == rules["quark_fused"]


@pytest.mark.parametrize("rules,release", CASES, ids=IDS)
def test_every_layer_is_moe(rules, release):
    """No dense MLP in gpt-oss: sglang raises NotImplementedError for one, vLLM builds MLPBlock always."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        text = ast.unparse(method_def(class_def(whl, MODEL["sglang"], "GptOssDecoderLayer"), "__init__"))
        assert "Dense MLP is not implemented" in text
    else:
        builds = attribute_builds(method_def(class_def(whl, MODEL["vllm"], "TransformerBlock"), "__init__"), "mlp")
        # MLPBlock (<= 0.24.0), or the class attribute mlp_cls = MLPBlock
        assert [b.call for b in builds] in (["MLPBlock"], ["self.mlp_cls"]) and not builds[0].under
    assert rules["moe_layers"] == "all"
    assert parsed(whl, MODEL[rules.engine]) is not None
