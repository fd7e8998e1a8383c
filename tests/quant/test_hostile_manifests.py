"""Crafted family manifests (``quantize --family-manifest FILE``) and ``gate checkpoint --deep`` on a
large tensor: each manifest case is one line, exit 2, naming the file and the key, with nothing
written; the schema (``quant.schema``, ``quant.layout.FamilyFile``) refuses it when it is read, so
no count, template or layout from it reaches the planner or the writer. ``--deep`` reads a tensor a
bounded chunk at a time: its memory is the chunk's, not the tensor's.

Real files and the real CLI throughout; the cases that exhausted memory run in a real process under
an address-space limit, so without the schema they fail (MemoryError) instead of taking the machine.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from quant.cli import main as quantize_main
from quant.layout import known_families, manifests_root
from quant.outputs import INDEX_NAME
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_fused_experts import write_fused
from tests.quant.test_hostile import one_line_error

MEMORY_LIMIT = 2 << 30  # address space for a crafted-manifest run: a dry run needs well under 1 GiB
FUSED_AXES = ["experts", "out", "in"]


def qwen3_fused_manifest() -> dict:
    """Qwen3-MoE's manifest with its experts declared fused (gate_up_proj, down_proj), as Qwen3.5 stores them."""
    data = yaml.safe_load((manifests_root() / "families" / "qwen3_moe" / "family.yaml").read_text())
    data["fused_experts"] = {"experts_key": "num_local_experts", "writes": "per_expert", "tensors": [
        {"pattern": r"\.mlp\.experts\.gate_up_proj$", "axes": list(FUSED_AXES), "projections": ["gate_proj", "up_proj"],
         "out": "moe_intermediate_size", "in": "hidden_size"},
        {"pattern": r"\.mlp\.experts\.down_proj$", "axes": list(FUSED_AXES), "projections": ["down_proj"],
         "out": "hidden_size", "in": "moe_intermediate_size"}]}
    return data


@pytest.fixture(scope="module")
def fused_src(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE checkpoint with each layer's experts in two fused tensors."""
    root = tmp_path_factory.mktemp("fused")
    return write_fused(write_family_checkpoint(root / "per_expert", "qwen3_moe"), root / "fused", FUSED_AXES, "halves")


def _tensor(data: dict, i: int = 0) -> dict:
    return data["fused_experts"]["tensors"][i]


def _routed_pattern(data: dict, pattern: str) -> None:
    next(r for r in data["roles"] if r["role"] == "routed_expert")["pattern"] = pattern


MANIFEST_CASES = {
    # case: (edit of the fused Qwen3-MoE manifest, the key the line names, what it says)
    "mtp default inf": (lambda d: d.update(mtp_layers_default=float("inf")), "mtp_layers_default:",
                        "valid integer, not inf"),
    "mtp default huge": (lambda d: d.update(mtp_layers_default=10 ** 12), "mtp_layers_default:",
                         "less than or equal to 64"),
    "mtp default a string": (lambda d: d.update(mtp_layers_default="1"), "mtp_layers_default:", "not '1'"),
    "mtp default fractional": (lambda d: d.update(mtp_layers_default=1.5), "mtp_layers_default:", "not 1.5"),
    "misspelt key": (lambda d: d.update(mtp_layer_default=1), "unknown key 'mtp_layer_default'",
                     "did you mean 'mtp_layers_default'?"),
    "misspelt nested key": (lambda d: _tensor(d, 1).update(nmaes="{experts}.{e}.{proj}.weight"),
                            "fused_experts.tensors.1: unknown key 'nmaes'", "did you mean 'names'?"),
    "misspelt role key": (lambda d: d["roles"][0].update(lineer=True), "roles.0: unknown key 'lineer'",
                          "did you mean 'linear'?"),
    "template unknown field": (lambda d: _tensor(d).update(names="{experts}.{x}.{proj}.weight"),
                               "fused_experts.tensors.0.names:", "field {x} is not one quantgate supplies"),
    "template 1.5e9 wide": (lambda d: _tensor(d).update(names="{experts}.{e:1500000000}.{proj}.weight"),
                            "fused_experts.tensors.0.names:", "{e:1500000000}: a format spec"),
    "template conversion": (lambda d: _tensor(d).update(names="{experts}.{e!r}.{proj}.weight"),
                            "fused_experts.tensors.0.names:", "{e!r}: a format spec or conversion"),
    "template literal brace": (lambda d: _tensor(d).update(names="{experts}.{e}.{proj}.{{w}}"),
                               "fused_experts.tensors.0.names:", "literal brace"),
    # every expert under one name: the writer emitted out of order (AssertionError)
    "template without {e}": (lambda d: (_tensor(d).update(names="{experts}.{proj}.weight"),
                                        _routed_pattern(d, r"\.mlp\.experts\.((?P<expert>\d+)\.)?")),
                             "fused_experts.tensors.0.names:", "must use {e} exactly once"),
    "projection in two tensors": (lambda d: _tensor(d, 1).update(projections=["gate_proj"]), "fused_experts:",
                                  "projection 'gate_proj' is in more than one of tensors"),
    "projection twice": (lambda d: _tensor(d).update(projections=["gate_proj", "gate_proj"]),
                         "fused_experts.tensors.0.projections:", "names a projection twice"),
    "writes unknown": (lambda d: d["fused_experts"].update(writes="mxfp4_native"), "fused_experts.writes:",
                       "'per_expert', 'blocks' or 'stacked'"),
    "split unknown": (lambda d: _tensor(d).update(split="alternate"), "fused_experts.tensors.0.split:",
                      "'halves' or 'interleaved'"),
    "config value nan": (lambda d: d.update(config_keys={"mxfp4": {"expert_dtype": float("nan")}}),
                         "config_keys.mxfp4.expert_dtype:", "nan is not a finite number"),
    "model_types a string": (lambda d: d.update(model_types="qwen3_moe"), "model_types:", "valid list"),
    "linear a string": (lambda d: d["roles"][0].update(linear="yes"), "roles.0.linear:", "valid boolean"),
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_crafted_family_manifest_is_one_line_naming_the_key(case, fused_src, tmp_path):
    """In a real process with its address space capped: a 1.5e9-wide field used to be a MemoryError
    (a 1.5 GB name per expert), .inf an OverflowError, {x} a KeyError, a template without {e} the
    writer's AssertionError; each is now refused as the manifest is read."""
    edit, key, says = MANIFEST_CASES[case]
    data = qwen3_fused_manifest()
    edit(data)
    manifest = tmp_path / "family.yaml"
    manifest.write_text(yaml.safe_dump(data))
    dst = tmp_path / "dst"
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    out = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", "--family-manifest",
                          str(manifest), str(fused_src), str(dst)], capture_output=True, text=True, timeout=120,
                         check=False, preexec_fn=limit)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    one_line_error(out.stderr, str(manifest), key, says)
    assert not dst.exists()


def test_shipped_manifests_pass_the_schema():
    """Every built-in manifest is read through the same schema (and names the file it came from)."""
    families = known_families()
    assert len(families) == len(list((manifests_root() / "families").glob("*/family.yaml")))
    assert all(f.path and f.path.name.endswith(".yaml") for f in families)


def run_quantize(capsys, *args) -> tuple[int, str]:
    code = quantize_main(["--to", "mxfp4", "-q", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_writes_blocks_no_engine_rule_reads_is_refused(fused_src, tmp_path, capsys):
    """``writes: blocks`` for a class whose rules were never read for that layout (no mxfp4_native):
    once KeyError 'mxfp4_native' after planning; now one line naming the manifest and the key."""
    data = qwen3_fused_manifest()
    data["fused_experts"].update(writes="blocks", blocks_config={"quant_method": "mxfp4"})
    _routed_pattern(data, r"\.mlp\.experts\.((?P<expert>\d+)\.(gate|up|down)_proj\.weight|gate_up_proj|down_proj)$")
    manifest = tmp_path / "blocks.yaml"
    manifest.write_text(yaml.safe_dump(data))
    for dry in ([], ["--dry-run"]):
        code, err = run_quantize(capsys, *dry, "--family-manifest", manifest, fused_src, tmp_path / "dst")
        assert code == 2
        one_line_error(err, str(manifest), "fused_experts.writes: blocks", "mxfp4_native")
        assert not (tmp_path / "dst").exists()


def test_a_per_expert_copy_beside_its_fused_tensor_is_refused_before_writing(fused_src, tmp_path, capsys):
    """A checkpoint storing expert 0's gate_proj beside the fused tensor its experts are written
    from: two outputs of one name, which the writer met out of order (AssertionError); now refused
    at plan time, naming the shard and the tensor."""
    src = Path(shutil.copytree(fused_src, tmp_path / "src"))
    index = json.loads((src / INDEX_NAME).read_text())
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    file = index["weight_map"]["model.layers.0.mlp.experts.gate_up_proj"]
    tensors = load_file(str(src / file))
    tensors[name] = torch.zeros(32, 64, dtype=torch.bfloat16)
    save_file(tensors, str(src / file), metadata={"format": "pt"})
    index["weight_map"][name] = file
    (src / INDEX_NAME).write_text(json.dumps(index))
    manifest = tmp_path / "fused.yaml"
    manifest.write_text(yaml.safe_dump(qwen3_fused_manifest()))
    code, err = run_quantize(capsys, "--family-manifest", manifest, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, file, name, "would be written twice")
    assert not (tmp_path / "dst").exists() or not list((tmp_path / "dst").iterdir())


def test_a_misspelt_key_in_a_shipped_manifest_copy_names_the_nearest(tmp_path, capsys, glm_ckpt):
    """The GLM-5 manifest with a top-level key misspelt: silently ignored before; now the nearest name."""
    data = yaml.safe_load((manifests_root() / "families" / "glm_moe_dsa" / "family.yaml").read_text())
    data["layers_prefx"] = data.pop("layers_prefix", "model.layers")
    manifest = tmp_path / "glm.yaml"
    manifest.write_text(yaml.safe_dump(data))
    code, err = run_quantize(capsys, "--family-manifest", manifest, glm_ckpt, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(manifest), "unknown key 'layers_prefx'", "did you mean 'layers_prefix'?")


# ---- gate checkpoint --deep in bounded memory ------------------------------------------------------

BIG = "model.layers.0.extra.weight"  # a bf16 tensor far larger than the chunk, NaN in its last element
DEEP_MEMORY = """
import json, resource, sys
import quant.source, quant.verify as verify
verify.DEEP_CHUNK_BYTES = 1 << 20
verify.verify(sys.argv[1])  # everything but the tensor data: imports, rules, headers
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = verify.verify(sys.argv[1], deep=True)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_mib": grew / 1024, "nan": [f.module for f in report.findings if f.why == "NaN/Inf values"]}))
"""


def test_deep_scans_a_large_bf16_tensor_in_bounded_memory(glm_ckpt, tmp_path):
    """A 64 MiB bf16 tensor scanned with 1 MiB chunks: the process's peak memory grows by a few
    chunks, not by the tensor (it loaded the tensor whole, and a bool mask half its size: a 2 GiB
    tensor was an allocation failure), and the NaN in its last element is still found."""
    src = Path(shutil.copytree(glm_ckpt, tmp_path / "src"))
    big = torch.zeros(4096, 8192, dtype=torch.bfloat16)
    big[-1, -1] = float("nan")
    save_file({BIG: big}, str(src / "model-extra.safetensors"), metadata={"format": "pt"})
    del big
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"][BIG] = "model-extra.safetensors"
    index.get("metadata", {}).pop("total_size", None)
    (src / INDEX_NAME).write_text(json.dumps(index))
    out = subprocess.run([sys.executable, "-c", DEEP_MEMORY, str(src)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["nan"] == [BIG]
    assert result["grew_mib"] < 16, result


def test_deep_decodes_a_quantized_weight_chunk_by_chunk(glm_ckpt, tmp_path, capsys, monkeypatch):
    """With a chunk of one row, a scale that overflows bf16 on the last row of an MXFP4 weight is
    still found, at that row: chunks are read at the right offsets."""
    from evals.cli import main as gate_main
    from quant import verify
    from tests.quant.test_hostile_sources import rewrite_shard, shard_of

    q = tmp_path / "q"
    assert quantize_main(["--to", "mxfp4", "-q", str(glm_ckpt), str(q)]) == 0
    weight_map = json.loads((q / INDEX_NAME).read_text())["weight_map"]
    weight = next(n for n in weight_map if n.endswith("experts.1.up_proj.weight"))

    def overflow_last_row(tensors):
        scale = tensors[weight + "_scale"].clone()
        scale[-1, 0] = 254
        tensors[weight + "_scale"] = scale

    rewrite_shard(shard_of(q, weight), overflow_last_row)
    rows = load_file(str(shard_of(q, weight)))[weight].shape[0]
    monkeypatch.setattr(verify, "DEEP_CHUNK_BYTES", 1)
    capsys.readouterr()
    code = gate_main(["checkpoint", str(q), "--deep"])
    out = capsys.readouterr().out
    assert code == 1 and weight in out and f"decodes to NaN/Inf at row {rows - 1}," in out, out
