"""Mutation check of the engine rules: each single change to the rule data
(manifests/engines/*.yaml) or to the matcher code (quant/engines/*.py) must make a test of
tests/quant/test_fusion.py or tests/quant/test_engine_sources.py fail.

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_engines.py [--only N,M] [--json]

Runs in one process (the wheels' parsed sources stay cached between runs): a data mutation is
applied to the loaded rule file (checked against its schema again: a value the schema refuses fails
every test that reads the file), a code mutation by swapping the module's functions for ones compiled
from the changed source; nothing on disk is changed. Prints one row per mutation (killed or
SURVIVED, the first failing test) and the score. Needs the wheels (see tests/quant/engine_sources.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import sys
import time
import types
from pathlib import Path

import pytest

import quant.engines.rules as rules_module
from quant.engines.rule_kinds import RuleFile
from tests.benchmarks.engine_mutations import code, data, top

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/quant/test_fusion.py", "tests/quant/test_engine_sources.py", "tests/quant/test_engine_families.py",
         "tests/quant/test_engine_kimi.py", "tests/quant/test_engine_qwen3_next.py", "tests/quant/test_engine_llama4.py",
         "tests/quant/test_engine_gpt_oss.py", "tests/quant/test_engine_qwen3_5.py",
         "tests/quant/test_engine_deepseek_v4.py",
         "tests/quant/test_engine_glm5_next.py", "tests/quant/test_engine_minimax_m3.py",
         "tests/quant/test_incidents_sglang.py", "tests/quant/test_incidents_vllm.py"]


MUTATIONS = [
    data("sglang", "0.5.18", "shared_experts_fusion", ["exclude_veto"], "none", "0.5.18 fuses an excluded shared expert"),
    data("sglang", "0.5.19", "shared_experts_fusion", ["exclude_veto"], "mtp_prefix",
         "0.5.19 draft-layer entries veto fusion"),
    data("sglang", "0.5.22", "shared_experts_fusion", ["draft_arch", "glm_moe_dsa", "class"],
         "DeepseekV3ForCausalLMNextN", "0.5.22 GLM draft never fuses"),
    data("sglang", "0.5.16", "shared_experts_fusion", ["draft_arch", "glm_moe_dsa", "config"],
         "DeepseekV3ForCausalLMNextN", "0.5.16 GLM draft fuses"),
    data("sglang", "0.5.13", "shared_experts_fusion", ["routed_experts"], {256: "any"}, "0.5.13 drops 384 experts"),
    data("sglang", "0.5.9", "shared_experts_fusion", ["min_capability", "rocm"], [9, 5], "0.5.9 needs gfx950"),
    data("sglang", "0.5.16", "shared_experts_fusion", ["min_capability", "cuda"], [9, 0], "0.5.16 needs sm90"),
    data("sglang", "0.5.18", "shared_experts_fusion", ["ep_min_capability"], {}, "0.5.18 no fusion under EP"),
    data("sglang", "0.5.9", "shared_experts_fusion", ["arch", "glm_moe_dsa"], "DeepseekV3ForCausalLM",
         "0.5.9 GLM main never fuses"),
    data("sglang", "0.5.22", "shared_experts_fusion", ["shared_experts"], 2, "0.5.22 wants 2 shared experts"),
    data("vllm", "0.30.0", "indexer", ["wk"], "quant_config", "vLLM wk quantized"),
    data("vllm", "0.30.0", "eh_proj", [], "quant_config", "vLLM eh_proj quantized"),
    data("sglang", "0.5.11", "eh_proj", [], "plain", "sglang 0.5.11-0.5.14 eh_proj plain"),
    data("sglang", "0.5.9", "router", ["reads"], [], "router keys emptied"),
    data("sglang", "0.5.15", "router", ["reads"], ["topk_method", "n_group", "topk_group"],
         "0.5.15 does not read scoring_func"),
    data("sglang", "0.5.15", "indexer", ["wk_fused_bf16_on_cuda"], False, "0.5.15 CUDA keeps wk separate"),
    data("sglang", "0.5.15", "indexer", ["wk_dequantized"], [], "0.5.15 does not dequantize FP8 wk"),
    data("vllm", "0.30.0", "indexer", ["wk_dequantized"], [], "vLLM does not dequantize FP8 wk"),
    data("sglang", "0.5.11", "quark_fused", [], {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "0.5.11 Quark mapping without gate_up_proj"),
    data("sglang", "0.5.21", "quark_match", ["fused_first"], False, "0.5.21 expands fused names first"),
    data("sglang", "0.5.21", "quark_match", ["experts_prefix"], "none", "0.5.21 no '<experts>.' prefix match"),
    data("vllm", "0.30.0", "quark_match", ["experts_prefix"], "none", "vLLM no check_children"),
    data("sglang", "0.5.9", "mtp_naming", ["max_layers"], None, "no 1-nextn-layer assert"),
    data("sglang", "0.5.16", "draft_exclude", ["glm_moe_dsa"], "mapper_61", "0.5.16 GLM draft uses the 61 mapper"),
    data("sglang", "0.5.11", "fp8_skip", ["match"], "substring", "0.5.11 FP8 entries as substrings"),
    # GLM-4.5 (Glm4MoeForCausalLM) rules: manifests/families/glm4_moe/{sglang,vllm}.yaml
    data("sglang.glm4_moe", "0.5.21", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
         "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"], "qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "glm4 sglang Quark expands qkv_proj"),
    data("vllm.glm4_moe", "0.33.0", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "glm4 vLLM Quark mapping without qkv_proj"),
    data("sglang.glm4_moe", "0.5.21", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "glm4 sglang builds q/k/v separately"),
    data("sglang.glm4_moe", "0.5.21", "fp8_skip", ["fallback_fused"], {}, "glm4 sglang FP8 without fallback shards"),
    data("vllm.glm4_moe", "0.33.0", "fp8_skip", ["fused"], {}, "glm4 vLLM FP8 without the class mapping"),
    data("sglang.glm4_moe", "0.5.21", "shared_experts_fusion", ["exclude_veto"], "draft_layers",
         "glm4 exclude list vetoes fusion"),
    data("sglang.glm4_moe", "0.5.21", "shared_experts_fusion", ["min_capability", "rocm"], [9, 5],
         "glm4 fusion needs gfx950"),
    data("sglang.glm4_moe", "0.5.21", "shared_experts_fusion", ["ep_min_capability"], {}, "glm4 no fusion under EP"),
    data("sglang.glm4_moe", "0.5.21", "shared_experts_fusion", ["routed_experts"], {160: "any"},
         "glm4 fusion needs 160 experts"),
    data("sglang.glm4_moe", "0.5.21", "mtp_naming", ["top_level"], ["eh_proj", "enorm", "hnorm"],
         "glm4 draft shared_head.norm under decoder"),
    data("sglang.glm4_moe", "0.5.21", "mtp_naming", ["style"], "original", "glm4 sglang draft keeps names"),
    data("vllm.glm4_moe", "0.33.0", "mtp_naming", ["style"], "decoder", "glm4 vLLM draft renamed"),
    data("sglang.glm4_moe", "0.5.21", "router", ["bias_when"], "noaux_tc", "glm4 bias only for noaux_tc"),
    data("vllm.glm4_moe", "0.33.0", "eh_proj", [], "quant_config", "glm4 vLLM eh_proj quantized"),
    data("vllm.glm4_moe", "0.33.0", "draft_exclude", ["glm4_moe"], "mapper_61", "glm4 vLLM draft mapped"),
    data("vllm.glm4_moe", "0.33.0", "unquantized_roles", [], ["lm_head", "mtp_head"], "glm4 vLLM router quantized"),
    top("sglang.glm4_moe", ("checked",), ["0.5.21", "0.5.23"], "glm4 0.5.22 not read"),
    # Qwen3-MoE (Qwen3MoeForCausalLM) rules: manifests/families/qwen3_moe/{sglang,vllm}.yaml
    data("vllm.qwen3_moe", "0.30.0", "unquantized_roles", [], ["router", "lm_head"], "qwen3 vLLM router plain"),
    data("sglang.qwen3_moe", "0.5.21", "unquantized_roles", [], ["lm_head"], "qwen3 sglang router quantized"),
    data("sglang.qwen3_moe", "0.5.21", "moe_layers", [], "config", "qwen3 sglang honours mlp_only_layers"),
    data("vllm.qwen3_moe", "0.30.0", "moe_layers", [], "all", "qwen3 vLLM all layers MoE"),
    data("sglang.qwen3_moe", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "qwen3 sglang Quark mapping without gate_up_proj"),
    data("vllm.qwen3_moe", "0.30.0", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "qwen3 vLLM Quark mapping with gate_up_proj"),
    data("sglang.qwen3_moe", "0.5.21", "fp8_skip", ["fused"], {}, "qwen3 sglang FP8 without the class mapping"),
    data("sglang.qwen3_moe", "0.5.21", "router", ["bias_when"], "always", "qwen3 router has a bias"),
    data("sglang.qwen3_moe", "0.5.21", "shared_experts_fusion", [], {"decided_by": "shared_experts_fusion_disable_reason",
         "exclude_veto": "none", "arch": None, "draft_arch": {}, "routed_experts": "any", "shared_experts": "any",
         "min_capability": {"cuda": [8, 0], "rocm": [9, 4]}, "ep_min_capability": {}}, "qwen3 fusion modelled"),
    # Mixtral (MixtralForCausalLM) rules: manifests/families/mixtral/{sglang,vllm}.yaml
    data("sglang.mixtral", "0.5.21", "module_names", [], {}, "mixtral sglang layers under model.layers"),
    data("vllm.mixtral", "0.30.0", "module_names", [], {"^model.layers.": "layers."}, "mixtral vLLM layers.N"),
    data("sglang.mixtral", "0.5.21", "built_fused", [], {}, "mixtral sglang q/k/v separate"),
    data("vllm.mixtral", "0.30.0", "quark_fused", [], {}, "mixtral vLLM no Quark mapping"),
    data("vllm.mixtral", "0.30.0", "unquantized_roles", [], ["lm_head"], "mixtral vLLM router quantized"),
    data("sglang.mixtral", "0.5.21", "router", ["bias_when"], "always", "mixtral router has a bias"),
    # MiniMax-M2 (MiniMaxM2ForCausalLM) rules: manifests/families/minimax_m2/{sglang,vllm}.yaml
    data("vllm.minimax_m2", "0.30.0", "module_names", [], {}, "minimax vLLM MoE under block_sparse_moe"),
    data("sglang.minimax_m2", "0.5.21", "module_names", [], {".block_sparse_moe.": ".mlp."}, "minimax sglang mlp.*"),
    data("sglang.minimax_m2", "0.5.21", "mtp_naming", ["style"], "original", "minimax sglang loads MTP modules"),
    data("vllm.minimax_m2", "0.30.0", "router", ["reads"], [], "minimax vLLM scoring_func not read"),
    data("sglang.minimax_m2", "0.5.21", "router", ["bias_when"], "always", "minimax bias regardless of config"),
    data("vllm.minimax_m2", "0.30.0", "unquantized_roles", [], ["lm_head"], "minimax vLLM router quantized"),
    # Kimi-K2.5 (KimiK25ForConditionalGeneration) rules: manifests/families/kimi_k25/{sglang,vllm}.yaml
    data("sglang.kimi_k25", "0.5.21", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
         "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}, "kimi sglang keeps the loader's gate_up_proj"),
    data("sglang.kimi_k25", "0.5.21", "quark_fused", [], {}, "kimi sglang without fused_qkv_a_proj_with_mqa"),
    data("vllm.kimi_k25", "0.33.0", "quark_fused", [], {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "kimi vLLM without gate_up_proj"),
    data("sglang.kimi_k25", "0.5.21", "built_fused", [], {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "kimi sglang builds no gate_up_proj"),
    data("sglang.kimi_k25", "0.5.21", "unquantized_roles", [], ["router", "lm_head"], "kimi sglang quantizes vision"),
    data("vllm.kimi_k25", "0.33.0", "unquantized_roles", [], ["router", "lm_head", "vision", "projector"],
         "kimi vLLM never quantizes vision"),
    data("vllm.kimi_k25", "0.33.0", "module_names", [], {}, "kimi vLLM projector keeps proj.0/2"),
    data("vllm.kimi_k25", "0.33.0", "module_names", [], {"^mm_projector.proj.0": "mm_projector.linear_2",
         "^mm_projector.proj.2": "mm_projector.linear_1"}, "kimi vLLM projector names swapped"),
    data("sglang.kimi_k25", "0.5.21", "shared_experts_fusion", ["exclude_veto"], "none", "kimi fuses an excluded shared expert"),
    data("sglang.kimi_k25", "0.5.21", "shared_experts_fusion", ["arch", "kimi_k25"], "KimiK25ForConditionalGeneration",
         "kimi compares the top-level architecture"),
    data("sglang.kimi_k25", "0.5.21", "shared_experts_fusion", ["routed_experts"], {256: "any"}, "kimi drops 384 experts"),
    data("sglang.kimi_k25", "0.5.21", "shared_experts_fusion", ["min_capability", "rocm"], [9, 5], "kimi needs gfx950"),
    data("sglang.kimi_k25", "0.5.21", "shared_experts_fusion", ["ep_min_capability"], {}, "kimi no fusion under EP"),
    data("sglang.kimi_k25", "0.5.21", "router", ["bias_when"], "always", "kimi bias regardless of topk_method"),
    data("sglang.kimi_k25", "0.5.21", "router", ["reads"], [], "kimi sglang reads no router key"),
    data("vllm.kimi_k25", "0.33.0", "unquantized_roles", [], ["lm_head"], "kimi vLLM router quantized"),
    top("sglang.kimi_k25", ("checked",), ["0.5.21", "0.5.23"], "kimi 0.5.22 not read"),
    # MiniMax-M3 (MiniMaxM3SparseForConditionalGeneration) rules: manifests/families/minimax_m3/{sglang,vllm}.yaml
    data("sglang.minimax_m3", "0.5.21", "module_names", [], {}, "m3 sglang MoE under block_sparse_moe"),
    data("sglang.minimax_m3", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "m3 sglang mapping without index_qkv_proj"),
    data("sglang.minimax_m3", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "index_qkv_proj": ["index_q_proj", "index_k_proj"]}, "m3 sglang without the loader's additions"),
    data("sglang.minimax_m3", "0.5.21", "built_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "m3 sglang builds no index_qkv_proj"),
    data("sglang.minimax_m3", "0.5.21", "fp8_skip", ["fused"], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "m3 sglang FP8 mapping without index_qkv_proj"),
    data("sglang.minimax_m3", "0.5.21", "mtp_naming", ["dropped_prefix"], None, "m3 sglang loads the MTP modules"),
    data("sglang.minimax_m3", "0.5.21", "unquantized_roles", [], ["router", "lm_head"], "m3 sglang quantizes vision"),
    data("sglang.minimax_m3", "0.5.21", "unquantized_roles", [], ["lm_head", "vision", "projector"],
         "m3 sglang router quantized"),
    data("sglang.minimax_m3", "0.5.21", "router", ["reads"], [], "m3 sglang reads no scoring_func"),
    data("sglang.minimax_m3", "0.5.21", "router", ["bias_when"], "always", "m3 bias regardless of use_routing_bias"),
    data("sglang.minimax_m3", "0.5.21", "shared_experts_fusion", ["min_capability", "rocm"], [9, 4], "m3 fuses on gfx942"),
    data("sglang.minimax_m3", "0.5.21", "shared_experts_fusion", ["ep_min_capability"], {"rocm": [9, 5]},
         "m3 fuses under EP on gfx950"),
    data("sglang.minimax_m3", "0.5.21", "shared_experts_fusion", ["exclude_veto"], "mtp_prefix",
         "m3 exclude list vetoes fusion"),
    data("sglang.minimax_m3", "0.5.21", "shared_experts_fusion", [], None, "m3 no fusion"),
    top("sglang.minimax_m3", ("checked",), ["0.5.21", "0.5.23"], "m3 0.5.22 not read"),
    data("vllm.minimax_m3", "0.33.0", "module_names", [], {}, "m3 vLLM keeps the projector names"),
    data("vllm.minimax_m3", "0.33.0", "module_names", [], {"^multi_modal_projector.": "vision_tower.multi_modal_projector.",
         "^patch_merge_mlp.": "vision_tower.patch_merge_mlp."}, "m3 vLLM keeps mlp.fc1/fc2"),
    data("vllm.minimax_m3", "0.33.0", "quark_fused", ["qkv_proj"], ["q_proj", "k_proj", "v_proj", "index_q_proj",
         "index_k_proj"], "m3 vLLM mapping with the indexer shards"),
    data("vllm.minimax_m3", "0.33.0", "built_fused", ["qkv_proj"], ["q_proj", "k_proj", "v_proj"],
         "m3 vLLM indexer not in qkv_proj"),
    data("vllm.minimax_m3", "0.33.0", "unquantized_roles", [], ["router", "lm_head", "vision", "projector"],
         "m3 vLLM never quantizes vision"),
    data("vllm.minimax_m3", "0.33.0", "unquantized_roles", [], ["lm_head"], "m3 vLLM router quantized"),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", [], {"style": "dropped", "top_level": [], "skipped": [], "max_layers": None,
                                                         "dropped_prefix": "language_model.model.mtp.layers."},
         "m3 vLLM builds no MTP draft"),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", ["renames"], {}, "m3 vLLM draft under the stored names"),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", ["renames"], {"^language_model.model.mtp.": "model.mtp."},
         "m3 vLLM draft keeps mtp."),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", ["renames"], {"^language_model.": ""},
         "m3 vLLM draft model.mtp.layers.i"),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", ["max_layers"], 1, "m3 vLLM builds one draft layer"),
    data("vllm.minimax_m3", "0.33.0", "mtp_naming", ["renames"], {"^language_model.model.mtp.": "model."},
         "m3 vLLM draft looked up with transformer_layer"),
    code("quant.engines.replay", "module.startswith(old[1:]):\n            module = new",
         "module.startswith(old[1:]):\n            return new", "renames: the first only"),
    data("vllm.minimax_m3", "0.33.0", "eh_proj", [], "plain", "m3 vLLM draft eh_proj bf16"),
    data("vllm.minimax_m3", "0.33.0", "eh_proj", [], "quant_config", "m3 vLLM FP8 draft eh_proj bf16"),
    data("vllm.minimax_m3", "0.33.0", "draft_exclude", [], {"minimax_m3": "glm_remap"}, "m3 vLLM draft list remapped"),
    data("vllm.minimax_m3", "0.33.0", "draft_exclude", [], {"minimax_m3": "mapper_61"}, "m3 vLLM draft list 61-mapped"),
    data("vllm.minimax_m3", "0.33.0", "router", ["bias_when"], "never", "m3 vLLM router without bias"),
    data("vllm.minimax_m3", "0.33.0", "exclude_mapper", ["platforms"], {}, "m3 vLLM ROCm keeps the tower's mlp.fc1 entries"),
    data("vllm.minimax_m3", "0.33.0", "exclude_mapper", ["substr"], {".mlp.fc1": ".fc1", ".mlp.fc2": ".fc2"},
         "m3 vLLM CUDA renames the tower's mlp.fc1 entries"),
    data("vllm.minimax_m3", "0.33.0", "exclude_mapper", ["prefix"], {}, "m3 vLLM exclude keeps the projector names"),
    data("vllm.minimax_m3", "0.33.0", "exclude_mapper", ["kinds"], ["quark"], "m3 vLLM FP8 ignored_layers not mapped"),
    data("vllm.minimax_m3", "0.33.0", "shared_experts_fusion", [], {"decided_by": "env"}, "m3 vLLM fuses by default"),
    data("vllm.deepseek_v4", "0.33.0", "shared_experts_fusion", [], {"decided_by": "env"}, "v4 vLLM fuses by default"),
    # DeepSeek-V4 (DeepseekV4ForCausalLM) rules: manifests/families/deepseek_v4/{sglang,vllm}.yaml
    # (killed by tests/quant/test_engine_deepseek_v4.py)
    data("sglang.deepseek_v4", "0.5.21", "draft_module_names", ["layer_as"], "model.layers.",
         "v4 sglang draft asks for main-layer names"),
    data("vllm.deepseek_v4", "0.33.0", "draft_module_names", ["layer_as"], "model.mtp.0.",
         "v4 vLLM draft asks for the mapped checkpoint names"),
    data("sglang.deepseek_v4", "0.5.21", "module_names", [], {}, "v4 sglang keeps the checkpoint names"),
    data("sglang.deepseek_v4", "0.5.21", "module_names", [], {"^layers.": "model.layers.", "^head": "lm_head",
         ".attn.": ".self_attn.", ".w1": ".gate_proj", ".w2": ".down_proj", ".w3": ".up_proj"}, "v4 sglang MoE under ffn"),
    data("sglang.deepseek_v4", "0.5.21", "module_names", ["^head"], "head", "v4 sglang head not renamed"),
    data("sglang.deepseek_v4", "0.5.21", "exclude_mapper", [], {"kinds": ["quark"], "style": "sglang",
         "substr": {".attn.": ".self_attn.", ".ffn.": ".mlp."}, "prefix": {"layers.": "model.layers."}, "suffix": {}},
         "v4 0.5.21 maps the exclude list"),
    data("sglang.deepseek_v4", "0.5.21", "quark_fused", ["wqkv_a"], ["wq_a", "wkv"], "v4 sglang Quark expands wqkv_a"),
    data("sglang.deepseek_v4", "0.5.21", "quark_fused", [], {}, "v4 sglang Quark without the loader additions"),
    data("sglang.deepseek_v4", "0.5.21", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
         "compressor.wkv_gate": ["compressor.wkv", "compressor.wgate"]}, "v4 sglang wq_a and wkv apart"),
    data("sglang.deepseek_v4", "0.5.21", "built_fused", [], {"wqkv_a": ["wq_a", "wkv"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "v4 sglang compressor wkv/wgate apart"),
    data("sglang.deepseek_v4", "0.5.21", "fp8_skip", ["fallback_fused"], {}, "v4 sglang FP8 without fallback shards"),
    data("sglang.deepseek_v4", "0.5.21", "fp8_skip", ["match"], "exact", "v4 sglang FP8 exact names"),
    data("sglang.deepseek_v4", "0.5.21", "mtp_naming", ["dropped_prefix"], None, "v4 sglang loads the MTP module"),
    data("sglang.deepseek_v4", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "indexer_weights"],
         "v4 sglang quantizes the compressors"),
    data("sglang.deepseek_v4", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "compressor"],
         "v4 sglang quantizes indexer weights_proj"),
    data("sglang.deepseek_v4", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "compressor",
         "indexer_weights", "indexer_proj"], "v4 sglang never quantizes indexer wq_b"),
    data("sglang.deepseek_v4", "0.5.21", "router", ["bias_when"], "always", "v4 sglang bias on hash layers"),
    data("sglang.deepseek_v4", "0.5.21", "router", ["reads"], ["topk_method"], "v4 sglang needs topk_method"),
    data("sglang.deepseek_v4", "0.5.21", "eh_proj", [], "quant_config", "v4 sglang main builds eh_proj"),
    data("sglang.deepseek_v4", "0.5.21", "shared_experts_fusion", [], {"decided_by": "shared_experts_fusion_disable_reason",
         "exclude_veto": "none", "arch": None, "draft_arch": {}, "routed_experts": "any", "shared_experts": "any",
         "min_capability": {"cuda": [8, 0], "rocm": [9, 4]}, "ep_min_capability": {}}, "v4 sglang fuses by default"),
    data("sglang.deepseek_v4", "0.5.22", "exclude_mapper", [], None, "v4 0.5.22 without the Quark mapper"),
    data("sglang.deepseek_v4", "0.5.22", "exclude_mapper", ["style"], "vllm", "v4 0.5.22 mapper applies every match"),
    data("sglang.deepseek_v4", "0.5.22", "exclude_mapper", ["kinds"], ["quark", "fp8"], "v4 0.5.22 maps FP8 lists"),
    data("sglang.deepseek_v4", "0.5.22", "exclude_mapper", ["prefix"], {"mtp.": "model.mtp."},
         "v4 0.5.22 mapper keeps layers."),
    data("sglang.deepseek_v4", "0.5.22", "exclude_mapper", ["suffix"], {}, "v4 0.5.22 mapper keeps w1/w2/w3"),
    top("sglang.deepseek_v4", ("checked",), ["0.5.21", "0.5.23"], "v4 0.5.22 not read"),
    data("vllm.deepseek_v4", "0.33.0", "module_names", [], {}, "v4 vLLM keeps the checkpoint names"),
    data("vllm.deepseek_v4", "0.33.0", "module_names", [], {"^layers.": "model.layers.", "^head": "lm_head"},
         "v4 vLLM shared w2 not renamed"),
    data("vllm.deepseek_v4", "0.33.0", "exclude_mapper", [], None, "v4 vLLM matches the list as written"),
    data("vllm.deepseek_v4", "0.33.0", "exclude_mapper", ["kinds"], ["quark"], "v4 vLLM FP8 list not mapped"),
    data("vllm.deepseek_v4", "0.33.0", "exclude_mapper", ["substr"], {".shared_experts.w2": ".shared_experts.down_proj",
         "mtp.": None}, "v4 vLLM rename mapper drops mtp entries"),
    data("vllm.deepseek_v4", "0.33.0", "quark_fused", [], {"gate_up_proj": ["w1", "w3"], "fused_wqa_wkv": ["wq_a", "wkv"]},
         "v4 vLLM Quark without fused_wkv_wgate"),
    data("vllm.deepseek_v4", "0.33.0", "built_fused", [], {"gate_up_proj": ["w1", "w3"],
         "compressor.fused_wkv_wgate": ["compressor.wkv", "compressor.wgate"]}, "v4 vLLM wq_a and wkv apart"),
    data("vllm.deepseek_v4", "0.33.0", "fp8_skip", ["fused"], {}, "v4 vLLM FP8 without the class mapping"),
    data("vllm.deepseek_v4", "0.33.0", "unquantized_roles", [], ["router", "lm_head", "indexer_weights"],
         "v4 vLLM quantizes the compressors"),
    data("vllm.deepseek_v4", "0.33.0", "unquantized_roles", [], ["lm_head", "compressor", "indexer_weights"],
         "v4 vLLM router quantized"),
    data("vllm.deepseek_v4", "0.33.0", "mtp_naming", ["dropped_prefix"], None, "v4 vLLM loads the MTP module"),
    data("vllm.deepseek_v4", "0.33.0", "eh_proj", [], "plain", "v4 vLLM draft e_proj bf16"),
    data("vllm.deepseek_v4", "0.33.0", "router", ["bias_when"], "never", "v4 vLLM router without bias"),
    # sglang's DeepSeek-V4 wo_a: FP8 under 128x128 blocks, bf16 otherwise, whatever the exclude list says
    data("sglang.deepseek_v4", "0.5.21", "built_quantized", [], None, "v4 sglang wo_a governed under block FP8"),
    data("sglang.deepseek_v4", "0.5.21", "built_quantized", ["fp8", "weight_block_size"], [64, 64],
         "v4 sglang FP8 wo_a GEMM for 64x64 blocks"),
    data("sglang.deepseek_v4", "0.5.21", "built_quantized", ["fp8", "leaves"], {"attention": ["wo_b"]},
         "v4 sglang FP8 builds wo_b quantized, not wo_a"),
    data("sglang.deepseek_v4", "0.5.21", "built_quantized", [], {"quark": {"leaves": {"attention": ["wo_a"]},
         "reason": "mutation", "error": "mutation", "fix": "mutation"}}, "v4 sglang Quark builds wo_a quantized"),
    data("sglang.deepseek_v4", "0.5.22", "built_quantized", [], None, "v4 0.5.22 wo_a governed under block FP8"),
    data("sglang.deepseek_v4", "0.5.21", "unquantized_leaves", [], None, "v4 sglang wo_a governed outside block FP8"),
    data("sglang.deepseek_v4", "0.5.21", "unquantized_leaves", [], {"attention": ["wo_a", "wo_b"]},
         "v4 sglang wo_b built bf16"),
    data("sglang.deepseek_v4", "0.5.22", "unquantized_leaves", [], {}, "v4 0.5.22 wo_a governed outside block FP8"),
    code("quant.engines.replay", "    if (role, leaf) in quantized:\n        return \"quantized\"\n", "",
         "built_quantized not applied"),
    code("quant.engines.replay", "    elif excluded(name, exclude, rules, kind, em.moe):", "    elif False:",
         "an exclude entry for a module built quantized passes"),
    code("quant.engines.replay", 'list(qconfig.get("weight_block_size") or []) != rule["weight_block_size"]',
         'False', "built_quantized whatever the block size"),
    top("sglang", ("rule_sets", "0.5.19", "versions"), ["0.5.19", "0.5.19"], "0.5.20 moved into the 0.5.21 set"),
    top("sglang", ("post_releases", "0.5.15.post1"), "0.5.16", "0.5.15.post1 given 0.5.16's rules"),
    top("sglang", ("checked",), ["0.5.9", "0.5.10", "0.5.11", "0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16",
                                 "0.5.17", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"], "0.5.18 not read"),
    # Llama-4 (Llama4ForConditionalGeneration) rules: manifests/families/llama4/{sglang,vllm}.yaml
    # (killed by tests/quant/test_engine_llama4.py)
    data("sglang.llama4", "0.5.21", "quark_fused", [], {}, "llama4 sglang Quark without the class mapping"),
    data("sglang.llama4", "0.5.21", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
         "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}, "llama4 sglang Quark without qkv_proj"),
    data("sglang.llama4", "0.5.21", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "llama4 sglang q/k/v not fused"),
    data("sglang.llama4", "0.5.21", "fp8_skip", ["fused"], {}, "llama4 sglang FP8 without the class mapping"),
    data("sglang.llama4", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "projector"],
         "llama4 sglang quantizes the vision attention"),
    data("sglang.llama4", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "vision", "vision_attention",
         "projector"], "llama4 sglang never quantizes the vision MLPs"),
    data("sglang.llama4", "0.5.21", "unquantized_roles", [], ["lm_head", "vision_attention", "projector"],
         "llama4 sglang router quantized"),
    data("sglang.llama4", "0.5.21", "router", ["bias_when"], "always", "llama4 sglang router bias"),
    data("sglang.llama4", "0.5.21", "moe_layers", ["zero"], "none", "llama4 sglang step 0 builds no MoE layer"),
    data("sglang.llama4", "0.5.21", "moe_layers", ["experts"], "n_routed_experts", "llama4 sglang counts another key"),
    data("vllm.llama4", "0.30.0", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "llama4 vLLM without gate_up_proj"),
    data("vllm.llama4", "0.30.0", "fp8_skip", ["fused"], {}, "llama4 vLLM FP8 without the class mapping"),
    data("vllm.llama4", "0.30.0", "unquantized_roles", [], ["router", "lm_head"], "llama4 vLLM quantizes vision"),
    data("vllm.llama4", "0.30.0", "unquantized_roles", [], ["lm_head", "vision", "vision_attention", "projector"],
         "llama4 vLLM router quantized"),
    data("vllm.llama4", "0.30.0", "moe_layers", ["zero"], "all", "llama4 vLLM step 0 builds every layer MoE"),
    data("vllm.llama4", "0.30.0", "moe_layers", ["step"], "decoder_sparse_step", "llama4 vLLM reads another step"),
    data("sglang.llama4", "0.5.21", "qk_rotary_permute", ["fails"], [], "llama4 sglang permutes packed MX q/k"),
    data("sglang.llama4", "0.5.21", "qk_rotary_permute", ["fails"], ["quark", "fp8"], "llama4 sglang refuses FP8 q/k"),
    top("sglang.llama4", ("checked",), ["0.5.21", "0.5.23"], "llama4 0.5.22 not read"),
    # Qwen3-Next (Qwen3NextForCausalLM, drafts Qwen3NextForCausalLMMTP / Qwen3NextMTP) rules:
    # manifests/families/qwen3_next/{sglang,vllm}.yaml (killed by tests/quant/test_engine_qwen3_next.py)
    data("sglang.qwen3_next", "0.5.21", "quark_fused", [], {}, "qwen3next sglang Quark without the class mapping"),
    data("sglang.qwen3_next", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}, "qwen3next sglang Quark without gate_up_proj"),
    data("sglang.qwen3_next", "0.5.21", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "qwen3next sglang q/k/v not fused"),
    data("sglang.qwen3_next", "0.5.21", "fp8_skip", ["fused"], {}, "qwen3next sglang FP8 without the class mapping"),
    data("sglang.qwen3_next", "0.5.21", "mtp_naming", ["renames"], {}, "qwen3next sglang draft keeps mtp.*"),
    data("sglang.qwen3_next", "0.5.21", "mtp_naming", ["renames"], {"^mtp.": "model."}, "qwen3next sglang model.fc"),
    data("sglang.qwen3_next", "0.5.21", "mtp_naming", ["max_layers"], None, "qwen3next sglang builds every draft layer"),
    data("sglang.qwen3_next", "0.5.21", "eh_proj", [], "quant_config", "qwen3next sglang fc with the quant config"),
    data("sglang.qwen3_next", "0.5.21", "draft_exclude", ["qwen3_next"], "remapped", "qwen3next sglang draft mapper"),
    data("sglang.qwen3_next", "0.5.21", "unquantized_roles", [], ["shared_expert_gate", "lm_head"],
         "qwen3next sglang router quantized"),
    data("sglang.qwen3_next", "0.5.21", "unquantized_roles", [], ["router", "lm_head"],
         "qwen3next sglang shared_expert_gate quantized"),
    data("sglang.qwen3_next", "0.5.21", "moe_layers", [], "config", "qwen3next sglang honours mlp_only_layers"),
    data("sglang.qwen3_next", "0.5.21", "router", ["bias_when"], "always", "qwen3next router has a bias"),
    data("sglang.qwen3_next", "0.5.21", "layer_kinds", ["from"], "list", "qwen3next sglang reads layer_types"),
    data("sglang.qwen3_next", "0.5.21", "layer_kinds", ["full"], "full_attention", "qwen3next sglang kind words"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", ["exclude_veto"], "none",
         "qwen3next fuses an excluded shared expert"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", ["platforms"], ["cuda"], "qwen3next no fusion on ROCm"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", ["config_reads"],
         ["n_shared_experts", "shared_expert_intermediate_size"], "qwen3next fusion reads no moe size"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", ["shared"], "shared_experts",
         "qwen3next plural shared expert"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", ["experts_key"], "n_routed_experts",
         "qwen3next fused slot n_routed_experts"),
    data("sglang.qwen3_next", "0.5.21", "shared_experts_fusion", [], None, "qwen3next sglang never fuses"),
    top("sglang.qwen3_next", ("checked",), ["0.5.21", "0.5.23"], "qwen3next 0.5.22 not read"),
    # gpt-oss (GptOssForCausalLM) rules: manifests/families/gpt_oss/{sglang,vllm}.yaml (killed by
    # tests/quant/test_engine_gpt_oss.py and tests/quant/test_gpt_oss.py)
    data("sglang.gpt_oss", "0.5.21", "unquantized_roles", [], ["router", "lm_head"], "gptoss sglang attention quantized"),
    data("sglang.gpt_oss", "0.5.21", "unquantized_roles", [], ["attention", "lm_head"], "gptoss sglang router quantized"),
    data("vllm.gpt_oss", "0.30.0", "unquantized_roles", [], ["router", "lm_head", "attention"],
         "gptoss vLLM attention built without the config"),
    data("vllm.gpt_oss", "0.30.0", "unquantized_roles", [], ["lm_head"], "gptoss vLLM router quantized"),
    data("vllm.gpt_oss", "0.30.0", "module_names", [], {}, "gptoss vLLM keeps .self_attn."),
    data("sglang.gpt_oss", "0.5.21", "mxfp4_native", ["linear"], "governed", "gptoss sglang native Linear quantized"),
    data("vllm.gpt_oss", "0.30.0", "mxfp4_native", ["experts"], "bf16", "gptoss vLLM native experts bf16"),
    data("vllm.gpt_oss", "0.30.0", "mxfp4_native", ["reads_exclude"], True, "gptoss vLLM reads the exclude"),
    data("sglang.gpt_oss", "0.5.21", "mxfp4_native", ["tensors"], ["gate_up_proj_blocks", "down_proj_blocks"],
         "gptoss sglang reads no scales"),
    data("vllm.gpt_oss", "0.30.0", "mxfp4_native", ["tensors"], ["gate_up_proj_blocks", "gate_up_proj_scales",
         "down_proj_blocks", "down_proj_scales"], "gptoss vLLM reads no biases"),
    data("vllm.gpt_oss", "0.30.0", "quark_fused", [], {}, "gptoss vLLM Quark without qkv_proj"),
    data("sglang.gpt_oss", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "gptoss sglang with a class mapping"),
    data("vllm.gpt_oss", "0.30.0", "fp8_skip", ["fused"], {}, "gptoss vLLM FP8 without qkv_proj"),
    data("sglang.gpt_oss", "0.5.21", "moe_layers", [], "config", "gptoss sglang dense layers"),
    top("sglang.gpt_oss", ("checked",), ["0.5.21", "0.5.23"], "gptoss 0.5.22 not read"),
    data("vllm.qwen3_next", "0.33.0", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "qwen3next vLLM Quark without the GDN entries"),
    data("vllm.qwen3_next", "0.33.0", "fp8_skip", ["fused"], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "qwen3next vLLM FP8 without gate_up_proj"),
    data("vllm.qwen3_next", "0.33.0", "built_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "qwen3next vLLM shared expert not fused"),
    data("vllm.qwen3_next", "0.33.0", "mtp_naming", ["renames"], {"^mtp.": "model."}, "qwen3next vLLM draft model.*"),
    data("vllm.qwen3_next", "0.33.0", "mtp_naming", ["max_layers"], 1, "qwen3next vLLM one draft layer at most"),
    data("vllm.qwen3_next", "0.33.0", "eh_proj", [], "plain", "qwen3next vLLM fc plain"),
    data("vllm.qwen3_next", "0.33.0", "unquantized_roles", [], ["shared_expert_gate", "lm_head"],
         "qwen3next vLLM router quantized"),
    data("vllm.qwen3_next", "0.33.0", "moe_layers", [], "all", "qwen3next vLLM all layers MoE"),
    data("vllm.qwen3_next", "0.33.0", "layer_kinds", ["from"], "interval", "qwen3next vLLM reads the interval only"),
    data("vllm.qwen3_next", "0.33.0", "layer_kinds", ["interval_default"], 2, "qwen3next vLLM interval default 2"),
    # manifests/families/qwen3_5_moe/{sglang,vllm}.yaml (tests/quant/test_engine_qwen3_5.py, test_families.py)
    data("sglang.qwen3_5_moe", "0.5.21", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "qwen3.5 sglang Quark without the GDN entries"),
    data("sglang.qwen3_5_moe", "0.5.21", "built_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "qwen3.5 sglang builds no packed GDN projection"),
    data("sglang.qwen3_5_moe", "0.5.21", "fp8_skip", ["fused"], {}, "qwen3.5 sglang FP8 without the class mapping"),
    data("sglang.qwen3_5_moe", "0.5.21", "mtp_naming", ["renames"], {"^mtp.": "model."}, "qwen3.5 sglang draft model.*"),
    data("sglang.qwen3_5_moe", "0.5.21", "eh_proj", [], "any_quant_config", "qwen3.5 sglang fc with the quant config"),
    data("sglang.qwen3_5_moe", "0.5.21", "unquantized_roles", [], ["router", "shared_expert_gate", "lm_head"],
         "qwen3.5 sglang vision tower with the quant config"),
    data("sglang.qwen3_5_moe", "0.5.21", "unquantized_roles", [], ["router", "lm_head", "vision"],
         "qwen3.5 sglang shared_expert_gate with the quant config"),
    data("sglang.qwen3_5_moe", "0.5.21", "shared_experts_fusion", ["platforms"], ["cuda", "rocm"],
         "qwen3.5 sglang fuses on CUDA"),
    data("sglang.qwen3_5_moe", "0.5.21", "shared_experts_fusion", ["exclude_veto"], "none",
         "qwen3.5 sglang: an excluded shared expert does not veto"),
    data("sglang.qwen3_5_moe", "0.5.21", "shared_experts_fusion", ["config_reads"],
         ["n_shared_experts", "moe_intermediate_size"], "qwen3.5 sglang ignores the shared expert's size"),
    data("sglang.qwen3_5_moe", "0.5.21", "shared_experts_fusion", [], None, "qwen3.5 sglang never fuses"),
    data("vllm.qwen3_5_moe", "0.33.0", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"], "qkv": ["qkv"]}, "qwen3.5 vLLM Quark without the GDN entries"),
    data("vllm.qwen3_5_moe", "0.33.0", "fp8_skip", ["fused"], {}, "qwen3.5 vLLM FP8 without the class mapping"),
    data("vllm.qwen3_5_moe", "0.33.0", "eh_proj", [], "plain", "qwen3.5 vLLM fc plain"),
    data("vllm.qwen3_5_moe", "0.33.0", "unquantized_roles", [], ["router", "shared_expert_gate", "lm_head", "vision"],
         "qwen3.5 vLLM vision tower without the quant config"),
    data("vllm.qwen3_5_moe", "0.33.0", "mtp_naming", ["renames"], {"^mtp.": "model."}, "qwen3.5 vLLM draft model.*"),
    top("sglang.qwen3_5_moe", ("checked",), ["0.5.21", "0.5.23"], "qwen3.5 0.5.22 not read"),
    code("quant.engines.match", "any(p.match(name) for p in self.patterns)",
         "any(p.fullmatch(name) for p in self.patterns)", "re: entries matched with fullmatch"),
    code("quant.engines.match", 'any(\n            e.startswith(module + ".") for e in exclude.entries)',
         "any(\n            e.startswith(module) for e in exclude.entries)", "'<experts>.' prefix without the dot"),
    code("quant.engines.fusion", 'and "shared_expert_gate" not in e ', "", "shared_expert_gate entries veto"),
    code("quant.engines.fusion", "if serving.capability < least:", "if serving.capability <= least:",
         "capability bound exclusive"),
    code("quant.engines.fusion", 'return [e for e in entries if "shared_expert" in e',
         'return [e for e in entries if all("shared_expert" in x for x in entries) and "shared_expert" in e',
         "veto needs every entry"),
    code("quant.engines.replay", '**value["platforms"].get(serving.platform, {})}', '}',
         "a per-platform rule value ignored (vLLM's amd/ files)"),
    code("quant.engines.replay", 'config.get("indexer_rope_interleave", False)',
         'config.get("indexer_rope_interleave", True)', "indexer rope assumed interleaved when unset"),
    # Mixtral, Qwen3-MoE, gpt-oss, Llama-4, MiniMax-M2 over sglang's window (their folders' sglang.yaml)
    data("sglang.mixtral", "0.5.9", "fp8_skip", ["match"], "module_path", "mixtral sglang 0.5.9 FP8 by module path"),
    data("sglang.mixtral", "0.5.9", "fp8_skip", ["model_prefix_variants"], True,
         "mixtral sglang 0.5.9 model. variants"),
    data("sglang.qwen3_moe", "0.5.10", "fp8_skip", ["experts"], "replace", "qwen3 sglang 0.5.10 experts replace"),
    data("sglang.qwen3_moe", "0.5.9", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "qwen3 sglang 0.5.9 loader adds Quark names"),
    data("sglang.gpt_oss", "0.5.11", "quark_fused", [], {}, "gpt-oss sglang 0.5.11 loader adds nothing"),
    data("sglang.llama4", "0.5.11", "fp8_skip", ["fallback_fused"], {}, "llama4 sglang 0.5.11 no fallback shards"),
    data("sglang.minimax_m2", "0.5.9", "module_names", [], None, "minimax sglang 0.5.9 MoE under block_sparse_moe"),
    data("sglang.minimax_m2", "0.5.10", "module_names", [], {".block_sparse_moe.": ".mlp."},
         "minimax sglang 0.5.10 MoE under mlp"),
    data("sglang.minimax_m2", "0.5.9", "quark_fused", [], {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}, "minimax sglang 0.5.9 has a packed mapping"),
    top("sglang.mixtral", ("post_releases",), {"0.5.12.post1": "0.5.12", "0.5.13.post1": "0.5.13",
        "0.5.15.post1": "0.5.15"}, "mixtral 0.5.10.post1 not read"),
    # Mixtral, Qwen3-MoE, gpt-oss, Llama-4, MiniMax-M2 over vLLM's window (their folders' vllm.yaml)
    data("vllm.mixtral", "0.16.0", "fp8_skip", ["fused_first"], True, "mixtral vLLM 0.16.0 fused name first"),
    data("vllm.qwen3_moe", "0.24.0", "fp8_skip", ["fused_first"], False, "qwen3 vLLM 0.24.0 shards only"),
    data("vllm.llama4", "0.16.0", "qk_rotary_permute", [], None, "llama4 vLLM 0.16.0 permutes MX scales"),
    data("vllm.llama4", "0.17.0", "qk_rotary_permute", [], {"leaves": ["q_proj", "k_proj"],
         "unless_name_has": ["vision_model"], "fails": ["quark"], "scales_left": True},
         "llama4 vLLM 0.17.0 leaves MX scales"),
    data("vllm.minimax_m2", "0.16.0", "mtp_naming", ["style"], "original", "minimax vLLM 0.16.0 loads MTP modules"),
    data("vllm.gpt_oss", "0.16.0", "module_names", [], None, "gpt-oss vLLM 0.16.0 attention as self_attn"),
    code("quant.engines.rules", "if r.covers(read[release])]", "if r.covers(release)]",
         ".postN by version order, not the map"),
    # GLM-5.3-Flash (Glm5NextForConditionalGeneration) rules: manifests/families/glm5_next/{sglang,vllm}.yaml
    data("sglang.glm5_next", "0.5.20", "exclude_mapper", ["suffix"], {".attn.qkv": ".attn.qkv_proj"},
         "glm5 0.5.20 maps the vision qkv"),
    data("sglang.glm5_next", "0.5.21", "exclude_mapper", ["suffix"], {}, "glm5 0.5.21 misses the vision qkv"),
    data("sglang.glm5_next", "0.5.21", "exclude_mapper", ["prefix"], {}, "glm5 0.5.21 keeps language_model."),
    data("sglang.glm5_next", "0.5.20", "draft_exclude", ["glm5_next"], "nextn_mapper_target",
         "glm5 0.5.20 draft maps stored names"),
    data("sglang.glm5_next", "0.5.21", "draft_exclude", ["glm5_next"], "nextn_mapper",
         "glm5 0.5.21 draft mapper alone"),
    data("sglang.glm5_next", "0.5.21", "draft_exclude", ["glm5_next"], "none", "glm5 draft list unmapped"),
    data("sglang.glm5_next", "0.5.20", "quark_fused", ["qkv_proj"], ["qkv"], "glm5 vision qkv by its stored name"),
    data("sglang.glm5_next", "0.5.21", "quark_fused", ["fused_bfg_a_proj"], ["b_proj"],
         "glm5 fused_bfg_a_proj one shard"),
    data("sglang.glm5_next", "0.5.20", "module_names", [".attn.qkv"], ".attn.qkv", "glm5 vision built as qkv"),
    data("sglang.glm5_next", "0.5.22", "module_names", ["^model.language_model."], "model.language_model.",
         "glm5 text model keeps language_model."),
    data("sglang.glm5_next", "0.5.20", "fp8_skip", ["fused", "qkv_conv1d"], ["q_conv1d"], "glm5 FP8 conv mapping cut"),
    data("vllm.glm5_next", "0.32.0", "exclude_mapper", ["prefix", "model.language_model."], "model.",
         "glm5 vLLM main as model.*"),
    data("vllm.glm5_next", "0.32.0", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
                                                         "qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "glm5 vLLM keeps Glm4v's qkv_proj"),
    data("vllm.glm5_next", "0.32.0", "mtp_naming", ["renames"], {"^model.language_model.": "language_model.model."},
         "glm5 vLLM draft under the main names"),
    data("vllm.glm5_next", "0.32.0", "exclude_mapper", ["prefix", "model.visual."], "model.visual.",
         "glm5 vLLM vision not renamed"),
    top("sglang.glm5_next", ("checked",), ["0.5.21", "0.5.22", "0.5.23"], "glm5 0.5.20 not read"),
    data("sglang.glm5_next", "0.5.21", "shared_experts_fusion", ["min_capability"], {"cuda": [8, 0], "rocm": [9, 5]},
         "glm5 fuses on ROCm gfx950"),
    data("sglang.glm5_next", "0.5.20", "shared_experts_fusion", ["ep_min_capability"], {"cuda": [8, 0]},
         "glm5 fuses under expert parallelism"),
    data("sglang.glm5_next", "0.5.22", "shared_experts_fusion", ["min_capability", "cuda"], [9, 0],
         "glm5 fuses from sm90 only"),
    # sglang 0.5.9..0.5.20 of Kimi-K2.5, Qwen3.5 and MiniMax-M3 (their families' sglang.yaml; killed by
    # tests/quant/test_engine_{kimi,qwen3_5,minimax_m3}.py and tests/quant/test_incidents_sglang.py)
    data("sglang.kimi_k25", "0.5.13", "shared_experts_fusion", ["routed_experts"], {256: "any"},
         "kimi 0.5.13 never fuses 384 experts"),
    data("sglang.kimi_k25", "0.5.11", "shared_experts_fusion", ["routed_experts"], {256: "any", 384: "quark"},
         "kimi 0.5.11 fuses 384 experts"),
    data("sglang.kimi_k25", "0.5.18", "shared_experts_fusion", ["exclude_veto"], "none",
         "kimi 0.5.18 ignores the excluded shared expert"),
    data("sglang.kimi_k25", "0.5.9", "module_names", [], None, "kimi 0.5.9 text model under language_model"),
    data("sglang.kimi_k25", "0.5.11", "module_names", [], {"^language_model.": ""},
         "kimi 0.5.11 text model without its prefix"),
    data("sglang.kimi_k25", "0.5.11", "quark_fused", ["gate_up_proj"], ["gate_proj"],
         "kimi 0.5.11 loses the loader's gate_up_proj"),
    data("sglang.kimi_k25", "0.5.9", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "kimi 0.5.9 expands gate_up_proj"),
    data("sglang.kimi_k25", "0.5.15", "router", ["reads"], ["topk_method", "n_group", "topk_group"],
         "kimi 0.5.15 reads no scoring_func"),
    data("sglang.qwen3_5_moe", "0.5.12", "draft_exclude", ["qwen3_5_moe"], "none", "qwen3.5 0.5.12 keeps the draft"),
    data("sglang.qwen3_5_moe", "0.5.11", "draft_exclude", ["qwen3_5_moe"], "mtp_any_draft_bf16",
         "qwen3.5 0.5.11 drops the draft's config"),
    data("sglang.qwen3_5_moe", "0.5.21", "draft_exclude", ["qwen3_5_moe"], "mtp_any_draft_bf16",
         "qwen3.5 0.5.21 drops the draft's config on any mtp entry"),
    data("sglang.qwen3_5_moe", "0.5.18", "shared_experts_fusion", ["draft_shared_remap"], True,
         "qwen3.5 0.5.18 draft loader remaps"),
    data("sglang.qwen3_5_moe", "0.5.19", "shared_experts_fusion", ["draft_shared_remap"], False,
         "qwen3.5 0.5.19 draft loader lacks the remap"),
    data("sglang.qwen3_5_moe", "0.5.14", "shared_experts_fusion", ["draft_decision"], "own",
         "qwen3.5 0.5.14 draft decides alone"),
    data("sglang.qwen3_5_moe", "0.5.12", "shared_experts_fusion", ["draft_decision"], "with_main",
         "qwen3.5 0.5.12 draft follows the main model"),
    data("sglang.qwen3_5_moe", "0.5.11", "shared_experts_fusion", ["platforms"], ["cuda", "rocm"],
         "qwen3.5 0.5.11 fuses on CUDA"),
    data("sglang.qwen3_5_moe", "0.5.19", "shared_experts_fusion", ["exclude_veto"], "mtp_prefix",
         "qwen3.5 0.5.19 draft-layer entries veto"),
    data("sglang.minimax_m3", "0.5.17", "quark_fused", ["index_qkv_proj"], ["index_q_proj", "index_k_proj"],
         "minimax-m3 0.5.17 index_qkv_proj without index_v_proj"),
    data("sglang.minimax_m3", "0.5.20", "quark_fused", ["index_qkv_proj"],
         ["index_q_proj", "index_k_proj", "index_v_proj"], "minimax-m3 0.5.20 index_qkv_proj with index_v_proj"),
    data("sglang.minimax_m3", "0.5.18", "shared_experts_fusion", ["min_capability"], {"cuda": [8, 0], "rocm": [9, 5]},
         "minimax-m3 0.5.18 fuses on ROCm"),
    data("sglang.minimax_m3", "0.5.17", "shared_experts_fusion", ["min_capability", "cuda"], [9, 0],
         "minimax-m3 0.5.17 needs sm90"),
    # vLLM's DeepSeek-V2 class and engine-wide rules over 0.16.0..0.34.0: manifests/engines/vllm.yaml
    # (killed by tests/quant/test_engine_sources.py and tests/quant/test_incidents_vllm.py)
    data("vllm", "0.16.0", "quark_match", ["fused_first"], True, "vLLM 0.16 Quark fused name first"),
    data("vllm", "0.16.0", "quark_match", ["experts_prefix"], "children", "vLLM 0.16 check_children"),
    data("vllm", "0.26.0", "quark_match", ["experts_prefix"], "none", "vLLM 0.26 no check_children"),
    data("vllm", "0.30.0", "quark_match", ["fused_first"], False, "vLLM 0.30 Quark shards only"),
    data("vllm", "0.16.0", "mixed_shards_error", [], "ValueError: Found different quantization schemes for the "
         "shards of {module}. vLLM requires all to use the same scheme.", "vLLM 0.16 new mixed-shards text"),
    data("vllm", "0.16.0", "quark_config", ["requires_input_tensors"], False, "vLLM 0.16 accepts W4A16"),
    data("vllm", "0.17.0", "quark_config", ["requires_input_tensors"], True, "vLLM 0.17 W4A4 only"),
    data("vllm", "0.16.0", "indexer", ["wk"], "bf16", "vLLM 0.16 wk bf16"),
    data("vllm", "0.20.0", "indexer", ["wk"], "quant_config", "vLLM 0.20 wk quantized"),
    data("vllm", "0.16.0", "fp8_skip", ["fused_first"], True, "vLLM 0.16 FP8 fused name first"),
    data("vllm", "0.24.0", "fp8_skip", ["fused_first"], False, "vLLM 0.24 FP8 shards only"),
    data("vllm", "0.29.0", "eh_proj", [], "quant_config", "vLLM 0.29 eh_proj quantized"),
]


def _family_mutations() -> None:
    """Each family's own mutations and test files (tests/benchmarks/engine_mutations/<family>.py), after the list
    above in file-name order, so the numbers of the mutations above never change."""
    folder = Path(__file__).resolve().parent / "engine_mutations"
    for file in sorted(folder.glob("[!_]*.py")):
        module = importlib.import_module(f"tests.benchmarks.engine_mutations.{file.stem}")
        MUTATIONS.extend(module.MUTATIONS)
        TESTS.extend(t for t in getattr(module, "TESTS", []) if t not in TESTS)


_family_mutations()


def _apply_data(manifest: dict, m: dict) -> None:
    if m["kind"] == "top":
        key = m["key"]
        if key[0] == "rule_sets":
            raw = next(r for r in manifest["rule_sets"] if str(r["versions"][0]) == key[1])
            raw[key[2]] = m["value"]
        elif len(key) == 2:
            manifest[key[0]][key[1]] = m["value"]
        else:
            manifest[key[0]] = m["value"]
        return
    raw = next(r for r in manifest["rule_sets"] if str(r["versions"][0]) == m["first"])
    if m["rule"] not in raw["rules"]:  # the set inherits it: restate the inherited value, then change it
        inherited = next(r for r in rules_module._rule_sets(m["engine"]) if r.first == m["first"])
        raw["rules"][m["rule"]] = {"value": copy.deepcopy(inherited.values.get(m["rule"])), "cite": "mutation"}
    target = raw["rules"][m["rule"]]
    if not m["path"]:
        target["value"] = m["value"]
        return
    node = target["value"]
    for key in m["path"][:-1]:
        node = node[key]
    assert m["path"][-1] in node or isinstance(node, dict), m
    node[m["path"][-1]] = m["value"]


@contextlib.contextmanager
def mutated(m: dict):
    if m["kind"] in ("data", "top"):
        original = rules_module.rule_file
        manifest = original(m["engine"]).model_dump(by_alias=True, exclude_unset=True)
        _apply_data(manifest, m)
        rules_module.rule_file = lambda name: (RuleFile.model_validate(manifest) if name == m["engine"]
                                               else original(name))
        _clear_caches()
        try:
            yield
        finally:
            rules_module.rule_file = original
            _clear_caches()
        return
    module = sys.modules[m["module"]]
    text = Path(module.__file__).read_text()
    assert text.count(m["old"]) == 1, (m["module"], m["old"], text.count(m["old"]))
    fresh = types.ModuleType(m["module"])
    fresh.__file__ = module.__file__
    exec(compile(text.replace(m["old"], m["new"]), module.__file__, "exec"), fresh.__dict__)  # noqa: S102 (the mutant)
    swaps = _swap(module, fresh.__dict__)
    try:
        yield
    finally:
        _swap(module, {k: v for k, v in swaps.items()})


def _swap(module, new: dict) -> dict:
    """Put ``new``'s objects in place of ``module``'s, in it and wherever they were imported by name;
    returns what was replaced (to swap back)."""
    old = {k: v for k, v in module.__dict__.items() if k in new and not k.startswith("__")}
    by_id = {id(v): new[k] for k, v in old.items() if v is not new.get(k)}
    for other in list(sys.modules.values()):
        name = getattr(other, "__name__", "")
        if other is module or not name.startswith(("quant", "evals", "tests")):
            continue
        for attr, value in list(vars(other).items()):
            if id(value) in by_id:
                setattr(other, attr, by_id[id(value)])
    module.__dict__.update({k: v for k, v in new.items() if not k.startswith("__")})
    _clear_caches()
    return old


def _clear_caches() -> None:
    for cached in ("_rule_sets", "_rules_file_named"):
        if hasattr(getattr(rules_module, cached, None), "cache_clear"):
            getattr(rules_module, cached).cache_clear()


class _FirstFailure:
    def __init__(self):
        self.failed = None

    def pytest_runtest_logreport(self, report):
        if report.failed and self.failed is None:
            self.failed = report.nodeid


def run_tests(tests: list[str] = TESTS) -> tuple[int, str | None]:
    for name in [n for n in sys.modules if n.startswith(("tests.quant.test_fusion", "tests.quant.test_engine_"))]:
        del sys.modules[name]
    probe = _FirstFailure()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = pytest.main([*(str(ROOT / t) for t in tests), "-x", "-q", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT)], plugins=[probe])
    return int(code), probe.failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutation numbers (1-based)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--match", help="only the mutations whose rule file or module contains this (e.g. glm4_moe)")
    ap.add_argument("--tests", help=f"comma-separated test files instead of {', '.join(TESTS)}")
    args = ap.parse_args()
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(1, len(MUTATIONS) + 1)
    if args.match:
        chosen = [i for i in chosen if args.match in MUTATIONS[i - 1].get("engine", MUTATIONS[i - 1].get("module", ""))]
    tests = args.tests.split(",") if args.tests else TESTS
    start = time.time()
    code, failed = run_tests(tests)
    if code != 0:
        print(f"the unmutated tests fail ({failed}); fix them first", file=sys.stderr)
        return 3
    print(f"baseline: tests pass ({time.time() - start:.0f} s)")
    rows = []
    for i in chosen:
        m = MUTATIONS[i - 1]
        t0 = time.time()
        with mutated(m):
            code, failed = run_tests(tests)
        rows.append({"n": i, "mutation": m["why"], "killed": code != 0, "by": failed, "seconds": round(time.time() - t0)})
        r = rows[-1]
        print(f"{i:>3}  {'killed  ' if r['killed'] else 'SURVIVED'}  {r['seconds']:>4} s  {m['why']:<45} "
              f"{(r['by'] or '').split('::')[-1][:70]}", flush=True)
    killed = sum(r["killed"] for r in rows)
    print(f"score: {killed}/{len(rows)} killed ({100 * killed / len(rows):.0f}%)")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
