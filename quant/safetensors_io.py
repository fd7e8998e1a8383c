"""Streaming safetensors: read headers without data, write a shard header-first, atomically.

A safetensors file is ``u64 little-endian header length | JSON header | data``; the header maps
each tensor name to ``{dtype, shape, data_offsets: [begin, end]}`` relative to the data start.
Reading only headers lets the planner size a 1.5 TB checkpoint in seconds; writing the header
first (shapes are known from the plan) lets the converter fill tensors in place, in chunks, so
memory follows the chunk rather than the shard.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.hashing import StreamHasher

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
TORCH_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
PARTIAL_SUFFIX = ".partial"


class ShardError(ValueError):
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


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a shard's header; never reads tensor data."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ShardError(f"{path}: only {file_size} bytes, not a safetensors file (truncated?); "
                                 "re-download or re-export this shard")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise ShardError(f"{path}: header length {header_len} does not fit in {file_size} bytes "
                                 "(truncated or not safetensors); re-download this shard")
            raw = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise ShardError(f"{path}: missing; the index names it but it is not on disk") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardError(f"{path}: header is not valid JSON ({exc}); re-download this shard") from None
    data_start = 8 + header_len
    metadata = raw.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise ShardError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if end - begin != numel(shape) * DTYPE_BYTES[dtype]:
            raise ShardError(f"{path}: tensor {name} {dtype}{list(shape)} has {end - begin} bytes; header is corrupt")
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
    data_end = max((t.end for t in tensors.values()), default=data_start)
    if data_end > file_size:
        raise ShardError(f"{path}: truncated, header needs {data_end} bytes but the file has {file_size}; "
                         "re-download or re-copy this shard")
    return ShardHeader(path, tensors, metadata, file_size)


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


class ShardWriter:
    """Writes one output shard under ``<final>.partial`` and renames it only when complete.

    Space for the whole file is reserved up front (``posix_fallocate``), so a full disk fails
    before any data is written rather than leaving a sparse, complete-looking file. Data must
    arrive in file order; it is hashed on the way, so committing needs no second read.
    """

    def __init__(self, final_path: Path, entries: list[tuple[str, str, tuple[int, ...]]], hasher: StreamHasher):
        self.final_path = final_path
        self.tmp_path = final_path.with_name(final_path.name + PARTIAL_SUFFIX)
        header, self.offsets = encode_header(entries)
        self.size = encoded_size(entries, header)
        self.hasher, self.digest = hasher, hasher.new()
        self.fd = os.open(self.tmp_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            if self.size:
                os.posix_fallocate(self.fd, 0, self.size)
            os.pwrite(self.fd, header, 0)
        except BaseException:
            self.abort()
            raise
        self.hasher.update(self.digest, header)
        self.pos = len(header)

    def write(self, name: str, offset_in_tensor: int, data) -> None:
        offset = self.offsets[name] + offset_in_tensor
        if offset != self.pos:
            raise AssertionError(f"{name}: out-of-order write at {offset}, expected {self.pos}")
        written = os.pwrite(self.fd, data, offset)
        if written != len(memoryview(data).cast("B")):
            raise OSError(f"{self.tmp_path}: short write")
        self.hasher.update(self.digest, data)
        self.pos += written

    def commit(self) -> str:
        """Flush and rename into place; returns the file's sha256."""
        if self.pos != self.size:
            raise AssertionError(f"{self.tmp_path}: {self.pos} of {self.size} bytes written")
        self.hasher.drain()
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp_path, self.final_path)
        return self.digest.hexdigest()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp_path.unlink(missing_ok=True)
