"""Train the built-in example model on the arith benchmark's train split (CPU, minutes, fixed seeds).

    nice -n 10 python3 -m quant.example_train            # rewrites quant/example_model/

Steps: a byte-level BPE tokenizer with every digit its own token is trained on the train split;
a DeepSeek-V3-layout model (``quant.example.trained_config``) learns to write each answer after
``Question: ...\\nAnswer:`` (loss on the answer and the end-of-sequence token only, the prompt
being what ``evals run --benchmarks arith`` sends); the MTP layer then learns the next-next token
on top of the frozen model. The weights are stored once, in GLM-5 layout (the DeepSeek-V3 layout
is the same tensors without the indexer, whose top-k covers the whole context). Not run in CI:
the shipped weights are its output, and the test split's greedy accuracy is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from quant.example import (
    TRAINED_DIR,
    TRAINED_TOKENIZER,
    TRAINED_WEIGHTS,
    random_tensor,
    tensor_shapes,
    trained_config,
)

SEED = 0


def read_split(name: str) -> list[dict]:
    from evals.data import BUNDLED_DATA_DIR

    path = BUNDLED_DATA_DIR / "arith" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_of(row: dict) -> str:
    """What the arith task sends (evals/benchmarks/arith.yaml's doc_to_text, 0-shot)."""
    return f"Question: {row['question']}\nAnswer:"


def train_tokenizer(rows: list[dict], vocab_size: int):
    """Byte-level BPE; digits split one per token before merging, so every number is spelt digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([f"{prompt_of(r)} {r['answer']}" for r in rows], trainer=trainer)
    return tokenizer


def encode(tokenizer, rows: list[dict], eos: int) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + EOS, prompt length); the prompt's own encoding must be a prefix."""
    out = []
    for row in rows:
        prompt = tokenizer.encode(prompt_of(row)).ids
        full = tokenizer.encode(f"{prompt_of(row)} {row['answer']}").ids
        assert full[:len(prompt)] == prompt, row["id"]
        out.append((full + [eos], len(prompt)))
    return out


def batches(data: list[tuple[list[int], int]], batch: int, rng: random.Random, pad: int):
    while True:
        picked = rng.sample(data, batch)
        width = max(len(ids) for ids, _ in picked)
        ids = torch.full((batch, width), pad, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, (seq, n_prompt) in enumerate(picked):
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
        yield ids, labels


def learning_rate(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


class TinyDeepseekV3(torch.nn.Module):
    """DeepSeek-V3's forward (transformers 5.24 ``DeepseekV3ForCausalLM``: MLA with interleaved RoPE, sigmoid
    top-k router with normalised weights times ``routed_scaling_factor``, shared expert, RMSNorm in fp32)
    written for training speed: every routed expert runs on every token and unselected ones get weight 0
    (the same sum), right padding under a causal mask needs no padding mask. Parameters carry the
    checkpoint's names (``.`` as ``__``; routed experts stacked); ``tensors()`` unstacks them. A test
    checks its logits against transformers' model loaded from the written checkpoint."""

    def __init__(self, config: dict, layers: range | None = None, seed: int = SEED):
        super().__init__()
        self.c = c = config
        layers = range(c["num_hidden_layers"]) if layers is None else layers
        self.layers = list(layers)
        shapes = tensor_shapes(config)
        gen = torch.Generator().manual_seed(seed + self.layers[0])
        params = {}
        for name, (shape, _) in shapes.items():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is not None and int(layer) not in self.layers or ".experts." in name or ".indexer." in name:
                continue
            if layer is None and self.layers[0] != 0:
                continue  # the MTP layer shares the embedding and lm_head of the main model
            params[name] = torch.ones(shape) if name.endswith("norm.weight") else \
                torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.randn(shape, generator=gen) * 0.02
        for layer in self.layers:
            if layer < c["first_k_dense_replace"]:
                continue
            e, i, h = c["n_routed_experts"], c["moe_intermediate_size"], c["hidden_size"]
            for proj, shape in (("gate_proj", (e, i, h)), ("up_proj", (e, i, h)), ("down_proj", (e, h, i))):
                params[f"model.layers.{layer}.mlp.experts.{proj}"] = torch.randn(shape, generator=gen) * 0.02
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in params.items()})
        for name in [k for k in self.p if k.endswith("e_score_correction_bias")]:
            self.p[name].requires_grad_(False)  # noaux_tc's bias: a buffer in transformers, zero here
        dim = c["qk_rope_head_dim"]
        self.register_buffer("inv_freq", 1.0 / (c["rope_parameters"]["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)),
                             persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def norm(self, x, name):
        x = x.float()
        return self.w(name) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]))

    def rope(self, x, cos, sin):  # transformers' apply_rotary_pos_emb_interleave
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def attention(self, x, a, cos, sin):
        c, lin = self.c, torch.nn.functional.linear
        b, s, _ = x.shape
        heads, nope, rope, v_dim = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q = lin(self.norm(lin(x, self.w(a + "q_a_proj.weight")), a + "q_a_layernorm.weight"), self.w(a + "q_b_proj.weight"))
        q = q.view(b, s, heads, nope + rope).transpose(1, 2)
        q_pass, q_rot = q.split([nope, rope], dim=-1)
        kv_nope, k_rot = lin(x, self.w(a + "kv_a_proj_with_mqa.weight")).split([c["kv_lora_rank"], rope], dim=-1)
        kv = lin(self.norm(kv_nope, a + "kv_a_layernorm.weight"), self.w(a + "kv_b_proj.weight"))
        k_pass, v = kv.view(b, s, heads, nope + v_dim).transpose(1, 2).split([nope, v_dim], dim=-1)
        k_rot = self.rope(k_rot.view(b, 1, s, rope), cos, sin).expand(b, heads, s, rope)
        q = torch.cat([q_pass, self.rope(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_pass, k_rot], dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(nope + rope) ** -0.5)
        return lin(out.transpose(1, 2).reshape(b, s, heads * v_dim), self.w(a + "o_proj.weight"))

    def mlp(self, x, m):
        lin = torch.nn.functional.linear
        return lin(torch.nn.functional.silu(lin(x, self.w(m + "gate_proj.weight"))) * lin(x, self.w(m + "up_proj.weight")),
                   self.w(m + "down_proj.weight"))

    def moe(self, x, m):
        c = self.c
        scores = torch.nn.functional.linear(x.float(), self.w(m + "gate.weight")).sigmoid()
        chosen = (scores + self.w(m + "gate.e_score_correction_bias")).topk(c["num_experts_per_tok"], dim=-1)[1]
        weights = scores.gather(-1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        dense = torch.zeros_like(scores).scatter(-1, chosen, weights)  # [b, s, experts]
        e, i = c["n_routed_experts"], c["moe_intermediate_size"]
        gate = torch.nn.functional.linear(x, self.w(m + "experts.gate_proj").reshape(e * i, -1))
        up = torch.nn.functional.linear(x, self.w(m + "experts.up_proj").reshape(e * i, -1))
        act = (torch.nn.functional.silu(gate) * up).unflatten(-1, (e, i)) * dense[..., None]
        down = self.w(m + "experts.down_proj").permute(1, 0, 2).reshape(-1, e * i)  # [h, e * i]
        routed = torch.nn.functional.linear(act.flatten(-2), down)
        return routed + self.mlp(x, m + "shared_experts.")

    def layer(self, x, n, cos, sin):
        p = f"model.layers.{n}."
        x = x + self.attention(self.norm(x, p + "input_layernorm.weight"), p + "self_attn.", cos, sin)
        h = self.norm(x, p + "post_attention_layernorm.weight")
        return x + (self.mlp(h, p + "mlp.") if n < self.c["first_k_dense_replace"] else self.moe(h, p + "mlp."))

    def rotary(self, s):
        freqs = torch.arange(s).float()[:, None] * self.inv_freq
        return freqs.cos(), freqs.sin()

    def hidden(self, ids):
        x = torch.nn.functional.embedding(ids, self.w("model.embed_tokens.weight"))
        cos, sin = self.rotary(ids.shape[1])
        for n in self.layers:
            x = self.layer(x, n, cos, sin)
        return x

    def forward(self, ids):
        return torch.nn.functional.linear(self.norm(self.hidden(ids), "model.norm.weight"), self.w("lm_head.weight"))

    def mtp_forward(self, main: TinyDeepseekV3, hidden, next_ids):
        """This module as the MTP layer: from the main model's hidden state at t (after its final norm) and
        the embedding of token t+1, logits for token t+2 through the shared lm_head."""
        p = f"model.layers.{self.layers[0]}."
        emb = torch.nn.functional.embedding(next_ids, main.w("model.embed_tokens.weight"))
        x = torch.nn.functional.linear(torch.cat([self.norm(emb, p + "enorm.weight"), self.norm(hidden, p + "hnorm.weight")], -1),
                                       self.w(p + "eh_proj.weight"))
        cos, sin = self.rotary(x.shape[1])
        x = self.layer(x, self.layers[0], cos, sin)
        return torch.nn.functional.linear(self.norm(x, p + "shared_head.norm.weight"), main.w("lm_head.weight"))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in self.p.items():
            name = key.replace("__", ".")
            if ".experts." in name:
                prefix, proj = name.rsplit(".", 1)
                out.update({f"{prefix}.{e}.{proj}.weight": value[e] for e in range(value.shape[0])})
            else:
                out[name] = value
        return {k: v.detach() for k, v in out.items()}


def masked_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train(step_loss, params, data, steps: int, batch: int, lr: float, pad: int, seed: int, tag: str) -> None:
    rng = random.Random(seed)
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    started = time.time()
    for step, (ids, labels) in zip(range(steps), batches(data, batch, rng, pad)):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        loss = step_loss(ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"{tag} step {step:5d}  loss {loss.item():.4f}  {time.time() - started:6.0f} s", flush=True)


@torch.no_grad()
def greedy_accuracy(model: TinyDeepseekV3, tokenizer, rows: list[dict], eos: int, max_new: int = 48) -> float:
    """Greedy answers to ``rows`` scored like the arith task's flexible-extract filter (the last number).
    Prompts of one length are decoded as a batch (no padding needed), the whole sequence re-run per token."""
    import re

    by_length: dict[int, list[tuple[list[int], dict]]] = {}
    for row in rows:
        ids = tokenizer.encode(prompt_of(row)).ids
        by_length.setdefault(len(ids), []).append((ids, row))
    right = 0
    for group in by_length.values():
        ids = torch.tensor([i for i, _ in group])
        start = ids.shape[1]
        for _ in range(max_new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
            if (ids[:, start:] == eos).any(-1).all():
                break
        for out, (_, row) in zip(ids[:, start:].tolist(), group):
            text = tokenizer.decode(out[:out.index(eos)] if eos in out else out)
            numbers = re.findall(r"-?[0-9]+", text.split("Question:")[0])
            right += bool(numbers) and numbers[-1] == row["answer"].rsplit("#### ", 1)[1]
    return right / len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m quant.example_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=TRAINED_DIR, help="folder for the weights and tokenizer")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps of the main model")
    p.add_argument("--mtp-steps", type=int, default=100, help="optimizer steps of the MTP layer (0: left initialised)")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy machine)")
    p.add_argument("--eval-items", type=int, default=250, help="test items scored greedily at the end")
    p.add_argument("--init", type=Path, metavar="DIR",
                   help="continue from the weights and tokenizer an earlier run wrote in DIR (a second phase)")
    p.add_argument("--seed", type=int, default=SEED, help="random seed of the batches (and of the initial weights)")
    p.add_argument("--score-only", action="store_true", help="only score the weights already in --out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.score_only:
        return score(args.out, args.eval_items)

    train_rows = read_split("train.jsonl")
    config = trained_config("deepseek_v3")
    if args.init:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(args.init / TRAINED_TOKENIZER))
    else:
        tokenizer = train_tokenizer(train_rows, config["vocab_size"])
    eos, pad = tokenizer.token_to_id("<|eos|>"), tokenizer.token_to_id("<|pad|>")
    assert eos == config["eos_token_id"]
    data = encode(tokenizer, train_rows, eos)
    print(f"{len(data)} training sequences, longest {max(len(s) for s, _ in data)} tokens", flush=True)
    model = load_trained(args.init, config).train() if args.init else TinyDeepseekV3(config, seed=args.seed)
    print(f"{sum(t.numel() for t in model.parameters()):,} parameters", flush=True)
    train(lambda ids, labels: masked_loss(model(ids)[:, :-1], labels[:, 1:]), list(model.parameters()),
          data, args.steps, args.batch, args.lr, pad, args.seed, "main")
    tensors = model.tensors()
    if args.mtp_steps:
        mtp = TinyDeepseekV3(config, range(config["num_hidden_layers"], config["num_hidden_layers"] + 1), seed=args.seed)
        model.requires_grad_(False)

        def mtp_loss(ids, labels):
            with torch.no_grad():
                hidden = model.norm(model.hidden(ids), "model.norm.weight")
            logits = mtp.mtp_forward(model, hidden[:, :-1], ids[:, 1:])  # at t: h_t and token t+1
            return masked_loss(logits[:, :-1], labels[:, 2:])  # predicts token t+2

        train(mtp_loss, list(mtp.parameters()), data, args.mtp_steps, args.batch, args.lr, pad, args.seed + 1, "mtp")
        tensors.update(mtp.tensors())
    glm = trained_config("glm_moe_dsa")
    gen = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, (shape, dtype) in tensor_shapes(glm).items():  # the indexer (and an untrained MTP): initialised
        tensor = tensors[name] if name in tensors else random_tensor(name, shape, dtype, gen)
        assert tuple(tensor.shape) == shape, (name, tensor.shape, shape)
        weights[name] = tensor.to(dtype).contiguous()
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    tokenizer.save(str(args.out / TRAINED_TOKENIZER))
    save_file(weights, str(args.out / TRAINED_WEIGHTS), metadata={"format": "pt"})
    print(f"wrote {args.out}: {(args.out / TRAINED_WEIGHTS).stat().st_size / 1e6:.2f} MB", flush=True)
    return score(args.out, args.eval_items)


def load_trained(folder: Path, config: dict) -> TinyDeepseekV3:
    """The bf16 weights written in ``folder`` in the training forward (fp32 compute)."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / TRAINED_WEIGHTS))
    model = TinyDeepseekV3(config)
    with torch.no_grad():
        for key, param in model.p.items():
            name = key.replace("__", ".")
            if ".experts." in name:
                prefix, proj = name.rsplit(".", 1)
                param.copy_(torch.stack([weights[f"{prefix}.{e}.{proj}.weight"] for e in range(param.shape[0])]))
            else:
                param.copy_(weights[name])
    return model.eval()


def score(folder: Path, items: int) -> int:
    from tokenizers import Tokenizer

    config = trained_config("deepseek_v3")
    tokenizer = Tokenizer.from_file(str(folder / TRAINED_TOKENIZER))
    rows = read_split("test.jsonl")[:items]
    accuracy = greedy_accuracy(load_trained(folder, config), tokenizer, rows, config["eos_token_id"])
    print(f"greedy accuracy of the bf16 weights in {folder} on {len(rows)} test items: {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
