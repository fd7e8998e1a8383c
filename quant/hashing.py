"""The one sha256 helper for files, bytes, text and JSON-able objects.

(The converter hashes its streams as it goes: ``source.SourceHasher`` and ``ShardWriter``.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

CHUNK = 8 << 20  # bytes read at a time: any file is hashed in this much memory


def sha256_fileobj(f: BinaryIO, chunk: int = CHUNK, on_block: Callable[[int], object] | None = None) -> str:
    """The sha256 of what is left to read in ``f``, streamed; ``on_block(nbytes)`` after each block (progress)."""
    digest = hashlib.sha256()
    while block := f.read(chunk):
        digest.update(block)
        if on_block:
            on_block(len(block))
    return digest.hexdigest()


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    with path.open("rb") as f:
        return sha256_fileobj(f, chunk)


def sha256_of(value: Path | bytes | str | object) -> str:
    """The one hex sha256 helper: a file (streamed), bytes, text (UTF-8), or any JSON-able object
    (canonical JSON, sorted keys, so equal objects hash equal whatever their key order)."""
    if isinstance(value, Path):
        return sha256_file(value)
    if isinstance(value, str):
        value = value.encode()
    elif not isinstance(value, (bytes, bytearray)):
        value = json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(value).hexdigest()
