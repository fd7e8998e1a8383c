"""dots.note's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint reads
this module): transformers 5.25's Dots3NoteForCausalLM (the text model) saved, whose names are the release's
(no conversion mapping renames its text weights: per-expert experts, self_attn.g_proj, indexer.* as stored),
which both engines' loaders read (sglang dots3_common/modeling.py Dots3LanguageModelForCausalLM.load_weights,
vLLM nvidia/multimodal.py Dots3NoteForCausalLM.hf_to_vllm_mapper: model. -> language_model.model.). The
MTP layer is built as decoder layer num_hidden_layers (a sliding-window layer with a dense MLP, as both
engines build it: sglang Dots3DecoderLayer._is_layer_sparse is False for is_nextn, vLLM
Dots3NoteDecoderLayer.__init__ is MoE only below num_hidden_layers) with its eh_proj, enorm, hnorm and
shared_head.norm beside it. config.json is the release's flat form (sglang's configs/dots3.py Dots3Config
keys: full_attention / sliding_attention layer_types, swa_* geometry) with language_only set: the omni
towers (vision_encoder.*, audio_encoder.*: plain torch modules both engines load apart from the quant
config) are left out of the tiny checkpoint."""

DRAFT_LAYERS = 1  # the MTP layer at index num_hidden_layers: a sliding-window layer with a dense MLP
ARCHITECTURE = "Dots3NoteForCausalLM"

# the sliding-window layers' own MLA geometry, smaller than the DSA layers' as in the release
SWA = {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}


def _swa() -> dict:
    """The swa_* keys: SWA and its head_dim (transformers checks it is nope + rope)."""
    return {**SWA, "head_dim": SWA["qk_nope_head_dim"] + SWA["qk_rope_head_dim"]}


def _kinds(num_layers: int) -> tuple[list[str], list[str]]:
    """Attention and MLP kind per built layer: DSA on the first two and every fourth from layer 1 (the
    release's schedule: transformers' Dots3NoteTextConfig default), sliding-window elsewhere; the first
    layer dense; the last built layer (the MTP layer) sliding-window and dense."""
    attention = ["indexed_attention" if i < 2 or i % 4 == 1 else "sliding_attention" for i in range(num_layers)]
    mlp = ["dense"] + ["sparse"] * (num_layers - 1)
    attention[-1], mlp[-1] = "sliding_attention", "dense"
    return attention, mlp


def build(num_hidden_layers: int, **overrides):
    from transformers import Dots3NoteForCausalLM, Dots3NoteTextConfig

    from tests.quant.family_checkpoints import TINY

    attention, mlp = _kinds(num_hidden_layers)
    swa = {f"swa_{k}": v for k, v in _swa().items()}
    text = {**TINY, "head_dim": 48, "num_key_value_heads": TINY["num_attention_heads"], "pad_token_id": 2,
            "num_hidden_layers": num_hidden_layers, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2,
            "shared_experts_intermediate_size": TINY["moe_intermediate_size"], "layer_types": attention,
            "mlp_layer_types": mlp, **swa, **overrides}
    return Dots3NoteTextConfig(**text), Dots3NoteForCausalLM


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    """The MTP layer's own tensors beside its decoder layer."""
    from tests.quant.family_checkpoints import random_tensors

    h = config.hidden_size
    p = f"model.layers.{num_hidden_layers}."
    return {**tensors, **random_tensors({p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,),
                                         p + "hnorm.weight": (h,), p + "shared_head.norm.weight": (h,)}, seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """config.json as the release writes it: flat, model_type dots3_note, DSA layers named full_attention
    (transformers reads them back as indexed_attention: use_dsa), the sliding-window geometry as swa_* keys,
    the MoE schedule as first_k_dense_replace (sglang's Dots3Config has no mlp_layer_types), the router's
    topk_method / scoring_func, which both engines read as attributes."""
    for key in ("per_layer_config", "mlp_layer_types", "rope_parameters", "sliding_window", "head_dim"):
        saved.pop(key, None)
    saved.update(model_type="dots3_note", num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=1,
                 layer_types=[kind.replace("indexed_attention", "full_attention")
                              for kind in config.layer_types[:num_hidden_layers]],
                 first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
                 sliding_window_size=512, rope_theta=80_000_000.0, swa_rope_theta=50_000.0,
                 attention_gate_type="headwise", swa_attention_gate_type="headwise", language_only=True,
                 **{f"swa_{k}": v for k, v in _swa().items()})
    # the towers' configs, which transformers' Dots3NoteConfig checks against the text width (their weights
    # are not in the tiny checkpoint: language_only)
    h = config.hidden_size
    saved.update(vision_config={"hidden_size": 32, "adapter_in_dim": 32, "adapter_out_dim": h, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "mlp_layer_types": ["dense"]},
                 audio_config={"hidden_size": 32, "adapter_input_size": 32, "adapter_out_dim": h,
                               "num_hidden_layers": 1, "num_attention_heads": 2})
