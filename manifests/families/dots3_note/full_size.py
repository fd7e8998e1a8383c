"""dots.note's full-size layout for the dry-run benchmark (tests/benchmarks/family_full_size.py reads this
module): ``layout() -> (config.json, [(name, dtype, shape)])`` of the release's text model and MTP layer at
their published sizes, written as sparse files (headers, no tensor data). The omni towers (vision_encoder.*,
audio_encoder.*: plain bf16 modules both engines load apart from the quant config) are left out."""

from __future__ import annotations

# dots.note: 46 layers, DSA (MLA + indexer) on layers 0, 1 and every fourth from 1, sliding-window MLA of
# its own geometry elsewhere; the first layer dense, 256 routed experts (moe_intermediate_size 1536) + 1
# shared, top-8; one MTP layer at index 46 (sliding-window, dense MLP). These are transformers 5.25's
# Dots3NoteTextConfig defaults (its __post_init__ gives the sliding-window defaults: 64 heads, q/kv LoRA
# rank 1024, head_dim 256 = 192 nope + 64 rope, v_head_dim 128), the 256-expert geometry sglang 0.5.23's
# dots3_common/modeling.py Dots3LanguageModelForCausalLM.shared_experts_fusion_disable_reason fuses; no
# published config.json was read here.
TEXT = {"vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824, "moe_intermediate_size": 1536,
        "num_hidden_layers": 46, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "q_lora_rank": 1024, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 64, "shared_experts_intermediate_size": 1536}
SWA = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
       "head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 128}
FIRST_SPARSE = 1  # first_k_dense_replace


def _kinds(num_layers: int) -> list[str]:
    return ["full_attention" if i < 2 or i % 4 == 1 else "sliding_attention" for i in range(num_layers)]


def _release_names(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """A decoder layer's tensor as the release stores it: per-expert experts."""
    from tests.quant.family_checkpoints import per_expert

    if (experts := per_expert(rest, dtype, shape)) is not None:
        return experts
    return [(rest, dtype, shape)]


def layout() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """dots.note at full size: transformers' Dots3NoteForCausalLM on the meta device with one layer of each
    kind (DSA dense, DSA sparse, sliding sparse, sliding dense), repeated over the layers in the release's
    names; the sliding dense layer again as the MTP layer 46 with its eh_proj, enorm, hnorm and
    shared_head.norm."""
    import torch

    from tests.quant.family_checkpoints import layer_entries
    from transformers import Dots3NoteForCausalLM, Dots3NoteTextConfig

    layers = TEXT["num_hidden_layers"]
    attention = _kinds(layers)
    built = {("full_attention", "dense"): 0, ("full_attention", "sparse"): 1, ("sliding_attention", "sparse"): 2,
             ("sliding_attention", "dense"): 3}
    swa = {f"swa_{k}": v for k, v in SWA.items()}
    with torch.device("meta"):
        model = Dots3NoteForCausalLM(Dots3NoteTextConfig(**{
            **TEXT, **swa, "num_hidden_layers": 4,
            "layer_types": [a.replace("full_attention", "indexed_attention") for a, _ in built],
            "mlp_layer_types": [m for _, m in built]}))
    per_layer, out = layer_entries(model.state_dict(), "model.layers")
    h = TEXT["hidden_size"]
    for i in range(layers + 1):  # the MTP layer last: a sliding-window dense layer
        kind = ("sliding_attention", "dense") if i == layers else \
            (attention[i], "dense" if i < FIRST_SPARSE else "sparse")
        out += [(f"model.layers.{i}.{name}", d2, s2) for rest, d, s in per_layer[built[kind]]
                for name, d2, s2 in _release_names(rest, d, s)]
    out += [(f"model.layers.{layers}.{n}", "BF16", (h,)) for n in ("enorm.weight", "hnorm.weight",
                                                                   "shared_head.norm.weight")]
    out.append((f"model.layers.{layers}.eh_proj.weight", "BF16", (h, 2 * h)))
    config = {k: v for k, v in TEXT.items() if k != "shared_experts_intermediate_size"}
    config.update(model_type="dots3_note", architectures=["Dots3NoteForCausalLM"], torch_dtype="bfloat16",
                  layer_types=attention, num_nextn_predict_layers=1, first_k_dense_replace=FIRST_SPARSE,
                  moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1, topk_group=1,
                  hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=524288, sliding_window_size=512,
                  attention_gate_type="headwise", swa_attention_gate_type="headwise", language_only=True,
                  moe_shared_expert_intermediate_size=TEXT["shared_experts_intermediate_size"], **swa)
    return config, out
