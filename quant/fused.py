"""Fused expert tensors as data: where each expert's projection lies inside one 3-D tensor.

A family manifest's ``fused_experts`` (``quant.layout.FusedExperts``) says which tensors hold all
routed experts of a layer, their axis order (Qwen3.5 ``[E, 2I, H]``, Llama-4 / gpt-oss
``[E, H, 2I]``) and how the projections share the out axis (gate then up, or interleaved). From a
header alone this module turns one such tensor into its ``Piece`` s: one 2-D ``[out, in]`` matrix
per expert and projection, given as a byte offset and two strides, which the executor reads in
bounded chunks (``SourceReader.gather``) and the planner sizes, names and classifies like any
per-expert weight. Nothing here reads tensor data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quant.layout import FusedTensor
from quant.safetensors_io import DTYPE_BYTES, TensorInfo


@dataclass(frozen=True)
class Piece:
    """One expert's projection inside a fused tensor: the ``[rows, cols]`` (``[out, in]``) matrix
    whose element ``(r, c)`` is the ``item`` bytes at ``offset + r * row_stride + c * col_stride``
    of the file (the fused tensor's own layout: for ``[E, H, 2I]`` the strides are transposed)."""
    name: str  # the per-expert tensor it is written as (``experts.{e}.{proj}.weight``)
    expert: int
    projection: str
    offset: int
    rows: int
    cols: int
    row_stride: int
    col_stride: int
    item: int

    @property
    def contiguous(self) -> bool:
        """Rows follow each other in the file (``[E, 2I, H]`` halves): read as plain rows."""
        return self.col_stride == self.item and self.row_stride == self.cols * self.item


def pieces(info: TensorInfo, spec: FusedTensor, out: int, inner: int) -> tuple[Piece, ...]:
    """The pieces of a fused tensor whose shape is ``spec.expected_shape(E, out, inner)`` (checked
    by the caller), in file order of their first byte: expert by expert, projection by projection."""
    item = DTYPE_BYTES[info.dtype]
    count = len(spec.projections)
    experts = info.shape[spec.axes.index("experts")]
    total = out * count  # the out axis: every projection
    step = 1 if spec.split == "halves" else count  # rows of one projection along the out axis
    found = []
    for e in range(experts):
        for p, projection in enumerate(spec.projections):
            first = p * out if spec.split == "halves" else p  # its first row on the out axis
            if spec.axes == ("experts", "out", "in"):  # element (e, o, i) at ((e * total + o) * inner + i)
                offset, row_stride, col_stride = (e * total + first) * inner, step * inner, 1
            else:  # ("experts", "in", "out"): element (e, i, o) at ((e * inner + i) * total + o)
                offset, row_stride, col_stride = e * inner * total + first, step, total
            found.append(Piece(spec.per_expert_name(info.name, e, projection), e, projection,
                               info.begin + offset * item, out, inner, row_stride * item, col_stride * item, item))
    return tuple(found)


def name_pattern(spec: FusedTensor) -> re.Pattern[str]:
    """A regex of the per-expert names ``spec`` writes, capturing the fused tensor's parent
    (``experts``), the expert and the projection: for ``--to bf16``, which puts them back."""
    parts = re.split(r"(\{experts\}|\{e\}|\{proj\})", spec.names)
    groups = {"{experts}": r"(?P<experts>.+)", "{e}": r"(?P<e>\d+)",
              "{proj}": "(?P<proj>" + "|".join(map(re.escape, spec.projections)) + ")"}
    return re.compile("^" + "".join(groups.get(part, re.escape(part)) for part in parts) + "$")
