"""Differential tests for Qwen4-Exp (``qwen4_exp``, Qwen4ExpForConditionalGeneration): each release read
(``manifests/families/qwen4_exp/{sglang,vllm}.yaml``) decides with its own code beside ``quant.engines``: the
class's packed-modules mapping as the wheel composes it (sglang: Qwen3.5's, plus the loader's Quark additions;
vLLM: Qwen3.5-VL's joined with the class's own), Quark's ``should_ignore_layer`` on random exclude lists, the
layer kinds the release builds (its config's ``layers_block_type`` and its decoder-layer table), and the
releases that build the class at all. Then the tiny checkpoint converted and checked by the real ``gate
checkpoint`` in its own process, and a load incident rebuilt: the layer kind transformers writes on save
(``indexed_attention``), which sglang 0.5.21 has no decoder layer for.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version

from evals.cli import main as gate_main
from quant.engines import ENGINES, rule_sets
from quant.engines.match import Exclude
from quant.engines.replay import exclude_entries, excluded
from quant.engines.rules import release_states, releases_read, window
from tests.quant.engine_sources import (
    class_def,
    sglang_quark_loader_additions,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel, wheel

FAMILY = "qwen4_exp"
CLASS = "Qwen4ExpForConditionalGeneration"
MAIN = {"sglang": "sglang/srt/models/qwen4_exp.py", "vllm": "vllm/models/qwen4_exp/nvidia/model.py"}
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, FAMILY)
         for v in sorted(releases_read(e, FAMILY), key=Version) if r.covers(releases_read(e, FAMILY)[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
LAYERS = 3  # the tiny checkpoint's decoder layers; its draft is mtp.layers.0
# the classes whose packed_modules_mapping a Qwen4-Exp class composes its own from, and their files
OWNERS = {"Qwen3_5ForCausalLM": "sglang/srt/models/qwen3_5.py",
          "Qwen3_5ForConditionalGeneration": "vllm/model_executor/models/qwen3_5.py",
          "Qwen3VLForConditionalGeneration": "vllm/model_executor/models/qwen3_vl.py",
          "Qwen4ExpForCausalLM": "vllm/models/qwen4_exp/nvidia/model.py"}


def composed_mapping(whl, path: str, cls: str) -> dict[str, list[str]]:
    """A class's packed_modules_mapping as the wheel writes it: a literal, another class's
    (``Owner.packed_modules_mapping``, its entries), or ``|`` of those, evaluated on the owners' own values."""
    node = class_def(whl, path, cls)
    assign = next(s for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                  and ast.unparse(s.targets[0] if isinstance(s, ast.Assign) else s.target) == "packed_modules_mapping")
    owners = {name for name in OWNERS if name in ast.unparse(assign.value) and name != cls}
    scope = {name: types.SimpleNamespace(packed_modules_mapping=composed_mapping(whl, OWNERS[name], name))
             for name in owners}
    return {k: list(v) for k, v in eval(compile(ast.Expression(assign.value), path, "eval"), scope).items()}


def wheel_packed(whl, engine: str, kind: str) -> dict[str, list[str]]:
    mapping = composed_mapping(whl, MAIN[engine], CLASS)
    if engine == "sglang" and kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    return mapping


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    whl = engine_wheel(rules, release)
    assert rules["quark_fused"] == wheel_packed(whl, rules.engine, "quark")
    assert rules["fp8_skip"]["fused"] == wheel_packed(whl, rules.engine, "fp8")


def sglang_built_kinds(whl) -> set[str]:
    """The layer_types entries sglang builds a decoder layer for: configs/qwen4_exp.py layers_block_type maps
    the kinds of its tuple to attention and keeps the others; models/qwen4_exp.py ALL_DECODER_LAYER_TYPES
    holds a layer class per kind it builds."""
    config = class_def(whl, "sglang/srt/configs/qwen4_exp.py", "Qwen4ExpTextConfig")
    prop = next(n for n in config.body if isinstance(n, ast.FunctionDef) and n.name == "layers_block_type")
    mapped = next(ast.literal_eval(c.comparators[0]) for c in ast.walk(prop)
                  if isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.In))
    tree = ast.parse(__import__("zipfile").ZipFile(whl).read(MAIN["sglang"]).decode())
    table = next(n for n in tree.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "ALL_DECODER_LAYER_TYPES")
    built = {ast.literal_eval(k) for k in table.value.keys}
    return built | ({*mapped} if "attention" in built else set())


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_layer_kinds_built_are_the_wheels(rules, release):
    assert set(rules["layer_kinds"]["builds"]) == sglang_built_kinds(engine_wheel(rules, release))


# modules as both engines build them, under the checkpoint's names (sglang matches the exclude list as written,
# vLLM maps modules and list alike): attention and Gated DeltaNet packed, the PLE's projections, the indexer,
# the draft's layer and input projections
MODULES = ["model.language_model.layers.1.self_attn.qkv_proj", "model.language_model.layers.1.self_attn.o_proj",
           "model.language_model.layers.1.self_attn.indexer.index_qk_proj",
           "model.language_model.layers.0.linear_attn.in_proj_qkvz",
           "model.language_model.layers.0.linear_attn.in_proj_ba", "model.language_model.layers.0.ple.key_proj",
           "model.language_model.layers.0.ple.value_proj", "model.language_model.layers.0.mlp.experts",
           "model.language_model.layers.0.mlp.shared_expert.gate_up_proj", "mtp.layers.0.self_attn.qkv_proj",
           "mtp.layers.0.mlp.experts"]
STORED = ["model.language_model.layers.1.self_attn.q_proj", "model.language_model.layers.1.self_attn.k_proj",
          "model.language_model.layers.1.self_attn.v_proj", "model.language_model.layers.1.self_attn.o_proj",
          "model.language_model.layers.1.self_attn.qkv_proj",
          "model.language_model.layers.1.self_attn.indexer.index_qk_proj",
          "model.language_model.layers.0.linear_attn.in_proj_qkv",
          "model.language_model.layers.0.linear_attn.in_proj_z",
          "model.language_model.layers.0.linear_attn.in_proj_b", "model.language_model.layers.0.linear_attn.in_proj_a",
          "model.language_model.layers.0.ple.key_proj", "model.language_model.layers.0.ple.value_proj",
          "model.language_model.layers.0.mlp.experts.0.gate_proj", "model.language_model.layers.0.mlp.experts",
          "model.language_model.layers.0.mlp.shared_expert.gate_proj",
          "model.language_model.layers.0.mlp.shared_expert.up_proj", "mtp.layers.0.self_attn.q_proj",
          "mtp.layers.0.self_attn.k_proj", "mtp.layers.0.self_attn.v_proj", "mtp.layers.0.mlp.experts"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists as written (sglang's hf_to_sglang_mapper is None): the replay decides every module as
    the wheel's own should_ignore_layer with the class's packed mapping, mixed shards included."""
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = wheel_packed(whl, "sglang", "quark")
    rng = random.Random(f"qwen4_exp{release}")
    seen = 0
    for _ in range(150):
        listed = rng.sample(STORED, rng.randint(0, len(STORED)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        for name in MODULES:
            moe = name.endswith(".experts")
            theirs = _outcome(engine, name, listed, fused, moe)
            assert _outcome(excluded, name, ours, rules, "quark", moe) == theirs, (release, name, listed)
            seen += theirs is True
    assert seen > 100


@pytest.mark.parametrize("engine", ENGINES)
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.20 (models/qwen4_exp.py), vLLM from 0.29.0 (models/qwen4_exp/): every
    release of the window that has the class is read, carried or needs reading (NOTES.md names it); none before."""
    path = {"sglang": MAIN["sglang"], "vllm": "vllm/models/qwen4_exp/__init__.py"}[engine]
    first = {"sglang": "0.5.20", "vllm": "0.29.0"}[engine]
    for release in (window(engine)[0], first, max(releases_read(engine, FAMILY), key=Version)):
        try:
            names = set(__import__("zipfile").ZipFile(wheel(engine, release)).namelist())
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (path in names) == (Version(release) >= Version(first)), release
    notes = " ".join((Path(__file__).parents[2] / "manifests/families/qwen4_exp/NOTES.md").read_text().split())
    assert f"first appears in {first}" in notes
    for release, state in release_states(engine, FAMILY).items():
        built = Version(release) >= Version(first)
        assert (state.state != "not built") == built, (release, state)


# --- the tiny checkpoint and an incident, in real processes ----------------------------------------------


def gate(*args) -> subprocess.CompletedProcess:
    """``gate checkpoint`` in this process (its entry point, output captured), so a rule mutated in memory
    (tests/benchmarks/mutation_engines.py) reaches it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = gate_main(["checkpoint", *map(str, args)])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """quantgate's MXFP4 conversion of the tiny checkpoint, and the same output with config.json's layer kinds
    as transformers' Qwen4ExpTextConfig writes them on save (indexed_attention for the release's full_attention)."""
    root = tmp_path_factory.mktemp("qwen4_exp")
    src = write_family_checkpoint(root / "bf16", FAMILY, num_hidden_layers=LAYERS)
    ours = root / "mxfp4"
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", str(src), str(ours)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    resaved = root / "resaved"
    shutil.copytree(ours, resaved)
    config = json.loads((ours / "config.json").read_text())
    text = config["text_config"]
    assert "full_attention" in text["layer_types"]
    text["layer_types"] = ["indexed_attention" if k == "full_attention" else k for k in text["layer_types"]]
    (resaved / "config.json").write_text(json.dumps(config, indent=2))
    return ours, resaved


def test_the_tiny_checkpoint_loads_in_the_newest_releases(converted):
    ours, _ = converted
    for engine in ("sglang==0.5.23", "sglang==0.5.21", "vllm==0.34.0"):
        done = gate(ours, "--engine", engine)
        assert done.returncode == 0 and "verdict: loads correctly" in done.stdout, done.stdout + done.stderr


def test_sglang_0_5_21_has_no_layer_for_the_kind_transformers_writes(converted):
    """A config.json re-saved by transformers 5.25 names the indexed layers indexed_attention: sglang 0.5.21's
    layers_block_type passes the kind through and its decoder-layer table has none (KeyError at load); 0.5.22
    maps it to attention."""
    _, resaved = converted
    failed = gate(resaved, "--engine", "sglang==0.5.21")
    assert failed.returncode == 1 and "indexed_attention" in failed.stdout and "layer_types" in failed.stdout, \
        failed.stdout + failed.stderr
    for engine in ("sglang==0.5.22", "sglang==0.5.23"):
        done = gate(resaved, "--engine", engine)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_release_before_the_class_is_refused(converted):
    """sglang 0.5.19 has no models/qwen4_exp.py: it cannot serve the family, and is never replayed."""
    ours, _ = converted
    refused = gate(ours, "--engine", "sglang==0.5.19")
    assert refused.returncode == 2 and "0.5.19" in refused.stderr and "Traceback" not in refused.stderr


def test_vllm_0_33_0_misses_the_drafts_quark_entries_and_packs_the_indexer_with_qkv(converted, tmp_path):
    """vLLM 0.32.0-0.33.0: the draft's layer is built as mtp.layers.3 and only FP8's skip list is shifted to it, so
    a Quark list's mtp.layers.0.* entries name no draft module (its bf16 shared expert is looked up as MXFP4);
    and index_qk_proj is a fourth shard of qkv_proj, so FP8 attention beside a bf16 indexer is mixed. 0.34.0
    shifts Quark's list too and fuses the indexer only when it takes q/k/v's quant method."""
    ours, _ = converted
    failed = gate(ours, "--engine", "vllm==0.33.0")
    assert failed.returncode == 1 and "mtp.layers.0.mlp.shared_expert.gate_up_proj" in failed.stdout, \
        failed.stdout + failed.stderr
    without_draft = gate(ours, "--engine", "vllm==0.33.0", "--no-speculative")
    assert without_draft.returncode == 0, without_draft.stdout + without_draft.stderr
    src = write_family_checkpoint(tmp_path / "bf16", FAMILY, num_hidden_layers=LAYERS)
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "fp8", "-q", str(src), str(tmp_path / "fp8")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert gate(tmp_path / "fp8", "--engine", "vllm==0.33.0").returncode == 0  # the indexer FP8 as q/k/v
    mixed = indexer_kept_bf16(src, tmp_path / "fp8", tmp_path / "mixed")
    failed = gate(mixed, "--engine", "vllm==0.33.0", "--no-speculative")
    assert failed.returncode == 1 and "self_attn.indexer.index_qk_proj" in failed.stdout, failed.stdout + failed.stderr
    for folder in (ours, mixed):
        done = gate(folder, "--engine", "vllm==0.34.0")
        assert done.returncode == 0, done.stdout + done.stderr


def indexer_kept_bf16(src: Path, fp8: Path, dst: Path) -> Path:
    """``fp8`` with every QSA indexer projection bf16 again (the source's weight, no scale) and listed as not
    converted: the checkpoint a quantizer writes that skips indexers."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(fp8, dst)
    source = {}
    for file in src.glob("*.safetensors"):
        source.update(load_file(str(file)))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    kept = sorted({n.rsplit(".", 1)[0] for n in index["weight_map"] if ".indexer.index_qk_proj." in n})
    total = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(dst / file))
        for module in kept:
            if tensors.pop(f"{module}.weight_scale_inv", None) is not None:
                tensors[f"{module}.weight"] = source[f"{module}.weight"]
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.endswith("_proj.weight_scale_inv")
                           or ".indexer." not in n}
    index["metadata"]["total_size"] = total
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] += kept
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
