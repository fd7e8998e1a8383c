"""The one sha256 helper for files, bytes, text and JSON-able objects.

(The converter hashes its streams as it goes: ``source.SourceHasher`` and ``ShardWriter``.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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
