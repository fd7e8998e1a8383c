"""Differential tests for dots.note (``dots3_note``, Dots3NoteForCausalLM): each release of the window read or
carried (``manifests/families/dots3_note/{sglang,vllm}.yaml``) decides with its own code beside ``quant.engines``:
the prefixes the classes build their modules under, the packed-modules mappings and weight mappers read from the
same wheel (sglang's class has none; vLLM's ``hf_to_vllm_mapper`` run as vLLM's own ``WeightsMapper``), the draft's
names (sglang ``model.heads.0.*``, vLLM ``model.layers.N.*``), Quark's ``should_ignore_layer`` on the list each
engine matches, sglang's shared-expert fusion decision; and the releases that build the class at all. Then the
tiny checkpoint converted and ``gate checkpoint`` run in real processes: an exclude list in the stored names only
(a Quark export's) is missed by sglang's main model (built under ``thinker.language_model``) and by vLLM's draft
(the class's mapper renames every ``model.*`` entry away from it); quantgate's own list, with the built names and
the draft's ``re:`` entries, loads in every release read.
"""

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
from pathlib import Path

import pytest
from packaging.version import Version

from evals.cli import main as gate_main
from quant.cli import main as quantize
from quant.engines import ENGINES
from quant.engines.fusion import no_fusion_reason
from quant.engines.match import Exclude
from quant.engines.replay import (
    class_name,
    draft_exclude,
    draft_name,
    exclude_entries,
    excluded,
)
from quant.engines.rules import release_states, releases_read, select, window
from quant.engines.serving import serving
from tests.quant.engine_sources import (
    class_constant,
    class_def,
    load,
    method_def,
    methods,
    sglang_quark_loader_additions,
    source,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel, wheel

FAMILY = "dots3_note"
CLASS = "Dots3NoteForCausalLM"
SGLANG_MODEL = "sglang/srt/models/dots3_common/modeling.py"
SGLANG_NEXTN = "sglang/srt/models/dots3_common/nextn.py"
VLLM_MAIN = "vllm/models/dots3_note/nvidia/multimodal.py"
VLLM_MTP = "vllm/models/dots3_note/nvidia/mtp.py"
FIRST = {"sglang": "0.5.19", "vllm": "0.28.0"}  # the first releases that register the class
LAYERS = 3  # the tiny checkpoint's decoder layers; its MTP layer is layer 3
CASES = [(select(f"{e}=={v}", FAMILY)[0], v) for e in ENGINES for v in window_sample(e, FAMILY)]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
VLLM = [c for c in CASES if c[0].engine == "vllm"]

# exclude entries as a Quark export writes them (the stored module names), with the engines' own names beside
STORED = ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
          "model.layers.0.self_attn.g_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
          "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.shared_experts.gate_proj",
          "model.layers.1.mlp.shared_experts.up_proj", "model.layers.3.eh_proj", "model.layers.3.self_attn.q_a_proj",
          "model.layers.3.self_attn.kv_a_proj_with_mqa", "model.layers.3.self_attn.g_proj", "lm_head",
          "thinker.language_model.model.layers.0.self_attn.fused_qkv_a_g_proj_with_mqa",
          "thinker.language_model.model.layers.1.mlp.experts", "model.heads.0.eh_proj",
          "model.heads.0.decoder.self_attn.q_a_proj", "model.heads.0.decoder.self_attn.kv_a_proj_with_mqa",
          "model.heads.0.decoder.self_attn.g_proj", "model.layers.0.self_attn.fused_qkv_a_proj",
          "model.layers.1.mlp.shared_experts.gate_up_proj", r"re:model\.layers\.3\.eh_proj$",
          r"re:model\.layers\.3\.self_attn\.fused_qkv_a_proj$", "model.layers.3"]
# the modules each engine builds and looks up: main model, then the draft
MODULES = {"sglang": (["thinker.language_model.model.layers.0.self_attn.fused_qkv_a_g_proj_with_mqa",
                       "thinker.language_model.model.layers.0.mlp.gate_up_proj",
                       "thinker.language_model.model.layers.1.mlp.experts",
                       "thinker.language_model.model.layers.1.mlp.shared_experts.gate_up_proj"],
                      ["model.heads.0.eh_proj", "model.heads.0.decoder.self_attn.fused_qkv_a_g_proj_with_mqa"]),
           "vllm": (["language_model.model.layers.0.self_attn.fused_qkv_a_proj",
                     "language_model.model.layers.0.mlp.gate_up_proj", "language_model.model.layers.1.mlp.experts",
                     "language_model.model.layers.1.mlp.shared_experts.gate_up_proj"],
                    ["model.layers.3.eh_proj", "model.layers.3.self_attn.fused_qkv_a_proj"])}


def prefix_call(fn: ast.FunctionDef, attr: str) -> str:
    """The literal first argument of ``add_prefix("<x>", prefix)`` in ``self.<attr> = Cls(..., prefix=...)``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == f"self.{attr}":
            for kw in node.value.keywords:
                if kw.arg == "prefix" and isinstance(kw.value, ast.Call):
                    return ast.literal_eval(kw.value.args[0])
    raise LookupError(attr)


def sglang_prefix(whl) -> str:
    """The prefix sglang builds the text model under: thinker, then language_model, then model."""
    parts = [prefix_call(method_def(class_def(whl, SGLANG_MODEL, cls), "__init__"), attr) for cls, attr in
             (("DotsNoteOmniForConditionalGeneration", "thinker"),
              ("DotsNoteOmniThinkerForConditionalGeneration", "language_model"),
              ("Dots3LanguageModelForCausalLM", "model"))]
    return ".".join(parts) + "."


def sglang_quark_mapping(whl) -> dict[str, list[str]]:
    """The dict QuarkConfig holds: the class body's literal (one object shared by the text model and the entry
    class), the loader's Quark additions, then what Dots3LanguageModelForCausalLM.__init__ writes into it."""
    text = class_def(whl, SGLANG_MODEL, "Dots3LanguageModelForCausalLM")
    mapping = dict(class_constant(text, "packed_modules_mapping"))
    assert ast.unparse(next(s.value for s in class_def(whl, SGLANG_MODEL, "DotsNoteOmniForConditionalGeneration").body
                            if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "packed_modules_mapping")) \
        == "Dots3LanguageModelForCausalLM.packed_modules_mapping"
    mapping.update(sglang_quark_loader_additions(whl))
    for node in ast.walk(method_def(text, "__init__")):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) and \
                ast.unparse(node.targets[0].value) == "self.packed_modules_mapping":
            mapping[ast.literal_eval(node.targets[0].slice)] = ast.literal_eval(node.value)
    return {k: list(v) for k, v in mapping.items()}


def vllm_mapper(whl):
    """vLLM's own WeightsMapper built from the class's literal."""
    path = "vllm/model_executor/models/utils.py"
    shards = ["ShardIds", "ShardId"] if "ShardIds" in source(whl, path) else []  # 0.31.0 on
    utils = load(whl, path, ["WeightsMapper", *shards], {"TypeAlias": typing.TypeAlias, "replace": dataclasses.replace})
    node = class_def(whl, VLLM_MAIN, CLASS)
    assign = next(s for s in node.body
                  if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "hf_to_vllm_mapper")
    return utils["WeightsMapper"](**{k.arg: ast.literal_eval(k.value) for k in assign.value.keywords})


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mappings_are_the_wheels(rules, release):
    """sglang: Quark's mapping is the loader's additions and the fused q/kv/g projection __init__ writes into the
    class's dict; FP8's is empty (the dict is still empty when Fp8Config.from_config copies it). vLLM: neither the
    class nor its bases define one, so both kinds hold none."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        assert rules["quark_fused"] == sglang_quark_mapping(whl)
        assert class_constant(class_def(whl, SGLANG_MODEL, "Dots3LanguageModelForCausalLM"),
                              "packed_modules_mapping") == {} == rules["fp8_skip"]["fused"]
        return
    node = class_def(whl, VLLM_MAIN, CLASS)
    assert [ast.unparse(b) for b in node.bases] == ["nn.Module", "SupportsMultiModal", "SupportsPP"]
    assert class_constant(node, "packed_modules_mapping") is None
    for base in ("SupportsMultiModal", "SupportsPP"):
        assert class_constant(class_def(whl, "vllm/model_executor/models/interfaces.py", base),
                              "packed_modules_mapping") is None
    assert rules["quark_fused"] == {} == rules["fp8_skip"]["fused"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_module_names_are_the_classes(rules, release):
    """sglang: the prefixes the entry class hands down (thinker.language_model.model.*) and no mapper of the
    exclude list; vLLM: the class's hf_to_vllm_mapper renames a stored name to the module it loads into."""
    whl = engine_wheel(rules, release)
    weights = ["model.layers.0.self_attn.q_a_proj", "model.layers.1.mlp.experts", "lm_head",
               "vision_encoder.blocks.0.attn.qkv", "audio_encoder.layers.0.fc1"]
    if rules.engine == "sglang":
        prefix = sglang_prefix(whl)
        assert prefix == "thinker.language_model.model."
        assert class_name(weights[0], rules) == prefix + weights[0].removeprefix("model.")
        assert class_name("lm_head", rules) == prefix.removesuffix("model.") + "lm_head"
        for cls in ("DotsNoteOmniForConditionalGeneration", CLASS):
            assert not any(isinstance(s, ast.Assign) and "hf_to_sglang_mapper" in ast.unparse(s.targets[0])
                           for s in class_def(whl, SGLANG_MODEL, cls).body)
        assert rules["exclude_mapper"] is None
        return
    mapper = vllm_mapper(whl)
    for module in weights:
        assert class_name(module, rules) + ".weight" == mapper._map_name(module + ".weight"), module
        assert exclude_entries({"exclude": [module]}, rules, "quark") == mapper.apply_list([module]), module


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_draft_names_are_the_loaders(rules, release):
    """sglang: Dots3LanguageModelForCausalLM.load_weights with is_nextn puts the MTP layer's own parts under
    model.heads.{k} and the rest under model.heads.{k}.decoder (one head: Dot3NoteModelNextN); vLLM's
    Dots3NoteMultiTokenPredictor keeps model.layers.{idx}."""
    whl = engine_wheel(rules, release)
    draft = ["model.layers.3.eh_proj", "model.layers.3.shared_head.norm", "model.layers.3.self_attn.q_a_proj",
             "model.layers.3.mlp.gate_proj"]
    if rules.engine == "vllm":
        layer = method_def(class_def(whl, VLLM_MTP, "Dots3NoteMultiTokenPredictor"), "__init__")
        assert 'f"{prefix}.layers.{idx}"' in ast.unparse(layer).replace("'", '"')
        assert [draft_name(n, rules, LAYERS) for n in draft] == draft
        return
    fn = method_def(class_def(whl, SGLANG_MODEL, "Dots3LanguageModelForCausalLM"), "load_weights")
    spec = next(ast.literal_eval(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "nextn_spec_weight_names")
    naming = rules["mtp_naming"]
    assert sorted(naming["top_level"]) == sorted(spec)
    targets = {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.JoinedStr)}
    assert {"f'model.heads.{head_idx}'", "f'model.heads.{head_idx}.decoder'"} <= targets
    heads = method_def(class_def(whl, SGLANG_NEXTN, "Dot3NoteModelNextN"), "__init__")
    assert "add_prefix('heads.0', prefix)" in ast.unparse(heads)  # one head: head_idx 0
    assert naming["top_level_as"] == "model.heads.0." and naming["decoder_as"] == "model.heads.0.decoder."
    assert [draft_name(n, rules, LAYERS) for n in draft] == [
        "model.heads.0.eh_proj", "model.heads.0.shared_head.norm", "model.heads.0.decoder.self_attn.q_a_proj",
        "model.heads.0.decoder.mlp.gate_proj"]


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_the_indexer_is_built_as_the_rule_says(rules, release):
    """sglang's Dots3AttentionMLA builds the DSA indexer with the quant config and is_neox_style=False, the
    interleaved rope under which dsa_indexer.py fuses wk with weights_proj (bf16) on CUDA, whatever config.json
    says."""
    whl = engine_wheel(rules, release)
    fn = method_def(class_def(whl, SGLANG_MODEL, "Dots3AttentionMLA"), "__init__")
    call = next(n.value for n in ast.walk(fn)
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.indexer")
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert keywords["quant_config"] == "quant_config" and keywords["is_neox_style"] == "False"
    indexer = rules["indexer"]
    assert indexer["wq_b"] == indexer["wk"] == "quant_config" and indexer["interleaved_always"]
    fusion = ast.unparse(method_def(class_def(whl, "sglang/srt/layers/attention/dsa/dsa_indexer.py", "Indexer"),
                                    "__init__"))
    assert "not is_neox_style" in fusion and indexer["wk_fused_bf16_on_cuda"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists: the replay decides every main and draft module as the wheel's own
    should_ignore_layer on the list the engine matches (sglang: as written, the draft sharing it; vLLM: the
    class's WeightsMapper applied, the draft sharing the mapped list)."""
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = sglang_quark_mapping(whl) if rules.engine == "sglang" else {}
    theirs_list = vllm_mapper(whl).apply_list if rules.engine == "vllm" else list
    main, draft = MODULES[rules.engine]
    rng = random.Random(f"dots3_note{release}")
    seen = 0
    for _ in range(150):
        listed = rng.sample(STORED, rng.randint(0, len(STORED)))
        ours = Exclude(exclude_entries({"exclude": listed}, rules, "quark"))
        ours_draft, whole_bf16 = draft_exclude(ours.entries, rules, FAMILY, LAYERS, "quark", raw=listed)
        assert not whole_bf16
        for modules, entries in ((main, ours), (draft, Exclude(ours_draft))):
            for name in modules:
                moe = name.endswith(".experts")
                theirs = _outcome(engine, name, theirs_list(listed), fused, moe)
                assert _outcome(excluded, name, entries, rules, "quark", moe) == theirs, (release, name, listed)
                seen += theirs is True
    assert seen > 100


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_shared_expert_fusion_decisions_are_the_wheels(rules, release):
    """The class's own shared_experts_fusion_disable_reason (hardware and parallel state stubbed): fused on CUDA
    sm80+ at the release's 256 routed + 1 shared experts under its architecture, without expert parallelism,
    whatever the exclude list says; never on ROCm nor at the tiny geometry."""
    whl = engine_wheel(rules, release)
    quark = types.SimpleNamespace(get_name=lambda: "quark")
    for routed, arch in ((256, CLASS), (4, CLASS), (256, "Dots3NoteForConditionalGeneration")):
        text = {"n_routed_experts": routed, "n_shared_experts": 1, "architectures": [arch]}
        for platform, sm, ep in (("cuda", 90, 1), ("cuda", 80, 1), ("cuda", 75, 1), ("cuda", 90, 8), ("rocm", 0, 1)):
            parallel = types.SimpleNamespace(moe_ep_size=ep)
            torch_stub = types.SimpleNamespace(cuda=types.SimpleNamespace(
                get_device_capability=lambda _device, sm=sm: (sm // 10, sm % 10)))
            stubs = {"_is_cuda": platform == "cuda", "torch": torch_stub, "get_parallel": lambda p=parallel: p}
            decide = methods(whl, SGLANG_MODEL, "Dots3LanguageModelForCausalLM",
                             ["shared_experts_fusion_disable_reason", "fused_shared_experts_architecture"], stubs)
            theirs = decide["cls"].shared_experts_fusion_disable_reason(types.SimpleNamespace(**text), quark)
            setup = serving(platform, tp=8, ep=ep, gpu_arch={90: "sm90", 80: "sm80", 75: "sm75", 0: "gfx950"}[sm])
            ours = no_fusion_reason(rules, FAMILY, text, "quark", [], setup, draft=False)
            assert (ours is None) == (theirs is None), (release, routed, arch, platform, sm, ep, ours, theirs)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_releases_that_build_the_class_are_the_ones_read_or_named(engine):
    """sglang builds the class from 0.5.19 (models/dots3.py), vLLM from 0.28.0 (vllm/models/dots3_note/): every
    release of the window that has the class is read or listed in NOTES.md as not read; none before it."""
    path = {"sglang": "sglang/srt/models/dots3.py", "vllm": "vllm/models/dots3_note/__init__.py"}[engine]
    read = releases_read(engine, FAMILY)
    notes = " ".join((Path(__file__).parents[2] / "manifests/families/dots3_note/NOTES.md").read_text().split())
    for release in (window(engine)[0], FIRST[engine], max(read, key=Version)):
        try:
            names = set(_names(wheel(engine, release)))
        except OSError as exc:
            pytest.skip(f"cannot obtain {engine}=={release}: {exc}")
        assert (path in names) == (Version(release) >= Version(FIRST[engine])), release
    states = release_states(engine, FAMILY)
    for release in window(engine):
        if Version(release) >= Version(FIRST[engine]):
            assert release in read or release in notes, release
            assert states[release].state in ("read", "carried", "needs reading"), states[release]
        else:
            assert states[release].state == "not built", states[release]


def _names(whl) -> list[str]:
    import zipfile

    with zipfile.ZipFile(whl) as z:
        return z.namelist()


# --- the tiny checkpoint converted and gated: the CLI's own entry points (in this process, so the rule mutations of
# tests/benchmarks/engine_mutations/dots3_note.py reach them), and one conversion in a real process -------------


def gate(capsys, *args) -> tuple[int, str]:
    code = gate_main(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


def with_exclude(src: Path, dst: Path, keep) -> Path:
    """A copy of ``src`` whose exclude list keeps the entries ``keep`` accepts."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"] if keep(e)]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """quantgate's own MXFP4 conversion of the tiny checkpoint (every engine's names), and the same checkpoint
    with the exclude list a Quark export writes: the stored module names only."""
    root = tmp_path_factory.mktemp("dots3_note")
    src = write_family_checkpoint(root / "bf16", FAMILY, num_hidden_layers=LAYERS)
    assert quantize(["--to", "mxfp4", "-q", str(src), str(root / "ours")]) == 0
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    modules = {n.rsplit(".", 1)[0] for n in index}
    return src, root / "ours", with_exclude(root / "ours", root / "stored", lambda e: e in modules)


def test_quantgates_own_exclude_list_loads_in_every_release_read(converted, capsys):
    """quantgate writes sglang's thinker.language_model.* and model.heads.0.* names and vLLM's draft as re:
    entries: the conversion loads in every release read, with the MTP draft; decoded in a real process, it
    gives back the release's names."""
    src, ours, _ = converted
    exclude = json.loads((ours / "config.json").read_text())["quantization_config"]["exclude"]
    assert {"thinker.language_model.model.layers.0.self_attn.fused_qkv_a_g_proj_with_mqa", "model.heads.0.eh_proj",
            r"re:model\.layers\.3\.eh_proj$",
            "language_model.model.layers.0.self_attn.fused_qkv_a_proj"} <= set(exclude)
    code, text = gate(capsys, ours)
    assert code == 0 and "verdict: loads correctly" in text, text
    decoded = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "bf16", "-q", str(ours),
                              str(ours.parent / "decoded")], capture_output=True, text=True, timeout=300)
    assert decoded.returncode == 0, decoded.stdout + decoded.stderr
    names = json.loads((ours.parent / "decoded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(names) == set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])


def test_a_stored_name_exclude_list_misses_sglangs_thinker_modules(converted, capsys):
    """sglang builds the text model under thinker.language_model and maps no exclude entry: a list in the stored
    names only leaves the bf16 attention, indexer and draft eh_proj looked up as MXFP4 (FP8 would still find
    them); the router is built without the quant config either way."""
    _, _, stored = converted
    code, text = gate(capsys, stored, "--engine", "sglang==0.5.23")
    assert code == 1, text
    assert "thinker.language_model.model.layers.0.self_attn.fused_qkv_a_g_proj_with_mqa" in text
    assert "model.heads.0.eh_proj" in text and ".mlp.gate\n" not in text


def test_vllm_matches_fused_modules_by_their_own_names_only(converted, capsys):
    """vLLM: the class hands the quant config no packed-modules mapping, so the stored shard names never
    exclude fused_qkv_a_proj or gate_up_proj: a stored-name list fails the main model, draft or not."""
    _, _, stored = converted
    for args in ((), ("--no-speculative",)):
        code, text = gate(capsys, stored, "--engine", "vllm==0.34.0", *args)
        assert code == 1, text
        assert "language_model.model.layers.0.self_attn.fused_qkv_a_proj" in text
        assert "language_model.model.layers.1.mlp.shared_experts.gate_up_proj" in text


def test_vllms_draft_is_reached_by_re_entries_only(converted, tmp_path, capsys):
    """vLLM: the class's mapper renames model.layers.3.* (stored or written again) to language_model.model.*, so
    without its re: entries quantgate's list leaves the draft's bf16 modules looked up as MXFP4; without the
    draft it loads."""
    _, ours, _ = converted
    plain = with_exclude(ours, tmp_path / "plain", lambda e: not e.startswith("re:"))
    code, text = gate(capsys, plain, "--engine", "vllm==0.34.0")
    assert code == 1 and "model.layers.3.eh_proj" in text and "language_model.model.layers.0" not in text, text
    code, text = gate(capsys, plain, "--engine", "vllm==0.34.0", "--no-speculative")
    assert code == 0, text


def test_fp8_quantizes_the_drafts_input_projection(converted, tmp_path, capsys):
    """FP8 ignored_layers match exactly (no re: entries): the fp8-block recipe quantizes dots.note's eh_proj,
    which both engines build with the quant config, so the draft loads in vLLM too."""
    src, _, _ = converted
    assert quantize(["--to", "fp8", "-q", str(src), str(tmp_path / "fp8")]) == 0
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.3.eh_proj.weight_scale_inv" in index
    for engine in ("sglang==0.5.23", "vllm==0.34.0"):
        code, text = gate(capsys, tmp_path / "fp8", "--engine", engine)
        assert code == 0, text


def test_the_indexer_and_router_as_each_engine_builds_them(converted, tmp_path, capsys):
    """Without their exclude entries: sglang looks the DSA indexer's wq_b and (off CUDA) wk up with the quant
    config, vLLM wq_b only (wk and weights_proj fused bf16); neither builds the router with it."""
    _, ours, _ = converted
    no_indexer = with_exclude(ours, tmp_path / "no_indexer", lambda e: ".indexer." not in e)
    layer = "model.layers.0.self_attn.indexer"
    for engine, prefix, looked_up, kept in (("sglang==0.5.23", "thinker.language_model.", ["wq_b", "wk"], []),
                                            ("vllm==0.34.0", "language_model.", ["wq_b"], ["wk"])):
        code, text = gate(capsys, no_indexer, "--engine", engine)
        assert code == 1, text
        assert all(f"{prefix}{layer}.{leaf}\n" in text for leaf in looked_up), text
        assert not any(f"{layer}.{leaf}" in text for leaf in [*kept, "weights_proj"]), text
    # on CUDA sglang fuses wk with weights_proj into a bf16 wk_weights_proj: wq_b alone is looked up
    code, text = gate(capsys, no_indexer, "--engine", "sglang==0.5.23", "--platform", "cuda", "--gpu-arch", "sm90")
    assert code == 1 and f"{layer}.wq_b\n" in text and f"{layer}.wk\n" not in text, text
    no_router = with_exclude(ours, tmp_path / "no_router", lambda e: not e.endswith((".mlp.gate", r"mlp\.gate$")))
    code, text = gate(capsys, no_router)
    assert code == 0, text


def test_the_fp8_recipe_quantizes_eh_proj_only_where_the_family_lets_it():
    """The fp8-block recipe's quantizable_only rule: dots.note's eh_proj (built with the quant config by both
    engines) is quantized; GLM-4.5's (vLLM's plain bf16 Linear, quantizable: false) is kept, not refused."""
    from quant.layout import family_named
    from quant.recipe import load_recipe

    recipe = load_recipe(to="fp8")
    assert recipe.action(family_named(FAMILY).classify("model.layers.3.eh_proj.weight", LAYERS)) == "quantize"
    assert recipe.action(family_named("glm4_moe").classify("model.layers.3.eh_proj.weight", LAYERS)) == "keep"


def test_a_release_before_the_class_is_refused(converted, capsys):
    """sglang 0.5.18 has no models/dots3.py: it cannot serve the family, and is never replayed."""
    _, ours, _ = converted
    code, text = gate(capsys, ours, "--engine", "sglang==0.5.18")
    assert code == 2 and "0.5.18" in text and "Traceback" not in text and len(text.strip().splitlines()) == 1
