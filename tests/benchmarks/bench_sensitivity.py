"""Time and peak memory of the sensitivity pass, on the built-in example and per GLM-5-sized decoder layer.

    python3 -m tests.benchmarks.bench_sensitivity                 # CPU: the example, then three GLM-5 slices
    python3 -m tests.benchmarks.bench_sensitivity --device cuda --skip-example --points 64:1024 128:1024 256:4096

1. The example: ``quant.sensitivity.run`` on arith's train split (``--items`` prompts), as ``quantize --ladder``
   runs it: seconds, seconds per layer, peak RSS.
2. GLM-5 MoE decoder layers (``quant.example.glm5_config``: hidden 6144, MLA with 64 heads, the DSA indexer,
   top-8 routed experts of 2048, a shared expert) built in memory with random weights and measured by the pass's
   own ``measure_layer`` (the reference run and every unit at every rung) on random calibration activations.
   A whole layer (256 experts, 19 GB of bf16) does not fit this CPU, so each point (``--points EXPERTS:TOKENS``)
   has fewer experts: the routed matmuls are the same (top-8 of any count); what grows with the experts is the
   weights' quantization and the experts loop, with the tokens every matmul. Three points fit
   ``seconds = a + b x experts + c x tokens``, evaluated at 256 experts and ``--project-tokens``. Reading the
   layer from disk is not in the measured time: the projection adds its bytes at ``--read-gbps``. A point's
   peak is ``ru_maxrss`` of this process so far (CPU) or the device's peak allocation.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

GLM5_LAYERS, GLM5_DENSE = 78, 3  # GLM-5's decoder layers and its dense first layers (quant.example.glm5_config)


def bench_example(items: int) -> dict:
    from quant.example import write_example
    from quant.sensitivity import run

    with tempfile.TemporaryDirectory(prefix="bench-sensitivity-") as tmp:
        src = write_example(Path(tmp) / "bf16")
        sens = run(src, "arith", Path(tmp) / "sensitivity.json", items=items, device="cpu")
    return {"seconds": sens.seconds, "seconds_per_layer": sens.seconds_per_layer, "tokens": sens.calibration["tokens"],
            "peak_rss_gb": sens.peak_rss_bytes / 1e9}


def glm5_layer(experts: int, device: str, dtype=torch.bfloat16):
    """GLM-5's first MoE decoder layer with ``experts`` routed experts, random weights, and its config."""
    from transformers import GlmMoeDsaConfig

    from quant.example import glm5_config

    raw = glm5_config()
    raw.update({"n_routed_experts": experts, "num_hidden_layers": GLM5_DENSE + 1,
                "mlp_layer_types": ["dense"] * GLM5_DENSE + ["sparse"]})
    for key in ("layer_types", "indexer_types"):
        raw[key] = raw[key][:GLM5_DENSE + 1]
    config = GlmMoeDsaConfig(**raw)
    config._attn_implementation = "sdpa"
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRotaryEmbedding

    generator = torch.Generator(device).manual_seed(0)
    with torch.device(device):
        layer = GlmMoeDsaDecoderLayer(config, GLM5_DENSE).to(dtype)
        for name, param in layer.named_parameters():
            if "norm" not in name:
                param.data.normal_(0, 0.02, generator=generator)
        rotary = GlmMoeDsaRotaryEmbedding(config=config)
    return layer.eval(), config, rotary


def bench_glm5_layer(experts: int, tokens: int, device: str) -> dict:
    from quant.layout import family_named
    from quant.sensitivity import Batch, _context, layer_modules, measure_layer

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    layer, config, rotary = glm5_layer(experts, device)
    prefix = f"model.layers.{GLM5_DENSE}"
    modules = layer_modules(layer, prefix, family_named("glm_moe_dsa"), GLM5_DENSE + 1)
    per_prompt = min(64, tokens)  # tokens per calibration prompt
    generator = torch.Generator(device).manual_seed(1)
    batches = []
    for start in range(0, tokens, 16 * per_prompt):
        rows = min(16, (tokens - start) // per_prompt)
        hidden = torch.randn(rows, per_prompt, config.hidden_size, generator=generator, device=device)
        batches.append(Batch(hidden.to(torch.bfloat16), torch.ones(rows, per_prompt, dtype=torch.bool, device=device)))
    contexts = [_context(config, b, rotary) for b in batches]
    started = time.perf_counter()
    with torch.no_grad():
        units, probe, _ = measure_layer(layer, modules, prefix, batches, contexts, "prev_topk_indices")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    routed = layer.mlp.experts
    expert_bytes = sum(p.numel() * p.element_size() for p in (routed.gate_up_proj, routed.down_proj)) // experts
    return {"experts": experts, "tokens": tokens, "seconds": seconds, "peak_gb": peak / 1e9,
            "layer_gb": layer_bytes / 1e9, "glm5_layer_gb": (layer_bytes + (256 - experts) * expert_bytes) / 1e9,
            "units": [(u["role"], u["error"]) for u in units],
            "experts_hit": sum(1 for n in probe.expert_tokens if n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=64, help="the example's calibration prompts (default 64)")
    parser.add_argument("--points", nargs="+", default=["8:64", "16:64", "8:128"], metavar="EXPERTS:TOKENS",
                        help="the GLM-5 layers measured: routed experts and calibration tokens of each (default "
                             "8:64 16:64 8:128; GLM-5 has 256 experts; three points fit time = a + b x experts + "
                             "c x tokens)")
    parser.add_argument("--project-tokens", type=int, default=4096,
                        help="calibration tokens of the projected pass (default 4096: 64 prompts of 64)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--read-gbps", type=float, default=2.0,
                        help="the source's read rate for the projection, GB/s (default 2: one NVMe drive)")
    parser.add_argument("--skip-example", action="store_true")
    args = parser.parse_args()
    if not args.skip_example:
        ex = bench_example(args.items)
        per_layer = ", ".join(f"{s:.1f}" for s in ex["seconds_per_layer"])
        print(f"example   {args.items} prompts, {ex['tokens']} tokens: {ex['seconds']:.1f} s "
              f"(per layer {per_layer} s), peak RSS {ex['peak_rss_gb']:.2f} GB", flush=True)
    rows, times = [], []
    bench_glm5_layer(8, 16, args.device)  # warm-up, not counted: numba compiles its kernels, torch its paths
    for point in args.points:
        experts, tokens = map(int, point.split(":"))
        r = bench_glm5_layer(experts, tokens, args.device)
        rows.append([1.0, experts, tokens])
        times.append(r["seconds"])
        print(f"GLM-5 MoE layer, {experts} experts ({r['experts_hit']} routed to), {tokens} tokens on "
              f"{args.device}: {r['seconds']:.1f} s, peak {r['peak_gb']:.2f} GB, layer {r['layer_gb']:.2f} GB bf16",
              flush=True)
    if len(rows) >= 3:
        fit = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                 torch.tensor(times, dtype=torch.float64).unsqueeze(1)).solution.flatten().tolist()
        a, per_expert, per_token = fit
        layer = a + per_expert * 256 + per_token * args.project_tokens
        read = r["glm5_layer_gb"] / args.read_gbps
        total = (GLM5_LAYERS - GLM5_DENSE) * (layer + read)
        print(f"fit: {a:.1f} s + {per_expert:.3f} s per expert + {per_token * 1000:.2f} s per 1000 tokens; "
              f"one 256-expert layer at {args.project_tokens} tokens: {layer:.0f} s + {read:.0f} s reading its "
              f"{r['glm5_layer_gb']:.1f} GB at {args.read_gbps} GB/s; {GLM5_LAYERS - GLM5_DENSE} MoE layers: "
              f"{total / 3600:.1f} h on {args.device} (the 3 dense layers add little)", flush=True)


if __name__ == "__main__":
    main()
