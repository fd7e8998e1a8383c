"""Shared fixtures: tiny real checkpoints and AMD Quark as the numeric oracle."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quant.example import tensor_shapes, tiny_config, write_checkpoint
from quant.safetensors_io import DTYPE_BYTES, encode_header, numel

# Module globs equivalent to the default recipe (routed experts only), in Quark's own fnmatch syntax:
# Quark quantizes every Linear weight that no pattern matches.
QUARK_DEFAULT_RECIPE_EXCLUDES = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj",
                       "*mlp.down_proj", "*shared_experts*", "*eh_proj"]


def quark_convert(src: Path, dst: Path, exclude: list[str], scale_rule: str = "even",
                  weight_only: bool = False, scheme: str = "mxfp4") -> dict:
    """Run Quark 0.13's file-to-file exporter on CPU; returns the written config.json."""
    from quark.torch import LLMTemplate
    from quark.torch.quantization.file2file_quantization import quantize_model_per_safetensor

    logging.getLogger("quark").setLevel(logging.WARNING)
    config = LLMTemplate.get("llama").get_config(scheme="mxfp4_weight_only" if weight_only else scheme,
                                                 exclude_layers=exclude)
    config.global_quant_config.weight.scale_calculation_mode = scale_rule
    quantize_model_per_safetensor(str(src), config, str(dst), device="cpu")
    return json.loads((dst / "config.json").read_text())


def load_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a checkpoint folder as (dtype, shape, raw bytes)."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensor = f.get_tensor(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()), tensor.view(torch.uint8).numpy().tobytes()
                             if tensor.numel() else b"")
    return out


@pytest.fixture(scope="session")
def glm_ckpt(tmp_path_factory) -> Path:
    """GLM-5 layout: 3 layers (1 dense, 2 MoE with 4 experts), MTP layer 3, several shards."""
    return write_checkpoint(tmp_path_factory.mktemp("glm") / "bf16", tiny_config("glm_moe_dsa"))


@pytest.fixture(scope="session")
def dsv3_ckpt(tmp_path_factory) -> Path:
    """DeepSeek-V3 layout, 4 main layers so the MTP layer sits at 4 (nothing hard-codes 78 or 61)."""
    return write_checkpoint(tmp_path_factory.mktemp("dsv3") / "bf16",
                            tiny_config("deepseek_v3", num_hidden_layers=4, first_k_dense_replace=2), seed=1)


TORCH_TO_ST = {"torch.bfloat16": "BF16", "torch.float32": "F32"}


def bytes_read() -> int:
    """Bytes this process has read through read calls so far (Linux ``/proc/self/io`` rchar). A
    headers-only pass over a full-size sparse checkpoint reads megabytes; reading its tensor data
    would read hundreds of gigabytes (of holes). Deterministic, unlike a time limit."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def write_sparse_checkpoint(dst, config, tensors_per_shard: int = 0, shards: int = 0) -> int:
    """Real headers followed by holes: a full-size layout that uses no disk. Returns bytes claimed."""
    items = [(name, TORCH_TO_ST[str(dtype)], shape) for name, (shape, dtype) in tensor_shapes(config).items()]
    per_shard = tensors_per_shard or -(-len(items) // shards)
    return write_sparse_shards(dst, config, [items[i:i + per_shard] for i in range(0, len(items), per_shard)])


def write_sparse_shards(dst, config: dict, chunks: list[list[tuple]]) -> int:
    """One shard per chunk of ``(name, safetensors dtype, shape)``: its real header, then a hole as
    long as its tensors; plus the index and config.json. Returns the bytes the shards claim."""
    dst.mkdir(parents=True)
    weight_map, claimed = {}, 0
    for i, chunk in enumerate(chunks, 1):
        file = f"model-{i:05d}-of-{len(chunks):05d}.safetensors"
        header, offsets = encode_header(chunk)
        size = max(offsets[n] + DTYPE_BYTES[d] * numel(s) for n, d, s in chunk)
        with open(dst / file, "wb") as f:
            f.write(header)
            f.truncate(size)
        claimed += size
        weight_map.update({name: file for name, _, _ in chunk})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config))
    return claimed


def quantize_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", *map(str, args)]


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test Ctrl-Cs: SIGINT back to its default, as in a user's
    terminal (a suite started in the background inherits SIGINT ignored, and so would the child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_midway(src: Path, dst: Path, sig: int, *args, on_stop=None) -> tuple[int, str]:
    """Start a conversion, and once one shard is recorded done and the next is in flight, send ``sig``.

    With ``sig`` = SIGSTOP, ``on_stop()`` runs while the process is frozen, then it continues.
    Returns the exit code and stderr.
    """
    proc = subprocess.Popen(quantize_cmd(src, dst, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)
    deadline = time.time() + 120
    progress = dst / ".quantgate-progress.json"
    while time.time() < deadline and proc.poll() is None:
        if list(dst.glob("*.safetensors.partial")) and progress.exists():
            try:
                if json.loads(progress.read_text())["shards"]:
                    break
            except (OSError, ValueError):  # replaced while we read it
                pass
        time.sleep(0.001)
    proc.send_signal(sig)
    if sig == signal.SIGSTOP:
        on_stop()
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.fixture(scope="session")
def multi_shard_ckpt(tmp_path_factory) -> Path:
    """~100 MB in 8 shards: long enough to interrupt a conversion in the middle."""
    config = tiny_config(num_hidden_layers=2, first_k_dense_replace=0, n_routed_experts=8,
                         hidden_size=1024, moe_intermediate_size=1024, intermediate_size=1024, vocab_size=384)
    return write_checkpoint(tmp_path_factory.mktemp("multi") / "bf16", config, shard_bytes=14 << 20)


@pytest.fixture(scope="session")
def multi_shard_reference(multi_shard_ckpt, tmp_path_factory) -> Path:
    """The uninterrupted conversion of ``multi_shard_ckpt``."""
    dst = tmp_path_factory.mktemp("multi_ref") / "out"
    subprocess.run(quantize_cmd(multi_shard_ckpt, dst), check=True, capture_output=True)
    return dst
