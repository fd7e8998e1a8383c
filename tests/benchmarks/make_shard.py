"""A GLM-5-shaped checkpoint for benchmarks: one MoE layer with N routed experts at real dims."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.example import tiny_config

HIDDEN, MOE_INTER = 6144, 2048


def make_glm5_shard(dst: Path, experts: int = 16, shards: int = 1, seed: int = 0) -> Path:
    """``experts`` x 3 projections of 6144x2048 bf16 (~75 MB each expert), spread over ``shards`` files."""
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    per_shard = -(-experts // shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {"model.layers.3.mlp.gate.weight": torch.randn(256, HIDDEN, generator=gen)} if s == 0 else {}
        for e in range(s * per_shard, min(experts, (s + 1) * per_shard)):
            p = f"model.layers.3.mlp.experts.{e}."
            for name, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, MOE_INTER))):
                tensors[p + name + ".weight"] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = tiny_config("glm_moe_dsa", num_hidden_layers=78, first_k_dense_replace=3, n_routed_experts=256,
                         hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, intermediate_size=12288,
                         vocab_size=154880)
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args()
    make_glm5_shard(args.dst, args.experts, args.shards)
