"""gpt-oss's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# openai/gpt-oss-120b's sizes (a bf16 derivative: the release's config less its quantization_config):
# 36 layers alternating sliding (128) and full attention, 128 experts, top-4, experts stored fused
GPT_OSS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
           "sliding_window": 128, "max_position_embeddings": 131072, "tie_word_embeddings": False}
GPT_OSS_LAYERS = 36


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """gpt-oss-120b at full size: transformers' GptOssForCausalLM on the meta device with one layer
    (its state_dict names are the release's: fused experts.gate_up_proj [E, H, 2I], down_proj [E, I, H]
    and their biases), repeated over the layers."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**GPT_OSS, num_hidden_layers=1, layer_types=["sliding_attention"]))
    out, layer = [], []
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.0."):
            layer.append((name[len("model.layers.0."):], "BF16", tuple(t.shape)))
        else:
            out.append((name, "BF16", tuple(t.shape)))
    for i in range(GPT_OSS_LAYERS):
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in layer]
    kinds = ["sliding_attention", "full_attention"] * (GPT_OSS_LAYERS // 2)
    config = GptOssConfig(**GPT_OSS, num_hidden_layers=GPT_OSS_LAYERS, layer_types=kinds)
    saved = {**config.to_dict(), "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16"}
    saved.pop("quantization_config", None)
    return saved, out
