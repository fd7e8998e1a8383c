"""LongCat-Flash's (longcat_flash) rule mutations: each changes one rule value read in the wheels (or the replay's
draft-layer index); the family's differential tests must kill it."""

from tests.benchmarks.engine_mutations import code, data

TESTS = ["tests/quant/test_engine_longcat_flash.py"]

S, V = "sglang.longcat_flash", "vllm.longcat_flash"
MLA = {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}
GATE_UP = {"gate_up_proj": ["gate_proj", "up_proj"]}
MUTATIONS = [
    data(S, "0.5.9", "quark_fused", [], {}, "longcat sglang Quark without __init__'s MLA mapping"),
    data(S, "0.5.9", "quark_fused", [], {**MLA, **GATE_UP}, "longcat sglang 0.5.9 loader adds gate_up_proj"),
    data(S, "0.5.11", "quark_fused", [], MLA, "longcat sglang 0.5.11 loader adds nothing"),
    data(S, "0.5.11", "fp8_skip", ["fused"], MLA, "longcat sglang FP8 keeps the class's mapping"),
    data(S, "0.5.11", "fp8_skip", ["fallback_fused"], {}, "longcat sglang FP8 without fallback shards"),
    data(S, "0.5.11", "fp8_skip", ["match"], "substring", "longcat sglang FP8 substring match"),
    data(S, "0.5.10", "fp8_skip", ["model_prefix_variants"], False,
         "longcat sglang 0.5.10 FP8 without model. variants"),
    data(S, "0.5.9", "fp8_skip", ["fused"], MLA, "longcat sglang 0.5.9 FP8 with a mapping"),
    data(S, "0.5.9", "built_fused", [], GATE_UP, "longcat sglang MLA q_a / kv_a apart"),
    data(S, "0.5.9", "mtp_naming", ["renames"], {"^model.mtp.layers.0.": "model.decoder."},
         "longcat sglang draft under model.decoder"),
    data(S, "0.5.9", "mtp_naming", ["renames"], {"^model.mtp.layers.0.": ""}, "longcat sglang draft MLP as stored"),
    data(S, "0.5.9", "mtp_naming", ["max_layers"], None, "longcat sglang builds every draft layer"),
    data(S, "0.5.9", "eh_proj", [], "plain", "longcat sglang eh_proj plain"),
    data(S, "0.5.9", "eh_proj", [], "quant_config", "longcat sglang eh_proj with Quark only"),
    data(S, "0.5.9", "unquantized_roles", [], ["lm_head"], "longcat sglang router quantized"),
    data(S, "0.5.9", "router", ["bias_when"], "noaux_tc", "longcat sglang bias only for noaux_tc"),
    data(S, "0.5.9", "router", ["reads"], ["zero_expert_type"], "longcat sglang reads zero_expert_type"),
    data(S, "0.5.9", "moe_layers", [], "config", "longcat sglang MoE layers from the config"),
    data(S, "0.5.9", "draft_exclude", ["longcat_flash"], "nextn_mapper", "longcat sglang draft mapper"),
    data(V, "0.16.0", "quark_fused", [], {**GATE_UP, "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "longcat vLLM maps fused_qkv_a_proj"),
    data(V, "0.16.0", "built_fused", [], GATE_UP, "longcat vLLM MLA q_a / kv_a apart"),
    data(V, "0.16.0", "fp8_skip", ["fused"], {}, "longcat vLLM FP8 without the class mapping"),
    data(V, "0.16.0", "fp8_skip", ["fused_first"], True, "longcat vLLM 0.16 FP8 fused name first"),
    data(V, "0.24.0", "fp8_skip", ["match"], "substring", "longcat vLLM FP8 substring match"),
    data(V, "0.16.0", "mtp_naming", ["layer_times"], 1, "longcat vLLM draft at layer num_layers"),
    data(V, "0.32.0", "mtp_naming", ["layer_times"], 1, "longcat vLLM 0.32 draft at layer num_layers"),
    data(V, "0.16.0", "mtp_naming", ["renames"], {"^model.mtp.layers.0.": "model.layers.{layer}."},
         "longcat vLLM draft MLP and eh_proj as stored"),
    data(V, "0.16.0", "mtp_naming", ["max_layers"], None, "longcat vLLM builds every draft layer"),
    data(V, "0.16.0", "eh_proj", [], "plain", "longcat vLLM eh_proj plain"),
    data(V, "0.16.0", "unquantized_roles", [], ["lm_head"], "longcat vLLM router quantized"),
    data(V, "0.32.0", "router", ["reads"], [], "longcat vLLM zero_expert_type not read"),
    data(V, "0.16.0", "router", ["bias_when"], "never", "longcat vLLM router without bias"),
    data(V, "0.16.0", "moe_layers", [], "config", "longcat vLLM MoE layers from the config"),
    data(V, "0.16.0", "draft_exclude", ["longcat_flash"], "mapper_61", "longcat vLLM draft mapper"),
    code("quant.engines.replay", 'naming.get("layer_times", 1)', "1", "replay ignores the draft's layer_times"),
]
