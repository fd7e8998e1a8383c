"""The numba block-FP8 kernels (``fp8_fast``) against the torch reference (``fp8``): the same bytes
both ways, on edge values, on every tensor of the example checkpoint, and without loading torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quant.cli import main as quantize
from quant.errors import NonFiniteError
from quant.formats import fp8, fp8_fast
from quant.formats.codecs import get_codec


def bf16_bytes(w: torch.Tensor) -> np.ndarray:
    """The raw bytes ``[rows, in * 2]`` the executor hands a kernel."""
    return w.contiguous().view(torch.uint8).numpy()


def assert_matches_reference(w: torch.Tensor) -> None:
    codes, scale_inv, flags, _, _ = fp8_fast.quantize_bf16(bf16_bytes(w))
    q, ref_scale = fp8.quantize(w)
    assert (flags == fp8_fast.ROW_OK).all()
    assert np.array_equal(scale_inv.view(np.uint32), ref_scale.numpy().view(np.uint32))
    assert np.array_equal(codes, q.view(torch.uint8).numpy())
    decoded = fp8_fast.decode_bf16(codes, scale_inv)
    assert np.array_equal(decoded, fp8.dequantize(q, ref_scale).view(torch.int16).numpy().view(np.uint16))


def rounding_boundaries() -> np.ndarray:
    """Every float32 up to e4m3's top whose low 16 bits are one of a few patterns: all e4m3 ties
    (normal and subnormal) and the values one ulp either side of them, every exponent."""
    top = int(np.float32(448).view(np.uint32)) >> 16
    high = np.arange(top + 1, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234], dtype=np.uint32)
    bits = (high[:, None] | low[None, :]).reshape(-1)
    values = bits[bits <= np.float32(448).view(np.uint32)].view(np.float32)
    return np.concatenate([values, -values])


def test_float32_to_e4m3_is_torchs_cast_at_every_rounding_boundary():
    values = rounding_boundaries()
    ours = fp8_fast.e4m3_from_float32(values)
    assert np.array_equal(ours, torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    assert ours[values.view(np.uint32) == 0x80000000].tolist() == [0x80]  # -0 keeps its sign


def test_e4m3_values_are_torchs():
    ours = fp8_fast.e4m3_values()
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(ours, ref, equal_nan=True) and np.isnan(ours[[0x7F, 0xFF]]).all()


def test_random_and_edge_values_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    # Partial edge tiles (300 x 200: 3 x 2 tiles, the last ones 44 rows and 72 columns), magnitudes
    # over 80 binades so tiles hold values that become e4m3 subnormals or round to +-0.
    w = (torch.randn(300, 200, generator=gen) * torch.logspace(-38, 38, 200)).to(torch.bfloat16)
    w[:128, :128] = 0  # an all-zero tile: scale 1.0
    w[128:256, :128] = -0.0  # a tile of -0: scale 1.0, every code 0x80
    w[256:, :128] = 0  # a tile of bf16 subnormals: its amax and scale are subnormal too
    w[256:262, 0] = torch.from_numpy(np.array([1, 2, 3, 0x7F, 0x8001, 0x807F], np.uint16).view(np.int16)).view(torch.bfloat16)
    # Ties: with amax 448 the scale is exactly 1.0, and these sit halfway between e4m3 neighbours.
    w[128:256, 128:] = 0
    w[140, 160:168] = torch.tensor([448, 1.0625, 1.1875, -1.0625, 0.5 * 2 ** -9, 1.5 * 2 ** -9, 2 ** -6 * 1.0625,
                                    -(2.5 * 2 ** -9)])
    w[288, 150] = torch.finfo(torch.bfloat16).max  # the largest bf16s: their tile's scale is about 7.6e35
    w[290, 151] = -torch.finfo(torch.bfloat16).max
    w[5, 130:] = 0
    assert_matches_reference(w)
    codes, scale_inv, *_ = fp8_fast.quantize_bf16(bf16_bytes(w))
    assert scale_inv[1, 1] == 1.0 and codes[140, 160:168].tolist() == [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x08, 0x82]
    assert (codes[128:256, :128] == 0x80).all() and scale_inv[0, 0] == scale_inv[1, 0] == 1.0


@pytest.mark.parametrize("shape", [(128, 128), (1, 7), (129, 257), (384, 1024)])
def test_random_shapes_match_the_reference(shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
    assert_matches_reference(w)


def test_decode_matches_the_reference_on_every_code_and_odd_scales():
    codes = np.tile(np.arange(256, dtype=np.uint8), (128, 1)).reshape(256, 128)  # 2 x 1 tiles
    for scale in (1.0, 1e-3, 3.3e-39, 2.0 ** -149, 7.6e35, 3e38, float("inf"), float("nan"), -2.5):
        scale_inv = np.array([[scale], [1 / 448]], dtype=np.float32)
        ref = fp8.dequantize(torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scale_inv))
        assert np.array_equal(fp8_fast.decode_bf16(codes, scale_inv), ref.view(torch.int16).numpy().view(np.uint16)), scale


def test_error_sample_is_on_the_strided_rows():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 256, generator=gen)).to(torch.bfloat16)
    _, _, _, err_sq, ref_sq = fp8_fast.quantize_bf16(bf16_bytes(w), error_stride=8, row_offset=3)
    q, scale_inv = fp8.quantize(w)
    x = w.float()
    d = fp8.dequantize(q, scale_inv, torch.float32) - x
    rows = [r for r in range(256) if (r + 3) % 8 == 0]
    assert np.flatnonzero(ref_sq).tolist() == rows
    assert np.allclose(err_sq[rows], (d[rows] ** 2).sum(1).double().numpy(), rtol=1e-6)
    assert np.allclose(ref_sq[rows], (x[rows] ** 2).sum(1).double().numpy(), rtol=1e-6)


def test_non_finite_is_refused_with_its_place():
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    w[200, 17] = float("nan")
    flags = fp8_fast.quantize_bf16(bf16_bytes(w))[2]
    assert flags.tolist() == [fp8_fast.ROW_OK, fp8_fast.ROW_NON_FINITE]
    with pytest.raises(NonFiniteError, match="NaN/Inf at row 1224, column 17"):
        get_codec("fp8").encode(bf16_bytes(w), "BF16", row0=1024)


def test_every_tensor_of_the_example_is_the_reference(glm_ckpt, tmp_path, capsys):
    """The converter's FP8 output, tensor by tensor, against ``fp8.quantize`` of the source; and
    ``--to bf16`` of it against ``fp8.dequantize``."""
    assert quantize(["--to", "fp8", "-q", str(glm_ckpt), str(tmp_path / "fp8")]) == 0
    assert quantize(["--to", "bf16", "-q", str(tmp_path / "fp8"), str(tmp_path / "deq")]) == 0
    capsys.readouterr()
    weight_map = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    checked = 0
    for name, file in weight_map.items():
        if not name.endswith("_scale_inv"):
            continue
        weight = name.removesuffix("_scale_inv")
        with safe_open(str(glm_ckpt / file), "pt") as f:
            source = f.get_tensor(weight)
        with safe_open(str(tmp_path / "fp8" / file), "pt") as f:
            q, scale_inv = f.get_tensor(weight), f.get_tensor(name)
        with safe_open(str(tmp_path / "deq" / file), "pt") as f:
            decoded = f.get_tensor(weight)
        ref_q, ref_scale = fp8.quantize(source)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale_inv, ref_scale), weight
        assert torch.equal(decoded.view(torch.int16), fp8.dequantize(q, scale_inv).view(torch.int16)), weight
        checked += 1
    assert checked == 68


def test_converting_bf16_to_fp8_and_back_loads_no_torch(glm_ckpt, tmp_path):
    code = ("import sys\n"
            "import quant.cli\n"
            f"assert quant.cli.main(['--to', 'fp8', '-q', {str(glm_ckpt)!r}, {str(tmp_path / 'fp8')!r}]) == 0\n"
            f"assert quant.cli.main(['--to', 'bf16', '-q', {str(tmp_path / 'fp8')!r}, {str(tmp_path / 'deq')!r}]) == 0\n"
            "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['numba']"
