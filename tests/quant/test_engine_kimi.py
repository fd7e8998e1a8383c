"""Differential tests for Kimi-K2.5 / K2.6 (``kimi_k25``, KimiK25ForConditionalGeneration): each
release read (``manifests/families/kimi_k25/{sglang,vllm}.yaml``) decides with its own Quark
``should_ignore_layer`` beside ``quant.engines`` on the checkpoint's module names (the text model
under language_model.model.layers, the vision tower, the projector), fed the packed-modules mapping
the release's classes leave on the quant config, read from the wheel: sglang's DeepSeek text model
replaces the loader's mapping with its own (no gate_up_proj); vLLM's is DeepseekV2ForCausalLM's.
vLLM's exclude list goes through the class's hf_to_vllm_mapper (read from the wheel) first.
"""

from __future__ import annotations

import ast
import random

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.replay import class_name
from quant.engines.rules import releases_read
from tests.quant.engine_sources import class_constant, class_def, method_def, sglang_quark_loader_additions
from tests.quant.test_engine_sources import engine_wheel, quark_disagreements, _quark_engine

KIMI = {"sglang": "sglang/srt/models/kimi_k25.py", "vllm": "vllm/model_executor/models/kimi_k25.py"}
DEEPSEEK = {"sglang": "sglang/srt/models/deepseek_v2.py", "vllm": "vllm/model_executor/models/deepseek_v2.py"}
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, "kimi_k25")
         for v in sorted(releases_read(e, "kimi_k25"), key=Version) if r.covers(releases_read(e, "kimi_k25")[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]


def effective_mapping(whl, engine: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds once the text model is built: the Kimi class
    has none; DeepseekV2ForCausalLM's class literal plus its __init__ additions (q_lora_rank), which
    sglang's update_packed_modules_mapping assigns over the loader's dict (never merged). Before
    sglang has that hook (0.5.13) the quant config keeps the loader's dict: the Kimi class's fresh one
    plus the loader's Quark additions (the text model writes its additions into its own class dict)."""
    kimi = class_def(whl, KIMI[engine], "KimiK25ForConditionalGeneration")
    assert class_constant(kimi, "packed_modules_mapping") is None
    cls = class_def(whl, DEEPSEEK[engine], "DeepseekV2ForCausalLM")
    init = method_def(cls, "__init__")
    if engine == "sglang":
        if "quant_config.update_packed_modules_mapping(self.packed_modules_mapping)" not in ast.unparse(init):
            return {k: list(v) for k, v in sglang_quark_loader_additions(whl).items()}
        base = class_def(whl, "sglang/srt/layers/quantization/base_config.py", "QuantizationConfig")
        assert ast.unparse(method_def(base, "update_packed_modules_mapping").body[-1]) == \
            "self.packed_modules_mapping = mapping"
    mapping = dict(class_constant(cls, "packed_modules_mapping") or {})
    for stmt in ast.walk(init):
        if isinstance(stmt, ast.If) and "use_mha" not in ast.unparse(stmt.test):
            for inner in stmt.body:
                target = inner.targets[0] if isinstance(inner, ast.Assign) else None
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "self.packed_modules_mapping":
                    mapping[ast.literal_eval(target.slice)] = ast.literal_eval(inner.value)
    return {k: list(v) for k, v in mapping.items()}


def quark_text_prefix(whl) -> str:
    """The prefix sglang's Kimi class builds its DeepSeek text model with under a Quark config, read
    from __init__: none before 0.5.11 (or one chosen for ModelSlim only), 'language_model' once the
    condition names QuarkConfig."""
    init = method_def(class_def(whl, KIMI["sglang"], "KimiK25ForConditionalGeneration"), "__init__")
    call = next(n for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == "DeepseekV3ForCausalLM")
    prefix = next((k.value for k in call.keywords if k.arg == "prefix"), None)
    if prefix is None:
        return ""
    return "language_model" if "QuarkConfig" in ast.unparse(prefix) else ""


def vllm_prefix_mapper(whl) -> dict[str, str]:
    """KimiK25ForConditionalGeneration.hf_to_vllm_mapper's orig_to_new_prefix, as the wheel writes it."""
    node = class_def(whl, KIMI["vllm"], "KimiK25ForConditionalGeneration")
    assign = next(s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "hf_to_vllm_mapper")
    return ast.literal_eval(next(k.value for k in assign.value.keywords if k.arg == "orig_to_new_prefix"))


def _mapped(entries: list[str], prefixes: dict[str, str]) -> list[str]:
    out = []
    for e in entries:
        old = next((p for p in prefixes if e.startswith(p)), None)
        out.append(prefixes[old] + e[len(old):] if old else e)
    return out


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_text_model_prefix_is_the_wheels(rules, release):
    """sglang 0.5.9 and 0.5.10 build the text model without the language_model prefix under Quark, so
    the exclude list's language_model.model.layers.* entries match nothing there (module_names)."""
    prefix = quark_text_prefix(engine_wheel(rules, release))
    assert (rules.values.get("module_names") or {}) == ({} if prefix else {"^language_model.": ""})


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_one_the_wheel_leaves(rules, release):
    assert effective_mapping(engine_wheel(rules, release), rules.engine) == rules["quark_fused"]


def test_vllm_projector_names_are_the_mappers():
    rules, release = next(c for c in CASES if c[0].engine == "vllm")
    prefixes = vllm_prefix_mapper(engine_wheel(rules, release))
    for old in ("mm_projector.proj.0", "mm_projector.proj.2", "mm_projector.proj.0.weight", "language_model.lm_head"):
        assert class_name(old, rules) == _mapped([old], prefixes)[0]


POOL_LAYERS = ["language_model.model.layers.0.", "language_model.model.layers.1."]
LEAVES = ["self_attn.fused_qkv_a_proj_with_mqa", "self_attn.fused_qkv_a_proj", "self_attn.kv_b_proj",
          "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "mlp.shared_experts.gate_up_proj",
          "mlp.shared_experts.down_proj", "mlp.experts", "mlp.gate"]
SHARDS = ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlp.gate_proj", "mlp.up_proj",
          "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.experts.0.gate_proj"]
VISION = ["vision_tower.encoder.blocks.0.wqkv", "vision_tower.encoder.blocks.0.wo",
          "vision_tower.encoder.blocks.0.mlp.fc0", "vision_tower.encoder.blocks.0.mlp.fc1"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = effective_mapping(whl, rules.engine)
    prefixes = vllm_prefix_mapper(whl) if rules.engine == "vllm" else {}
    # the names the class asks its quant config for (module_names: no language_model. before 0.5.11)
    modules = [class_name(p + m, rules) for p in POOL_LAYERS for m in LEAVES] + VISION + \
        [class_name(m, rules) for m in ("mm_projector.proj.0", "mm_projector.proj.2")]
    entries = [p + m for p in POOL_LAYERS for m in LEAVES + SHARDS] + VISION + \
        ["mm_projector.proj.0", "mm_projector.proj.2", "re:.*shared_experts.*", "re:.*vision_tower.*", "lm_head"]
    rng = random.Random(f"kimi{rules.id}{release}")
    # the writer lists both names (quant/serving.py); vLLM sees its mapper's names, sglang the list as written
    written = lambda exclude: exclude + [class_name(e, rules) for e in exclude]  # noqa: E731
    disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=20, names=5,
                                         ours=written, theirs=lambda exclude: _mapped(exclude, prefixes)
                                         if rules.engine == "vllm" else written(exclude))
    assert not disagree, disagree[:3]
    assert seen > 30


def _built_with(whl, engine: str, attr: str) -> str:
    """The quant_config argument KimiK25ForConditionalGeneration.__init__ builds ``attr`` with."""
    init = method_def(class_def(whl, KIMI[engine], "KimiK25ForConditionalGeneration"), "__init__")
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == f"self.{attr}" and \
                isinstance(node.value, ast.Call):
            given = next((k.value for k in node.value.keywords if k.arg == "quant_config"), None)
            return "None" if given is None else ast.unparse(given)  # sglang <= 0.5.9 passes none
    raise AssertionError(f"{attr} not built in __init__")


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_vision_tower_gets_the_quant_config_as_the_wheel_builds_it(rules, release):
    """sglang passes the vision tower a config only for ModelSlim (its projector's ReplicatedLinears
    take none); vLLM passes _maybe_ignore_quant_config(quant_config), None only for compressed-tensors."""
    whl = engine_wheel(rules, release)
    vision = _built_with(whl, rules.engine, "vision_tower")
    if rules.engine == "sglang":
        never = vision in ("quant_config if isinstance(quant_config, ModelSlimConfig) else None", "None")
        projector = class_def(whl, KIMI["sglang"], "K2VLMultiModalProjector")
        assert "quant_config" not in ast.unparse(method_def(projector, "__init__")).split("ReplicatedLinear", 1)[1]
    else:
        guard = method_def(class_def(whl, KIMI["vllm"], "KimiK25ForConditionalGeneration"), "_maybe_ignore_quant_config")
        assert "CompressedTensorsConfig" in ast.unparse(guard)
        never = vision != "self._maybe_ignore_quant_config(quant_config)" or \
            _built_with(whl, "vllm", "mm_projector") != vision
    assert never == ({"vision", "projector"} <= set(rules["unquantized_roles"]))
    assert ("vision" in rules["unquantized_roles"]) == ("projector" in rules["unquantized_roles"])


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_shared_expert_fusion_is_deepseek_v3s_on_the_text_config(rules, release):
    """The Kimi class hands its text_config to DeepseekV3ForCausalLM's own decision (and, 0.5.23, its
    count); that decision, run from the wheel on a DeepseekV3ForCausalLM text config, equals the replay's."""
    from quant.engines.fusion import no_fusion_reason
    from quant.engines.serving import serving
    from tests.quant.test_engine_sources import GPUS
    from tests.quant.test_engine_sources import _fusion_engine as deepseek_fusion

    whl = engine_wheel(rules, release)
    kimi = class_def(whl, KIMI["sglang"], "KimiK25ForConditionalGeneration")
    gate = method_def(kimi, "shared_experts_fusion_disable_reason")
    if gate is None:  # <= 0.5.17: the text model (DeepseekV3ForCausalLM) decides in its own __init__
        assert Version(release) < Version("0.5.18") and "DeepseekV3ForCausalLM(" in ast.unparse(kimi)
    else:
        delegated = ast.unparse(gate)
        assert "DeepseekV3ForCausalLM.shared_experts_fusion_disable_reason(" in delegated and "text_config" in delegated
    engine = deepseek_fusion(whl, "deepseek_v3", False)
    pool = [f"language_model.model.layers.{n}.mlp.shared_experts.{p}" for n in (1, 3) for p in ("gate_proj", "gate_up_proj")] \
        + ["re:.*shared_experts.*", "vision_tower.encoder.blocks.0.wqkv", "language_model.model.layers.3.mlp.experts",
           "mm_projector.proj.0", "language_model.lm_head"]
    rng = random.Random(f"kimi-fusion{release}")
    disagree, fused = [], 0
    for _ in range(150):
        config = {"num_hidden_layers": 61, "n_routed_experts": rng.choice([384, 384, 256, 160]),
                  "n_shared_experts": rng.choice([1, 1, 1, 2]), "num_nextn_predict_layers": 1}
        exclude = rng.sample(pool, rng.randint(0, 3))
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 1, 8]), disable_shared_experts_fusion=rng.random() < 0.15)
        theirs = engine(config, exclude, kind, setup)
        ours = no_fusion_reason(rules, "kimi_k25", {**config, "architectures": ["DeepseekV3ForCausalLM"]}, kind,
                                exclude, setup, False) is None
        fused += theirs
        if theirs != ours:
            disagree.append((config, exclude, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert 0 < fused < 150


TEXT_MODEL = {"sglang": "DeepseekV3ForCausalLM(", "vllm": "architectures=['DeepseekV2ForCausalLM']"}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_the_text_model_is_deepseeks_with_its_rules(rules, release):
    """The Kimi class builds its language model as the DeepSeek class (sglang DeepseekV3ForCausalLM,
    vLLM DeepseekV2ForCausalLM, read in __init__), so the text model's router, FP8 skip and
    unquantized modules are that class's rules for the same release, which test_engine_sources.py
    checks against the wheel's own code."""
    from quant.engines.rules import select

    init = method_def(class_def(engine_wheel(rules, release), KIMI[rules.engine], "KimiK25ForConditionalGeneration"),
                      "__init__")
    assert TEXT_MODEL[rules.engine] in ast.unparse(init).replace('"', "'")
    deepseek = select(f"{rules.engine}=={release}", "deepseek_v3")[0]
    for rule in ("router", "fp8_skip", "built_fused"):
        assert rules[rule] == deepseek[rule], rule
    assert set(deepseek["unquantized_roles"]) - {"mtp_head"} <= set(rules["unquantized_roles"])


def test_every_required_release_is_read_and_has_one_rule_set():
    from quant.engines.rules import window

    for engine, required in {"sglang": list(window("sglang")), "vllm": ["0.33.0"]}.items():
        read = releases_read(engine, "kimi_k25")
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert sum(r.covers(read[release]) for r in rule_sets(engine, "kimi_k25")) == 1
