"""Shared fixtures: tiny real checkpoints and AMD Quark as the numeric oracle."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quant.example import tiny_config, write_checkpoint

# Module globs equivalent to the seed recipe (routed experts only), in Quark's own fnmatch syntax:
# Quark quantizes every Linear weight that no pattern matches.
QUARK_SEED_EXCLUDES = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj",
                       "*mlp.down_proj", "*shared_experts*", "*eh_proj"]


def quark_convert(src: Path, dst: Path, exclude: list[str], scale_rule: str = "even",
                  weight_only: bool = False) -> dict:
    """Run Quark 0.13's file-to-file exporter on CPU; returns the written config.json."""
    from quark.torch import LLMTemplate
    from quark.torch.quantization.file2file_quantization import quantize_model_per_safetensor

    logging.getLogger("quark").setLevel(logging.WARNING)
    config = LLMTemplate.get("llama").get_config(scheme="mxfp4_weight_only" if weight_only else "mxfp4",
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
