"""Kimi-K3's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module). transformers 5.25 has no kimi_k3 (its kimi_linear is Kimi-Linear's text model, without
K3's full-rank KDA gate, MLA output gate, latent MoE and attention residuals), so the tensors are written
here by hand, named as both engines' loaders read the release:

- text weights under ``language_model.model.layers.N`` (sglang models/kimi_k3.py
  KimiK3ForConditionalGeneration.load_weights strips ``language_model.`` and maps ``block_sparse_moe`` to
  ``mlp``; vLLM models/kimi_k3/nvidia/model.py KimiK3ForConditionalGeneration.hf_to_vllm_mapper keeps them);
- KDA layers (``linear_attn_config.kda_layers``, 1-based) ``self_attn.{q,k,v,g,b,f_a,f_b,o}_proj``,
  ``{q,k,v}_conv1d``, ``A_log``, ``dt_bias``, ``o_norm`` (KimiLinearModel.load_weights' stacked names);
  MLA layers ``self_attn.{q_a,q_b,kv_a_proj_with_mqa,kv_b,g,o}_proj`` with ``q_a_layernorm`` /
  ``kv_a_layernorm`` (NoPE MLA with the output gate ``g_proj``, ``mla_use_output_gate``);
- the MoE block ``block_sparse_moe.{gate, experts.E.w1/w2/w3, shared_experts.*, routed_expert_down_proj,
  routed_expert_norm, routed_expert_up_proj}`` (latent MoE: the routed experts run at
  ``routed_expert_hidden_size``), the first ``first_k_dense_replace`` layers a dense ``mlp``;
- attention-residual tensors ``{self_attention,mlp}_res_{norm,proj}`` per layer and
  ``model.output_attn_res_{norm,proj}`` (``attn_res_block_size``);
- the MoonViT tower ``vision_tower.*`` and projector ``mm_projector.proj.{0,2}`` / ``post_norm``
  (sglang kimi_k3_vl.py KimiK3VisionTower / KimiK3MultiModalProjector, vLLM kimi_k25_vit.py).

The names are also the llama.cpp GGUF loader's targets (sglang model_loader/kimi_k3_gguf.py
kimi_k3_checkpoint_targets), the one place that lists a K3 layer's tensors whole."""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "language_model.model"

# the text config at Kimi-K3's kinds of layers, scaled down: two KDA layers and one MLA layer, the first
# layer dense, latent MoE with one shared expert, attention residuals every two layers
TEXT = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 384,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 32, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 0, "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.0, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "attn_res_block_size": 2, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
KDA = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "use_full_rank_gate": True}
VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
          "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_hidden_size": 32,
          "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2],
          "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm"}


def config(num_hidden_layers: int, **overrides) -> dict:
    """config.json as the release writes it (model_type kimi_k3, text_config kimi_linear): the last layer
    MLA, the others KDA (the release: three KDA layers per MLA layer)."""
    kda = [i + 1 for i in range(num_hidden_layers) if i != num_hidden_layers - 1]
    text = {**TEXT, "num_hidden_layers": num_hidden_layers, **overrides,
            "linear_attn_config": {**KDA, "kda_layers": kda,
                                   "full_attn_layers": [i + 1 for i in range(num_hidden_layers) if i + 1 not in kda]}}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "torch_dtype": "bfloat16",
            "text_config": text, "vision_config": {**VISION, "text_hidden_size": text["hidden_size"]},
            "media_placeholder_token_id": 163605, "pad_token_id": 0}


def _layer(text: dict, i: int) -> dict[str, tuple[int, ...]]:
    h, lin = text["hidden_size"], text["linear_attn_config"]
    out = {f"{n}.weight": (h,) for n in ("input_layernorm", "post_attention_layernorm")}
    if text.get("attn_res_block_size"):
        out |= {f"{n}_res_norm.weight": (h,) for n in ("self_attention", "mlp")}
        out |= {f"{n}_res_proj.weight": (1, h) for n in ("self_attention", "mlp")}
    if i + 1 in lin["kda_layers"]:
        proj, d, heads = lin["num_heads"] * lin["head_dim"], lin["head_dim"], lin["num_heads"]
        out |= {f"self_attn.{p}_proj.weight": (proj, h) for p in "qkvg"}
        out |= {f"self_attn.{p}_conv1d.weight": (proj, 1, lin["short_conv_kernel_size"]) for p in "qkv"}
        out |= {"self_attn.b_proj.weight": (heads, h), "self_attn.f_a_proj.weight": (d, h),
                "self_attn.f_b_proj.weight": (proj, d), "self_attn.A_log": (heads,), "self_attn.dt_bias": (proj,),
                "self_attn.o_norm.weight": (d,), "self_attn.o_proj.weight": (h, proj)}
    else:
        heads, q, kv = text["num_attention_heads"], text["q_lora_rank"], text["kv_lora_rank"]
        qk, v, rope = text["qk_nope_head_dim"] + text["qk_rope_head_dim"], text["v_head_dim"], text["qk_rope_head_dim"]
        out |= {"self_attn.q_a_proj.weight": (q, h), "self_attn.q_a_layernorm.weight": (q,),
                "self_attn.q_b_proj.weight": (heads * qk, q), "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
                "self_attn.kv_a_layernorm.weight": (kv,),
                "self_attn.kv_b_proj.weight": (heads * (text["qk_nope_head_dim"] + v), kv),
                "self_attn.o_proj.weight": (h, heads * v)}
        if text.get("mla_use_output_gate"):
            out["self_attn.g_proj.weight"] = (heads * v, h)
    if i < text["first_k_dense_replace"] or i % text["moe_layer_freq"]:
        inter = text["intermediate_size"]
        return out | {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                      "mlp.down_proj.weight": (h, inter)}
    inter, experts = text["moe_intermediate_size"], text["num_experts"]
    latent = text.get("routed_expert_hidden_size") or h
    moe = "block_sparse_moe."
    out |= {moe + "gate.weight": (experts, h), moe + "gate.e_score_correction_bias": (experts,)}
    for e in range(experts):
        out |= {f"{moe}experts.{e}.w1.weight": (inter, latent), f"{moe}experts.{e}.w3.weight": (inter, latent),
                f"{moe}experts.{e}.w2.weight": (latent, inter)}
    if text.get("num_shared_experts"):
        shared = inter * text["num_shared_experts"]
        out |= {f"{moe}shared_experts.{p}_proj.weight": (shared, h) for p in ("gate", "up")}
        out[moe + "shared_experts.down_proj.weight"] = (h, shared)
    if text.get("routed_expert_hidden_size"):
        out |= {moe + "routed_expert_down_proj.weight": (latent, h), moe + "routed_expert_up_proj.weight": (h, latent)}
        if text.get("latent_moe_use_norm"):
            out[moe + "routed_expert_norm.weight"] = (latent,)
    return out


def tensor_shapes(cfg: dict, layers: range | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the release ``cfg`` describes (``layers``: the decoder layers to list, default all)."""
    text, vision = cfg["text_config"], cfg["vision_config"]
    h, vocab = text["hidden_size"], text["vocab_size"]
    out = {f"{PREFIX}.embed_tokens.weight": (vocab, h), f"{PREFIX}.norm.weight": (h,),
           "language_model.lm_head.weight": (vocab, h)}
    if text.get("attn_res_block_size"):
        out |= {f"{PREFIX}.output_attn_res_norm.weight": (h,), f"{PREFIX}.output_attn_res_proj.weight": (1, h)}
    for i in layers if layers is not None else range(text["num_hidden_layers"]):
        out |= {f"{PREFIX}.layers.{i}.{rest}": shape for rest, shape in _layer(text, i).items()}
    vh, qkv, patch = vision["vt_hidden_size"], vision["qkv_hidden_size"], vision["patch_size"]
    out |= {"vision_tower.patch_embed.proj.weight": (vh, 3, patch, patch),
            "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"],
                                                        vision["init_pos_emb_width"], vh),
            "vision_tower.encoder.final_layernorm.weight": (vh,)}
    for b in range(vision["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{b}."
        out |= {block + "norm0.weight": (vh,), block + "norm1.weight": (vh,), block + "wqkv.weight": (3 * qkv, vh),
                block + "wo.weight": (vh, qkv), block + "mlp.fc0.weight": (vision["vt_intermediate_size"], vh),
                block + "mlp.fc1.weight": (vh, vision["vt_intermediate_size"])}
    merged = vh * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    return out | {"mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.2.weight": (h, merged),
                  "mm_projector.post_norm.weight": (h,)}


def write(dst, *, num_hidden_layers: int, seed: int, **overrides) -> Path:
    """The tiny release in two shards with index, config.json and tokenizer: bf16, the router bias float32."""
    import torch

    from quant.example import write_tokenizer
    from quant.safe_files import make_folder
    from tests.quant.family_checkpoints import write_shards

    cfg = config(num_hidden_layers, **overrides)
    dst = make_folder(Path(dst))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(cfg).items():
        value = torch.randn(shape, generator=gen) * 0.02
        if name.endswith("norm.weight"):
            value = value + 1
        tensors[name] = value.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
    write_shards(tensors, dst)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    text = cfg["text_config"]
    write_tokenizer(dst, text["vocab_size"], text["max_position_embeddings"])
    return dst
