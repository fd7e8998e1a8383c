"""sha256 of byte streams computed on helper threads, overlapping the caller's work.

hashlib releases the GIL on large buffers, so a ``HashStream`` per stream (the source a shard is
read from, the output it is written to) hashes on its own thread while the caller runs the
kernel: hashing costs wall-clock time only where it is the slowest stage. At most ``backlog``
buffers wait, which bounds memory (callers hand over views, not copies).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


class HashStream:
    def __init__(self, backlog: int = 3):
        self.backlog = backlog
        self.busy_s = 0.0  # time the helper thread spent hashing
        self._digest = hashlib.sha256()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._pending: deque[Future] = deque()

    def _update(self, data) -> None:
        started = time.perf_counter()
        self._digest.update(data)
        self.busy_s += time.perf_counter() - started

    def update(self, data) -> None:
        """Hash ``data`` after everything handed over before; ``data`` must stay unchanged until then."""
        self._pending.append(self._thread.submit(self._update, data))
        while len(self._pending) > self.backlog:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return self._digest.hexdigest()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


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
