"""Streaming safetensors: read headers without data, write a shard header-first, atomically.

A safetensors file is ``u64 little-endian header length | JSON header | data``; the header maps
each tensor name to ``{dtype, shape, data_offsets: [begin, end]}`` relative to the data start.
Reading only headers lets the planner size a 1.5 TB checkpoint in seconds; writing the header
first (shapes are known from the plan) lets the converter fill tensors in place, in chunks, so
memory follows the chunk rather than the shard.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from quant.errors import QuantgateError
from quant.safe_files import create_new, open_regular_fd, parse_json

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
PARTIAL_SUFFIX = ".partial"


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (torch is loaded only by those who need it)."""
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
            "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64}[name]


class ShardError(QuantgateError, ValueError):
    """A shard that cannot be read as safetensors; the message names the file and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int
    identity: dict | None = None  # ``file_identity`` of the file the header was read from
    header_sha256: str | None = None  # of the length prefix and the header, as on disk


def file_identity(st: os.stat_result) -> dict:
    """What says a file is the one read before without reading it: any write changes one of these
    (ctime too, which no one can set back, unlike mtime)."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def open_regular(path: Path):
    """``path`` opened for binary reading, refused unless it is a regular file: a FIFO or a device
    named like a shard would block the reader forever (``safe_files.open_regular_fd``)."""
    return os.fdopen(open_regular_fd(path, ShardError), "rb")


USIZE_MAX = 2**64 - 1  # safetensors reads every header number as a Rust usize (u64 here)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= USIZE_MAX


def _fits_usize(shape: list[int], item_bytes: int) -> bool:
    """The element count and byte size fit a usize at every step, as the library computes them
    (``Metadata::validate``: ``shape.iter().try_fold(1, usize::checked_mul)``, then times the
    dtype's size); a header that overflows there is one it refuses."""
    count = 1
    for dim in [*shape, item_bytes]:
        count *= dim
        if count > USIZE_MAX:
            return False
    return True


class _Object(dict):
    """A JSON object that remembers which of its keys were repeated (the last one is kept)."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.repeated = {k for k, n in Counter(k for k, _ in pairs).items() if n > 1} if len(self) < len(pairs) \
            else set()


# Keys the library reads into a struct field, where serde_json refuses a repeat ("duplicate
# field"); a repeated tensor name or metadata key is a map entry, where the last one wins.
_STRUCT_FIELDS = ("dtype", "shape", "data_offsets")


def _repeated_field(raw: _Object) -> str | None:
    if "__metadata__" in raw.repeated:
        return "__metadata__"
    for name, entry in raw.items():
        if isinstance(entry, _Object) and (fields := entry.repeated.intersection(_STRUCT_FIELDS)):
            return f"{sorted(fields)[0]} of tensor {name}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_info(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise ShardError(f"{where}: header entry is not an object; the header is corrupt, re-download this shard")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ShardError(f"{where}: unsupported or missing dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ShardError(f"{where}: shape {_short(shape)} is not a list of non-negative integers below 2**64; "
                         "the header is corrupt")
    if not _fits_usize(shape, DTYPE_BYTES[dtype]):
        raise ShardError(f"{where}: shape {_short(shape)} has more bytes than 2**64 (safetensors refuses it); "
                         "the header is corrupt")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise ShardError(f"{where}: data_offsets {_short(offsets)} are not two ordered non-negative integers below "
                         "2**64; the header is corrupt, re-download this shard")
    begin, end = offsets
    if end - begin != numel(shape) * DTYPE_BYTES[dtype]:
        raise ShardError(f"{where} {dtype}{shape} has {end - begin} bytes; the header is corrupt")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a shard's header; never reads tensor data.

    Accepts exactly what the safetensors library (0.8, ``Metadata::validate`` in
    safetensors/src/tensor.rs) loads: tensors tile the data area in offset order, without gap or
    overlap, and the data ends where the file ends. Anything else is refused with the shard and
    tensor named, before a byte of it is read as tensor data.
    """
    try:
        with open_regular(path) as f:
            opened = os.fstat(f.fileno())
            file_size = opened.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ShardError(f"{path}: only {file_size} bytes, not a safetensors file (truncated?); "
                                 "re-download or re-export this shard")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise ShardError(f"{path}: header length {header_len} does not fit in {file_size} bytes "
                                 "(truncated or not safetensors); re-download this shard")
            header_bytes = f.read(header_len)
            raw = parse_json(header_bytes, f"{path}: header", ShardError, "re-download this shard", _Object)
    except FileNotFoundError:
        raise ShardError(f"{path}: missing; the index names it but it is not on disk") from None
    except OSError as exc:
        raise ShardError(f"{path}: cannot be read ({exc.strerror}); check the file and its permissions") from None
    if not isinstance(raw, dict):
        raise ShardError(f"{path}: header is a JSON {type(raw).__name__}, not an object; re-download this shard")
    if repeated := _repeated_field(raw):
        raise ShardError(f"{path}: header repeats {repeated} (safetensors refuses it); the header is corrupt, "
                         "re-download this shard")
    data_start = 8 + header_len
    metadata = raw.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ShardError(f"{path}: __metadata__ is {_short(metadata)}, not an object of strings (safetensors refuses "
                         "it); the header is corrupt, re-download this shard")
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in raw.items()}
    cursor = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != cursor:
            what = "overlaps the tensor before it" if info.begin < cursor else f"leaves a gap at byte {cursor}"
            raise ShardError(f"{path}: tensor {info.name} at bytes [{info.begin}, {info.end}) {what}; the header is "
                             "corrupt (safetensors refuses it), re-download or re-export this shard")
        cursor = info.end
    if cursor > file_size:
        raise ShardError(f"{path}: truncated, header needs {cursor} bytes but the file has {file_size}; "
                         "re-download or re-copy this shard")
    if cursor < file_size:
        raise ShardError(f"{path}: {file_size - cursor} bytes after the last tensor (safetensors refuses it); "
                         "re-download or re-export this shard")
    return ShardHeader(path, tensors, metadata, file_size, file_identity(opened),
                       hashlib.sha256(prefix + header_bytes).hexdigest())


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]],
                  metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Returns the bytes and each tensor's absolute file offset. The JSON is space-padded to a
    multiple of 8 bytes, as the safetensors library does, so every tensor is aligned.
    """
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    relative: dict[str, int] = {}
    cursor = 0
    for name, dtype, shape in entries:
        size = numel(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + size]}
        relative[name] = cursor
        cursor += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    start = 8 + len(body)
    return struct.pack("<Q", len(body)) + body, {name: start + off for name, off in relative.items()}


def encoded_size(entries: list[tuple[str, str, tuple[int, ...]]], header: bytes | None = None) -> int:
    """Bytes of the whole file: header plus every tensor's data."""
    header = header if header is not None else encode_header(entries)[0]
    return len(header) + sum(numel(shape) * DTYPE_BYTES[dtype] for _, dtype, shape in entries)


def _writeback_starter():
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a
    range to disk without waiting for it, so the fsync that makes a shard durable before its
    rename finds little left to do (measured here on 330 MB: fsync 0.10 s -> 0.00 s, writes no
    slower). None where there is no such call; the fsync then does all of it."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()
WRITEBACK_BYTES = 32 << 20  # written data is sent to disk in steps of this size


class ShardWriter:
    """Writes one output shard under ``<final>.partial`` and renames it only when complete.

    Data must arrive in file order. Hashing it (so committing needs no second read) and writing it
    happen on two helper threads: hashlib and pwrite release the GIL, so they overlap the caller's
    kernel and each other (a direct write waits for the disk). At most ``BACKLOG`` buffers wait
    for each; a caller hands over a buffer it no longer changes.

    Writes go out in ``STAGE_BYTES`` blocks from one reused, aligned buffer with ``O_DIRECT``,
    bypassing the page cache: copying into fresh page-cache pages was the converter's largest
    kernel-side cost (perf: 14% of a conversion's CPU; 0.09-0.86 s per 320 MB against 0.03 s
    direct, measured here). The last partial block, and every block on a filesystem that refuses
    ``O_DIRECT`` (tmpfs), goes through the page cache. A failed write (a disk that fills despite
    the converter's up-front space check) is raised by the next ``write`` or by ``commit``, and
    ``abort`` removes the partial file. No ``posix_fallocate``: on ext4 it makes every later
    buffered write convert unwritten extents, which measured 3-7x slower than plain writes here.
    """

    BACKLOG = 3
    STAGE_BYTES = 8 << 20  # a multiple of every block size O_DIRECT asks alignment to

    def __init__(self, final_path: Path, entries: list[tuple[str, str, tuple[int, ...]]], mode: int = 0o644):
        self.final_path = final_path
        self.tmp_path = final_path.with_name(final_path.name + PARTIAL_SUFFIX)
        header, self.offsets = encode_header(entries)
        self.size = encoded_size(entries, header)
        self.write_s = self.hash_s = 0.0  # the helper threads' time in writes (and the final fsync), in sha256
        self.fd = self._open(self.tmp_path, mode)
        self.pos = 0  # handed over up to here
        self._digest = hashlib.sha256()
        self._stage = mmap.mmap(-1, self.STAGE_BYTES)  # page-aligned, as O_DIRECT needs
        self._staged = self._written = 0
        self._error: BaseException | None = None
        self._helpers = []  # (inbox, thread): one hashes, one writes
        for step, name in ((self._hash, "sha256-output"), (self._stage_and_write, "shard-writer")):
            inbox: queue.Queue = queue.Queue(self.BACKLOG)
            thread = threading.Thread(target=self._drain, args=(inbox, step), name=name, daemon=True)
            thread.start()
            self._helpers.append((inbox, thread))
        self.write("", 0, header)

    @staticmethod
    def _open(path: Path, mode: int) -> int:
        """The partial file, created new with ``mode`` less the umask (never through a link:
        ``safe_files.create_new``), then switched to ``O_DIRECT`` where the filesystem takes it."""
        fd = create_new(path, mode)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | getattr(os, "O_DIRECT", 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                os.close(fd)
                raise
        return fd

    def write(self, name: str, offset_in_tensor: int, data) -> None:
        """``data`` (bytes-like) at ``offset_in_tensor`` of tensor ``name`` ("" with 0: the header)."""
        offset = self.offsets[name] + offset_in_tensor if name else 0
        if offset != self.pos:
            raise AssertionError(f"{name}: out-of-order write at {offset}, expected {self.pos}")
        if self._error:
            raise self._error
        view = memoryview(data).cast("B")
        for inbox, _ in self._helpers:
            inbox.put(view)
        self.pos += len(view)

    def _drain(self, inbox: queue.Queue, step) -> None:
        while (view := inbox.get()) is not None:
            if self._error:
                continue  # after a failure only drain, so the caller never blocks on a full queue
            try:
                step(view)
            except BaseException as exc:
                self._error = exc

    def _hash(self, view: memoryview) -> None:
        started = time.perf_counter()
        self._digest.update(view)
        self.hash_s += time.perf_counter() - started

    def _stage_and_write(self, view: memoryview) -> None:
        while view:
            take = min(len(view), self.STAGE_BYTES - self._staged)
            self._stage[self._staged:self._staged + take] = view[:take]
            self._staged, view = self._staged + take, view[take:]
            if self._staged == self.STAGE_BYTES:
                self._flush_stage()

    def _flush_stage(self) -> None:
        """Write the staged bytes at the end of the file (direct when the block is whole)."""
        started = time.perf_counter()
        with memoryview(self._stage)[:self._staged] as block:
            done = 0
            while done < len(block):  # a short write (disk just filled) is retried: the retry reports ENOSPC
                try:
                    n = os.pwrite(self.fd, block[done:], self._written + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self._buffered():
                        raise
                    continue  # the filesystem took O_DIRECT at open but refuses it here: buffered
                if n == 0:
                    raise OSError(errno.ENOSPC, f"{self.tmp_path}: no byte written", str(self.tmp_path))
                done += n
        if _start_writeback:  # what went through the page cache starts for the disk now
            _start_writeback(self.fd, self._written, done)
        self._written += done
        self._staged = 0
        self.write_s += time.perf_counter() - started

    def _buffered(self) -> bool:
        """Clear O_DIRECT on the file; False if it was not set."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        direct = getattr(os, "O_DIRECT", 0)
        if not flags & direct:
            return False
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~direct)
        return True

    def _stop(self) -> None:
        for inbox, thread in self._helpers:
            if thread.is_alive():
                inbox.put(None)
                thread.join()

    def commit(self) -> str:
        """Write the last partial block, flush, rename into place; returns the file's sha256."""
        self._stop()
        if self._error:
            raise self._error
        if self.pos != self.size:
            raise AssertionError(f"{self.tmp_path}: {self.pos} of {self.size} bytes written")
        if self._staged:
            self._buffered()  # a partial block cannot go direct
            self._flush_stage()
        started = time.perf_counter()
        os.fsync(self.fd)
        self.write_s += time.perf_counter() - started
        self._close()
        os.replace(self.tmp_path, self.final_path)
        return self._digest.hexdigest()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._stage.close()

    def abort(self) -> None:
        self._stop()
        self._close()
        self.tmp_path.unlink(missing_ok=True)
