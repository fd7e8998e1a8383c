"""Kimi-K3's (kimi_k3) rule mutations: each changes one rule value read in the wheels, or the replay's choice
of fused module for a shard two fused modules list; the family's differential tests must kill it."""

from tests.benchmarks.engine_mutations import code, data

TESTS = ["tests/quant/test_engine_kimi_k3.py"]

S, V = "sglang.kimi_k3", "vllm.kimi_k3"
KDA = {"fused_qkvg_proj": ["q_proj", "k_proj", "v_proj", "g_proj"]}
MUTATIONS = [
    data(S, "0.5.19", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
                                          "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "k3 sglang 0.5.19 Quark without the class mapping"),
    data(S, "0.5.17", "quark_fused", [], {**KDA, "gate_up_proj": ["gate_proj", "up_proj"]},
         "k3 sglang 0.5.17 Quark with a class mapping"),
    data(S, "0.5.19", "fp8_skip", ["fused"], {}, "k3 sglang 0.5.19 FP8 without the class mapping"),
    data(S, "0.5.17", "fp8_skip", ["fused"], KDA, "k3 sglang 0.5.17 FP8 with a class mapping"),
    data(S, "0.5.17", "exclude_mapper", ["substr"], {}, "k3 sglang mapper keeps block_sparse_moe"),
    data(S, "0.5.17", "exclude_mapper", ["prefix"], {}, "k3 sglang mapper without the layers prefix"),
    data(S, "0.5.17", "module_names", [], {"^language_model.": ""}, "k3 sglang text model keeps block_sparse_moe"),
    data(S, "0.5.17", "module_names", [], None, "k3 sglang text model under language_model"),
    data(S, "0.5.17", "unquantized_roles", [], ["router", "lm_head", "attn_res", "vision", "projector"],
         "k3 sglang latent projections quantized"),
    data(S, "0.5.17", "unquantized_roles", [], ["router", "lm_head", "latent_proj", "attn_res"],
         "k3 sglang vision tower quantized"),
    data(S, "0.5.17", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
                                          "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "k3 sglang KDA q/k/v/g apart"),
    data(S, "0.5.17", "router", ["bias_when"], "always", "k3 sglang router bias whatever topk_method"),
    data(V, "0.29.0", "quark_fused", ["in_proj_qkvgfab"], ["q_proj", "k_proj", "v_proj", "g_proj", "b_proj",
                                                           "f_a_proj"], "k3 vLLM Quark expands g_proj too"),
    data(V, "0.29.0", "fp8_skip", ["fused"], {}, "k3 vLLM FP8 without the class mapping"),
    data(V, "0.29.0", "exclude_mapper", ["prefix"], {}, "k3 vLLM mapper without the projector renames"),
    data(V, "0.29.0", "module_names", [], None, "k3 vLLM projector keeps proj.0"),
    data(V, "0.29.0", "unquantized_roles", [], ["router", "lm_head", "attn_res"], "k3 vLLM 0.29 latent quantized"),
    data(V, "0.31.0", "unquantized_roles", [], ["router", "lm_head", "attn_res", "latent_proj"],
         "k3 vLLM 0.31 latent bf16"),
    data(V, "0.29.0", "unquantized_roles", [], ["router", "lm_head", "attn_res", "latent_proj", "vision"],
         "k3 vLLM vision tower bf16"),
    data(V, "0.33.0", "built_fused", ["fused_qkv_a_proj"], ["q_a_proj", "kv_a_proj_with_mqa"],
         "k3 vLLM 0.33 ROCm MLA gate apart"),
    data(V, "0.29.0", "built_fused", ["fused_qkv_a_proj"], ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
         "k3 vLLM 0.29 ROCm MLA gate fused"),
    data(V, "0.29.0", "router", ["bias_when"], "noaux_tc", "k3 vLLM router bias only for noaux_tc"),
    code("quant/engines/replay.py", "    if not counts[best]:\n        return None\n",
         "    if not counts[best]:\n        return False\n", "a lone shard joins its fused module"),
    code("quant/engines/replay.py", "list(counts.values()).count(counts[best]) > 1 else best",
         "list(counts.values()).count(counts[best]) > 1 else False", "the shared shard's fused module by fused_into"),
]
