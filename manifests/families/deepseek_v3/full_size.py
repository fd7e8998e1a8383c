"""DeepSeek-V3's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads
this module): ``layout() -> (config.json, [(name, dtype, shape)])`` at deepseek-ai/DeepSeek-V3's
published sizes (61 layers, 3 dense, 256 routed + 1 shared experts, top-8 in 8 groups, one MTP layer),
named and shaped as quant.example writes the family (a test checks those against transformers)."""

from __future__ import annotations


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    from quant.example import tensor_shapes, tiny_config

    config = tiny_config("deepseek_v3", num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
                         hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, vocab_size=129280)
    config.update({"num_attention_heads": 128, "num_key_value_heads": 128, "num_experts_per_tok": 8,
                   "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                   "qk_nope_head_dim": 128, "qk_head_dim": 192, "v_head_dim": 128, "head_dim": 64,
                   "max_position_embeddings": 163840})
    return config, [(name, "F32" if str(dtype) == "torch.float32" else "BF16", tuple(shape))
                    for name, (shape, dtype) in tensor_shapes(config).items()]
