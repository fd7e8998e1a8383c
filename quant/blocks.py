"""A release's own MXFP4 layout for fused experts (``fused_experts.writes: blocks``): gpt-oss's.

gpt-oss ships its routed experts as ``<fused>_blocks`` uint8 ``[E, out, in/32, 16]`` (two E2M1 codes
a byte, the first value in the low nibble) and ``<fused>_scales`` uint8 ``[E, out, in/32]`` (E8M0),
with ``quantization_config: {quant_method: mxfp4, ...}``; the biases stay bf16 beside them. That is
what both engines' gpt-oss loaders read (sglang models/gpt_oss.py:
GptOssForCausalLM._load_mxfp4_experts_weights; vLLM models/gpt_oss.py: hf_to_vllm_mapper maps the
suffixes to w13_weight / w13_weight_scale / w2_*), and what transformers' integrations/mxfp4.py
``convert_moe_packed_tensors`` dequantizes back to ``[E, in, out]``.

Each expert's matrix is its fused slice as ``[out, in]`` (``gate_up_proj[e].T``: the out axis in the
tensor's own order, gate and up interleaved), and its rows are exactly Quark's MXFP4 of that matrix
(blocks of 32 along the input dimension): the per-expert codec's bytes, written expert after expert.
Nothing here reads tensor data; the executor (``quant.shard``) encodes and decodes.
"""

from __future__ import annotations

from quant.formats.constants import BLOCK
from quant.fused import Piece
from quant.layout import FusedTensor
from quant.safetensors_io import DTYPE_BYTES, TensorInfo

BLOCKS, SCALES = "_blocks", "_scales"
BYTES_PER_BLOCK = BLOCK // 2  # 16: two E2M1 codes a byte


def expert_matrices(info: TensorInfo, spec: FusedTensor, out: int, inner: int) -> tuple[Piece, ...]:
    """One piece per expert: its whole ``[out * projections, in]`` matrix in the tensor's own row order
    (what the blocks hold), named by the fused tensor (the engines' FusedMoE loads it whole)."""
    item = DTYPE_BYTES[info.dtype]
    total = out * len(spec.projections)
    experts = info.shape[spec.axes.index("experts")]
    found = []
    for e in range(experts):
        if spec.axes == ("experts", "out", "in"):  # element (e, o, i) at ((e * total + o) * inner + i)
            offset, row_stride, col_stride = e * total * inner, inner, 1
        else:  # ("experts", "in", "out"): element (e, i, o) at ((e * inner + i) * total + o)
            offset, row_stride, col_stride = e * inner * total, 1, total
        found.append(Piece(info.name, e, "+".join(spec.projections), info.begin + offset * item, total, inner,
                           row_stride * item, col_stride * item, item))
    return tuple(found)


def outputs(name: str, experts: int, rows: int, cols: int) -> tuple[tuple, tuple]:
    """The blocks and scales tensors written for a fused tensor of ``experts`` ``[rows, cols]`` matrices."""
    return ((name + BLOCKS, "U8", (experts, rows, cols // BLOCK, BYTES_PER_BLOCK)),
            (name + SCALES, "U8", (experts, rows, cols // BLOCK)))


def fused_name(stored: str) -> str | None:
    """The fused tensor a ``*_blocks`` tensor stores (None for any other name)."""
    return stored[:-len(BLOCKS)] if stored.endswith(BLOCKS) else None


def layout_problem(blocks: TensorInfo, scales: TensorInfo | None, expected: tuple[int, int, int]) -> str | None:
    """Why a stored ``*_blocks`` tensor (and its ``*_scales``) is not the layout the engines read for
    ``expected`` (experts, out, in) from config.json (None: it is)."""
    experts, rows, cols = expected
    want = outputs("", experts, rows, cols)
    if (blocks.dtype, tuple(blocks.shape)) != want[0][1:]:
        return f"{blocks.dtype}{list(blocks.shape)}, not the U8{list(want[0][2])} config.json gives (E, out, in/32, 16)"
    if scales is None:
        return f"no {blocks.name.removesuffix(BLOCKS) + SCALES} beside it: the engines would load it without scales"
    if (scales.dtype, tuple(scales.shape)) != want[1][1:]:
        return f"its scales are {scales.dtype}{list(scales.shape)}, not U8{list(want[1][2])}"
    return None


def is_native(config: dict, family) -> bool:
    """Whether ``config.json`` declares the family's own blocks layout (its ``blocks_config``'s quant_method)."""
    fused = family.fused_experts if family else None
    qconfig = config.get("quantization_config")
    return bool(fused) and fused.writes == "blocks" and isinstance(qconfig, dict) and \
        qconfig.get("quant_method") == fused.blocks_config.get("quant_method")


def native_config(blocks_config: dict) -> dict:
    """config.json's quantization_config for the blocks layout: the release's own (a copy)."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in blocks_config.items()}
