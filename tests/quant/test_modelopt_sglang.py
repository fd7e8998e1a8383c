"""Differential tests: sglang's ModelOpt loading as quantgate replays it (``quant.engines.modelopt.decide`` under
``manifests/engines/modelopt.sglang.yaml``) equals the wheels' own code, release by release.

Each release's own functions run beside the rules on generated configs and modules: the config class it builds
(configs/model_config.py ``ModelConfig._parse_quant_hf_config`` / ``_parse_modelopt_quant_config``,
layers/quantization/base_config.py ``_modelopt_override_quantization_method``, the ``QUANTIZATION_METHODS`` table,
and model_loader/weight_utils.py ``get_quant_config``'s hf_quant_config.json branch, restated here: it reads files),
that config's ``from_config`` and ``get_quant_method`` for a LinearBase, a FusedMoE and a ParallelLMHead
(modelopt_quant.py, with layers/quantization/utils.py ``is_layer_skipped``). The layer classes and quant methods
are stand-ins: the method's class names what is built. By default each rule span's first and last release;
``QUANTGATE_WINDOW=all`` runs every release of the window (and checks that the cited code changes only
where a span starts). The acceptance tests at the end run the real ``gate checkpoint`` on tiny ModelOpt exports.

Not generated: a flat config whose quant_method is ``modelopt_fp4`` with an FP8 quant_algo (the FP4 config then
quantizes at load, which is not replayed), and a config without group_size (every ModelOpt export writes it).
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import logging
import os
import random
import subprocess
import sys
import types

import pytest
from packaging.version import Version

from quant.engines import format_rules
from quant.engines.modelopt import decide, exclude_entries
from quant.engines.rules import RuleSet, window
from tests.quant.engine_sources import (
    WheelUnavailable,
    _base_namespace,
    load,
    methods,
    parsed,
    served_modules,
    source,
    source_files,
    wheel,
)
from tests.quant.third_party_checkpoints import modelopt_config, write_third_party

MODELOPT = "sglang/srt/layers/quantization/modelopt_quant.py"
UTILS = "sglang/srt/layers/quantization/utils.py"
BASE = "sglang/srt/layers/quantization/base_config.py"
MODEL_CONFIG = "sglang/srt/configs/model_config.py"
METHODS_TABLE = "sglang/srt/layers/quantization/__init__.py"
CONFIGS = ("ModelOptQuantConfig", "ModelOptFp8Config", "ModelOptFp4Config")
CONFIG_METHODS = {"__init__", "from_config", "common_group_size", "is_layer_excluded", "_get_quant_method",
                  "get_quant_method", "get_name", "apply_weight_name_mapper"}
BUILT = {"ModelOptFp8LinearMethod": "fp8", "ModelOptFp8MoEMethod": "fp8", "ModelOptFp4LinearMethod": "nvfp4",
         "ModelOptNvFp4FusedMoEMethod": "nvfp4", "ModelOptNvFp4A16LinearMethod": "nvfp4"}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class LinearBase:
    pass


class FusedMoE:
    pass


class VocabParallelEmbedding:
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RadixAttention:
    pass


LAYERS = {"linear": LinearBase, "moe": FusedMoE, "lm_head": ParallelLMHead}
LAYER_MODULES = {"sglang.srt.layers.linear": {"LinearBase": LinearBase},
                 "sglang.srt.layers.moe.fused_moe_triton": {"FusedMoE": FusedMoE},
                 "sglang.srt.layers.vocab_parallel_embedding": {"ParallelLMHead": ParallelLMHead,
                                                                 "VocabParallelEmbedding": VocabParallelEmbedding}}


def _wheel(release: str):
    try:
        return wheel("sglang", release)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain sglang=={release} from the package registry: {exc}")


def _defined(whl, path: str, name: str) -> bool:
    return any(getattr(n, "name", None) == name or any(getattr(t, "id", None) == name for t in
               getattr(n, "targets", []) + [getattr(n, "target", None)]) for n in parsed(whl, path).body)


def _configs(whl) -> dict:
    """The release's ModelOpt config classes, their methods run as the release has them."""
    import regex
    import torch

    ns = _base_namespace()
    ns.update({n: type(n, (), {"__init__": lambda self, *a, **k: None})
               for n in (*BUILT, "UnquantizedLinearMethod", "ModelOptFp8KVCacheMethod")})
    ns.update(re=regex, torch=torch, lru_cache=functools.lru_cache, RadixAttention=RadixAttention, Tuple=tuple,
              LinearMethodBase=object, FusedMoEMethodBase=object, QuantizeMethodBase=object,
              envs=types.SimpleNamespace(SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=types.SimpleNamespace(
                  get=lambda: False)))
    ns["is_layer_skipped"] = load(whl, UTILS, [n for n in ("is_layer_skipped", "_module_path_match",
                                                           "_FALLBACK_FUSED_SHARDS") if _defined(whl, UTILS, n)]
                                  )["is_layer_skipped"]
    ns["QuantizationConfig"] = methods(whl, BASE, "QuantizationConfig", ["__init__", "get_from_keys"])["cls"]
    body = []
    for node in parsed(whl, MODELOPT).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_compile_exclusion_pattern":
            body.append(node)
        if isinstance(node, ast.ClassDef) and node.name in CONFIGS:
            keep = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in CONFIG_METHODS]
            body.append(ast.ClassDef(name=node.name, bases=node.bases, keywords=[], body=keep, decorator_list=[],
                                     type_params=[]))
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    import __future__
    exec(compile(module, f"{whl.name}/{MODELOPT}", "exec", flags=__future__.annotations.compiler_flag,  # noqa: S102
                 dont_inherit=True), ns)
    return ns


def _methods_table(whl) -> dict[str, str]:
    """``QUANTIZATION_METHODS``: quant_method -> the config class's name."""
    for node in parsed(whl, METHODS_TABLE).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if getattr(target, "id", None) in ("BASE_QUANTIZATION_METHODS", "QUANTIZATION_METHODS") and \
                isinstance(node.value, ast.Dict):
            return {ast.literal_eval(k): ast.unparse(v) for k, v in zip(node.value.keys, node.value.values) if k}
    raise LookupError(f"{METHODS_TABLE} in {whl.name} has no QUANTIZATION_METHODS literal")


def _dispatch(whl):
    """qconfig -> the config class the release builds it with on CUDA without --quantization (None: none)."""
    helpers = [n for n in ("_quant_config_to_dict", "unwrap_modelopt_quantization_config")
               if _defined(whl, MODEL_CONFIG, n)]
    found = load(whl, MODEL_CONFIG, helpers) if helpers else {}
    model_config = methods(whl, MODEL_CONFIG, "ModelConfig", ["_parse_quant_hf_config", "_parse_modelopt_quant_config"],
                           extra={n: found[n] for n in helpers})["cls"]
    override = methods(whl, BASE, "QuantizationConfig", ["_modelopt_override_quantization_method"])["cls"]
    override_fn = override.__dict__["_modelopt_override_quantization_method"]
    override_fn = getattr(override_fn, "__func__", override_fn)
    table = _methods_table(whl)

    def dispatch(qconfig: dict) -> str | None:
        hf_config = types.SimpleNamespace(architectures=["X"], model_type="x")
        own = types.SimpleNamespace(hf_config=hf_config, model_path="/nonexistent-quantgate-model")
        own._parse_modelopt_quant_config = lambda d: model_config._parse_modelopt_quant_config(own, d)
        nested = "quantization" in qconfig
        if nested:  # no quantization_config in config.json: hf_quant_config.json's content
            cfg = model_config._parse_modelopt_quant_config(own, copy.deepcopy(qconfig))
        else:
            hf_config.quantization_config = copy.deepcopy(qconfig)
            cfg = model_config._parse_quant_hf_config(own)
        if cfg is None:
            return None
        method = cfg.get("quant_method", "").lower()
        with served_modules({"sglang.srt.configs.model_config": {"REQUANTIZATION_METHODS": []}}):
            method = override_fn(override, cfg, None) or method
        algo = qconfig.get("quantization", {}).get("quant_algo")
        if nested and method.startswith("modelopt") and qconfig["producer"]["name"].startswith("modelopt"):
            if algo == "FP8" or method == "modelopt_fp8":  # get_quant_config's hf_quant_config.json branch
                return "ModelOptFp8Config"
            if "FP4" in algo:
                return "ModelOptFp4Config"
        return table.get(method, method) or None
    return dispatch


@functools.cache
def own_code(release: str):
    """(qconfig, layer kind, module, the class's packed_modules_mapping) -> what the release builds: a scheme
    label, None (unquantized), "raises", or "other" (a config that is not ModelOpt's FP8 / FP4 one)."""
    whl = _wheel(release)
    ns, dispatch = _configs(whl), _dispatch(whl)

    def built(qconfig: dict, kind: str, module: str, packed: dict):
        cls = dispatch(qconfig)
        if cls is None:
            return None
        if cls not in ("ModelOptFp8Config", "ModelOptFp4Config"):
            return "other"
        try:
            config = ns[cls].from_config({**copy.deepcopy(qconfig), "packed_modules_mapping": packed})
            with served_modules(LAYER_MODULES):
                method = config.get_quant_method(LAYERS[kind](), module)
        except ValueError:
            return "raises"
        return None if method is None or type(method).__name__ == "UnquantizedLinearMethod" else \
            BUILT[type(method).__name__]
    return built


def _rules(release: str, model_class: str = "Qwen3MoeForCausalLM", packed: dict = PACKED) -> RuleSet:
    span = next(s for s in format_rules.format_spans("modelopt", "sglang") if s.covers(release))
    return RuleSet("sglang", span.first, span.last, {"modelopt": span.values, "quark_fused": packed,
                                                     "exclude_mapper": None},
                   {f"modelopt.{r}": c for r, c in span.cites.items()}, model_class=model_class)


def ours(release: str, qconfig: dict, kind: str, module: str, packed: dict):
    """The same question put to the replay, in the same words."""
    rules = _rules(release, packed=packed)
    decision = decide(module, moe=kind == "moe", draft=False, qconfig=qconfig, rules=rules)
    if decision.unread:
        return "other"
    return "raises" if decision.raises else decision.scheme


MODULES = [("linear", "model.layers.{i}.self_attn.qkv_proj"), ("linear", "model.layers.{i}.self_attn.o_proj"),
           ("linear", "model.layers.{i}.mlp.gate_up_proj"), ("linear", "model.layers.{i}.mlp.down_proj"),
           ("linear", "model.layers.{i}.mlp.shared_experts.gate_up_proj"),
           ("linear", "model.layers.{i}.mlp.shared_experts.down_proj"),
           ("linear", "model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa"),
           ("linear", "model.layers.{i}.self_attn.kv_b_proj"), ("linear", "model.layers.{i}.self_attn.q_b_proj"),
           ("moe", "model.layers.{i}.mlp.experts"), ("lm_head", "lm_head"),
           ("linear", "language_model.model.layers.{i}.self_attn.o_proj"),
           ("moe", "language_model.model.layers.{i}.mlp.experts"), ("linear", "mtp.layers.0.self_attn.qkv_proj"),
           ("moe", "mtp.layers.0.mlp.experts"), ("linear", "model.layers.{i}.mlp.gate")]
ENTRIES = ["lm_head", "model.layers.{i}.self_attn", "model.layers.{i}.mlp.experts",
           "model.layers.{i}.mlp.experts.0.gate_proj", "model.layers.{i}.mlp.experts.*", "*mlp.experts*",
           "*self_attn*", "mtp*", "mtp.*", "*.mlp.gate", "model.layers.{i}.", "model.layers.{i}", "model.layers.1",
           "*shared_experts*", "model.layers.{i}.mlp.shared_experts", "model.layers.{i}.self_attn.q_proj",
           "model.layers.{i}.self_attn.k_proj", "q_a_proj", "kv_b_proj", "model.layers.{i}.self_attn.q_a_proj",
           "kv_a_proj_with_mqa", "model.layers.{i}.self_attn.kv_a_proj_with_mqa",
           "language_model.model.layers.{i}.self_attn", "model.layers.{i}.mlp.gate_proj",
           "model.layers.{i}.mlp.up_proj", "o_proj", "down_proj", "*", "layers", "gate_up_proj", "mlp.gate",
           "language_model.lm_head", "model.layers.{i}.mlp.shared_experts.down_proj", "*experts.0*", "experts"]
ALGOS = ["NVFP4", "FP8", "NVFP4_AWQ", "W4A16_NVFP4", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8",
         "MIXED_PRECISION"]
EXCLUDE_KEYS = ("ignore", "exclude_modules", "modules_to_not_convert")


def _qconfig(rng: random.Random) -> dict:
    """A ModelOpt config as an export writes it: hf_quant_config.json's nested shape, or config.json's flat one
    (quant_method modelopt, or the config's own name), its exclude list under one of the keys engines read."""
    algo = rng.choice(ALGOS)
    entries = [e.format(i=rng.choice([1, 10, 2])) for e in rng.sample(ENTRIES, rng.randint(0, 4))]
    shape = rng.choice(["nested", "modelopt", "modelopt", "named"])
    if shape == "nested":
        return {"producer": {"name": "modelopt"},
                "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": entries}}
    method = "modelopt" if shape == "modelopt" else "modelopt_fp4" if "FP4" in algo else "modelopt_fp8"
    return {"quant_method": method, "quant_algo": algo, "group_size": 16, rng.choice(EXCLUDE_KEYS): entries}


def _releases() -> list[str]:
    every = os.environ.get("QUANTGATE_WINDOW") == "all"
    spans = format_rules.format_spans("modelopt", "sglang")
    return [r for r in window("sglang") if every or any(r in (s.first, s.last) for s in spans)]


@pytest.mark.parametrize("release", _releases())
def test_each_release_builds_what_its_own_code_builds(release):
    """Configs x modules: the scheme (or refusal) the replay gives equals the release's own decision."""
    logging.disable(logging.WARNING)  # from_config warns on every NVFP4 config
    try:
        built = own_code(release)
        rng = random.Random(release)
        for _ in range(150):
            qconfig = _qconfig(rng)
            packed = rng.choice([PACKED, {}])  # a class that maps no shards: the release's fallback, if any
            for kind, name in MODULES:
                module = name.format(i=rng.choice([1, 10]))
                assert ours(release, qconfig, kind, module, packed) == built(qconfig, kind, module, packed), \
                    (release, qconfig, module, packed)
    finally:
        logging.disable(logging.NOTSET)


def test_every_window_release_is_covered_once():
    spans = format_rules.format_spans("modelopt", "sglang")
    for release in window("sglang"):
        assert len([s for s in spans if s.covers(release)]) == 1, release


# the functions cited by the rule file, per file: a span's releases must hold the same code for each
CITED = {MODELOPT: ["ModelOptQuantConfig._get_quant_method", "ModelOptQuantConfig.is_layer_excluded",
                    "ModelOptQuantConfig.apply_weight_name_mapper", "ModelOptFp8Config.from_config",
                    "ModelOptFp4Config.from_config", "ModelOptFp4Config.get_quant_method"],
         UTILS: ["is_layer_skipped", "_module_path_match"],
         MODEL_CONFIG: ["ModelConfig._parse_quant_hf_config", "ModelConfig._parse_modelopt_quant_config"]}
# cited code that changed inside a span without changing what it decides (the differential test runs both)
SAME_DECISIONS = {("ModelOptQuantConfig.is_layer_excluded", "0.5.22"): "the pattern compiled once, then matched",
                  ("ModelOptQuantConfig.apply_weight_name_mapper", "0.5.14"): "an annotation",
                  ("ModelOptFp4Config.from_config", "0.5.15"): "kv_cache_quant_algo read also when flat",
                  ("ModelOptFp8Config.from_config", "0.5.15"): "kv_cache_quant_algo read also when flat",
                  ("ModelOptFp4Config.get_quant_method", "0.5.18"): "a checkpoint not stored NVFP4 (load-time)",
                  ("ModelConfig._parse_quant_hf_config", "0.5.19"): "_quant_config_to_dict",
                  ("ModelConfig._parse_modelopt_quant_config", "0.5.15"): "MIXED_PRECISION's config (not replayed)",
                  ("ModelConfig._parse_modelopt_quant_config", "0.5.20"): "a flat config unwrapped (same algos)"}


def _cited_hash(whl, path: str, name: str) -> str:
    cls, _, fn = name.rpartition(".")
    body = parsed(whl, path).body
    if cls:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    node = next((n for n in body if getattr(n, "name", None) == fn), None)
    return hashlib.sha256(ast.dump(node).encode()).hexdigest() if node else "-"


@pytest.mark.skipif(os.environ.get("QUANTGATE_WINDOW") != "all", reason="reads every wheel of the window: "
                    "QUANTGATE_WINDOW=all (the differential test reads each span's first and last)")
def test_cited_code_changes_only_where_a_span_starts():
    """Every change of a cited function's code falls on a span's first release, or is listed as one that
    decides the same (and the differential test runs the releases on both sides)."""
    firsts = {s.first for s in format_rules.format_spans("modelopt", "sglang")}
    previous: dict = {}
    for release in window("sglang"):
        whl = _wheel(release)
        for path, names in CITED.items():
            for name in names:
                code = _cited_hash(whl, path, name)
                if name in previous and previous[name] != code:
                    assert release in firsts or (name, release) in SAME_DECISIONS, (name, release)
                previous[name] = code


# the MTP draft each family's sglang main class is served with, and whether it drops the quant config under
# modelopt_fp4 (the rule bf16_drafts lists the main classes whose draft does)
DRAFTS = {"DeepseekV2ForCausalLM": "deepseek_nextn.py", "Glm4MoeForCausalLM": "glm4_moe_nextn.py",
          "Glm5NextForConditionalGeneration": "glm5_next_nextn.py",
          "Qwen3_5MoeForConditionalGeneration": "qwen3_5_mtp.py",
          "Qwen4ExpForConditionalGeneration": "qwen4_exp_mtp.py",
          "ExaoneMoEForCausalLM": "exaone_moe_mtp.py", "LongcatFlashForCausalLM": "longcat_flash_nextn.py",
          "Qwen3NextForCausalLM": "qwen3_next_mtp.py", "Qwen3MoeForCausalLM": "qwen3_moe_mtp.py",
          "MiMoV2FlashForCausalLM": "mimo_v2_nextn.py", "DeepseekV4ForCausalLM": "deepseek_v4_nextn.py",
          "HYV4ForCausalLM": "hunyuan_v4_nextn.py", "Step3p7ForConditionalGeneration": "step3p5_mtp.py"}
# a draft that is another's class (or calls its helper) drops the quant config where that one does
BUILT_BY = {"glm5_next_nextn.py": ("DeepseekV3ForCausalLMNextN", "deepseek_nextn.py"),
            "qwen4_exp_mtp.py": ("_mtp_quant_config", "qwen3_5_mtp.py")}


def _drops_fp4(source: str) -> bool:
    """The draft's constructor sets quant_config None (or returns None) when the config is modelopt_fp4."""
    return any(isinstance(node, ast.If) and '"modelopt_fp4"' in ast.unparse(node.test).replace("'", '"')
               and any(ast.unparse(s) in ("return None", "quant_config = None") for s in node.body)
               for node in ast.walk(ast.parse(source)))


@pytest.mark.parametrize("release", _releases())
def test_bf16_drafts_are_the_drafts_that_drop_the_fp4_config(release):
    """The main classes bf16_drafts lists are those whose MTP draft class drops the modelopt_fp4 config."""
    whl = _wheel(release)
    span = next(s for s in format_rules.format_spans("modelopt", "sglang") if s.covers(release))
    for main, path in DRAFTS.items():
        path = f"sglang/srt/models/{path}"
        if path not in source_files(whl):
            continue  # the release does not build this draft
        text = source(whl, path)
        if base := BUILT_BY.get(path.rsplit("/", 1)[1]):
            assert base[0] in text, (release, path)
            text = source(whl, f"sglang/srt/models/{base[1]}")
        assert _drops_fp4(text) == (main in span.values["bf16_drafts"]), (release, main, path)


NVFP4_FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}


def test_an_fp4_draft_of_a_listed_class_is_built_unquantized():
    """DeepSeek's NextN draft under modelopt_fp4: unquantized whatever the exclude list says; Qwen3-MoE's
    draft keeps the config."""
    deepseek = _rules("0.5.23", "DeepseekV2ForCausalLM")
    found = decide("model.decoder.mlp.experts", moe=True, draft=True, qconfig=NVFP4_FLAT, rules=deepseek)
    assert found.scheme is None and "deepseek_nextn.py: DeepseekModelNextN.__init__" in found.why
    assert decide("model.decoder.mlp.experts", moe=True, draft=False, qconfig=NVFP4_FLAT, rules=deepseek).scheme \
        == "nvfp4"
    qwen = _rules("0.5.23", "Qwen3MoeForCausalLM")
    assert decide("model.layers.48.mlp.experts", moe=True, draft=True, qconfig=NVFP4_FLAT, rules=qwen).scheme == \
        "nvfp4"


def test_per_expert_exclude_entries_do_not_exclude_the_fused_moe():
    """Every expert's projections listed but not the FusedMoE's own name: sglang's is_layer_excluded
    fullmatches the FusedMoE's prefix, so it is built NVFP4 in every release (stored bf16: a finding)."""
    entries = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    qconfig = {"producer": {"name": "modelopt"},
               "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": entries}}
    for span in format_rules.format_spans("modelopt", "sglang"):
        found = decide("model.layers.1.mlp.experts", moe=True, draft=False, qconfig=qconfig, rules=_rules(span.first))
        assert found.scheme == "nvfp4", span.first
        listed = decide("model.layers.1.mlp.experts", moe=True, draft=False, rules=_rules(span.first),
                        qconfig={**qconfig, "quantization": {**qconfig["quantization"],
                                                            "exclude_modules": ["model.layers.1.mlp.experts*"]}})
        assert listed.scheme is None and "is_layer_excluded" in listed.why, span.first


def test_quantized_lm_head_is_taken_from_0_5_15():
    """A NVFP4 lm_head not excluded: built unquantized (ParallelLMHead gets no method) until 0.5.14.x,
    NVFP4 from 0.5.15."""
    qconfig = {**NVFP4_FLAT, "ignore": []}
    assert decide("lm_head", moe=False, draft=False, qconfig=qconfig, rules=_rules("0.5.14")).scheme is None
    assert decide("lm_head", moe=False, draft=False, qconfig=qconfig, rules=_rules("0.5.15")).scheme == "nvfp4"


def test_a_flat_exclude_modules_key_is_read_from_0_5_23():
    """config.json's ModelOpt config naming its exclude list exclude_modules (not ignore): sglang before 0.5.23
    builds every module NVFP4; 0.5.23's FP4 config reads it. The FP8 config reads ignore only."""
    qconfig = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
               "exclude_modules": ["model.layers.0.self_attn*"]}
    module = "model.layers.0.self_attn.qkv_proj"
    assert decide(module, moe=False, draft=False, qconfig=qconfig, rules=_rules("0.5.22")).scheme == "nvfp4"
    assert decide(module, moe=False, draft=False, qconfig=qconfig, rules=_rules("0.5.23")).scheme is None
    fp8 = {**qconfig, "quant_algo": "FP8"}
    assert decide(module, moe=False, draft=False, qconfig=fp8, rules=_rules("0.5.23")).scheme == "fp8"


def test_fp8_variants_per_release():
    """FP8_PER_CHANNEL_PER_TOKEN: built per-tensor FP8 until 0.5.17; from 0.5.18 hf_quant_config.json's is not
    read as a quantization and config.json's (quant_method modelopt) is refused by the FP8 config."""
    nested = {"producer": {"name": "modelopt"},
              "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": []}}
    flat = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": []}
    module = "model.layers.0.mlp.down_proj"
    assert decide(module, moe=False, draft=False, qconfig=nested, rules=_rules("0.5.17")).scheme == "fp8"
    late = decide(module, moe=False, draft=False, qconfig=nested, rules=_rules("0.5.18"))
    assert late.scheme is None and late.raises is None and "no quantization method" in late.why
    refused = decide(module, moe=False, draft=False, qconfig=flat, rules=_rules("0.5.18"))
    assert refused.raises and "ModelOptFp8Config" in refused.raises


def test_nvfp4_in_config_json_is_refused_by_0_5_9():
    """0.5.9 builds config.json's quant_method modelopt with the FP8 config, which refuses NVFP4."""
    found = decide("model.layers.0.mlp.down_proj", moe=False, draft=False, qconfig=NVFP4_FLAT, rules=_rules("0.5.9"))
    assert found.raises and "only supports static FP8" in found.raises
    assert decide("model.layers.0.mlp.down_proj", moe=False, draft=False, qconfig=NVFP4_FLAT,
                  rules=_rules("0.5.10")).scheme == "nvfp4"


MAPPER = {"style": "sglang", "kinds": [], "substr": {"model.layers.61": "model.decoder", "vision": None},
          "prefix": {"model.language_model.": "language_model.model."}, "suffix": None}


@pytest.mark.parametrize("release", _releases())
def test_exclude_list_through_the_class_mapper(release):
    """A class with a weight-name mapper: the exclude list as the release's own apply_weight_name_mapper leaves
    it (its WeightsMapper, models/utils.py) is the list the replay matches."""
    whl = _wheel(release)
    import torch
    mapper_cls = load(whl, "sglang/srt/models/utils.py", ["WeightsMapper"],
                      extra={"torch": torch, "WeightsMapping": dict})["WeightsMapper"]
    fp4_config = _configs(whl)["ModelOptFp4Config"]
    mapper = mapper_cls(orig_to_new_substr=MAPPER["substr"], orig_to_new_prefix=MAPPER["prefix"])
    rng = random.Random(release)
    entries = ["model.layers.61.mlp.experts*", "model.language_model.layers.1.self_attn", "vision_tower*",
               "language_model.lm_head", "model.language_model.layers.2.mlp", "lm_head", "language_model.model.x"]
    for _ in range(40):
        chosen = rng.sample(entries, rng.randint(1, len(entries)))
        qconfig = {"producer": {"name": "modelopt"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(chosen)}}
        config = fp4_config.from_config({**copy.deepcopy(qconfig), "packed_modules_mapping": {}})
        config.apply_weight_name_mapper(mapper)
        rules = RuleSet("sglang", release, release, {**_rules(release).values, "exclude_mapper": MAPPER}, {})
        assert exclude_entries(qconfig, rules) == config.exclude_modules, (release, chosen)


@pytest.mark.parametrize("release", ["0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.13"])
def test_fused_shards_without_the_class_mapping(release):
    """A class that maps no shards: from 0.5.11 sglang still asks qkv_proj's and gate_up_proj's shards
    (_FALLBACK_FUSED_SHARDS), so a list naming some of them raises; 0.5.10 matches the fused name as is (a
    gate_up_proj whose gate and up are both listed is skipped in every release)."""
    qconfig = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16,
        "exclude_modules": ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.gate_proj",
                            "model.layers.1.mlp.up_proj"]}}
    built = own_code(release)
    for module in ("model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"):
        assert ours(release, qconfig, "linear", module, {}) == built(qconfig, "linear", module, {}), module
    late = Version(release) >= Version("0.5.11")
    assert ours(release, qconfig, "linear", "model.layers.1.self_attn.qkv_proj", {}) == ("raises" if late else "nvfp4")
    assert ours(release, qconfig, "linear", "model.layers.1.mlp.gate_up_proj", {}) is None


# --- acceptance: tiny ModelOpt checkpoints checked by the real gate checkpoint, in real processes ---------------

PER_EXPERT = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Qwen3-MoE (read in the whole sglang window) exported by ModelOpt: layer 1's experts kept bf16 and listed
    one by one or by a wildcard; an NVFP4 lm_head; config.json naming its list exclude_modules."""
    root = tmp_path_factory.mktemp("modelopt_sglang")
    return {
        "per_expert": write_third_party(root / "per_expert", "qwen3_moe", modelopt_config(
            "NVFP4", exclude=["lm_head", "*.mlp.gate", *PER_EXPERT]), hf_quant_config_only=True),
        "experts_wildcard": write_third_party(root / "experts_wildcard", "qwen3_moe", modelopt_config(
            "NVFP4", exclude=["lm_head", "*.mlp.gate", "model.layers.1.mlp.experts*"]), hf_quant_config_only=True),
        "lm_head_nvfp4": write_third_party(root / "lm_head_nvfp4", "qwen3_moe", modelopt_config(
            "NVFP4", exclude=["*.mlp.gate"]), hf_quant_config_only=True),
        "flat_exclude_modules": write_third_party(root / "flat_exclude_modules", "qwen3_moe", {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head", "*.mlp.gate", "model.layers.0.self_attn*"]}),
    }


def gate(folder, release: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine",
                           f"sglang=={release}"], capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout


def test_experts_listed_one_by_one_do_not_exclude_the_fused_moe(exports):
    """Layer 1's experts stored bf16 and listed expert by expert: sglang builds the FusedMoE NVFP4 in every
    release (exit 1 naming it and is_layer_excluded's decision); listing model.layers.1.mlp.experts* loads."""
    for release in ("0.5.9", "0.5.23"):
        code, out = gate(exports["per_expert"], release)
        assert code == 1 and "model.layers.1.mlp.experts" in out and "builds this FusedMoE as nvfp4" in out, out
        assert gate(exports["experts_wildcard"], release)[0] == 0


def test_nvfp4_lm_head_needs_0_5_15(exports):
    code, out = gate(exports["lm_head_nvfp4"], "0.5.14")
    assert code == 1 and "lm_head" in out and "ParallelLMHead takes no ModelOpt quant method" in out, out
    assert gate(exports["lm_head_nvfp4"], "0.5.15")[0] == 0


def test_config_json_exclude_modules_needs_0_5_23(exports):
    code, out = gate(exports["flat_exclude_modules"], "0.5.22")
    assert code == 1 and "model.layers.0.self_attn.qkv_proj" in out and "as nvfp4" in out, out
    assert gate(exports["flat_exclude_modules"], "0.5.23")[0] == 0
