"""vLLM's compressed-tensors loading (``quant.engines.compressed_tensors`` with
``manifests/engines/compressed_tensors.vllm.yaml``) against every release's own code.

The differential tests run each release's ``CompressedTensorsConfig`` from its wheel (``tests/quant/
ct_vllm_wheel.py``: from_config, apply_vllm_mapper, get_quant_method and everything it calls in the
quantization layer) on a grid of configs and modules beside ``decide`` under the rules of the span covering
that release: the same outcome (unquantized, built with the group's scheme, or the same error) for every
case. Every release of the window runs (the functions are small; the wheels are cached).
"""

from __future__ import annotations

import pytest

from quant.engines import compressed_tensors as ct
from quant.engines.format_rules import format_spans
from quant.engines.rules import RuleSet, window
from quant.third_party import CT, scheme_label

compressed_tensors = pytest.importorskip("compressed_tensors", reason="the format's own library is the oracle")

from tests.quant.ct_vllm_wheel import Mapper, WheelUnavailable, build

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
WINDOW = window("vllm")


def _preset_group(name: str, targets: list[str]) -> tuple[dict, str]:
    """A config group of compressed-tensors' preset ``name`` and the format the library writes it in."""
    import torch
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization.quant_scheme import (
        PRESET_SCHEMES,
        QuantizationScheme,
    )

    scheme = QuantizationScheme(targets=targets, **PRESET_SCHEMES[name])
    fmt = infer_module_format(torch.nn.Linear, scheme).value
    dumped = scheme.model_dump(mode="json", exclude_none=True)
    group = {"targets": targets, "weights": dumped["weights"]}
    if "input_activations" in dumped:
        group["input_activations"] = dumped["input_activations"]
    return group, fmt


def qconfig(groups: dict[str, tuple[str, list[str]]], ignore: list[str] | None = None) -> dict:
    """A compressed-tensors quantization_config: group name -> (preset, targets), each group with its format."""
    config_groups = {}
    for name, (preset, targets) in groups.items():
        group, fmt = _preset_group(preset, targets)
        config_groups[name] = {**group, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": "mixed-precision" if len(groups) > 1 else
            next(iter(config_groups.values()))["format"], "config_groups": config_groups, "ignore": ignore or []}


def rule_set(release: str, mapper: dict | None = None) -> RuleSet:
    span = next(s for s in format_spans(CT, "vllm") if s.covers(release))
    return RuleSet("vllm", span.first, span.last,
                   {ct.KEY: span.values, "quark_fused": PACKED, "exclude_mapper": mapper},
                   {f"{ct.KEY}.{k}": v for k, v in span.cites.items()}, release=release)


def _wheel_build(release: str, *args, **kwargs):
    try:
        return build(release, *args, **kwargs)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain vllm=={release}: {exc}")


# The scheme classes the engine builds, by the label of the weights they take
CLASS_LABELS = (("Mxfp4", "mxfp4"), ("Mxfp8", "mxfp8"), ("Fp4", "nvfp4"), ("Nvfp4", "nvfp4"), ("W4A8Fp8", "int4"),
                ("Fp8", "fp8"), ("WNA16", "int"), ("Int", "int"))


def _label_of(class_name: str) -> str:
    return next(label for part, label in CLASS_LABELS if part in class_name)


def same(release: str, config: dict, module: str, kind: str, layer_class: str = "", mapper: dict | None = None,
         leaves=ct.EXPERT_LEAVES) -> None:
    """``decide`` and the release's own code agree on ``module``."""
    wheel_mapper = Mapper(**{k: mapper[k] for k in ("substr", "prefix", "suffix") if k in mapper}) if mapper else None
    theirs = _wheel_build(release, config, module, "moe" if kind == "moe" else kind, PACKED, wheel_mapper,
                          layer_class=layer_class, ckpt_leaves=leaves)
    ours = ct.decide(module, moe=kind == "moe", draft=False, qconfig=config, rules=rule_set(release, mapper),
                     expert_leaves=leaves)
    where = f"vllm {release}, {module}: theirs {theirs}, ours {ours}"
    if theirs[0] == "raises":
        assert ours.raises is not None, where
        if theirs[1] in ("ValueError",) and ("shard" in theirs[2] or "matching target" in theirs[2]
                                             or "MoE projections" in theirs[2]):
            assert ours.raises == theirs[2], where  # the matching errors' words are rule values
    elif theirs[0] == "unquantized":
        assert ours.raises is None and ours.scheme is None, where
    else:
        assert ours.raises is None and ours.scheme is not None, where
        assert ours.scheme.startswith(_label_of(theirs[1])), where


NVFP4_LINEAR = qconfig({"group_0": ("NVFP4", ["Linear"])}, ["lm_head", "re:.*mlp.gate$"])
ATTN_FP8_MLP_INT4 = qconfig({"attn": ("FP8_DYNAMIC", ["re:.*self_attn.*"]), "mlp": ("W4A16", ["re:.*mlp.*"])},
                            ["lm_head"])
SHARDS_BY_NAME = qconfig({"g": ("W4A16", [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
                                + ["model.layers.0.self_attn.o_proj"])})
MOE_CLASS = qconfig({"g": ("NVFP4", ["FusedMoE"])})

LINEAR_CASES = [
    # (config, module, class)
    (NVFP4_LINEAR, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (NVFP4_LINEAR, "model.layers.0.mlp.gate", "ReplicatedLinear"),
    (NVFP4_LINEAR, "model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear"),
    (ATTN_FP8_MLP_INT4, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (ATTN_FP8_MLP_INT4, "model.layers.0.mlp.down_proj", "RowParallelLinear"),
    (ATTN_FP8_MLP_INT4, "model.layers.0.input_proj", "ReplicatedLinear"),  # no target: raise / unquantized
    (SHARDS_BY_NAME, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),  # the fused match
    (SHARDS_BY_NAME, "model.layers.0.self_attn.o_proj", "RowParallelLinear"),
    (SHARDS_BY_NAME, "model.layers.1.self_attn.qkv_proj", "QKVParallelLinear"),
    (MOE_CLASS, "model.layers.0.self_attn.o_proj", "RowParallelLinear"),
]
IGNORES = [
    ["model.layers.0.self_attn.q_proj"],  # one shard only: the shards disagree
    [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"],
    ["model.layers.0.self_attn.qkv_proj"],  # the fused name, exactly
    ["re:.*self_attn.qkv_proj$"],  # the fused name by a pattern: only from 0.30.0
    ["re:.*self_attn.q_proj$"],
    ["re:model.layers.0.*"],
    ["model.layers.*.self_attn.qkv_proj"],  # a shell pattern: never (fnmatch off)
]
MOE_IGNORES = [
    [],
    ["model.layers.1.mlp.experts"],  # the FusedMoE's own name: matches none of the names asked
    ["re:.*mlp.experts.*"],
    ["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.up_proj",
     "model.layers.1.mlp.experts.0.down_proj"],
    ["model.layers.1.mlp.experts.0.down_proj"],  # one projection only: the three differ
    ["re:.*experts.*w[123]$"],  # a Mixtral-named list: matches the checkpoint names, not the fixed ones
]


@pytest.mark.parametrize("release", WINDOW)
def test_linear_matching_matches_each_release(release):
    for config, module, cls in LINEAR_CASES:
        same(release, config, module, "linear", cls)
    for ignore in IGNORES:
        config = {**NVFP4_LINEAR, "ignore": ignore}
        for module, cls in (("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
                            ("model.layers.0.self_attn.o_proj", "RowParallelLinear")):
            same(release, config, module, "linear", cls)


@pytest.mark.parametrize("release", WINDOW)
def test_moe_matching_matches_each_release(release):
    configs = [NVFP4_LINEAR, qconfig({"g": ("W4A16", ["re:.*experts.*"])}), MOE_CLASS,
               qconfig({"g": ("W4A16", ["re:.*experts.*"]), "h": ("FP8_DYNAMIC", ["re:.*down_proj$"])}),
               qconfig({"g": ("W4A16", ["re:.*self_attn.*"])})]
    for config in configs:
        for ignore in MOE_IGNORES:
            for leaves in (ct.EXPERT_LEAVES, ("w1", "w3", "w2")):
                same(release, {**config, "ignore": ignore}, "model.layers.1.mlp.experts", "moe", leaves=leaves)


@pytest.mark.parametrize("release", WINDOW)
def test_lm_head_matches_each_release(release):
    for config in (NVFP4_LINEAR, {**NVFP4_LINEAR, "ignore": []}, qconfig({"g": ("W4A16", ["re:.*lm_head"])}),
                   qconfig({"g": ("W4A16", ["lm_head", "re:.*proj$"])}), SHARDS_BY_NAME):
        same(release, config, "lm_head", "lm_head")


@pytest.mark.parametrize("release", WINDOW)
def test_each_preset_builds_as_each_release_builds_it(release):
    for preset in ct.PRESETS:
        config = qconfig({"g": (preset, ["Linear"])})
        same(release, config, "model.layers.0.self_attn.o_proj", "linear", "RowParallelLinear")
        same(release, config, "model.layers.0.mlp.experts", "moe")


@pytest.mark.parametrize("release", [WINDOW[0], WINDOW[-1]])
def test_the_class_mapper_renames_ignore_and_targets(release):
    """apply_vllm_mapper: layer paths in ignore and targets renamed by the class's hf_to_vllm_mapper, regexes
    and class names kept: a legacy language_model.layers.N entry only matches once renamed."""
    mapper = {"kinds": ["quark"], "style": "vllm", "prefix": {"language_model.model.": "model."}}
    config = qconfig({"g": ("NVFP4", ["Linear"]), "h": ("W4A16", ["language_model.model.layers.0.self_attn.o_proj"])},
                     ["language_model.model.layers.1.self_attn.o_proj", "re:language_model.*mlp.gate$"])
    for module in ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate"):
        same(release, config, module, "linear", "RowParallelLinear", mapper)


def test_presets_are_the_librarys():
    """``PRESETS`` holds compressed-tensors' own preset args (PRESET_SCHEMES), each recognized as itself."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for name in ct.PRESETS:
        group, fmt = _preset_group(name, ["Linear"])
        assert ct.preset(group["weights"], group.get("input_activations")) in (name, "W8A8" if name == "INT8" else name)
        scheme_label(CT, {**group["weights"], "format": fmt})  # a scheme quantgate reads
    assert set(ct.PRESETS) <= set(PRESET_SCHEMES)


def test_every_window_release_is_covered_once():
    spans = format_spans(CT, "vllm")
    for release in WINDOW:
        assert len([s for s in spans if s.covers(release)]) == 1, release
