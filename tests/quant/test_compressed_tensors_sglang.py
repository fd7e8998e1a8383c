"""sglang's compressed-tensors loading (``manifests/engines/compressed_tensors.sglang.yaml``, replayed by
``quant.engines.compressed_tensors.decide``) against each release's own code.

The differential tests run a release's ``CompressedTensorsConfig.from_config`` and ``get_quant_method``
from its wheel (``tests/quant/sglang_ct_source.py``) on a grid of configs (the compressed-tensors presets
llm-compressor writes, each in its storage format; ignore lists written as llm-compressor, the model vendors
and the incidents write them: exact names, parent modules, ``re:`` entries, substrings; a mixed-precision
checkpoint; lm_head targeted by name, by class, block-quantized) and engine modules (attention and MLP
Linears, fused and not, FusedMoEs, lm_head), beside ``decide`` under the rule span covering the release:
the scheme built (or unquantized) and whether it raises must agree on every cell. By default each rule
span's first and last release; ``QUANTGATE_WINDOW=all`` runs every release of the window.
"""

from __future__ import annotations

import os

import pytest
from packaging.version import Version

from quant.engines.compressed_tensors import KEY, decide
from quant.engines.format_rules import format_spans
from quant.engines.rules import RuleSet, window
from tests.quant.engine_sources import WheelUnavailable

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
DEEPSEEK_FUSED = {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}  # no gate_up_proj

# (module, kind) as get_quant_method is asked: linear | moe | lm_head
MODULES = [("model.layers.0.self_attn.qkv_proj", "linear"), ("model.layers.0.self_attn.o_proj", "linear"),
           ("model.layers.0.mlp.gate_up_proj", "linear"), ("model.layers.0.mlp.down_proj", "linear"),
           ("model.layers.1.self_attn.fused_qkv_a_proj_with_mqa", "linear"),
           ("model.layers.1.mlp.shared_experts.gate_up_proj", "linear"), ("model.layers.1.mlp.experts", "moe"),
           ("model.layers.12.mlp.experts", "moe"), ("lm_head", "lm_head")]

_INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
_FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
# preset -> (weights, input activations, format): compressed-tensors' PRESET_SCHEMES as llm-compressor saves them
PRESETS = {
    "W4A16": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None, "pack-quantized"),
    "W4A16_ASYM": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}, None,
                   "pack-quantized"),
    "W8A16": ({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}, None, "pack-quantized"),
    "W8A8": ({"num_bits": 8, "type": "int", "strategy": "channel"}, _INT8_TOKEN, "int-quantized"),
    "W4A8": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, _INT8_TOKEN, "pack-quantized"),
    "W4AFP8": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, _FP8_TOKEN, "pack-quantized"),
    "FP8": ({"num_bits": 8, "type": "float", "strategy": "tensor"},
            {"num_bits": 8, "type": "float", "strategy": "tensor"}, "float-quantized"),
    "FP8_DYNAMIC": ({"num_bits": 8, "type": "float", "strategy": "channel"}, _FP8_TOKEN, "float-quantized"),
    "FP8_BLOCK": ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                  {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True},
                  "float-quantized"),
    "FP8A16": ({"num_bits": 8, "type": "float", "strategy": "tensor"}, None, "float-quantized"),
    "FP8A16_CHANNEL": ({"num_bits": 8, "type": "float", "strategy": "channel"}, None, "float-quantized"),
    "FP8A16_BLOCK": ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, None,
                     "float-quantized"),
    "NVFP4A16": ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, None,
                 "nvfp4-pack-quantized"),
    "NVFP4": ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
              {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
              "nvfp4-pack-quantized"),
    "MXFP4A16": ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}, None,
                 "mxfp4-pack-quantized"),
    "MXFP4": ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
              {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True},
              "mxfp4-pack-quantized"),
    "MXFP8A16": ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}, None, "mxfp8-quantized"),
    "MXFP8": ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32},
              {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True},
              "mxfp8-quantized"),
}

# ignore lists as written in the wild: lm_head and the router only (llm-compressor's default recipe), a
# FusedMoE's experts by parent (llm-compressor writes parents), a shard of a fused module, re: entries, a
# substring that also names layers 10-19, a whole layer by prefix
IGNORES = {
    "lm_head": ["lm_head"],
    "expert_parent": ["lm_head", "model.layers.1.mlp.experts.0", "model.layers.1.mlp.experts.1"],
    "experts_prefix": ["lm_head", "model.layers.1.mlp.experts"],
    "expert_projections": ["lm_head"] + [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(2)
                                         for p in ("gate_proj", "up_proj", "down_proj")],
    "one_shard": ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"],
    "all_shards": ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                   "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
    "regex": ["re:.*lm_head", "re:.*mlp.gate$", "re:.*self_attn.*", "re:model.layers.1.mlp.experts.*"],
    "substring": ["lm_head", "layers.1.", "shared_experts"],
    "suffix": ["lm_head", "self_attn.o_proj", "mlp.experts.0.gate_proj"],
    "upper_case": ["LM_HEAD", "Model.Layers.0.Self_Attn.O_Proj"],
    "partial_suffix": ["lm_head", "attn.o_proj"],
    "fused_name_regex": ["lm_head", "re:.*qkv_proj", "re:.*gate_up_proj"],
    "none": [],
}


def _config(groups: dict, ignore: list[str], fmt: str | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ignore, "config_groups": groups}


def _preset_config(name: str, ignore: list[str], targets=("Linear",)) -> dict:
    weights, acts, fmt = PRESETS[name]
    group = {"targets": list(targets), "weights": weights, **({"input_activations": acts} if acts else {})}
    return _config({"group_0": group}, ignore, fmt)


def _configs():
    """(id, quantization_config) of the grid."""
    for name in PRESETS:
        yield name, _preset_config(name, IGNORES["lm_head"])
    for ignore, entries in IGNORES.items():
        yield f"NVFP4/{ignore}", _preset_config("NVFP4", entries)
        yield f"W4A16/{ignore}", _preset_config("W4A16", entries)
    nvfp4, w4a16, fp8 = PRESETS["NVFP4"], PRESETS["W4A16"], PRESETS["FP8_DYNAMIC"]
    yield "mixed_precision", _config({  # attention FP8, experts NVFP4: each group with its own format
        "group_0": {"targets": ["re:.*self_attn.*"], "weights": fp8[0], "input_activations": fp8[1], "format": fp8[2]},
        "group_1": {"targets": ["re:.*mlp.*"], "weights": nvfp4[0], "input_activations": nvfp4[1],
                    "format": nvfp4[2]}}, ["lm_head"], "mixed-precision")
    yield "mixed_precision_int4", _config({  # attention FP8, the MLPs INT4
        "group_0": {"targets": ["re:.*self_attn.*"], "weights": fp8[0], "input_activations": fp8[1], "format": fp8[2]},
        "group_1": {"targets": ["re:.*mlp.*"], "weights": w4a16[0], "format": w4a16[2]}}, ["lm_head"],
        "mixed-precision")
    yield "W4A16_unpacked", _config({"group_0": {"targets": ["Linear"], "weights": w4a16[0]}}, ["lm_head"],
                                    "naive-quantized")
    yield "experts_only", _config({"group_0": {"targets": ["re:.*mlp.experts.*"], "weights": w4a16[0]}},
                                  ["lm_head"], "pack-quantized")
    yield "linear_and_experts", _config({  # the experts by regex INT4, every other Linear FP8 (the later group wins)
        "group_0": {"targets": ["Linear"], "weights": fp8[0], "input_activations": fp8[1]},
        "group_1": {"targets": ["re:.*mlp.experts.*"], "weights": fp8[0], "input_activations": fp8[1]}},
        ["lm_head"], "float-quantized")
    for head in (["re:.*lm_head"], ["lm_head"], ["model.lm_head"]):
        yield f"lm_head_target/{head[0]}", _config({
            "group_0": {"targets": ["Linear", *head], "weights": fp8[0], "input_activations": fp8[1]}}, [],
            "float-quantized")
    block = PRESETS["FP8_BLOCK"]
    yield "lm_head_block", _config({"group_0": {"targets": ["Linear", "lm_head"], "weights": block[0],
                                                "input_activations": block[1]}}, [], "float-quantized")
    yield "lm_head_target_ignored", _config({"group_0": {"targets": ["Linear", "lm_head"], "weights": fp8[0],
                                                         "input_activations": fp8[1]}}, ["lm_head"], "float-quantized")
    yield "lm_head_not_ignored", _preset_config("NVFP4", [])
    yield "mxfp4_ignored_experts", _preset_config("MXFP4A16", IGNORES["expert_projections"])
    mxfp4 = PRESETS["MXFP4A16"]
    yield "mxfp4_experts_by_regex", _config({"group_0": {"targets": ["re:.*mlp.experts.*"], "weights": mxfp4[0]}},
                                            IGNORES["expert_projections"], mxfp4[2])
    yield "mxfp4_in_mixed_precision", _config({  # the format said only by the group
        "group_0": {"targets": ["Linear"], "weights": mxfp4[0], "format": mxfp4[2]}}, ["lm_head"], "mixed-precision")
    yield "weightless_group", _config({  # an activations-only group beside the weights' (refused when read)
        "group_0": {"targets": ["Linear"], "weights": fp8[0], "input_activations": fp8[1]},
        "group_1": {"targets": ["re:.*self_attn.*"], "input_activations": fp8[1]}}, ["lm_head"], "float-quantized")


def _label(built, qconfig: dict) -> str | None:
    """The scheme label (quant.third_party's) of the scheme class a release built, from the weight args it
    was handed (the config's own where the class takes none)."""
    name, args = built.scheme, built.args
    if name is None:
        return None
    if "Nvfp4" in name or "Fp4" in name:
        return "nvfp4"
    if name == "Mxfp4MoEMethod":
        return "mxfp4"
    handed = next((v for v in [*args.values(), *args.get("positional", ())] if hasattr(v, "num_bits")), None)
    groups = [g["weights"] for g in qconfig["config_groups"].values() if g.get("weights")]
    # a WNA16 MoE handed only the config (until 0.5.14) reads the group / channel weights' group
    weights = next((w for w in groups if w.get("strategy") in ("group", "channel")), groups[0])
    if "Fp8" in name and "W4AFP8" not in name:
        strategy = getattr(handed, "strategy", None) or args.get("strategy") or weights["strategy"]
        return {"channel": "fp8-channel", "block": "fp8-block"}.get(str(getattr(strategy, "value", strategy)), "fp8")
    bits = getattr(handed, "num_bits", None) or args.get("num_bits") or weights["num_bits"]
    return "int4" if "W4AFP8" in name or bits == 4 else "int8"


def _releases() -> list[tuple[object, str]]:
    every = os.environ.get("QUANTGATE_WINDOW") == "all"
    spans = format_spans("compressed-tensors", "sglang")
    return [(span, v) for span in spans for v in window("sglang") if span.covers(v)
            and (every or v in (span.first, span.last) or v == max((r for r in window("sglang") if span.covers(r)),
                                                                   key=Version))]


def _rules(span, fused: dict) -> RuleSet:
    return RuleSet("sglang", span.first, span.last, {KEY: span.values, "quark_fused": fused, "exclude_mapper": None},
                   {f"{KEY}.{rule}": cite for rule, cite in span.cites.items()})


@pytest.fixture(scope="module")
def sglang_releases():
    from tests.quant.sglang_ct_source import Release

    out = []
    for span, version in _releases():
        try:
            out.append((span, Release(version)))
        except WheelUnavailable as exc:
            pytest.skip(f"cannot obtain sglang=={version} or compressed-tensors from the registry: {exc}")
    return out


@pytest.mark.parametrize("fused", [FUSED, DEEPSEEK_FUSED], ids=["qwen_packed", "deepseek_packed"])
def test_decide_matches_each_release(sglang_releases, fused):
    """Every config of the grid, every module kind: decide builds what the release builds, or raises where it does."""
    wrong = []
    for span, release in sglang_releases:
        rules = _rules(span, fused)
        for cid, qconfig in _configs():
            for module, kind in MODULES:
                built = release.build({**qconfig, "packed_modules_mapping": fused}, module, kind)
                theirs = ("raises", None) if built.raises else ("builds", _label(built, qconfig))
                decision = decide(module, moe=kind == "moe", draft=False, qconfig=qconfig, rules=rules)
                ours = ("raises", None) if decision.raises else ("builds", decision.scheme)
                if ours != theirs:
                    wrong.append(f"{release.version} {cid} {module}: sglang {theirs} {built}, decide {ours} "
                                 f"({decision.why})")
    assert not wrong, f"{len(wrong)} cells differ:\n" + "\n".join(wrong[:40])


def test_spans_cover_the_window_and_name_their_functions():
    """Each window release in one span; every rule stated from the first span on and cited to a file and function."""
    spans = format_spans("compressed-tensors", "sglang")
    assert [v for v in window("sglang") if sum(s.covers(v) for s in spans) != 1] == []
    first = spans[0]
    assert set(first.values) == set(spans[-1].values)
    for rule, cite in spans[-1].cites.items():
        assert cite.startswith("sglang/srt/layers/quantization/compressed_tensors/"), rule


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from quant.third_party import CT, parse
    from tests.quant.third_party_checkpoints import nvfp4_ct, write_third_party

    root = tmp_path_factory.mktemp("ct_sglang")
    # layer 1's experts kept bf16 and ignored by their parent's name, as llm-compressor writes a skipped subtree
    parent = nvfp4_ct(ignore=("lm_head", "re:.*mlp\\.gate$", "model.layers.1.mlp.experts"))
    config = parse(CT, parent)
    experts_bf16 = lambda module: None if module.startswith("model.layers.1.mlp.experts.") else config.resolve(module)
    experts_only = nvfp4_ct(scheme_targets=("re:.*mlp\\.experts\\..*",), ignore=("lm_head",))
    return {"parent": write_third_party(root / "parent", "qwen3_moe", parent, stored=experts_bf16),
            "experts only": write_third_party(root / "experts", "qwen3_moe", experts_only)}


@pytest.mark.parametrize("release, loads", [("0.5.9", True), ("0.5.16", True), ("0.5.17", False), ("0.5.23", False)])
def test_a_parent_ignore_entry_keeps_the_experts_bf16_until_0_5_16(checkpoints, release, loads):
    """gate checkpoint in a real process: a substring entry ignores the FusedMoE's expert-0 probe until 0.5.16;
    from 0.5.17 a plain entry matches only as a dotted suffix, so the bf16 experts meet an NVFP4 FusedMoE."""
    from tests.quant.test_compressed_tensors_engines import gate

    code, said = gate(checkpoints["parent"], "--engine", f"sglang=={release}")
    assert code == (0 if loads else 1), said
    if not loads:
        assert "model.layers.1.mlp.experts" in said and "bf16 on disk" in said and "as nvfp4" in said, said
        assert "get_moe_scheme" in said, said


@pytest.mark.parametrize("release", ["0.5.9", "0.5.23"])
def test_a_linear_no_target_names_raises_in_every_release(checkpoints, release):
    """Targets naming the experts alone: sglang's find_matched_target raises for the attention Linears."""
    from tests.quant.test_compressed_tensors_engines import gate

    code, said = gate(checkpoints["experts only"], "--engine", f"sglang=={release}")
    assert code == 1, said
    assert "Unable to find matching target for model.layers.0.self_attn" in said and "find_matched_target" in said, said
