"""A fresh machine, fourth campaign: the first conversion with several workers on an empty numba
cache (a fresh clone's state), and compiled code cached in the user's cache folder, never in the
installed package or ``$TMPDIR``.

Real processes with an environment of their own: on an empty cache each worker compiles each kernel,
and numba reads its variables again before every compile.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import quant
from quant.cli import main as quantize_main

CACHE_VARIABLES = ("NUMBA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")


@pytest.fixture(scope="module")
def mxfp4(glm_ckpt, tmp_path_factory) -> Path:
    """The tiny GLM-5 checkpoint converted by one worker: the bytes two workers must write too."""
    dst = tmp_path_factory.mktemp("environment") / "mxfp4"
    assert quantize_main(["--to", "mxfp4", "-q", str(glm_ckpt), str(dst)]) == 0
    return dst


def fresh_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """This environment without the cache variables, HOME and TMPDIR in ``tmp_path``, then ``variables``."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    for name in ("home", "tmpdir"):
        (tmp_path / name).mkdir()
    return {**env, "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmpdir"), **variables}


def run_quantize(env: dict[str, str], *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "-q", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)


def shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("to", ["mxfp4", "bf16"])
def test_two_workers_on_an_empty_numba_cache(to, glm_ckpt, mxfp4, tmp_path):
    """Each worker set its numba pool's size after numba had loaded: the first compile (an empty
    cache) read the new value and numba refused it once its threads ran ("Cannot set
    NUMBA_NUM_THREADS to a different value once the threads have been launched"), so the first
    conversion of a machine with 4 or more cores (one worker per two) died; encode and decode alike."""
    cache = tmp_path / "numba"
    cache.mkdir()
    out = tmp_path / "out"
    done = run_quantize(fresh_env(tmp_path, NUMBA_CACHE_DIR=str(cache)), "--to", to, "--workers", "2",
                        glm_ckpt if to == "mxfp4" else mxfp4, out)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and (out / "conversion_manifest.json").is_file()
    assert list(cache.rglob("*.nbi")), "nothing compiled: the cache was not empty, the case was not tested"
    if to == "mxfp4":
        assert shards(out) == shards(mxfp4)  # as one worker wrote them


def test_numba_caches_in_the_user_cache_folder(mxfp4, tmp_path):
    """numba cached its kernels beside their source, inside the installed package (shared by every
    user, maybe read-only, stale after an upgrade); now under ~/.cache/quantgate, nothing in $TMPDIR."""
    env = fresh_env(tmp_path)
    package = Path(quant.__file__).parent
    started = time.time()
    done = run_quantize(env, "--to", "bf16", mxfp4, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "home" / ".cache" / "quantgate" / "numba").rglob("*.nbi"))
    assert not [p for p in package.rglob("*.nb[ic]") if p.stat().st_mtime >= started - 1]
    assert not list((tmp_path / "tmpdir").iterdir())


@pytest.mark.parametrize("given, numba, inductor", [
    ({}, "home/.cache/quantgate/numba", "home/.cache/quantgate/torchinductor"),
    ({"XDG_CACHE_HOME": "xdg"}, "xdg/quantgate/numba", "xdg/quantgate/torchinductor"),
    ({"XDG_CACHE_HOME": "relative/xdg"}, "home/.cache/quantgate/numba", "home/.cache/quantgate/torchinductor"),
    ({"NUMBA_CACHE_DIR": "mine/numba", "TORCHINDUCTOR_CACHE_DIR": "mine/inductor"}, "mine/numba", "mine/inductor"),
])
def test_cache_folders_follow_the_user(given, numba, inductor, tmp_path):
    """XDG_CACHE_HOME (when absolute, as its specification asks) over ~/.cache; a cache variable the
    user set is theirs. Seen by a converting process and by an evaluating one."""
    env = fresh_env(tmp_path, **{k: v if v.startswith("relative") else str(tmp_path / v) for k, v in given.items()})
    for package in ("quant", "evals"):
        shown = subprocess.run([sys.executable, "-c", f"import os, {package}; "
                                "print(os.environ['NUMBA_CACHE_DIR']); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"],
                               env=env, capture_output=True, text=True, check=True, cwd=tmp_path).stdout
        assert shown.split() == [str(tmp_path / numba), str(tmp_path / inductor)]
