"""Each family's full-size layout from headers: `quantize --dry-run` on the bf16 release layout and
`gate checkpoint` on the MXFP4 layout the plan writes, both as sparse files (real safetensors headers
followed by holes: no disk, no tensor data), with the published config sizes.

    PYTHONPATH=. nice -n 15 python tests/benchmarks/family_full_size.py [--families glm4_moe,...] [--root DIR]

Names and shapes come from transformers' own modeling class built on the meta device at the real
sizes (a few layers; its fused 3-D expert tensors are split back into the release's per-expert
names, as save_pretrained does; Llama-4's stay fused, as its release stores them) and repeated over
every layer. Prints seconds and peak memory.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quant.safetensors_io import DTYPE_BYTES, numel
from tests.conftest import write_sparse_shards

# Published sizes (the releases' config.json; docs/reference.md §5b names the families).
REAL = {
    # zai-org/GLM-4.5: 92 layers (3 dense), 160 routed + 1 shared experts, MTP at 92
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1, "attention_bias": True, "partial_rotary_factor": 0.5, "n_group": 1,
        "topk_group": 1, "tie_word_embeddings": False}, ("gate_proj", "up_proj", "down_proj")),
    # Qwen/Qwen3-235B-A22B: 94 layers, 128 experts, top-8
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False}, ("gate_proj", "up_proj", "down_proj")),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers (3 Gated DeltaNet + 1 full attention, repeated),
    # 512 routed + 1 shared experts, top-10, one MTP draft layer under mtp.*
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
        "partial_rotary_factor": 0.25, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "tie_word_embeddings": False}, ("gate_proj", "up_proj", "down_proj")),
    # mistralai/Mixtral-8x22B-v0.1: 56 layers, 8 experts, top-2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "vocab_size": 32768, "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
        "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "tie_word_embeddings": False}, ("w1", "w3", "w2")),
    # MiniMaxAI/MiniMax-M2.5: 62 layers, 256 experts, top-8, 3 MTP modules
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
        "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True, "num_mtp_modules": 3,
        "use_qk_norm": True, "qk_norm_type": "per_layer", "tie_word_embeddings": False}, ("w1", "w3", "w2")),
}
# meta-llama/Llama-4-Maverick-17B-128E-Instruct and Llama-4-Scout-17B-16E-Instruct: 48 layers, MoE every
# interleave_moe_layer_step-th (Maverick 2: 128 routed experts, top-1, one shared expert, dense layers
# between; Scout 1: 16 experts, every layer), routed experts fused as the release stores them
# (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]); a 34-layer vision tower and projector
_LLAMA4_TEXT = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                "num_experts_per_tok": 1, "attention_chunk_size": 8192, "tie_word_embeddings": False}
_LLAMA4_VISION = {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34, "num_attention_heads": 16,
                  "image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
                  "projector_output_dim": 4096, "vision_output_dim": 4096}
LLAMA4 = {"llama4_maverick": {**_LLAMA4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2},
          "llama4_scout": {**_LLAMA4_TEXT, "num_local_experts": 16, "interleave_moe_layer_step": 1}}
MTP = {"glm4_moe": "num_nextn_predict_layers", "minimax_m2": "num_mtp_modules"}
# Families whose layers repeat a pattern of kinds (Qwen3-Next: full_attention_interval) and whose draft
# layer is stored under its own prefix (the release's config.json has no count: one draft layer)
PERIOD = {"qwen3_next": "full_attention_interval"}
MTP_PREFIX = {"qwen3_next": "mtp.layers.0."}
# transformers' module names that its save_pretrained writes under the release's (its weight conversions)
RELEASE_NAMES = {"mixtral": (".mlp.", ".block_sparse_moe."), "minimax_m2": (".mlp.", ".block_sparse_moe.")}
ST = {"torch.bfloat16": "BF16", "torch.float32": "F32"}


def llama4_layout(family: str) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Llama-4 at full size: transformers' Llama4ForConditionalGeneration on the meta device with one
    layer of each kind (its state_dict names are the release's, experts fused), the decoder layers
    repeated on the interleave_moe_layer_step grid."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = LLAMA4[family]
    step = text["interleave_moe_layer_step"]
    with torch.device("meta"):
        model = Llama4ForConditionalGeneration(Llama4Config(text_config={**text, "num_hidden_layers": step},
                                                            vision_config=_LLAMA4_VISION))
    per_layer: dict[int, list] = {}
    out = []
    for name, t in model.state_dict().items():
        m = re.match(r"language_model\.model\.layers\.(\d+)\.(.+)$", name)
        (per_layer.setdefault(int(m.group(1)), []).append((m.group(2), "BF16", tuple(t.shape))) if m
         else out.append((name, "BF16", tuple(t.shape))))
    for i in range(text["num_hidden_layers"]):
        out += [(f"language_model.model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[i % step]]
    config = Llama4Config(text_config=text, vision_config=_LLAMA4_VISION, tie_word_embeddings=False).to_dict()
    return {**config, "architectures": ["Llama4ForConditionalGeneration"], "torch_dtype": "bfloat16"}, out


def layout(family: str) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """(config.json, [(name, dtype, shape)]) of the family's release at full size."""
    import torch
    import transformers

    config_cls, model_cls, sizes, (gate, up, down) = REAL[family]
    layers, mtp = sizes["num_hidden_layers"], sizes.get(MTP.get(family, ""), 0)
    dense = sizes.get("first_k_dense_replace", 0)
    period = sizes.get(PERIOD.get(family, ""), 1)
    template_layers = dense + period + (1 if mtp else 0)  # one of each kind of layer
    config = getattr(transformers, config_cls)(**{**sizes, "num_hidden_layers": template_layers})
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    per_layer: dict[int, list] = {}
    top = []
    for name, t in model.state_dict().items():
        shape, dtype = tuple(t.shape), ST[str(torch.bfloat16 if t.dtype == torch.bfloat16 else t.dtype)]
        dtype = "BF16" if t.dtype in (torch.float16, torch.bfloat16, torch.float32) and "correction_bias" not in name \
            else dtype
        if family in RELEASE_NAMES:
            name = name.replace(*RELEASE_NAMES[family])
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        entries = [(name, dtype, shape)]
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate, up [I, H]
            e, two_i, h = shape
            entries = [(f"{name[:-len('gate_up_proj')]}{x}.{proj}.weight", dtype, (two_i // 2, h))
                       for x in range(e) for proj in (gate, up)]
        elif name.endswith("experts.down_proj"):  # [E, H, I] -> per expert down [H, I]
            entries = [(f"{name[:-len('down_proj')]}{x}.{down}.weight", dtype, shape[1:]) for x in range(shape[0])]
        if m:
            per_layer.setdefault(int(m.group(1)), []).extend(
                (re.sub(r"^model\.layers\.\d+\.", "", n), d, s) for n, d, s in entries)
        else:
            top.extend(entries)
    out = list(top)
    for i in range(layers + mtp):
        kind = (0 if i < dense else dense + (i - dense) % period) if i < layers else template_layers - 1
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[kind]]
    if family in MTP_PREFIX:  # the draft: a full-attention MoE layer (the pattern's last) beside fc and norms
        h, p = sizes["hidden_size"], MTP_PREFIX[family]
        out += [(p + rest, d, s) for rest, d, s in per_layer[template_layers - 1]]
        out += [("mtp.fc.weight", "BF16", (h, 2 * h))] + [(f"mtp.{n}.weight", "BF16", (h,)) for n in
                                                          ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    if family == "glm4_moe":  # the MTP layer's own tensors (transformers does not build them)
        h, v = sizes["hidden_size"], sizes["vocab_size"]
        p = f"model.layers.{layers}."
        out += [(p + "eh_proj.weight", "BF16", (h, 2 * h)), (p + "enorm.weight", "BF16", (h,)),
                (p + "hnorm.weight", "BF16", (h,)), (p + "shared_head.norm.weight", "BF16", (h,)),
                (p + "shared_head.head.weight", "BF16", (v, h)), (p + "embed_tokens.weight", "BF16", (v, h))]
    saved = {**config.to_dict(), **sizes, "architectures": [model_cls], "torch_dtype": "bfloat16"}
    if family in PERIOD:  # the release states the interval only (the template's layer_types are 4 layers')
        saved.pop("layer_types", None)
    return saved, out


# MiniMaxAI/MiniMax-M3: 60 layers (3 dense, full attention; 57 MoE with sparse attention), 128
# routed + 1 shared experts, top-4, one MTP module; a 32-layer CLIP vision tower (transformers' defaults)
M3_TEXT = {"vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288,
           "shared_intermediate_size": 3072, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
           "num_local_experts": 128, "num_experts_per_tok": 4, "index_n_heads": 4, "index_head_dim": 128}
M3_LAYERS, M3_DENSE = 60, 3


def layout_minimax_m3() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """MiniMax-M3 at full size: transformers' MiniMaxM3SparseForConditionalGeneration on the meta
    device with one dense, one MoE and one MTP-template layer, its names reverted to the release's by
    transformers' own revert_weight_conversion (what save_pretrained writes), repeated over the layers."""
    import torch
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import tiny_builder

    kinds = ["dense", "sparse", "sparse"]  # layer 0: dense; 1: MoE; 2: the MTP module's template
    text = {**M3_TEXT, "num_hidden_layers": 3, "mlp_layer_types": kinds,
            "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]}
    config = MiniMaxM3VLConfig(text_config=text, vision_config={}, projector_hidden_size=6144)
    with torch.device("meta"):
        model = MiniMaxM3SparseForConditionalGeneration(config)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    per_layer: dict[int, list] = {}
    out = []
    for name, t in state.items():
        dtype = "F32" if "correction_bias" in name else "BF16"
        m = re.match(r"language_model\.model\.layers\.(\d+)\.(.+)$", name)
        if m:
            per_layer.setdefault(int(m.group(1)), []).append((m.group(2), dtype, tuple(t.shape)))
        else:
            out.append((name, dtype, tuple(t.shape)))
    for i in range(M3_LAYERS):
        out += [(f"language_model.model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[0 if i < M3_DENSE else 1]]
    h, mtp = M3_TEXT["hidden_size"], "language_model.model.mtp.layers.0."
    out += [(mtp + "transformer_layer." + rest, d, s) for rest, d, s in per_layer[2]]
    out += [(mtp + "eh_proj.weight", "BF16", (h, 2 * h))] + [(mtp + f"{n}.weight", "BF16", (h,))
                                                            for n in ("enorm", "hnorm", "final_layernorm")]
    saved = {**config.to_dict(), "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "torch_dtype": "bfloat16"}
    freq = ["dense"] * M3_DENSE + ["sparse"] * (M3_LAYERS - M3_DENSE)
    saved["text_config"].update(num_hidden_layers=M3_LAYERS, mlp_layer_types=freq, layer_types=list(freq))
    tiny_builder("minimax_m3").release_config(saved, None, M3_LAYERS)
    return saved, out


# openai/gpt-oss-120b's sizes (a bf16 derivative: the release's config less its quantization_config):
# 36 layers alternating sliding (128) and full attention, 128 experts, top-4, experts stored fused
GPT_OSS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
           "sliding_window": 128, "max_position_embeddings": 131072, "tie_word_embeddings": False}
GPT_OSS_LAYERS = 36


def layout_gpt_oss() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """gpt-oss-120b at full size: transformers' GptOssForCausalLM on the meta device with one layer
    (its state_dict names are the release's: fused experts.gate_up_proj [E, H, 2I], down_proj [E, I, H]
    and their biases), repeated over the layers."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**GPT_OSS, num_hidden_layers=1, layer_types=["sliding_attention"]))
    out, layer = [], []
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.0."):
            layer.append((name[len("model.layers.0."):], "BF16", tuple(t.shape)))
        else:
            out.append((name, "BF16", tuple(t.shape)))
    for i in range(GPT_OSS_LAYERS):
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in layer]
    kinds = ["sliding_attention", "full_attention"] * (GPT_OSS_LAYERS // 2)
    config = GptOssConfig(**GPT_OSS, num_hidden_layers=GPT_OSS_LAYERS, layer_types=kinds)
    saved = {**config.to_dict(), "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16"}
    saved.pop("quantization_config", None)
    return saved, out


# Qwen/Qwen3.5-397B-A17B: 60 layers (3 Gated DeltaNet + 1 full attention, repeated), 512 routed experts
# (moe_intermediate_size 1024: gate_up_proj [512, 2048, 4096] is 8.6 GB) + 1 shared expert, top-10, a
# 27-block vision tower, one MTP draft layer under mtp.* (its experts per expert)
QWEN3_5_TEXT = {"vocab_size": 248320, "hidden_size": 4096, "moe_intermediate_size": 1024,
                "shared_expert_intermediate_size": 1024, "num_hidden_layers": 60, "num_attention_heads": 32,
                "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 64, "full_attention_interval": 4,
                "mtp_num_hidden_layers": 1}
QWEN3_5_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096}


def layout_qwen3_5_moe() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """Qwen3.5-397B-A17B at full size: transformers' Qwen3_5MoeForConditionalGeneration on the meta
    device with one period of layers (its parameters are the release's fused experts, gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]), repeated over the layers; the full-attention layer again as the
    draft, mtp.layers.0.*, with its experts per expert, plus mtp.fc and its norms."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text, period = QWEN3_5_TEXT, QWEN3_5_TEXT["full_attention_interval"]
    kinds = ["full_attention" if (i + 1) % period == 0 else "linear_attention" for i in range(text["num_hidden_layers"])]
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
            text_config={**text, "num_hidden_layers": period, "layer_types": kinds[:period]},
            vision_config=QWEN3_5_VISION))
    per_layer: dict[int, list] = {}
    out = []
    for name, t in model.state_dict().items():
        m = re.match(r"model\.language_model\.layers\.(\d+)\.(.+)$", name)
        (per_layer.setdefault(int(m.group(1)), []).append((m.group(2), "BF16", tuple(t.shape))) if m
         else out.append((name, "BF16", tuple(t.shape))))
    for i in range(text["num_hidden_layers"]):
        out += [(f"model.language_model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[i % period]]
    h, inter = text["hidden_size"], text["moe_intermediate_size"]
    for rest, d, s in per_layer[period - 1]:
        if rest.startswith("mlp.experts."):
            continue
        out.append((f"mtp.layers.0.{rest}", d, s))
    for e in range(text["num_experts"]):
        out += [(f"mtp.layers.0.mlp.experts.{e}.{proj}.weight", "BF16", shape)
                for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))]
    out += [("mtp.fc.weight", "BF16", (h, 2 * h))] + [(f"mtp.{n}.weight", "BF16", (h,))
                                                       for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    config = Qwen3_5MoeConfig(text_config={**text, "layer_types": kinds}, vision_config=QWEN3_5_VISION,
                              tie_word_embeddings=False).to_dict()
    config["text_config"].update(full_attention_interval=period, mtp_num_hidden_layers=1)
    return {**config, "architectures": ["Qwen3_5MoeForConditionalGeneration"], "torch_dtype": "bfloat16"}, out


# deepseek-ai/DeepSeek-V4-Flash's sizes as transformers 5.24's DeepseekV4Config defaults them (its
# checkpoint deepseek-ai/DeepSeek-V4-Flash-Base): 43 layers (2 heavily compressed, then compressed
# sparse and heavily compressed alternating; the first 3 routed by the hash table), 256 routed + 1 shared
# experts, top-6, head_dim 512, hc_mult 4, one MTP module stored as mtp.0.*
V4_LAYERS = 43


def layout_deepseek_v4() -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """DeepSeek-V4 at full size: transformers' DeepseekV4ForCausalLM on the meta device with every
    layer plus one for the MTP module, its names reverted by transformers' own revert_weight_conversion
    and then made the release's (tests/quant/family_checkpoints.py: unprefixed, attn.kv_norm, the last
    layer as mtp.0.* with its e_proj / h_proj, norms and hc_head_*)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from tests.quant.family_checkpoints import tiny_builder

    default = DeepseekV4Config(num_hidden_layers=V4_LAYERS)
    config = DeepseekV4Config(num_hidden_layers=V4_LAYERS + 1, tie_word_embeddings=False,
                              layer_types=[*default.layer_types, "sliding_attention"],
                              mlp_layer_types=[*default.mlp_layer_types, "moe"])
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    tiny = tiny_builder("deepseek_v4")
    state = tiny.release(revert_weight_conversion(model, dict(model.state_dict())), config, V4_LAYERS, 0)
    out = [(name, "I64" if name.endswith("tid2eid") else "BF16", tuple(t.shape)) for name, t in state.items()]
    saved = {**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"], "torch_dtype": "bfloat16"}
    tiny.release_config(saved, config, V4_LAYERS)
    return saved, out


LAYOUTS = {"minimax_m3": layout_minimax_m3,  # families whose release layout is not REAL's pattern
           "deepseek_v4": layout_deepseek_v4,
           "gpt_oss": layout_gpt_oss, "qwen3_5_moe": layout_qwen3_5_moe,
           **{name: (lambda name=name: llama4_layout(name)) for name in LLAMA4}}


def write_sparse(dst: Path, config: dict, entries, shard_bytes: int = 5 << 30) -> int:
    """The layout in shards of about ``shard_bytes`` each (as releases shard), headers and holes."""
    chunks, size = [[]], 0
    for entry in entries:
        nbytes = DTYPE_BYTES[entry[1]] * numel(entry[2])
        if chunks[-1] and size + nbytes > shard_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += nbytes
    claimed = write_sparse_shards(dst, config, chunks)
    (dst / "tokenizer.json").write_text("{}")
    return claimed


def timed(command: list[str]) -> tuple[int, float, str]:
    start = time.time()
    # peak memory: the child's VmHWM (ru_maxrss would carry this parent's high-water mark across exec)
    done = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = sys.argv[1:]; "
                           "code = 0\ntry: runpy.run_module(sys.argv[0], run_name='__main__')\n"
                           "except SystemExit as e: code = e.code or 0\n"
                           "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
                           "print('PEAK_KB', hwm, file=sys.stderr); "
                           "sys.exit(code)", *command], capture_output=True, text=True, check=False)
    peak = re.search(r"PEAK_KB (\d+)", done.stderr)
    return done.returncode, time.time() - start, f"{int(peak.group(1)) // 1024} MB" if peak else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join([*REAL, *LAYOUTS]))
    ap.add_argument("--root", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for family in args.families.split(","):
            config, entries = LAYOUTS[family]() if family in LAYOUTS else layout(family)
            src = Path(tmp) / family / "bf16"
            claimed = write_sparse(src, config, entries)
            code, seconds, peak = timed(["quant.cli", "--to", "mxfp4", "--dry-run", "-q", "--json", str(src),
                                         str(Path(tmp) / family / "out")])
            # the MXFP4 output's layout, from the plan: headers the converter would write, holes for data
            from quant.plan import make_plan
            from quant.recipe import load_recipe
            plan = make_plan(src, load_recipe(None, "mxfp4"))
            out = Path(tmp) / family / "mxfp4"
            write_sparse(out, plan.output_config(), [e for s in plan.shards for e in s.entries])
            gcode, gseconds, gpeak = timed(["evals.cli", "checkpoint", "--engine", "sglang==0.5.23", str(out)])
            vcode, vseconds, vpeak = timed(["evals.cli", "checkpoint", "--engine", "vllm", str(out)])
            print(f"{family:<11} {len(entries):>6} tensors {claimed / 1e12:5.2f} TB bf16 | quantize --dry-run exit "
                  f"{code} {seconds:5.1f} s {peak} | gate checkpoint sglang==0.5.23 exit {gcode} {gseconds:5.1f} s "
                  f"{gpeak}, vllm exit {vcode} {vseconds:5.1f} s {vpeak}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
