"""Hostile inputs, third campaign, converter and decoder side: a source that changes after it was
planned (or under a reader that holds no lease), tiles whose amax underflows, corrupt quantized
checkpoints the decoder and ``gate checkpoint --deep`` must refuse, outputs more readable than
their sources, links planted in ``quantize --example``'s folder.

Real files, real processes: each refusal is one line naming the file or tensor, exit 2, and no
NaN, Inf or unfilled memory is ever written; files outside SRC and DST are unchanged (``outside``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import quantgate
from quant.errors import QuantgateError
from quant.example import tensor_shapes, tiny_config, write_checkpoint
from quant.outputs import INDEX_NAME, MANIFEST_NAME
from quant.safetensors_io import PARTIAL_SUFFIX, encode_header, read_header
from quant.source import SourceReader
from tests.conftest import default_sigint, interrupt_midway, load_tensors, quantize_cmd
from tests.quant.test_hostile import gate, one_line_error, quantize, rewrite_header, src  # noqa: F401
from tests.quant.test_hostile_links import outside  # noqa: F401  (fixture)
from tests.quant.test_scale import same_checkpoint

EXPERT = "model.layers.1.mlp.experts.0.down_proj.weight"  # quantized by every format's recipe
FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8"]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "-q", *map(str, args)], capture_output=True, text=True)


def refused(out: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line, no traceback, every needle in that line."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr
    one_line_error(out.stderr, *needles)


@pytest.fixture(scope="module")
def quantized(glm_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("third_quantized")
    out = {}
    for to in FORMATS:
        out[to] = root / to
        subprocess.run([sys.executable, "-m", "quant.cli", "-q", "--to", to, str(glm_ckpt), str(out[to])],
                       check=True, capture_output=True)
    return out


def grow_header(path: Path, by: int = 16) -> None:
    """The same tensors, the header ``by`` bytes longer (JSON padding): every data offset moves."""
    rewrite_header(path, lambda header: header)  # re-encoded without the 8-byte alignment padding
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    body = raw[8:8 + n] + b" " * by
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


# ---- 1. a source shard is re-checked against the plan when it is opened ---------------------------

def test_api_refuses_a_shard_whose_header_grew_after_planning(glm_ckpt, tmp_path):
    src = Path(shutil.copytree(glm_ckpt, tmp_path / "src"))
    planned = quantgate.plan(src)
    last = src / planned.shards[-1].file
    before = read_header(last)
    grow_header(last)
    after = read_header(last)  # same tensors, other offsets: what was read silently at the old ones
    assert {n: (t.dtype, t.shape) for n, t in after.tensors.items()} == \
        {n: (t.dtype, t.shape) for n, t in before.tensors.items()}
    assert all(after.tensors[n].begin != t.begin for n, t in before.tensors.items())
    with pytest.raises(QuantgateError) as caught:
        quantgate.convert(planned, tmp_path / "out")
    message = str(caught.value)
    assert "\n" not in message and str(last) in message and "changed since it was planned" in message
    assert caught.value.exit_code == 2
    assert not (tmp_path / "out" / last.name).exists() and not list((tmp_path / "out").glob("*" + PARTIAL_SUFFIX))
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    fresh = quantgate.convert(quantgate.plan(src), tmp_path / "out", resume=True)  # planned again: converts
    assert fresh.manifest["shards"][-1]["source_sha256"]


@pytest.mark.parametrize("change", ["header", "same bytes"])
def test_cli_refuses_a_later_shard_replaced_by_mv_while_an_earlier_one_converts(change, multi_shard_ckpt, tmp_path):
    """Frozen mid-run, the last shard (not opened yet) is replaced by ``mv``: with a longer header,
    or with a byte-identical copy (another file all the same). Exit 2 naming it; --resume finishes."""
    src = Path(shutil.copytree(multi_shard_ckpt, tmp_path / "src"))
    dst = tmp_path / "out"
    last = sorted(src.glob("*.safetensors"))[-1]
    replaced = []

    def replace_last():
        copy = tmp_path / "replacement.safetensors"
        shutil.copyfile(last, copy)
        if change == "header":
            grow_header(copy)
        os.rename(copy, last)  # what mv does within one filesystem
        replaced.append(last)

    code, err = interrupt_midway(src, dst, signal.SIGSTOP, on_stop=replace_last)
    assert replaced and code == 2, (code, err)
    assert "Traceback" not in err
    one_line_error(err, str(last), "changed since it was planned", "--resume")
    assert not (dst / last.name).exists() and not list(dst.glob("*" + PARTIAL_SUFFIX))
    out = subprocess.run(quantize_cmd(src, dst, "--resume"), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fresh = tmp_path / "fresh"
    subprocess.run(quantize_cmd(src, fresh), check=True, capture_output=True)
    same_checkpoint(dst, fresh)


def test_without_a_lease_the_source_is_read_not_mapped(glm_ckpt, tmp_path):
    """A file someone holds open for writing cannot be leased (fcntl(2): F_SETLEASE F_RDLCK fails
    with EAGAIN), so nothing would stop a truncation under a mapping: the reader maps nothing."""
    path = Path(shutil.copy(next(glm_ckpt.glob("*.safetensors")), tmp_path / "shard.safetensors"))
    leased = SourceReader(path)
    try:
        assert leased.guard.leased and leased.map is not None
    finally:
        leased.close()
    with path.open("r+b"):
        reader = SourceReader(path)
        try:
            assert not reader.guard.leased and reader.map is None
            assert bytes(reader.read(0, 8)) == path.read_bytes()[:8]
            assert reader.finish() == hashlib.sha256(path.read_bytes()).hexdigest()
        finally:
            reader.close()


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_truncation_without_a_lease_is_one_line_never_sigbus(attempt, multi_shard_ckpt, outside, tmp_path):  # noqa: F811
    """Every shard held open for writing elsewhere (so no lease), the shard being read is cut to
    nothing while the converter is frozen: one line naming it, exit 2, never SIGBUS; restored,
    --resume finishes to the bytes of a clean run. Where the freeze lands is chance: a reader that
    mapped the file died of SIGBUS in 1 of these 3 attempts here (frozen while touching a chunk)."""
    src = Path(shutil.copytree(multi_shard_ckpt, tmp_path / "src"))
    dst = tmp_path / "out"
    writers = [path.open("r+b") for path in sorted(src.glob("*.safetensors"))]
    cut = []

    def truncate_in_flight():
        partial = next(dst.glob("*" + PARTIAL_SUFFIX))
        cut.append(src / partial.name.removesuffix(PARTIAL_SUFFIX))
        os.truncate(cut[0], 0)  # no lease to wait on: it lands at once

    try:
        code, err = interrupt_midway(src, dst, signal.SIGSTOP, on_stop=truncate_in_flight)
    finally:
        for f in writers:
            f.close()
    assert code != -signal.SIGBUS and "Traceback" not in err, (code, err)
    assert code == 2, err
    one_line_error(err, str(cut[0]), "--resume")
    assert not list(dst.glob("*" + PARTIAL_SUFFIX))
    shutil.copy(multi_shard_ckpt / cut[0].name, cut[0])
    subprocess.run(quantize_cmd(src, dst, "--resume"), check=True, capture_output=True)
    fresh = tmp_path / "fresh"
    subprocess.run(quantize_cmd(src, fresh), check=True, capture_output=True)
    same_checkpoint(dst, fresh)


# ---- 5. a tile or block whose amax underflows ----------------------------------------------------

@pytest.mark.parametrize("to", FORMATS)
def test_a_tile_of_one_fp32_subnormal_encodes_to_zeros_with_a_finite_scale(to, tmp_path):
    """An fp32 weight whose every value is 1e-44 (a subnormal: amax / 448 underflows to 0) converts,
    and decodes to zeros: no NaN code, a finite non-zero FP8 scale, no 0xFF MX scale."""
    config = tiny_config("glm_moe_dsa")
    shape, _ = tensor_shapes(config)[EXPERT]
    tiny = torch.full(shape, 1e-44, dtype=torch.float32)
    assert 0 < float(tiny[0, 0]) < torch.finfo(torch.float32).tiny
    src = write_checkpoint(tmp_path / "src", config, overrides={EXPERT: tiny})
    out = cli("--to", to, src, tmp_path / "q")
    assert out.returncode == 0, out.stderr
    tensors = load_tensors(tmp_path / "q")
    dtype, _, weight = tensors[EXPERT]
    scale_name = EXPERT + ("_scale_inv" if to == "fp8" else "_scale")
    scale = tensors[scale_name][2]
    if to == "fp8":
        assert dtype == "F8_E4M3" and not any((b & 0x7F) == 0x7F for b in weight)
        values = np.frombuffer(scale, "<f4")
        assert np.isfinite(values).all() and (values > 0).all()
    else:
        assert 0xFF not in scale
    out = cli("--to", "bf16", tmp_path / "q", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    dtype, _, back = load_tensors(tmp_path / "back")[EXPERT]
    assert dtype == "BF16" and not any(back), "decodes to zeros (1e-44 is below every format's smallest step)"
    deep = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(tmp_path / "q"), "--deep", "--json"],
                          capture_output=True, text=True)
    assert deep.returncode in (0, 1), deep.stderr  # MXFP6: sglang refuses the format, which is a finding
    findings = [f for engine in json.loads(deep.stdout)["engines"].values() for f in engine["findings"]]
    assert not [f for f in findings if f["check"] in ("values", "layout")], findings


# ---- 5 + 7. corrupt quantized checkpoints: the decoder refuses, gate --deep flags ----------------

def shard_of(folder: Path, tensor: str) -> Path:
    return folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][tensor]


def rewrite_shard(path: Path, change=None, order=None) -> None:
    """Rewrite a shard: ``change(tensors)`` edits ``{name: torch tensor}`` in place; ``order`` (a
    function of the names) lays the data out in that order, the header listing them in it."""
    with safe_open(str(path), "pt") as f:  # copies: the file is rewritten below
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    if change:
        change(tensors)
    names = order(list(tensors)) if order else sorted(tensors)
    entries = [(n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8",
                    torch.float8_e4m3fn: "F8_E4M3"}[tensors[n].dtype], tuple(tensors[n].shape)) for n in names]
    header, _ = encode_header(entries)
    with path.open("wb") as f:
        f.write(header)
        for n in names:
            if tensors[n].numel():
                f.write(tensors[n].contiguous().view(torch.uint8).numpy().tobytes())


def corrupt_copy(folder: Path, tmp_path: Path, change) -> Path:
    bad = Path(shutil.copytree(folder, tmp_path / "bad"))
    rewrite_shard(shard_of(bad, EXPERT), change)
    return bad


def _set_scale(value, suffix="_scale_inv"):
    def change(tensors):
        scale = tensors[EXPERT + suffix].clone()
        scale.view(-1)[0] = value
        tensors[EXPERT + suffix] = scale
    return change


def _set_code(byte):
    def change(tensors):
        codes = tensors[EXPERT].view(torch.uint8).clone()
        codes[1, 2] = byte
        tensors[EXPERT] = codes.view(torch.float8_e4m3fn)
    return change


VALUE_CASES = {  # (format, change, what the decoder and the gate say)
    "mx-scale-0xff": ("mxfp4", _set_scale(255, "_scale"), "0xFF (E8M0 NaN)"),
    "mxfp6-scale-0xff": ("mxfp6_e3m2", _set_scale(255, "_scale"), "0xFF (E8M0 NaN)"),
    "fp8-scale-nan": ("fp8", _set_scale(float("nan")), "scale_inv nan"),
    "fp8-scale-inf": ("fp8", _set_scale(float("inf")), "scale_inv inf"),
    "fp8-scale-negative": ("fp8", _set_scale(-0.5), "scale_inv -0.5"),
    "fp8-scale-overflows": ("fp8", _set_scale(1e37), "decodes to NaN/Inf"),
    "mx-scale-overflows": ("mxfp4", _set_scale(254, "_scale"), "decodes to NaN/Inf"),
    "e4m3-nan-7f": ("fp8", _set_code(0x7F), "e4m3 NaN code 0x7F at row 1, column 2"),
    "e4m3-nan-ff": ("fp8", _set_code(0xFF), "e4m3 NaN code 0xFF at row 1, column 2"),
}


@pytest.mark.parametrize("case", VALUE_CASES)
def test_forbidden_scales_and_codes_are_refused_by_decode_and_flagged_by_gate_deep(case, quantized, outside,  # noqa: F811
                                                                                  tmp_path, capsys):
    to, change, says = VALUE_CASES[case]
    bad = corrupt_copy(quantized[to], tmp_path, change)
    refused(cli("--to", "bf16", bad, tmp_path / "back"), EXPERT, says, "re-export")
    assert not list((tmp_path / "back").glob("*.safetensors*")) if (tmp_path / "back").exists() else True
    _, out, _ = gate(capsys, bad)
    assert says not in out, out  # headers alone cannot see it
    code, out, _ = gate(capsys, bad, "--deep")
    assert code == 1 and says in out and EXPERT in out, out


SHAPE_CASES = {  # (format, change, what both say)
    "mxfp4-34-columns": ("mxfp4", lambda t: t.update({EXPERT: torch.cat([t[EXPERT], t[EXPERT][:, :1]], dim=1)}),
                         "34 values a row is not a whole number of 32-value blocks"),
    "mxfp4-zero-rows": ("mxfp4", lambda t: t.update({EXPERT: t[EXPERT][:0].clone(),
                                                      EXPERT + "_scale": t[EXPERT + "_scale"][:0].clone()}),
                        "has no elements"),
    "mxfp6-bytes-not-by-3": ("mxfp6_e2m3", lambda t: t.update({EXPERT: t[EXPERT][:, :-1].clone()}),
                             "is not a whole number of 6-bit mxfp6_e2m3 codes"),
    "fp8-zero-rows": ("fp8", lambda t: t.update({EXPERT: t[EXPERT][:0].clone(),
                                                  EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"][:0].clone()}),
                      "has no elements"),
}


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_stored_shapes_the_format_cannot_hold_are_refused_before_reading(case, quantized, outside, tmp_path,  # noqa: F811
                                                                         capsys):
    """A partial MX block (34 columns: the kernel left columns 32-33 unwritten), zero rows, MXFP6
    bytes not divisible by 3: decode refuses at plan time (one line, exit 2, no output shard);
    ``gate checkpoint`` flags it from the header."""
    to, change, says = SHAPE_CASES[case]
    bad = corrupt_copy(quantized[to], tmp_path, change)
    refused(cli("--to", "bf16", bad, tmp_path / "back"), EXPERT, says)
    assert not (tmp_path / "back").exists() or not list((tmp_path / "back").glob("*.safetensors*"))
    code, out, _ = gate(capsys, bad, "--deep")
    assert code == 1 and says in out, out


def test_mxfp4_decode_kernel_refuses_a_partial_block_instead_of_leaving_memory_unwritten():
    from quant.formats import mxfp4_fast

    with pytest.raises(ValueError, match="unwritten"):
        mxfp4_fast.decode_bf16(np.zeros((4, 17), np.uint8), np.full((4, 1), 127, np.uint8))


@pytest.mark.parametrize("order", ["save_file", "reversed", "interleaved"])
@pytest.mark.parametrize("to", ["fp8", "mxfp4"])
def test_decode_reads_any_on_disk_tensor_order(to, order, quantized, tmp_path):
    """The same valid checkpoint stored in the order safetensors' save_file writes (dtype size
    first: every FP8 scale_inv before its weight), reversed, or each scale just before its
    weight: decodes to the same bytes as in the converter's order."""
    folder = Path(shutil.copytree(quantized[to], tmp_path / "reordered"))
    for path in sorted(folder.glob("*.safetensors")):
        if order == "save_file":
            with safe_open(str(path), "pt") as f:
                tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
            save_file(tensors, str(path), metadata={"format": "pt"})
        elif order == "reversed":
            rewrite_shard(path, order=lambda names: sorted(names, reverse=True))
        else:
            rewrite_shard(path, order=lambda names: sorted(names, key=lambda n: (n.split(".weight")[0],
                                                                               n.endswith(".weight"))))
    moved = [t for t in read_header(shard_of(folder, EXPERT)).tensors.values() if t.name.startswith(EXPERT)]
    assert min(moved, key=lambda t: t.begin).name != EXPERT or to == "mxfp4" and order == "save_file"
    out = cli("--to", "bf16", folder, tmp_path / "back")
    assert out.returncode == 0, out.stderr
    straight = cli("--to", "bf16", quantized[to], tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    assert load_tensors(tmp_path / "back") == load_tensors(tmp_path / "straight")


# ---- 9. outputs are never more readable than their sources ---------------------------------------

@pytest.mark.parametrize("to", ["mxfp4", "bf16"])
def test_outputs_are_no_more_readable_than_their_sources(to, glm_ckpt, quantized, tmp_path):
    src = Path(shutil.copytree(glm_ckpt if to == "mxfp4" else quantized["mxfp4"], tmp_path / "src"))
    for shard in src.glob("*.safetensors"):
        shard.chmod(0o600)
    (src / "config.json").chmod(0o640)
    out = cli("--to", to, src, tmp_path / "out")
    assert out.returncode == 0, out.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    for name, mode in modes.items():
        if name.endswith(".safetensors") or name in (INDEX_NAME, MANIFEST_NAME):
            assert mode == 0o600, (name, oct(mode))
    assert modes["config.json"] == 0o640
    assert modes["tokenizer_config.json"] == stat.S_IMODE((src / "tokenizer_config.json").stat().st_mode) & ~0o022


def test_a_strict_umask_wins_over_a_readable_source(glm_ckpt, tmp_path):
    out = subprocess.run([sys.executable, "-m", "quant.cli", "-q", "--to", "mxfp4", str(glm_ckpt),
                          str(tmp_path / "out")], capture_output=True, text=True, preexec_fn=lambda: os.umask(0o077))
    assert out.returncode == 0, out.stderr
    for path in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


# ---- 8. quantize --example never writes through a link -------------------------------------------

@pytest.mark.parametrize("planted", ["bf16", "mxfp4"])
def test_example_refuses_links_planted_in_its_folder(planted, outside, tmp_path):  # noqa: F811
    folder = tmp_path / "example"
    folder.mkdir()
    target = tmp_path / "elsewhere"  # a folder of someone else's: must stay empty
    target.mkdir()
    (folder / planted).symlink_to(target)
    out = subprocess.run([sys.executable, "-m", "quant.cli", "-q", "--to", "mxfp4", "--example", str(folder)],
                         capture_output=True, text=True, preexec_fn=default_sigint)
    refused(out, str(folder / planted), "symbolic link")
    assert not list(target.iterdir())
    assert not (folder / ("mxfp4" if planted == "bf16" else "bf16")).exists()
