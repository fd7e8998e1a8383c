"""Numeric formats. ``codecs`` is the registry (one codec object per ``--to`` name) and the only
module the rest of quantgate needs; ``constants`` holds the facts it is built on. The math lives
in one module per format, loaded on first use: ``mx`` (any MX element: MXFP4, MXFP6), ``mxfp4``
(the MXFP4 reference the fast kernel mirrors), ``mxfp4_fast`` (its numba kernels), ``fp8`` (block
FP8) and ``fp8_fast`` (its numba kernels, no torch); ``numba_threads`` caps a kernel call's threads."""
