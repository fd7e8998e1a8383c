"""Qwen4-Exp's (qwen4_exp) rule mutations: each changes one rule value read in the wheels; the family's
differential and real-process tests must kill it."""

from tests.benchmarks.engine_mutations import data

TESTS = ["tests/quant/test_engine_qwen4_exp.py"]

S, V = "sglang.qwen4_exp", "vllm.qwen4_exp"
QKV = ["q_proj", "k_proj", "v_proj"]
MUTATIONS = [
    data(S, "0.5.21", "quark_fused", ["in_proj_qkvz"], ["in_proj_qkv"], "qwen4_exp sglang Quark in_proj_qkvz shards"),
    data(S, "0.5.21", "fp8_skip", ["fused", "in_proj_ba"], ["in_proj_b"], "qwen4_exp sglang FP8 in_proj_ba shards"),
    data(S, "0.5.21", "layer_kinds", ["builds"],
         ["linear_attention", "full_attention", "qwen_sparse_attention", "indexed_attention", "attention"],
         "qwen4_exp sglang 0.5.21 builds indexed_attention"),
    data(S, "0.5.22", "layer_kinds", ["builds"], ["linear_attention", "full_attention", "qwen_sparse_attention"],
         "qwen4_exp sglang 0.5.22 without indexed_attention"),
    data(V, "0.32.0", "quark_fused", ["qkv_proj"], QKV, "qwen4_exp vLLM 0.33.0 indexer apart (Quark)"),
    data(V, "0.32.0", "fp8_skip", ["fused", "qkv_proj"], QKV, "qwen4_exp vLLM 0.33.0 indexer apart (FP8)"),
    data(V, "0.32.0", "draft_exclude", ["qwen4_exp"], "none", "qwen4_exp vLLM 0.33.0 draft's Quark entries shifted"),
    data(V, "0.34.0", "draft_exclude", ["qwen4_exp"], "mtp_layers_unshifted_quark",
         "qwen4_exp vLLM 0.34.0 draft's Quark entries unshifted"),
    data(V, "0.34.0", "quark_fused", ["qkv_proj"], QKV + ["indexer.index_qk_proj"],
         "qwen4_exp vLLM 0.34.0 indexer packed (Quark)"),
    data(V, "0.34.0", "fp8_skip", ["fused", "kv_proj"], ["key_proj"], "qwen4_exp vLLM 0.34.0 PLE kv_proj shards"),
]
