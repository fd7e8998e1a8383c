"""MiMo-V2-Flash's (mimo_v2_flash) rule mutations: each changes one rule value read in the wheels (or the replay's
expert-scale rename); the family's differential tests must kill it."""

from tests.benchmarks.engine_mutations import code, data

TESTS = ["tests/quant/test_engine_mimo_v2_flash.py"]

S, V = "sglang.mimo_v2_flash", "vllm.mimo_v2_flash"
QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
GATE_UP = {"gate_up_proj": ["gate_proj", "up_proj"]}
MUTATIONS = [
    data(S, "0.5.21", "quark_fused", [], {**QKV, **GATE_UP}, "mimo sglang Quark maps qkv_proj"),
    data(S, "0.5.21", "quark_fused", [], {}, "mimo sglang Quark without the loader's additions"),
    data(S, "0.5.21", "fp8_skip", ["fused"], {**QKV, **GATE_UP}, "mimo sglang FP8 with a class mapping"),
    data(S, "0.5.21", "fp8_skip", ["fallback_fused"], {}, "mimo sglang FP8 without fallback shards"),
    data(S, "0.5.21", "fp8_skip", ["match"], "exact", "mimo sglang FP8 exact match"),
    data(S, "0.5.21", "fp8_skip", ["model_prefix_variants"], False, "mimo sglang FP8 without model. variants"),
    data(S, "0.5.21", "built_fused", [], GATE_UP, "mimo sglang q/k/v apart"),
    data(S, "0.5.21", "mtp_naming", ["renames"], {}, "mimo sglang draft as stored"),
    data(S, "0.5.21", "mtp_naming", ["renames"], {"^model.mtp.layers.0.": "model.mtp_block."},
         "mimo sglang draft eh_proj under mtp_block"),
    data(S, "0.5.21", "mtp_naming", ["prefix"], "mtp.", "mimo sglang draft under mtp."),
    data(S, "0.5.21", "mtp_naming", ["max_layers"], 0, "mimo sglang builds no draft layer"),
    data(S, "0.5.21", "draft_exclude", ["mimo_v2_flash"], "nextn_mapper", "mimo sglang draft mapper"),
    data(S, "0.5.21", "eh_proj", [], "any_quant_config", "mimo sglang eh_proj with the quant config"),
    data(S, "0.5.21", "unquantized_roles", [], ["lm_head"], "mimo sglang router quantized"),
    data(S, "0.5.21", "unquantized_roles", [], ["router", "lm_head", "mtp_attention"],
         "mimo sglang MTP attention bf16"),
    data(S, "0.5.21", "router", ["bias_when"], "always", "mimo sglang router bias always"),
    data(S, "0.5.21", "router", ["reads"], [], "mimo sglang reads no router key"),
    data(S, "0.5.21", "moe_layers", [], "all", "mimo sglang every layer MoE"),
    data(S, "0.5.21", "indexer", [], {"wq_b": "bf16", "wk": "bf16", "weights_proj": "bf16",
                                      "wk_fused_bf16_on_cuda": False, "wk_dequantized": []}, "mimo sglang indexer"),
    data(S, "0.5.21", "expert_scales_renamed", ["fails"], [], "mimo sglang loads Quark MXFP4 experts"),
    data(S, "0.5.21", "expert_scales_renamed", ["fails"], ["quark", "fp8"], "mimo sglang FP8 experts renamed too"),
    data(S, "0.5.21", "expert_scales_renamed", [], None, "mimo sglang no expert-scale rename"),
    data(S, "0.5.21", "expert_scales_renamed", ["renamed"], "weight_scale_2", "mimo sglang scale renamed otherwise"),
    data(V, "0.32.0", "quark_fused", [], GATE_UP, "mimo vLLM Quark without qkv_proj"),
    data(V, "0.32.0", "fp8_skip", ["fused"], {}, "mimo vLLM FP8 without the class mapping"),
    data(V, "0.32.0", "fp8_skip", ["match"], "substring", "mimo vLLM FP8 substring match"),
    data(V, "0.32.0", "fp8_skip", ["experts"], "replace", "mimo vLLM FP8 experts replace"),
    data(V, "0.32.0", "built_fused", [], QKV, "mimo vLLM gate/up apart"),
    data(V, "0.32.0", "mtp_naming", ["renames"], {"^model.mtp.layers.0.": "model.mtp_block."},
         "mimo vLLM draft under mtp_block"),
    data(V, "0.32.0", "mtp_naming", ["prefix"], None, "mimo vLLM draft as decoder layers"),
    data(V, "0.32.0", "draft_exclude", ["mimo_v2_flash"], "mtp_any_draft_bf16", "mimo vLLM whole draft bf16"),
    data(V, "0.32.0", "eh_proj", [], "quant_config", "mimo vLLM eh_proj with Quark"),
    data(V, "0.32.0", "unquantized_roles", [], ["lm_head"], "mimo vLLM router quantized"),
    data(V, "0.32.0", "unquantized_leaves", [], None, "mimo vLLM MTP o_proj with the quant config"),
    data(V, "0.32.0", "unquantized_leaves", [], {"attention": ["o_proj"]}, "mimo vLLM every o_proj bf16"),
    data(V, "0.32.0", "unquantized_leaves", [], {"mtp_attention": ["o_proj", "qkv_proj"]},
         "mimo vLLM MTP qkv_proj bf16"),
    data(V, "0.32.0", "router", ["bias_when"], "noaux_tc", "mimo vLLM bias only for noaux_tc"),
    data(V, "0.32.0", "router", ["reads"], ["topk_method"], "mimo vLLM reads topk_method"),
    data(V, "0.32.0", "moe_layers", [], "all", "mimo vLLM every layer MoE"),
    data(V, "0.32.0", "expert_scales_renamed", [], {"fails": ["quark"], "scale": "weight_scale", "dtype": "uint8",
                                                   "renamed": "weight_scale_inv"}, "mimo vLLM renames expert scales"),
    code("quant.engines.replay", 'return rule if rule and kind in rule["fails"] else None', "return None",
         "replay ignores expert_scales_renamed"),
    code("quant.engines.replay",
         'if quantized_on_disk and em.moe and (renamed := _expert_scales_renamed(rules, kind)):',
         "if quantized_on_disk and not em.moe and (renamed := _expert_scales_renamed(rules, kind)):",
         "replay renames dense modules' scales"),
]
