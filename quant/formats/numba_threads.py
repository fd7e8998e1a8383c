"""How many threads a numba kernel call may use, for that call only."""

from __future__ import annotations

from contextlib import contextmanager

import numba


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
