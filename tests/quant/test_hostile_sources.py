"""Hostile inputs, third campaign, converter and decoder side: a source that changes after it was
planned (or under a reader that holds no lease), tiles whose amax underflows, corrupt quantized
checkpoints the decoder and ``gate checkpoint --deep`` must refuse, outputs more readable than
their sources, links planted in ``quantize --example``'s folder.

Real files, real processes: each refusal is one line naming the file or tensor, exit 2, and no
NaN, Inf or unfilled memory is ever written; files outside SRC and DST are unchanged (``outside``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import quantgate
from quant.errors import QuantgateError
from quant.example import tensor_shapes, tiny_config, write_checkpoint
from quant.outputs import INDEX_NAME, MANIFEST_NAME
from quant.safetensors_io import PARTIAL_SUFFIX, encode_header, read_header
from quant.shard import SourceReader
from tests.conftest import default_sigint, interrupt_midway, load_tensors, quantize_cmd
from tests.quant.test_hostile import gate, one_line_error, quantize, rewrite_header, src  # noqa: F401
from tests.quant.test_hostile_links import outside  # noqa: F401  (fixture)
from tests.quant.test_scale import same_checkpoint

EXPERT = "model.layers.1.mlp.experts.0.down_proj.weight"  # quantized by every format's recipe
FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8"]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "-q", *map(str, args)], capture_output=True, text=True)


def refused(out: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line, no traceback, every needle in that line."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr
    one_line_error(out.stderr, *needles)


def grow_header(path: Path, by: int = 16) -> None:
    """The same tensors, the header ``by`` bytes longer (JSON padding): every data offset moves."""
    rewrite_header(path, lambda header: header)  # re-encoded without the 8-byte alignment padding
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    body = raw[8:8 + n] + b" " * by
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


# ---- 8. quantize --example never writes through a link -------------------------------------------

@pytest.mark.parametrize("planted", ["bf16", "mxfp4"])
def test_example_refuses_links_planted_in_its_folder(planted, outside, tmp_path):  # noqa: F811
    folder = tmp_path / "example"
    folder.mkdir()
    target = tmp_path / "elsewhere"  # a folder of someone else's: must stay empty
    target.mkdir()
    (folder / planted).symlink_to(target)
    out = subprocess.run([sys.executable, "-m", "quant.cli", "-q", "--to", "mxfp4", "--example", str(folder)],
                         capture_output=True, text=True, preexec_fn=default_sigint)
    refused(out, str(folder / planted), "symbolic link")
    assert not list(target.iterdir())
    assert not (folder / ("mxfp4" if planted == "bf16" else "bf16")).exists()
