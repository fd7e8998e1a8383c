"""Differential tests for Qwen3.5 MoE (``qwen3_5_moe``, Qwen3_5MoeForConditionalGeneration and its
drafts Qwen3_5ForCausalLMMTP / Qwen3_5MoeMTP): each release read
(``manifests/families/qwen3_5_moe/{sglang,vllm}.yaml``) decides with its own functions beside
``quant.engines`` on the checkpoint's module names (Gated DeltaNet layers with their packed
in_proj_qkvz / in_proj_ba, full-attention layers, the shared expert and its gate, the vision tower,
the mtp.* draft): Quark's ``should_ignore_layer`` fed the
class's packed-modules mapping read from the same wheel, and sglang's shared-expert fusion decision
(qwen2_moe.py ``can_fuse_shared_expert`` with QuarkConfig's own hook, on the platforms the class fuses
on). Without the wheels the tests skip, saying why.
"""

from __future__ import annotations

import ast
import random

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.fusion import no_fusion_reason
from quant.engines.replay import draft_name, is_draft
from quant.engines.rules import releases_read
from quant.engines.serving import serving
from tests.quant.engine_sources import class_def, config_reads, method_def, parsed, source
from tests.quant.test_engine_qwen3_next import _fusion_engine, class_mapping
from tests.quant.test_engine_sources import (
    GPUS,
    engine_wheel,
    fp8_disagreements,
    _fp8_engine,
    quark_disagreements,
    _quark_engine,
)

FAMILY = "qwen3_5_moe"
MAIN = {"sglang": "sglang/srt/models/qwen3_5.py", "vllm": "vllm/model_executor/models/qwen3_5.py"}
VL = "vllm/model_executor/models/qwen3_vl.py"
DRAFT = "sglang/srt/models/qwen3_5_mtp.py"
QWEN2_MOE = "sglang/srt/models/qwen2_moe.py"
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
SGLANG_IDS = [f"sglang {v}" for _, v in SGLANG]
L = 60  # Qwen3.5-397B-A17B's num_hidden_layers


def quark_mapping(whl, engine: str) -> dict[str, list[str]]:
    """The mapping the Quark config holds: sglang's class shares Qwen3_5ForCausalLM's dict (updated by
    the loader); vLLM's is Qwen3VLForConditionalGeneration's literal | the class's GDN entries."""
    if engine == "sglang":
        return class_mapping(whl, "sglang", "Qwen3_5ForCausalLM", "quark", MAIN["sglang"])
    node = class_def(whl, MAIN["vllm"], "Qwen3_5ForConditionalGeneration")
    value = next(s.value for s in node.body if isinstance(s, ast.Assign)
                 and any(getattr(t, "id", None) == "packed_modules_mapping" for t in s.targets))
    assert isinstance(value, ast.BinOp) and ast.unparse(value.left) == \
        "Qwen3VLForConditionalGeneration.packed_modules_mapping"
    base = next(ast.literal_eval(s.value) for s in class_def(whl, VL, "Qwen3VLForConditionalGeneration").body
                if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == "packed_modules_mapping")
    return {k: list(v) for k, v in {**base, **ast.literal_eval(value.right)}.items()}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert quark_mapping(whl, rules.engine) == rules["quark_fused"]
    if rules.engine == "sglang":  # the class shares the text model's dict; no mapper renames the exclude list
        node = class_def(whl, MAIN["sglang"], "Qwen3_5MoeForConditionalGeneration")
        body = "\n".join(ast.unparse(s) for s in node.body if isinstance(s, ast.Assign))
        assert "packed_modules_mapping = Qwen3_5ForCausalLM.packed_modules_mapping" in body
        assert "hf_to_sglang_mapper = None" in body


# Module names the generator draws from, as the checkpoint (and so both engines: sglang builds the text
# model under model.language_model, vLLM maps model.language_model. to language_model.model. on both
# sides) names them: a linear-attention layer, a full-attention layer, the draft, the vision tower.
LAYERS = ["model.language_model.layers.0.", "model.language_model.layers.3.", "mtp.layers.0."]
LEAVES = ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.qkv_proj",
          "self_attn.o_proj", "mlp.experts", "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"]
SHARDS = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
          "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.shared_expert.gate_proj",
          "mlp.shared_expert.up_proj", "mlp.experts.0.gate_proj", "mlp.experts.1.down_proj", "mlp.shared_expert_gate",
          "mlp.gate"]
VISION = ["model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj", "model.visual.merger.linear_fc1"]


def _pool():
    modules = [p + m for p in LAYERS for m in LEAVES] + VISION + ["mtp.fc"]
    entries = [p + m for p in LAYERS for m in LEAVES + SHARDS] + VISION + \
        ["mtp.fc", "lm_head", "re:.*shared_expert\\..*", "re:.*linear_attn.*", "re:mtp\\..*", "re:.*experts.*",
         "re:model\\.visual\\..*"]
    return modules, entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = quark_mapping(whl, rules.engine)
    modules, entries = _pool()
    rng = random.Random(f"qwen3_5{rules.id}{release}")
    disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=24,
                                          names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_shared_expert_fusion_decisions_are_the_engines(rules, release):
    """sglang fuses Qwen3.5's shared expert only under aiter (ROCm): the class and both decoder layers
    gate it on _use_aiter / support_shared_expert_fusion without the CUDA switch; where it may, the
    wheel's can_fuse_shared_expert with QuarkConfig's own hook decides, as the replay does."""
    whl = engine_wheel(rules, release)
    init = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3_5MoeForConditionalGeneration"), "__init__"))
    rule = rules["shared_experts_fusion"]
    if rule is None:  # before 0.5.12 the class builds no fused slot at all
        assert "num_fused_shared_experts" not in init
        assert "support_shared_expert_fusion" not in source(whl, MAIN["sglang"])
        return
    assert "if _use_aiter" in init and "self.num_fused_shared_experts = self._get_num_fused_shared_experts()" in init
    for decoder in ("Qwen3_5LinearDecoderLayer", "Qwen3_5AttentionDecoderLayer"):
        layer = ast.unparse(method_def(class_def(whl, MAIN["sglang"], decoder), "__init__"))
        assert "support_shared_expert_fusion=" in layer
        assert "enable_cuda_shared_expert_fusion" not in layer
    # from 0.5.18 the loader asks the class, HIP only, before any layer is built
    assert ("if not _is_hip:\n        return None" in source(whl, MAIN["sglang"])) == (rule["file"] == "qwen3_5.py")
    fuses = _fusion_engine(whl)
    pool = ["model.language_model.layers.1.mlp.shared_expert.gate_proj",
            "model.language_model.layers.3.mlp.shared_expert.down_proj",
            "model.language_model.layers.1.mlp.shared_expert_gate", "mtp.layers.0.mlp.shared_expert.up_proj",
            "re:.*shared_expert\\..*", "model.language_model.layers.3.mlp.experts", "lm_head", "model.visual.blocks.0.attn.qkv"]
    rng = random.Random(f"qwen3_5-fusion{release}")
    disagree, fused = [], 0
    for _ in range(200):
        config = {"num_hidden_layers": L, "moe_intermediate_size": 1024,
                  "shared_expert_intermediate_size": rng.choice([1024, 1024, 512, 0])}
        exclude = rng.sample(pool, rng.randint(0, 3))
        kind = rng.choice(["quark", "quark", "fp8"])
        platform, arch = rng.choice(GPUS)
        setup = serving(platform, arch, tp=8, ep=rng.choice([1, 8]), disable_shared_experts_fusion=rng.random() < 0.15)
        theirs = setup.platform == "rocm" and fuses(config, exclude, kind, setup)
        ours = no_fusion_reason(rules, FAMILY, config, kind, exclude, setup, False) is None
        fused += theirs
        if theirs != ours:
            disagree.append((config, exclude, kind, setup.label(), theirs, ours))
    assert not disagree, disagree[:3]
    assert 10 < fused < 150


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    """FP8's is_layer_skipped fed the class's mapping (sglang: without the Quark additions)."""
    whl = engine_wheel(rules, release)
    engine = _fp8_engine(rules, whl)
    fused = class_mapping(whl, "sglang", "Qwen3_5ForCausalLM", "fp8", MAIN["sglang"]) if rules.engine == "sglang" \
        else quark_mapping(whl, "vllm")
    assert fused == rules["fp8_skip"]["fused"]
    modules, entries = _pool()
    entries = [e for e in entries if not e.startswith("re:")]
    rng = random.Random(f"qwen3_5-fp8{rules.id}{release}")
    disagree, seen = fp8_disagreements(engine, rules["fp8_skip"], fused, modules, entries, rng, draws=200, most=16,
                                       names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_sglang_construction_and_draft_are_the_wheels(rules, release):
    """The modules the class builds packed (load_weights' stacked_params_mapping), the router and the
    shared-expert gate without quant config, the draft under mtp.* with a plain nn.Linear fc, and the
    config keys the fusion decision reads (qwen2_moe.py's can_fuse_shared_expert)."""
    whl = engine_wheel(rules, release)
    load = method_def(class_def(whl, MAIN["sglang"], "Qwen3_5MoeForConditionalGeneration"), "load_weights")
    stacked = next(ast.literal_eval(n.value) for n in ast.walk(load) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "stacked_params_mapping")
    built: dict[str, list[str]] = {}
    for param, shard, _ in stacked:
        built.setdefault(param.rstrip("."), []).append(shard.rstrip("."))
    assert built == rules["built_fused"]
    block = ast.unparse(method_def(class_def(whl, QWEN2_MOE, "Qwen2MoeSparseMoeBlock"), "__init__"))
    for attr in ("gate", "shared_expert_gate"):
        built_with = block[block.index(f"self.{attr} = ReplicatedLinear("):].split(")", 1)[0]
        assert "quant_config=None" in built_with
    assert {"router", "shared_expert_gate", "lm_head", "vision"} <= set(rules["unquantized_roles"])
    draft = ast.unparse(method_def(class_def(whl, DRAFT, "Qwen3_5ForCausalLMMTP"), "__init__"))
    assert "self.fc = nn.Linear(" in draft and rules["eh_proj"] == "plain"
    assert "prefix=add_prefix('mtp', prefix)" in draft
    for module in ("mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.mlp.experts", "mtp.layers.0.linear_attn.out_proj"):
        assert is_draft(module, rules, L) and draft_name(module, rules, L) == module
    if rules["shared_experts_fusion"] is not None:
        tree = parsed(whl, QWEN2_MOE)
        assert config_reads(tree, ("get_num_shared_experts", "can_fuse_shared_expert")) == \
            set(rules["shared_experts_fusion"]["config_reads"])


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=SGLANG_IDS)
def test_draft_quant_config_and_fused_slot_loading_are_the_wheels(rules, release):
    """When the draft is built bf16 (qwen3_5_mtp.py drops a Quark config whose exclude list has mtp.*
    entries: any from 0.5.12, one naming mlp.experts from 0.5.21), whether the draft's blocks decide
    fusion alone or the main model's refusal turns it off server-wide (0.5.14-0.5.17), and whether the
    draft's loader renames its shared expert into the fused slot (from 0.5.19)."""
    whl = engine_wheel(rules, release)
    draft = source(whl, DRAFT)
    how = rules["draft_exclude"][FAMILY]
    drops = "layer.startswith('mtp.')" in ast.unparse(parsed(whl, DRAFT))
    experts_signal = '"mlp.experts" in layer' in draft
    assert how == ("none" if not drops else "mtp_experts_draft_bf16" if experts_signal else "mtp_any_draft_bf16")
    rule = rules["shared_experts_fusion"]
    if rule is None:
        return
    load = ast.unparse(method_def(class_def(whl, DRAFT, "Qwen3_5ForCausalLMMTP"), "load_weights"))
    remaps = "'mlp.shared_expert.'" in load and "num_fused_shared_experts" in load
    assert rule.get("draft_shared_remap", True) == remaps
    text_init = ast.unparse(method_def(class_def(whl, MAIN["sglang"], "Qwen3_5ForCausalLM"), "__init__"))
    server_wide = "_maybe_autodisable_shared_experts_fusion(" in text_init
    assert rule.get("draft_decision", "own") == ("with_main" if server_wide else "own")
