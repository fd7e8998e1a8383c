"""GLM-5 scale: the fast kernel's exactness, resume, full disk, Ctrl-C, workers, full-size planning."""

from __future__ import annotations

import json
import signal
import subprocess

import numpy as np
import pytest
import torch

from quant.convert import MANIFEST_NAME, PROGRESS_NAME
from quant.example import glm5_config, tiny_config, write_checkpoint
from quant.formats import mxfp4, mxfp4_fast
from quant.formats.constants import ScaleRule
from quant.hashing import sha256_file
from quant.cli import main as quantize
from tests.conftest import (QUARK_DEFAULT_RECIPE_EXCLUDES, bytes_read, interrupt_midway, load_tensors, quantize_cmd,
                            quark_convert, write_sparse_checkpoint)
from tests.quant.test_mxfp4 import edge_case_weight


def every_bf16_pattern_in_blocks(exponent: int) -> torch.Tensor:
    """All finite bf16 bit patterns, 31 per block, each block pinned to scale 2^exponent by its
    first element (6 * 2^exponent)."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = patterns[torch.isfinite(patterns)]
    finite = finite[finite.abs() <= 6 * 2.0 ** exponent]  # the pin must stay the block's amax
    pad = (-finite.numel()) % 31
    body = torch.cat([finite, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 31)
    pin = torch.full((body.shape[0], 1), 6 * 2.0 ** exponent, dtype=torch.bfloat16)
    return torch.cat([pin, body], dim=1)


@pytest.mark.parametrize("exponent", [0, -3, 17, -100, -119, 125])
def test_fast_kernel_equals_reference_on_every_bf16_pattern(exponent):
    weight = every_bf16_pattern_in_blocks(exponent)
    packed, scales, flags, _, _ = mxfp4_fast.quantize_bf16(weight)
    ref_packed, ref_scales = mxfp4.quantize(weight)
    assert (flags == mxfp4_fast.ROW_OK).all()
    assert np.array_equal(scales, ref_scales.numpy()) and (scales == exponent + 127).all()
    assert np.array_equal(packed, ref_packed.numpy())


def test_fast_kernel_flags_tiny_and_non_finite_blocks():
    weight = edge_case_weight()
    weight[3, 40] = float("nan")
    _, _, flags, _, _ = mxfp4_fast.quantize_bf16(weight)
    assert flags[3] == mxfp4_fast.ROW_NON_FINITE
    tiny = torch.tensor([[2.0 ** -130] * 32], dtype=torch.bfloat16)
    assert mxfp4_fast.quantize_bf16(tiny)[2][0] == mxfp4_fast.ROW_NEEDS_REFERENCE


def test_converter_edge_cases_through_the_fast_path_match_quark(tmp_path):
    """Edge-case rows (ties, saturation, zero and tiny blocks, huge values) inside a real
    checkpoint: the converter's fast path, with its reference fallback, writes Quark's bytes."""
    config = tiny_config(hidden_size=64, moe_intermediate_size=64)
    weight = edge_case_weight()[:64]  # [64 rows, 64]: one routed expert's gate_proj
    src = write_checkpoint(tmp_path / "src", config, overrides={"model.layers.1.mlp.experts.0.gate_proj.weight": weight})
    quark_convert(src, tmp_path / "quark", QUARK_DEFAULT_RECIPE_EXCLUDES)
    subprocess.run(quantize_cmd(src, tmp_path / "ours"), check=True, capture_output=True)
    assert load_tensors(tmp_path / "ours") == load_tensors(tmp_path / "quark")


def same_checkpoint(a, b) -> None:
    """Byte-identical outputs; the manifest may differ only in timings and resume counts."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != MANIFEST_NAME:
            assert sha256_file(a / name) == sha256_file(b / name), name
    ma, mb = (json.loads((d / MANIFEST_NAME).read_text()) for d in (a, b))
    assert ma["shards"] == mb["shards"]


def test_resume_after_kill_finishes_identically(multi_shard_ckpt, multi_shard_reference, tmp_path):
    dst = tmp_path / "out"
    code, _ = interrupt_midway(multi_shard_ckpt, dst, signal.SIGKILL)
    assert code == -signal.SIGKILL and (dst / PROGRESS_NAME).exists()
    kept = json.loads((dst / PROGRESS_NAME).read_text())["shards"]
    assert 0 < len(kept) < 8
    out = subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume", "--json"), capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout)["manifest"]["resumed_shards"] == len(kept)  # finished shards are not redone
    assert not (dst / PROGRESS_NAME).exists()
    same_checkpoint(dst, multi_shard_reference)


def test_decode_runs_on_the_converter_executor(multi_shard_reference, tmp_path):
    """--to bf16 is a plan of per-tensor decode actions run by the one executor: a killed run
    resumes to the same bytes, two workers write the same bytes, the manifest records the decode."""
    full = tmp_path / "full"
    subprocess.run(quantize_cmd(multi_shard_reference, full, "--to", "bf16"), check=True, capture_output=True)
    manifest = json.loads((full / MANIFEST_NAME).read_text())
    quantized = json.loads((multi_shard_reference / MANIFEST_NAME).read_text())["summary"]["tensors_quantized"]
    assert (manifest["format"], manifest["decoded_from"]) == ("bf16", "mxfp4")
    assert manifest["summary"]["tensors_decoded"] == quantized > 0
    dst = tmp_path / "resumed"
    code, _ = interrupt_midway(multi_shard_reference, dst, signal.SIGKILL, "--to", "bf16")
    assert code == -signal.SIGKILL
    assert 0 < len(json.loads((dst / PROGRESS_NAME).read_text())["shards"]) < len(manifest["shards"])
    subprocess.run(quantize_cmd(multi_shard_reference, dst, "--to", "bf16", "--resume"), check=True, capture_output=True)
    same_checkpoint(dst, full)
    subprocess.run(quantize_cmd(multi_shard_reference, tmp_path / "w2", "--to", "bf16", "--workers", "2"), check=True,
                   capture_output=True)
    same_checkpoint(tmp_path / "w2", full)


def test_resume_redoes_a_kept_shard_that_no_longer_matches_its_hash(multi_shard_ckpt, multi_shard_reference,
                                                                    tmp_path):
    dst = tmp_path / "out"
    interrupt_midway(multi_shard_ckpt, dst, signal.SIGKILL)
    kept = sorted(json.loads((dst / PROGRESS_NAME).read_text())["shards"])
    with (dst / kept[0]).open("r+b") as f:  # bit rot in a finished shard
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume", "--json"), capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout)["manifest"]["resumed_shards"] == len(kept) - 1
    same_checkpoint(dst, multi_shard_reference)


def test_resume_refuses_a_different_plan(multi_shard_ckpt, tmp_path):
    dst = tmp_path / "out"
    interrupt_midway(multi_shard_ckpt, dst, signal.SIGKILL)
    out = subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume", "--shared-experts", "mxfp4"),
                         capture_output=True, text=True)
    assert out.returncode == 2 and "other sources, recipe or quantgate version" in out.stderr
    out = subprocess.run(quantize_cmd(multi_shard_ckpt, dst), capture_output=True, text=True)
    assert out.returncode == 2 and "--resume to finish it" in out.stderr


def test_ctrl_c_stops_cleanly_and_resumes(multi_shard_ckpt, multi_shard_reference, tmp_path):
    dst = tmp_path / "out"
    code, err = interrupt_midway(multi_shard_ckpt, dst, signal.SIGINT)
    assert code == 130 and "rerun with --resume" in err
    assert not list(dst.glob("*.partial")) and (dst / PROGRESS_NAME).exists()
    subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume"), check=True, capture_output=True)
    same_checkpoint(dst, multi_shard_reference)


@pytest.fixture
def small_disk(tmp_path):
    """A real 100 MB filesystem (tmpfs) to run out of; needs root, as CI and this machine have."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_mid_run_is_clear_and_resumable(multi_shard_ckpt, multi_shard_reference, small_disk):
    dst = small_disk / "out"
    ballast = small_disk / "ballast"

    def fill_disk():  # while the converter is frozen, take every free byte
        with ballast.open("wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass

    code, err = interrupt_midway(multi_shard_ckpt, dst, signal.SIGSTOP, on_stop=fill_disk)
    assert code == 1, err
    assert "disk full" in err and "--resume" in err
    assert not list(dst.glob("*.partial"))
    for shard in dst.glob("*.safetensors"):  # what is there under a final name is complete
        assert sha256_file(shard) == sha256_file(multi_shard_reference / shard.name)
    ballast.unlink()
    subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume"), check=True, capture_output=True)
    same_checkpoint(dst, multi_shard_reference)


def test_refuses_to_start_without_room(multi_shard_ckpt, small_disk):
    (small_disk / "ballast").write_bytes(b"\0" * (60 << 20))
    out = subprocess.run(quantize_cmd(multi_shard_ckpt, small_disk / "out"), capture_output=True, text=True)
    assert out.returncode == 1
    assert "needs 0.07 GB more but only 0.04 GB are free" in out.stderr
    assert not list((small_disk / "out").glob("*.safetensors"))


def test_two_workers_write_the_same_bytes(multi_shard_ckpt, multi_shard_reference, tmp_path):
    subprocess.run(quantize_cmd(multi_shard_ckpt, tmp_path / "w2", "--workers", "2"), check=True, capture_output=True)
    same_checkpoint(tmp_path / "w2", multi_shard_reference)
    assert json.loads((tmp_path / "w2" / MANIFEST_NAME).read_text())["summary"]["workers"] == 2


def test_full_size_glm5_dry_run_from_headers_only(tmp_path, capsys):
    claimed = write_sparse_checkpoint(tmp_path / "glm5", glm5_config(), shards=282)
    assert len(list((tmp_path / "glm5").glob("*.safetensors"))) == 282
    assert claimed == pytest.approx(1.508e12, rel=1e-3)
    before = bytes_read()
    assert quantize(["--to", "mxfp4", "--dry-run", "--json", str(tmp_path / "glm5"), str(tmp_path / "out")]) == 0
    assert bytes_read() - before < 64e6  # headers only (13 MB measured): the data is 1.5 TB
    plan = json.loads(capsys.readouterr().out)
    assert plan["tensors_quantized"] == 58368 == plan["by_role"]["routed_expert"]["quantize"]  # 76 x 256 x 3
    assert plan["bytes_in"] == claimed
    expert = 6144 * 2048
    assert plan["bytes_in"] - plan["bytes_out"] == pytest.approx(58368 * (2 * expert - expert // 2 - expert // 32),
                                                                 rel=1e-4)
    assert "model.decoder.mlp.shared_experts.gate_proj" in plan["exclude"]
    assert "model.layers.78.mlp.shared_experts.gate_proj" in plan["exclude"]
    assert plan["mtp_layers"] == ["78"]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_device_writes_the_same_bytes(glm_ckpt, tmp_path):
    subprocess.run(quantize_cmd(glm_ckpt, tmp_path / "cpu"), check=True, capture_output=True)
    subprocess.run(quantize_cmd(glm_ckpt, tmp_path / "cuda", "--device", "cuda"), check=True, capture_output=True)
    assert load_tensors(tmp_path / "cpu") == load_tensors(tmp_path / "cuda")
    weight = edge_case_weight()
    for rule in ScaleRule:
        cpu = mxfp4.quantize(weight, rule)
        gpu = mxfp4.quantize(weight.cuda(), rule)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


def test_fast_decode_equals_reference_for_every_scale_byte_and_packed_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # every code pair in every row
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 16)  # row s: scale byte s
    reference = mxfp4.dequantize(packed, scales).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(mxfp4_fast.decode_bf16(packed.numpy(), scales.numpy()), reference)


def test_fast_error_sample_is_the_reference_error_of_the_sampled_rows():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 256, generator=gen) * torch.logspace(-3, 2, 96)[:, None]).to(torch.bfloat16)
    _, _, flags, err_sq, ref_sq = mxfp4_fast.quantize_bf16(x, error_stride=8, row_offset=3)
    xf = x.float().double()
    error = (mxfp4.dequantize(*mxfp4.quantize(x), torch.float32).double() - xf) ** 2
    sampled = (torch.arange(96) + 3) % 8 == 0
    assert not flags.any()
    assert np.allclose(err_sq, torch.where(sampled, error.sum(1), 0).numpy(), rtol=1e-12, atol=0)
    assert np.allclose(ref_sq, torch.where(sampled, (xf * xf).sum(1), 0).numpy(), rtol=1e-12, atol=0)
