"""``--to bf16`` of compressed-tensors and ModelOpt checkpoints: every decoded element equal to a
reference written here from each format's definition (the producer library's own dequantization,
cited per reference), and, where the library installs, to the library itself."""

from __future__ import annotations

import json
import subprocess
import sys

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
    for symmetric, dtype in ((True, torch.bfloat16), (False, torch.float32)):  # int-quantized: int8 as it is
        stored = {"weight": torch.randint(-128, 128, (out, cols), dtype=torch.int8, generator=g),
                  "weight_scale": (torch.rand(out, 1, generator=g) * 0.01 + 1e-4).to(dtype)}
        if not symmetric:
            stored["weight_zero_point"] = torch.randint(-128, 128, (out, 1), dtype=torch.int8, generator=g)
        cases.append((Scheme(CT, "int8", "int-quantized", 8, "channel", symmetric=symmetric),
                      NaiveQuantizationCompressor,
                      {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": symmetric}, stored))
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


def test_stored_and_as_float_give_the_values_of_stored_bytes():
    """``stored`` (no copy) and ``as_float`` (what ``gate checkpoint --deep`` reads scales with too)."""
    for tensor in (torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
                   torch.tensor([0.875, 448.0]).to(torch.float8_e4m3fn),
                   torch.tensor([3.0e-5, 7.0], dtype=torch.float16), torch.tensor([1e-30, 2.5])):
        dtype = DTYPES[tensor.dtype]
        got = third_party_decode.as_float(dtype, third_party_decode.stored(raw(tensor), dtype, (2,)))
        assert got.dtype == np.float32 and np.array_equal(got, tensor.float().numpy())
    assert third_party_decode.stored(bytes([0xFF, 3]), "U8", (2,)).tolist() == [255, 3]
    assert third_party_decode.stored(np.array([5, -6], "<i8").tobytes(), "I64", (2,)).tolist() == [5, -6]


# --- quantize --to bf16 of whole checkpoints, in a real process ---------------------------------

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False}
CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_WEIGHTS,
                                          "input_activations": {**NVFP4_WEIGHTS, "dynamic": "local"}}},
            "ignore": ["lm_head", "re:.*self_attn.*"]}
CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}},
           "ignore": ["lm_head", "re:.*self_attn.*"]}
MODELOPT_NVFP4 = {"producer": {"name": "modelopt", "version": "0.29.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head", "*self_attn*"]}}
EXPERT = "model.layers.0.mlp.experts.0.gate_proj"
KEPT = ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight")


def write_third_party(folder, qconfig: dict | None, module: dict[str, torch.Tensor], hf_quant: dict | None = None):
    """A tiny checkpoint: one quantized expert projection (``module``: suffix -> tensor) beside bf16 ones."""
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(32, 64, generator=g).to(torch.bfloat16) for name in KEPT}
    tensors.update({f"{EXPERT}.{suffix}": t for suffix, t in module.items()})
    save_file({**tensors, "model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(folder / "model.safetensors"))
    config = {"model_type": "tiny_third_party", "architectures": ["TinyForCausalLM"]}
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return tensors


def run_decode(src, dst) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "--to", "bf16", "-q", str(src), str(dst)],
                          capture_output=True, text=True, timeout=300, check=False)


def nvfp4_module(out: int, cols: int, fmt: str, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stored = {"weight_packed" if fmt == CT else "weight":
              torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8, generator=g),
              "weight_scale": VALID_E4M3[torch.randint(0, 126, (out, cols // 16), generator=g)].view(
                  torch.float8_e4m3fn)}
    if fmt == CT:
        stored.update(weight_global_scale=torch.tensor([2688.0 / 3.5]), input_global_scale=torch.tensor([99.0]))
    else:
        stored.update(weight_scale_2=torch.tensor(3.5 / 2688.0), input_scale=torch.tensor(0.01))
    return stored


def assert_decoded(dst, src_tensors: dict, want: torch.Tensor) -> None:
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == {*KEPT, f"{EXPERT}.weight"}  # scales consumed, activation and KV cache scales dropped
        assert np.array_equal(bits(f.get_tensor(f"{EXPERT}.weight")), bits(want))
        for name in KEPT:
            assert torch.equal(f.get_tensor(name), src_tensors[name])
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config and not (dst / "hf_quant_config.json").exists()


@pytest.mark.parametrize("layout", ["ct", "modelopt-config", "modelopt-hf-quant-config-only"])
def test_quantize_to_bf16_decodes_nvfp4_checkpoints(tmp_path, layout):
    """compressed-tensors NVFP4, ModelOpt NVFP4 with its config in config.json, and a ModelOpt export whose
    config sits only in hf_quant_config.json: the expert decoded exactly, the rest copied, no
    quantization config left in the output (config.json nor hf_quant_config.json)."""
    out, cols = 24, 64
    fmt = CT if layout == "ct" else MODELOPT
    module = nvfp4_module(out, cols, fmt)
    qconfig = {"ct": CT_NVFP4, "modelopt-config": {"quant_method": "modelopt", **MODELOPT_NVFP4}}.get(layout)
    hf_quant = MODELOPT_NVFP4 if layout == "modelopt-hf-quant-config-only" else None
    src_tensors = write_third_party(tmp_path / "src", qconfig, module, hf_quant)
    done = run_decode(tmp_path / "src", tmp_path / "deq")
    assert done.returncode == 0, done.stderr
    tensor_scale = module["weight_global_scale" if fmt == CT else "weight_scale_2"]
    weight = module["weight_packed" if fmt == CT else "weight"]
    assert_decoded(tmp_path / "deq", src_tensors, ref_nvfp4(weight, module["weight_scale"], tensor_scale, fmt))


def test_quantize_to_bf16_decodes_int4_pack_quantized_with_zero_points(tmp_path):
    out, cols = 24, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 8, (out, cols), generator=g)
    zero = torch.randint(-8, 8, (out, cols // 32), generator=g)
    words = sum(((q + 8).to(torch.int64))[:, i::8] << (4 * i) for i in range(8))
    zwords = sum(((zero + 8).to(torch.int64))[i::8] << (4 * i) for i in range(8))
    scale = (torch.rand(out, cols // 32, generator=g) * 0.01).to(torch.bfloat16)
    module = {"weight_packed": (words - ((words >> 31) << 32)).to(torch.int32), "weight_scale": scale,
              "weight_shape": torch.tensor([out, cols]),
              "weight_zero_point": (zwords - ((zwords >> 31) << 32)).to(torch.int32)}
    src_tensors = write_third_party(tmp_path / "src", CT_INT4, module)
    done = run_decode(tmp_path / "src", tmp_path / "deq")
    assert done.returncode == 0, done.stderr
    want = ref_scaled(q, expand(scale, out, cols, (1, 32)), expand(zero, out, cols, (1, 32)), torch.bfloat16)
    assert_decoded(tmp_path / "deq", src_tensors, want)


@pytest.mark.parametrize("bad, message", [
    ({"weight_global_scale": torch.tensor([0.0])}, "weight_global_scale holds zero or negative values"),
    ({"weight_global_scale": torch.tensor([float("nan")])}, "weight_global_scale holds NaN/Inf values"),
    ({"weight_scale": torch.full((24, 4), float("nan")).to(torch.float8_e4m3fn)}, "weight_scale holds NaN/Inf"),
])
def test_bad_scales_refuse_the_decode_and_write_nothing(tmp_path, bad, message):
    module = {**nvfp4_module(24, 64, CT), **bad}
    write_third_party(tmp_path / "src", CT_NVFP4, module)
    done = run_decode(tmp_path / "src", tmp_path / "deq")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and f"{EXPERT}." in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "deq" / "model.safetensors").exists()


def test_a_missing_scale_refuses_the_plan_naming_it(tmp_path):
    module = nvfp4_module(24, 64, CT)
    del module["weight_global_scale"]
    write_third_party(tmp_path / "src", CT_NVFP4, module)
    done = run_decode(tmp_path / "src", tmp_path / "deq")
    assert done.returncode == 2 and f"{EXPERT}.weight_global_scale: missing" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "deq" / "model.safetensors").exists()


def test_a_compressed_tensors_nvfp4_checkpoint_written_by_the_library_decodes_to_its_own_decompression(tmp_path):
    """The tiny GLM-5 checkpoint with every routed expert compressed by compressed-tensors' own
    ``NVFP4PackedCompressor.compress`` (scales observed here as its observers do: a global scale of
    448 * 6 / amax, block scales amax / 6 * global), shards and index kept: ``quantize --to bf16`` gives
    each expert exactly ``decompress``'s bf16 weight and every other tensor byte for byte."""
    pytest.importorskip("compressed_tensors")
    import re

    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    from quant.example import tiny_config, write_checkpoint

    src = write_checkpoint(tmp_path / "bf16", tiny_config())
    expert = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    library = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**NVFP4_WEIGHTS))
    ct = tmp_path / "ct"
    ct.mkdir()
    want, kept = {}, {}
    for shard in sorted(src.glob("*.safetensors")):
        stored = {}
        for name, tensor in load_file(str(shard)).items():
            if not expert.match(name):
                stored[name] = kept[name] = tensor
                continue
            w = tensor.float()
            global_scale = (448.0 * 6.0 / w.abs().amax()).reshape(1)
            block_scale = (w.reshape(w.shape[0], -1, 16).abs().amax(-1) / 6.0 * global_scale).to(torch.float8_e4m3fn)
            module = NVFP4PackedCompressor.compress(
                {"weight": tensor, "weight_scale": block_scale.float(), "weight_global_scale": global_scale}, library)
            prefix = name.removesuffix(".weight")
            stored.update({f"{prefix}.{k}": v.contiguous() for k, v in module.items()})
            want[name] = NVFP4PackedCompressor.decompress(dict(module), library)["weight"].to(torch.bfloat16)
        save_file(stored, str(ct / shard.name))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: path.name for path in sorted(ct.glob("*.safetensors"))
                           for name in load_file(str(path))}
    (ct / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**CT_NVFP4, "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], "weights": NVFP4_WEIGHTS}}}
    (ct / "config.json").write_text(json.dumps(config))
    for aux in src.iterdir():  # tokenizer and generation config
        if not aux.name.endswith(".safetensors") and aux.name not in ("config.json", "model.safetensors.index.json"):
            (ct / aux.name).write_bytes(aux.read_bytes())
    done = run_decode(ct, tmp_path / "deq")
    assert done.returncode == 0, done.stderr
    assert want and kept
    found = {}
    for shard in (tmp_path / "deq").glob("*.safetensors"):
        found.update(load_file(str(shard)))
    assert set(found) == set(want) | set(kept)
    for name, tensor in want.items():
        assert np.array_equal(bits(found[name]), bits(tensor)), name
    for name, tensor in kept.items():
        assert torch.equal(found[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())


def test_quantize_to_bf16_decodes_a_modelopt_fp8_checkpoint(tmp_path):
    """ModelOpt FP8 (one fp32 scale per tensor, stored as a scalar): ``q.to(bf16) * scale.to(bf16)``."""
    weight, scale = random_e4m3(24, 64, 13), torch.tensor(0.0123)
    module = {"weight": weight, "weight_scale": scale, "input_scale": torch.tensor(0.02)}
    qconfig = {"quant_method": "modelopt", "producer": {"name": "modelopt"},
               "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head", "*self_attn*"]}}
    src_tensors = write_third_party(tmp_path / "src", qconfig, module)
    done = run_decode(tmp_path / "src", tmp_path / "deq")
    assert done.returncode == 0, done.stderr
    assert_decoded(tmp_path / "deq", src_tensors, weight.to(torch.bfloat16) * scale.to(torch.bfloat16))
