"""Differential tests for K-EXAONE (``exaone_moe``, ExaoneMoEForCausalLM and its drafts ExaoneMoEForCausalLMMTP /
ExaoneMoeMTP): each release read (``manifests/families/exaone_moe/{sglang,vllm}.yaml``) decides with its own
functions beside ``quant.engines`` on the checkpoint's module names (dense and MoE layers, the shared experts, the
mtp.* draft under each engine's names): Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` fed the
class's packed-modules mapping read from the same wheel, the draft renaming of sglang's ``load_weights``, and the
registry keys that decide which vLLM releases build the release's architecture. How modules are built is read from
the constructors. The tiny checkpoint is converted and checked in real processes. Without the wheels the tests
skip, saying why.
"""

from __future__ import annotations

import ast
import json
import random
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from quant.engines import ENGINES, rule_sets, select
from quant.engines.replay import draft_name, is_draft
from quant.engines.rules import UnknownEngine, release_states, releases_read
from quant.layout import family_named
from tests.quant.engine_sources import (
    attribute_builds,
    class_def,
    method_def,
    packed_mapping,
    source,
    wheel,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import (
    _draft_config_arch,
    _fp8_engine,
    _quark_engine,
    engine_wheel,
    fp8_disagreements,
    quark_disagreements,
)

FAMILY = "exaone_moe"
MAIN = {"sglang": "sglang/srt/models/exaone_moe.py", "vllm": "vllm/model_executor/models/exaone_moe.py"}
DRAFT = {"sglang": "sglang/srt/models/exaone_moe_mtp.py", "vllm": "vllm/model_executor/models/exaone_moe_mtp.py"}
CLASS = {"sglang": "ExaoneMoEForCausalLM", "vllm": "ExaoneMoeForCausalLM"}  # the Python classes
ARCH = "ExaoneMoEForCausalLM"  # the release's config.json architecture
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY) for v in window_sample(e, FAMILY)
         if v in releases_read(e, FAMILY) and r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
VLLM = [c for c in CASES if c[0].engine == "vllm"]
L = 48  # K-EXAONE-236B's num_hidden_layers


def class_mapping(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds: vLLM the class's literal, sglang (no mapping of its own)
    the loader's Quark additions."""
    return packed_mapping(whl, MAIN[engine], CLASS[engine], engine, kind)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert class_mapping(whl, rules.engine, "quark") == rules["quark_fused"]
    assert class_mapping(whl, rules.engine, "fp8") == rules["fp8_skip"]["fused"]


# Module names the generator draws from: a dense layer, a MoE layer, the draft under both engines' names (sglang
# model.layers.0.*, main layer 0's; vLLM mtp.layers.0.*), the draft's fc.
LAYERS = ["model.layers.0.", "model.layers.1.", "mtp.layers.0."]
LEAVES = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "mlp.experts",
          "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"]
SHARDS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
          "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.experts.0.gate_proj",
          "mlp.experts.1.down_proj", "mlp.gate"]


def _pool():
    modules = [p + m for p in LAYERS for m in LEAVES] + ["mtp.fc", "fc"]
    entries = [p + m for p in LAYERS for m in LEAVES + SHARDS] + ["mtp.fc", "fc", "lm_head", "re:.*shared_experts.*",
                                                                 "re:mtp\\..*", "re:.*experts.*", "re:.*qkv.*"]
    return modules, entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = class_mapping(whl, rules.engine, "quark")
    modules, entries = _pool()
    rng = random.Random(f"exaone{rules.id}{release}")
    disagree, seen = quark_disagreements(engine, rules, fused, modules, entries, rng, draws=200, most=20, names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _fp8_engine(rules, whl)
    fused = class_mapping(whl, rules.engine, "fp8")
    modules, entries = _pool()
    entries = [e for e in entries if not e.startswith("re:")]
    entries += [e.removeprefix("model.") for e in entries if e.startswith("model.")][:12]
    rng = random.Random(f"exaone-fp8{rules.id}{release}")
    disagree, seen = fp8_disagreements(engine, rules["fp8_skip"], fused, modules, entries, rng, draws=200, most=16,
                                       names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


# --- sglang's draft: the checkpoint's mtp.* renamed as load_weights renames it ----------------------

def _sglang_draft_renamer(whl):
    """The ``if is_mtp:`` block of ExaoneMoEForCausalLM.load_weights, run as the wheel writes it (its
    ``continue``: the weight is not loaded)."""
    load_weights = method_def(class_def(whl, MAIN["sglang"], CLASS["sglang"]), "load_weights")
    loop = next(n for n in ast.walk(load_weights) if isinstance(n, ast.For))
    block = next(s for s in loop.body if isinstance(s, ast.If) and ast.unparse(s.test) == "is_mtp")
    code = "def rename(name, is_mtp=True):\n    for _ in [0]:\n" + textwrap.indent(ast.unparse(block), " " * 8) + \
        "\n        return name\n    return None\n"
    namespace: dict = {}
    exec(compile(code, f"{whl.name}/{MAIN['sglang']}", "exec"), namespace)  # noqa: S102 (the engine's own code)
    return namespace["rename"]


DRAFT_MODULES = ["mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.o_proj",
                 "mtp.layers.0.mlp.gate_proj", "mtp.layers.0.mlp.down_proj", "mtp.norm", "mtp.pre_fc_norm_hidden"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_sglang_draft_names_are_load_weights(rules, release):
    """The draft's weights get load_weights' names (mtp.fc -> fc, mtp.* -> model.*), and the draft's modules are
    built under those prefixes: ExaoneMoEModel(prefix='model') of one layer beside a plain nn.Linear fc; the main
    model drops every mtp name; configs/model_config.py makes an ExaoneMoEForCausalLM draft the MTP class."""
    whl = engine_wheel(rules, release)
    rename = _sglang_draft_renamer(whl)
    for module in DRAFT_MODULES:
        assert is_draft(module, rules, L)
        assert rename(module + ".weight") == draft_name(module, rules, L) + ".weight", module
    assert rename("model.layers.0.mlp.gate_proj.weight") is None  # the draft loads only mtp names
    assert draft_name("model.layers.0.mlp.gate_proj", rules, L) == "model.layers.0.mlp.gate_proj"
    init = method_def(class_def(whl, DRAFT["sglang"], "ExaoneMoEForCausalLMMTP"), "__init__")
    text = ast.unparse(init)
    assert "ExaoneMoEModel(config, quant_config, prefix=add_prefix('model', prefix))" in text
    assert "config.num_hidden_layers = 1" in text and rules["mtp_naming"]["max_layers"] == 1
    assert [b.call for b in attribute_builds(init, "fc")] == ["nn.Linear"] and rules["eh_proj"] == "plain"
    assert "hf_to_sglang_mapper" not in source(whl, DRAFT["sglang"]) and rules["draft_exclude"][FAMILY] == "none"
    assert _draft_config_arch(whl, ARCH) == "ExaoneMoEForCausalLMMTP"
    main_load = ast.unparse(method_def(class_def(whl, MAIN["sglang"], CLASS["sglang"]), "load_weights"))
    assert re.search(r"if not is_mtp and 'mtp' in name:\s+continue", main_load)


@pytest.mark.parametrize(("rules", "release"), VLLM, ids=[f"vllm {v}" for _, v in VLLM])
def test_vllm_draft_is_built_under_the_checkpoints_names(rules, release):
    """vLLM's draft ExaoneMoeMTP builds ExaoneMoeMultiTokenPredictor under 'mtp' (fc and layers.{idx} under it,
    fc with the quant config), so quant lookups see mtp.* as written; config/speculative.py makes an exaone_moe
    draft ExaoneMoeMTP; the main class's mapper drops mtp.* (a prefix mapped to None, not applied to the list)."""
    whl = engine_wheel(rules, release)
    init = method_def(class_def(whl, DRAFT["vllm"], "ExaoneMoeMTP"), "__init__")
    assert attribute_builds(init, "model")[0].keywords["prefix"] == "maybe_prefix(prefix, 'mtp')"
    predictor = method_def(class_def(whl, DRAFT["vllm"], "ExaoneMoeMultiTokenPredictor"), "__init__")
    fc = attribute_builds(predictor, "fc")
    assert fc[0].keywords["prefix"] == "f'{prefix}.fc'" and fc[0].keywords["quant_config"] == "quant_config"
    assert rules["eh_proj"] == "any_quant_config"
    assert "prefix=f'{prefix}.layers.{idx}'" in ast.unparse(predictor)
    assert re.search(r"(is_mtp|mtp_layer)=True", ast.unparse(predictor))  # the draft's layer: a dense MLP
    assert "getattr(config, 'num_nextn_predict_layers', 1)" in ast.unparse(predictor)
    assert rules["mtp_naming"]["max_layers"] is None
    for module in DRAFT_MODULES:
        assert is_draft(module, rules, L) and draft_name(module, rules, L) == module
    assert "hf_to_vllm_mapper" not in ast.unparse(class_def(whl, DRAFT["vllm"], "ExaoneMoeMTP"))
    main = ast.unparse(class_def(whl, MAIN["vllm"], CLASS["vllm"]))
    # the main class maps stacked names only (0.25.0 on), from 0.27.0 also drops mtp.* (a prefix mapped to None)
    assert "hf_to_vllm_mapper" not in main or "orig_to_new_prefix" not in main or \
        "orig_to_new_prefix={'mtp.': None}" in main
    assert rules["draft_exclude"][FAMILY] == "none"
    spec = source(whl, "vllm/config/speculative.py").replace('"', "'")
    assert "hf_config.model_type = 'exaone_moe_mtp'" in spec and "'architectures': ['ExaoneMoeMTP']" in spec


# --- How modules are built, read from the classes -------------------------------------------------------

@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_construction_is_the_engine_classes(rules, release):
    """The router is built without quant config and its correction bias always, beside it (mlp.*); q/k/v and the
    dense / shared gate and up are fused Linears; the MoE layers are the config's list (sglang is_moe_layer, vLLM
    mlp_layer_types); the shared expert is never a slot of the FusedMoE."""
    whl = engine_wheel(rules, release)
    main = MAIN[rules.engine]
    if rules.engine == "sglang":
        block = method_def(class_def(whl, main, "ExaoneMoESparseMoEBlock"), "__init__")
        gates = attribute_builds(block, "gate")
        assert gates and all(b.call == "ReplicatedLinear" and b.keywords["quant_config"] == "None" for b in gates)
        # the FusedMoE holds the routed experts (and EPLB's redundant ones): no slot for the shared expert
        assert re.search(r"num_experts=config\.num_experts \+ [\w.()]+\.ep_num_redundant_experts,", ast.unparse(block))
        qkv = attribute_builds(method_def(class_def(whl, main, "ExaoneMoEAttention"), "__init__"), "qkv_proj")
        mlp = attribute_builds(method_def(class_def(whl, main, "ExaoneMoEMLP"), "__init__"), "gate_up_proj")
        layer = ast.unparse(class_def(whl, main, "ExaoneMoEDecoderLayer"))
        assert "config.is_moe_layer" in layer
        assert "shared_experts_fusion_disable_reason" not in source(whl, main)
    else:
        exaone4 = "vllm/model_executor/models/exaone4.py"
        block = method_def(class_def(whl, main, "ExaoneMoe"), "__init__")
        gates = attribute_builds(block, "gate")
        # GateLinear (0.31.0 on) takes no quant config; before, ReplicatedLinear(quant_config=None)
        assert gates and all("quant_config" not in b.keywords if b.call == "GateLinear" else
                             b.call == "ReplicatedLinear" and b.keywords["quant_config"] == "None" for b in gates)
        # the attention is exaone4.py's Exaone4Attention up to 0.26.0, then the file's own ExaoneMoeAttention
        attention = class_def(whl, main, "ExaoneMoeAttention") or class_def(whl, exaone4, "Exaone4Attention")
        qkv = attribute_builds(method_def(attention, "__init__"), "qkv_proj")
        assert "from .exaone4 import Exaone4GatedMLP as ExaoneMoeGatedMLP" in source(whl, main)
        mlp = attribute_builds(method_def(class_def(whl, exaone4, "Exaone4GatedMLP"), "__init__"), "gate_up_proj")
        layer = ast.unparse(method_def(class_def(whl, main, "ExaoneMoeDecoderLayer"), "__init__"))
        key = "is_moe_layer" if "is_moe_layer" in rules["router"]["reads"] else None
        assert ("config.is_moe_layer[layer_idx] and (not mtp_layer)" if key else
                "config.mlp_layer_types[layer_idx] == 'sparse' and (not is_mtp)") in layer
    assert rules["moe_layers"] == "config" and rules["shared_experts_fusion"] is None
    assert [b.call for b in attribute_builds(block, "e_score_correction_bias")] == ["nn.Parameter"]
    assert rules["router"]["bias_when"] == "always"
    assert set(rules["unquantized_roles"]) == {"router", "lm_head"}
    assert qkv[0].call == "QKVParallelLinear" and mlp[0].call == "MergedColumnParallelLinear"
    assert rules["built_fused"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                    "gate_up_proj": ["gate_proj", "up_proj"]}


def test_the_config_keys_read_as_attributes_are_the_ones_transformers_lacks():
    """sglang reads config.is_moe_layer, which transformers' ExaoneMoeConfig does not define (so config.json must
    carry it: rule router.reads); vLLM 0.32.0+ reads mlp_layer_types (transformers derives it) and the K-EXAONE 2.0
    keys with getattr, so it reads none."""
    from transformers import ExaoneMoeConfig

    defined = set(ExaoneMoeConfig().to_dict())
    for engine in ENGINES:
        for rules in rule_sets(engine, FAMILY):
            assert not set(rules["router"]["reads"]) & defined, rules.id
    assert all(r["router"]["reads"] == ["is_moe_layer"] for r in rule_sets("sglang", FAMILY))
    vllm = {r.first: r["router"]["reads"] for r in rule_sets("vllm", FAMILY)}
    assert vllm["0.16.0"] == ["is_moe_layer"] and vllm["0.32.0"] == []
    assert "is_moe_layer" not in defined and "mlp_layer_types" in defined


# --- Which vLLM releases build the release's architecture: the registry keys ---------------------------

@pytest.mark.parametrize("release", ["0.26.0", "0.27.0", "0.31.0", "0.32.0"])
def test_vllm_registry_keys_decide_which_releases_build_the_release(release):
    """0.16.0-0.26.0 and 0.32.0+ register ExaoneMoEForCausalLM (the release's spelling), 0.27.0-0.31.0 only
    transformers' ExaoneMoeForCausalLM: the lock's states follow the wheels' registry."""
    try:
        whl = wheel("vllm", release)
    except Exception as exc:  # noqa: BLE001  (no registry: say why)
        pytest.skip(f"cannot obtain vllm=={release}: {exc}")
    registry = source(whl, "vllm/model_executor/models/registry.py")
    registered = re.search(rf'^\s*"{ARCH}":', registry, re.MULTILINE) is not None
    state = release_states("vllm", FAMILY)[release].state
    assert (state != "not built") == registered, (release, state)


def test_every_required_release_is_read_and_one_not_built_is_refused():
    wanted = {"sglang": ["0.5.9", "0.5.10.post1", "0.5.11", "0.5.16", "0.5.21", "0.5.22", "0.5.23"],
                "vllm": ["0.16.0", "0.24.0", "0.26.0", "0.32.0", "0.34.0"]}
    for engine, required in wanted.items():
        read = releases_read(engine, FAMILY)
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert len(select(f"{engine}=={release}", FAMILY)) == 1
    with pytest.raises(UnknownEngine, match="0.30.0"):
        select("vllm==0.30.0", FAMILY)
    assert not {"0.27.0", "0.31.0"} & set(releases_read("vllm", FAMILY))


# --- The tiny checkpoint in real processes --------------------------------------------------------------

def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("exaone")
    src = write_family_checkpoint(root / "bf16", FAMILY)
    done = _cli("quant.cli", "--to", "mxfp4", "-q", src, root / "mxfp4")
    assert done.returncode == 0, done.stderr
    return src, root / "mxfp4"


def test_the_tiny_checkpoint_converts_and_loads_in_the_newest_releases(mxfp4):
    """quantize --to mxfp4 writes the draft's names for both engines (sglang's model.layers.0.*, vLLM's mtp.* with
    its quantizable mtp.fc) and gate checkpoint passes in every release read."""
    _, out = mxfp4
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    assert {"mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj",
            "model.layers.1.mlp.shared_experts.gate_up_proj"} <= set(exclude)
    assert family_named(FAMILY).name == FAMILY
    for engine in ("sglang==0.5.21", "sglang==0.5.23", "vllm==0.32.0", "vllm==0.34.0"):
        done = _cli("evals.cli", "checkpoint", out, "--engine", engine)
        assert done.returncode == 0 and "verdict: loads correctly" in done.stdout, (engine, done.stdout, done.stderr)


def test_a_config_without_is_moe_layer_is_caught_for_sglang(mxfp4, tmp_path):
    """A config.json as transformers writes it (mlp_layer_types, no is_moe_layer) loads in vLLM 0.32.0+ but raises
    in sglang's ExaoneMoEDecoderLayer and vLLM's up to 0.26.0 (config.is_moe_layer): gate checkpoint fails it
    there, naming the key."""
    _, out = mxfp4
    copy = shutil.copytree(out, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config.pop("is_moe_layer")
    (copy / "config.json").write_text(json.dumps(config))
    for engine in ("sglang==0.5.23", "sglang==0.5.9", "vllm==0.16.0", "vllm==0.26.0"):
        done = _cli("evals.cli", "checkpoint", copy, "--engine", engine)
        assert done.returncode == 1 and "is_moe_layer" in done.stdout, (engine, done.stdout)
    done = _cli("evals.cli", "checkpoint", copy, "--engine", "vllm==0.34.0")
    assert done.returncode == 0, done.stdout
