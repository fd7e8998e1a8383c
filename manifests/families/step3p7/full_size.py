"""Step-3.7-Flash's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release at its published sizes,
written as sparse files (headers, no tensor data)."""

from __future__ import annotations

# stepfun-ai/Step-3.7-Flash's text model: transformers 5.25's Step3p7TextConfig defaults, the same as sglang
# 0.5.23's configs/step3p5.py Step3p5Config defaults (hidden 4096, intermediate 11264, 45 layers, 64 heads of
# 128, 8 key-value groups, vocabulary 128815, 288 routed experts of 1280, top-8, one shared expert of 1280,
# moe_layers_enum 3..44: the first three layers dense). The vision tower: Step3p7VisionConfig's defaults (a
# 47-block perception encoder, width 1536, MLP 8960, 728-pixel images in 14-pixel patches), the same as
# sglang's configs/step3p7.py Step3p7VisionEncoderConfig. The release's three MTP layers are left out: this
# folder does not replay the draft (NOTES.md beside this file). No published config.json was read here.
TEXT = {"vocab_size": 128815, "hidden_size": 4096, "intermediate_size": 11264, "num_hidden_layers": 45,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "moe_intermediate_size": 1280,
        "n_routed_experts": 288, "num_experts_per_tok": 8, "share_expert_dim": 1280}
FIRST_SPARSE = 3
VISION = {"hidden_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 16, "image_size": 728,
          "patch_size": 14}


def _layer(i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """Decoder layer i under the release's names (as tiny.py's checkpoint stores them)."""
    h, heads, kv, hd = TEXT["hidden_size"], TEXT["num_attention_heads"], TEXT["num_key_value_heads"], TEXT["head_dim"]
    p = f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", "BF16", (h,)), (p + "post_attention_layernorm.weight", "BF16", (h,)),
           (p + "self_attn.q_proj.weight", "BF16", (heads * hd, h)),
           (p + "self_attn.k_proj.weight", "BF16", (kv * hd, h)), (p + "self_attn.v_proj.weight", "BF16", (kv * hd, h)),
           (p + "self_attn.o_proj.weight", "BF16", (h, heads * hd)),
           (p + "self_attn.g_proj.weight", "BF16", (heads, h)), (p + "self_attn.q_norm.weight", "BF16", (hd,)),
           (p + "self_attn.k_norm.weight", "BF16", (hd,))]
    if i < FIRST_SPARSE:
        inter = TEXT["intermediate_size"]
        return out + [(p + "mlp.gate_proj.weight", "BF16", (inter, h)), (p + "mlp.up_proj.weight", "BF16", (inter, h)),
                      (p + "mlp.down_proj.weight", "BF16", (h, inter))]
    e, mi, si = TEXT["n_routed_experts"], TEXT["moe_intermediate_size"], TEXT["share_expert_dim"]
    return out + [(p + "moe.gate.weight", "BF16", (e, h)), (p + "moe.router_bias", "F32", (e,)),
                  (p + "moe.gate_proj.weight", "BF16", (e, mi, h)), (p + "moe.up_proj.weight", "BF16", (e, mi, h)),
                  (p + "moe.down_proj.weight", "BF16", (e, h, mi)),
                  (p + "share_expert.gate_proj.weight", "BF16", (si, h)),
                  (p + "share_expert.up_proj.weight", "BF16", (si, h)),
                  (p + "share_expert.down_proj.weight", "BF16", (h, si))]


def _vision() -> list[tuple[str, str, tuple[int, ...]]]:
    w, inter, patch = VISION["hidden_size"], int(VISION["hidden_size"] * 8960 / 1536), VISION["patch_size"]
    out = [("vision_model.conv1.weight", "BF16", (w, 3, patch, patch)), ("vision_model.ln_pre.weight", "BF16", (w,)),
           ("vision_model.ln_pre.bias", "BF16", (w,)),
           ("vision_model.positional_embedding", "BF16", ((VISION["image_size"] // patch) ** 2, w)),
           ("vision_model.vit_downsampler1.weight", "BF16", (2 * w, w, 3, 3)),
           ("vision_model.vit_downsampler1.bias", "BF16", (2 * w,)),
           ("vision_model.vit_downsampler2.weight", "BF16", (4 * w, 2 * w, 3, 3)),
           ("vision_model.vit_downsampler2.bias", "BF16", (4 * w,)),
           ("vit_large_projector.weight", "BF16", (TEXT["hidden_size"], 4 * w))]
    for b in range(VISION["num_hidden_layers"]):
        p = f"vision_model.transformer.resblocks.{b}."
        out += [(p + "attn.in_proj_weight", "BF16", (3 * w, w)), (p + "attn.in_proj_bias", "BF16", (3 * w,)),
                (p + "attn.out_proj.weight", "BF16", (w, w)), (p + "attn.out_proj.bias", "BF16", (w,)),
                (p + "mlp.c_fc.weight", "BF16", (inter, w)), (p + "mlp.c_fc.bias", "BF16", (inter,)),
                (p + "mlp.c_proj.weight", "BF16", (w, inter)), (p + "mlp.c_proj.bias", "BF16", (w,))]
        out += [(p + f"{n}.{k}", "BF16", (w,)) for n in ("ln_1", "ln_2") for k in ("weight", "bias")]
        out += [(p + f"ls_{n}.gamma", "BF16", (w,)) for n in (1, 2)]
    return out


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Step-3.7-Flash at full size: every decoder layer, the vision tower and the projector by name."""
    import importlib.util
    from pathlib import Path

    from transformers import Step3p7Config

    # the legacy text_config keys the engines read, as tiny.py (beside this file) writes them
    spec = importlib.util.spec_from_file_location("step3p7_tiny", Path(__file__).with_name("tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)

    layers, h, v = TEXT["num_hidden_layers"], TEXT["hidden_size"], TEXT["vocab_size"]
    out = [("model.embed_tokens.weight", "BF16", (v, h)), ("model.norm.weight", "BF16", (h,)),
           ("lm_head.weight", "BF16", (v, h))]
    out += [entry for i in range(layers) for entry in _layer(i)] + _vision()
    mlp = ["dense" if i < FIRST_SPARSE else "sparse" for i in range(layers)]
    config = Step3p7Config(text_config={**TEXT, "mlp_layer_types": mlp}, vision_config=VISION).to_dict()
    tiny.release_config(config, None, layers)
    return {**config, "architectures": ["Step3p7ForConditionalGeneration"], "torch_dtype": "bfloat16"}, out
