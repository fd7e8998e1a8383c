"""How many threads numba runs: a process's pool, set once before it starts, and a kernel call's share."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numba
import numba.core.config


def size_pool(threads: int) -> None:
    """Start this process's numba pool with ``threads`` threads, whenever it starts. numba reads
    NUMBA_NUM_THREADS when it loads, and again before each compile (every kernel's first call on an
    empty cache), and refuses a value other than the one its running pool started with: so the variable
    and numba's own setting are made to agree now, before the first kernel call starts the pool."""
    os.environ["NUMBA_NUM_THREADS"] = str(threads)
    numba.core.config.reload_config()


@contextmanager
def numba_threads(count: int | None):
    """Run the kernel on ``count`` threads (None: numba's default). numba's setting belongs to the
    calling thread, so it is set for the call and put back."""
    if not count:
        yield
        return
    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(previous)
