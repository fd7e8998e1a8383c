"""Differential tests for the model classes beyond DeepSeek-V2's (GLM-4.5 ``glm4_moe`` ...): for each
release read for a family's class (``manifests/families/<family>/<engine>.yaml``), that release's own
functions decide beside ``quant.engines`` on generated cases: Quark's ``should_ignore_layer`` fed the
class's packed-modules mapping read from the same wheel (not the YAML under test), FP8's
``is_layer_skipped`` + ``Fp8Config.from_config``, and sglang's shared-expert fusion decision (the
class's ``shared_experts_fusion_disable_reason`` with the loader's switch, hardware queries stubbed).
How modules are built (router, eh_proj, fused modules, MTP naming, the draft class) is read from the
classes' constructors and loaders. The wheels come from the registry (``tests/quant/engine_sources.py``);
without it the tests skip, saying why.
"""

from __future__ import annotations

import ast
import random
import re
import types

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.fusion import no_fusion_reason
from quant.engines.rules import releases_read
from quant.engines.serving import serving
from quant.layout import family_named
from tests.quant.engine_sources import (attribute_builds, class_constant, class_def, method_def, methods, parsed,
                                        sglang_quark_loader_additions, source, source_files)
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

CASES = 150

# Where each engine defines a family's classes (main model, its MTP draft), as the wheels hold them.
SOURCES = {
    "glm4_moe": {
        "sglang": {"main": "sglang/srt/models/glm4_moe.py", "draft": "sglang/srt/models/glm4_moe_nextn.py"},
        "vllm": {"main": "vllm/model_executor/models/glm4_moe.py", "draft": "vllm/model_executor/models/glm4_moe_mtp.py"},
    },
    "qwen3_moe": {
        # the MLP class is qwen2_moe.py's Qwen2MoeMLP (imported as Qwen3MoeMLP)
        "sglang": {"main": "sglang/srt/models/qwen3_moe.py", "draft": "sglang/srt/models/qwen3_moe_mtp.py",
                   "mlp": "sglang/srt/models/qwen2_moe.py", "layers": "sglang/srt/models/qwen2_moe.py"},
        "vllm": {"main": "vllm/model_executor/models/qwen3_moe.py", "draft": None},
    },
    "mixtral": {
        "sglang": {"main": "sglang/srt/models/mixtral.py", "draft": None},
        "vllm": {"main": "vllm/model_executor/models/mixtral.py", "draft": None},
    },
    "minimax_m2": {
        "sglang": {"main": "sglang/srt/models/minimax_m2.py", "draft": None},
        "vllm": {"main": "vllm/model_executor/models/minimax_m2.py", "draft": None},
    },
}
# Module names each family's pool uses for the routed experts and the router (block_sparse_moe), and
# the classes holding them: (MoE block, decoder layer)
MOE = {"mixtral": "block_sparse_moe", "minimax_m2": "block_sparse_moe"}
BLOCKS = {"mixtral": ("MixtralMoE", "MixtralDecoderLayer"), "minimax_m2": ("MiniMaxM2MoE", "MiniMaxM2DecoderLayer")}
FAMILIES = sorted(SOURCES)


def _cases() -> list[tuple]:
    out = []
    for family in FAMILIES:
        for engine in ENGINES:
            for rules in rule_sets(engine, family):
                read = releases_read(engine, family)
                out += [(family, rules, v) for v in sorted(read, key=Version) if rules.covers(read[v])]
    return out


CASES_ALL = _cases()
SGLANG = [c for c in CASES_ALL if c[1].engine == "sglang"]
FUSING = [c for c in SGLANG if c[1].values.get("shared_experts_fusion")]


def _ids(cases) -> list[str]:
    return [f"{family}-{rules.engine} {release}" for family, rules, release in cases]


def _classes(family: str, engine: str, rules) -> tuple[str, str | None]:
    """(the main class, the draft class or None) the rule file was read for."""
    from quant.engines.rules import rule_file, rules_file

    classes = rule_file(rules_file(engine, family)).model_classes
    assert classes[0] == family_named(family).engine_class[engine] == rules.model_class
    return classes[0], (classes[1] if len(classes) > 1 else None)


def class_mapping(whl, engine: str, path: str, cls: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config gets: the class's literal, plus, in sglang with
    quark, the loader's additions (model_loader/loader.py: _get_quantization_config)."""
    mapping = dict(class_constant(class_def(whl, path, cls), "packed_modules_mapping") or {})
    if engine == "sglang" and kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    return {k: list(v) for k, v in mapping.items()}


def _pool(family: str, rules, num_layers: int = 3):
    """Engine module names and exclude entries the generator draws from (GQA attention, dense and MoE
    MLPs, shared experts, the draft's names in both engines' styles, the class's own prefix, regexes
    and prefixes)."""
    layers = ["model.layers.0.", "model.layers.1.", f"model.layers.{num_layers}.", "layers.1."] + \
        (["model.decoder."] if rules.engine == "sglang" else [])
    moe = MOE.get(family, "mlp")
    modules, entries = [], ["lm_head", "model.decoder", "mlp.gate", "re:.*shared_experts.*", "re:.*experts.*",
                            "re:model\\.layers\\.1\\..*", "re:.*gate_up_proj", "re:.*(q_proj|k_proj)", "self_attn",
                            "experts", "model.layers.1", "re:.*qkv_proj"]
    for p in layers:
        modules += [p + m for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                                    "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", f"{moe}.experts",
                                    f"{moe}.gate")]
        entries += [p + m for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj",
                                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj",
                                    "mlp.down_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                    "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj", f"{moe}.experts",
                                    f"{moe}.experts.0.gate_proj", f"{moe}.experts.1.down_proj", f"{moe}.experts.0.w1",
                                    f"{moe}.gate")]
    return modules, entries


@pytest.mark.parametrize(("family", "rules", "release"), CASES_ALL, ids=_ids(CASES_ALL))
def test_packed_mapping_is_the_wheels(family, rules, release):
    whl = engine_wheel(rules, release)
    main, _ = _classes(family, rules.engine, rules)
    path = SOURCES[family][rules.engine]["main"]
    assert class_mapping(whl, rules.engine, path, main, "quark") == rules["quark_fused"]
    fp8 = rules["fp8_skip"]
    assert class_mapping(whl, rules.engine, path, main, "fp8") == fp8["fused"]


@pytest.mark.parametrize(("family", "rules", "release"), CASES_ALL, ids=_ids(CASES_ALL))
def test_quark_exclude_decisions_equal_the_engines(family, rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    main, _ = _classes(family, rules.engine, rules)
    fused = class_mapping(whl, rules.engine, SOURCES[family][rules.engine]["main"], main, "quark")
    modules, entries = _pool(family, rules)
    rng = random.Random(f"{family}{rules.id}{release}")
    disagree, excluded_seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=CASES, most=14,
                                          names=4)
    assert not disagree, disagree[:3]
    assert excluded_seen > 20  # the cases reach both answers


@pytest.mark.parametrize(("family", "rules", "release"), CASES_ALL, ids=_ids(CASES_ALL))
def test_fp8_skip_decisions_equal_the_engines(family, rules, release):
    whl = engine_wheel(rules, release)
    engine = _fp8_engine(rules, whl)
    main, _ = _classes(family, rules.engine, rules)
    fused = class_mapping(whl, rules.engine, SOURCES[family][rules.engine]["main"], main, "fp8")
    modules, entries = _pool(family, rules)
    entries = [e for e in entries if not e.startswith("re:")] + [e.removeprefix("model.") for e in entries[12:30]]
    rng = random.Random(f"fp8{family}{rules.id}{release}")
    skip = rules["fp8_skip"]
    disagree, _ = fp8_disagreements(engine, skip, fused, modules, entries, rng, draws=CASES, most=14, names=4)
    assert not disagree, disagree[:3]


# --- Shared-expert fusion (sglang), decided by the class's own function -------------------------

def _fusion_engine(whl, family: str, path: str, cls: str):
    """(config, kind, serving) -> whether the release fuses this class's shared expert."""
    names = ["shared_experts_fusion_disable_reason", "num_fusable_shared_experts", "determine_num_fused_shared_experts"]
    holder = methods(whl, path, cls, names)["cls"]
    gate = holder.__dict__["shared_experts_fusion_disable_reason"].__func__
    count = holder.__dict__.get("num_fusable_shared_experts")

    def decide(config, kind, setup) -> bool:
        gate.__globals__.update(_stubs(whl, setup, None))
        hf = types.SimpleNamespace(**config)
        qc = types.SimpleNamespace(get_name=lambda: kind)
        disabled = setup.disable_shared_experts_fusion or gate(holder, hf, qc) is not None
        if count is not None:  # 0.5.23: resolve_shared_experts_config
            return not disabled and count.__func__(holder, hf) > 0
        # 0.5.21/0.5.22: install_shared_experts_fusion_decision, then determine_num_fused_shared_experts
        fn = holder.__dict__["determine_num_fused_shared_experts"]
        fn.__globals__.update(is_shared_experts_fusion_disabled=lambda: disabled)
        model = types.SimpleNamespace(config=hf)
        fn(model)
        return bool(model.num_fused_shared_experts)
    return decide


@pytest.mark.parametrize(("family", "rules", "release"), SGLANG, ids=_ids(SGLANG))
def test_a_class_without_fusion_rules_has_no_fusion_hook(family, rules, release):
    """No shared_experts_fusion rule: the class defines no shared_experts_fusion_disable_reason, so
    the loader fuses nothing (layers/moe/utils.py: a class without the hook follows no fusion)."""
    main, _ = _classes(family, "sglang", rules)
    node = class_def(engine_wheel(rules, release), SOURCES[family]["sglang"]["main"], main)
    assert (method_def(node, "shared_experts_fusion_disable_reason") is not None) == \
        bool(rules.values.get("shared_experts_fusion"))


@pytest.mark.parametrize("draft", [False, True], ids=["main", "draft"])
@pytest.mark.parametrize(("family", "rules", "release"), FUSING, ids=_ids(FUSING))
def test_shared_expert_fusion_decisions_are_the_engines(family, rules, release, draft):
    whl = engine_wheel(rules, release)
    main, draft_cls = _classes(family, "sglang", rules)
    if draft:  # the draft class decides with what it inherits: it must not override the decision
        node = class_def(whl, SOURCES[family]["sglang"]["draft"], draft_cls)
        assert method_def(node, "shared_experts_fusion_disable_reason") is None
    engine = _fusion_engine(whl, family, SOURCES[family]["sglang"]["main"], main)
    rng = random.Random(f"fusion{family}{release}{draft}")
    disagree, fused = [], 0
    for _ in range(CASES):
        config = {"num_hidden_layers": 46, "n_routed_experts": rng.choice([128, 160, 256, 4]),
                  "n_shared_experts": rng.choice([1, 1, 1, 2, None, 0]), "num_nextn_predict_layers": 1,
                  "architectures": [main]}
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 1, 8]),
                        disable_shared_experts_fusion=rng.random() < 0.15)
        exclude = rng.sample(["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.46.mlp.experts",
                              "re:.*shared_experts.*", "lm_head"], rng.randint(0, 3))
        theirs = engine(config, kind, setup)
        ours = no_fusion_reason(rules, family, config, kind, exclude, setup, draft) is None
        fused += theirs
        if theirs != ours:
            disagree.append((config, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert 0 < fused < CASES


# --- How modules are built and named, read from the classes --------------------------------------

def _unconditional(fn: ast.FunctionDef, attr_target: str) -> bool:
    """Whether ``<attr_target> = ...`` is assigned at the top level of ``fn`` (under no ``if``)."""
    return any(isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == attr_target for s in fn.body)


def _glm4_moe_construction(whl, rules, where) -> dict:
    if rules.engine == "sglang":
        gate = method_def(class_def(whl, where["main"], "Glm4MoeGate"), "__init__")
        eh = attribute_builds(method_def(class_def(whl, where["draft"], "Glm4MoeModelNextN"), "__init__"), "eh_proj")
        draft_text = source(whl, where["draft"])
        return {"router_plain": all(b.call == "nn.Parameter" for b in attribute_builds(gate, "weight")),
                "bias_always": _unconditional(gate, "self.e_score_correction_bias"), "eh": eh,
                "remaps": "hf_to_sglang_mapper" in draft_text or "_resolve_nextn_quant_config" in draft_text}
    moe = method_def(class_def(whl, where["main"], "Glm4MoE"), "__init__")
    gates = attribute_builds(moe, "gate")
    eh = attribute_builds(method_def(class_def(whl, where["draft"], "Glm4MoeMultiTokenPredictorLayer"), "__init__"),
                          "eh_proj")
    return {"router_plain": bool(gates) and all(b.call == "GateLinear" and "quant_config" not in b.keywords
                                                for b in gates),
            "bias_always": _unconditional(moe, "self.gate.e_score_correction_bias"), "eh": eh,
            "remaps": "hf_to_vllm_mapper" in source(whl, where["draft"])}


def _qwen3_moe_construction(whl, rules, where) -> dict:
    block = method_def(class_def(whl, where["main"], "Qwen3MoeSparseMoeBlock"), "__init__")
    gates = attribute_builds(block, "gate")
    text = ast.unparse(block)
    if rules.engine == "sglang":
        # quant_config=None (<= 0.5.16), or gate_quant_config = quant_config only for modelslim, else None
        modelslim_only = "get_name() == 'modelslim' else None" in text.replace('"', "'")
        plain = bool(gates) and all(b.keywords.get("quant_config") == "None" or
                                    (b.keywords.get("quant_config") == "gate_quant_config" and modelslim_only)
                                    for b in gates)
        has_draft = where["draft"] in source_files(whl)  # no draft class before 0.5.13: nothing built, nothing mapped
        eh = attribute_builds(method_def(class_def(whl, where["draft"], "Qwen3MoeForCausalLMMTP"), "__init__"),
                              "fc") if has_draft else []
        remaps = has_draft and "hf_to_sglang_mapper" in source(whl, where["draft"])
    else:
        plain = not (gates and all(b.keywords.get("quant_config") == "quant_config" for b in gates))
        eh, remaps = [], "get_rename_mapper" in source(whl, where["main"])
    layer = ast.unparse(method_def(class_def(whl, where["main"], "Qwen3MoeDecoderLayer"), "__init__"))
    stage = class_def(whl, where["main"], "Qwen3MoeDecoderLayer")
    all_sparse = "is_layer_sparse = True" in ast.unparse(stage) and "mlp_only_layers" not in ast.unparse(stage)
    return {"router_plain": plain, "bias_always": False, "bias_never": "e_score_correction_bias" not in text,
            "eh": eh, "remaps": remaps, "moe_layers": "all" if all_sparse else
            "config" if "mlp_only_layers" in layer and "decoder_sparse_step" in layer else "unknown"}


def _block_sparse_moe_construction(whl, rules, where, family) -> dict:
    """Mixtral and MiniMax-M2: the router built without quant config, the bias (MiniMax: only with
    use_routing_bias), the prefix the MoE block is built under, and the MTP modules skipped."""
    moe_cls, layer_cls = BLOCKS[family]
    main = family_named(family).engine_class[rules.engine]
    block = method_def(class_def(whl, where["main"], moe_cls), "__init__")
    gates = attribute_builds(block, "gate")
    head = ast.unparse(method_def(class_def(whl, where["main"], main), "__init__"))
    if rules.engine == "sglang":
        plain = bool(gates) and all(b.keywords.get("quant_config") == "None" for b in gates)
        lm_head = head[head.index("self.lm_head = "):][:200]
        assert "quant_config" not in lm_head or "quant_config=None" in lm_head  # lm_head built without it
    else:  # GateLinear without quant_config, or (<= 0.30.0) ReplicatedLinear(quant_config=None)
        plain = bool(gates) and all(b.keywords.get("quant_config", "None") == "None" for b in gates)
    biases = attribute_builds(block, "e_score_correction_bias")
    layer = method_def(class_def(whl, where["main"], layer_cls), "__init__")
    moe_prefix = attribute_builds(layer, "block_sparse_moe")[0].keywords["prefix"]
    text = source(whl, where["main"])
    return {"router_plain": plain, "bias_always": False, "bias_never": not biases,
            "bias_under": sorted({u for b in biases for u in b.under}), "eh": [], "remaps": False,
            "moe_prefix": moe_prefix, "reads_scoring_func": "scoring_func=config.scoring_func" in ast.unparse(block),
            "skips_mtp": "def get_spec_layer_idx_from_weight_name" in text and "num_mtp_modules" in text
            if rules.engine == "sglang" or "def get_spec_layer_idx_from_weight_name" in text  # vLLM <= 0.24.0
            else 'skip_prefixes = [f"layers.{base + i}." for i in range(num_mtp)]' in text  # 0.25.0 .. 0.28.0
            or 'orig_to_new_prefix={f"layers.{base + i}.": None for i in range(num_mtp)}' in text}


CONSTRUCTION = {"glm4_moe": _glm4_moe_construction, "qwen3_moe": _qwen3_moe_construction,
                "mixtral": lambda *a: _block_sparse_moe_construction(*a, "mixtral"),
                "minimax_m2": lambda *a: _block_sparse_moe_construction(*a, "minimax_m2")}


@pytest.mark.parametrize(("family", "rules", "release"), CASES_ALL, ids=_ids(CASES_ALL))
def test_module_construction_is_the_engine_classes(family, rules, release):
    whl = engine_wheel(rules, release)
    where = SOURCES[family][rules.engine]
    # fused modules: built as one Linear from these shards
    built_as = {name: re.search(rf"self\.{name} = \(?\s*{call}\(", source(whl, where.get(part, where["main"])))
                for name, call, part in (("qkv_proj", "QKVParallelLinear", "main"),
                                         ("gate_up_proj", "MergedColumnParallelLinear", "mlp"))}
    assert {name for name, found in built_as.items() if found} == set(rules["built_fused"])
    # the prefix the decoder layers are built under: make_layers(..., prefix="layers") drops "model."
    tree = parsed(whl, where.get("layers", where["main"]))
    prefixes = {k.value for call in ast.walk(tree) if isinstance(call, ast.Call)
                and ast.unparse(call.func) in ("make_layers", "make_pp_layers") for k in call.keywords if k.arg == "prefix"}
    literal = {p.value for p in prefixes if isinstance(p, ast.Constant)}
    assert prefixes and literal <= {"layers"}
    prefix_renames = {k: v for k, v in (rules.values.get("module_names") or {}).items() if k.startswith("^")}
    assert prefix_renames == ({"^model.layers.": "layers."} if literal else {})
    built = CONSTRUCTION[family](whl, rules, where)
    assert built["router_plain"] == ("router" in rules["unquantized_roles"])
    assert (rules["router"]["bias_when"] == "always") == built["bias_always"]
    assert (rules["router"]["bias_when"] == "never") == built.get("bias_never", False)
    assert rules["eh_proj"] == ("plain" if all(b.call == "nn.Linear" for b in built["eh"]) else "quant_config")
    assert rules["draft_exclude"][family] == ("none" if not built["remaps"] else "remapped")
    assert rules.values.get("moe_layers", "config") == built.get("moe_layers", "config")
    if "moe_prefix" in built:  # block_sparse_moe built under f"{prefix}.mlp" (vLLM MiniMax-M2) or its own name
        renamed = built["moe_prefix"] in ("f'{prefix}.mlp'", "add_prefix('mlp', prefix)")
        assert renamed or built["moe_prefix"] in ("add_prefix('block_sparse_moe', prefix)", "f'{prefix}.block_sparse_moe'")
        assert (".block_sparse_moe." in (rules.values.get("module_names") or {})) == renamed
        # the bias: none, or only under getattr(config, 'use_routing_bias', False)
        assert rules["router"]["bias_when"] == ("config:use_routing_bias" if built["bias_under"] == ["self.use_routing_bias"]
                                                else "never")
        assert ("scoring_func" in rules["router"]["reads"]) == built["reads_scoring_func"]
        assert (rules["mtp_naming"]["style"] == "dropped") == built["skips_mtp"]


@pytest.mark.parametrize(("family", "rules", "release"), CASES_ALL, ids=_ids(CASES_ALL))
def test_draft_class_and_names_are_the_engines(family, rules, release):
    whl = engine_wheel(rules, release)
    main, draft = _classes(family, rules.engine, rules)
    naming = rules["mtp_naming"]
    if draft is None and rules.engine == "sglang" and family in ("mixtral", "minimax_m2"):  # no draft class
        # no draft class: configs/model_config.py rewrites no draft of it, and no layer is renamed as a draft
        assert _draft_config_arch(whl, main) == main and naming["style"] in ("original", "dropped")
        assert "is_nextn" not in source(whl, SOURCES[family]["sglang"]["main"])
        return
    if draft is None and family in ("mixtral", "minimax_m2"):
        registry = source(whl, "vllm/model_executor/models/registry.py")
        assert f'"{main}MTP"' not in registry and naming["style"] in ("original", "dropped")
        return
    if family == "qwen3_moe":  # no draft layer in the releases: names stay; sglang's draft class reads mtp.*
        assert naming["style"] == "original" and naming["max_layers"] is None
        if rules.engine == "sglang" and SOURCES[family]["sglang"]["draft"] not in source_files(whl):
            # before the draft class existed (<= 0.5.12): no draft is made of the class, names stay as written
            assert _draft_config_arch(whl, main) == main and rules["draft_exclude"][family] == "none"
        elif rules.engine == "sglang":
            assert _draft_config_arch(whl, main) == draft
            load = ast.unparse(method_def(class_def(whl, SOURCES[family]["sglang"]["main"], main), "load_weights"))
            assert re.search(r"elif 'mtp' in name:\s+continue", load)  # the main model drops mtp.* names
        else:
            assert f"{main}MTP" not in source(whl, "vllm/model_executor/models/registry.py") and draft is None
        return
    if rules.engine == "sglang":
        assert _draft_config_arch(whl, main) == draft  # configs/model_config.py rewrites the draft's class
        text = source(whl, SOURCES[family]["sglang"]["draft"])
        assert f"class {draft}({main})" in text and "is_nextn=True" in text  # the main class's loader, as nextn
        load = ast.unparse(method_def(class_def(whl, SOURCES[family]["sglang"]["main"], main), "load_weights"))
        spec = load[load.index("nextn_spec_weight_names = ["):]
        spec = ast.literal_eval(spec[len("nextn_spec_weight_names = "):spec.index("]") + 1])
        assert naming["style"] == "decoder" and sorted(spec) == sorted(naming["top_level"])
        for skipped in naming["skipped"]:
            assert f"'{skipped}' in name" in load
        assert "name.replace(nextn_layer_prefix, 'model.decoder')" in load
        assert (naming["max_layers"] == 1) == ("Only 1 nextn layer is supported" in load)
    else:
        registry = source(whl, "vllm/model_executor/models/registry.py")
        assert f'("glm4_moe_mtp", "{draft}")' in registry and '"glm4_moe_mtp"' in source(whl, "vllm/config/speculative.py")
        path = SOURCES[family]["vllm"]["draft"]
        layer = method_def(class_def(whl, path, "Glm4MoeMultiTokenPredictorLayer"), "__init__")
        block = attribute_builds(layer, "mtp_block")
        # the decoder is built under the layer's own prefix model.layers.{N}: quant lookups see the checkpoint names
        assert block and block[0].keywords.get("prefix") == "prefix" and naming["style"] == "original"
        assert "self.mtp_start_layer_idx = config.num_hidden_layers" in source(whl, path)
        assert naming["max_layers"] is None and "Only 1 nextn layer" not in source(whl, path)


# The releases users serve today, which every new family's rules must cover: each one read and covered by one rule set.
REQUIRED = {"sglang": ["0.5.21", "0.5.22", "0.5.23"], "vllm": ["0.33.0"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_required_release_is_read_and_has_one_rule_set(family):
    from quant.engines import select

    for engine, releases in REQUIRED.items():
        assert set(releases) <= set(releases_read(engine, family)), (engine, family)
        for release in releases:
            assert len(select(f"{engine}=={release}", family)) == 1


# Families read over each engine's whole window: every registry release (a .postN through its base release)
WHOLE_WINDOW = {"sglang": ("mixtral", "qwen3_moe", "minimax_m2"), "vllm": ("mixtral", "qwen3_moe", "minimax_m2")}


@pytest.mark.parametrize(("engine", "family"), [(e, f) for e, fams in WHOLE_WINDOW.items() for f in fams])
def test_every_window_release_is_read(engine, family):
    from quant.engines import select
    from quant.engines.rules import window

    assert set(window(engine)) <= set(releases_read(engine, family)), (engine, family)
    assert all(len(select(f"{engine}=={release}", family)) == 1 for release in window(engine))


def test_minimax_mtp_modules_are_skipped_as_the_wheel_skips_them():
    """sglang's own get_spec_layer_idx_from_weight_name names the MTP modules load_weights skips: the
    replay builds nothing from exactly those (and builds every decoder layer)."""
    from quant.engines.replay import draft_name
    from tests.quant.engine_sources import load

    for rules in rule_sets("sglang", "minimax_m2"):
        for release in ("0.5.21", "0.5.23"):
            whl = engine_wheel(rules, release)
            spec = load(whl, SOURCES["minimax_m2"]["sglang"]["main"], ["get_spec_layer_idx_from_weight_name"],
                        {"PretrainedConfig": object})["get_spec_layer_idx_from_weight_name"]
            config = types.SimpleNamespace(num_hidden_layers=62, num_mtp_modules=3)
            for layer in (0, 61, 62, 64):
                name = f"model.layers.{layer}.block_sparse_moe.experts.3.w1"
                assert (spec(config, name + ".weight") is not None) == (draft_name(name, rules, 62) is None)
