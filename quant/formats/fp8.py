"""Block FP8 (DeepSeek-V3 style), the reference format: e4m3 weights, one float32 scale per
128x128 tile (docs/reference.md §1). ``w ~= q * scale_inv``; ``scale_inv = amax_tile / 448`` (1.0 for an
all-zero tile, and for a tile whose ``amax / 448`` underflows float32 to 0, an fp32 tile of subnormals
below 2^-140: its values are below e4m3's smallest step, so the codes are zeros, never ``x / 0``);
``q = clamp(w / scale_inv, -448, 448)`` cast to e4m3 with round-to-nearest-even.
"""

from __future__ import annotations

import torch

from quant.formats.constants import E4M3_MAX, FP8_TILE as TILE


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE), -(-cols // TILE)


def _expand(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(TILE, 0)[:rows].repeat_interleave(TILE, 1)[:, :cols]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [rows, cols], scale_inv float32 [ceil(rows/128), ceil(cols/128)])``."""
    rows, cols = weight.shape
    tr, tc = _tiles(rows, cols)
    x = weight.to(torch.float32)
    padded = torch.zeros(tr * TILE, tc * TILE, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = x.abs()
    amax = padded.reshape(tr, TILE, tc, TILE).amax(dim=(1, 3))
    scale_inv = amax / E4M3_MAX
    scale_inv = torch.where(scale_inv == 0, torch.ones_like(scale_inv), scale_inv)  # a zero or underflowing tile
    q = (x / _expand(scale_inv, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    rows, cols = q.shape
    return (q.to(torch.float32) * _expand(scale_inv.to(torch.float32), rows, cols)).to(dtype)


def quantize_dequantize(x: torch.Tensor, group: int = TILE, eps: float = 1e-10) -> torch.Tensor:
    """What a dynamic block-FP8 activation becomes: per token, each group of ``group`` values along the
    last dim gets ``scale = max(amax, eps) * (1 / 448)`` in float32 and ``clamp(x / scale, +-448)`` cast to
    e4m3, then multiplied back, returned in ``x``'s dtype. This is vLLM 0.33.0's
    ``per_token_group_quant_fp8`` (``model_executor/layers/quantization/utils/fp8_utils.py``, the Triton
    ``_per_token_group_quant_fp8``, without ``use_ue8m0``). A last group shorter than ``group`` is
    quantized on its own (as if zero-padded: padding changes no amax).
    """
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, -cols % group))
    groups = padded.reshape(*x.shape[:-1], -1, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=eps) * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    q = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).reshape(*x.shape[:-1], -1)[..., :cols].to(x.dtype)
