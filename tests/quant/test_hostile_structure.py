"""Structural checks for every family, driven by its manifest (``quant.structure``): a checkpoint
missing a routed expert, a family-specific tensor or a draft's projection, holding an expert index
written two ways or a hash table naming experts that do not exist, or a config.json whose counts
are no integers in range, is flagged by ``gate checkpoint`` (exit 1, or 2 for a config it cannot
read) and refused by ``quantize`` in one line, exit 2, before anything is written or allocated.

Real tiny checkpoints of each family (``tests/quant/family_checkpoints.py``), damaged as a careless
copy or a hostile edit would; headers only except where the case is about values.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.layout import family_named
from quant.outputs import INDEX_NAME
from tests.conftest import quantize_cmd
from tests.quant.family_checkpoints import built_families, write_family_checkpoint
from tests.quant.test_hostile import edit_json, gate, one_line_error, quantize
from tests.quant.test_hostile_links import _limited, gate_cmd


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(family)``: the family's tiny bf16 checkpoint; ``built(family, "mxfp4")`` its conversion
    (each made once for the module; tests damage copies)."""
    root, cache = tmp_path_factory.mktemp("families"), {}

    def get(family: str, to: str = "bf16") -> Path:
        if (family, to) not in cache:
            if to == "bf16":
                cache[family, to] = write_family_checkpoint(root / family, family)
            else:
                from quant.cli import main as quantize_main

                assert quantize_main(["--to", to, "-q", str(get(family)), str(root / f"{family}.{to}")]) == 0
                cache[family, to] = root / f"{family}.{to}"
        return cache[family, to]
    return get


def copy(built, tmp_path: Path, family: str, to: str = "bf16") -> Path:
    return Path(shutil.copytree(built(family, to), tmp_path / "src"))


def edit_tensors(folder: Path, change) -> None:
    """Rewrite ``folder``'s shards with ``change(tensors)`` applied (it edits the dict in place; a
    new tensor goes to the first shard), and the index to match."""
    index = json.loads((folder / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    shards = {file: load_file(str(folder / file)) for file in files}
    tensors = {name: t for shard in shards.values() for name, t in shard.items()}
    change(tensors)
    where = {name: file for file, shard in shards.items() for name in shard}
    weight_map = {name: where.get(name, files[0]) for name in tensors}
    for file in files:
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, str(folder / file),
                  metadata={"format": "pt"})
    index["weight_map"] = weight_map
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_NAME).write_text(json.dumps(index))


def text_config(folder: Path, family: str) -> tuple[dict, str]:
    """config.json's text config (where the family nests it) and the prefix naming its keys."""
    key = family_named(family).text_config_key
    config = json.loads((folder / "config.json").read_text())
    return (config[key], f"{key}.") if key else (config, "")


def set_text_key(folder: Path, family: str, key: str, value) -> None:
    nested = family_named(family).text_config_key
    edit_json(folder / "config.json", lambda c: (c[nested] if nested else c).__setitem__(key, value))


def experts_key(folder: Path, family: str) -> str:
    config, _ = text_config(folder, family)
    return next(k for k in family_named(family).experts_keys if k in config)


def gate_finds(capsys, folder: Path, *needles: str, args=()) -> None:
    code, out, err = gate(capsys, folder, *args)
    assert code == 1 and "Traceback" not in err, (out, err)
    for needle in needles:
        assert needle in out, (needle, out)


def quantize_refuses(capsys, folder: Path, tmp_path: Path, *needles: str, to: str = "mxfp4", dry_run=True) -> None:
    dst = tmp_path / "dst"
    code, err = quantize(capsys, folder, dst, *(["--dry-run"] if dry_run else []), to=to)
    assert code == 2, err
    one_line_error(err, *needles)
    assert not dst.exists()


# ---- every routed expert of every MoE layer (and draft layer), for every family ----------------

def _drop_expert(tensors: dict, family: str, expert: int = 1, draft: bool = False) -> str:
    """Remove every tensor of routed expert ``expert`` of one layer (the draft's where ``draft``);
    returns that layer's experts prefix."""
    fam = family_named(family)
    containers = sorted({name[:m.start("expert")] for name in tensors
                         if (m := fam.expert_match(name, fam.classify(name, 0).role)) and ("mtp" in name) == draft})
    container = containers[0]
    for name in [n for n in tensors if n.startswith(f"{container}{expert}.")]:
        del tensors[name]
    return container


# the built families by how their release stores routed experts (manifest fused_experts): per expert,
# fused 3-D tensors, and of those the ones converted to per-expert weights (gpt-oss writes its own blocks)
PER_EXPERT = [f for f in built_families() if family_named(f).fused_experts is None]
FUSED = [f for f in built_families() if family_named(f).fused_experts is not None]
FUSED_TO_PER_EXPERT = [f for f in FUSED if family_named(f).fused_experts.writes == "per_expert"]


@pytest.mark.parametrize("family", PER_EXPERT + ["qwen3_5_moe"])
def test_a_missing_routed_expert_is_flagged_and_refused_for_every_family(family, built, tmp_path, capsys):
    """One routed expert of one layer gone (for Qwen3.5, whose main layers are fused, its draft's):
    the gate names the layer's experts and the expert, quantize refuses before writing."""
    src = copy(built, tmp_path, family)
    where = []
    edit_tensors(src, lambda t: where.append(_drop_expert(t, family, draft=family == "qwen3_5_moe")))
    container = where[0].rstrip(".")
    gate_finds(capsys, src, container, "experts 1 have no tensor")
    quantize_refuses(capsys, src, tmp_path, container, "experts 1 have no tensor", dry_run=family != "mixtral")


def test_a_missing_expert_projection_is_flagged(built, tmp_path, capsys):
    """An expert with only some of its projections is as incomplete as an absent one."""
    src = copy(built, tmp_path, "mixtral")
    edit_tensors(src, lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w2.weight"))
    gate_finds(capsys, src, "experts 3 have no tensor or lack some", "experts.3.w2.weight")


@pytest.mark.parametrize("family", FUSED_TO_PER_EXPERT)
def test_a_missing_expert_of_a_fused_family_output_is_flagged_and_not_decoded(family, built, tmp_path, capsys):
    """Llama-4 / Qwen3.5 are converted to per-expert weights: one of them gone from the output is
    flagged, and --to bf16 refuses to write the fused tensor back without it."""
    src = copy(built, tmp_path, family, "mxfp4")
    where = []
    edit_tensors(src, lambda t: where.append(_drop_expert(t, family)))
    gate_finds(capsys, src, where[0].rstrip("."), "experts 1 have no tensor")
    quantize_refuses(capsys, src, tmp_path, f"no tensor {where[0]}1.", to="bf16", dry_run=False)


def keep_fused_experts(src, family: str, count: int, biases: bool = False):
    """Cut every fused expert tensor (and, with ``biases``, gpt-oss's expert biases) to its first
    ``count`` experts; returns the family's fused-experts description."""
    fused = family_named(family).fused_experts

    def cut(tensors):
        for name in [n for n in tensors if fused.match(n) or (biases and n.endswith("_proj_bias"))]:
            tensors[name] = tensors[name][:count].contiguous()
    edit_tensors(src, cut)
    return fused


@pytest.mark.parametrize("family", FUSED)
def test_a_fused_tensor_holding_fewer_experts_than_declared_is_flagged(family, built, tmp_path, capsys):
    src = copy(built, tmp_path, family)
    keep_fused_experts(src, family, 3)
    gate_finds(capsys, src, "holds 3 experts but config.json")


def test_a_moe_layer_without_any_expert_is_flagged(built, tmp_path, capsys):
    src = copy(built, tmp_path, "qwen3_moe")
    edit_tensors(src, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.1.mlp.experts.")])
    gate_finds(capsys, src, "layers 1 have a router but none of the 4 routed experts")
    quantize_refuses(capsys, src, tmp_path, "layers 1 have a router")


@pytest.mark.parametrize("family, block", [("glm4_moe", "model.layers.1.mlp."), ("qwen3_moe", "model.layers.1.mlp."),
                                           ("mixtral", "model.layers.1.block_sparse_moe."),
                                           ("deepseek_v4", "layers.1.ffn.")])
def test_a_layer_stripped_of_its_whole_moe_block_is_flagged(family, block, built, tmp_path, capsys):
    """Router and every expert of a layer gone: it looks like a dense layer without its MLP."""
    src = copy(built, tmp_path, family)
    edit_tensors(src, lambda t: [t.pop(n) for n in list(t) if n.startswith(block)])
    gate_finds(capsys, src, "layers 1 hold no MLP")
    quantize_refuses(capsys, src, tmp_path, "layers 1 hold no MLP")


# ---- counts from config.json: integers in range, bounded by the shards, before any allocation --

BAD_COUNTS = [10**12, -1, 4.0, "4", 0, True]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("family", sorted(built_families()))
def test_expert_counts_must_be_positive_integers_the_shards_can_hold(family, value, built, tmp_path, capsys):
    src = copy(built, tmp_path, family)
    key = experts_key(src, family)
    set_text_key(src, family, key, value)
    _, where = text_config(src, family)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", f"{where}{key}")
    quantize_refuses(capsys, src, tmp_path, "config.json", f"{where}{key}")


@pytest.mark.parametrize("family", FUSED)
def test_zero_experts_with_empty_fused_tensors_is_one_line(family, built, tmp_path, capsys):
    """config 0 experts and fused tensors [0, ...] agree with each other: still no model (IndexError before)."""
    src = copy(built, tmp_path, family)
    fused = keep_fused_experts(src, family, 0, biases=True)
    set_text_key(src, family, fused.experts_key, 0)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", fused.experts_key, "outside 1..")
    quantize_refuses(capsys, src, tmp_path, "config.json", fused.experts_key)


def test_a_million_llama4_experts_is_refused_before_planning(built, tmp_path, capsys):
    src = copy(built, tmp_path, "llama4")
    set_text_key(src, "llama4", "num_local_experts", 10**6)
    quantize_refuses(capsys, src, tmp_path, "config.json", "text_config.num_local_experts", "outside 1..")
    assert gate(capsys, src)[0] == 2


@pytest.mark.parametrize("key, value", [("num_local_experts", 10**6), ("num_hidden_layers", 10**12)])
def test_huge_llama4_counts_are_refused_in_bounded_memory_by_real_processes(key, value, built, tmp_path):
    """Before: quantize --dry-run died of MemoryError at 5.8 GB (10**6 experts), gate checkpoint of
    MemoryError (10**12 layers). Each is one line, exit 2, under a 3 GB address-space limit."""
    src = copy(built, tmp_path, "llama4")
    set_text_key(src, "llama4", key, value)
    for command in (quantize_cmd(src, tmp_path / "dst", "--dry-run"), gate_cmd("checkpoint", src)):
        out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120,
                             preexec_fn=_limited(3072))
        assert out.returncode == 2, (command, out.stderr)
        one_line_error(out.stderr, str(src / "config.json"), f"text_config.{key} is {value}")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("family", ["llama4", "kimi_k25"])
def test_a_huge_nested_layer_count_is_one_line_in_the_gate(family, built, tmp_path, capsys):
    src = copy(built, tmp_path, family)
    set_text_key(src, family, "num_hidden_layers", 10**12)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", "text_config.num_hidden_layers")
    quantize_refuses(capsys, src, tmp_path, "text_config.num_hidden_layers")


@pytest.mark.parametrize("value", [-1, "2", 2.5, 10**12], ids=repr)
def test_interleave_moe_layer_step_must_be_a_small_integer(value, built, tmp_path, capsys):
    src = copy(built, tmp_path, "llama4")
    set_text_key(src, "llama4", "interleave_moe_layer_step", value)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", "text_config.interleave_moe_layer_step")
    quantize_refuses(capsys, src, tmp_path, "text_config.interleave_moe_layer_step", dry_run=False)


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next", "minimax_m3", "qwen3_5_moe"])
@pytest.mark.parametrize("value", ["abc", -1, 1.0, 10**9], ids=repr)
def test_mtp_layer_counts_must_be_integers_in_range(family, value, built, tmp_path, capsys):
    src = copy(built, tmp_path, family)
    key = family_named(family).mtp_layers_key
    set_text_key(src, family, key, value)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", key)
    quantize_refuses(capsys, src, tmp_path, key)


@pytest.mark.parametrize("to", ["bf16", "mxfp4"])
def test_gpt_oss_sizes_must_be_whole_mxfp4_blocks(to, built, tmp_path, capsys):
    """gpt-oss's engines run MXFP4 blocks of 32 along hidden_size: 48 cannot be served or decoded."""
    if to == "bf16":
        src = write_family_checkpoint(tmp_path / "src", "gpt_oss", hidden_size=48)
    else:
        src = copy(built, tmp_path, "gpt_oss", "mxfp4")
        set_text_key(src, "gpt_oss", "hidden_size", 48)
    code, _, err = gate(capsys, src)
    assert code == 2
    one_line_error(err, "config.json", "hidden_size is 48, not a multiple of 32")
    quantize_refuses(capsys, src, tmp_path, "hidden_size is 48", to="bf16" if to == "mxfp4" else "mxfp4")


# ---- family-specific tensors: present and well-formed -----------------------------------------

MISSING = [("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj_bias"),
           ("gpt_oss", "model.layers.0.mlp.experts.down_proj_bias"),
           ("deepseek_v4", "layers.1.hc_attn_fn"), ("deepseek_v4", "hc_head_scale"),
           ("deepseek_v4", "mtp.0.e_proj.weight"), ("deepseek_v4", "mtp.0.hc_ffn_base"),
           ("glm4_moe", "model.layers.3.eh_proj.weight"),
           ("minimax_m3", "language_model.model.mtp.layers.0.eh_proj.weight"),
           ("qwen3_next", "mtp.fc.weight"), ("qwen3_5_moe", "mtp.fc.weight")]


@pytest.mark.parametrize("family, tensor", MISSING)
def test_a_missing_family_specific_tensor_is_flagged_and_refused(family, tensor, built, tmp_path, capsys):
    src = copy(built, tmp_path, family)
    edit_tensors(src, lambda t: t.pop(tensor))
    gate_finds(capsys, src, tensor)
    quantize_refuses(capsys, src, tmp_path, tensor)


@pytest.mark.parametrize("shape", [(4, 10), (3, 192), (192,)])
def test_a_misshapen_gpt_oss_expert_bias_is_flagged_and_refused(shape, built, tmp_path, capsys):
    src = copy(built, tmp_path, "gpt_oss")
    name = "model.layers.2.mlp.experts.gate_up_proj_bias"
    edit_tensors(src, lambda t: t.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16)))
    gate_finds(capsys, src, name, "is not the float bias [4, 192]")
    quantize_refuses(capsys, src, tmp_path, name)


def test_a_gpt_oss_mxfp4_checkpoint_without_its_bias_is_flagged(built, tmp_path, capsys):
    src = copy(built, tmp_path, "gpt_oss", "mxfp4")
    edit_tensors(src, lambda t: t.pop("model.layers.0.mlp.experts.down_proj_bias"))
    gate_finds(capsys, src, "model.layers.0.mlp.experts.down_proj_bias")


TID2EID = "layers.0.ffn.gate.tid2eid"


def test_a_hash_table_pointing_past_the_experts_is_flagged_deep_and_refused(built, tmp_path, capsys):
    """tid2eid naming expert 1000 of 4: only its values say so; --deep reads them, quantize too."""
    src = copy(built, tmp_path, "deepseek_v4")

    def point_away(tensors):
        table = tensors[TID2EID].clone()
        table[7, 1] = 1000
        tensors[TID2EID] = table
    edit_tensors(src, point_away)
    gate_finds(capsys, src, TID2EID, "row 7 names expert 1000", "n_routed_experts is 4", args=["--deep"])
    quantize_refuses(capsys, src, tmp_path, TID2EID, "row 7 names expert 1000")


def test_a_hash_table_that_is_no_integer_table_is_flagged(built, tmp_path, capsys):
    src = copy(built, tmp_path, "deepseek_v4")
    edit_tensors(src, lambda t: t.__setitem__(TID2EID, t[TID2EID].to(torch.float32)))
    gate_finds(capsys, src, TID2EID, "a 2-D integer tensor")
    quantize_refuses(capsys, src, tmp_path, TID2EID)


# ---- indices written one way ------------------------------------------------------------------

def test_an_expert_index_with_a_leading_zero_beside_the_plain_one_is_refused(built, tmp_path, capsys):
    """Llama-4's output holding experts.01.* beside experts.1.*: --to bf16 put one of them into
    slot 1 (exit 0); both read as expert 1, so neither can be trusted."""
    src = copy(built, tmp_path, "llama4", "mxfp4")
    prefix = "language_model.model.layers.1.feed_forward.experts."

    def duplicate(tensors):
        for name in [n for n in tensors if n.startswith(prefix + "2.")]:
            tensors[prefix + "01." + name[len(prefix + "2."):]] = tensors[name].clone()
    edit_tensors(src, duplicate)
    quantize_refuses(capsys, src, tmp_path, prefix + "01.", "leading zero", to="bf16", dry_run=False)
    gate_finds(capsys, src, prefix + "01.", "leading zero")


def test_a_layer_index_with_a_leading_zero_is_refused(built, tmp_path, capsys):
    src = copy(built, tmp_path, "mixtral")
    edit_tensors(src, lambda t: t.__setitem__("model.layers.01.input_layernorm.weight",
                                              t["model.layers.1.input_layernorm.weight"].clone()))
    gate_finds(capsys, src, "model.layers.01.input_layernorm.weight", "leading zero")
    quantize_refuses(capsys, src, tmp_path, "model.layers.01.", "leading zero")


# ---- the manifest fields themselves ------------------------------------------------------------

@pytest.mark.parametrize("entry, why", [
    ({"name": "{prefix}.x", "per": "model"}, "a per-model name may use no field"),
    ({"name": "{x}.eh_proj.weight", "per": "mtp"}, "a per-mtp name may use {prefix}"),
    ({"name": "{prefix:>1000000000}.x", "per": "layer"}, "a per-layer name may use {prefix}"),
    ({"name": "x", "per": "everywhere"}, "per 'everywhere' is not one of"),
])
def test_a_required_tensors_entry_the_checker_cannot_use_is_refused(entry, why, tmp_path):
    import yaml

    from quant.layout import UnknownFamilyError, load_family, manifests_root

    data = yaml.safe_load((manifests_root() / "families" / "mixtral" / "family.yaml").read_text())
    data["required_tensors"] = [entry]
    path = tmp_path / "family.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UnknownFamilyError, match="not a valid family manifest") as info:
        load_family(path)
    assert why in str(info.value)


def test_the_shipped_checkpoints_of_every_family_still_pass(built, capsys):
    for family in sorted(built_families()):
        code, out, err = gate(capsys, built(family))
        assert code == 0, (family, out, err)
