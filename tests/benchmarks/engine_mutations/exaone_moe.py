"""K-EXAONE's (exaone_moe) rule mutations: each changes one rule value read in the wheels; the family's
differential tests must kill it."""

from tests.benchmarks.engine_mutations import data

TESTS = ["tests/quant/test_engine_exaone_moe.py"]

S, V = "sglang.exaone_moe", "vllm.exaone_moe"
MUTATIONS = [
    data(S, "0.5.11", "quark_fused", [], {}, "exaone sglang Quark without the loader's additions"),
    data(S, "0.5.11", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                          "gate_up_proj": ["gate_proj", "up_proj"],
                                          "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "exaone sglang Quark expands qkv_proj"),
    data(S, "0.5.9", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]}, "exaone sglang q/k/v apart"),
    data(S, "0.5.11", "fp8_skip", ["fused"], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "exaone sglang FP8 with a class mapping"),
    data(S, "0.5.11", "fp8_skip", ["fallback_fused"], {}, "exaone sglang FP8 without fallback shards"),
    data(S, "0.5.11", "fp8_skip", ["match"], "substring", "exaone sglang FP8 substring match"),
    data(S, "0.5.9", "mtp_naming", ["renames"], {}, "exaone sglang draft keeps mtp.*"),
    data(S, "0.5.9", "mtp_naming", ["renames"], {"^mtp.": "model."}, "exaone sglang draft model.fc"),
    data(S, "0.5.9", "mtp_naming", ["max_layers"], None, "exaone sglang builds every draft layer"),
    data(S, "0.5.9", "eh_proj", [], "quant_config", "exaone sglang fc with the quant config"),
    data(S, "0.5.9", "draft_exclude", ["exaone_moe"], "nextn_mapper", "exaone sglang draft mapper"),
    data(S, "0.5.9", "unquantized_roles", [], ["lm_head"], "exaone sglang router quantized"),
    data(S, "0.5.9", "router", ["bias_when"], "never", "exaone sglang router without bias"),
    data(S, "0.5.9", "router", ["reads"], [], "exaone sglang is_moe_layer not read"),
    data(S, "0.5.9", "moe_layers", [], "all", "exaone sglang every layer MoE"),
    data(V, "0.32.0", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, "exaone vLLM no gate_up_proj"),
    data(V, "0.32.0", "built_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, "exaone vLLM gate/up apart"),
    data(V, "0.32.0", "fp8_skip", ["fused"], {}, "exaone vLLM FP8 without the class mapping"),
    data(V, "0.32.0", "fp8_skip", ["match"], "substring", "exaone vLLM FP8 substring match"),
    data(V, "0.32.0", "mtp_naming", ["renames"], {"^mtp.": "model."}, "exaone vLLM draft renamed model.*"),
    data(V, "0.32.0", "mtp_naming", ["max_layers"], 1, "exaone vLLM one draft layer at most"),
    data(V, "0.32.0", "eh_proj", [], "plain", "exaone vLLM fc plain"),
    data(V, "0.32.0", "draft_exclude", ["exaone_moe"], "mapper_61", "exaone vLLM draft mapper"),
    data(V, "0.32.0", "unquantized_roles", [], ["lm_head"], "exaone vLLM router quantized"),
    data(V, "0.32.0", "router", ["bias_when"], "noaux_tc", "exaone vLLM bias only for noaux_tc"),
    data(V, "0.16.0", "router", ["reads"], [], "exaone vLLM 0.16 is_moe_layer not read"),
    data(V, "0.32.0", "moe_layers", [], "all", "exaone vLLM every layer MoE"),
    data(V, "0.16.0", "fp8_skip", ["fused_first"], True, "exaone vLLM 0.16 FP8 fused name first"),
    data(V, "0.16.0", "eh_proj", [], "plain", "exaone vLLM 0.16 fc plain"),
    data(V, "0.16.0", "unquantized_roles", [], ["lm_head"], "exaone vLLM 0.16 router quantized"),
    data(V, "0.32.0", "shared_experts_fusion", [], {"decided_by": "can_fuse_shared_expert", "exclude_veto": "none",
                                                     "platforms": ["cuda", "rocm"], "config_reads": [],
                                                     "experts_key": "num_experts", "shared": "shared_experts",
                                                     "file": "exaone_moe.py"}, "exaone vLLM fuses the shared expert"),
]
