"""How far each served scheme moves the built-in example from bf16: teacher-forced logits and greedy items.

    python -m tests.benchmarks.emulation_agreement [--dtype bfloat16] [--new-tokens 16] [--json]

Writes the built-in example (``quantize --example``), converts it to MXFP4 weight-only (W4A16),
MXFP4 (W4A4: weights and activations, the default recipe), and block FP8 (W8A8), and loads each
with ``evals.emulation.load_model`` (exact weight decode, activations quantize-dequantized as the
engines do). Against the bf16 checkpoint it prints, per scheme:
- teacher-forced, over every position of the prompts below: top-1 agreement with bf16 and the mean
  and 95th percentile of KL(bf16 || scheme) of the next-token distributions;
- item level: the share of prompts whose greedy continuation (``--new-tokens``) equals bf16's, and
  the share whose first generated token does.
The example's weights are random: the figures measure the emulation's numerics, not a model's accuracy.
Not a test: a measurement for the closing note.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

PROMPTS = [  # synthetic GSM8K-style items, written here
    "Question: Janet has 3 apples and buys 5 more. How many apples does she have?\nAnswer:",
    "Question: A box holds 12 pens. How many pens are in 7 boxes?\nAnswer:",
    "Question: Tom reads 20 pages a day for 6 days. How many pages does he read?\nAnswer:",
    "Question: A train travels 60 miles an hour for 3 hours. How far does it go?\nAnswer:",
    "Question: Sara had 45 stickers and gave away 17. How many are left?\nAnswer:",
    "Question: What is 12 times 7? Answer: 84. What is 9 times 8?\nAnswer:",
    "Question: A shirt costs 15 dollars and is 20 percent off. What does it cost?\nAnswer:",
    "Question: There are 4 rows of 9 chairs. How many chairs are there?\nAnswer:",
    "The quick brown fox jumps over the lazy dog 0123456789 times. The answer is",
    "A. alpha B. beta C. gamma D. delta. The best answer is",
    "Question: Mia saves 5 dollars a week. How much has she saved after 11 weeks?\nAnswer:",
    "Question: A baker makes 144 rolls and packs them 12 to a bag. How many bags?\nAnswer:",
    "Question: Leo is 3 times as old as his son, who is 9. How old is Leo?\nAnswer:",
    "Question: A garden is 8 meters by 5 meters. What is its area?\nAnswer:",
    "Question: 250 people attend; 40 percent are children. How many adults?\nAnswer:",
    "Question: Ann runs 2 miles each morning and 3 each evening. Miles in a week?\nAnswer:",
]
SCHEMES = {"W4A16": ("mxfp4", "--weight-only"), "W4A4": ("mxfp4",), "W8A8": ("fp8",)}


def build(workdir: Path) -> dict[str, Path]:
    from quant.cli import main as quantize

    bf16 = workdir / "bf16"
    with contextlib.redirect_stdout(io.StringIO()):  # the conversions' own reports
        assert quantize(["--to", "mxfp4", "-q", "--example", str(workdir / "example")]) == 0
        (workdir / "example" / "bf16").rename(bf16)
        paths = {"bf16": bf16}
        for name, (fmt, *flags) in SCHEMES.items():
            paths[name] = workdir / name
            assert quantize(["--to", fmt, "-q", *flags, str(bf16), str(paths[name])]) == 0
    return paths


def measure(reference, candidate, tokenizer, new_tokens: int) -> dict:
    kls, agree, same_items, same_first = [], [], 0, 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref_logp = reference(ids).logits[0].float().log_softmax(-1)
            cand_logp = candidate(ids).logits[0].float().log_softmax(-1)
            kls.append((ref_logp.exp() * (ref_logp - cand_logp)).sum(-1))
            agree.append(ref_logp.argmax(-1) == cand_logp.argmax(-1))
            gen = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
            ref_out = reference.generate(ids, **gen)[0, ids.shape[1]:]
            cand_out = candidate.generate(ids, **gen)[0, ids.shape[1]:]
        same_items += torch.equal(ref_out, cand_out)
        same_first += bool(ref_out[0] == cand_out[0])
    kl, agree = torch.cat(kls), torch.cat(agree).float()
    return {"positions": len(kl), "top1_agreement": round(agree.mean().item(), 4),
            "kl_mean": float(f"{kl.mean().item():.3g}"), "kl_p95": float(f"{kl.quantile(0.95).item():.3g}"),
            "items": len(PROMPTS), "item_agreement": round(same_items / len(PROMPTS), 4),
            "first_token_agreement": round(same_first / len(PROMPTS), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per item")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from evals.emulation import load_model

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(paths["bf16"])
        reference, _ = load_model(paths["bf16"], dtype=dtype)
        results = {}
        for name in SCHEMES:
            candidate, record = load_model(paths[name], dtype=dtype)
            results[name] = {**measure(reference, candidate, tokenizer, args.new_tokens),
                             "emulated_modules": {k: len(v) for k, v in record["modules"].items()}}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"built-in example vs bf16, compute dtype {args.dtype}; teacher-forced over "
          f"{next(iter(results.values()))['positions']} positions, {len(PROMPTS)} greedy items x {args.new_tokens} tokens")
    print(f"{'scheme':<7} {'top-1 agree':>11} {'KL mean':>9} {'KL p95':>9} {'items same':>10} {'first tok':>9}  modules")
    for name, r in results.items():
        print(f"{name:<7} {r['top1_agreement']:>11.4f} {r['kl_mean']:>9.3g} {r['kl_p95']:>9.3g} "
              f"{r['item_agreement']:>10.3f} {r['first_token_agreement']:>9.3f}  {r['emulated_modules']}")


if __name__ == "__main__":
    main()
