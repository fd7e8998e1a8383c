"""compressed-tensors ``pack-quantized``: signed INT4 / INT8 weights packed into int32 words.

compressed-tensors 0.20.1 ``pack_quantized/helpers.py: pack_to_int32`` adds ``2^(bits - 1)`` to each
value (the symmetric offset) and packs 32 / bits consecutive values of a row into one int32, value
``j`` of a word at bits ``j * bits`` (little-endian words, so for INT4 byte ``k`` of a row holds
values ``2k`` (low nibble) and ``2k + 1``, and for INT8 byte ``k`` is value ``k``); a row's last word
is zero-padded (``weight_shape`` holds the true ``[out, in]``). Asymmetric zero points of the group
and channel strategies are packed the same way down the rows (``packed_dim=0``): word ``w`` of column
``g`` holds the zero points of rows ``w * 32 / bits ...``. ``unpack_from_int32`` reverses both.
Only 4 and 8 bits are decoded (the widths the engines run); the values leave here exact, as int16.
"""

from __future__ import annotations

import numpy as np

BITS = (4, 8)


def packed_columns(columns: int, bits: int) -> int:
    """int32 words a row of ``columns`` values takes."""
    return -(-columns * bits // 32)


def unpack_rows(words: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """Signed values (int16 ``[rows, columns]``) of rows of int32 ``words`` (or their bytes, uint8)."""
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(words.shape[0], -1)
    if bits == 8:
        codes = raw
    else:  # low nibble first: the value with the lower bit position
        codes = np.stack((raw & 0x0F, raw >> 4), axis=-1).reshape(raw.shape[0], -1)
    return codes[:, :columns].astype(np.int16) - (1 << (bits - 1))


def unpack_zero_points(words: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Zero points (int16 ``[rows, groups]``) packed down the rows (``packed_dim=0``): int32 ``[words, groups]``."""
    words = np.ascontiguousarray(words).view(np.int32).reshape(words.shape[0], -1)
    return unpack_rows(np.ascontiguousarray(words.T), bits, rows).T
