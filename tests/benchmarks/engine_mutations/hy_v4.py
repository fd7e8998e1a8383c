"""Hunyuan-V4's (hy_v4) rule mutations: each changes one rule value read in the wheels; the family's differential
tests must kill it."""

from tests.benchmarks.engine_mutations import data

TESTS = ["tests/quant/test_engine_hy_v4.py"]

S, V = "sglang.hy_v4", "vllm.hy_v4"
MLA = {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}
GATE_UP = {"gate_up_proj": ["gate_proj", "up_proj"]}
VLLM_MLA = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
FUSION = {"decided_by": "shared_experts_fusion_disable_reason", "file": "hunyuan_v4.py", "exclude_veto": "none",
          "arch": None, "draft_arch": {}, "routed_experts": "any", "shared_experts": 1,
          "min_capability": {"cuda": [8, 0]}, "ep_min_capability": {}}
MUTATIONS = [
    data(S, "0.5.20", "quark_fused", [], GATE_UP, "hy_v4 sglang Quark without the loader's MLA mapping"),
    data(S, "0.5.21", "quark_fused", [], MLA, "hy_v4 sglang 0.5.21 Quark without gate_up_proj"),
    data(S, "0.5.21", "fp8_skip", ["fused"], {**MLA, **GATE_UP}, "hy_v4 sglang FP8 with the Quark additions"),
    data(S, "0.5.20", "fp8_skip", ["match"], "substring", "hy_v4 sglang 0.5.20 FP8 substring match"),
    data(S, "0.5.21", "fp8_skip", ["fallback_fused"], {}, "hy_v4 sglang FP8 without fallback shards"),
    data(S, "0.5.20", "mtp_naming", ["renames"], {"^model.mtp_layers.0.": "model.decoder."},
         "hy_v4 sglang draft eh_proj under model.decoder"),
    data(S, "0.5.20", "mtp_naming", ["renames"], {"^model.mtp_layers.0.": "model.layers.{layer}."},
         "hy_v4 sglang draft as vLLM names it"),
    data(S, "0.5.20", "eh_proj", [], "quant_config", "hy_v4 sglang eh_proj with Quark"),
    data(S, "0.5.20", "unquantized_roles", [], ["lm_head"], "hy_v4 sglang router quantized"),
    data(S, "0.5.20", "router", ["bias_when"], "noaux_tc", "hy_v4 sglang bias from config.json's topk_method"),
    data(S, "0.5.20", "indexer", ["wk_fused_bf16_on_cuda"], False, "hy_v4 sglang wk never fused"),
    data(S, "0.5.20", "draft_exclude", ["hy_v4"], "nextn_mapper", "hy_v4 sglang draft maps the Quark list"),
    data(S, "0.5.20", "shared_experts_fusion", [], FUSION, "hy_v4 sglang fuses the shared expert"),
    data(S, "0.5.20", "exclude_mapper", [], {"kinds": ["quark", "fp8"], "style": "sglang",
                                             "substr": {"model.mtp_layers.0": "model.decoder"}},
         "hy_v4 sglang main class maps the list"),
    data(V, "0.30.0", "quark_fused", [], {**GATE_UP, **VLLM_MLA}, "hy_v4 vLLM without wk_weights_proj"),
    data(V, "0.30.0", "fp8_skip", ["fused"], GATE_UP, "hy_v4 vLLM FP8 without the class mapping"),
    data(V, "0.30.0", "fp8_skip", ["match"], "substring", "hy_v4 vLLM FP8 substring match"),
    data(V, "0.30.0", "mtp_naming", ["renames"], {"^model.mtp_layers.0.": "model.decoder."},
         "hy_v4 vLLM draft under model.decoder"),
    data(V, "0.30.0", "mtp_naming", ["prefix"], None, "hy_v4 vLLM draft not under model.mtp_layers"),
    data(V, "0.30.0", "indexer", ["wk"], "quant_config", "hy_v4 vLLM wk with the quant config"),
    data(V, "0.30.0", "indexer", ["wq_b"], "bf16", "hy_v4 vLLM wq_b bf16"),
    data(V, "0.30.0", "router", ["bias_when"], "noaux_tc", "hy_v4 vLLM bias from topk_method"),
    data(V, "0.30.0", "eh_proj", [], "quant_config", "hy_v4 vLLM eh_proj with Quark"),
    data(V, "0.30.0", "draft_exclude", ["hy_v4"], "mapper_61", "hy_v4 vLLM draft mapper"),
    data(V, "0.30.0", "exclude_mapper", [], {"kinds": ["quark", "fp8"], "style": "vllm",
                                             "prefix": {"model.mtp_layers.0.": "model.layers.3."}},
         "hy_v4 vLLM main class maps the list"),
    data(V, "0.30.0", "unquantized_roles", [], ["lm_head"], "hy_v4 vLLM router quantized"),
]
