"""LongCat-Flash's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's LongcatFlashForCausalLM, whose save_pretrained writes the release's
names (conversion_mapping.py "longcat_flash" -> "qwen2_moe" reverted: per-expert mlp.experts.E.*; two MLA
sublayers self_attn.0/1 and two dense MLPs mlps.0/1 per layer; the router mlp.router.classifier over routed
plus zero experts), plus the MTP draft the release stores under model.mtp.* (transformers does not build it;
these are the names both engines' drafts list: sglang longcat_flash_nextn.py
LongcatFlashForCausalLMNextN.load_weights weight_names_mapping, vLLM longcat_flash_mtp.py
LongCatFlashMTP.load_weights new_to_old_names_mapping)."""


def build(num_hidden_layers: int, **overrides):
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    from tests.quant.family_checkpoints import TINY

    # meituan-longcat/LongCat-Flash-Chat's kinds of layers, scaled down: MLA with a rope part, 4 routed and
    # 2 zero experts, top-2; num_layers counts decoder layers (each with two attention sublayers)
    config = {**{k: v for k, v in TINY.items() if k not in ("intermediate_size", "moe_intermediate_size",
                                                              "num_key_value_heads", "head_dim")},
              "num_layers": num_hidden_layers, "ffn_hidden_size": TINY["intermediate_size"],
              "expert_ffn_hidden_size": TINY["moe_intermediate_size"], "n_routed_experts": 4, "zero_expert_num": 2,
              "moe_topk": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
              "head_dim": 16, "v_head_dim": 32, **overrides}
    return LongcatFlashConfig(**config), LongcatFlashForCausalLM


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The MTP draft under model.mtp.*: one MLA sublayer and one dense MLP shaped as a decoder layer's, its
    eh_proj, enorm.m / hnorm.m, final norm and embedding."""
    from tests.quant.family_checkpoints import random_tensors

    h = config.hidden_size
    shapes = {"model.mtp.layers.0.eh_proj.weight": (h, 2 * h), "model.mtp.layers.0.enorm.m.weight": (h,),
              "model.mtp.layers.0.hnorm.m.weight": (h,), "model.mtp.layers.0.input_layernorm.weight": (h,),
              "model.mtp.layers.0.post_attention_layernorm.weight": (h,), "model.mtp.norm.weight": (h,),
              "model.mtp.embed_tokens.weight": (config.vocab_size, h)}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.0.self_attn.0."):
            shapes["model.mtp.layers.0.self_attn." + name[len("model.layers.0.self_attn.0."):]] = tuple(tensor.shape)
        elif name.startswith("model.layers.0.mlps.0."):
            shapes["model.mtp.layers.0.transformer_layer.mlp." + name[len("model.layers.0.mlps.0."):]] = \
                tuple(tensor.shape)
    return {**tensors, **random_tensors(shapes, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The keys the release's config.json carries that transformers' config does not define: vLLM's
    LongcatMoe asserts config.zero_expert_type and (0.32.0 on) scale_mla_lora_norms_on_load reads
    config.mla_scale_q_lora / mla_scale_kv_lora, attributes of transformers' config; sglang's own
    LongcatFlashConfig defaults them (identity, True, True); one MTP layer."""
    saved.update(num_layers=num_hidden_layers, zero_expert_type="identity", mla_scale_q_lora=True,
                 mla_scale_kv_lora=True, num_nextn_predict_layers=1)
