"""Bad input: a clear error naming the file/tensor, exit code 2, nothing lost, nothing half-written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quant.cli import main
from quant.example import tiny_config, write_checkpoint
from quant.safetensors_io import PARTIAL_SUFFIX

EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(["--to", "mxfp4", "-q", *map(str, args)])
    return code, capsys.readouterr().err


def assert_no_final_shards(dst):
    assert not list(dst.glob("*.safetensors")) and not list(dst.glob("*" + PARTIAL_SUFFIX))
    assert not (dst / "conversion_manifest.json").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_the_tensor(tmp_path, capsys, bad):
    config = tiny_config()
    weight = torch.zeros(32, 64, dtype=torch.bfloat16)
    weight[5, 7] = bad
    src = write_checkpoint(tmp_path / "src", config, shard_bytes=10 << 20, overrides={EXPERT: weight})
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2
    assert EXPERT in err and "NaN/Inf at row 5, column 7" in err
    assert_no_final_shards(tmp_path / "dst")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the source is untouched


def test_dim_not_divisible_by_block(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", tiny_config(moe_intermediate_size=48))
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2
    assert "down_proj.weight BF16[64, 48]" in err and "not divisible by the mxfp4 block (32)" in err
    assert not (tmp_path / "dst").exists()


def test_missing_shard(glm_ckpt, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(glm_ckpt, src)
    (src / "model-00002-of-00003.safetensors").unlink()
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2 and "model-00002-of-00003.safetensors: missing" in err


def test_truncated_shard(glm_ckpt, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(glm_ckpt, src)
    shard = src / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2 and "model-00003-of-00003.safetensors: truncated" in err and "re-download" in err


def test_index_names_absent_tensor(glm_ckpt, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(glm_ckpt, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.gate.weight"] = "model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2 and "model.layers.9.mlp.gate.weight" in err and "no such tensor" in err


def test_output_equal_to_or_inside_input(glm_ckpt, capsys):
    for dst in (glm_ckpt, glm_ckpt / "out"):
        code, err = run_cli(capsys, glm_ckpt, dst)
        assert code == 2 and "overlaps the input" in err
    assert not (glm_ckpt / "out").exists()


def test_non_empty_output_needs_overwrite(glm_ckpt, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, glm_ckpt, dst)
    assert code == 2 and "not empty" in err and "--overwrite" in err
    code, err = run_cli(capsys, glm_ckpt, dst, "--overwrite")
    assert code == 2 and "does not look like a checkpoint folder" in err
    assert (dst / "notes.txt").read_text() == "mine"
    (dst / "notes.txt").unlink()
    assert run_cli(capsys, glm_ckpt, dst)[0] == 0
    assert run_cli(capsys, glm_ckpt, dst, "--overwrite")[0] == 0  # a previous conversion may be replaced


def test_unknown_family_says_which_manifest_to_write(tmp_path, capsys):
    config = tiny_config()
    src = write_checkpoint(tmp_path / "src", config)
    (src / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k9"}))
    code, err = run_cli(capsys, src, tmp_path / "dst")
    assert code == 2 and "'kimi_k9'" in err and "family.yaml" in err and "--family-manifest" in err
    assert "QUANTGATE_FAMILIES" in err and err.count("\n") == 1  # one line: copy a family folder into a root


def test_missing_config(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    code, err = run_cli(capsys, tmp_path / "src", tmp_path / "dst")
    assert code == 2 and "config.json: missing" in err
