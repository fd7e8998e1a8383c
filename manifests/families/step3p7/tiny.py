"""Step-3.7-Flash's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's Step3p7ForConditionalGeneration, whose save_pretrained writes the
release's names (conversion_mapping.py "step3p7" and "step3p5_vision" reverted: model.layers.N.*, the routed
experts stacked as moe.{gate,up,down}_proj.weight, moe.gate.weight, moe.router_bias, share_expert.*,
vision_model.* with attn.in_proj_weight, vit_large_projector.weight). The MTP layers are not built
(transformers drops them on load; the tiny release has none: num_nextn_predict_layers 0)."""


def build(num_hidden_layers: int, **overrides):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    from tests.quant.family_checkpoints import TINY

    # text_config at stepfun-ai/Step-3.7-Flash's kinds of layers, scaled down: full and sliding attention
    # alternating, the first layer dense, the rest MoE with one shared expert
    text = {**TINY, "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "share_expert_dim": 32, "pad_token_id": 2, "sliding_window": 64,
            "layer_types": ["sliding_attention" if i % 2 else "full_attention" for i in range(num_hidden_layers)],
            "mlp_layer_types": ["dense"] + ["sparse"] * (num_hidden_layers - 1), **overrides}
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56,
              "patch_size": 14}
    return Step3p7Config(text_config=text, vision_config=vision), Step3p7ForConditionalGeneration


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The keys both engines' own configs read from the release's text_config under their legacy names
    (sglang configs/step3p5.py Step3p5Config.__init__: moe_num_experts, moe_top_k, share_expert_dims,
    num_attention_groups, moe_layers_enum, with defaults of the full-size model; vLLM's step3p5.py reads
    them as attributes of transformers' Step3p7TextConfig through its attribute_map, and
    use_head_wise_attn_gate, use_moe_router_bias, need_fp32_gate, which that config does not define)."""
    text = saved["text_config"]
    sparse = [str(i) for i, kind in enumerate(text["mlp_layer_types"]) if kind == "sparse"]
    text.update(moe_num_experts=text["n_routed_experts"], moe_top_k=text["num_experts_per_tok"],
                share_expert_dims=text["share_expert_dim"], num_attention_groups=text["num_key_value_heads"],
                moe_layers_enum=",".join(sparse), use_head_wise_attn_gate=True, use_moe_router_bias=True,
                need_fp32_gate=True, norm_expert_weight=True)
