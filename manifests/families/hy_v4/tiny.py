"""Hunyuan-V4's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint
reads this module): transformers 5.25's HYV4ForCausalLM builds the decoder, saved under the names both
engines' loaders read (sglang models/hunyuan_v4.py HYV4ForCausalLM.load_weights, vLLM models/hy_v4/nvidia/
model.py HYV4Model.load_weights; conversion_mapping.py "hy_v4" maps them to transformers' own). transformers
does not give those names back on save: its rename of linear_gate to gate_proj, reverted, also renames the
dense MLP's and shared expert's gate_proj to linear_gate, the hyper-connections' hc_pre lands before the layer
part, and the routed experts stay fused (both loaders read them per expert: sglang's DeepseekV2 loader
only so). ``release`` puts the release's names back. The MTP layer (transformers does not build it) is a
decoder layer built past the others, stored as model.mtp_layers.0.* without hyper-connections (vLLM
nvidia/mtp.py: "MTP checkpoints do not carry iHC pre/post weights") beside eh_proj, enorm, hnorm and
final_layernorm (sglang hunyuan_v4_nextn.py HYV4ForCausalLMNextN.load_weights)."""

import re

DRAFT_LAYERS = 1  # the MTP layer: an MLA + MoE layer with a full indexer (sglang builds one for is_nextn)


def _indexer_types(num_layers: int) -> list[str]:
    """transformers' and the engines' default (full on layer 0 and every fourth from 1), the MTP layer full."""
    kinds = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(num_layers)]
    return kinds[:-1] + ["full"]


def build(num_hidden_layers: int, **overrides):
    from transformers import HYV4Config, HYV4ForCausalLM

    from tests.quant.family_checkpoints import TINY

    # tencent/Hy4-preview's kinds of layers scaled down: MLA with a rope part the indexer head holds, as many
    # key-value heads as heads (the config forces it), the first layer dense, four hyper-connection streams
    text = {**TINY, "num_key_value_heads": TINY["num_attention_heads"], "pad_token_id": 2,
            "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "index_topk": 16, "index_head_dim": 32, "index_n_heads": 2,
            "hc_mult": 4, "indexer_types": _indexer_types(num_hidden_layers),
            "mlp_layer_types": ["dense"] + ["sparse"] * (num_hidden_layers - 1), **overrides}
    return HYV4Config(**text), HYV4ForCausalLM


# transformers' names as saved -> the release's
_RENAMES = [(re.compile(r"\.hc_pre\.(hc_(attn|mlp)_layer)\.hc_"), r".\1.hc_pre.hc_"),
            (re.compile(r"^model\.hc_pre\.hc_head\."), "model.hc_head."),
            (re.compile(r"\.mlp\.(shared_experts\.)?linear_gate\."), r".mlp.\1gate_proj.")]


def release_name(name: str) -> str:
    for pattern, new in _RENAMES:
        name = pattern.sub(new, name)
    return name


def per_expert(name: str, tensor) -> dict:
    """A fused experts tensor ([E, 2I, H] gate then up, or [E, H, I] down) as the release's per-expert weights."""
    prefix, part = name.rsplit(".", 1)
    if part == "gate_up_proj":
        half = tensor.shape[1] // 2
        return {f"{prefix}.{e}.{proj}.weight": rows.contiguous() for e in range(tensor.shape[0])
                for proj, rows in (("gate_proj", tensor[e, :half]), ("up_proj", tensor[e, half:]))}
    return {f"{prefix}.{e}.down_proj.weight": tensor[e].contiguous() for e in range(tensor.shape[0])}


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The release's names; the last built layer as the MTP layer model.mtp_layers.0.* with its own tensors."""
    from tests.quant.family_checkpoints import random_tensors

    out = {}
    draft = f"model.layers.{num_hidden_layers}."
    for name, tensor in tensors.items():
        name = release_name(name)
        if name.startswith(draft):
            if ".hc_" in name:
                continue
            name = "model.mtp_layers.0." + name[len(draft):]
        out.update(per_expert(name, tensor) if name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
                   else {name: tensor})
    h = config.hidden_size
    p = "model.mtp_layers.0."
    return {**out, **random_tensors({p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,),
                                     p + "hnorm.weight": (h,), p + "final_layernorm.weight": (h,)}, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The MTP layer counted apart, and the release's keys transformers' config does not keep: both engines'
    own HYV4Config read enable_ihc, gated_mla, gating_type, learnable_sink (vLLM's decoder layer runs without
    hyper-connections where enable_ihc is missing) and num_nextn_predict_layers."""
    saved.update(num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=1, enable_ihc=True, gated_mla=True,
                 gating_type="elementwise", learnable_sink=True, enable_lm_head_fp32=True)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        saved[key] = saved[key][:num_hidden_layers]
