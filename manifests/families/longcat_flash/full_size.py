"""LongCat-Flash's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# meituan-longcat/LongCat-Flash-Chat (560B): 28 decoder layers of two MLA sublayers and two dense MLPs each
# (ffn_hidden_size 12288) beside 512 routed experts (expert_ffn_hidden_size 2048) and 256 zero experts, top-12,
# hidden 6144, 64 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 / rope 64 / v 128, vocab 131072, one
# MTP layer under model.mtp.*. These are transformers 5.25's LongcatFlashConfig defaults; sglang 0.5.23's
# longcat_flash.py _LONGCAT_FLASH_ROUTER_HPC_GEMM_MIN_M names the same router shape for LongCat-Flash-Chat-FP8
# ("6144 hidden size, 512 routed experts + 256 zero experts"). sglang's own configs/longcat_flash.py defaults
# qk_rope_head_dim to 128, which config.json overrides (no published config.json was read here).
CONFIG = {"vocab_size": 131072, "hidden_size": 6144, "num_layers": 28, "num_attention_heads": 64,
          "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 512,
          "zero_expert_num": 256, "moe_topk": 12}


def _release_names(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """A decoder layer's tensor as the release stores it: transformers' fused experts per expert."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    return [(rest, dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """LongCat-Flash at full size: transformers' LongcatFlashForCausalLM on the meta device with one layer,
    repeated over the layers in the release's names; the MTP draft under model.mtp.* as the engines' drafts
    name it (its MLA as self_attn.0's, its dense MLP as mlps.0's)."""
    import torch

    from tests.quant.family_checkpoints import layer_entries
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    with torch.device("meta"):
        model = LongcatFlashForCausalLM(LongcatFlashConfig(**{**CONFIG, "num_layers": 1}))
    per_layer, out = layer_entries(model.state_dict(), "model.layers")
    template = [entry for rest, d, s in per_layer[0] for entry in _release_names(rest, d, s)]
    for i in range(CONFIG["num_layers"]):
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in template]
    h, mtp = CONFIG["hidden_size"], "model.mtp.layers.0."
    for rest, d, s in per_layer[0]:
        if rest.startswith("self_attn.0."):
            out.append((mtp + "self_attn." + rest[len("self_attn.0."):], d, s))
        elif rest.startswith("mlps.0."):
            out.append((mtp + "transformer_layer.mlp." + rest[len("mlps.0."):], d, s))
    out += [(mtp + n, "BF16", (h,)) for n in ("enorm.m.weight", "hnorm.m.weight", "input_layernorm.weight",
                                             "post_attention_layernorm.weight")]
    out += [(mtp + "eh_proj.weight", "BF16", (h, 2 * h)), ("model.mtp.norm.weight", "BF16", (h,)),
            ("model.mtp.embed_tokens.weight", "BF16", (CONFIG["vocab_size"], h))]
    config = LongcatFlashConfig(**CONFIG).to_dict()
    config.update(zero_expert_type="identity", mla_scale_q_lora=True, mla_scale_kv_lora=True,
                  num_nextn_predict_layers=1)
    return {**config, "architectures": ["LongcatFlashForCausalLM"], "torch_dtype": "bfloat16"}, out
