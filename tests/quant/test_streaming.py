"""Streaming and atomic output: plans from headers alone, and a killed run leaves no lie on disk."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from quant.convert import MANIFEST_NAME, sha256_file
from quant.example import tiny_config
from quant.plan import make_plan
from quant.recipe import load_recipe
from quant.safetensors_io import read_header
from quant.cli import main as quantize
from tests.conftest import bytes_read, interrupt_midway, write_sparse_checkpoint

def test_dry_run_plans_from_headers_only(tmp_path, capsys):
    # Real GLM-5 expert dims, 8 layers x 16 experts: ~9 GB claimed, ~0 bytes on disk.
    config = tiny_config(num_hidden_layers=8, first_k_dense_replace=3, n_routed_experts=16,
                         hidden_size=6144, moe_intermediate_size=2048, intermediate_size=12288, vocab_size=1024)
    claimed = write_sparse_checkpoint(tmp_path / "sparse", config, tensors_per_shard=200)
    used = sum(os.stat(p).st_blocks * 512 for p in (tmp_path / "sparse").iterdir())
    assert claimed > 9e9 and used < 10e6
    before = bytes_read()
    assert quantize(["--to", "mxfp4", "--dry-run", "--json", str(tmp_path / "sparse"), str(tmp_path / "out")]) == 0
    assert bytes_read() - before < 8e6  # headers only (0.1 MB measured): the data is 9 GB
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors_quantized"] == (8 - 3 + 1) * 16 * 3  # 5 MoE layers + the MTP layer
    assert summary["bytes_in"] == claimed
    expert_bytes = 6144 * 2048 * 2
    packed_bytes = expert_bytes // 4 + expert_bytes // 2 // 32  # 4-bit codes + one byte per 32 values
    assert summary["bytes_in"] - summary["bytes_out"] == pytest.approx(
        summary["tensors_quantized"] * (expert_bytes - packed_bytes), rel=1e-4)
    assert not (tmp_path / "out").exists()


def test_output_header_written_from_plan_matches_safetensors_reader(glm_ckpt, tmp_path):
    from quant.convert import convert

    plan = make_plan(glm_ckpt, load_recipe())
    convert(plan, tmp_path / "out", show_progress=False)
    for shard in plan.shards:
        header = read_header(tmp_path / "out" / shard.file)
        assert [(t.name, t.dtype, t.shape) for t in sorted(header.tensors.values(), key=lambda t: t.begin)] == \
            [(n, d, tuple(s)) for n, d, s in shard.entries]
        assert header.file_size == shard.output_size
        assert header.metadata == {"format": "pt"}


def test_killed_conversion_leaves_only_complete_shards(multi_shard_ckpt, multi_shard_reference, tmp_path):
    dst = tmp_path / "killed"
    code, _ = interrupt_midway(multi_shard_ckpt, dst, signal.SIGKILL)
    assert code == -signal.SIGKILL
    finished = sorted(dst.glob("*.safetensors"))
    assert finished, "the conversion ended before it could be killed mid-way"
    assert len(finished) < len(list(multi_shard_reference.glob("*.safetensors")))
    for shard in finished:  # every final-named shard is complete and identical to the uninterrupted run
        assert sha256_file(shard) == sha256_file(multi_shard_reference / shard.name)
    assert not (dst / MANIFEST_NAME).exists() and not (dst / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "no_o_direct"])
def test_shard_writer_bytes_and_hash_through_stages(tmp_path, monkeypatch, direct):
    """Whole stages go O_DIRECT, the unaligned tail through the page cache; where the platform has
    no O_DIRECT every block is buffered. Either way the file is exactly the data, and the digest
    is its sha256."""
    import fcntl
    import hashlib

    import numpy as np

    from quant.safetensors_io import ShardWriter, encode_header

    monkeypatch.setattr(ShardWriter, "STAGE_BYTES", 8192)
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT")
    entries = [("a", "U8", (5, 7001)), ("b", "BF16", (9, 513)), ("c", "U8", (1,))]  # odd sizes: an unaligned tail
    rng = np.random.default_rng(0)
    data = {name: rng.integers(0, 256, int(np.prod(shape)) * (2 if dtype == "BF16" else 1), dtype=np.uint8)
            for name, dtype, shape in entries}
    writer = ShardWriter(tmp_path / "x.safetensors", entries)
    if direct and not fcntl.fcntl(writer.fd, fcntl.F_GETFL) & os.O_DIRECT:
        writer.abort()
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    for name, _, _ in entries:
        for start in range(0, len(data[name]), 3000):  # pieces that straddle stage boundaries
            writer.write(name, start, data[name][start:start + 3000].copy())
    digest = writer.commit()
    expected = encode_header(entries)[0] + b"".join(data[name].tobytes() for name, _, _ in entries)
    written = (tmp_path / "x.safetensors").read_bytes()
    assert len(expected) > 4 * 8192 and len(expected) % 4096
    assert written == expected and digest == hashlib.sha256(expected).hexdigest()
    assert not list(tmp_path.glob("*.partial"))


def test_source_hash_runs_ahead_of_the_reader_only_so_far(tmp_path, monkeypatch):
    import hashlib

    from quant import source

    monkeypatch.setattr(source, "LEAD_BYTES", 64 << 10)
    monkeypatch.setattr(source, "CHUNK_BYTES", 16 << 10)
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(1 << 20))
    reader = source.SourceReader(path)
    try:
        deadline = time.monotonic() + 10
        while reader.hash.pos < (64 << 10) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        assert reader.hash.pos == 64 << 10  # hashed up to the lead, and waits there
        reader.read(0, 100_000)
        assert reader.finish() == hashlib.sha256(path.read_bytes()).hexdigest()  # the rest, unread, hashed too
    finally:
        reader.close()
