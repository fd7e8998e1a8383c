"""Qwen4-Exp's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's Qwen4ExpForConditionalGeneration, whose save_pretrained writes the
release's names (conversion_mapping.py "qwen4_exp_text" reverted: per-expert experts, the PLE n-gram
table in split_ngram_parts row shards ngram_embedding.shard_K), with the last built decoder layer moved
to the draft, mtp.layers.0.*, beside the draft's own tensors (transformers does not build the MTP module;
both engines' drafts read mtp.fc_embedding, mtp.fc_hidden, mtp.pre_fc_norm_{embedding,hidden} and
mtp.hyper_connection_mixer.*: sglang qwen4_exp_mtp.py Qwen4ExpForCausalLMMTP._init_mtp_input_fusion,
vLLM qwen4_exp/nvidia/mtp.py Qwen4ExpMultiTokenPredictor.__init__)."""

DRAFT_LAYERS = 1  # one layer more is built: the draft's


def _kinds(num_layers: int) -> list[str]:
    """Gated DeltaNet and indexed attention alternating (the release: three linear layers per attention
    layer), the last built layer (the draft's) an attention layer, as both engines build the draft."""
    kinds = ["indexed_attention" if i % 2 else "linear_attention" for i in range(num_layers)]
    kinds[-1] = "indexed_attention"
    return kinds


def build(num_hidden_layers: int, **overrides):
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    # text_config at Qwen/Qwen4-Exp's kinds of layers, scaled down: two hyper-connection streams, a PLE on
    # the first (linear) layer with a small hashed n-gram table in two shards, the QSA indexer (one key
    # head, 512 blocks per query as sglang's QSA requires, the rope inside its head), the shared expert as wide as
    # a routed one (as the release); a one-block vision tower without deepstack mergers
    text = {**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": TINY["moe_intermediate_size"], "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "layer_types": _kinds(num_hidden_layers),
            "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 64, "ngram_size": 3,
            "heads_per_ngram": 2, "ngram_vocab_size_base": 64, "make_ngram_vocab_size_divisible_by": 8,
            "split_ngram_parts": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
            "indexer_budget": 2048, "indexer_compress_ratio": 4, **overrides}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 16}
    return Qwen4ExpConfig(text_config=text, vision_config=vision, tie_word_embeddings=False), \
        Qwen4ExpForConditionalGeneration


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The last built decoder layer as the draft, mtp.layers.0.*, and the draft's own tensors beside it."""
    from tests.quant.family_checkpoints import random_tensors, renamed

    out = renamed(tensors, f"model.language_model.layers.{num_hidden_layers}.", "mtp.layers.0.")
    text = config.text_config
    h, wide, rank = text.hidden_size, text.hidden_size * text.hc_count, text.hc_lowrank
    return {**out, **random_tensors({
        "mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h),
        "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (wide,),
        "mtp.hyper_connection_mixer.hc_norm.weight": (wide,),
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (rank, wide),
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (wide, rank)}, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The draft's layer was built beside the decoder's: the release counts it apart, and writes
    full_attention for its indexed layers (transformers' Qwen4ExpTextConfig reads them as indexed_attention;
    sglang's configs/qwen4_exp.py layers_block_type takes either)."""
    text = saved["text_config"]
    kinds = ["full_attention" if k == "indexed_attention" else k for k in text["layer_types"][:num_hidden_layers]]
    text.update(num_hidden_layers=num_hidden_layers, layer_types=kinds, mtp_num_hidden_layers=1)
    text.pop("number_of_conv_states", None)  # derived by transformers, not a key of the release
