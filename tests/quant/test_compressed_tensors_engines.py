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

    weight_only = {"FP8A16": "FP8", "FP8A16_CHANNEL": "FP8_DYNAMIC", "FP8A16_BLOCK": "FP8_BLOCK"}  # no presets
    preset = PRESET_SCHEMES[weight_only.get(name, name)]
    scheme = QuantizationScheme(targets=targets, **({"weights": preset["weights"]} if name in weight_only
                                                    else preset))
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
        if any(words in theirs[2] for words in ("quantization schemes for", "matching target", "MoE projections")):
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
QKV_0 = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
SHARDS_OR_CLASS = qconfig({"a": ("W4A16", QKV_0), "b": ("FP8_DYNAMIC", ["Linear"])})  # the fused match or the class
TWO_SHARDS = qconfig({"a": ("W4A16", QKV_0[:2]), "b": ("FP8_DYNAMIC", ["re:.*o_proj$"])})
ATTENTION_ONLY = qconfig({"attn": ("FP8", ["LlamaAttention"])})  # dropped: no group left to match
LOWER_CLASS = qconfig({"g": ("W4A16", ["linear"])})
LATER_GROUP_WINS = qconfig({"a": ("W4A16", ["Linear"]), "b": ("FP8_DYNAMIC", ["Linear"])})
CLASS_BY_NAME = qconfig({"c": ("FP8_DYNAMIC", ["ColumnParallelLinear"]), "l": ("W4A16", ["Linear"])})
SUFFIX_FUSED = qconfig({"g": ("W4A16", [f"model.layers.0.self_attn.w_{p}_proj" for p in "qkv"])})
WEIGHTLESS = qconfig({"g": ("W4A16", ["Linear"])})
WEIGHTLESS["config_groups"]["kv"] = {"targets": ["re:.*self_attn$"], "input_activations": {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}

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
    (SHARDS_OR_CLASS, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (TWO_SHARDS, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (ATTENTION_ONLY, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (LOWER_CLASS, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (LATER_GROUP_WINS, "model.layers.0.self_attn.o_proj", "RowParallelLinear"),
    (CLASS_BY_NAME, "model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    (CLASS_BY_NAME, "model.layers.0.self_attn.kv_b_proj", "ColumnParallelLinear"),
    (SUFFIX_FUSED, "model.layers.0.self_attn.w_qkv_proj", "QKVParallelLinear"),  # a fused key the name ends with
    (WEIGHTLESS, "model.layers.0.self_attn.o_proj", "RowParallelLinear"),
]
IGNORES = [
    ["model.layers.0.self_attn.q_proj"],  # one shard only: the shards disagree
    [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"],
    ["model.layers.0.self_attn.qkv_proj"],  # the fused name, exactly
    ["re:.*self_attn.qkv_proj$"],  # the fused name by a pattern: only from 0.30.0
    ["re:.*self_attn.q_proj$"],
    ["re:model.layers.0.*"],
    ["model.layers.*.self_attn.qkv_proj"],  # a shell pattern: never (fnmatch off)
    ["re:self_attn"],  # re.match: anchored at the start, so never
    ["re:.*qkv"],  # re.match needs no full match
    ["model.layers.*.self_attn.o_proj"],
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
        del config["config_groups"]["g"]["format"]  # the format stated once for all groups
        same(release, config, "model.layers.0.mlp.experts", "moe")


@pytest.mark.parametrize("release", [WINDOW[0], WINDOW[-1]])
def test_the_class_mapper_renames_ignore_and_targets(release):
    """apply_vllm_mapper: layer paths in ignore and targets renamed by the class's hf_to_vllm_mapper, regexes
    and class names kept: a legacy language_model.layers.N entry only matches once renamed."""
    mapper = {"kinds": ["quark"], "style": "vllm", "substr": {"language_model.model.": "model."}}
    config = qconfig({"g": ("NVFP4", ["Linear"]), "h": ("W4A16", ["language_model.model.layers.0.self_attn.o_proj"])},
                     ["language_model.model.layers.1.self_attn.o_proj", "re:language_model.model.layers.1.mlp.gate$"])
    for module in ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate"):
        same(release, config, module, "linear", "RowParallelLinear", mapper)


def test_presets_are_the_librarys():
    """``PRESETS`` holds compressed-tensors' own preset args (PRESET_SCHEMES), each recognized as itself."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for name in ct.PRESETS:
        group, fmt = _preset_group(name, ["Linear"])
        assert ct.preset(group["weights"], group.get("input_activations")) in (name, "W8A8" if name == "INT8" else name)
        scheme_label(CT, {**group["weights"], "format": fmt})  # a scheme quantgate reads
    assert set(ct.PRESETS) - set(PRESET_SCHEMES) == {"FP8A16", "FP8A16_CHANNEL", "FP8A16_BLOCK"}
    nvfp4_by_32 = {**PRESET_SCHEMES["NVFP4A16"]["weights"].model_dump(mode="json"), "group_size": 32}
    assert ct.preset(nvfp4_by_32, None) is None  # a scheme's fixed group size tells it apart


def test_every_window_release_is_covered_once():
    spans = format_spans(CT, "vllm")
    for release in WINDOW:
        assert len([s for s in spans if s.covers(release)]) == 1, release


# Every change of a cited function inside a span, and why it changes no rule (docstrings aside). A change not
# listed here and not at a span's first release is code nobody read.
CITED = {
    "utils.py": ["should_ignore_layer", "find_matched_target", "_find_first_match", "_match_fused_layer",
                 "_is_equal_or_regex_match", "check_equal_or_regex_match"],
    "compressed_tensors.py": [f"CompressedTensorsConfig.{m}" for m in (
        "from_config", "_quantization_scheme_map_from_config", "apply_vllm_mapper", "get_quant_method",
        "get_scheme_dict", "get_scheme", "_get_scheme_from_parts", "_add_fused_moe_to_target_scheme_map")],
    "moe": ["CompressedTensorsMoEMethod.get_moe_method"],
}
READ_CHANGES = {
    ("CompressedTensorsConfig.from_config", "0.17.0"): "a config without config_groups no longer KeyErrors",
    ("CompressedTensorsConfig.from_config", "0.22.0"): "sparsity_config only checked as deprecated (sparse "
                                                       "formats are refused when the checkpoint is read)",
    ("CompressedTensorsConfig._quantization_scheme_map_from_config", "0.23.0"): "output_activations kept for the "
                                                                                 "new W*A8O8 int scheme: int weights",
    ("CompressedTensorsConfig.apply_vllm_mapper", "0.22.0"): "the sparsity maps are gone",
    ("CompressedTensorsConfig.get_quant_method", "0.22.0"): "a quantized VocabParallelEmbedding branch "
                                                            "(embeddings are not replayed)",
    ("CompressedTensorsConfig.get_quant_method", "0.23.0"): "isinstance RoutedExperts, an alias of FusedMoE "
                                                            "until 0.24.0",
    ("CompressedTensorsConfig.get_scheme", "0.22.0"): "the 2:4 sparse scheme removed (sparse formats refused)",
    ("CompressedTensorsConfig.get_scheme", "0.23.0"): "output_activations handed on",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.22.0"): "MXFP4 with activations: W4A4Mxfp4 (mxfp4 "
                                                                   "weights either way)",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.23.0"): "NVFP4 weights with other activations raise "
                                                                   "ValueError (no preset); W*A8O8 int",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.25.0"): "the WNA16 bit check moved (bits other than 4 "
                                                                   "and 8 are refused when read); an XPU branch",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.26.0"): "W*A8 / W*A4 int on pack-quantized (int "
                                                                   "weights; the W4A8 preset is int-quantized)",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.28.0"): "the XPU branch only",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.29.0"): "an error message's wording",
    ("CompressedTensorsConfig._get_scheme_from_parts", "0.31.0"): "the schemes' constructor arguments",
    ("CompressedTensorsMoEMethod.get_moe_method", "0.23.0"): "ROCm's native WNA16 MoE kernels (ROCm only)",
    ("CompressedTensorsMoEMethod.get_moe_method", "0.25.0"): "Marlin's tile padding with actorder (the kernel)",
    ("CompressedTensorsMoEMethod.get_moe_method", "0.26.0"): "an emulation MoE backend (the kernel)",
    ("CompressedTensorsMoEMethod.get_moe_method", "0.29.0"): "error messages' wording",
    ("CompressedTensorsMoEMethod.get_moe_method", "0.31.0"): "W4AFP8 experts on any GPU, not only sm90 (rules "
                                                             "are judged on sm90)",
}


def _hash(node) -> str:
    import ast
    import hashlib

    node = ast.parse(ast.unparse(node)).body[0]
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.ClassDef)) and inner.body and isinstance(inner.body[0], ast.Expr) \
                and isinstance(inner.body[0].value, ast.Constant) and isinstance(inner.body[0].value.value, str):
            inner.body = inner.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()


def _cited_hashes(release: str) -> dict[str, str]:
    from tests.quant.ct_vllm_wheel import CT_DIR
    from tests.quant.engine_sources import parsed, source_files, wheel

    try:
        whl = wheel("vllm", release)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain vllm=={release}: {exc}")
    moe = "compressed_tensors_moe/compressed_tensors_moe.py"
    out = {}
    for file, names in CITED.items():
        path = CT_DIR + (file if file != "moe" else moe if CT_DIR + moe in source_files(whl)
                         else "compressed_tensors_moe.py")
        tree = parsed(whl, path)
        for name in names:
            cls, _, fn = name.rpartition(".")
            body = next((n.body for n in tree.body if getattr(n, "name", None) == cls), []) if cls else tree.body
            node = next((n for n in body if getattr(n, "name", None) == fn), None)
            out[name] = _hash(node) if node is not None else "absent"
    return out


def test_cited_code_changes_only_where_read():
    """Each cited function's code (docstrings aside) changes only at a span's first release, or where the
    change was read and changes no rule (``READ_CHANGES``)."""
    starts = {s.first for s in format_spans(CT, "vllm")}
    before = None
    unread = []
    for release in WINDOW:
        now = _cited_hashes(release)
        if before is not None and release not in starts:
            unread += [(name, release) for name in now if now[name] != before[name]
                       and (name, release) not in READ_CHANGES]
        before = now
    assert not unread, f"cited code changed inside a span, not read: {unread}"


@pytest.mark.parametrize("release", WINDOW)
def test_refused_activation_ordering_is_each_releases(release):
    """From 0.30.0 a group's actorder group / dynamic refuses the config (compressed-tensors 0.20.1, the
    oracle here, refuses it itself, so the release's source is checked instead of run)."""
    from tests.quant.ct_vllm_wheel import CT_DIR
    from tests.quant.engine_sources import source, wheel

    text = source(wheel("vllm", release), CT_DIR + "compressed_tensors.py")
    config = qconfig({"g": ("W4A16", ["Linear"])})
    config["config_groups"]["g"]["weights"]["actorder"] = "group"
    decided = ct.decide("model.layers.0.self_attn.o_proj", moe=False, draft=False, qconfig=config,
                        rules=rule_set(release))
    refused = "group/dynamic activation ordering" in text and "is no longer supported" in text
    assert (decided.raises is not None) == refused, release
    if refused:
        assert decided.raises.startswith("Compressed-tensors group/dynamic activation ordering (actorder='group')")
    for order in ("weight", "static"):
        config["config_groups"]["g"]["weights"]["actorder"] = order
        same(release, config, "model.layers.0.self_attn.o_proj", "linear", "RowParallelLinear")


# --- the real gate checkpoint on tiny compressed-tensors checkpoints (qwen3_moe, read in every vLLM release) ---

def gate(folder, *args) -> tuple[int, str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), *args],
                          check=False, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from quant.third_party import parse
    from tests.quant.third_party_checkpoints import fp8_ct, nvfp4_ct, write_third_party

    root = tmp_path_factory.mktemp("ct_vllm")
    # layer 1's experts kept bf16 and "ignored" by the FusedMoE's own name, which no expert-0 probe equals
    prefix = nvfp4_ct(ignore=("lm_head", "re:.*mlp\\.gate$", "model.layers.1.mlp.experts"))
    config = parse(CT, prefix)
    experts_bf16 = lambda module: None if module.startswith("model.layers.1.mlp.experts.") else config.resolve(module)
    # experts only: no target for attention (it stays bf16), which vLLM refuses until 0.20.2
    experts_only = nvfp4_ct(scheme_targets=("re:.*mlp\\.experts\\..*",), ignore=("lm_head",))
    # experts NVFP4, attention and lm_head FP8 per channel (a target names the head): a quantized lm_head
    head = nvfp4_ct(scheme_targets=("re:.*mlp.*",), ignore=("re:.*mlp\\.gate$",))
    head["format"] = "mixed-precision"
    head["config_groups"]["group_1"] = {**fp8_ct("channel")["config_groups"]["group_0"], "format": "float-quantized",
                                        "targets": ["re:.*self_attn.*", "re:.*lm_head"]}
    return {"prefix": write_third_party(root / "prefix", "qwen3_moe", prefix, stored=experts_bf16),
            "experts only": write_third_party(root / "experts", "qwen3_moe", experts_only),
            "lm_head": write_third_party(root / "head", "qwen3_moe", head)}


@pytest.mark.parametrize("release", ["0.16.0", "0.34.0"])
def test_an_ignore_entry_naming_the_fused_moe_does_not_ignore_it(checkpoints, release):
    code, said = gate(checkpoints["prefix"], "--engine", f"vllm=={release}")
    assert code == 1, said
    assert "model.layers.1.mlp.experts" in said and "bf16 on disk" in said and "as nvfp4" in said, said
    assert "get_moe_method" in said and "names the FusedMoE itself" in said, said  # asked as expert 0's parts


@pytest.mark.parametrize("release, loads", [("0.16.0", False), ("0.20.2", False), ("0.21.0", True),
                                            ("0.34.0", True)])
def test_a_linear_no_target_names_raises_until_0_20_2(checkpoints, release, loads):
    code, said = gate(checkpoints["experts only"], "--engine", f"vllm=={release}")
    assert code == (0 if loads else 1), said
    if not loads:
        assert "Unable to find matching target for model.layers.0.self_attn" in said, said
        assert "find_matched_target" in said, said


@pytest.mark.parametrize("release, loads", [("0.16.0", False), ("0.19.1", False), ("0.20.0", True), ("0.34.0", True)])
def test_a_quantized_lm_head_loads_from_0_20_0(checkpoints, release, loads):
    """Until 0.19.1 get_quant_method gives a ParallelLMHead no method: its FP8 weight and weight_scale meet an
    unquantized head."""
    code, said = gate(checkpoints["lm_head"], "--engine", f"vllm=={release}")
    assert code == (0 if loads else 1), said
    if not loads:
        assert "PROBLEM  [engine] lm_head" in said and "fp8-channel on disk" in said, said
        assert "CompressedTensorsConfig.get_quant_method" in said, said
