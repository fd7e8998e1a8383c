"""Converting one shard: read tensors in file order, carry out each one's planned action (encode,
decode or copy), write one atomic file.

Four threads overlap, each on one stream, so a shard keeps two cores busy (``convert`` gives a
worker process two cores): the source's sha256 (``SourceHasher``, from the moment the file
opens, on its own mapping), the kernel (this thread; numba's threads inside, ``kernel_threads``
of them), and the output's sha256 and its writing (``ShardWriter``'s two helpers). hashlib,
numba and pwrite all release the GIL. sha256 is sequential, so on two cores the source's hash is
the floor: about 2 GB/s per core here. Memory is bounded by a few chunks (``CHUNK_BYTES`` of
source) whatever the tensor or shard size.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from quant.errors import NonFiniteError, SourceError
from quant.formats.codecs import Codec
from quant.formats.constants import ScaleRule
from quant.outputs import output_mode
from quant.fused import Piece
from quant.plan import ASSEMBLE, CONSUMED, COPY, DECODE, ENCODE, ShardPlan, TensorPlan
from quant.safetensors_io import DTYPE_BYTES, MAX_HEADER_BYTES, ShardWriter, file_identity, numel, open_regular
from quant.strided import WORDS, copy2d

CHUNK_BYTES = 32 << 20  # source bytes per step
# Mapped source left behind is dropped in steps this big (each drop also interrupts the other
# core for a TLB shootdown, so not every chunk); resident source stays under a step plus a chunk.
RELEASE_STEP = 128 << 20
LEAD_BYTES = 1 << 30  # how far the source's hashing may run ahead of the reading


@dataclass(frozen=True)
class ShardJob:
    source_dir: Path
    dst: Path
    shard: ShardPlan
    codec: Codec
    scale_rule: ScaleRule | None  # encoding only
    device: str = "cpu"
    strict: bool = False  # NaN/Inf in a tensor kept as it is: an error, not a warning
    kernel_threads: int | None = None  # cores the CPU kernel may use (None: all)


# Exponent-field masks: a float is NaN or Inf exactly when all its exponent bits are set.
_EXPONENT_MASKS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000)}


def first_non_finite(data, dtype: str) -> int | None:
    """Index of the first NaN/Inf element in raw little-endian float bytes, None if all are finite."""
    if dtype not in _EXPONENT_MASKS:
        return None
    word, mask = _EXPONENT_MASKS[dtype]
    bad = np.flatnonzero((np.frombuffer(data, word) & word(mask)) == mask)
    return int(bad[0]) if bad.size else None


def release_mapped(mapping: mmap.mmap, released: int, upto: int) -> int:
    """Drop ``[released, upto)`` from a file mapping once that is a whole ``RELEASE_STEP``
    (``MADV_DONTNEED``: the pages stay in the page cache, just not in this process); returns where
    the mapping is kept from now."""
    upto -= upto % mmap.PAGESIZE
    if upto - released < RELEASE_STEP:
        return released
    mapping.madvise(mmap.MADV_DONTNEED, released, upto - released)
    return upto


class SourceGuard:
    """Says whether a source file is being changed under its reader, before each chunk is touched.

    Touching a mapped page past the end of a file someone truncated is SIGBUS: the process dies
    without a word. So the reader holds a read lease on the file (``fcntl(F_SETLEASE, F_RDLCK)``,
    Linux; fcntl(2) "Leases"): whoever opens it for writing or truncates it then waits (up to
    /proc/sys/fs/lease-break-time, 45 s by default) until the lease is released, and the lease
    shows the pending break, which ``changed`` checks before each chunk is touched. The conversion
    stops with the shard named, unmaps, and releases the lease (``close``); only then does the
    change go ahead. The break's signal is set to SIGURG, ignored by default (SIGIO would kill).
    Where no lease can be had (a file someone has open for writing, another owner, a filesystem
    without leases) nothing stops a truncation, so the file is never mapped: it is read with
    ``pread`` (``mapped`` is False), where a truncation is a short read, reported in one line.
    """

    F_SETLEASE, F_GETLEASE, F_SETSIG = fcntl.F_SETLEASE, fcntl.F_GETLEASE, fcntl.F_SETSIG

    def __init__(self, fileno: int):
        self.fileno, self.size = fileno, 0  # the reader sets ``size`` once it has checked it under the lease
        try:
            fcntl.fcntl(fileno, self.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fileno, self.F_SETLEASE, fcntl.F_RDLCK)
            self.leased = True
        except OSError:
            self.leased = False

    @property
    def mapped(self) -> bool:
        """Whether the file may be memory-mapped: only under the lease (see above)."""
        return self.leased

    def changed(self) -> bool:
        if self.leased:
            return fcntl.fcntl(self.fileno, self.F_GETLEASE) != fcntl.F_RDLCK  # a break is pending
        return os.fstat(self.fileno).st_size < self.size

    def close(self) -> None:
        """Release the lease (call once nothing touches the mappings any more)."""
        if self.leased:
            fcntl.fcntl(self.fileno, self.F_SETLEASE, fcntl.F_UNLCK)
            self.leased = False


def pread_exactly(fileno: int, offset: int, nbytes: int, path: Path) -> memoryview:
    """``nbytes`` at ``offset``, read (not mapped); a file that ends first was truncated meanwhile."""
    view = memoryview(bytearray(nbytes))
    done = 0
    while done < nbytes:
        got = os.preadv(fileno, [view[done:]], offset + done)
        if got == 0:
            raise truncated_error(path, offset + done)
        done += got
    return view


class SourceHasher:
    """sha256 of a whole source file on a helper thread with its own mapping, at its own pace.

    It needs nothing from the conversion (every byte is hashed, header and padding included), so it
    starts the moment the file is opened, overlapping the kernel's import as well as the kernel;
    hashlib releases the GIL. It stays at most ``LEAD_BYTES`` ahead of the reader (on a cold file
    it is the reader's readahead, and what it read must still be cached when the kernel gets
    there), and it drops what it has hashed from its mapping, so its resident memory is a chunk.
    Without a lease it reads chunks with ``pread`` instead of mapping (``SourceGuard``).
    """

    def __init__(self, fileno: int, size: int, guard: SourceGuard, path: Path):
        self.fileno, self.size, self.guard, self.path = fileno, size, guard, path
        self.pos = 0  # hashed up to here
        self.busy_s = 0.0
        self._allowed = LEAD_BYTES
        self._stop = False
        self._digest = hashlib.sha256()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._map = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ) if size and guard.mapped else None
        self._thread = threading.Thread(target=self._run, name="sha256-source", daemon=True)
        self._thread.start()

    def allow(self, end: int) -> None:
        """The reader got to ``end``: hashing may run up to ``LEAD_BYTES`` beyond it."""
        with self._cond:
            if end + LEAD_BYTES > self._allowed:
                self._allowed = end + LEAD_BYTES
                self._cond.notify()

    def _run(self) -> None:
        try:
            released = 0
            while self.pos < self.size:
                with self._cond:
                    while self._allowed <= self.pos and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    end = min(self.size, self.pos + CHUNK_BYTES, self._allowed)
                if self.guard.changed():
                    raise changed_error(self.path)
                started = time.perf_counter()
                if self._map:
                    with memoryview(self._map)[self.pos:end] as view:
                        self._digest.update(view)
                else:
                    self._digest.update(pread_exactly(self.fileno, self.pos, end - self.pos, self.path))
                self.busy_s += time.perf_counter() - started
                self.pos = end
                if self._map:
                    released = release_mapped(self._map, released, end)
        except BaseException as exc:  # handed to the reader's finish()
            self._error = exc

    def hexdigest(self) -> str:
        self.allow(self.size)
        self._thread.join()
        if self._error:
            raise self._error
        return self._digest.hexdigest()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        if self._map:
            self._map.close()


def _what_changed(planned: dict, now: dict) -> str:
    if (planned["inode"], planned["device"]) != (now["inode"], now["device"]):
        return "replaced by another file"
    if planned["size"] != now["size"]:
        return f"{planned['size']} bytes when planned, {now['size']} now"
    return "modified"


def check_as_planned(path: Path, fileno: int, st: os.stat_result, planned: ShardPlan) -> None:
    """Refuse a source that is not the file the plan was made from: every offset in the plan was
    read from its header, so a shard replaced, resized or rewritten since would be read at the old
    offsets (the wrong bytes, silently). Its identity (size, inode, mtime, ctime), its size and
    its header bytes must all be the planned ones."""
    def refuse(what: str) -> SourceError:
        return SourceError(f"{path}: changed since it was planned ({what}); the plan's offsets no longer describe it: "
                           "plan again and convert (rerunning quantize does both; --resume keeps the finished shards)")

    now = file_identity(st)
    if planned.source_identity is not None and now != planned.source_identity:
        raise refuse(_what_changed(planned.source_identity, now))
    if st.st_size != planned.source_size:
        raise refuse(f"{planned.source_size} bytes when planned, {st.st_size} now")
    if planned.header_sha256 is None:
        return
    prefix = bytes(pread_exactly(fileno, 0, min(8, st.st_size), path)) if st.st_size >= 8 else b""
    length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
    if not 0 <= length <= min(MAX_HEADER_BYTES, st.st_size - 8):
        raise refuse("its header is gone")
    if hashlib.sha256(prefix + pread_exactly(fileno, 8, length, path)).hexdigest() != planned.header_sha256:
        raise refuse("its header differs")


class SourceReader:
    """Reads one source file at increasing offsets while a ``SourceHasher`` hashes all of it.

    Under the read lease the file is memory-mapped, so a read costs no copy; ranges left behind
    are dropped from the mapping (``MADV_DONTNEED``: the pages stay in the page cache, just not in
    this process), so resident memory stays a few chunks whatever the shard size. The lease is
    taken first, then the file is checked against the plan (``check_as_planned``), and only then
    mapped; without a lease it is read with ``pread`` (``SourceGuard``).
    """

    def __init__(self, path: Path, planned: ShardPlan | None = None):
        self.path = path
        self.pos = self.released = 0
        self.read_s = 0.0
        self.map = self.hash = None
        self.file = open_regular(path)  # open until close(): it holds the guard's lease
        self.guard = SourceGuard(self.file.fileno())
        try:
            self.opened = os.fstat(self.file.fileno())  # the identity --resume checks before trusting this shard
            self.opened_ns = time.time_ns()
            self.size = self.guard.size = self.opened.st_size
            if planned is not None:
                check_as_planned(path, self.file.fileno(), self.opened, planned)
            if self.size and self.guard.mapped:
                self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
                self.map.madvise(mmap.MADV_SEQUENTIAL)
            self.hash = SourceHasher(self.file.fileno(), self.size, self.guard, path)
        except BaseException:
            self.close()
            raise

    def read(self, offset: int, nbytes: int) -> memoryview:
        """The bytes at ``offset``: a view into the mapping (or, without a lease, a copy read now)."""
        started = time.perf_counter()
        if offset < self.pos:
            raise AssertionError("tensors must be read in file order")
        if offset + nbytes > self.size:
            raise truncated_error(self.path, self.size)
        if self.guard.changed():
            raise changed_error(self.path)
        data = self._view(offset, offset + nbytes)
        self.pos = offset + nbytes
        self.hash.allow(self.pos)
        if self.map:
            self.released = release_mapped(self.map, self.released, offset)
        self.read_s += time.perf_counter() - started
        return data

    def peek(self, offset: int, nbytes: int) -> bytes:
        """A copy of bytes ahead of the read position (a scale its weight needs first)."""
        if offset < self.pos or offset + nbytes > self.size:
            raise AssertionError(f"peek at [{offset}, {offset + nbytes}) outside the unread part of {self.path}")
        if self.guard.changed():
            raise changed_error(self.path)
        return bytes(self._view(offset, offset + nbytes))

    def gather(self, offset: int, rows: int, cols: int, row_stride: int, col_stride: int, item: int,
               threads: int | None = None) -> np.ndarray:
        """A copy of the ``rows x cols`` elements of ``item`` bytes at ``offset + r * row_stride + c *
        col_stride``, as contiguous rows (uint8 ``[rows, cols * item]``): one chunk of a fused expert's
        projection that is not a run of whole rows in the file, copied by tiles (``quant.strided``;
        ``threads``: the cores it may use). A tensor's gathers start at increasing offsets (its
        pieces in file order, each one's chunks in order), so the mapping is dropped up to the
        first byte of each, as ``read`` drops it (in ``RELEASE_STEP`` s): what it spans stays mapped
        for the next piece of the same expert (gate and up share every page of an ``[E, H, 2I]``
        expert), and resident source stays under a step and one expert's span. Without a lease it
        reads the runs along the smaller stride line by line. The read position does not move (the
        chunks of an ``[E, H, 2I]`` tensor interleave in the file)."""
        end = offset + (rows - 1) * row_stride + (cols - 1) * col_stride + item
        if end > self.size:
            raise truncated_error(self.path, self.size)
        if self.guard.changed():
            raise changed_error(self.path)
        started = time.perf_counter()
        word = WORDS[item]
        out = np.empty((rows, cols), word)
        if self.map:
            view = np.ndarray((rows, cols), word, self.map, offset, (row_stride, col_stride))
            copy2d(view, out, threads)
            del view
            self.released = release_mapped(self.map, self.released, offset)
        else:  # the runs in the file are the lines along the smaller stride: read those
            by_rows = row_stride >= col_stride
            lines, length, line_stride, stride = (rows, cols, row_stride, col_stride) if by_rows else \
                (cols, rows, col_stride, row_stride)
            block = np.empty((lines, length), word)
            span = (length - 1) * stride + item
            for line in range(lines):
                run = np.frombuffer(pread_exactly(self.file.fileno(), offset + line * line_stride, span, self.path), word)
                block[line] = run[::stride // item]
            if by_rows:
                out = block
            else:
                copy2d(block.T, out, threads)
        self.hash.allow(max(self.pos, end))
        self.read_s += time.perf_counter() - started
        return out.view(np.uint8).reshape(rows, cols * item)

    def fetch(self, offset: int, nbytes: int) -> np.ndarray:
        """A copy of the bytes at ``offset`` (uint8), wherever the read position is: a fused tensor
        written back (``--to bf16``) reads its experts' weights in expert order, not file order.
        What it touched of the mapping is dropped after; the read position does not move."""
        end = offset + nbytes
        if end > self.size:
            raise truncated_error(self.path, self.size)
        if self.guard.changed():
            raise changed_error(self.path)
        started = time.perf_counter()
        if self.map:
            block = np.frombuffer(self.map, np.uint8, nbytes, offset).copy()
            self._drop(offset, end)
        else:
            block = np.frombuffer(pread_exactly(self.file.fileno(), offset, nbytes, self.path), np.uint8)
        self.hash.allow(max(self.pos, end))
        self.read_s += time.perf_counter() - started
        return block

    def _drop(self, start: int, end: int) -> None:
        """Drop the mapped pages of ``[start, end)`` from this process (they stay in the page cache)."""
        first = start - start % mmap.PAGESIZE
        last = min(self.size, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _view(self, start: int, end: int) -> memoryview:
        if self.map:
            return memoryview(self.map)[start:end]
        return pread_exactly(self.file.fileno(), start, end - start, self.path)

    def finish(self) -> str:
        digest = self.hash.hexdigest()
        if self.guard.changed() or file_identity(self.path.stat()) != file_identity(self.opened):
            raise changed_error(self.path)
        return digest

    def close(self) -> None:
        if self.hash:
            self.hash.close()
        if self.map:
            try:
                self.map.close()
            except BufferError:  # a view is still referenced; the mapping goes with it
                pass
        self.guard.close()  # nothing touches the mappings any more: a pending change may go ahead
        self.file.close()


def changed_error(path: Path) -> SourceError:
    return SourceError(f"{path}: changed while it was being converted; leave the source alone and rerun "
                       "(--resume keeps the finished shards)")


def truncated_error(path: Path, at: int) -> SourceError:
    return SourceError(f"{path}: ends at byte {at}, before the data planned: truncated or changed since it was "
                       "planned; restore it and rerun (--resume keeps the finished shards)")


def _encode_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                   advance: Callable[[int], None], timing: dict) -> dict:
    info = tensor.source
    if tensor.blocks:  # the release's own layout: every expert's matrix into one *_blocks, then one *_scales
        scales: list = []
        errors = [_encode_rows(piece_rows(reader, piece, job.kernel_threads), (piece.rows, piece.cols), tensor.outputs, info.dtype,
                               f"{info.name} expert {piece.expert}", writer, job, advance, timing,
                               weight_base=i * piece.rows * piece.cols // 2, scales_out=scales)
                  for i, piece in enumerate(tensor.pieces)]
        writer.write(tensor.outputs[1][0], 0, np.concatenate(scales).data)
        err_sq, ref_sq = sum(e for e, _ in errors), sum(r for _, r in errors)
    elif tensor.pieces:  # a fused expert tensor: each expert's projection encoded as its own weight
        errors = [_encode_rows(piece_rows(reader, piece, job.kernel_threads), (piece.rows, piece.cols), tensor.outputs[2 * i:2 * i + 2],
                               info.dtype, piece.name, writer, job, advance, timing)
                  for i, piece in enumerate(tensor.pieces)]
        err_sq, ref_sq = sum(e for e, _ in errors), sum(r for _, r in errors)
    else:
        row_bytes = info.nbytes // info.shape[0]
        rows = lambda start, count: reader.read(info.begin + start * row_bytes, count * row_bytes)  # noqa: E731
        err_sq, ref_sq = _encode_rows(rows, info.shape, tensor.outputs, info.dtype, info.name, writer, job, advance,
                                      timing)
    return {"shape": list(info.shape), "rel_rms_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0}


def piece_rows(reader: SourceReader, piece: Piece, threads: int | None = None) -> Callable[[int, int], memoryview | np.ndarray]:
    """Rows of one fused expert's projection: read as they lie where they follow each other, else
    gathered (every other row of an interleaved tensor, the transpose of an ``[E, H, 2I]`` slice)."""
    row_bytes = piece.cols * piece.item
    if piece.contiguous:
        return lambda start, count: reader.read(piece.offset + start * piece.row_stride, count * row_bytes)
    return lambda start, count: reader.gather(piece.offset + start * piece.row_stride, count, piece.cols,
                                              piece.row_stride, piece.col_stride, piece.item, threads)


def _encode_rows(rows_at: Callable[[int, int], object], shape: tuple[int, int], outputs, dtype: str, what: str,
                 writer: ShardWriter, job: ShardJob, advance: Callable[[int], None], timing: dict,
                 weight_base: int = 0, scales_out: list | None = None) -> tuple[float, float]:
    """Encode a ``[rows, cols]`` matrix whose rows ``rows_at(start, count)`` gives as raw bytes, in
    chunks of ``CHUNK_BYTES``; returns the squared error and reference sums. ``weight_base``: where in
    the weight tensor the matrix starts (one expert of a ``*_blocks`` tensor); ``scales_out``: collect
    the scales there for the caller to write (after every expert's blocks), instead of writing them."""
    codec = job.codec
    rows, cols = shape
    row_bytes = cols * DTYPE_BYTES[dtype]
    step = max(codec.row_multiple, CHUNK_BYTES // row_bytes // codec.row_multiple * codec.row_multiple)
    (weight_name, _, _), (scale_name, _, _) = outputs
    err_sq = ref_sq = 0.0
    scale_chunks = []  # written after the weight, keeping the file order (1/64 of the tensor's size)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(rows_at(start, count), np.uint8)
        started = time.perf_counter()
        try:
            out = codec.encode(raw.reshape(count, row_bytes), dtype, job.scale_rule, device=job.device, row0=start,
                               threads=job.kernel_threads)
        except NonFiniteError as exc:
            raise NonFiniteError(f"{what}: {exc}") from None
        timing["kernel"] += time.perf_counter() - started
        writer.write(weight_name, weight_base + start * out.weight.shape[1] * out.weight.itemsize, out.weight.data)
        scale_chunks.append(out.scales)
        err_sq, ref_sq = err_sq + out.err_sq, ref_sq + out.ref_sq
        advance(count * row_bytes)
    if scales_out is not None:
        scales_out.extend(scale_chunks)
    else:
        writer.write(scale_name, 0, np.concatenate(scale_chunks).data)
    return err_sq, ref_sq


def _decoded_rows(job: ShardJob, info, scale, raw_scales: bytes, rows_at: Callable[[int, int], object],
                  shape: tuple[int, int], timing: dict, advance: Callable[[int], None]) -> Iterator[tuple[int, np.ndarray]]:
    """The bf16 rows (uint8 ``[count, cols * 2]``, from row ``start``) of one stored weight whose rows
    ``rows_at(offset, nbytes)`` reads, in chunks. Scales, codes and the decoded values are checked
    before a row is given: a scale or code the format forbids (E8M0 0xFF, a NaN/Inf/negative FP8
    scale, an e4m3 NaN code) or a value that overflows bf16 is refused naming the tensor, never
    written as NaN or Inf."""
    codec, multiple = job.codec, job.codec.row_multiple
    rows, cols = shape
    where = f"{job.source_dir / job.shard.file}: tensor"
    fix = "the checkpoint is corrupt: re-export it (gate checkpoint --deep lists every such tensor)"
    scales = np.frombuffer(raw_scales, np.uint8).reshape(scale.shape[0], -1)
    if problem := codec.scale_problem(scales):
        raise SourceError(f"{where} {scale.name}: {problem}; {fix}")
    may_overflow = codec.may_overflow(scales)
    row_bytes = info.nbytes // rows
    step = max(multiple, CHUNK_BYTES // (cols * 2) // multiple * multiple)  # bounded by the bf16 written
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(rows_at(info.begin + start * row_bytes, count * row_bytes), np.uint8)
        started = time.perf_counter()
        codes = raw.reshape(count, row_bytes)
        if problem := codec.code_problem(codes, start):
            raise SourceError(f"{where} {info.name}: {problem}; {fix}")
        first = start // multiple
        out = codec.decode_bytes(codes, scales[first:first + -(-count // multiple)], job.kernel_threads)
        if may_overflow and (bad := first_non_finite(out.data, "BF16")) is not None:
            raise SourceError(f"{where} {info.name}: decodes to NaN/Inf at row {start + bad // cols}, column "
                              f"{bad % cols} (its scale is too large for bf16); {fix}")
        timing["kernel"] += time.perf_counter() - started
        yield start, out
        advance(count * row_bytes)


def _decode_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                   advance: Callable[[int], None], timing: dict, stored_scales: bytes | None) -> None:
    """Decode one weight; ``stored_scales``: its scale's bytes when the file holds the scale before
    the weight (read as the reader passed them), else None (read ahead now)."""
    info, scale = tensor.source, tensor.scale
    name, _, shape = tensor.outputs[0]
    raw_scales = stored_scales if stored_scales is not None else reader.peek(scale.begin, scale.nbytes)
    for start, out in _decoded_rows(job, info, scale, raw_scales, reader.read, shape, timing, advance):
        writer.write(name, start * shape[1] * 2, out.data)


def _assemble_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                     advance: Callable[[int], None], timing: dict) -> None:
    """Write one fused tensor (``--to bf16`` of a fused family) from its experts' weights, expert by
    expert: each expert's block of the fused tensor (its projections, in the release's axis order
    and gate/up layout, as ``tensor.pieces`` place them) is filled from their decoded rows (or the
    rows of a weight kept bf16, copied) and written, so memory is one expert's block and a chunk,
    whatever the tensor's size. The weights are read in expert order (``SourceReader.fetch``)."""
    name, _, shape = tensor.outputs[0]
    experts = tensor.pieces[-1].expert + 1
    block_items = numel(shape) // experts  # one expert's [out, in] or [in, out] block, in bf16 items
    # [E, 2I, H] with gate then up: each piece's rows follow the previous piece's in the output,
    # so decoded rows are written as they come; any other layout fills an expert's block first.
    direct = all(piece.contiguous for piece in tensor.pieces)
    block = None
    for piece, (weight, scale) in zip(tensor.pieces, tensor.members):
        if not direct and (block is None or piece.expert != expert):
            if block is not None:
                writer.write(name, expert * block_items * 2, block)
            expert, block = piece.expert, np.empty(block_items, np.uint16)  # a new one: the writer holds the last
        item, row_bytes = piece.item, piece.cols * piece.item
        if scale is None:  # kept bf16: its rows as they are
            rows = _kept_rows(reader, weight, row_bytes, advance)
        else:
            rows = _decoded_rows(job, weight, scale, bytes(reader.fetch(scale.begin, scale.nbytes)), reader.fetch,
                                 (piece.rows, piece.cols), timing, advance)
        if direct:
            for start, out in rows:
                writer.write(name, piece.offset + start * row_bytes, out.data)
        else:
            place = np.ndarray((piece.rows, piece.cols), np.uint16, block, piece.offset - expert * block_items * item,
                               (piece.row_stride, piece.col_stride))
            for start, out in rows:
                count = out.shape[0]
                started = time.perf_counter()
                copy2d(out.view(np.uint16).reshape(count, piece.cols), place[start:start + count], job.kernel_threads)
                timing["kernel"] += time.perf_counter() - started
        if scale is not None:
            advance(scale.nbytes)
    if block is not None:
        writer.write(name, expert * block_items * 2, block)


def _kept_rows(reader: SourceReader, weight, row_bytes: int,
               advance: Callable[[int], None]) -> Iterator[tuple[int, np.ndarray]]:
    """The rows of a weight kept bf16 (uint8 ``[count, row_bytes]``), in chunks."""
    rows = weight.nbytes // row_bytes
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        yield start, reader.fetch(weight.begin + start * row_bytes, count * row_bytes).reshape(count, row_bytes)
        advance(count * row_bytes)


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
    """Write one output shard atomically; returns its record for the conversion manifest, with the
    seconds each stage was busy (the hashes and the writing run on helper threads, overlapping the
    kernel; the kernel's first call includes loading numba)."""
    shard = job.shard
    started = time.perf_counter()
    timing = {"kernel": 0.0}
    writer = reader = None
    errors: dict[str, dict] = {}
    decoded: list[str] = []
    kept_non_finite: dict[str, str] = {}
    # Scales stored before their weight (safetensors' save_file puts F32 before F8, so every FP8
    # scale_inv): kept as the reader passes them, until their weight is decoded.
    early_scales: dict[str, bytes] = {}
    used_scales: set[str] = set()
    try:
        # The source first: checked against the plan (and leased) before an output file exists.
        reader = SourceReader(job.source_dir / shard.file, shard)
        writer = ShardWriter(job.dst / shard.file, shard.entries, output_mode(reader.opened.st_mode))
        for tensor in shard.tensors:  # the plan decided each tensor's action; this only carries it out
            if tensor.action == ENCODE:
                errors[tensor.source.name] = _encode_tensor(reader, tensor, writer, job, advance, timing)
            elif tensor.action == DECODE:
                _decode_tensor(reader, tensor, writer, job, advance, timing, early_scales.pop(tensor.scale.name, None))
                used_scales.add(tensor.scale.name)
                decoded.append(tensor.source.name)
            elif tensor.action == ASSEMBLE:
                _assemble_tensor(reader, tensor, writer, job, advance, timing)
                decoded += [weight.name for weight, scale in tensor.members if scale is not None]
            elif tensor.action == COPY:
                if where := _copy_tensor(reader, tensor, writer, job, advance):
                    kept_non_finite[tensor.source.name] = where
            elif tensor.action == CONSUMED:  # a scale for its weight's decode: hashed as the reading passes it
                if tensor.source.name not in used_scales:  # its weight comes later in the file
                    early_scales[tensor.source.name] = bytes(reader.read(tensor.source.begin, tensor.source.nbytes))
                advance(tensor.source.nbytes)
            else:
                raise AssertionError(f"{tensor.source.name}: unknown action {tensor.action!r}")
        source_sha256 = reader.finish()
        output_sha256 = writer.commit()
    except BaseException:
        if writer:
            writer.abort()
        raise
    finally:
        if reader:
            reader.close()
    seconds = {"total": time.perf_counter() - started, "read": reader.read_s, **timing,
               "source_hash": reader.hash.busy_s, "output_hash": writer.hash_s, "write": writer.write_s}
    return {"file": shard.file, "source_size": shard.source_size, "source_sha256": source_sha256,
            "size": writer.size, "sha256": output_sha256, "quantized": errors, "decoded": decoded, "kept_non_finite": kept_non_finite,
            "source_identity": {**file_identity(reader.opened), "opened_ns": reader.opened_ns},
            "seconds": {k: round(v, 4) for k, v in seconds.items()}}
