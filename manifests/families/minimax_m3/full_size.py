"""MiniMax-M3's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations


# MiniMaxAI/MiniMax-M3: 60 layers (3 dense, full attention; 57 MoE with sparse attention), 128
# routed + 1 shared experts, top-4, one MTP module; a 32-layer CLIP vision tower (transformers' defaults)
M3_TEXT = {"vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288,
           "shared_intermediate_size": 3072, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
           "num_local_experts": 128, "num_experts_per_tok": 4, "index_n_heads": 4, "index_head_dim": 128}
M3_LAYERS, M3_DENSE = 60, 3


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """MiniMax-M3 at full size: transformers' MiniMaxM3SparseForConditionalGeneration on the meta
    device with one dense, one MoE and one MTP-template layer, its names reverted to the release's by
    transformers' own revert_weight_conversion (what save_pretrained writes), repeated over the layers."""
    import torch
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import layer_entries, tiny_builder

    kinds = ["dense", "sparse", "sparse"]  # layer 0: dense; 1: MoE; 2: the MTP module's template
    text = {**M3_TEXT, "num_hidden_layers": 3, "mlp_layer_types": kinds,
            "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]}
    config = MiniMaxM3VLConfig(text_config=text, vision_config={}, projector_hidden_size=6144)
    with torch.device("meta"):
        model = MiniMaxM3SparseForConditionalGeneration(config)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    per_layer, out = layer_entries(state, "language_model.model.layers")
    for i in range(M3_LAYERS):
        out += [(f"language_model.model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[0 if i < M3_DENSE else 1]]
    h, mtp = M3_TEXT["hidden_size"], "language_model.model.mtp.layers.0."
    out += [(mtp + "transformer_layer." + rest, d, s) for rest, d, s in per_layer[2]]
    out += [(mtp + "eh_proj.weight", "BF16", (h, 2 * h))] + [(mtp + f"{n}.weight", "BF16", (h,))
                                                            for n in ("enorm", "hnorm", "final_layernorm")]
    saved = {**config.to_dict(), "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
             "torch_dtype": "bfloat16"}
    freq = ["dense"] * M3_DENSE + ["sparse"] * (M3_LAYERS - M3_DENSE)
    saved["text_config"].update(num_hidden_layers=M3_LAYERS, mlp_layer_types=freq, layer_types=list(freq))
    tiny_builder("minimax_m3").release_config(saved, None, M3_LAYERS)
    return saved, out
