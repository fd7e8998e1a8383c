"""quant.strided.copy2d: the tiled copy a fused expert's gather and write-back use, against numpy's
own copy, on shapes with and without whole 64 x 64 tiles, both ways (out of and into a strided view)."""

from __future__ import annotations

import numpy as np
import pytest

from quant.strided import copy2d


@pytest.mark.parametrize("shape", [(128, 192), (130, 70), (64, 65), (3, 200), (200, 3), (1, 1)])
def test_copy2d_is_numpys_copy(shape):
    rng = np.random.default_rng(0)
    stored = rng.integers(0, 1 << 16, size=(shape[1], 2 * shape[0]), dtype=np.uint16)  # [in, 2 * out], gate/up alternating
    gate = stored[:, ::2].T  # an [out, in] projection as an interleaved [E, H, 2I] expert holds it
    out = np.empty(shape, np.uint16)
    copy2d(gate, out, threads=1)
    assert np.array_equal(out, gate)
    back = np.zeros_like(stored)
    copy2d(out, back[:, ::2].T)
    assert np.array_equal(back[:, ::2], stored[:, ::2]) and not back[:, 1::2].any()


def test_copy2d_refuses_a_shape_or_dtype_mismatch():
    with pytest.raises(ValueError, match="copy2d"):
        copy2d(np.zeros((2, 3), np.uint16), np.zeros((3, 2), np.uint16))
    with pytest.raises(ValueError, match="copy2d"):
        copy2d(np.zeros((2, 3), np.uint16), np.zeros((2, 3), np.uint32))
