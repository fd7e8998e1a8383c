"""``--to bf16`` of compressed-tensors and ModelOpt checkpoints: every decoded element equal to a
reference written here from each format's definition (the producer library's own dequantization,
cited per reference), and, where the library installs, to the library itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quant.formats import nvfp4, third_party_decode
from quant.third_party import CT, MODELOPT, Scheme

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def bits(x: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns of a bf16 tensor."""
    return x.view(torch.int16).numpy().view(np.uint16)


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
          torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.int8: "I8"}


def decode(scheme: Scheme, weight: torch.Tensor, others: dict[str, torch.Tensor], out: int, cols: int,
           cut: int | None = None) -> np.ndarray:
    """Our decode of a module stored as ``weight`` + ``others``, in two chunks of rows (split at ``cut``)."""
    params = third_party_decode.load_params(
        scheme, {k: (DTYPES[v.dtype], tuple(v.shape), raw(v)) for k, v in others.items()}, out, cols)
    assert third_party_decode.param_problem(scheme, params) is None
    codes = weight.contiguous().view(torch.uint8).numpy().reshape(out, -1)
    cut = out // 3 if cut is None else cut
    return np.concatenate([third_party_decode.decode_rows(scheme, codes[:cut], 0, cols, params),
                           third_party_decode.decode_rows(scheme, codes[cut:], cut, cols, params)])


# --- references, from the definitions -------------------------------------------------------------

def ref_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """NVFP4: byte k of a row holds values 2k (low nibble) and 2k + 1; a nibble is sign (bit 3) and
    an E2M1 magnitude; each 16 values share an e4m3 scale.
    compressed-tensors 0.20.1 (``NVFP4PackedCompressor.decompress`` -> ``unpack_fp4_from_uint8`` ->
    ``forward_helpers._dequantize``): ``value * (scale / global_scale)``, the quotient fp32, the product
    fp32, cast to bf16; a negative zero code is ``0 * -1 = -0.0``.
    ModelOpt 0.47.0 (``NVFP4QTensor.dequantize``): ``value * (scale.float() * weight_scale_2)`` in fp32,
    cast to bf16; its table's code 8 is +0.0."""
    rows = packed.shape[0]
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float32)[nibbles & 7]
    negative = (nibbles & 8) != 0
    if fmt == CT:
        values = magnitude * torch.where(negative, -1.0, 1.0)
        scale = block_scales.to(torch.float32) / tensor_scale.to(torch.float32)
    else:
        values = torch.where(negative & (magnitude != 0), -magnitude, magnitude)
        scale = block_scales.to(torch.float32) * tensor_scale.to(torch.float32)
    return (values.reshape(rows, -1, 16) * scale.unsqueeze(-1)).reshape(rows, -1).to(torch.bfloat16)


def ref_unpack_int32(words: torch.Tensor, bits_: int, cols: int) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32``: value j of a row is bits ``[j * b, (j + 1) * b)`` of the row's
    int32 words read as one little-endian bit string, offset by ``2^(b - 1)``."""
    per_word = 32 // bits_
    j = torch.arange(cols)
    word = words.to(torch.int64)[:, j // per_word] & 0xFFFFFFFF
    return ((word >> ((j % per_word) * bits_)) & ((1 << bits_) - 1)) - (1 << (bits_ - 1))


def ref_scaled(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, compute: torch.dtype
               ) -> torch.Tensor:
    """compressed-tensors ``forward_helpers._dequantize``: ``(q - zero_point) * scale``, every operand in
    the scale's dtype (``compute``), then (the decode's output) bf16. ``scale``/``zero`` broadcast already."""
    x = values.to(compute)
    if zero is not None:
        x = x - zero.to(compute)
    return (x * scale.to(compute)).to(torch.bfloat16)


def expand(per_group: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A scale per ``block`` (rows x columns) spread to every value."""
    return per_group.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


# --- NVFP4 ----------------------------------------------------------------------------------------

VALID_E4M3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # every non-NaN scale


@pytest.mark.parametrize("fmt, tensor_scale", [(CT, 2688.0), (CT, 1234.567), (CT, 3.0e-5),
                                               (MODELOPT, 1 / 2688.0), (MODELOPT, 3.1e-4), (MODELOPT, 7.5e6)])
def test_nvfp4_every_scale_and_byte_equals_the_definition(fmt, tensor_scale):
    """Every (e4m3 block scale, packed byte) pair (254 x 256), each tensor scale: subnormal, normal and
    overflowing products included (an Inf is refused by the executor, but the bits still agree)."""
    rows, cols = len(VALID_E4M3), 512
    packed = torch.arange(cols // 2, dtype=torch.uint8).repeat(rows, 1)
    pick = (torch.arange(rows)[:, None] + torch.arange(cols // 16)[None, :]) % rows
    block_scales = VALID_E4M3[pick].view(torch.float8_e4m3fn)
    global_name = "weight_global_scale" if fmt == CT else "weight_scale_2"
    scale = torch.tensor([tensor_scale], dtype=torch.float32)
    scheme = Scheme(fmt, "nvfp4", "nvfp4-pack-quantized" if fmt == CT else "NVFP4", 4, "tensor_group", 16)
    got = decode(scheme, packed, {"weight_scale": block_scales, global_name: scale}, rows, cols, cut=101)
    assert np.array_equal(got, bits(ref_nvfp4(packed, block_scales, scale, fmt)))


def test_nvfp4_signed_zero_follows_each_producer():
    """Code 8 decodes as -0.0 (compressed-tensors multiplies 0 by -1) and +0.0 (ModelOpt's table)."""
    packed = torch.full((1, 8), 0x88, dtype=torch.uint8)
    block = torch.ones(1, 1).to(torch.float8_e4m3fn)
    for fmt, name, want in ((CT, "weight_global_scale", 0x8000), (MODELOPT, "weight_scale_2", 0x0000)):
        scheme = Scheme(fmt, "nvfp4", "x", 4, "tensor_group", 16)
        got = decode(scheme, packed, {"weight_scale": block, name: torch.ones(1)}, 1, 16, cut=0)
        assert set(got.reshape(-1).tolist()) == {want}


# --- INT4 / INT8 pack-quantized, FP8 --------------------------------------------------------------

@pytest.mark.parametrize("nbits", [4, 8])
@pytest.mark.parametrize("strategy, group", [("group", 32), ("group", 128), ("channel", None)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_quantized_equals_the_definition(nbits, strategy, group, symmetric, scale_dtype):
    g = torch.Generator().manual_seed(nbits * 7 + symmetric)
    out, cols = 72, 256
    groups = cols // group if group else 1
    low, high = -(1 << nbits - 1), (1 << nbits - 1)
    q = torch.randint(low, high, (out, cols), generator=g)
    unsigned = (q + high).to(torch.int64)
    per_word = 32 // nbits
    words = sum(unsigned[:, i::per_word] << (i * nbits) for i in range(per_word))  # little-endian bit string
    packed = (words - ((words >> 31) << 32)).to(torch.int32)
    assert torch.equal(ref_unpack_int32(packed, nbits, cols), q)
    scale = (torch.rand(out, groups, generator=g) * 0.02 + 1e-4).to(scale_dtype)
    others = {"weight_scale": scale, "weight_shape": torch.tensor([out, cols])}
    zero = None
    if not symmetric:  # zero points packed down the rows (packed_dim=0)
        zero = torch.randint(low, high, (out, groups), generator=g)
        zu = (zero + high).to(torch.int64)
        zw = sum(zu[i::per_word] << (i * nbits) for i in range(per_word)).to(torch.int64)
        others["weight_zero_point"] = (zw - ((zw >> 31) << 32)).to(torch.int32)
    scheme = Scheme(CT, f"int{nbits}", "pack-quantized", nbits, strategy, group, symmetric=symmetric)
    got = decode(scheme, packed, others, out, cols)
    block = (1, group or cols)
    want = ref_scaled(q, expand(scale, out, cols, block), None if zero is None else expand(zero, out, cols, block),
                      scale_dtype)
    assert np.array_equal(got, bits(want))


def random_e4m3(out: int, cols: int, seed: int) -> torch.Tensor:
    codes = torch.randint(0, 256, (out, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN is refused before decoding
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("strategy, shape, block", [("tensor", (1,), None), ("channel", (200, 1), None),
                                                    ("block", (2, 3), (128, 128))])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_ct_fp8_equals_the_definition(strategy, shape, block, scale_dtype):
    out, cols = 200, 320  # partial blocks at both edges
    weight = random_e4m3(out, cols, 3)
    scale = (torch.rand(shape, generator=torch.Generator().manual_seed(4)) * 0.01 + 1e-5).to(scale_dtype)
    label = {"tensor": "fp8", "channel": "fp8-channel", "block": "fp8-block"}[strategy]
    scheme = Scheme(CT, label, "float-quantized", 8, strategy, block=block)
    got = decode(scheme, weight, {"weight_scale": scale}, out, cols)
    full = expand(scale.reshape(shape[0], -1), out, cols, block or (out if strategy == "tensor" else 1, cols))
    assert np.array_equal(got, bits(ref_scaled(weight.to(torch.float32), full, None, scale_dtype)))


@pytest.mark.parametrize("strategy, shape, block", [("tensor", (), None), ("channel", (200,), None),
                                                    ("block", (2, 3), (128, 128))])
def test_modelopt_fp8_equals_the_definition(strategy, shape, block):
    """ModelOpt 0.47.0 ``FP8QTensor.dequantize(dtype=bf16)``: ``q.to(bf16) * scale.to(bf16)``."""
    out, cols = 200, 320
    weight = random_e4m3(out, cols, 5)
    scale = torch.rand(shape, generator=torch.Generator().manual_seed(6)) * 0.01 + 1e-5
    scheme = Scheme(MODELOPT, "fp8", "FP8", 8, strategy, block=block)
    got = decode(scheme, weight, {"weight_scale": scale}, out, cols)
    full = expand(scale.reshape(1 if strategy == "tensor" else shape[0], -1), out, cols,
                  block or (out if strategy == "tensor" else 1, cols))
    assert np.array_equal(got, bits(weight.to(torch.bfloat16) * full.to(torch.bfloat16)))


def test_bad_scales_are_named_before_decoding():
    scheme = Scheme(CT, "nvfp4", "nvfp4-pack-quantized", 4, "tensor_group", 16)
    for name, value, what in (("weight_global_scale", 0.0, "zero or negative"),
                              ("weight_global_scale", float("inf"), "NaN/Inf")):
        params = third_party_decode.load_params(scheme, {
            "weight_scale": ("F8_E4M3", (1, 1), bytes([0x38])),
            name: ("F32", (1,), np.float32(value).tobytes())}, 1, 16)
        assert what in third_party_decode.param_problem(scheme, params)
    params = third_party_decode.load_params(scheme, {"weight_scale": ("F8_E4M3", (1, 2), bytes([0x38, 0x7F])),
                                                     "weight_global_scale": ("F32", (1,), np.float32(1).tobytes())},
                                            1, 32)
    assert third_party_decode.param_problem(scheme, params).startswith("weight_scale holds NaN/Inf values (1 of 2")


def test_weight_shape_disagreeing_is_refused():
    scheme = Scheme(CT, "int4", "pack-quantized", 4, "channel")
    with pytest.raises(ValueError, match=r"weight_shape holds \[8, 60\]"):
        third_party_decode.load_params(scheme, {"weight_shape": ("I64", (2,), np.array([8, 60]).tobytes())}, 8, 64)


# --- the producers' own code, where it installs -------------------------------------------------

def test_equals_compressed_tensors_own_decompression():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.naive_quantized.base import (
        NaiveQuantizationCompressor,
    )
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    g = torch.Generator().manual_seed(0)
    out, cols = 96, 256
    cases = []  # (ours, the library's compressor, its scheme args, the stored tensors)
    cases.append((Scheme(CT, "nvfp4", "nvfp4-pack-quantized", 4, "tensor_group", 16), NVFP4PackedCompressor,
                  {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                  {"weight_packed": torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8, generator=g),
                   "weight_scale": VALID_E4M3[torch.randint(0, 127, (out, cols // 16), generator=g)].view(
                       torch.float8_e4m3fn),
                   "weight_global_scale": torch.tensor([1234.567])}))
    cases.append((Scheme(CT, "mxfp4", "mxfp4-pack-quantized", 4, "group", 32), MXFP4PackedCompressor,
                  {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
                  {"weight_packed": torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8, generator=g),
                   "weight_scale": torch.randint(100, 140, (out, cols // 32), dtype=torch.uint8, generator=g)}))
    for nbits in (4, 8):
        low, high = -(1 << nbits - 1), (1 << nbits - 1)
        for strategy, group, symmetric, dtype in (("group", 32, True, torch.bfloat16),
                                                  ("group", 128, False, torch.float16),
                                                  ("channel", None, False, torch.float32),
                                                  ("channel", None, True, torch.bfloat16)):
            groups = cols // group if group else 1
            stored = {"weight_packed": pack_to_int32(torch.randint(low, high, (out, cols), dtype=torch.int8,
                                                                   generator=g), nbits),
                      "weight_scale": (torch.rand(out, groups, generator=g) * 0.01 + 1e-4).to(dtype),
                      "weight_shape": torch.tensor([out, cols])}
            if not symmetric:
                stored["weight_zero_point"] = pack_to_int32(
                    torch.randint(low, high, (out, groups), dtype=torch.int8, generator=g), nbits, packed_dim=0)
            cases.append((Scheme(CT, f"int{nbits}", "pack-quantized", nbits, strategy, group, symmetric=symmetric),
                          PackedQuantizationCompressor,
                          {"num_bits": nbits, "type": "int", "strategy": strategy, "group_size": group,
                           "symmetric": symmetric},
                          stored))
    for strategy, shape, block in (("tensor", (1,), None), ("channel", (out, 1), None), ("block", (1, 2), [128, 128])):
        for dtype in (torch.bfloat16, torch.float32):
            cases.append((Scheme(CT, "fp8", "float-quantized", 8, strategy, block=tuple(block) if block else None),
                          NaiveQuantizationCompressor,
                          {"num_bits": 8, "type": "float", "strategy": strategy, "block_structure": block},
                          {"weight": random_e4m3(out, cols, 9),
                           "weight_scale": (torch.rand(shape, generator=g) * 0.01 + 1e-4).to(dtype)}))
    for scheme, compressor, args, stored in cases:
        library = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
        want = compressor.decompress(dict(stored), library)["weight"].to(torch.bfloat16)
        weight_key = scheme.weight
        others = {k: v for k, v in stored.items() if k != weight_key}
        assert np.array_equal(decode(scheme, stored[weight_key], others, out, cols), bits(want)), (scheme, args)


def test_equals_modelopt_own_dequantize():
    pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    g = torch.Generator().manual_seed(1)
    out, cols = 64, 256
    packed = torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8, generator=g)
    scale = VALID_E4M3[torch.randint(0, 254, (out, cols // 16), generator=g)].view(torch.float8_e4m3fn)
    scale_2 = torch.tensor(3.1e-4)
    want = NVFP4QTensor(torch.Size([out, cols]), torch.bfloat16, packed).dequantize(
        dtype=torch.bfloat16, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    scheme = Scheme(MODELOPT, "nvfp4", "NVFP4", 4, "tensor_group", 16)
    assert np.array_equal(decode(scheme, packed, {"weight_scale": scale, "weight_scale_2": scale_2}, out, cols),
                          bits(want))
    weight = random_e4m3(out, cols, 2)
    for strategy, shape, blocks in (("tensor", (), None), ("channel", (out,), None),
                                    ("block", (1, 2), {0: 128, 1: 128})):
        scales = torch.rand(shape, generator=g) * 0.01 + 1e-4
        library = FP8QTensor(torch.Size([out, cols]), torch.bfloat16, weight)
        given = scales.reshape(out, 1) if strategy == "channel" else scales
        want = library.dequantize(dtype=torch.bfloat16, scale=given, **({"block_sizes": blocks} if blocks else {}))
        scheme = Scheme(MODELOPT, "fp8", "FP8", 8, strategy, block=(128, 128) if blocks else None)
        assert np.array_equal(decode(scheme, weight, {"weight_scale": scales}, out, cols), bits(want)), strategy


def test_nvfp4_kernel_refuses_partial_blocks():
    with pytest.raises(ValueError, match="not whole 16-value blocks"):
        nvfp4.decode_bf16(np.zeros((2, 12), np.uint8), np.ones((2, 1), np.uint8), nvfp4.decode_table(1.0, nvfp4.DIVIDE))



def test_typed_gives_the_values_of_stored_bytes():
    """``typed`` (what ``gate checkpoint --deep`` reads scales with): floats as float32, bytes and integers as
    stored."""
    for tensor in (torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
                   torch.tensor([0.875, 448.0]).to(torch.float8_e4m3fn),
                   torch.tensor([3.0e-5, 7.0], dtype=torch.float16), torch.tensor([1e-30, 2.5])):
        got = third_party_decode.typed(raw(tensor), DTYPES[tensor.dtype], (2,))
        assert got.dtype == np.float32 and np.array_equal(got, tensor.float().numpy())
    assert third_party_decode.typed(bytes([0xFF, 3]), "U8", (2,)).tolist() == [255, 3]
    assert third_party_decode.typed(np.array([5, -6], "<i8").tobytes(), "I64", (2,)).tolist() == [5, -6]
