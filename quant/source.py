"""Reading one source shard as the plan read it: a guarded mapping (a file that changes or shrinks
under the converter is an error naming it, never a torn tensor), its sha256 computed on a thread of
its own ahead of the reading (``SourceHasher``: sequential, the floor on two cores), and mapped
pages dropped behind the reader so resident source stays under ``RELEASE_STEP`` plus a chunk.
``quant.shard`` carries out each tensor's action on what this reads.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np

from quant.errors import SourceError
from quant.plan import ShardPlan
from quant.safetensors_io import MAX_HEADER_BYTES, file_identity, open_regular
from quant.strided import WORDS, copy2d

CHUNK_BYTES = 32 << 20  # source bytes per step
# Mapped source left behind is dropped in steps this big (each drop also interrupts the other
# core for a TLB shootdown, so not every chunk); resident source stays under a step plus a chunk.
RELEASE_STEP = 128 << 20
LEAD_BYTES = 1 << 30  # how far the source's hashing may run ahead of the reading

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
