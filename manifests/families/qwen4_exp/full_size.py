"""Qwen4-Exp's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# Qwen/Qwen4-Exp: transformers 5.25's Qwen4ExpTextConfig defaults (no published config.json was read here):
# 40 layers, every fourth an attention layer, 512 routed experts (moe_intermediate_size 512) + one shared
# expert of 512, top-10, hidden 2048, 4 hyper-connection streams of low rank 320, and the PLE n-gram table
# at its defaults (ngram_size 3, 8 heads per n-gram, 20,000,000 rows per head base, 512 shards: ~41B
# parameters per PLE layer, the "~45B" transformers' tensor-parallel plan names). Not defaults, chosen here
# and said so: the PLE on layer 1 only (ple_layer_ids [1]) and the QSA indexer's sizes (32 heads of 128,
# one key head, a budget of 2048 in blocks of 4: 512 blocks, one of the two widths sglang's
# layers/attention/qsa/config.py _parse_compressed accepts), with Qwen3.5's partial rotary factor 0.25 so
# the rope fits the index head.
TEXT = {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10, "hc_count": 4,
        "hc_lowrank": 320, "ple_layer_ids": [1], "indexer_n_heads": 32, "indexer_kv_heads": 1,
        "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": 248044}
BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")  # int64 hash tables


def _kinds(num_layers: int) -> list[str]:
    return ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def _release_names(rest: str, dtype: str, shape: tuple[int, ...], parts: int) -> list[tuple[str, str, tuple]]:
    """A decoder layer's tensor as the release stores it: per-expert experts, the n-gram table in ``parts``
    row shards (transformers' Concatenate reverted: equal chunks, the last one shorter), int64 buffers."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    if rest.endswith("ngram_embedding.weight"):
        rows = -(-shape[0] // parts)
        return [(rest.replace(".weight", f".shard_{k}.weight"), dtype, (min(rows, shape[0] - k * rows), shape[1]))
                for k in range(parts) if k * rows < shape[0]]
    if rest.rsplit(".", 1)[-1] in BUFFERS:
        return [(rest, "I64", shape)]
    return [(rest, dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Qwen4-Exp at full size: transformers' Qwen4ExpForConditionalGeneration on the meta device with one
    layer of each kind (linear with the PLE, linear, attention with the indexer), repeated over the layers in
    the release's names; the attention layer again as the draft mtp.layers.0 with the draft's own tensors."""
    import torch
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    from tests.quant.family_checkpoints import layer_entries

    layers, prefix = TEXT["num_hidden_layers"], "model.language_model.layers"
    with torch.device("meta"):
        built = Qwen4ExpConfig(text_config={**TEXT, "num_hidden_layers": 3,
                                            "layer_types": ["linear_attention", "linear_attention",
                                                            "indexed_attention"]})
        model = Qwen4ExpForConditionalGeneration(built)
    parts = built.text_config.split_ngram_parts
    per_layer, rest = layer_entries(model.state_dict(), prefix)
    out = [entry for name, d, s in rest for entry in _release_names(name, d, s, parts)]
    kinds = _kinds(layers)
    for i in range(layers):
        template = 0 if i + 1 in TEXT["ple_layer_ids"] else 2 if kinds[i] == "indexed_attention" else 1
        out += [(f"{prefix}.{i}.{name}", d2, s2) for name, d, s in per_layer[template]
                for name, d2, s2 in _release_names(name, d, s, parts)]
    out += [(f"mtp.layers.0.{name}", d2, s2) for name, d, s in per_layer[2]
            for name, d2, s2 in _release_names(name, d, s, parts)]
    h, rank = TEXT["hidden_size"], TEXT["hc_lowrank"]
    wide = h * TEXT["hc_count"]
    out += [("mtp.fc_embedding.weight", "BF16", (h, h)), ("mtp.fc_hidden.weight", "BF16", (h, h)),
            ("mtp.pre_fc_norm_embedding.weight", "BF16", (h,)), ("mtp.pre_fc_norm_hidden.weight", "BF16", (wide,)),
            ("mtp.hyper_connection_mixer.hc_norm.weight", "BF16", (wide,)),
            ("mtp.hyper_connection_mixer.input_mix_weight_down.weight", "BF16", (rank, wide)),
            ("mtp.hyper_connection_mixer.input_mix_weight_up.weight", "BF16", (wide, rank))]
    config = Qwen4ExpConfig(text_config={**TEXT, "layer_types": kinds}).to_dict()
    text = config["text_config"]
    text.update(layer_types=["full_attention" if k == "indexed_attention" else k for k in kinds],
                mtp_num_hidden_layers=1)
    text.pop("number_of_conv_states", None)
    return {**config, "architectures": ["Qwen4ExpForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
