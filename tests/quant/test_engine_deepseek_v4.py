"""Differential tests for DeepSeek-V4 (``deepseek_v4``, DeepseekV4ForCausalLM): each release read
(``manifests/families/deepseek_v4/{sglang,vllm}.yaml``) decides with its own code beside
``quant.engines``: the checkpoint's names as the class's own loaders rename them (sglang's
``remap_weight_name_to_dpsk_hf_format``, vLLM's ``hf_to_vllm_mapper`` run by the wheel's
``WeightsMapper``); the exclude list as the class's mapper leaves it (sglang 0.5.22+:
``_QUARK_CKPT_TO_SGLANG_MAPPER``, none in 0.5.21; vLLM: ``get_rename_mapper()``); Quark's
``should_ignore_layer`` and FP8's ``is_layer_skipped`` fed the class's packed-modules mapping read
from the same wheel; the fused modules the loaders stack; which modules are built without quant
config (router, compressors, the indexer's weights_proj, the head); the router bias; the MTP module
the main models drop; sglang's shared-expert fusion decision (the class's own
``shared_experts_fusion_disable_reason``); vLLM's ``expert_dtype`` for FP8 checkpoints.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
import types

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.replay import (
    Module,
    ReplayContext,
    class_name,
    draft_name,
    engine_modules,
    exclude_entries,
)
from quant.engines.rules import releases_read
from quant.layout import family_named
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    load,
    method_def,
    methods,
    packed_mapping,
    parsed,
    source,
)
from tests.quant.test_engine_sources import (
    _fp8_engine,
    _quark_engine,
    engine_wheel,
    fp8_disagreements,
    quark_disagreements,
)

FAMILY = "deepseek_v4"
CLASS = "DeepseekV4ForCausalLM"
MAIN = {"sglang": "sglang/srt/models/deepseek_v4.py", "vllm": "vllm/models/deepseek_v4/nvidia/model.py"}
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
N = 43  # DeepSeek-V4-Flash's num_hidden_layers

# checkpoint modules as the release stores them (layer 1: compressed sparse attention, with indexer)
STORED = ["attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.compressor.wkv",
          "attn.compressor.wgate", "attn.indexer.wq_b", "attn.indexer.weights_proj", "attn.indexer.compressor.wkv",
          "attn.indexer.compressor.wgate", "ffn.gate", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
          "ffn.shared_experts.w3", "ffn.experts.0.w1", "ffn.experts.3.w2", "ffn.experts"]
# the modules each engine builds with the quant config (asked for a decision)
BUILT = {"sglang": ["self_attn.wqkv_a", "self_attn.wq_b", "self_attn.wo_a", "self_attn.wo_b", "self_attn.indexer.wq_b",
                    "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", "mlp.experts"],
         "vllm": ["attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                  "ffn.shared_experts.gate_up_proj", "ffn.shared_experts.down_proj", "ffn.experts"]}
LAYERS = ["layers.0.", "layers.1."]


def _sglang_mapper_class(whl):
    return load(whl, "sglang/srt/models/utils.py", ["WeightsMapper", "WeightsMapping"],
                {"dataclasses": dataclasses})["WeightsMapper"]


def _vllm_mapper(whl):
    """The class's hf_to_vllm_mapper, built by the wheel's _make_deepseek_v4_weights_mapper with the
    wheel's WeightsMapper (the class attribute: expert_dtype fp4)."""
    mapper = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper"],
                  {"WeightRenaming": object, "ShardIds": object, "replace": dataclasses.replace})["WeightsMapper"]
    make = load(whl, MAIN["vllm"], ["_make_deepseek_v4_weights_mapper"], {"WeightsMapper": mapper})
    assert "hf_to_vllm_mapper = _make_deepseek_v4_weights_mapper('fp4')" in ast.unparse(class_def(whl, MAIN["vllm"], CLASS))
    return make["_make_deepseek_v4_weights_mapper"]("fp4")


def exclude_mapper(whl, engine: str, kind: str):
    """What the loader does to the exclude list (Quark) / ignored_layers (FP8) before matching: the
    class's own mapper, where the wheel's class hands one to that quant config."""
    if engine == "vllm":
        rename = _vllm_mapper(whl).get_rename_mapper()  # model_loader/utils.py: configure_quant_config
        return rename.apply_list
    node = class_def(whl, MAIN["sglang"], CLASS)
    if method_def(node, "get_hf_to_sglang_mapper") is None:
        assert class_constant(node, "hf_to_sglang_mapper") is None
        return list
    getter = ast.unparse(method_def(node, "get_hf_to_sglang_mapper"))
    assert "_QUARK_CKPT_TO_SGLANG_MAPPER if _is_quark_checkpoint(config) else None" in getter
    if kind != "quark":
        return list
    ns = load(whl, MAIN["sglang"], ["_QUARK_CKPT_TO_SGLANG_MAPPER"], {"WeightsMapper": _sglang_mapper_class(whl)})
    return ns["_QUARK_CKPT_TO_SGLANG_MAPPER"].apply_list


def wheel_mapping(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds: the class's literal, plus sglang's loader
    additions for Quark."""
    return packed_mapping(whl, MAIN[engine], CLASS, engine, kind)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert wheel_mapping(whl, rules.engine, "quark") == rules["quark_fused"]
    assert wheel_mapping(whl, rules.engine, "fp8") == rules["fp8_skip"]["fused"]


def _loader_name(whl, engine: str):
    """A checkpoint weight name as the class's load path renames it (sglang: the class's own
    remap_weight_name_to_dpsk_hf_format; vLLM: its hf_to_vllm_mapper)."""
    if engine == "vllm":
        return _vllm_mapper(whl).map_name
    holder = methods(whl, MAIN["sglang"], CLASS, ["remap_weight_name_to_dpsk_hf_format"])["cls"]
    remap = holder.__dict__["remap_weight_name_to_dpsk_hf_format"].__func__
    return lambda name: remap(name, num_hidden_layers=N)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_names_are_the_class_loaders(rules, release):
    """Every stored Linear of the release gets the name the class's loader gives its weight (before
    stacking: the fused names come from built_fused)."""
    loader = _loader_name(engine_wheel(rules, release), rules.engine)
    for module in [p + m for p in LAYERS for m in STORED if not m.endswith("experts")] + ["head"]:
        assert class_name(module, rules) + ".weight" == loader(module + ".weight"), module


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_exclude_mapper_is_the_wheels(rules, release):
    """The replay renames an exclude list as the release's loader does before it matches (sglang 0.5.21:
    not at all; 0.5.22+: the Quark mapper; vLLM: the rename part of its mapper, FP8 too), on names in
    the checkpoint's, the engines' and regex forms."""
    whl = engine_wheel(rules, release)
    names = [p + m for p in LAYERS + ["mtp.0.", "model.layers.1."] for m in STORED + BUILT["sglang"] + BUILT["vllm"]]
    names += ["head", "lm_head", "embed", "norm", "hc_head_fn", "re:.*attn.*", "re:.*ffn\\.experts.*", "layers.1",
              "layers.1.ffn.gate.bias", "model.layers.1.attn.w1", "mtp.0.e_proj",
              # several rules of one kind apply (sglang applies the longest only, vLLM each in turn)
              "layers.1.attn.ffn.w1", "layers.1.ffn.attn.w3", "layers.1.ffn.shared_experts.w2.w1"]
    for kind in ("quark", "fp8"):
        theirs = exclude_mapper(whl, rules.engine, kind)(list(names))
        qconfig = {"exclude": list(names)} if kind == "quark" else {"modules_to_not_convert": list(names)}
        ours = exclude_entries(qconfig, rules, kind)
        if kind == "fp8" and rules["fp8_skip"]["model_prefix_variants"]:
            ours = [e for e in ours if e.startswith("model.") or e.removeprefix("model.") != e]  # not compared
            continue
        assert ours == theirs, (kind, [(a, b) for a, b in zip(ours, theirs, strict=False) if a != b][:3])


def _written(rules):
    """The writer lists each entry under every rule set's names too (quant/serving.py: the aliases)."""
    return lambda exclude: exclude + [class_name(e, r) for e in exclude for r in rule_sets(rules.engine, FAMILY)
                                      if class_name(e, r) != e]


@pytest.mark.parametrize("written", [False, True], ids=["as drawn", "as written"])
@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release, written):
    """Random exclude lists, drawn from the checkpoint's names, both engines' names and regexes, decided
    by the wheel's should_ignore_layer after the wheel's mapper and by the replay after its rule."""
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "quark")
    mapper = exclude_mapper(whl, rules.engine, "quark")
    modules = ["model." + p + m for p in LAYERS for m in BUILT[rules.engine]]
    entries = [p + m for p in LAYERS for m in STORED] + ["model." + p + m for p in LAYERS for m in BUILT["sglang"] + BUILT["vllm"]] + \
        ["re:.*shared_experts.*", "re:.*self_attn.*", "re:.*\\.attn\\..*", "re:.*experts.*", "layers.1", "model.layers.1",
         "mtp.0.attn.wq_a", "lm_head"]
    listed = _written(rules) if written else list
    rng = random.Random(f"deepseek_v4{rules.id}{release}{written}")
    disagree, seen = quark_disagreements(
        engine, rules, fused, modules, entries, rng, draws=250, most=20, names=5,
        ours=lambda exclude: exclude_entries({"exclude": listed(exclude)}, rules, "quark"),
        theirs=lambda exclude: mapper(listed(exclude)))
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    """FP8's own from_config and is_layer_skipped on the class's mapping; vLLM's ignored_layers pass its
    mapper first (Fp8Config.apply_vllm_mapper), sglang hands FP8 configs no mapper. The replay's side is
    exclude_entries (its mapper rule included) and match.fp8_skipped."""
    whl = engine_wheel(rules, release)
    decide = _fp8_engine(rules, whl)
    mapper = exclude_mapper(whl, rules.engine, "fp8")
    fused = wheel_mapping(whl, rules.engine, "fp8")
    modules = ["model." + p + m for p in LAYERS for m in BUILT[rules.engine]]
    entries = [p + m for p in LAYERS for m in STORED] + ["model." + p + m for p in LAYERS for m in BUILT[rules.engine]] + \
        ["lm_head", "model.layers.1.attn.wq_a", "model.layers.1.ffn.shared_experts.w1", "model.layers.1.mlp.experts",
         # path prefixes (sglang matches whole dotted components or a prefix path, vLLM exact names)
         "model.layers.1.self_attn", "model.layers.1", "layers.0.mlp.shared_experts", "model.layers.1.attn"]
    rng = random.Random(f"fp8deepseek_v4{rules.id}{release}")
    disagree, seen = fp8_disagreements(decide, rules["fp8_skip"], fused, modules, entries, rng, draws=200, most=14,
                                       names=4, listed_by=lambda q: exclude_entries(q, rules, "fp8"), theirs=mapper)
    assert not disagree, disagree[:3]
    assert seen > 30


def _built_name(rules, module: str, *siblings: str) -> str:
    """The module the engine builds from stored ``module`` (stored beside ``siblings``, the other shards of its
    fused module in its layer, as a release stores them: a shard's fused module is told by the shards beside it)."""
    family = family_named(FAMILY)
    stored = {m: Module(False, (64, 64), family.classify(m + ".weight", N).role) for m in (module, *siblings)}
    built = engine_modules(ReplayContext(rules, stored, {}, FAMILY, N, "quark"))
    return next(name for name, em in built.items() if module in em.members) if siblings else next(iter(built))


def _sglang_stacking(whl) -> dict[str, list[str]]:
    """sglang's stacked modules: DEEPSEEK_V4_STACKED_PARAMS_MAPPING (gate_up_proj), the wq_a/wkv pair
    load_weights fuses into wqkv_a, the compressor's wkv/wgate loaded into wkv_gate."""
    text = source(whl, MAIN["sglang"])
    mapping = load(whl, MAIN["sglang"], ["DEEPSEEK_V4_STACKED_PARAMS_MAPPING"])["DEEPSEEK_V4_STACKED_PARAMS_MAPPING"]
    out: dict[str, list[str]] = {}
    for fused, shard, _ in mapping:
        out.setdefault(fused, []).append(shard)
    load_weights = ast.unparse(method_def(class_def(whl, MAIN["sglang"], CLASS), "load_weights"))
    assert "('.wq_a.' if is_q else '.wkv.', '.wqkv_a.')" in load_weights.replace('"', "'")
    out["wqkv_a"] = ["wq_a", "wkv"]
    assert "COMPRESSOR_PART = '.compressor.w'" in load_weights.replace('"', "'") and ".wkv_gate.weight" in load_weights
    compressor = method_def(class_def(whl, "sglang/srt/layers/attention/dsv4/compressor.py", "Compressor"), "__init__")
    assert attribute_builds(compressor, "wkv_gate")
    out["compressor.wkv_gate"] = ["compressor.wkv", "compressor.wgate"]
    # the wq_a + wkv fusion is the default: SGLANG_OPT_FUSE_WQA_WKV = EnvBool(True)
    assert "SGLANG_OPT_FUSE_WQA_WKV = EnvBool(True)" in source(whl, "sglang/srt/environ.py")
    assert "envs.SGLANG_OPT_FUSE_WQA_WKV.get() if fuse_wqa_wkv is None else fuse_wqa_wkv" in text
    return out


def _vllm_stacking(whl) -> dict[str, list[str]]:
    fn = method_def(class_def(whl, MAIN["vllm"], "DeepseekV4Model"), "load_weights")
    out: dict[str, list[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and all(isinstance(e, ast.Constant) for e in node.elts):
            fused, shard, _ = (e.value for e in node.elts)
            if fused.startswith("attn."):  # attn.fused_wqa_wkv: the attention's own (not the compressor's wkv)
                fused, shard = fused.removeprefix("attn."), shard.removeprefix("attn.")
            out.setdefault(fused, []).append(shard)
    return out


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fused_modules_are_the_loaders_stacking(rules, release):
    """built_fused is what the loader stacks, and the replay puts each stored shard in that module."""
    whl = engine_wheel(rules, release)
    stacked = (_sglang_stacking if rules.engine == "sglang" else _vllm_stacking)(whl)
    assert stacked == rules["built_fused"]
    def stored(shard: str) -> str:
        return "layers.1." + {"gate_proj": "ffn.shared_experts.w1", "up_proj": "ffn.shared_experts.w3",
                              "w1": "ffn.shared_experts.w1", "w3": "ffn.shared_experts.w3"}.get(shard, f"attn.{shard}")

    for fused, shards in stacked.items():
        for shard in shards:
            siblings = [] if "." in shard else [stored(s) for s in shards if s != shard]  # as a layer stores them
            built = _built_name(rules, stored(shard), *siblings)
            assert built.endswith("." + fused.rpartition(".")[2]), (shard, built)
    # the indexer's compressor is fused the same way, the attention's wkv with wq_a
    assert _built_name(rules, "layers.1.attn.indexer.compressor.wgate").endswith(".indexer.compressor." +
                                                                                 ("wkv_gate" if rules.engine == "sglang" else "fused_wkv_wgate"))
    wkv = _built_name(rules, "layers.1.attn.wkv", "layers.1.attn.wq_a")
    assert wkv.endswith("wqkv_a" if rules.engine == "sglang" else "fused_wqa_wkv")


def _quant_config_of(builds) -> set[str]:
    return {b.keywords.get("quant_config", "<none>") for b in builds}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_unquantized_modules_are_built_without_quant_config(rules, release):
    """router, compressors, the indexer's weights_proj and the head: built without the quant config
    (sglang: expert_pack only), as unquantized_roles says; the indexer's wq_b and the attention
    projections with it (governed by the exclude list)."""
    whl = engine_wheel(rules, release)
    assert {"router", "lm_head", "compressor", "indexer_weights"} == set(rules["unquantized_roles"])
    if rules.engine == "sglang":
        d = "sglang/srt/layers/attention/dsv4/"
        indexer = method_def(class_def(whl, d + "indexer.py", "C4Indexer"), "__init__")
        assert _quant_config_of(attribute_builds(indexer, "weights_proj")) == {"expert_pack_quant_config"}
        assert _quant_config_of(attribute_builds(indexer, "wq_b")) == {"quant_config"}
        layer = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "MQALayer"), "__init__"))
        assert "quant_config=expert_pack_quant_config" in layer and \
            "quant_config if quant_config is not None and quant_config.get_name() == 'expert_pack' else None" in layer
        attn = method_def(class_def(whl, MAIN["sglang"], "MqaAttentionBase"), "__init__")
        for leaf in ("wqkv_a", "wq_a", "wkv", "wq_b", "wo_b"):
            assert _quant_config_of(attribute_builds(attn, leaf)) == {"quant_config"}, leaf
        # wo_a: the quant config only for the FP8 wo_a GEMM (Quark: built bf16, and listed in exclude)
        assert _quant_config_of(attribute_builds(attn, "wo_a")) == {"wo_a_quant_config"}
        v2 = "sglang/srt/models/deepseek_v2.py"
        gate = ast.unparse(method_def(class_def(whl, v2, "MoEGate"), "__init__"))
        assert "self.weight = nn.Parameter(" in gate and "LinearBase" not in gate  # no quant method
        lm_head = ast.unparse(method_def(class_def(whl, MAIN["sglang"], CLASS), "__init__"))
        assert "self.lm_head = ParallelLMHead(" in lm_head
    else:
        attn = source(whl, "vllm/models/deepseek_v4/attention.py")
        tree = ast.parse(attn)
        builds = {}
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
            for leaf in ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b", "weights_proj"):
                builds.setdefault(leaf, []).extend(attribute_builds(fn, leaf))
        assert _quant_config_of(builds["weights_proj"]) == {"None"}
        for leaf in ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b"):
            assert _quant_config_of(builds[leaf]) == {"quant_config"}, leaf
        compressor = method_def(class_def(whl, "vllm/models/deepseek_v4/compressor.py", "Compressor"), "__init__") \
            if class_def(whl, "vllm/models/deepseek_v4/compressor.py", "Compressor") else None
        found = [b for n in ast.walk(ast.parse(source(whl, "vllm/models/deepseek_v4/compressor.py")))
                 if isinstance(n, ast.FunctionDef) for b in attribute_builds(n, "fused_wkv_wgate")] if compressor is None \
            else attribute_builds(compressor, "fused_wkv_wgate")
        assert found and _quant_config_of(found) == {"None"}
        moe = method_def(class_def(whl, MAIN["vllm"], "DeepseekV4MoE"), "__init__")
        assert all(b.call == "GateLinear" and "quant_config" not in b.keywords for b in attribute_builds(moe, "gate"))
        head = method_def(class_def(whl, MAIN["vllm"], CLASS), "__init__")
        assert all("quant_config" not in b.keywords for b in attribute_builds(head, "lm_head"))


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_router_bias_only_for_noaux_tc_outside_hash_layers(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["router"] == {"reads": [], "bias_when": "noaux_tc"}
    if rules.engine == "sglang":
        gate = ast.unparse(method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "MoEGate"), "__init__"))
        assert "if config.topk_method == 'noaux_tc' and (not is_hash_moe):" in gate.replace('"', "'")
        moe = ast.unparse(method_def(class_def(whl, "sglang/srt/models/deepseek_v2.py", "DeepseekV2MoE"), "__init__"))
        assert "layer_id < n_hash_layers" in moe and "getattr(config, 'num_hash_layers', 0)" in moe.replace('"', "'")
        # the config class supplies topk_method (read as an attribute: nothing missing to report)
        assert "topk_method: str = 'noaux_tc'" in ast.unparse(class_def(whl, "sglang/srt/configs/deepseek_v4.py",
                                                                          "DeepSeekV4Config")).replace('"', "'")
    else:
        moe = ast.unparse(method_def(class_def(whl, MAIN["vllm"], "DeepseekV4MoE"), "__init__")).replace('"', "'")
        assert "getattr(config, 'topk_method', None) == 'noaux_tc' and (not is_hash_moe" in moe
        assert "is_hash_moe = extract_layer_index(prefix) < num_hash_layers" in moe


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_main_model_drops_the_mtp_module(rules, release):
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        load_weights = ast.unparse(method_def(class_def(whl, MAIN["sglang"], CLASS), "load_weights"))
        assert re.search(r"if name\.startswith\('mtp'\):\s+continue", load_weights.replace('"', "'"))
        assert _loader_name(whl, "sglang")("mtp.0.ffn.experts.0.w1.weight").startswith("mtp.")
        assert rules["eh_proj"] == "plain"  # no e_proj / h_proj in the main model
        assert "e_proj" not in ast.unparse(method_def(class_def(whl, MAIN["sglang"], "DeepseekV4Model"), "__init__"))
    else:
        assert _vllm_mapper(whl).map_name("mtp.0.ffn.experts.0.w1.weight") is None
        # the draft (built only under --speculative-config) gives e_proj / h_proj the quant config
        layer = method_def(class_def(whl, "vllm/models/deepseek_v4/nvidia/mtp.py", "DeepSeekV4MultiTokenPredictorLayer"),
                           "__init__")
        for proj in ("e_proj", "h_proj"):
            assert _quant_config_of(attribute_builds(layer, proj)) == {"quant_config"}
        assert rules["eh_proj"] == "quant_config"
    for module in ("mtp.0.attn.wq_a", "mtp.0.ffn.experts.0.w1", "mtp.0.e_proj", "mtp.0.ffn.shared_experts.w2"):
        assert draft_name(module, rules, N) is None
    assert draft_name("layers.42.attn.wq_a", rules, N) is not None


def _fusion_reason(whl, enforce: bool, ep: int, blocks: bool):
    holder = methods(whl, MAIN["sglang"], CLASS, ["shared_experts_fusion_disable_reason"])["cls"]
    fn = holder.__dict__["shared_experts_fusion_disable_reason"].__func__
    fn.__globals__.update(
        quant_blocks_shared_experts_fusion=lambda qc: blocks,
        get_parallel=lambda: types.SimpleNamespace(moe_ep_size=ep),
        uses_per_rank_fused_shared_slots=lambda: False,
        get_exec=lambda: types.SimpleNamespace(moe=types.SimpleNamespace(enforce_shared_experts_fusion=enforce)))
    return fn(holder, types.SimpleNamespace(n_shared_experts=1), types.SimpleNamespace(get_name=lambda: "quark"))


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_shared_expert_fusion_only_when_enforced(rules, release):
    """The class's own decision: never on the default setup (whatever the platform, EP or quant
    config), so the rule is null; --enforce-shared-experts-fusion is the only way in."""
    whl = engine_wheel(rules, release)
    assert rules["shared_experts_fusion"] is None
    for ep in (1, 8):
        for blocks in (False, True):
            assert _fusion_reason(whl, False, ep, blocks) is not None
    assert _fusion_reason(whl, True, 1, False) is None


def test_vllm_fp8_experts_need_expert_dtype_fp8():
    """quant_method fp8 on a deepseek_v4 config becomes DeepseekV4FP8Config, whose routed experts are
    Mxfp4MoEMethod unless config.expert_dtype is fp8: the family writes it beside FP8 configs."""
    rules, release = next(c for c in CASES if c[0].engine == "vllm")
    whl = engine_wheel(rules, release)
    path = "vllm/models/deepseek_v4/quant_config.py"
    holder = methods(whl, path, "DeepseekV4FP8Config", ["override_quantization_method"])["cls"]
    override = holder.__dict__["override_quantization_method"].__func__
    v4 = types.SimpleNamespace(model_type="deepseek_v4")
    assert override(holder, {"quant_method": "fp8"}, None, v4) == "deepseek_v4_fp8"
    assert override(holder, {"quant_method": "quark"}, None, v4) is None  # Quark: QuarkConfig
    text = ast.unparse(class_def(whl, path, "DeepseekV4FP8Config")).replace('"', "'")
    assert "expert_dtype = getattr(hf_config, 'expert_dtype', 'fp4')" in text
    assert "if self.expert_dtype == 'fp4':" in text and "return Mxfp4MoEMethod(" in text
    assert "fp8" in load(whl, path, ["_DEEPSEEK_V4_EXPERT_DTYPES"])["_DEEPSEEK_V4_EXPERT_DTYPES"]
    assert dict(dict(family_named(FAMILY).config_keys)["fp8"]) == {"expert_dtype": "fp8"}


def test_every_required_release_is_read_and_has_one_rule_set():
    for engine, required in {"sglang": ["0.5.21", "0.5.22", "0.5.23"], "vllm": ["0.33.0"]}.items():
        read = releases_read(engine, FAMILY)
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert sum(r.covers(read[release]) for r in rule_sets(engine, FAMILY)) == 1


AMD = "vllm/models/deepseek_v4/amd/model.py"  # vLLM's ROCm class (models/deepseek_v4/__init__.py: is_rocm())


def test_vllm_rocm_class_loads_as_the_rules_say():
    """The ROCm class renames the exclude list as the CUDA one (configure_quant_config reads the class
    attribute hf_to_vllm_mapper, built by amd/model.py's own _make_deepseek_v4_weights_mapper("fp4")),
    stacks the same shards, builds the router, head and attention alike (DeepseekV4ROCMAiterMLAAttention
    subclasses attention.py's DeepseekV4Attention) and drops mtp.*; its packed_modules_mapping lacks
    fused_wkv_wgate, which names only the compressor's module, built without quant config; its
    shared-expert fusion is opt-in (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS, default off)."""
    rules, release = next(c for c in CASES if c[0].engine == "vllm")
    whl = engine_wheel(rules, release)
    mapper = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper"],
                  {"WeightRenaming": object, "ShardIds": object, "replace": dataclasses.replace})["WeightsMapper"]
    make = load(whl, AMD, ["_make_deepseek_v4_weights_mapper"], {"WeightsMapper": mapper})
    assert "hf_to_vllm_mapper = _make_deepseek_v4_weights_mapper('fp4')" in ast.unparse(class_def(whl, AMD, CLASS))
    rename = make["_make_deepseek_v4_weights_mapper"]("fp4").get_rename_mapper().apply_list
    names = [p + m for p in LAYERS + ["mtp.0.", "model.layers.1."] for m in STORED + BUILT["vllm"]] + \
        ["head", "lm_head", "embed", "norm", "re:.*attn.*", "layers.1.ffn.gate.bias", "layers.1.ffn.shared_experts.w2.w1"]
    for kind in ("quark", "fp8"):
        qconfig = {"exclude": list(names)} if kind == "quark" else {"modules_to_not_convert": list(names)}
        assert exclude_entries(qconfig, rules, kind) == rename(list(names)), kind
    node = class_def(whl, AMD, CLASS)
    mapping = class_constant(node, "packed_modules_mapping")
    assert mapping == {k: v for k, v in rules["quark_fused"].items() if k != "fused_wkv_wgate"}
    compressor = method_def(class_def(whl, "vllm/models/deepseek_v4/compressor.py", "DeepseekCompressor"), "__init__")
    assert [b.keywords.get("quant_config") for b in attribute_builds(compressor, "fused_wkv_wgate")] == ["None"]
    assert "compressor" in rules["unquantized_roles"]
    rocm = class_def(whl, "vllm/models/deepseek_v4/amd/rocm.py", "DeepseekV4ROCMAiterMLAAttention")
    assert [ast.unparse(b) for b in rocm.bases] == ["DeepseekV4Attention"]
    assert "super().__init__(*args, **kwargs)" in ast.unparse(method_def(rocm, "__init__"))
    layer = method_def(class_def(whl, AMD, "DeepseekV4DecoderLayer"), "__init__")
    assert attribute_builds(layer, "attn")[0].call == "DeepseekV4ROCMAiterMLAAttention"
    moe = method_def(class_def(whl, AMD, "DeepseekV4MoE"), "__init__")
    gate = attribute_builds(moe, "gate")
    assert gate and all(b.call == "GateLinear" and "quant_config" not in b.keywords for b in gate)
    fse = next(n for n in ast.parse(source(whl, AMD)).body
               if isinstance(n, ast.FunctionDef) and n.name == "_fuse_shared_experts_enabled")
    assert "envs.VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS and (not parallel_config.enable_expert_parallel)" in \
        ast.unparse(fse)
    assert rules["shared_experts_fusion"] is None  # off by default: not replayed
    amd_stack = [n for n in ast.walk(method_def(class_def(whl, AMD, "DeepseekV4Model"), "load_weights"))
                 if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "stacked_params_mapping"]
    cuda_stack = [n for n in ast.walk(method_def(class_def(whl, MAIN["vllm"], "DeepseekV4Model"), "load_weights"))
                  if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "stacked_params_mapping"]
    assert ast.unparse(amd_stack[0].value) == ast.unparse(cuda_stack[0].value)


def _sglang_wo_a_quant_config(whl, quant_config):
    """What sglang's own MqaAttentionBase.__init__ hands wo_a as its quant config on the default
    environment (not NPU): the wheel's wo_a_fp8_gemm_enabled, run with _FP8_WO_A_GEMM at environ.py's
    default, then the constructor's own statements from ``fp8 = ...`` to the ``wo_a_keeps_quant_config`` choice."""
    env = source(whl, "sglang/srt/environ.py")
    default = re.search(r"SGLANG_OPT_FP8_WO_A_GEMM = EnvBool\((True|False)\)", env)
    assert default, "SGLANG_OPT_FP8_WO_A_GEMM not found in environ.py"

    class Fp8Config:  # what wo_a_fp8_gemm_enabled reads of the config: its class and weight_block_size
        def __init__(self, weight_block_size):
            self.weight_block_size = weight_block_size

        def get_name(self):
            return "fp8"

    ns = load(whl, MAIN["sglang"], ["wo_a_fp8_gemm_enabled"],
              {"_FP8_WO_A_GEMM": default.group(1) == "True", "Fp8Config": Fp8Config, "QuantizationConfig": object})
    init = method_def(class_def(whl, MAIN["sglang"], "MqaAttentionBase"), "__init__")
    body = init.body
    start = next(i for i, s in enumerate(body) if isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "fp8")
    end = next(i for i, s in enumerate(body) if isinstance(s, ast.If) and "wo_a_keeps_quant_config" in ast.unparse(s.test))
    wanted = [s for s in body[start:end + 1] if not (isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "reduce_results")]
    local = {**ns, "quant_config": None, "wo_a_fp8": None, "wo_a_keeps_quant_config": None,
             "use_npu_arch35_mxfp8_wo_a": lambda qc: False, "self": types.SimpleNamespace()}
    if quant_config is not None:
        kind, block = quant_config
        local["quant_config"] = Fp8Config(block) if kind == "fp8" else types.SimpleNamespace(get_name=lambda: kind)
    exec(compile(ast.fix_missing_locations(ast.Module(body=wanted, type_ignores=[])), "MqaAttentionBase", "exec"),
         local)  # noqa: S102 (the engine's own code)
    return local["wo_a_quant_config"], local["quantize_wo_a"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_sglang_builds_wo_a_quantized_under_block_fp8(rules, release):
    """sglang builds DeepSeek-V4's wo_a with the FP8 config whatever modules_to_not_convert says
    under 128x128 block FP8 (its FP8 wo_a GEMM, SGLANG_OPT_FP8_WO_A_GEMM on by default), and bf16
    (no quant config) whatever the exclude list says for other FP8 layouts and Quark: the wheel's own
    constructor statements decide beside built_quantized and unquantized_leaves; the class asserts the quantized weight_scale_inv and load_weights raises
    for a wo_a not stored float8_e4m3fn."""
    whl = engine_wheel(rules, release)
    modules = {f"layers.1.attn.{leaf}": Module(True, (8, 8), "attention") for leaf in ("wo_a", "wo_b")}
    for config, qconfig in ((("fp8", [128, 128]), {"weight_block_size": [128, 128]}), (("fp8", [64, 64]), {"weight_block_size": [64, 64]}),
                            (("fp8", None), {}), (("quark", None), {})):
        built, quantize = _sglang_wo_a_quant_config(whl, config)
        kind = config[0]
        mine = engine_modules(ReplayContext(rules, modules, qconfig, FAMILY, N, kind))
        assert (built is not None) == quantize, config
        assert mine["model.layers.1.self_attn.wo_a"].build == ("quantized" if quantize else "bf16"), config
        assert mine["model.layers.1.self_attn.wo_b"].build == "governed"
    init = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "MqaAttentionBase"), "__init__"))
    assert re.search(r"if quantize_wo_a:\s+assert hasattr\(self\.wo_a, 'weight_scale_inv'\)", init)
    load_weights = ast.unparse(method_def(class_def(whl, MAIN["sglang"], CLASS), "load_weights"))
    assert "self.wo_a_fp8 and name.endswith('.wo_a.weight') and (loaded_weight.dtype != torch.float8_e4m3fn)" in load_weights
    # an exclude entry for wo_a makes Fp8Config's quant method unquantized (no weight_scale_inv)
    get = ast.unparse(method_def(class_def(whl, "sglang/srt/layers/quantization/fp8.py", "Fp8Config"), "get_quant_method"))
    assert re.search(r"if isinstance\(layer, LinearBase\):\s+if is_layer_skipped\(prefix, self\.ignored_layers, "
                     r"fused_mapping=self\.packed_modules_mapping\):\s+return UnquantizedLinearMethod\(\)", get)


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_sglang_wo_a_findings_under_block_fp8(rules, release):
    """The replay's findings for wo_a under block FP8: an FP8 wo_a loads; a bf16 one fails listed or not
    (load_weights' ValueError); an FP8 one listed in modules_to_not_convert fails the class's
    weight_scale_inv assertion; per-tensor FP8 and Quark build it bf16, listed or not (a quantized one
    meets a bf16 parameter)."""
    from quant.engines.replay import replay

    def findings(wo_a_fp8: bool, listed: list[str], block=(128, 128)):
        modules = {"layers.1.attn.wo_a": Module(wo_a_fp8, (8, 8), "attention"),
                   "layers.1.attn.wo_b": Module(True, (8, 8), "attention")}
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": listed,
                   **({"weight_block_size": list(block)} if block else {})}
        return [f for f in replay(ReplayContext(rules, modules, qconfig, FAMILY, N, "fp8", "FP8"))
                if f.check == "engine"]

    entry = ["model.layers.1.self_attn.wo_a"]
    assert findings(True, []) == []
    for listed in ([], entry):
        (found,) = findings(False, listed)
        assert found.module == "model.layers.1.self_attn.wo_a" and "SGLANG_OPT_FP8_WO_A_GEMM" in found.why, found
    (found,) = findings(True, entry)
    assert "weight_scale_inv" in found.why and found.fix.startswith("remove the modules_to_not_convert entries"), found
    assert findings(False, entry, block=None) == findings(False, [], block=None) == []  # built bf16
    (found,) = findings(True, [], block=None)
    assert "builds wo_a unquantized (attention)" in found.why, found
    modules = {"layers.1.attn.wo_a": Module(True, (8, 8), "attention")}
    quark = {"quant_method": "quark", "exclude": []}
    ctx = ReplayContext(rules, modules, quark, FAMILY, N, "quark", "MXFP4")
    (found,) = [f for f in replay(ctx) if f.check == "engine"]
    assert found.module == "model.layers.1.self_attn.wo_a" and "unquantized (attention)" in found.why, found


@pytest.fixture(scope="module")
def default_mxfp4_exclude(tmp_path_factory):
    """quantgate's default MXFP4 conversion of the tiny DeepSeek-V4: its exclude list and num_hidden_layers."""
    import json

    from quant.cli import main as quantize
    from tests.quant.family_checkpoints import write_family_checkpoint

    root = tmp_path_factory.mktemp("deepseek_v4_draft")
    src = write_family_checkpoint(root / "bf16", "deepseek_v4")
    assert quantize(["--to", "mxfp4", "-q", str(src), str(root / "mxfp4")]) == 0
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    return config["quantization_config"]["exclude"], config["num_hidden_layers"]


def _sglang_draft_entries(whl, exclude):
    """The exclude list as sglang's DeepSeek-V4 draft (deepseek_v4_nextn.py DeepseekV4ForCausalLMNextN) is
    built with: its get_hf_to_sglang_mapper (0.5.22+: the main class's _QUARK_CKPT_TO_SGLANG_MAPPER | the
    prefixes mtp.0.e_proj -> model.e_proj, mtp.0.h_proj -> model.h_proj, mtp.0. -> model.decoder.), none in 0.5.21."""
    node = class_def(whl, "sglang/srt/models/deepseek_v4_nextn.py", "DeepseekV4ForCausalLMNextN")
    getter = method_def(node, "get_hf_to_sglang_mapper")
    if getter is None:
        return list(exclude)
    text = ast.unparse(getter)
    prefixes = {"mtp.0.e_proj": "model.e_proj", "mtp.0.h_proj": "model.h_proj", "mtp.0.": "model.decoder."}
    assert "return mapper | WeightsMapper(orig_to_new_prefix=" in text and all(
        f"'{k}': '{v}'" in text for k, v in prefixes.items()), text
    mapper = _sglang_mapper_class(whl)
    ns = load(whl, MAIN["sglang"], ["_QUARK_CKPT_TO_SGLANG_MAPPER"], {"WeightsMapper": mapper})
    return (ns["_QUARK_CKPT_TO_SGLANG_MAPPER"] | mapper(orig_to_new_prefix=prefixes)).apply_list(exclude)


DRAFT_CASES = [(r, v, p) for r, v in CASES for p in (("cuda", "rocm") if r.engine == "vllm" else ("",))]


def _vllm_rocm_draft_entries(whl, entries, n):
    """amd/mtp.py DeepSeekV4MTP.__init__ runs align_mtp_quant_config (quant_config.py), which re-keys the
    main-mapped model.mtp.{i}. entries onto model.layers.{num_hidden_layers + i}.: the wheel's function and
    WeightsMapper, on a quant config whose apply_vllm_mapper applies the mapper to the list (QuarkConfig's)."""
    init = ast.unparse(method_def(class_def(whl, "vllm/models/deepseek_v4/amd/mtp.py", "DeepSeekV4MTP"), "__init__"))
    assert "align_mtp_quant_config(self.quant_config, self.config)" in init
    mapper = load(whl, "vllm/model_executor/models/utils.py", ["WeightsMapper"],
                  {"WeightRenaming": object, "ShardIds": object, "replace": dataclasses.replace})["WeightsMapper"]
    ns = load(whl, "vllm/models/deepseek_v4/quant_config.py", ["align_mtp_quant_config"],
              {"QuantizationConfig": object, "PreTrainedConfig": object})
    holder = types.SimpleNamespace(entries=list(entries))
    holder.apply_vllm_mapper = lambda m: setattr(holder, "entries", m.apply_list(holder.entries))
    from tests.quant.engine_sources import served_modules

    with served_modules({"vllm.model_executor.models.utils": {"WeightsMapper": mapper}}):
        ns["align_mtp_quant_config"](holder, types.SimpleNamespace(num_hidden_layers=n, num_nextn_predict_layers=1))
    return holder.entries


@pytest.mark.parametrize(("rules", "release", "platform"), DRAFT_CASES,
                         ids=[f"{r.engine} {v} {p}".strip() for r, v, p in DRAFT_CASES])
def test_default_mxfp4_draft_exclude_coverage(rules, release, platform, default_mxfp4_exclude):
    """The MTP draft (built only under speculative decoding) of quantgate's default MXFP4 output: its
    attention, shared expert and e_proj / h_proj are stored bf16; does the exclude list, as each release
    hands it to the draft, name them? Decided by the wheels' own mappers and should_ignore_layer.
    sglang's draft names them model.decoder.* / model.e_proj (deepseek_v4.py load_weights(is_nextn=True):
    mtp.0.X -> model.layers.N.X -> model.decoder.X); vLLM's DeepSeekV4MTP builds them under prefix
    model.layers.{num_hidden_layers}.* (nvidia/mtp.py DeepSeekV4MultiTokenPredictor: f'{prefix}.layers.{idx}',
    idx from num_hidden_layers) with no hf_to_vllm_mapper of its own, sharing the main model's quant config
    (spec_decode/llm_base_proposer.py _create_draft_vllm_config: dataclasses.replace of the target's
    VllmConfig), whose exclude list the main class's mapper renamed (mtp.0. -> model.mtp.0.); on ROCm
    (amd/mtp.py) align_mtp_quant_config re-keys model.mtp.0. onto model.layers.{N}., on CUDA (nvidia/mtp.py)
    nothing does. With checkpoint names alone (mtp.0.*) sglang 0.5.21 and vLLM on CUDA built the draft's
    bf16 modules MXFP4; the converter now also writes the names each draft asks for (rule
    draft_module_names), as it does for GLM-5's model.decoder.*."""
    exclude, n = default_mxfp4_exclude
    whl = engine_wheel(rules, release)
    key = f"{rules.engine} {release} {platform}".strip()
    if rules.engine == "sglang":
        nextn = "sglang/srt/models/deepseek_v4_nextn.py"
        model = ast.unparse(method_def(class_def(whl, nextn, "DeepseekV4ModelNextN"), "__init__"))
        assert "prefix = add_prefix('decoder', prefix)" in model and "prefix=add_prefix('e_proj', prefix)" in model
        assert "add_prefix('model', prefix)" in ast.unparse(method_def(class_def(whl, nextn, "DeepseekV4ForCausalLMNextN"), "__init__"))
        entries = _sglang_draft_entries(whl, exclude)
        bf16 = ["model.decoder.self_attn.wqkv_a", "model.decoder.self_attn.wq_b", "model.decoder.self_attn.wo_b",
                "model.decoder.mlp.shared_experts.gate_up_proj", "model.decoder.mlp.shared_experts.down_proj",
                "model.e_proj", "model.h_proj"]
        experts = "model.decoder.mlp.experts"
    else:
        mtp = source(whl, f"vllm/models/deepseek_v4/{'amd' if platform == 'rocm' else 'nvidia'}/mtp.py")
        assert "hf_to_vllm_mapper" not in mtp and "f'{prefix}.layers.{idx}'" in ast.unparse(ast.parse(mtp))
        assert ("align_mtp_quant_config" in mtp) == (platform == "rocm")
        proposer = ast.unparse(method_def(class_def(whl, "vllm/v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer")
                                          or next(n for n in ast.walk(parsed(whl, "vllm/v1/spec_decode/llm_base_proposer.py"))
                                                  if isinstance(n, ast.ClassDef) and method_def(n, "_create_draft_vllm_config")),
                                          "_create_draft_vllm_config"))
        assert "base = self.vllm_config" in proposer and "quant_config" not in proposer  # the target's quant config
        entries = exclude_mapper(whl, "vllm", "quark")(exclude)
        if platform == "rocm":
            entries = _vllm_rocm_draft_entries(whl, entries, n)
        bf16 = [f"model.layers.{n}.{leaf}" for leaf in ("attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b",
                                                         "ffn.shared_experts.gate_up_proj",
                                                         "ffn.shared_experts.down_proj", "e_proj", "h_proj")]
        experts = f"model.layers.{n}.ffn.experts"
    decide = _quark_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "quark")
    assert not decide(experts, entries, fused, True)  # the draft's routed experts: MXFP4, as stored
    missing = [name for name in bf16 if not decide(name, entries, fused, False)]
    assert missing == [], f"{key}: the draft builds these MXFP4, stored bf16: {missing}"
