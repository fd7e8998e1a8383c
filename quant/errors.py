"""Errors of the conversion step, importable without loading the converter's numeric kernels."""


class ConvertError(RuntimeError):
    """The conversion cannot proceed; nothing under a final name is incomplete."""


class DiskFullError(ConvertError):
    """Out of space: finished shards are kept, ``--resume`` completes the job once space is freed."""


class NonFiniteError(ValueError):
    """A weight to quantize holds NaN or Inf; the message names the tensor, row and column."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read safely (exit code 2); the message names the file and the fix."""
