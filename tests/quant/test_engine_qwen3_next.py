"""Differential tests for Qwen3-Next (``qwen3_next``, Qwen3NextForCausalLM and its drafts
Qwen3NextForCausalLMMTP / Qwen3NextMTP): each release read (``manifests/families/qwen3_next/{sglang,vllm}.yaml``)
decides with its own functions beside ``quant.engines`` on the checkpoint's module names (Gated
DeltaNet and full-attention layers, the singular shared expert and its gate, the mtp.* draft under
each engine's names): Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` fed the class's
packed-modules mapping read from the same wheel, sglang's shared-expert fusion decision
(qwen2_moe.py ``can_fuse_shared_expert`` with QuarkConfig's own ``can_fuse_shared_expert``), the
draft renaming of sglang's ``load_weights``, and the layer kinds each engine computes (sglang's
``layers_block_type``; transformers' Qwen3NextConfig, which vLLM reads). How modules are built is read
from the constructors. Without the wheels the tests skip, saying why.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
import types

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets, select
from quant.engines.config import engine_layer_kinds
from quant.engines.fusion import no_fusion_reason
from quant.engines.replay import draft_name, is_draft
from quant.engines.rules import UnknownEngine, releases_read
from quant.engines.serving import serving
from tests.quant.engine_sources import (
    attribute_builds,
    class_def,
    config_reads,
    load,
    method_def,
    methods,
    packed_mapping,
    parsed,
    source,
)
from tests.quant.test_engine_sources import (
    GPUS,
    _draft_config_arch,
    engine_wheel,
    fp8_disagreements,
    _fp8_engine,
    quark_disagreements,
    _quark_engine,
    _stubs,
)

FAMILY = "qwen3_next"
MAIN = {"sglang": "sglang/srt/models/qwen3_next.py", "vllm": "vllm/model_executor/models/qwen3_next.py"}
DRAFT = {"sglang": "sglang/srt/models/qwen3_next_mtp.py", "vllm": "vllm/model_executor/models/qwen3_next_mtp.py"}
QWEN2_MOE = "sglang/srt/models/qwen2_moe.py"
QUARK = "sglang/srt/layers/quantization/quark/quark.py"
GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
SGLANG_IDS = [f"sglang {v}" for _, v in SGLANG]
L = 48  # Qwen3-Next-80B-A3B's num_hidden_layers


def class_mapping(whl, engine: str, cls: str, kind: str, path: str | None = None) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds: the class's literal (vLLM: handed over by
    model_loader/utils.py configure_quant_config), plus, in sglang with quark, the loader's
    additions, which update the class's dict in place before __init__ assigns it to the quant config."""
    return packed_mapping(whl, path or MAIN[engine], cls, engine, kind)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert class_mapping(whl, rules.engine, "Qwen3NextForCausalLM", "quark") == rules["quark_fused"]
    assert class_mapping(whl, rules.engine, "Qwen3NextForCausalLM", "fp8") == rules["fp8_skip"]["fused"]
    if rules.engine == "sglang":  # __init__ hands the (loader-updated) class dict to the quant config
        init = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3NextForCausalLM"), "__init__"))
        assert "quant_config.packed_modules_mapping = self.packed_modules_mapping" in init
    else:  # the draft's mapping is the main one's, less the identity entries of the GDN projections
        draft = class_mapping(whl, "vllm", "Qwen3NextMTP", "quark", DRAFT["vllm"])
        assert draft == {k: v for k, v in rules["quark_fused"].items() if [k] != v}


# Module names the generator draws from: a linear-attention layer, a full-attention layer, the draft
# under both engines' names (sglang model.layers.0.*, vLLM mtp.layers.0.*), and the draft's fc.
LAYERS = ["model.layers.0.", "model.layers.3.", "mtp.layers.0."]
LEAVES = ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.qkv_proj",
          "self_attn.o_proj", "mlp.experts", "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"]
SHARDS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.shared_expert.gate_proj",
          "mlp.shared_expert.up_proj", "mlp.experts.0.gate_proj", "mlp.experts.1.down_proj", "mlp.shared_expert_gate",
          "mlp.gate"]


def _pool():
    modules = [p + m for p in LAYERS for m in LEAVES] + ["mtp.fc"]
    entries = [p + m for p in LAYERS for m in LEAVES + SHARDS] + ["mtp.fc", "fc", "lm_head", "re:.*shared_expert\\..*",
                                                                 "re:.*linear_attn.*", "re:mtp\\..*", "re:.*experts.*"]
    return modules, entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = class_mapping(whl, rules.engine, "Qwen3NextForCausalLM", "quark")
    modules, entries = _pool()
    rng = random.Random(f"qwen3next{rules.id}{release}")
    disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=20,
                                          names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _fp8_engine(rules, whl)
    fused = class_mapping(whl, rules.engine, "Qwen3NextForCausalLM", "fp8")
    modules, entries = _pool()
    entries = [e for e in entries if not e.startswith("re:")]
    entries += [e.removeprefix("model.") for e in entries if e.startswith("model.")][:12]
    rng = random.Random(f"qwen3next-fp8{rules.id}{release}")
    disagree, seen = fp8_disagreements(engine, rules["fp8_skip"], fused, modules, entries, rng, draws=200, most=16,
                                       names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


# --- sglang's draft: the checkpoint's mtp.* renamed as load_weights renames it ----------------------

def _sglang_draft_renamer(whl):
    """The ``if is_mtp:`` block of Qwen3NextForCausalLM.load_weights, run as the wheel writes it
    (its ``continue``: the weight is not loaded)."""
    load_weights = method_def(class_def(whl, MAIN["sglang"], "Qwen3NextForCausalLM"), "load_weights")
    loop = next(n for n in ast.walk(load_weights) if isinstance(n, ast.For))
    block = next(s for s in loop.body if isinstance(s, ast.If) and ast.unparse(s.test) == "is_mtp")
    code = "def rename(name, is_mtp=True):\n    for _ in [0]:\n" + textwrap.indent(ast.unparse(block), " " * 8) + \
        "\n        return name\n    return None\n"
    namespace: dict = {}
    exec(compile(code, f"{whl.name}/{MAIN['sglang']}", "exec"), namespace)  # noqa: S102 (the engine's own code)
    return namespace["rename"]


DRAFT_MODULES = ["mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.o_proj",
                 "mtp.layers.0.mlp.experts.3.up_proj", "mtp.layers.0.mlp.shared_expert.down_proj",
                 "mtp.layers.0.mlp.shared_expert_gate", "mtp.layers.0.mlp.gate"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_sglang_draft_names_are_load_weights(rules, release):
    """The draft's weights get load_weights' names (mtp.fc -> fc, mtp.* -> model.*), and the draft's
    modules are built under those prefixes: Qwen3NextModel(prefix='model') of one full-attention
    layer beside a plain nn.Linear fc; the main model drops every mtp name."""
    whl = engine_wheel(rules, release)
    rename = _sglang_draft_renamer(whl)
    for module in DRAFT_MODULES:
        assert is_draft(module, rules, L)
        assert rename(module + ".weight") == draft_name(module, rules, L) + ".weight", module
    assert rename("model.layers.0.mlp.gate.weight") is None  # the draft loads only mtp names
    assert draft_name("model.layers.0.mlp.gate", rules, L) == "model.layers.0.mlp.gate"  # the main model's stay
    init = method_def(class_def(whl, DRAFT["sglang"], "Qwen3NextForCausalLMMTP"), "__init__")
    text = ast.unparse(init)
    assert "Qwen3NextModel(mtp_config, quant_config, prefix=add_prefix('model', prefix), is_nextn=True)" in text
    assert "mtp_config.num_hidden_layers = 1" in text and "mtp_config.full_attention_interval = 1" in text
    assert rules["mtp_naming"]["max_layers"] == 1
    assert [b.call for b in attribute_builds(init, "fc")] == ["nn.Linear"] and rules["eh_proj"] == "plain"
    assert "hf_to_sglang_mapper" not in source(whl, DRAFT["sglang"]) and rules["draft_exclude"][FAMILY] == "none"
    assert _draft_config_arch(whl, "Qwen3NextForCausalLM") == "Qwen3NextForCausalLMMTP"
    main_load = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3NextForCausalLM"), "load_weights"))
    assert re.search(r"if not is_mtp and 'mtp' in name:\s+continue", main_load)


@pytest.mark.parametrize(("rules", "release"), [c for c in CASES if c[0].engine == "vllm"], ids=["vllm"])
def test_vllm_draft_is_built_under_the_checkpoints_names(rules, release):
    """vLLM's draft Qwen3NextMTP builds Qwen3NextMultiTokenPredictor under 'mtp' (fc and layers.{idx}
    under it, fc with the quant config), so quant lookups see mtp.* as written; config/speculative.py
    makes a qwen3_next draft Qwen3NextMTP."""
    whl = engine_wheel(rules, release)
    init = method_def(class_def(whl, DRAFT["vllm"], "Qwen3NextMTP"), "__init__")
    assert attribute_builds(init, "model")[0].keywords["prefix"] == "maybe_prefix(prefix, 'mtp')"
    predictor = method_def(class_def(whl, DRAFT["vllm"], "Qwen3NextMultiTokenPredictor"), "__init__")
    fc = attribute_builds(predictor, "fc")
    assert fc[0].keywords["prefix"] == "f'{prefix}.fc'" and fc[0].keywords["quant_config"] == "fc_quant"
    assert "fc_quant = None if quant_config and quant_config.get_name() == 'modelopt_fp4' else quant_config" in \
        ast.unparse(predictor) and rules["eh_proj"] == "any_quant_config"
    assert "prefix=f'{prefix}.layers.{idx}'" in ast.unparse(predictor)
    assert "getattr(config, 'num_nextn_predict_layers', 1)" in ast.unparse(predictor)
    assert rules["mtp_naming"]["max_layers"] is None
    for module in DRAFT_MODULES:
        assert is_draft(module, rules, L) and draft_name(module, rules, L) == module
    assert "hf_to_vllm_mapper" not in ast.unparse(class_def(whl, DRAFT["vllm"], "Qwen3NextMTP"))
    assert rules["draft_exclude"][FAMILY] == "none"
    spec = source(whl, "vllm/config/speculative.py")
    assert "hf_config.model_type = 'qwen3_next_mtp'" in spec.replace('"', "'") and "'architectures': ['Qwen3NextMTP']" in \
        spec.replace('"', "'")


def test_a_draft_quantized_otherwise_than_main_layer_0_is_refused():
    """sglang's draft modules are main layer 0's names: one exclude list cannot keep the draft's
    experts bf16 and quantize layer 0's (the writer refuses, naming both)."""
    from quant.layout import family_named
    from quant.serving import NamingError, build_exclude

    family = family_named(FAMILY)
    main = {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    draft = {m.replace("model.layers.0.", "mtp.layers.0.") for m in main}
    with pytest.raises(NamingError, match="mtp.layers.0.mlp.experts.0.* model.layers.0.mlp.experts.0"):
        build_exclude(draft, main, L, family)
    exclude = build_exclude(draft | main, set(), L, family)  # all kept: both names listed
    assert {"mtp.layers.0.mlp.experts", "model.layers.0.mlp.experts"} <= set(exclude)


# --- sglang's shared-expert fusion: qwen2_moe.py's can_fuse_shared_expert ----------------------------

def _fusion_engine(whl):
    """(config, exclude, kind, serving) -> whether Qwen2MoeSparseMoeBlock fuses the shared expert,
    decided by the wheel's get_num_shared_experts, can_fuse_shared_expert and QuarkConfig's hook."""
    # get_num_shared_experts is a function from 0.5.14; before, the block counts inline as it does
    named = [n for n in ("get_num_shared_experts", "can_fuse_shared_expert") if f"def {n}(" in source(whl, QWEN2_MOE)]
    moe = load(whl, QWEN2_MOE, named, {"PretrainedConfig": object, "QuantizationConfig": object})
    consts = load(whl, QUARK, [n for n in ("_MOE_SHARED_EXPERT_QUANT_LAYER0_BASES", "_SHARED_EXPERT_BODY_PROJ_SUFFIXES",
                                           "_MOE_SHARED_EXPERT_QUANT_DRAFT_BASES") if n in source(whl, QUARK)])
    hooks = [n for n in ("can_fuse_shared_expert", "shared_expert_excluded_from_quant", "_is_draft_layer",
                         "shared_expert_online_mxfp4_supported", "_warn_online_mxfp4_unavailable")
             if f"def {n}(" in source(whl, QUARK)]
    quark = methods(whl, QUARK, "QuarkConfig", hooks)
    block = ast.unparse(method_def(class_def(whl, QWEN2_MOE, "Qwen2MoeSparseMoeBlock"), "__init__"))
    assert "_use_aiter" in block and "support_shared_expert_fusion" in block
    assert "can_fuse_shared_expert(config, quant_config)" in block
    inline = lambda hf: getattr(hf, "n_shared_experts", None) if hasattr(hf, "n_shared_experts") else \
        int(getattr(hf, "shared_expert_intermediate_size", 0) > 0)  # noqa: E731  the block's own count, <= 0.5.13
    count = moe.get("get_num_shared_experts", inline)

    def decide(config, exclude, kind, setup) -> bool:
        stubs = _stubs(whl, setup, None)
        stubs["get_moe_a2a_backend"]().is_deepep_v2 = stubs["get_moe_a2a_backend"]().is_deepep
        moe.update(stubs)
        hf = types.SimpleNamespace(**config)
        if kind == "quark":
            qc = object.__new__(quark["cls"])
            qc.exclude_layers, qc.quant_config = list(exclude), {"exclude": list(exclude), "layer_quant_config": {}}
            qc.num_hidden_layers, qc.num_nextn_predict_layers = config["num_hidden_layers"], 0
            quark["ns"].update(consts, **stubs, is_hip=lambda: setup.platform == "rocm")
        else:
            qc = types.SimpleNamespace(get_name=lambda: kind)  # Fp8Config: no can_fuse_shared_expert
        # qwen3_next.py passes support/enable_cuda True; on ROCm, _use_aiter (SGLANG_USE_AITER=1, assumed)
        platform_ok = setup.platform == "cuda" or setup.platform == "rocm"
        return platform_ok and count(hf) > 0 and moe["can_fuse_shared_expert"](hf, qc)
    return decide


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_shared_expert_fusion_decisions_are_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    for decoder in ("Qwen3HybridLinearDecoderLayer", "Qwen3HybridAttentionDecoderLayer"):
        init = ast.unparse(method_def(class_def(whl, MAIN["sglang"], decoder), "__init__"))
        assert "support_shared_expert_fusion=True" in init and "enable_cuda_shared_expert_fusion=True" in init
    engine = _fusion_engine(whl)
    pool = ["model.layers.1.mlp.shared_expert.gate_proj", "model.layers.3.mlp.shared_expert.down_proj",
            "model.layers.1.mlp.shared_expert_gate", "mtp.layers.0.mlp.shared_expert.up_proj",
            "re:.*shared_expert\\..*", "model.layers.3.mlp.experts", "lm_head", "model.layers.0.linear_attn.out_proj"]
    rng = random.Random(f"qwen3next-fusion{release}")
    disagree, fused = [], 0
    for _ in range(200):
        config = {"num_hidden_layers": L, "moe_intermediate_size": 512,
                  "shared_expert_intermediate_size": rng.choice([512, 512, 256, 0]),
                  **({"n_shared_experts": rng.choice([0, 1])} if rng.random() < 0.2 else {})}
        exclude = rng.sample(pool, rng.randint(0, 3))
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 8]), disable_shared_experts_fusion=rng.random() < 0.15)
        theirs = engine(config, exclude, kind, setup)
        ours = no_fusion_reason(rules, FAMILY, config, kind, exclude, setup, False) is None
        fused += theirs
        if theirs != ours:
            disagree.append((config, exclude, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert 20 < fused < 180


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_fusion_config_reads_are_the_functions(rules, release):
    """The config keys the decision consults (``config_reads``) are those get_num_shared_experts and
    can_fuse_shared_expert read of the config, as the wheel writes them."""
    whl = engine_wheel(rules, release)
    tree = parsed(whl, QWEN2_MOE)
    assert config_reads(tree, ("get_num_shared_experts", "can_fuse_shared_expert")) == \
        set(rules["shared_experts_fusion"]["config_reads"])
    load_weights = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3NextForCausalLM"), "load_weights"))
    slot = rules["shared_experts_fusion"]
    assert f"'mlp.{slot['shared']}.', f'mlp.experts.{{self.config.{slot['experts_key']}}}.'" in load_weights


# --- Which layers are linear attention: each engine's computation --------------------------------------

@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_layer_kinds_are_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    rng = random.Random(f"qwen3next-kinds{release}")
    if rules.engine == "sglang":
        ns = methods(whl, "sglang/srt/configs/qwen3_next.py", "Qwen3NextConfig", ["layers_block_type"])
        ns["ns"]["HybridLayerType"] = load(whl, "sglang/srt/configs/qwen3_next.py", ["HybridLayerType"],
                                           {"enum": __import__("enum")})["HybridLayerType"]
        theirs = lambda cfg: ns["cls"].__dict__["layers_block_type"].fget(types.SimpleNamespace(**cfg))
        get_layer = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3NextModel"), "__init__"))
        assert "ALL_DECODER_LAYER_TYPES[config.layers_block_type[idx]]" in get_layer
    else:
        from transformers import Qwen3NextConfig

        theirs = lambda cfg: Qwen3NextConfig(**cfg).layer_types  # the config vLLM reads
        model = ast.unparse(method_def(class_def(whl, MAIN["vllm"], "Qwen3NextModel"), "__init__"))
        assert "layer_type=config.layer_types[extract_layer_index(prefix)]" in model
    checked = 0
    for _ in range(40):
        n = rng.randint(1, 12)
        cfg = {"num_hidden_layers": n, "full_attention_interval": rng.randint(1, 5)}
        if rng.random() < 0.4:
            cfg["layer_types"] = [rng.choice(["linear_attention", "full_attention"]) for _ in range(n)]
        if rng.random() < 0.2:
            cfg.pop("full_attention_interval")
        ours, _ = engine_layer_kinds(rules, cfg, n)
        try:
            expected = list(theirs(cfg))
        except AttributeError:  # sglang: no full_attention_interval in config.json
            expected = None
        assert ours == expected, cfg
        checked += expected is not None
    assert checked > 20


# --- How modules are built, read from the classes -------------------------------------------------------

@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_construction_is_the_engine_classes(rules, release):
    """The router and the shared-expert gate are built without quant config, the conv1d kernel too;
    the attention's q/k/v and the shared expert's gate/up are fused Linears; every layer is MoE in
    sglang, by mlp_only_layers / decoder_sparse_step in vLLM."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        block = method_def(class_def(whl, QWEN2_MOE, "Qwen2MoeSparseMoeBlock"), "__init__")
        gates = attribute_builds(block, "gate")
        shared_gate = attribute_builds(block, "shared_expert_gate")
        assert all(b.keywords.get("quant_config") == "None" for b in gates + shared_gate if b.call == "ReplicatedLinear")
        assert {b.call for b in shared_gate} == {"ReplicatedLinear", "torch.nn.Linear"}
        gdn = method_def(class_def(whl, MAIN["sglang"], "Qwen3GatedDeltaNet"), "__init__")
        assert attribute_builds(gdn, "conv1d")[0].keywords["quant_config"] == "None"
        for decoder in ("Qwen3HybridLinearDecoderLayer", "Qwen3HybridAttentionDecoderLayer"):
            assert "self.is_layer_sparse = True" in ast.unparse(method_def(class_def(whl, MAIN["sglang"], decoder),
                                                                           "__init__"))
        assert rules["moe_layers"] == "all"
        attn = method_def(class_def(whl, MAIN["sglang"], "Qwen3HybridAttentionDecoderLayer"), "__init__")
        qkv = attribute_builds(attn, "qkv_proj")
        mlp = attribute_builds(method_def(class_def(whl, QWEN2_MOE, "Qwen2MoeMLP"), "__init__"), "gate_up_proj")
    else:
        block = method_def(class_def(whl, MAIN["vllm"], "Qwen3NextSparseMoeBlock"), "__init__")
        gates = attribute_builds(block, "gate")
        assert gates and all(b.call == "GateLinear" and "quant_config" not in b.keywords for b in gates)
        assert attribute_builds(block, "shared_expert_gate")[0].keywords["quant_config"] == "None"
        gdn = source(whl, GDN)
        conv = gdn[gdn.index("self.conv1d = ColumnParallelLinear("):][:300]
        assert "quant_config" not in conv.split(")", 1)[0]
        layer = ast.unparse(method_def(class_def(whl, MAIN["vllm"], "Qwen3NextDecoderLayer"), "__init__"))
        assert "mlp_only_layers" in layer and "decoder_sparse_step" in layer and rules["moe_layers"] == "config"
        head = ast.unparse(method_def(class_def(whl, MAIN["vllm"], "Qwen3NextForCausalLM"), "__init__"))
        assert "quant_config" not in head[head.index("self.lm_head = "):].split(")", 1)[0]
        qkv = attribute_builds(method_def(class_def(whl, MAIN["vllm"], "Qwen3NextAttention"), "__init__"), "qkv_proj")
        # the MLP class is qwen2_moe.py's Qwen2MoeMLP (imported as Qwen3NextMLP)
        assert "from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP as Qwen3NextMLP" in source(whl, MAIN["vllm"])
        mlp = attribute_builds(method_def(class_def(whl, "vllm/model_executor/models/qwen2_moe.py", "Qwen2MoeMLP"),
                                          "__init__"), "gate_up_proj")
    assert {"router", "shared_expert_gate"} <= set(rules["unquantized_roles"])
    assert qkv[0].call == "QKVParallelLinear" and mlp[0].call == "MergedColumnParallelLinear"
    assert rules["built_fused"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert rules["router"]["bias_when"] == "never" and "e_score_correction_bias" not in ast.unparse(block)


def test_every_required_release_is_read_and_one_not_read_is_refused():
    for engine, required in {"sglang": ["0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"],
                             "vllm": ["0.33.0"]}.items():
        read = releases_read(engine, FAMILY)
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert len(select(f"{engine}=={release}", FAMILY)) == 1
    with pytest.raises(UnknownEngine, match="sglang 0.5.16 has not been read for family qwen3_next.*0.5.17, 0.5.18"):
        select("sglang==0.5.16", FAMILY)
