"""dots.note's (dots3_note) rule mutations: each changes one rule value read in the wheels; the family's
differential tests must kill it."""

from tests.benchmarks.engine_mutations import data

TESTS = ["tests/quant/test_engine_dots3_note.py"]

S, V = "sglang.dots3_note", "vllm.dots3_note"
QKV_A_G = {"fused_qkv_a_g_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"]}
MUTATIONS = [
    data(S, "0.5.19", "module_names", [], {"^model.": "model."}, "dots3 sglang text model without the thinker prefix"),
    data(S, "0.5.19", "exclude_mapper", [], {"kinds": ["quark", "fp8"], "style": "sglang",
                                             "prefix": {"model.": "thinker.language_model.model."}},
         "dots3 sglang maps the exclude list"),
    data(S, "0.5.19", "quark_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"],
                                          "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "dots3 sglang Quark without the q/kv/g fusion"),
    data(S, "0.5.19", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]}, "dots3 sglang q/kv/g apart"),
    data(S, "0.5.19", "fp8_skip", ["fused"], QKV_A_G, "dots3 sglang FP8 with the class mapping"),
    data(S, "0.5.19", "mtp_naming", ["decoder_as"], "model.decoder.", "dots3 sglang draft decoder as DeepSeek's"),
    data(S, "0.5.19", "mtp_naming", ["top_level_as"], "model.", "dots3 sglang draft eh_proj as model.eh_proj"),
    data(S, "0.5.19", "mtp_naming", ["top_level"], [], "dots3 sglang draft eh_proj under the decoder"),
    data(S, "0.5.19", "draft_exclude", ["dots3_note"], "nextn_mapper", "dots3 sglang draft mapper"),
    data(S, "0.5.19", "eh_proj", [], "plain", "dots3 sglang eh_proj plain"),
    data(S, "0.5.19", "indexer", ["wq_b"], "bf16", "dots3 sglang indexer wq_b bf16"),
    data(S, "0.5.19", "indexer", ["wk_fused_bf16_on_cuda"], False, "dots3 sglang indexer wk never fused"),
    data(S, "0.5.19", "indexer", ["interleaved_always"], False, "dots3 sglang indexer rope from config.json"),
    data(S, "0.5.19", "unquantized_roles", [], ["lm_head", "mtp_head", "vision", "audio_tower"],
         "dots3 sglang router quantized"),
    data(S, "0.5.19", "shared_experts_fusion", ["routed_experts"], "any", "dots3 sglang fuses any expert count"),
    data(S, "0.5.19", "shared_experts_fusion", ["min_capability"], {"cuda": [9, 0]}, "dots3 sglang fuses sm90+"),
    data(S, "0.5.19", "shared_experts_fusion", ["ep_min_capability"], {"cuda": [8, 0]},
         "dots3 sglang fuses under expert parallelism"),
    data(S, "0.5.19", "shared_experts_fusion", ["arch"], {"dots3_note": "Dots3NoteForConditionalGeneration"},
         "dots3 sglang fusion architecture"),
    data(S, "0.5.19", "shared_experts_fusion", ["min_capability"], {"cuda": [8, 0], "rocm": [9, 4]},
         "dots3 sglang fuses on ROCm"),
    data(V, "0.28.0", "module_names", [], {"^model.": "model."}, "dots3 vLLM text model without language_model"),
    data(V, "0.28.0", "exclude_mapper", ["prefix"], {"lm_head.": "language_model.lm_head."},
         "dots3 vLLM mapper leaves model.* entries"),
    data(V, "0.28.0", "quark_fused", [], {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
         "dots3 vLLM Quark expands fused_qkv_a_proj"),
    data(V, "0.28.0", "built_fused", [], {"gate_up_proj": ["gate_proj", "up_proj"]}, "dots3 vLLM q/kv apart"),
    data(V, "0.28.0", "fp8_skip", ["fused"], {"gate_up_proj": ["gate_proj", "up_proj"]},
         "dots3 vLLM FP8 with a class mapping"),
    data(V, "0.28.0", "mtp_naming", ["renames"], {"^model.layers.": "language_model.model.layers."},
         "dots3 vLLM draft under language_model"),
    data(V, "0.28.0", "draft_exclude", ["dots3_note"], "nextn_mapper", "dots3 vLLM draft mapper"),
    data(V, "0.28.0", "eh_proj", [], "plain", "dots3 vLLM eh_proj plain"),
    data(V, "0.28.0", "indexer", ["wk"], "quant_config", "dots3 vLLM indexer wk with the quant config"),
    data(V, "0.28.0", "indexer", ["wq_b"], "bf16", "dots3 vLLM indexer wq_b bf16"),
    data(V, "0.28.0", "unquantized_roles", [], ["lm_head", "mtp_head", "vision", "audio_tower"],
         "dots3 vLLM router quantized"),
]
