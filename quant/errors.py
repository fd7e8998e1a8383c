"""Errors of the conversion step, importable without loading the converter's numeric kernels,
and the project's error base, which carries the exit code a command returns for it.

Every error a user can cause, in any module, derives from ``QuantgateError``: ``quantize``, ``gate``
and ``evals`` catch that base alone and return its ``exit_code``, so a new error needs no command
changed (tests/test_errors.py walks every module's exception classes to keep it so)."""


class QuantgateError(Exception):
    """A user-facing error: the message says what is wrong and what to do; ``exit_code`` is what a
    command returns for it (2: bad input or a refused request, unless a subclass says otherwise)."""

    exit_code = 2


class ConvertError(QuantgateError, RuntimeError):
    """The conversion cannot proceed; nothing under a final name is incomplete."""


class DiskFullError(ConvertError):
    """Out of space: finished shards are kept, ``--resume`` completes the job once space is freed."""

    exit_code = 1  # the input was fine: the run failed, and freeing space then --resume finishes it


class NonFiniteError(QuantgateError, ValueError):
    """A weight to quantize holds NaN or Inf; the message names the tensor, row and column."""


class CheckpointError(QuantgateError, ValueError):
    """A checkpoint folder that cannot be read safely (exit code 2); the message names the file and the fix."""


class UnsafeFileError(ConvertError):
    """A file quantgate will not write or read as it is: a link where it writes, a FIFO or device
    where it reads, a file far too large (exit code 2); the message names the path and the fix."""


class SourceError(ConvertError):
    """A source shard whose bytes cannot be converted as planned: changed since it was planned,
    changed or truncated while it was read, or holding values its format forbids (exit code 2);
    the message names the file or tensor and the fix. Nothing under a final name is incomplete."""
