"""vLLM's ModelOpt loading (``quant.engines.modelopt`` + ``manifests/engines/modelopt.vllm.yaml``) beside the
wheels' own functions: each test runs the release's code (``ModelOptQuantConfigBase.from_config`` /
``apply_vllm_mapper`` / ``is_layer_excluded`` / ``get_quant_method``, the mixed-precision config's
``_resolve_quant_algo`` and ``get_quant_method``, the convertor's ``_normalize_quantization_config``) on a grid
of configs and module names and asserts ``decide`` says what the release does. By default each rule span's first
and last release; ``QUANTGATE_WINDOW=all`` runs every release of the window.
"""

from __future__ import annotations

import ast
import itertools
import os
import types
from dataclasses import replace

import pytest
from packaging.version import Version

from quant.engines import modelopt
from quant.engines.format_rules import cut, format_spans
from quant.engines.match import MixedShards
from quant.engines.replay import mapped_entry
from quant.engines.rules import rule_sets, window
from tests.quant.engine_sources import (
    WheelUnavailable,
    class_def,
    load,
    methods,
    parsed,
    wheel,
)
from tests.quant.test_fusion import run_gate
from tests.quant.third_party_checkpoints import modelopt_config, write_third_party

MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"
QUANT_UTILS = "vllm/model_executor/layers/quantization/utils/quant_utils.py"
CONVERTOR = "vllm/transformers_utils/model_arch_config_convertor.py"
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
         "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
MAPPER = {"style": "vllm", "kinds": ["quark"], "prefix": {"model.language_model.": "language_model.model."},
          "substr": {"mtp.": "model.layers.4."}}


EXCLUDED = ("lm_head", "*.mlp.gate", "*self_attn*")  # attention, routers and lm_head stored bf16


def _releases() -> list[str]:
    every = os.environ.get("QUANTGATE_WINDOW") == "all"
    spans = format_spans("modelopt", "vllm")
    return [v for v in window("vllm") if every or any(v in (s.first, s.last) for s in spans)]


def _wheel(release: str):
    try:
        return wheel("vllm", release)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain vllm=={release} from the package registry: {exc}")


def _rules(release: str, mapper: dict | None = None, fused: dict | None = None):
    family = next(r for r in rule_sets("vllm") if r.covers(release))
    rules = cut(family, "modelopt", release)
    return replace(rules, values={**rules.values, "exclude_mapper": mapper, "quark_fused": fused or FUSED})


class _Mapper:
    """A class's hf_to_vllm_mapper as apply_vllm_mapper uses it (the mapping itself is tested with the families)."""

    def __init__(self, mapper: dict):
        self.mapper = mapper

    def apply_list(self, values):
        return [m for v in values if (m := mapped_entry(v, self.mapper)) is not None]

    def apply_dict(self, values):
        return {m: v for k, v in values.items() if (m := mapped_entry(k, self.mapper)) is not None}

    def get_rename_mapper(self):
        return self


def _their_exclusion(whl):
    """(prefix, entries, packed, mapper) -> True / False / "raises", by the release's own functions."""
    skipped = load(whl, QUANT_UTILS, ["is_layer_skipped"])["is_layer_skipped"]
    from fnmatch import fnmatch
    base = methods(whl, MODELOPT, "ModelOptQuantConfigBase", ["is_layer_excluded", "apply_vllm_mapper"],
                   extra={"is_layer_skipped": skipped, "fnmatch": fnmatch, "WeightsMapper": object})["cls"]

    def run(prefix: str, entries: list[str], packed: dict, mapper: dict | None):
        config = types.SimpleNamespace(exclude_modules=list(entries), packed_modules_mapping=packed)
        if mapper is not None:  # the loader hands a class's mapper over only where the class has one
            base.apply_vllm_mapper(config, _Mapper(mapper))
        try:
            return base.is_layer_excluded(config, prefix)
        except ValueError:
            return "raises"
    return run


def _our_exclusion(prefix: str, entries: list[str], rules) -> bool | str:
    try:
        return modelopt.excluded_by(prefix, modelopt.exclude_entries({"quantization": {
            "exclude_modules": entries}}, rules), rules) is not None
    except MixedShards:
        return "raises"


PREFIXES = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj",
            "model.layers.1.mlp.down_proj", "model.layers.1.mlp.experts", "model.layers.10.mlp.experts",
            "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.2.self_attn.fused_qkv_a_proj",
            "lm_head", "language_model.model.layers.0.self_attn.o_proj", "model.layers.4.mlp.experts",
            "language_model.model.layers.1.mlp.down_proj"]
EXCLUDES = [
    [], ["lm_head"], ["model.layers.0.self_attn.qkv_proj"], ["model.layers.0.self_attn.q_proj"],
    ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"],
    ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"], ["model.layers.1.mlp.experts.0.gate_proj"],
    ["model.layers.1.mlp.experts.0.down_proj"], ["model.layers.1*"], ["model.layers.1.mlp*"], ["*.mlp.gate*"],
    ["*mlp.experts*"], ["*self_attn*"], ["model.layers.0.self_attn*", "lm_head"], ["mlp.down_proj"],
    ["model.layers.1.mlp.shared_experts*"], ["model.layers.2.self_attn.q_a_proj"],
    ["model.language_model.layers.0.self_attn.o_proj"], ["mtp.mlp.experts*"], ["layers.1"], ["*experts"],
    ["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_experts.up_proj"],
    ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_proj"],
    ["model.layers.0.self_attn", "model.layers.0.self_attn.q_proj"], ["model.layers.1.mlp.*"],
]


@pytest.mark.parametrize("release", _releases())
def test_exclusion_matches_each_release(release):
    """apply_vllm_mapper + is_layer_excluded (exact with fused shards and the experts test, substring, fnmatch):
    every prefix x exclude list x class mapper (none / one) decided as the release decides it."""
    theirs = _their_exclusion(_wheel(release))
    for mapper in (None, MAPPER):
        rules = _rules(release, mapper)
        for entries in EXCLUDES:
            for prefix in PREFIXES:
                assert _our_exclusion(prefix, entries, rules) == theirs(prefix, entries, FUSED, mapper), \
                    (release, prefix, entries, mapper)


def _quant_algos(whl) -> dict:
    """QUANT_ALGOS (and LINEAR_ALGOS where it is built from them) as the release's module defines them."""
    nodes = [n for n in parsed(whl, MODELOPT).body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
        getattr(t, "id", None) in ("QUANT_ALGOS", "LINEAR_ALGOS", "_BLOCK_FP8_MOE_ALGOS")
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    ns: dict = {}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), whl.name, "exec"), ns)  # noqa: S102 (the release's data)
    return ns


def _their_from_config(whl):
    """config -> (algo, exclude list) or "raises", by from_config (+ the nested-field checks of the NVFP4 and
    MXFP8 configs' _from_config, and the convertor for a config naming its producer)."""
    algos = _quant_algos(whl)
    got = {}

    def captured(cls, **kwargs):
        got.update(kwargs)
        return kwargs

    base = methods(whl, MODELOPT, "ModelOptQuantConfigBase", ["from_config"],
                   extra={"QUANT_ALGOS": algos["QUANT_ALGOS"]})["cls"]
    holder = types.SimpleNamespace(_from_config=lambda **kw: captured(None, **kw),
                                   get_from_keys=lambda config, keys: config[keys[0]])
    required = {}
    for cls, algo in (("ModelOptNvFp4Config", "NVFP4"), ("ModelOptMxFp8Config", "MXFP8")):
        fn = next(n for n in class_def(whl, MODELOPT, cls).body if getattr(n, "name", None) == "_from_config")
        text = ast.unparse(fn)
        start = text.index("required_fields = ")
        required[algo] = ast.literal_eval(text[start + len("required_fields = "):].split("\n", 1)[0])
    convertor = methods(whl, CONVERTOR, "ModelArchConfigConvertorBase", ["_normalize_quantization_config"])["cls"]

    def run(config: dict):
        got.clear()
        import copy
        config = copy.deepcopy(config)
        try:
            convertor._normalize_quantization_config(None, types.SimpleNamespace(quantization_config=config))
            base.from_config.__func__(holder, config)
        except ValueError:
            return "raises"
        algo = got["quant_method"]
        inner = config.get("quantization")
        if isinstance(inner, dict) and any(k not in inner for k in required.get(algo, [])):
            return "raises"
        return algo, got["exclude_modules"]
    return run


CONFIGS = [
    {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "group_size": 16,
                                                          "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
    for algo in ("FP8", "fp8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8",
                 "MIXED_PRECISION", "W4A8_AWQ")
] + [
    {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"], "group_size": 16}
    for algo in ("FP8", "NVFP4", "nvfp4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION", "W4A8_AWQ")
] + [
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["a"], "exclude_modules": ["lm_head"]},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": "lm_head"},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16"},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "sixteen"},
    {"quant_method": "modelopt"},
    {"quantization": {"quant_algo": "NVFP4", "exclude_modules": []}},
    {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "exclude_modules": []}},
    {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}},
    {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None}},
    {"quantization": {"quant_algo": "MXFP8", "exclude_modules": []}},
    {"quant_method": "modelopt", "quantization": "FP8", "quant_algo": "FP8"},
    {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8", "exclude_modules": []}},
    {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": 8, "exclude_modules": []}},
    {"quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None}},
    {"quantization": {"quant_algo": "FP8"}},
    {"quantization": {"quant_algo": "FP8", "exclude_modules": "lm_head"}},
    {"producer": {"name": "other"}, "quantization": {"quant_algo": "W4A8_AWQ", "exclude_modules": []}},
    {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": [],
                                                          "quantized_layers": {"a": {"quant_algo": "FP8"}}}},
]


@pytest.mark.parametrize("release", _releases())
def test_config_matches_each_release(release):
    """Both config shapes (hf_quant_config.json's nested one, config.json's flat one): the algo, the exclude list
    read, and every refusal, as the release's from_config and convertor have them."""
    theirs = _their_from_config(_wheel(release))
    rules = _rules(release)
    values = rules.values["modelopt"]
    for config in CONFIGS:
        ours = "raises" if modelopt.config_error(config, rules) else (
            modelopt.quant_algo(config), modelopt.exclude_list(config, values))
        assert ours == theirs(config), (release, config)


class Linear:
    pass


class Moe:
    moe_config = None


class LmHead:
    pass


class Attention:
    pass


def _their_quant_method(whl, cls: str = "ModelOptQuantConfigBase"):
    """(layer, prefix, excluded) -> "quantized" / "unquantized" / "raises" by get_quant_method with the release's
    layer classes stood in (LinearBase, FusedMoE / RoutedExperts, ParallelLMHead, Attention / MLAAttention)."""
    unquantized = type("UnquantizedLinearMethod", (), {})
    quantized = type("Quantized", (), {"__init__": lambda self, *a, **k: None})
    extra = {"LinearBase": Linear, "FusedMoE": Moe, "RoutedExperts": Moe, "ParallelLMHead": LmHead,
             "VocabParallelEmbedding": LmHead, "Attention": Attention, "MLAAttention": Attention,
             "UnquantizedLinearMethod": unquantized, "get_marlin_input_dtype": lambda prefix: None,
             "build_linear_method": lambda *a: quantized()}
    base = methods(whl, MODELOPT, cls, ["get_quant_method"], extra=extra)["cls"]

    def run(layer, prefix: str, excluded: bool):
        config = types.SimpleNamespace(is_layer_excluded=lambda p: excluded, LinearMethodCls=quantized,
                                       FusedMoEMethodCls=quantized, quant_method="FP8")
        try:
            method = base.get_quant_method(config, layer, prefix)
        except (NotImplementedError, ValueError):
            return "raises"
        return "quantized" if isinstance(method, quantized) else "unquantized"
    return run


def _their_mxfp8(whl, base):
    """The MXFP8 config's own get_quant_method (0.16.0..0.17.1: any FusedMoE raises before its super() is asked)."""
    asked = {}
    mx = methods(whl, MODELOPT, "ModelOptMxFp8Config", ["get_quant_method"],
                 extra={"FusedMoE": Moe, "RoutedExperts": Moe, "super": lambda: types.SimpleNamespace(
                     get_quant_method=lambda layer, prefix: base(layer, prefix, asked["excluded"]))})["cls"]

    def run(layer, prefix: str, excluded: bool):
        asked["excluded"] = excluded
        config = types.SimpleNamespace(moe_quant_algo=None, is_layer_excluded=lambda p: excluded)
        try:
            return mx.get_quant_method(config, layer, prefix)
        except NotImplementedError:
            return "raises"
    return run


def _ours(decision) -> str:
    return "raises" if decision.raises else "unquantized" if decision.scheme is None else "quantized"


@pytest.mark.parametrize("release", _releases())
def test_quant_method_matches_each_release(release):
    """get_quant_method: an excluded module, a vision module, lm_head and a FusedMoE, quantized or not as the
    release builds them (the MXFP8 config's own get_quant_method where it has one)."""
    whl = _wheel(release)
    rules = _rules(release)
    mxfp8 = class_def(whl, MODELOPT, "ModelOptMxFp8Config")
    own = any(getattr(n, "name", None) == "get_quant_method" for n in mxfp8.body)
    for algo in ("FP8", "NVFP4", "MXFP8"):
        theirs = _their_quant_method(whl)
        if algo == "MXFP8" and own:
            theirs = _their_mxfp8(whl, theirs)
        for layer, prefix in ((Linear, "model.layers.0.self_attn.o_proj"), (Moe, "model.layers.1.mlp.experts"),
                              (LmHead, "lm_head"), (Linear, "model.vision_tower.blocks.0.fc1"),
                              (Linear, "model.vit_large_projector.fc"), (Moe, "model.vision_model.mlp.experts")):
            for excluded in (False, True):
                qconfig = {"quantization": {"quant_algo": algo, "group_size": 16, "kv_cache_quant_algo": None,
                                            "exclude_modules": [prefix] if excluded else []}}
                decision = modelopt.decide(prefix, moe=layer is Moe, draft=False, qconfig=qconfig, rules=rules)
                assert _ours(decision) == theirs(layer(), prefix, excluded), (release, algo, prefix, excluded)


def _assigned(whl, attr: str) -> dict[str, str]:
    """``<Config>.<attr> = <Class>`` statements of the release's modelopt.py."""
    out = {}
    for node in parsed(whl, MODELOPT).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) \
                and node.targets[0].attr == attr:
            out[ast.unparse(node.targets[0].value)] = ast.unparse(node.value)
    return out


CONFIG_OF = {"FP8": "ModelOptFp8Config", "FP8_PER_CHANNEL_PER_TOKEN": "ModelOptFp8Config",
             "FP8_PB_WO": "ModelOptFp8Config", "NVFP4": "ModelOptNvFp4Config", "W4A16_NVFP4": "ModelOptNvFp4Config",
             "MXFP8": "ModelOptMxFp8Config"}
MOE_LABEL = {"ModelOptFp8MoEMethod": "fp8", "ModelOptNvFp4FusedMoE": "nvfp4", "ModelOptMxFp8FusedMoE": "mxfp8"}


@pytest.mark.parametrize("release", _releases())
def test_algos_and_moe_methods_match_each_release(release):
    """The algos from_config accepts are QUANT_ALGOS; each algo's FusedMoE method is the one its config class
    assigns (ModelOptFp8MoEMethod's per-tensor scales for every FP8 algo)."""
    whl = _wheel(release)
    values = _rules(release).values["modelopt"]
    assert set(values["algos"]) == set(_quant_algos(whl)["QUANT_ALGOS"]), release
    moe = _assigned(whl, "FusedMoEMethodCls")
    mxfp8_raises = any(getattr(n, "name", None) == "get_quant_method" and "NotImplementedError" in ast.unparse(n)
                       for n in class_def(whl, MODELOPT, "ModelOptMxFp8Config").body)
    theirs = {algo: MOE_LABEL[moe[cls]] for algo, cls in CONFIG_OF.items()
              if algo in values["algos"] and cls in moe and not (algo == "MXFP8" and mxfp8_raises)}
    assert values["moe_schemes"] == theirs, release


def _their_mixed(whl):
    ns = methods(whl, MODELOPT, "ModelOptMixedPrecisionConfig",
                 ["_resolve_quant_algo", "_quantized_layer_prefix_candidates"])["cls"]

    def run(prefix: str, layers: dict, packed: dict):
        config = types.SimpleNamespace(quantized_layers=layers, packed_modules_mapping=packed)
        if hasattr(ns, "_quantized_layer_prefix_candidates"):
            config._quantized_layer_prefix_candidates = ns._quantized_layer_prefix_candidates
        try:
            return ns._resolve_quant_algo(config, prefix)
        except ValueError:
            return "raises"
    return run


MIXED_LAYERS = [
    {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}, "model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"},
     "model.layers.0.self_attn.v_proj": {"quant_algo": "FP8"}, "model.layers.1.mlp.experts.0.gate_proj":
     {"quant_algo": "NVFP4"}, "lm_head": {"quant_algo": "fp8"}},
    {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}, "model.layers.0.self_attn.k_proj":
     {"quant_algo": "NVFP4"}, "model.layers.1.mlp.gate_proj": {"quant_algo": "NVFP4"}},
    {"model.layers.0.self_attn.qkv_proj": {"quant_algo": "NVFP4"}, "model.layers.1.mlp.gate_up_proj":
     {"quant_algo": "FP8"}, "model.layers.1.mlp.down_proj": {"quant_algo": "W4A16_NVFP4"}},
    {"model.language_model.layers.0.self_attn.o_proj": {"quant_algo": "MXFP8"},
     "model.language_model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}},
]
MIXED_PREFIXES = PREFIXES + ["model.layers.0.self_attn.q_proj", "model.lm_head", "model.layers.1.mlp",
                             "language_model.model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn"]


@pytest.mark.parametrize("release", _releases())
def test_mixed_resolution_matches_each_release(release):
    """MIXED_PRECISION: the algo _resolve_quant_algo finds for each module (or its refusal of disagreeing shards)."""
    whl = _wheel(release)
    mixed = _rules(release).values["modelopt"]["mixed"]
    if mixed is None:
        assert class_def(whl, MODELOPT, "ModelOptMixedPrecisionConfig") is None, release
        return
    theirs = _their_mixed(whl)
    for layers in MIXED_LAYERS:
        for packed in ({}, FUSED):
            for prefix in MIXED_PREFIXES:
                try:
                    ours = modelopt.mixed_algo(prefix, layers, mixed, packed)
                except MixedShards:
                    ours = "raises"
                assert ours == theirs(prefix, layers, packed), (release, prefix, layers, packed)


def test_spans_cover_the_window_in_order():
    """Each window release in one span; the spans split where a rule changed (never two alike in a row)."""
    spans = format_spans("modelopt", "vllm")
    assert [s.first for s in spans] == sorted((s.first for s in spans), key=Version)
    assert all(a.values != b.values for a, b in itertools.pairwise(spans))


def test_labels_are_the_formats_own():
    """Every scheme a release builds is labelled as quant.third_party labels the algo's tensors (the GGUF-style
    block codecs of 0.32.0's mixed precision excepted: quantgate reads no such checkpoint)."""
    from quant.third_party import LABELS, MODELOPT, scheme_label

    for span in format_spans("modelopt", "vllm"):
        values = span.values
        for algo, label in values["algos"].items():
            assert algo == modelopt.MIXED or label == scheme_label(MODELOPT, algo), (span.first, algo)
        for algo, label in values["moe_schemes"].items():
            assert label in LABELS and values["algos"][algo] in LABELS, (span.first, algo)
        for built in (values["mixed"] or {}).get("linear", {}), (values["mixed"] or {}).get("moe", {}):
            for algo, label in built.items():
                assert label in LABELS or label == algo.lower() and algo.startswith(("IQ", "Q8")), (span.first, algo)


# the methods the mixed-precision config builds, and the scheme each builds (ModelOptFp8MoEMethod: per-tensor scales;
# Fp8MoEMethod: the block FP8 MoE of the fp8 quantization)
MIXED_METHODS = {"ModelOptFp8LinearMethod": "fp8", "ModelOptFp8PcPtLinearMethod": "fp8-channel",
                 "ModelOptFp8PbWoLinearMethod": "fp8-block", "ModelOptNvFp4LinearMethod": "nvfp4",
                 "ModelOptNvFp4W4A16LinearMethod": "nvfp4", "ModelOptMxFp8LinearMethod": "mxfp8",
                 "ModelOptFp8MoEMethod": "fp8", "ModelOptNvFp4FusedMoE": "nvfp4", "ModelOptMxFp8FusedMoE": "mxfp8",
                 "Fp8MoEMethod": "fp8-block"}
SUBCONFIGS = ("fp8_config", "fp8_block_config", "nvfp4_config", "w4a16_nvfp4_config", "mxfp8_config",
              "fp8_pcpt_config", "fp8_pb_wo_config")  # the sub-configs the mixed config hands its methods
MIXED_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "FP8_BLOCK_SCALES", "NVFP4", "W4A16_NVFP4", "MXFP8",
               "W4A8_AWQ", "INT4_AWQ")


def _their_mixed_method(whl, config_of=None):
    """(layer, algo) -> the scheme label ModelOptMixedPrecisionConfig.get_quant_method builds, None: unquantized
    (``config_of(algo)``: the config it runs on, default one whose every module resolves to ``algo``)."""
    from quant.third_party import MODELOPT as FORMAT
    from quant.third_party import scheme_label

    made = {name: type(name, (), {"__init__": lambda self, *a, **k: None, "label": label})
            for name, label in MIXED_METHODS.items()}
    built = type("Built", (), {"__init__": lambda self, label: setattr(self, "label", label)})
    extra = {**made, **_quant_algos(whl), "LinearBase": Linear, "FusedMoE": Moe, "RoutedExperts": Moe,
             "ParallelLMHead": LmHead, "VocabParallelEmbedding": LmHead, "Attention": Attention,
             "UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {}), "B12X_BLOCK_CODECS": {},
             "build_linear_method": lambda config, algo, prefix: built(scheme_label(FORMAT, algo))}
    cls = methods(whl, MODELOPT, "ModelOptMixedPrecisionConfig", ["get_quant_method"], extra=extra)["cls"]

    def run(layer, algo: str, prefix: str = "model.layers.0.x"):
        config = config_of(algo) if config_of else types.SimpleNamespace(
            is_layer_excluded=lambda p: False, _resolve_quant_algo=lambda p: algo)
        config.kv_cache_quant_method = None
        config.__dict__.update(dict.fromkeys(SUBCONFIGS))
        return getattr(cls.get_quant_method(config, layer, prefix), "label", None)
    return run


@pytest.mark.parametrize("release", _releases())
def test_mixed_methods_match_each_release(release):
    """MIXED_PRECISION: the scheme a Linear, lm_head and a FusedMoE are built with for each algo quantized_layers
    gives (an algo the release does not build: unquantized). 0.32.0's GGUF-style codecs are not run here (their
    methods are imported inside the function)."""
    whl = _wheel(release)
    mixed = _rules(release).values["modelopt"]["mixed"]
    if mixed is None:
        return
    theirs = _their_mixed_method(whl)
    lm_head = _rules(release).values["modelopt"]["lm_head"]
    for algo in MIXED_ALGOS:
        for layer, built in ((Linear, mixed["linear"]), (Moe, mixed["moe"]), (LmHead, mixed["linear"])):
            ours = built.get(algo) if layer is not LmHead or lm_head else None
            assert ours == theirs(layer(), algo), (release, algo, layer)


@pytest.mark.parametrize("release", _releases())
def test_mixed_decide_matches_each_release(release):
    """decide on a MIXED_PRECISION config beside the release's whole chain: is_layer_excluded, then
    _resolve_quant_algo on quantized_layers, then the mixed config's get_quant_method."""
    whl = _wheel(release)
    rules = _rules(release)
    if rules.values["modelopt"]["mixed"] is None:
        return
    from fnmatch import fnmatch
    skipped = load(whl, QUANT_UTILS, ["is_layer_skipped"])["is_layer_skipped"]
    base = methods(whl, MODELOPT, "ModelOptQuantConfigBase", ["is_layer_excluded"],
                   extra={"is_layer_skipped": skipped, "fnmatch": fnmatch})["cls"]
    resolve = methods(whl, MODELOPT, "ModelOptMixedPrecisionConfig",
                      ["_resolve_quant_algo", "_quantized_layer_prefix_candidates"])["cls"]
    layers = {**MIXED_LAYERS[0], "model.layers.1.mlp.down_proj": {"quant_algo": "W4A16_NVFP4"},
              "model.layers.2.self_attn.q_a_proj": {"quant_algo": "MXFP8"},
              "model.layers.2.self_attn.kv_a_proj_with_mqa": {"quant_algo": "MXFP8"},
              "model.layers.10.mlp.experts.3.up_proj": {"quant_algo": "FP8_PB_WO"}}
    for exclude in ([], ["lm_head", "model.layers.1.mlp.experts*"], ["*self_attn*"]):
        def config_of(algo, exclude=exclude):
            config = types.SimpleNamespace(exclude_modules=exclude, packed_modules_mapping=FUSED,
                                           quantized_layers=layers)
            config.is_layer_excluded = lambda p: base.is_layer_excluded(config, p)
            if hasattr(resolve, "_quantized_layer_prefix_candidates"):
                config._quantized_layer_prefix_candidates = resolve._quantized_layer_prefix_candidates
            config._resolve_quant_algo = lambda p: resolve._resolve_quant_algo(config, p)
            return config
        theirs = _their_mixed_method(whl, config_of)
        qconfig = {"quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": exclude,
                                    "quantized_layers": layers}}
        for prefix in PREFIXES + ["model.layers.0.self_attn.q_proj"]:
            layer = Moe if prefix.endswith(".experts") else LmHead if prefix == "lm_head" else Linear
            try:
                their = theirs(layer(), "", prefix)
            except ValueError:
                their = "raises"
            decision = modelopt.decide(prefix, moe=layer is Moe, draft=False, qconfig=qconfig, rules=rules)
            ours = "raises" if decision.raises else decision.scheme
            assert ours == their, (release, prefix, exclude)


# ---- gate checkpoint on tiny Qwen3-MoE ModelOpt checkpoints, each release replayed with its own rules ----

@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """ModelOpt exports of a tiny Qwen3-MoE (experts NVFP4, the EXCLUDED modules bf16): hf_quant_config.json alone
    (ModelOpt <= 0.29) with NVFP4 and W4A16_NVFP4, and config.json's flat config with W4A16_NVFP4 and with its
    exclude list under ``exclude_modules`` instead of ``ignore``."""
    flat = {"quant_method": "modelopt", "group_size": 16}
    cases = {"hf_nvfp4": (modelopt_config("NVFP4", EXCLUDED), True),
             "hf_w4a16": (modelopt_config("W4A16_NVFP4", EXCLUDED), True),
             "flat_w4a16": ({**flat, "quant_algo": "W4A16_NVFP4", "ignore": list(EXCLUDED)}, False),
             "flat_exclude_modules": ({**flat, "quant_algo": "NVFP4", "exclude_modules": list(EXCLUDED)}, False)}
    return {name: write_third_party(tmp_path_factory.mktemp(name) / "ck", "qwen3_moe", qconfig,
                                    hf_quant_config_only=only, num_hidden_layers=2)
            for name, (qconfig, only) in cases.items()}


@pytest.mark.parametrize("release", ["0.16.0", "0.22.1", "0.34.0"])
def test_hf_quant_config_only_export_loads(exports, capsys, release):
    """An export whose config is only in hf_quant_config.json is read as the ModelOpt NVFP4 checkpoint it is
    (vLLM's get_config takes that file's content when config.json has no quantization_config) and loads."""
    assert not (exports["hf_nvfp4"] / "config.json").read_text().count("quantization_config")
    code, text = run_gate(capsys, exports["hf_nvfp4"], "--engine", f"vllm=={release}")
    assert code == 0, text


@pytest.mark.parametrize("release", ["0.21.0", "0.34.0"])
def test_w4a16_in_hf_quant_config_only_is_refused_by_the_convertor(exports, capsys, release):
    """W4A16_NVFP4 from hf_quant_config.json: the architecture-config convertor gives producer-named configs a
    quant_method for FP8 / NVFP4 (and MIXED_PRECISION from 0.33.0) only, and raises on the rest; the same algo
    in config.json's flat config loads from 0.21.0, where QUANT_ALGOS took it."""
    code, text = run_gate(capsys, exports["hf_w4a16"], "--engine", f"vllm=={release}")
    assert code == 1 and "Unknown ModelOpt quant algo: W4A16_NVFP4" in text, text
    assert "_normalize_quantization_config" in text
    code, text = run_gate(capsys, exports["flat_w4a16"], "--engine", f"vllm=={release}")
    assert code == 0, text


def test_w4a16_before_0_21_0_is_refused_by_from_config(exports, capsys):
    code, text = run_gate(capsys, exports["flat_w4a16"], "--engine", "vllm==0.20.2")
    assert code == 1 and "ModelOpt currently only supports" in text and "QUANT_ALGOS" in text, text


def test_flat_exclude_modules_is_read_from_0_33_0(exports, capsys):
    """config.json's flat config listing its exclusions under exclude_modules: from_config reads only ``ignore``
    up to 0.32.0, so the bf16 attention is built NVFP4 (named, exit 1); 0.33.0 reads either key."""
    code, text = run_gate(capsys, exports["flat_exclude_modules"], "--engine", "vllm==0.32.0")
    assert code == 1 and "model.layers.0.self_attn.qkv_proj" in text and "not excluded" in text, text
    code, text = run_gate(capsys, exports["flat_exclude_modules"], "--engine", "vllm==0.33.0")
    assert code == 0, text
