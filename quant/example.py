"""Tiny checkpoints with the real GLM-5 / DeepSeek-V3 tensor names, for tests and ``--example``.

Two kinds: the trained example (``write_example``, what ``quantize --example`` writes), a small
model trained on the arith benchmark (``quant/example_train.py`` reproduces its weights, shipped in
``quant/example_model``), and seeded random ones of any size (``write_checkpoint(tiny_config(...))``,
what most tests use). Shapes follow transformers' ``GlmMoeDsaConfig`` / ``DeepseekV3Config`` models (a test checks
names and shapes against transformers itself); the MTP layer at index ``num_hidden_layers``
(enorm, hnorm, eh_proj, shared_head.norm plus a full MoE decoder layer) is what the real
checkpoints carry and transformers ignores. Random values are seeded bf16, with a byte-level BPE
tokenizer trained offline on a built-in corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when tensors are made: quant.cli imports this module for FAMILIES
    import torch

FAMILIES = ("glm_moe_dsa", "deepseek_v3")
MLA_SIZES = ("tiny", "real")
# The attention sizes real MLA kernels accept (FlashMLA / aiter MLA decode need kv_lora_rank 512 and
# a 64-wide rope part): DeepSeek-V3's and GLM-5's published values. Everything else stays tiny.
REAL_MLA = {"deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                            "v_head_dim": 128, "q_lora_rank": 1536, "qk_head_dim": 192, "head_dim": 64},
            "glm_moe_dsa": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
                            "v_head_dim": 256, "q_lora_rank": 2048, "qk_head_dim": 256, "head_dim": 64,
                            "index_head_dim": 128}}
# The trained example (quant/example_train.py): its weights in GLM-5 layout and its tokenizer ship here.
TRAINED_DIR = Path(__file__).with_name("example_model")
TRAINED_WEIGHTS, TRAINED_TOKENIZER = "weights.safetensors", "tokenizer.json"
# Twice tiny_config's width: at hidden 64 the model reached only 0.42 on arith in 600 CPU steps.
TRAINED_SIZES: dict = {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 256}
# The arith prompts and answers take < 100 tokens; 512 bounds what an untrained or damaged model
# rambles (evals' generation budget is the context minus the longest prompt, evals/budget.py).
TRAINED_CONTEXT = 512
_CORPUS = [
    "Janet has 3 apples and buys 5 more. How many apples does she have? The answer is 8.",
    "Question: What is 12 times 7? Answer: 84. #### 84",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
    "A. alpha B. beta C. gamma D. delta. The best answer is (C).",
]


def tiny_config(family: str = "glm_moe_dsa", *, num_hidden_layers: int = 3, first_k_dense_replace: int = 1,
                n_routed_experts: int = 4, hidden_size: int = 64, moe_intermediate_size: int = 32,
                intermediate_size: int = 128, vocab_size: int = 384, num_nextn_predict_layers: int = 1,
                mla: str = "tiny") -> dict:
    """A config with every key the published GLM-5 / DeepSeek-V3 config.json carries (the engines'
    model code reads the router keys ``topk_method``, ``scoring_func``, ``n_group``, ``topk_group``),
    at tiny sizes; ``mla="real"`` uses the MLA sizes real kernels accept."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if mla not in MLA_SIZES:
        raise ValueError(f"unknown MLA sizes {mla!r}; choose one of {MLA_SIZES}")
    config = {
        "architectures": ["GlmMoeDsaForCausalLM" if family == "glm_moe_dsa" else "DeepseekV3ForCausalLM"],
        "model_type": family,
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "moe_intermediate_size": moe_intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_nextn_predict_layers": num_nextn_predict_layers,
        "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1,
        "n_routed_experts": n_routed_experts, "num_experts_per_tok": 2, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
        "qk_head_dim": 48, "head_dim": 16, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "first_k_dense_replace": first_k_dense_replace, "hidden_act": "silu",
        # 4096: GSM8K's 5-shot prompts take ~2,400 tokens of the tiny byte-level tokenizer, and the
        # evals' generation budget is the context minus the longest prompt (evals/budget.py)
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "dtype": "bfloat16", "initializer_range": 0.02,
        "use_cache": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1, "moe_layer_freq": 1,
    }
    if family == "glm_moe_dsa":
        config.update({
            "index_head_dim": 32, "index_n_heads": 2, "index_topk": 8,
            "mlp_layer_types": ["dense" if i < first_k_dense_replace else "sparse" for i in range(num_hidden_layers)],
            "layer_types": ["indexed_attention"] * num_hidden_layers,
            "indexer_types": ["full"] * num_hidden_layers,
            "pretraining_tp": 1, "rope_interleave": True, "indexer_rope_interleave": True,
        })
    else:
        config.update({"aux_loss_alpha": 0.001, "seq_aux": True})
    if mla == "real":
        config.update({k: v for k, v in REAL_MLA[family].items() if k in config})
    return config


def trained_config(family: str = "glm_moe_dsa") -> dict:
    """The trained example's config: ``tiny_config``'s layout (3 layers, the first dense, 4 routed experts
    top-2 + 1 shared, one MTP layer, tiny MLA) a little wider, with a 512-token context. For GLM-5 the
    indexer's top-k is the whole context: every key is selected, so the indexer changes nothing and the
    GLM-5 and DeepSeek-V3 layouts of the same weights compute the same (a test checks it)."""
    config = tiny_config(family, **TRAINED_SIZES)
    config.update({"num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": TRAINED_CONTEXT})
    if family == "glm_moe_dsa":
        config["index_topk"] = TRAINED_CONTEXT
    return config


def glm5_config() -> dict:
    """GLM-5's published dimensions: for full-size planning tests on sparse files."""
    config = tiny_config("glm_moe_dsa", num_hidden_layers=78, first_k_dense_replace=3, n_routed_experts=256,
                         hidden_size=6144, moe_intermediate_size=2048, intermediate_size=12288, vocab_size=154880)
    config.update({"num_attention_heads": 64, "num_key_value_heads": 64, "num_experts_per_tok": 8,
                   "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
                   "qk_head_dim": 256, "v_head_dim": 256, "head_dim": 64, "index_head_dim": 128,
                   "index_n_heads": 32, "index_topk": 2048, "max_position_embeddings": 202752})
    return config


def tensor_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the checkpoint, in storage order, with shape and dtype."""
    import torch

    c = config
    h, heads = c["hidden_size"], c["num_attention_heads"]
    bf16, f32 = torch.bfloat16, torch.float32
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((c["vocab_size"], h), bf16)}
    n_layers, n_mtp = c["num_hidden_layers"], c.get("num_nextn_predict_layers", 0)
    for layer in range(n_layers + n_mtp):
        p = f"model.layers.{layer}."
        if layer >= n_layers:
            shapes.update({p + "enorm.weight": ((h,), bf16), p + "hnorm.weight": ((h,), bf16),
                           p + "eh_proj.weight": ((h, 2 * h), bf16), p + "shared_head.norm.weight": ((h,), bf16)})
        a = p + "self_attn."
        shapes.update({
            p + "input_layernorm.weight": ((h,), bf16),
            a + "q_a_proj.weight": ((c["q_lora_rank"], h), bf16),
            a + "q_a_layernorm.weight": ((c["q_lora_rank"],), bf16),
            a + "q_b_proj.weight": ((heads * c["qk_head_dim"], c["q_lora_rank"]), bf16),
            a + "kv_a_proj_with_mqa.weight": ((c["kv_lora_rank"] + c["qk_rope_head_dim"], h), bf16),
            a + "kv_a_layernorm.weight": ((c["kv_lora_rank"],), bf16),
            a + "kv_b_proj.weight": ((heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]), bf16),
            a + "o_proj.weight": ((h, heads * c["v_head_dim"]), bf16),
        })
        if c["model_type"] == "glm_moe_dsa":
            i = a + "indexer."
            shapes.update({
                i + "wq_b.weight": ((c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"]), bf16),
                i + "wk.weight": ((c["index_head_dim"], h), bf16),
                i + "k_norm.weight": ((c["index_head_dim"],), bf16),
                i + "k_norm.bias": ((c["index_head_dim"],), bf16),
                i + "weights_proj.weight": ((c["index_n_heads"], h), bf16),
            })
        shapes[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        m = p + "mlp."
        if layer < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            shapes.update({m + "gate_proj.weight": ((inter, h), bf16), m + "up_proj.weight": ((inter, h), bf16),
                           m + "down_proj.weight": ((h, inter), bf16)})
            continue
        inter, n_exp = c["moe_intermediate_size"], c["n_routed_experts"]
        shapes.update({m + "gate.weight": ((n_exp, h), f32), m + "gate.e_score_correction_bias": ((n_exp,), f32)})
        for e in range(n_exp):
            x = f"{m}experts.{e}."
            shapes.update({x + "gate_proj.weight": ((inter, h), bf16), x + "up_proj.weight": ((inter, h), bf16),
                           x + "down_proj.weight": ((h, inter), bf16)})
        s_inter = inter * c["n_shared_experts"]
        s = m + "shared_experts."
        shapes.update({s + "gate_proj.weight": ((s_inter, h), bf16), s + "up_proj.weight": ((s_inter, h), bf16),
                       s + "down_proj.weight": ((h, s_inter), bf16)})
    shapes["model.norm.weight"] = ((h,), bf16)
    shapes["lm_head.weight"] = ((c["vocab_size"], h), bf16)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    import torch

    if name.endswith(("norm.weight",)):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(("norm.bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.05).to(dtype)


def write_tokenizer(dst: Path, vocab_size: int, context: int, trained: Path | None = None) -> None:
    """A byte-level BPE saved in transformers' layout: ``trained`` (a tokenizer.json), else one trained
    here on a built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if trained is not None:
        tokenizer = Tokenizer.from_file(str(trained))
        if tokenizer.get_vocab_size() != vocab_size:
            raise ValueError(f"{trained}: {tokenizer.get_vocab_size()} tokens, the config says {vocab_size}")
        _write_tokenizer_files(dst, tokenizer, context)
        return
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    _write_tokenizer_files(dst, tokenizer, context)


def _write_tokenizer_files(dst: Path, tokenizer, context: int) -> None:
    tokenizer.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "model_max_length": context,
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }, indent=2))


def write_checkpoint(dst: Path, config: dict, *, shard_bytes: int = 256 << 10, seed: int = 0,
                     overrides: dict[str, torch.Tensor] | None = None, tokenizer: Path | None = None) -> Path:
    """Write ``config`` as a sharded bf16 checkpoint with index, tokenizer and generation config.

    ``overrides`` replaces named tensors' values (edge cases, NaN injection in tests, trained weights);
    ``tokenizer`` is a tokenizer.json to ship instead of the built-in one.
    """
    import torch
    from safetensors.torch import save_file

    from quant.safe_files import make_folder

    dst = make_folder(Path(dst))  # never into a folder that is a link
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, (shape, dtype) in tensor_shapes(config).items():
        tensor = (overrides or {}).get(name)
        if tensor is None:
            tensor = random_tensor(name, shape, dtype, gen)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}, indent=2))
    write_tokenizer(dst, config["vocab_size"], config["max_position_embeddings"], tokenizer)
    return dst


def trained_weights(family: str = "glm_moe_dsa") -> dict[str, torch.Tensor]:
    """The trained example's tensors in ``family``'s layout: the shipped GLM-5 tensors, less the indexer
    for DeepSeek-V3 (which has none)."""
    from safetensors.torch import load_file

    weights = load_file(str(TRAINED_DIR / TRAINED_WEIGHTS))
    expected = tensor_shapes(trained_config(family))
    weights = {name: t for name, t in weights.items() if name in expected}
    wrong = sorted(n for n in expected if n not in weights or (tuple(weights[n].shape), weights[n].dtype) != expected[n])
    if wrong:  # never fill a gap with random values: the example must be the trained model or nothing
        raise ValueError(f"{TRAINED_DIR / TRAINED_WEIGHTS} does not match trained_config({family!r}) at {wrong[:3]}; "
                         "rerun python3 -m quant.example_train")
    return weights


def write_example(dst: Path, family: str = "glm_moe_dsa", *, trained: bool = True, **config_kwargs) -> Path:
    """The built-in example, a multi-shard checkpoint of ``family`` with an MTP layer: the trained model
    (arith benchmark), or with ``trained=False`` seeded random weights of ``tiny_config(family,
    **config_kwargs)`` (e.g. ``mla="real"``)."""
    if not trained:
        return write_checkpoint(dst, tiny_config(family, **config_kwargs))
    if config_kwargs:
        raise ValueError(f"the trained example has fixed sizes; {sorted(config_kwargs)} need trained=False")
    return write_checkpoint(dst, trained_config(family), overrides=trained_weights(family),
                            tokenizer=TRAINED_DIR / TRAINED_TOKENIZER)
