"""Differential tests for Hunyuan-V4 (``hy_v4``, HYV4ForCausalLM): each release read
(``manifests/families/hy_v4/{sglang,vllm}.yaml``) decides with its own code beside ``quant.engines``: the class's
packed-modules mapping (sglang with its loader's Quark additions; vLLM in both platform files), the exclude list
as the class's mapper leaves it, the draft's names as the drafts' own exclusion remaps write them
(sglang ``_mtp_quant_config``, vLLM ``_remap_mtp_quant_exclusions``, run on FP8-style lists, and shown to leave a
Quark list as written), Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` on random lists for the
main model's and the draft's modules, the modules the constructors build with or without the quant config, and
the shared-expert fusion answer; and the releases that build the class at all. Then its load incident, rebuilt
as a tiny checkpoint and checked by the real ``gate checkpoint`` in its own process: an MXFP4 checkpoint whose
exclude list names the MTP layer as stored (``model.mtp_layers.0.*``, the way a Quark export lists it) is
quantized in both engines' drafts, and local evaluation is refused in one line (transformers 5.25 reads none of
the release's per-expert experts)."""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import types
import typing
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from quant.engines import ENGINES, rule_sets
from quant.engines.match import Exclude
from quant.engines.replay import draft_exclude, draft_name, exclude_entries, excluded
from quant.engines.rules import release_states, releases_read, window
from tests.evals.test_run import data_dir  # noqa: F401  (a fixture)
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    load,
    method_def,
    methods,
    packed_mapping,
    parsed,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import (
    _fp8_engine,
    _outcome,
    _quark_engine,
    engine_wheel,
    fp8_disagreements,
    wheel,
)

FAMILY = "hy_v4"
CLASS = "HYV4ForCausalLM"
SGLANG_MAIN, SGLANG_NEXTN = "sglang/srt/models/hunyuan_v4.py", "sglang/srt/models/hunyuan_v4_nextn.py"
VLLM_MODEL = ("vllm/models/hy_v4/nvidia/model.py", "vllm/models/hy_v4/amd/model.py")
VLLM_MTP, VLLM_ATTENTION = "vllm/models/hy_v4/nvidia/mtp.py", "vllm/models/hy_v4/nvidia/attention.py"
CASES = [(r, v) for e in ENGINES for v in window_sample(e, FAMILY) for r in rule_sets(e, FAMILY)
         if r.covers(releases_read(e, FAMILY).get(v, v))]
IDS = [f"{r.engine} {v}" for r, v in CASES]
LAYERS = 3  # the tiny checkpoint's decoder layers; its MTP layer is model.mtp_layers.0, the drafts' layer 3
# the draft's stored modules
DRAFT_STORED = ["model.mtp_layers.0.self_attn.q_a_proj", "model.mtp_layers.0.self_attn.kv_a_proj_with_mqa",
                "model.mtp_layers.0.self_attn.linear_gate", "model.mtp_layers.0.self_attn.q_b_proj",
                "model.mtp_layers.0.self_attn.indexer.wq_b", "model.mtp_layers.0.mlp.shared_experts.gate_proj",
                "model.mtp_layers.0.mlp.shared_experts.up_proj", "model.mtp_layers.0.mlp.experts.0.gate_proj",
                "model.mtp_layers.0.mlp.experts", "model.mtp_layers.0.eh_proj"]
# exclude entries a writer may list: the stored names, the fused names, the drafts' own names
STORED = ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
          "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "model.layers.0.self_attn.fused_qkv_a_proj",
          "model.layers.0.self_attn.linear_gate", "model.layers.0.self_attn.indexer.wq_b",
          "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.experts",
          "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.shared_experts.gate_proj",
          "model.layers.1.mlp.shared_experts.up_proj", "model.layers.1.mlp.shared_experts.down_proj", *DRAFT_STORED,
          "model.decoder.self_attn.q_a_proj", "model.decoder.self_attn.kv_a_proj_with_mqa",
          "model.decoder.mlp.experts", "model.decoder.mlp.shared_experts.gate_up_proj", "model.eh_proj",
          "model.layers.3.self_attn.fused_qkv_a_proj", "model.layers.3.mlp.experts",
          "model.layers.3.mlp.shared_experts.gate_proj", "model.layers.3.mlp.shared_experts.up_proj"]
# the modules each engine builds and looks up: the main model's, then the draft's
MODULES = {"sglang": (["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "model.layers.0.self_attn.linear_gate",
                       "model.layers.0.self_attn.indexer.wq_b", "model.layers.0.mlp.gate_up_proj",
                       "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.gate_up_proj",
                       "model.layers.1.mlp.shared_experts.down_proj"],
                      ["model.decoder.self_attn.fused_qkv_a_proj_with_mqa", "model.decoder.self_attn.q_b_proj",
                       "model.decoder.mlp.experts", "model.decoder.mlp.shared_experts.gate_up_proj"]),
           "vllm": (["model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.self_attn.linear_gate",
                     "model.layers.0.self_attn.indexer.wq_b", "model.layers.0.mlp.gate_up_proj",
                     "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.gate_up_proj",
                     "model.layers.1.mlp.shared_experts.down_proj"],
                    ["model.layers.3.self_attn.fused_qkv_a_proj", "model.layers.3.self_attn.q_b_proj",
                     "model.layers.3.mlp.experts", "model.layers.3.mlp.shared_experts.gate_up_proj"])}


def vllm_packed(whl) -> dict[str, list[str]]:
    """HYV4ForCausalLM's packed_modules_mapping (its __init__ sets it on the quant config), the same literal in the
    CUDA and ROCm files where the release has both, and HYV4MTP's (the draft's), which must be the same."""
    found = [packed_mapping(whl, path, CLASS, "vllm", "quark") for path in VLLM_MODEL
             if path in zipfile.ZipFile(whl).namelist()]
    draft = class_constant(class_def(whl, VLLM_MTP, "HYV4MTP"), "packed_modules_mapping")
    draft = {k: list(v) for k, v in draft.items()}
    assert found and all(f == found[0] for f in found) and draft == found[0], (found, draft)
    return found[0]


def wheel_packed(whl, engine: str, kind: str) -> dict[str, list[str]]:
    if engine == "vllm":
        return vllm_packed(whl)
    main = packed_mapping(whl, SGLANG_MAIN, CLASS, "sglang", kind)
    assert packed_mapping(whl, SGLANG_NEXTN, "HYV4ForCausalLMNextN", "sglang", kind) == main
    return main


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["quark_fused"] == wheel_packed(whl, rules.engine, "quark")
    assert rules["fp8_skip"]["fused"] == wheel_packed(whl, rules.engine, "fp8")
    if rules.engine == "sglang":  # the shards FP8 tries for a fused name the class does not map
        fallback = load(whl, "sglang/srt/layers/quantization/utils.py", ["_FALLBACK_FUSED_SHARDS"])
        assert rules["fp8_skip"]["fallback_fused"] == fallback["_FALLBACK_FUSED_SHARDS"]


def vllm_rename_mapper(whl):
    """vLLM's own WeightsMapper built from HYV4ForCausalLM's literal, as configure_quant_config hands it to the
    quant config (get_rename_mapper: the stacked maps dropped)."""
    path = "vllm/model_executor/models/utils.py"
    defined = {t.id for n in parsed(whl, path).body for t in getattr(n, "targets", []) if isinstance(t, ast.Name)}
    utils = load(whl, path, ["WeightsMapper", *({"ShardIds", "ShardId"} & defined)],
                 {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})
    node = class_def(whl, VLLM_MODEL[0], CLASS)
    assign = next(s for s in node.body
                  if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "hf_to_vllm_mapper")
    mapper = utils["WeightsMapper"](**{k.arg: ast.literal_eval(k.value) for k in assign.value.keywords})
    assert mapper.orig_to_new_stacked  # the loader's stacking, which names no module of the exclude list
    return mapper.get_rename_mapper()


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_the_exclude_list_stays_as_written(rules, release):
    """sglang: HYV4ForCausalLM has no hf_to_sglang_mapper; vLLM: its mapper's rename part leaves every entry."""
    whl = engine_wheel(rules, release)
    assert rules["exclude_mapper"] is None and rules["module_names"] is None
    if rules.engine == "sglang":
        assert class_constant(class_def(whl, SGLANG_MAIN, CLASS), "hf_to_sglang_mapper") is None
        return
    assert vllm_rename_mapper(whl).apply_list(STORED) == STORED


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_draft_names_are_the_drafts_own_remaps(rules, release):
    """The drafts' own exclusion remaps, run on an FP8-style list (an ignored_layers attribute) of the stored
    draft modules, write each as the draft module the replay names it (sglang: model.mtp_layers.0 ->
    model.decoder, eh_proj by the loader's model.eh_proj; vLLM: -> model.layers.3); a Quark config (its exclude
    list is exclude_layers / a dict) comes back with its list as written: rule draft_exclude none."""
    whl = engine_wheel(rules, release)
    stored = [m for m in DRAFT_STORED if not m.endswith("eh_proj")]
    ours = [draft_name(m, rules, LAYERS) for m in stored]
    if rules.engine == "sglang":
        remap = load(whl, SGLANG_NEXTN, ["_mtp_quant_config"])["_mtp_quant_config"]
        assert remap(types.SimpleNamespace(ignored_layers=list(stored))).ignored_layers == ours
        quark = types.SimpleNamespace(exclude_layers=list(stored), quant_config={"exclude": list(stored)})
        assert remap(quark).exclude_layers == stored
        assert draft_name("model.mtp_layers.0.eh_proj", rules, LAYERS) == "model.eh_proj"
        loader = ast.unparse(method_def(class_def(whl, SGLANG_NEXTN, "HYV4ForCausalLMNextN"), "load_weights"))
        assert "name.replace('model.mtp_layers.0', layer_prefix)" in loader
    else:
        logger = types.SimpleNamespace(info_once=lambda *a, **k: None)
        remap = load(whl, VLLM_MTP, ["_remap_mtp_quant_exclusions", "_MTP_QUANT_EXCLUSION_ATTRS"], {"logger": logger})
        fp8 = remap["_remap_mtp_quant_exclusions"](types.SimpleNamespace(ignored_layers=list(stored)), LAYERS, 1)
        assert fp8.ignored_layers == stored + ours
        quark = types.SimpleNamespace(quant_config={"exclude": list(stored)})
        assert remap["_remap_mtp_quant_exclusions"](quark, LAYERS, 1) is quark
    assert rules["draft_exclude"][FAMILY] == "none"  # the list as written (as the remaps above leave a Quark one)
    assert draft_exclude(list(STORED), rules, FAMILY, LAYERS, "quark") == (STORED, False)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists as written: the replay decides every main and draft module as the wheel's own
    should_ignore_layer on the list the engine keeps (both drafts take the main model's list as written)."""
    whl = engine_wheel(rules, release)
    engine, fused = _quark_engine(rules, whl), wheel_packed(whl, rules.engine, "quark")
    rng = random.Random(f"hy_v4 {rules.engine} {release}")
    seen = 0
    for _ in range(120):
        listed = rng.sample(STORED, rng.randint(0, len(STORED)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        for name in [*MODULES[rules.engine][0], *MODULES[rules.engine][1]]:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, listed, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 100


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    """Random FP8 configs: the replay's skip decision is the wheel's Fp8Config.from_config + is_layer_skipped fed
    the class's mapping (sglang: gate_up_proj only, so fused_qkv_a_proj_with_mqa is asked by its own name)."""
    whl = engine_wheel(rules, release)
    modules = MODULES[rules.engine][0]
    fused = wheel_packed(whl, rules.engine, "fp8")
    disagree, seen = fp8_disagreements(_fp8_engine(rules, whl), rules["fp8_skip"], fused, modules, STORED,
                                       random.Random(f"hy_v4 fp8 {release}"), draws=150, most=len(STORED),
                                       names=len(modules))
    assert not disagree and seen > 50, disagree[:3]


def _quantized_by(whl, path: str, cls: str, attr: str, method: str = "__init__") -> set[str]:
    """How ``self.<attr>`` is built in ``cls.<method>``: the quant_config keyword of each build."""
    return {b.keywords.get("quant_config", "absent")
            for b in attribute_builds(method_def(class_def(whl, path, cls), method), attr)}


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_what_the_constructors_build_with_the_quant_config(rules, release):
    """The indexer, the output gate, the MTP eh_proj, the router and the hyper-connections as the constructors
    build them: the rules' indexer / built_fused / eh_proj / unquantized_roles values."""
    whl = engine_wheel(rules, release)
    indexer = rules["indexer"]
    if rules.engine == "sglang":
        assert _quantized_by(whl, SGLANG_MAIN, "HYV4Attention", "linear_gate") == {"quant_config"}
        assert _quantized_by(whl, SGLANG_NEXTN, "HYV4ModelNextN", "eh_proj") == {"absent"}  # nn.Linear
        assert _quantized_by(whl, SGLANG_MAIN, "HYV4HCPreLayer", "hc_fn") == {"absent"}
        assert _quantized_by(whl, SGLANG_MAIN, "HYV4HCHeadLayer", "hc_head_fn") == {"absent"}
        config = load(whl, "sglang/srt/configs/hy_v4.py", ["HYV4Config"],
                      {"PreTrainedConfig": type("PreTrainedConfig", (), {"__init__": lambda self, **kw: None})})
        built = config["HYV4Config"]()
        assert built.indexer_rope_interleave and built.topk_method == "noaux_tc"  # wk fused bf16 on CUDA; the bias
        assert indexer["wk_fused_bf16_on_cuda"] and rules["router"]["bias_when"] == "always"
    else:
        assert _quantized_by(whl, VLLM_ATTENTION, "Indexer", "wq_b") == {"quant_config"}
        assert indexer["wq_b"] == "quant_config"
        assert _quantized_by(whl, VLLM_ATTENTION, "Indexer", "wk_weights_proj") == {"None"}
        assert indexer["wk"] == indexer["weights_proj"] == "bf16"
        assert _quantized_by(whl, VLLM_ATTENTION, "HYV4MLAAttention", "linear_gate") == {"quant_config"}
        assert _quantized_by(whl, VLLM_ATTENTION, "HYV4MLAAttention", "fused_qkv_a_proj") == {"quant_config"}
        assert _quantized_by(whl, "vllm/models/hy_v4/nvidia/moe.py", "HYV4MoEFused", "gate") == {"absent"}
        builds = attribute_builds(method_def(class_def(whl, "vllm/models/hy_v4/nvidia/moe.py", "HYV4MoEFused"),
                                             "__init__"), "expert_bias")
        assert len(builds) == 1 and not builds[0].under and rules["router"]["bias_when"] == "always"
        assert _quantized_by(whl, VLLM_MTP, "HYV4MultiTokenPredictorLayer", "eh_proj") == {"absent"}
    assert rules["eh_proj"] == "plain" and "router" in rules["unquantized_roles"]
    assert "linear_gate" not in json.dumps(rules["built_fused"])  # one module of its own


@pytest.mark.parametrize(("rules", "release"), [c for c in CASES if c[0].engine == "sglang"],
                         ids=[i for i in IDS if i.startswith("sglang")])
def test_sglang_never_fuses_the_shared_expert(rules, release):
    """HYV4ForCausalLM.shared_experts_fusion_disable_reason (and the draft's) always gives a reason: the routed
    experts' SwiGLU limit is not the shared expert's."""
    whl = engine_wheel(rules, release)
    main = methods(whl, SGLANG_MAIN, CLASS, ["shared_experts_fusion_disable_reason"])["cls"]
    reason = main.shared_experts_fusion_disable_reason(types.SimpleNamespace(n_shared_experts=1), None)
    draft = methods(whl, SGLANG_NEXTN, "HYV4ForCausalLMNextN", ["shared_experts_fusion_disable_reason"],
                    {CLASS: main})["cls"]
    assert reason and draft.shared_experts_fusion_disable_reason(None, None) == reason
    assert rules["shared_experts_fusion"] is None


@pytest.mark.parametrize("engine", ENGINES)
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.20 (models/hunyuan_v4.py), vLLM from 0.29.0 (models/hy_v4/): every release
    of the window that has it is read, or named in NOTES.md as not read; none before it is."""
    path = {"sglang": SGLANG_MAIN, "vllm": "vllm/models/hy_v4/__init__.py"}[engine]
    first = {"sglang": "0.5.20", "vllm": "0.29.0"}[engine]
    read = releases_read(engine, FAMILY)
    notes = " ".join((Path(__file__).parents[2] / "manifests/families/hy_v4/NOTES.md").read_text().split())
    for release in (window(engine)[0], first, max(read, key=Version)):
        try:
            names = set(zipfile.ZipFile(wheel(engine, release)).namelist())
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (path in names) == (Version(release) >= Version(first)), release
    states = release_states(engine, FAMILY)
    for release in window(engine):
        if Version(release) >= Version(first):
            assert release in read or f"{release} is not read" in notes, release
        else:
            assert states[release].state == "not built", states[release]


# --- the incident and local evaluation, in real processes ---------------------------------------------------


def gate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """quantgate's own MXFP4 conversion, and the same checkpoint with the exclude list a Quark export writes:
    the stored module names only (the MTP layer as model.mtp_layers.0.*)."""
    root = tmp_path_factory.mktemp("hy_v4")
    src = write_family_checkpoint(root / "bf16", FAMILY, num_hidden_layers=LAYERS)
    ours = root / "ours"
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", str(src), str(ours)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    stored = root / "stored"
    shutil.copytree(ours, stored)
    index = json.loads((stored / "model.safetensors.index.json").read_text())["weight_map"]
    modules = {n.rsplit(".", 1)[0] for n in index}
    config = json.loads((stored / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"] if e in modules]
    assert "model.mtp_layers.0.mlp.shared_experts.gate_proj" in config["quantization_config"]["exclude"]
    (stored / "config.json").write_text(json.dumps(config, indent=2))
    return src, ours, stored


def test_a_stored_name_exclude_list_misses_both_drafts(converted):
    """Both drafts take the main model's Quark list as written and build the MTP layer under their own names
    (sglang model.decoder.*, vLLM model.layers.3.*): its bf16 attention and shared expert are looked up as MXFP4.
    Served without the draft it loads; quantgate's own list, which writes the drafts' names too, loads with it."""
    _, ours, stored = converted
    for release, module in (("sglang==0.5.23", "model.decoder.mlp.shared_experts.gate_up_proj"),
                            ("sglang==0.5.20", "model.decoder.self_attn.fused_qkv_a_proj_with_mqa"),
                            ("vllm==0.34.0", "model.layers.3.mlp.shared_experts.gate_up_proj"),
                            ("vllm==0.30.0", "model.layers.3.self_attn.fused_qkv_a_proj")):
        failed = gate(stored, "--engine", release)
        assert failed.returncode == 1 and module in failed.stdout, failed.stdout + failed.stderr
        for checkpoint, args in ((stored, ("--no-speculative",)), (ours, ())):
            done = gate(checkpoint, "--engine", release, *args)
            assert done.returncode == 0 and "verdict: loads correctly" in done.stdout, done.stdout + done.stderr


def test_a_release_before_the_class_is_refused(converted):
    """sglang 0.5.19 has no models/hunyuan_v4.py: it cannot serve the family, and is never replayed."""
    _, ours, _ = converted
    refused = gate(ours, "--engine", "sglang==0.5.19")
    assert refused.returncode == 2 and "0.5.19" in refused.stderr and "Traceback" not in refused.stderr


EVALS = "import sys; from evals.cli import evals_main; sys.exit(evals_main(sys.argv[1:]))"  # the evals command


def test_local_evaluation_is_refused_in_one_line(converted, data_dir, tmp_path):  # noqa: F811
    """transformers 5.25's conversion mapping "hy_v4" merges none of the release's per-expert experts into its
    fused HYV4Experts: loaded, they would run uninitialised. evals run refuses the bf16 release and its MXFP4
    conversion in one line, exit 2, nothing written."""
    src, ours, _ = converted
    data = data_dir
    for checkpoint, says in ((src, "model.layers.1.mlp.experts"), (ours, "model.layers.1.mlp.experts")):
        out = tmp_path / f"run-{checkpoint.name}"
        run = subprocess.run([sys.executable, "-c", EVALS, "run", "--out", str(out), "--model", str(checkpoint),
                              "--benchmarks", "gsm8k", "--data-dir", str(data), "--limit", "1"],
                             capture_output=True, text=True, timeout=300, check=False)
        said = [line for line in run.stderr.splitlines() if line.startswith("evals: error:")]
        assert run.returncode == 2 and len(said) == 1 and says in said[0] and "--base-url" in said[0], run.stderr
        assert "Traceback" not in run.stderr and not (out / "run.json").exists()

