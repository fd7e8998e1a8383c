"""sha256 of files as they stream through, on a helper thread (hashlib releases the GIL).

One ``StreamHasher`` per shard serves the source reader and the output writer alike: its single
thread takes buffers in submission order, and at most ``backlog`` wait, which bounds memory and
tells callers when a buffer they handed over has been hashed (see ``SourceReader``).
"""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


class StreamHasher:
    def __init__(self, backlog: int = 2):
        self.backlog = backlog
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._pending: deque[Future] = deque()

    def new(self) -> "hashlib._Hash":
        return hashlib.sha256()

    def update(self, digest: "hashlib._Hash", data) -> None:
        self._pending.append(self._thread.submit(digest.update, data))
        while len(self._pending) > self.backlog:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
