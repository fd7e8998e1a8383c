"""Step-3.7-Flash's (step3p7) rule mutations: each changes one rule value read in the wheels; the family's
differential tests must kill it."""

from tests.benchmarks.engine_mutations import data

TESTS = ["tests/quant/test_engine_step3p7.py"]

S, V = "sglang.step3p7", "vllm.step3p7"
MUTATIONS = [
    data(S, "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                           "gate_up_proj": ["gate_proj", "up_proj"]},
         "step3p7 sglang Quark expands qkv_proj"),
    data(S, "0.5.21", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]}, "step3p7 sglang q/k/v apart"),
    data(S, "0.5.21", "fp8_skip", ["fused"], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "step3p7 sglang FP8 with a class mapping"),
    data(S, "0.5.21", "module_names", [".moe."], ".moe.", "step3p7 sglang MoE block under moe"),
    data(S, "0.5.21", "module_names", ["^model."], "model.", "step3p7 sglang text model without language_model"),
    data(S, "0.5.21", "exclude_mapper", ["prefix"], {"model.": "language_model.model."},
         "step3p7 sglang mapper renames model."),
    data(S, "0.5.21", "unquantized_roles", [], ["router", "lm_head", "attention_gate"],
         "step3p7 sglang vision tower with the quant config"),
    data(S, "0.5.21", "router", ["bias_when"], "never", "step3p7 sglang router without bias"),
    data(S, "0.5.21", "moe_layers", [], "all", "step3p7 sglang every layer MoE"),
    data(S, "0.5.21", "eh_proj", [], "quant_config", "step3p7 sglang eh_proj with the quant config"),
    data(V, "0.33.0", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]}, "step3p7 vLLM no qkv_proj"),
    data(V, "0.33.0", "built_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, "step3p7 vLLM gate/up apart"),
    data(V, "0.33.0", "fp8_skip", ["fused"], {}, "step3p7 vLLM FP8 without the class mapping"),
    data(V, "0.33.0", "exclude_mapper", ["substr"], {".mlp.c_fc": ".mlp.fc1", ".mlp.c_proj": ".mlp.fc2"},
         "step3p7 vLLM the text model's mapper not applied"),
    data(V, "0.33.0", "module_names", [".share_expert."], ".share_expert.", "step3p7 vLLM shared expert outside moe"),
    data(V, "0.33.0", "unquantized_roles", [], ["router", "lm_head", "vision", "projector"],
         "step3p7 vLLM vision tower without the quant config"),
    data(V, "0.33.0", "router", ["reads"], [], "step3p7 vLLM router keys not read"),
    data(V, "0.33.0", "mtp_naming", ["style"], "original", "step3p7 vLLM MTP layers kept"),
]
