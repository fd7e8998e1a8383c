"""Where compiled code is cached: the user's cache folder, never the installed package or $TMPDIR.

numba caches a kernel beside its source file unless told otherwise (inside an installed package: a
folder shared by every user, maybe read-only, left stale by an upgrade), and torch makes
``$TMPDIR/torchinductor_<user>`` as soon as ``torch._dynamo`` loads (transformers and lm-eval load it).
Both read a variable first; it is set here, unless the user set it, before either library loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path | None:
    """``$XDG_CACHE_HOME/quantgate``, else ``~/.cache/quantgate`` (a relative XDG_CACHE_HOME is
    ignored, as the XDG specification says); None without a home folder to put it in."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")  # "~" stays "~" for a user without a home
    return Path(base) / "quantgate" if os.path.isabs(base) else None


def use_user_cache() -> None:
    """Point numba's and torch's caches under ``cache_root()``; a variable the user set is kept."""
    root = cache_root()
    if root is None:  # nowhere of the user's: the libraries' own defaults
        return
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "torchinductor")
    if not os.environ.get("NUMBA_CACHE_DIR"):
        os.environ["NUMBA_CACHE_DIR"] = str(root / "numba")
        if "numba" in sys.modules:  # loaded first by the caller: numba reads its variables again only now
            sys.modules["numba"].core.config.reload_config()
