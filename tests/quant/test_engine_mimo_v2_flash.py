"""Differential tests for MiMo-V2-Flash (``mimo_v2_flash``, MiMoV2FlashForCausalLM): each release sampled from
the window (``window_sample``: every release read for ``manifests/families/mimo_v2_flash/{sglang,vllm}.yaml``,
and carried ones) decides with its own code beside ``quant.engines``: the class's packed-modules mapping,
Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` on random exclude lists over the main model's and
the draft's module names, the draft's own renaming (sglang ``MiMoV2MTP.map_model_name_to_mtp_param_name``), which
modules the constructors build without the quant config, and sglang's loader statement that renames a uint8
expert scale (so Quark MXFP4 experts cannot load there). Then the tiny checkpoint through the real CLI in its
own processes: MXFP4 refused without ``--serve`` and loading in vLLM only, FP8 loading in both, the decode
giving the release's names back, and two load failures rebuilt: an exclude list naming the MTP layer only as
stored (sglang's draft looks up model.mtp_block.*), and an FP8 MTP o_proj (vLLM builds it bf16).
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from evals.cli import main as gate_main
from quant.engines import ENGINES
from quant.engines.replay import draft_exclude, draft_layer, draft_name
from quant.engines.rules import release_states, select
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    method_def,
    methods,
    packed_mapping,
    parsed,
    source,
    window_sample,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import (
    _fp8_engine,
    _quark_engine,
    engine_wheel,
    fp8_disagreements,
    quark_disagreements,
)

FAMILY = "mimo_v2_flash"
CLASS = "MiMoV2FlashForCausalLM"
MAIN = {"sglang": "sglang/srt/models/mimo_v2.py", "vllm": "vllm/model_executor/models/mimo_v2.py"}
DRAFT = {"sglang": "sglang/srt/models/mimo_v2_nextn.py", "vllm": "vllm/model_executor/models/mimo_v2_mtp.py"}
CASES = [(select(f"{e}=={v}", FAMILY)[0], v) for e in ENGINES for v in window_sample(e, FAMILY)]
IDS = [f"{r.engine} {v}" for r, v in CASES]
SGLANG = [c for c in CASES if c[0].engine == "sglang"]
LAYERS = 3  # the tiny checkpoint's decoder layers: 0 full attention + dense, 1-2 sliding window + MoE
MTP = "model.mtp.layers.0."
# the draft's modules as each engine builds them (sglang: mimo_v2_nextn.py, vLLM: as stored)
DRAFT_MODULES = {"sglang": "model.mtp_block.", "vllm": MTP}
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _pool(engine: str) -> tuple[list[str], list[str]]:
    """Engine module names (main layers, the draft) and exclude entries the random lists draw from: stored names,
    fused names, the draft's names in both engines' styles, regexes and prefixes."""
    layers = ["model.layers.0.", "model.layers.1.", MTP, "model.mtp_block."]
    modules = [p + m for p in ("model.layers.0.", "model.layers.1.", DRAFT_MODULES[engine])
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    modules += ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    entries = ["lm_head", "re:.*experts.*", "re:model\\.mtp.*", "re:.*qkv_proj", "re:.*(q_proj|k_proj)", "self_attn",
               "model.mtp", "model.mtp_block", "experts", "model.layers.1", "re:.*mtp_block.*"]
    for p in layers:
        entries += [p + m for m in (*ATTENTION, *MLP, "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.experts",
                                    "mlp.experts.0.gate_proj", "mlp.experts.1.down_proj", "mlp.gate")]
    return modules, entries


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_wheels(rules, release):
    """sglang's class defines none (nor its base MiMoV2ForCausalLM): Quark gets the loader's additions only, so
    qkv_proj is looked up by its fused name; vLLM's class maps qkv_proj and gate_up_proj."""
    whl = engine_wheel(rules, release)
    if rules.engine == "sglang":
        assert class_constant(class_def(whl, MAIN["sglang"], "MiMoV2ForCausalLM"), "packed_modules_mapping") is None
    assert packed_mapping(whl, MAIN[rules.engine], CLASS, rules.engine, "quark") == rules["quark_fused"]
    assert packed_mapping(whl, MAIN[rules.engine], CLASS, rules.engine, "fp8") == rules["fp8_skip"]["fused"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_decisions_equal_the_engines(rules, release):
    """Random exclude lists: the replay decides every main and draft module as the wheel's should_ignore_layer,
    fed the mapping the quant config holds (neither class has a weight mapper: the lists are matched as
    written, by the draft too)."""
    whl = engine_wheel(rules, release)
    fused = packed_mapping(whl, MAIN[rules.engine], CLASS, rules.engine, "quark")
    modules, entries = _pool(rules.engine)
    disagree, seen = quark_disagreements(_quark_engine(rules, whl), rules, fused, modules, entries,
                                         random.Random(f"{FAMILY}{rules.id}{release}"), draws=150, most=14, names=4)
    assert not disagree, disagree[:3]
    assert seen > 20  # the cases reach both answers


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    fused = packed_mapping(whl, MAIN[rules.engine], CLASS, rules.engine, "fp8")
    modules, entries = _pool(rules.engine)
    entries = [e for e in entries if not e.startswith("re:")] + [e.removeprefix("model.") for e in entries[11:40]]
    disagree, _ = fp8_disagreements(_fp8_engine(rules, whl), rules["fp8_skip"], fused, modules, entries,
                                    random.Random(f"fp8{FAMILY}{rules.id}{release}"), draws=150, most=14, names=4)
    assert not disagree, disagree[:3]


# the MTP layer's Linear weights as the release stores them
DRAFT_WEIGHTS = [MTP + m + ".weight" for m in ("eh_proj", *ATTENTION, *MLP)]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_draft_class_and_names_are_the_engines(rules, release):
    """sglang: the draft config's architecture becomes MiMoV2MTP, whose own renaming of a stored MTP weight is
    the name the replay looks up (before stacking); vLLM: MiMoV2FlashForCausalLM's draft is MiMoV2MTPModel,
    built under model.mtp.layers (names as stored), one layer."""
    whl = engine_wheel(rules, release)
    assert [draft_layer(w, rules, LAYERS) for w in DRAFT_WEIGHTS] == [0] * len(DRAFT_WEIGHTS)
    assert draft_layer(f"model.layers.{LAYERS - 1}.mlp.gate_proj", rules, LAYERS) is None
    if rules.engine == "sglang":
        config = source(whl, "sglang/srt/configs/model_config.py")
        assert 'self.hf_config.architectures[0] = "MiMoV2MTP"' in config
        assert '"MiMoV2FlashForCausalLM"' in config[config.index("MIMO_V2_MODEL_ARCHS = ("):]
        rename = methods(whl, DRAFT["sglang"], "MiMoV2MTP", ["map_model_name_to_mtp_param_name"])["cls"]
        for weight in DRAFT_WEIGHTS:
            theirs = rename.map_model_name_to_mtp_param_name(None, weight)
            assert draft_name(weight.removesuffix(".weight"), rules, LAYERS) + ".weight" == theirs, weight
        return
    assert '"MiMoV2MTPModel": ("mimo_v2_mtp", "MiMoV2MTP")' in source(whl, "vllm/model_executor/models/registry.py")
    spec = source(whl, "vllm/config/speculative.py")
    assert 'if hf_config.architectures[0] == "MiMoV2FlashForCausalLM":' in spec and '["MiMoV2MTPModel"]' in spec
    init = ast.unparse(method_def(class_def(whl, DRAFT["vllm"], "MiMoV2MultiTokenPredictor"), "__init__"))
    assert "num_mtp_layers = 1" in init and "prefix=maybe_prefix(prefix, 'mtp.layers')" in init
    assert "maybe_prefix(prefix, 'model')" in ast.unparse(method_def(class_def(whl, DRAFT["vllm"], "MiMoV2MTP"),
                                                                     "__init__"))
    for weight in DRAFT_WEIGHTS:
        assert draft_name(weight.removesuffix(".weight"), rules, LAYERS) + ".weight" == weight


def _builds(whl, path: str, cls: str, attr: str):
    (built,) = attribute_builds(method_def(class_def(whl, path, cls), "__init__"), attr)
    return built


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_modules_built_without_the_quant_config_are_the_engines(rules, release):
    """Read in the constructors: eh_proj a plain Linear in both drafts; the router no quantized Linear; vLLM's
    MiMoV2Attention builds o_proj without the quant config under an mtp.layers prefix only (the MTP
    attention's role), sglang's draft layer takes it; the router bias always (vLLM) or for noaux_tc (sglang)."""
    whl = engine_wheel(rules, release)
    e = rules.engine
    unquantized = rules.values.get("unquantized_leaves") or {}
    if e == "vllm":
        eh = _builds(whl, DRAFT["vllm"], "MiMoV2MTPLayer", "eh_proj")
        assert eh.call == "ReplicatedLinear" and "quant_config" not in eh.keywords and rules["eh_proj"] == "plain"
        o_proj = _builds(whl, MAIN["vllm"], "MiMoV2Attention", "o_proj").keywords["quant_config"]
        assert o_proj == "quant_config if 'mtp.layers' not in prefix else None"
        assert unquantized == {"mtp_attention": ["o_proj"]}
        gate = _builds(whl, MAIN["vllm"], "MiMoV2MoE", "gate")
        assert gate.call == "GateLinear" and "quant_config" not in gate.keywords
        assert "router" in rules["unquantized_roles"]
        moe = method_def(class_def(whl, MAIN["vllm"], "MiMoV2MoE"), "__init__")
        bias = [ast.unparse(n.value.func) for n in moe.body if isinstance(n, ast.Assign)  # unconditional statements
                and ast.unparse(n.targets[0]) == "self.gate.e_score_correction_bias"]
        assert bias == ["nn.Parameter"] and rules["router"]["bias_when"] == "always"
        return
    eh = _builds(whl, DRAFT["sglang"], "MiMoV2ModelNextN", "eh_proj")
    assert eh.call == "nn.Linear" and rules["eh_proj"] == "plain"
    for attr in ("self_attn", "mlp"):
        assert _builds(whl, DRAFT["sglang"], "MiMoV2MTPLayer", attr).keywords["quant_config"] == "quant_config"
    assert not unquantized
    gate = attribute_builds(method_def(class_def(whl, MAIN["sglang"], "MoEGate"), "__init__"), "weight")
    assert [b.call for b in gate] == ["nn.Parameter"] and "router" in rules["unquantized_roles"]
    (bias,) = [b for b in attribute_builds(method_def(class_def(whl, MAIN["sglang"], "MoEGate"), "__init__"),
                                           "e_score_correction_bias") if b.call == "nn.Parameter"]
    assert bias.under == ["config.topk_method == 'noaux_tc'"] and rules["router"]["bias_when"] == "noaux_tc"


# the main model's and the draft's loader classes
LOADERS = {"sglang": ("MiMoV2ForCausalLM", DRAFT["sglang"], "MiMoV2MTP"),
           "vllm": ("MiMoV2Model", DRAFT["vllm"], "MiMoV2MTP")}


def _stacked(whl, path: str, cls: str) -> dict[str, list[str]]:
    """A loader's stacked_params_mapping literal as fused module -> its shards, in order."""
    fn = method_def(class_def(whl, path, cls), "load_weights")
    assign = next(n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
                  and ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target) == "stacked_params_mapping")
    fused: dict[str, list[str]] = {}
    for param, shard, _ in ast.literal_eval(assign.value):
        fused.setdefault(param, []).append(shard)
    return fused


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fused_modules_mappers_and_layers_are_the_loaders(rules, release):
    """What the class builds fused is what its loaders stack (main model and draft alike); neither the main class
    nor the draft has a weight mapper, so the draft matches the exclude list as written; no DSA indexer, no
    shared-expert fusion hook; MoE layers where config.moe_layer_freq says so."""
    whl = engine_wheel(rules, release)
    main, draft_path, draft = LOADERS[rules.engine]
    assert _stacked(whl, MAIN[rules.engine], main) == _stacked(whl, draft_path, draft) == rules["built_fused"]
    mapper = "hf_to_sglang_mapper" if rules.engine == "sglang" else "hf_to_vllm_mapper"
    assert mapper not in source(whl, MAIN[rules.engine]) and mapper not in source(whl, draft_path)
    # the pool, and entries a draft mapper or a whole-bf16-draft rule would act on (the decoder layer after the last,
    # a Qwen-style mtp.* prefix): neither engine's draft does
    entries = [*_pool(rules.engine)[1], f"model.layers.{LAYERS}.self_attn.q_proj", "mtp.layers.0.self_attn.q_proj"]
    for kind in ("quark", "fp8"):
        assert draft_exclude(entries, rules, FAMILY, LAYERS, kind) == (entries, False)
    assert "Indexer" not in source(whl, MAIN[rules.engine]) and rules["indexer"] is None
    assert "shared_experts_fusion_disable_reason" not in source(whl, MAIN[rules.engine])
    assert rules["shared_experts_fusion"] is None
    layer = "MiMoV2DecoderLayer" if rules.engine == "sglang" else "MiMoV2FlashDecoderLayer"
    sparse = ast.unparse(method_def(class_def(whl, MAIN[rules.engine], layer), "is_moe_layer"))
    assert "moe_layer_freq[layer_idx]" in sparse and rules["moe_layers"] == "config"


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_router_reads_are_the_keys_transformers_config_lacks(rules, release):
    """The config attributes the router code reads that transformers' MiMoV2FlashConfig does not define (a
    config.json without them raises at build): sglang's MoEGate / MiMoV2MoE, vLLM's MiMoV2MoE."""
    from transformers import MiMoV2FlashConfig

    whl = engine_wheel(rules, release)
    classes = ("MoEGate", "MiMoV2MoE") if rules.engine == "sglang" else ("MiMoV2MoE",)
    reads = {n.attr for cls in classes for n in ast.walk(method_def(class_def(whl, MAIN[rules.engine], cls),
                                                                    "__init__"))
             if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "config"}
    defined = MiMoV2FlashConfig()
    assert sorted(r for r in reads if not hasattr(defined, r)) == sorted(rules["router"]["reads"])


def _uint8_branch(whl) -> ast.If | None:
    """load_weights' statement that takes a uint8 routed-expert tensor for MiMo-V2's own MXFP4 layout."""
    fn = method_def(class_def(whl, MAIN["sglang"], "MiMoV2ForCausalLM"), "load_weights")
    return next((n for n in ast.walk(fn) if isinstance(n, ast.If) and "torch.uint8" in ast.unparse(n.test)), None)


def _quark_moe_parameters(whl) -> set[str]:
    """The parameters Quark's MXFP4 MoE method registers on a FusedMoE."""
    path = "sglang/srt/layers/quantization/quark/schemes/quark_w4a4_mxfp4_moe.py"
    return {ast.literal_eval(c.args[0]) for c in ast.walk(parsed(whl, path)) if isinstance(c, ast.Call)
            and ast.unparse(c.func) == "layer.register_parameter" and isinstance(c.args[0], ast.Constant)}


@pytest.mark.parametrize(("rules", "release"), SGLANG, ids=[f"sglang {v}" for _, v in SGLANG])
def test_expert_scale_rename_is_the_loaders(rules, release):
    """The wheel's own statement renames what a Quark MXFP4 export stores (uint8 weight_scale) and leaves an FP8
    export's float32 weight_scale_inv alone; the wheel's expert mapping then asks for a parameter Quark's MoE
    method never registers (KeyError): exactly the kinds ``expert_scales_renamed`` says fail."""
    whl = engine_wheel(rules, release)
    branch, rule = _uint8_branch(whl), rules["expert_scales_renamed"]
    assert branch is not None and rule is not None
    mapping = methods(whl, "sglang/srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE",
                      ["make_expert_params_mapping"])["cls"].make_expert_params_mapping("gate_proj", "down_proj",
                                                                                         "up_proj", 2)
    registered = _quark_moe_parameters(whl)
    stored = {"quark": ("model.layers.1.mlp.experts.0.gate_proj.weight_scale", torch.uint8),
              "fp8": ("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv", torch.float32)}
    for kind, (name, dtype) in stored.items():
        ns = {"torch": torch, "name": name, "loaded_weight": torch.zeros(2, dtype=dtype)}
        statement = ast.fix_missing_locations(ast.Module(body=[branch], type_ignores=[]))
        exec(compile(statement, "load_weights", "exec"), ns)  # noqa: S102 (the engine's own statement)
        param, weight_name, _, _ = next(m for m in mapping if m[1] in ns["name"])
        param = ns["name"].replace(weight_name, param).rsplit(".", 1)[-1]
        renamed = ns["name"] != name
        assert renamed == (kind in rule["fails"]), kind
        if renamed:
            assert ns["name"] == name.replace(rule["scale"], rule["renamed"]) and str(dtype) == f"torch.{rule['dtype']}"
            assert param not in registered and param.removesuffix("_inv") in registered


@pytest.mark.parametrize(("rules", "release"), [c for c in CASES if c[0].engine == "vllm"],
                         ids=[i for i in IDS if i.startswith("vllm")])
def test_vllm_loader_keeps_expert_scales(rules, release):
    whl = engine_wheel(rules, release)
    assert "torch.uint8" not in ast.unparse(method_def(class_def(whl, MAIN["vllm"], "MiMoV2Model"), "load_weights"))
    assert rules.values.get("expert_scales_renamed") is None


@pytest.mark.parametrize("engine", ENGINES)
def test_the_newest_releases_are_read(engine):
    """Both engines build the class in every window release; the newest are read, the rest say what changed."""
    states = release_states(engine, FAMILY)
    assert not [r for r, s in states.items() if s.state == "not built"]
    newest = ["0.5.21", "0.5.22", "0.5.23"] if engine == "sglang" else ["0.32.0", "0.33.0", "0.34.0"]
    assert all(states[r].state == "read" for r in newest)


# --- the tiny checkpoint through the real CLI, each command in its own process ---------------------------------

def run(module: str, *args) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          check=False, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp(FAMILY)
    return write_family_checkpoint(root / "bf16", FAMILY), root


@pytest.fixture(scope="module")
def fp8(tiny):
    """The tiny checkpoint converted by ``quantize --to fp8``."""
    src, root = tiny
    code, text = run("quant.cli", "--to", "fp8", "-q", src, root / "fp8")
    assert code == 0, text
    return root / "fp8"


def copied(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in folder.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def write_index_total(folder: Path) -> None:
    """The index's total_size as the tensors' bytes, after a shard was rewritten."""
    sizes = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "U8": 1}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = sum(sizes[d] * int(torch.Size(s).numel()) for d, s in headers(folder).values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
    return out


def gate(folder: Path, engine: str, capsys) -> tuple[int, str]:
    """``gate checkpoint`` in this process (the replay as imported here), its exit code and output."""
    code = gate_main(["checkpoint", str(folder), "--engine", engine])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_mxfp4_is_refused_without_serve_and_loads_in_vllm_only(tiny, capsys):
    src, root = tiny
    code, text = run("quant.cli", "--to", "mxfp4", src, root / "refused")
    assert code == 2 and "weight_scale_inv" in text and "--serve" in text and "Traceback" not in text, text
    assert not (root / "refused").exists()
    code, text = run("quant.cli", "--to", "mxfp4", "-q", "--serve", "vllm==0.34.0", src, root / "mxfp4")
    assert code == 0, text
    code, text = run("evals.cli", "checkpoint", root / "mxfp4", "--engine", "vllm==0.34.0")
    assert code == 0 and "verdict: loads correctly" in text, text
    code, text = run("evals.cli", "checkpoint", root / "mxfp4", "--engine", "sglang==0.5.23")
    assert code == 1 and "model.layers.1.mlp.experts" in text and "weight_scale_inv" in text, text
    for engine, expect in (("sglang==0.5.21", 1), ("sglang==0.5.22", 1), ("vllm==0.32.0", 0)):
        code, text = gate(root / "mxfp4", engine, capsys)
        assert code == expect and ("weight_scale_inv" in text) == bool(expect), (engine, text)
    assert "model.layers.0.mlp" not in text  # the dense layer's MLP is no FusedMoE: its scales are not renamed
    code, text = run("quant.cli", "--to", "bf16", "-q", root / "mxfp4", root / "decoded")
    assert code == 0, text
    assert {n: s for n, (_, s) in headers(root / "decoded").items()} == {n: s for n, (_, s) in headers(src).items()}


def test_fp8_loads_in_both_engines(fp8, capsys):
    stored = headers(fp8)
    # the MTP attention stays bf16 (vLLM builds its o_proj without quant config); its MLP and the main layers do not
    assert stored[MTP + "self_attn.o_proj.weight"][0] == "BF16" and stored[MTP + "mlp.down_proj.weight"][0] == "F8_E4M3"
    for engine in ("sglang==0.5.23", "sglang==0.5.21", "vllm==0.34.0", "vllm==0.32.0"):
        code, text = gate(fp8, engine, capsys)
        assert code == 0 and "verdict: loads correctly" in text, (engine, text)


def test_draft_entries_under_stored_names_only_fail_in_sglang(fp8, tmp_path, capsys):
    """An FP8 export listing the MTP layer only as stored (model.mtp.layers.0.*), as a quantizer that knows the
    checkpoint's names writes it: sglang's draft looks up model.mtp_block.* and finds them quantized, so the bf16
    attention cannot load; vLLM's draft keeps the stored names and loads."""
    out = copied(fp8, tmp_path / "stored-names")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    qc["modules_to_not_convert"] = [e for e in qc["modules_to_not_convert"] if not e.startswith("model.mtp_block.")]
    (out / "config.json").write_text(json.dumps(config))
    code, text = run("evals.cli", "checkpoint", out, "--engine", "sglang==0.5.23")
    assert code == 1 and "model.mtp_block.self_attn.qkv_proj" in text, text
    code, text = gate(out, "vllm==0.34.0", capsys)
    assert code == 0, text
    code, text = gate(out, "sglang==0.5.21", capsys)
    assert code == 1 and "model.mtp_block.mlp" not in text, text  # the MTP MLP is FP8 and built quantized


def test_an_fp8_mtp_o_proj_fails_in_vllm(fp8, tmp_path, capsys):
    """The MTP layer's o_proj stored FP8 (block scales beside it, no exclude entry): vLLM builds it without
    quant config (MiMoV2Attention under an mtp.layers prefix) and cannot load it; sglang's draft takes it."""
    out = copied(fp8, tmp_path / "fp8-mtp-o")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = MTP + "self_attn.o_proj.weight"
    shard = out / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones((1, 1), dtype=torch.float32)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"][name + "_scale_inv"] = shard.name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    write_index_total(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    qc["modules_to_not_convert"] = [e for e in qc["modules_to_not_convert"] if not e.endswith("self_attn.o_proj")]
    (out / "config.json").write_text(json.dumps(config))
    code, text = run("evals.cli", "checkpoint", out, "--engine", "vllm==0.34.0")
    assert code == 1 and name.removesuffix(".weight") in text, text
    code, text = gate(out, "vllm==0.32.0", capsys)
    assert code == 1 and name.removesuffix(".weight") in text, text
    code, text = gate(out, "sglang==0.5.23", capsys)
    assert code == 0, text

