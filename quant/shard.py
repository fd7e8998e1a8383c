"""Converting one shard: read tensors in file order, quantize or copy them, write one atomic file.

The source is read front to back exactly once; the same bytes feed its sha256, so provenance
costs no second read. Memory is bounded by one chunk (``CHUNK_BYTES`` of source) whatever the
tensor or shard size.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from quant.errors import NonFiniteError
from quant.formats import mxfp4, mxfp4_fast, weight_format
from quant.formats.mx import ScaleRule
from quant.hashing import StreamHasher
from quant.plan import ShardPlan, TensorPlan
from quant.safetensors_io import TORCH_DTYPES, ShardError, ShardWriter, numel, open_regular

CHUNK_BYTES = 32 << 20  # source bytes per step
RELEASE_LAG = 4 * CHUNK_BYTES  # mapped source kept resident behind the read position
ERROR_ROW_STRIDE = 64  # the fast path measures error on every 64th row: cheap and representative


@dataclass(frozen=True)
class ShardJob:
    source_dir: Path
    dst: Path
    shard: ShardPlan
    scale_rule: ScaleRule
    device: str = "cpu"
    format: str = "mxfp4"
    strict: bool = False  # NaN/Inf in a tensor kept as it is: an error, not a warning


def file_identity(st: os.stat_result) -> dict:
    """What says a file is the one read before without reading it: any write changes one of these
    (ctime too, which no one can set back, unlike mtime)."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


# Exponent-field masks: a float is NaN or Inf exactly when all its exponent bits are set.
_EXPONENT_MASKS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000)}


def first_non_finite(data, dtype: str) -> int | None:
    """Index of the first NaN/Inf element in raw little-endian float bytes, None if all are finite."""
    if dtype not in _EXPONENT_MASKS:
        return None
    word, mask = _EXPONENT_MASKS[dtype]
    bad = np.flatnonzero((np.frombuffer(data, word) & word(mask)) == mask)
    return int(bad[0]) if bad.size else None


class SourceReader:
    """Reads one source file at increasing offsets and hashes every byte of it on the way.

    The file is memory-mapped, so a read costs no copy; ranges left behind are dropped from the
    mapping (``MADV_DONTNEED``: the pages stay in the page cache, just not in this process), so
    resident memory stays a few chunks whatever the shard size.
    """

    def __init__(self, path: Path, hasher: StreamHasher):
        self.path = path
        self.hasher, self.digest = hasher, hasher.new()
        self.pos = self.released = 0
        with open_regular(path) as f:
            self.opened = os.fstat(f.fileno())  # the identity --resume checks before trusting this shard
            self.opened_ns = time.time_ns()
            self.size = self.opened.st_size
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        if self.map:
            self.map.madvise(mmap.MADV_SEQUENTIAL)

    def read(self, offset: int, nbytes: int) -> memoryview:
        """The bytes at ``offset``, as a view into the mapping."""
        if offset > self.pos:  # header, or padding between tensors
            self.hasher.update(self.digest, self._view(self.pos, offset))
        elif offset < self.pos:
            raise AssertionError("tensors must be read in file order")
        if offset + nbytes > self.size:
            raise ShardError(f"{self.path}: ends at byte {self.size}, before {offset + nbytes} "
                             "(file truncated or changed during conversion)")
        data = self._view(offset, offset + nbytes)
        self.hasher.update(self.digest, data)
        self.pos = offset + nbytes
        self._release_behind(offset - RELEASE_LAG)
        return data

    def _view(self, start: int, end: int) -> memoryview:
        return memoryview(self.map)[start:end] if self.map else memoryview(b"")

    def _release_behind(self, offset: int) -> None:
        end = offset - offset % mmap.PAGESIZE
        if self.map and end > self.released:
            self.map.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end

    def finish(self) -> str:
        if self.pos < self.size:
            self.read(self.pos, self.size - self.pos)
        self.hasher.drain()
        if file_identity(self.path.stat()) != file_identity(self.opened):
            raise ShardError(f"{self.path}: changed while it was being converted; leave the source alone and "
                             "rerun (--resume keeps the finished shards)")
        return self.digest.hexdigest()

    def close(self) -> None:
        if self.map:
            try:
                self.map.close()
            except BufferError:  # a view is still referenced; the mapping goes with it
                pass


def _nonfinite_error(name: str, x: torch.Tensor, row0: int) -> NonFiniteError:
    row, col = (~torch.isfinite(x)).nonzero()[0].tolist()
    return NonFiniteError(f"{name}: NaN/Inf at row {row0 + row}, column {col}; "
                          "fix the source checkpoint (Quark would silently write garbage here)")


def _quantize_chunk(raw: np.ndarray, dtype: str, name: str, row0: int, job: "ShardJob",
                    ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``(weight, scales, err_sq, ref_sq)`` for rows of one weight, given as raw bytes ``[rows, row_bytes]``."""
    rule, fmt = job.scale_rule, weight_format(job.format)
    fast = job.format == "mxfp4" and job.device == "cpu" and rule is ScaleRule.EVEN and dtype == "BF16"
    if fast:
        packed, scales, flags, err, ref = mxfp4_fast.quantize_bf16(raw, ERROR_ROW_STRIDE, row0)
        if not flags.any():
            return packed, scales, float(err.sum()), float(ref.sum())
    x = torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[dtype]).reshape(raw.shape[0], -1)
    if fast and not (flags == mxfp4_fast.ROW_NON_FINITE).any():  # tiny blocks: the reference is exact
        redo = np.flatnonzero(flags == mxfp4_fast.ROW_NEEDS_REFERENCE)
        p, s = mxfp4.quantize(x[torch.from_numpy(redo)], rule)
        packed[redo], scales[redo] = p.numpy(), s.numpy()
        return packed, scales, float(err.sum()), float(ref.sum())
    xd = x.to(job.device)
    if not torch.isfinite(xd).all():
        raise _nonfinite_error(name, xd.cpu(), row0)
    weight, scales = fmt.quantize(xd, rule)  # the reference path: error measured on every row
    xf = xd.to(torch.float32)
    err = float(((fmt.dequantize(weight, scales, torch.float32) - xf) ** 2).sum())
    return weight.cpu().numpy(), scales.cpu().numpy(), err, float((xf * xf).sum())


def _quantize_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                     advance: Callable[[int], None]) -> dict:
    info = tensor.source
    rows, cols = info.shape
    row_bytes = info.nbytes // rows
    multiple = weight_format(job.format).row_multiple  # FP8 scales cover 128-row tiles
    step = max(multiple, CHUNK_BYTES // row_bytes // multiple * multiple)
    (weight_name, _, _), (scale_name, _, _) = tensor.outputs
    err_sq = ref_sq = 0.0
    scale_chunks = []  # written after the weight, keeping the file order (1/64 of the tensor's size)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(reader.read(info.begin + start * row_bytes, count * row_bytes), np.uint8)
        packed, scales, err, ref = _quantize_chunk(raw.reshape(count, row_bytes), info.dtype, info.name, start, job)
        writer.write(weight_name, start * packed.shape[1] * packed.itemsize, packed.data)
        scale_chunks.append(scales)
        err_sq, ref_sq = err_sq + err, ref_sq + ref
        advance(count * row_bytes)
    writer.write(scale_name, 0, np.concatenate(scale_chunks).data)
    return {"shape": list(info.shape), "rel_rms_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0}


def _copy_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                 advance: Callable[[int], None]) -> str | None:
    """Copy a kept tensor unchanged; returns where its first NaN/Inf is (None if it has none)."""
    info = tensor.source
    non_finite = None
    item = numel(info.shape) and info.nbytes // numel(info.shape)
    for done in range(0, info.nbytes, CHUNK_BYTES):
        size = min(CHUNK_BYTES, info.nbytes - done)
        data = reader.read(info.begin + done, size)
        if non_finite is None and (bad := first_non_finite(data, info.dtype)) is not None:
            element = done // item + bad
            cols = info.shape[-1] if len(info.shape) > 1 else 0
            non_finite = f"row {element // cols}, column {element % cols}" if cols else f"element {element}"
            if job.strict:
                raise NonFiniteError(f"{job.source_dir / job.shard.file}: tensor {info.name}: NaN/Inf at "
                                     f"{non_finite} (kept as it is by the recipe; --strict refuses it); fix the "
                                     "source checkpoint, or drop --strict to copy it unchanged")
        writer.write(info.name, done, data)
        advance(size)
    return non_finite


def convert_shard(job: ShardJob, advance: Callable[[int], None] = lambda n: None) -> dict:
    """Write one output shard atomically; returns its record for the conversion manifest."""
    shard = job.shard
    hasher = StreamHasher()
    writer = reader = None
    errors: dict[str, dict] = {}
    kept_non_finite: dict[str, str] = {}
    try:
        writer = ShardWriter(job.dst / shard.file, shard.entries, hasher)
        reader = SourceReader(job.source_dir / shard.file, hasher)
        for tensor in shard.tensors:
            if tensor.quantize:
                errors[tensor.source.name] = _quantize_tensor(reader, tensor, writer, job, advance)
            elif where := _copy_tensor(reader, tensor, writer, job, advance):
                kept_non_finite[tensor.source.name] = where
        source_sha256 = reader.finish()
        output_sha256 = writer.commit()
    except BaseException:
        if writer:
            writer.abort()
        raise
    finally:
        if reader:
            reader.close()
        hasher.close()
    return {"file": shard.file, "source_size": shard.source_size, "source_sha256": source_sha256,
            "size": writer.size, "sha256": output_sha256, "quantized": errors, "kept_non_finite": kept_non_finite,
            "source_identity": {**file_identity(reader.opened), "opened_ns": reader.opened_ns}}
