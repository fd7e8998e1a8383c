"""Kimi-K3's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data). No config.json of the release was read (no hub access):
the sizes are the ones vLLM 0.34.0's Kimi-K3 decode kernels are written for, where they name them."""

from __future__ import annotations

# vLLM 0.34.0 models/kimi_k3/amd/specialized_decode: mono/attention/kda.py (HIDDEN 7168; KDA HD 128, NH 12 heads
# a rank at TP 8: 96 heads; NPROJ 6284 = q, k, v, g 4 x 12288 / 8 + b 96 / 8 + f_a 128), runtime/guards.py
# (MLA_HEADS 12 a rank, MLA_Q 1536, MLA_KV 512, MLA_NOPE 128, MLA_ROPE 64, MLA_V 128), mono/stages/moe.py (E 896,
# TOPK 16, LAT 3584 = routed_expert_hidden_size, RI 384 and SI 768 a rank at TP 8: moe_intermediate_size 3072,
# two shared experts' 6144); nvidia/specialized_decode/runtime/__init__.py unsupported() (situ 4.0 / 25.0, one
# expert group, sigmoid); nvidia/specialized_decode/drafter/markov.py (vocabulary 163840). The vision tower at
# sglang / vLLM configs/kimi_k3.py KimiK3VisionConfig defaults.
TEXT = {"hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 96, "num_key_value_heads": 96,
        "head_dim": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_experts": 896, "num_experts_per_token": 16, "routed_expert_hidden_size": 3584,
        "moe_intermediate_size": 3072, "num_shared_experts": 2}
KDA = {"num_heads": 96, "head_dim": 128}
VISION = {"init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4, "vt_num_attention_heads": 12,
          "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "qkv_hidden_size": 1536}
# Not named by any code read (assumed, Kimi-K2's depth and dense MLP): 61 layers, the first dense with an
# intermediate size of 18432, three KDA layers per MLA layer (as Kimi-Linear), an attention-residual block of 4.
LAYERS, FIRST_DENSE, DENSE_INTERMEDIATE, RES_BLOCK = 61, 1, 18432, 4


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """The release's tensors in the tiny checkpoint's names (tiny.py tensor_shapes), at full size."""
    from tests.quant.family_checkpoints import tiny_builder

    tiny = tiny_builder("kimi_k3")
    config = tiny.config(LAYERS, **TEXT, first_k_dense_replace=FIRST_DENSE, intermediate_size=DENSE_INTERMEDIATE,
                         attn_res_block_size=RES_BLOCK)
    config["text_config"]["linear_attn_config"].update(
        KDA, kda_layers=[i + 1 for i in range(LAYERS) if i % 4 != 3],
        full_attn_layers=[i + 1 for i in range(LAYERS) if i % 4 == 3])
    config["vision_config"].update(VISION)
    entries = [(name, "F32" if name.endswith("e_score_correction_bias") else "BF16", shape)
               for name, shape in tiny.tensor_shapes(config).items()]
    return config, entries
