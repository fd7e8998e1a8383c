"""Time and peak memory of the sensitivity pass, on the built-in example and per GLM-5-sized decoder layer.

    python3 -m tests.benchmarks.bench_sensitivity                      # CPU: the example, then GLM-5 slices
    python3 -m tests.benchmarks.bench_sensitivity --device cuda --experts 256 --tokens 4096   # a whole GLM-5 layer

1. The example: ``quant.sensitivity.run`` on arith's train split (``--items`` prompts), as ``quantize --ladder``
   runs it: seconds, seconds per layer, peak RSS.
2. One GLM-5 MoE decoder layer (``quant.example.glm5_config``: hidden 6144, MLA with 64 heads, the DSA indexer,
   top-8 routed experts of 2048, a shared expert) built in memory with random weights, measured by the pass's own
   ``measure_layer`` (the reference run and every unit at every rung) on ``--tokens`` calibration tokens. On a
   CPU a whole layer (256 experts, 19 GB of bf16) does not fit, so it is measured with fewer experts (``--experts``,
   each a separate run in this process): the routed matmuls are the same (top-8 of any count), what grows with the
   expert count is the weights' quantization and the experts loop, so the per-layer time at 256 experts is the
   line through the measured points. A run's peak is ``ru_maxrss`` (CPU) or the device's peak allocation.
   Reading the layer from disk is not in the figure: the projection adds the layer's bytes at ``--read-gbps``.
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
    per_prompt = 64
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
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16],
                        help="routed experts of the GLM-5 layers measured (default 8 16; GLM-5 has 256)")
    parser.add_argument("--tokens", type=int, default=256, help="calibration tokens per GLM-5 layer (default 256)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--read-gbps", type=float, default=2.0,
                        help="the source's read rate for the projection, GB/s (default 2: one NVMe drive)")
    parser.add_argument("--skip-example", action="store_true")
    args = parser.parse_args()
    if not args.skip_example:
        ex = bench_example(args.items)
        per_layer = ", ".join(f"{s:.1f}" for s in ex["seconds_per_layer"])
        print(f"example   {args.items} prompts, {ex['tokens']} tokens: {ex['seconds']:.1f} s (per layer {per_layer} s), "
              f"peak RSS {ex['peak_rss_gb']:.2f} GB")
    points = []
    for experts in args.experts:
        r = bench_glm5_layer(experts, args.tokens, args.device)
        points.append((experts, r["seconds"]))
        print(f"GLM-5 MoE layer, {experts} experts ({r['experts_hit']} routed to), {r['tokens']} tokens on "
              f"{args.device}: {r['seconds']:.1f} s, peak {r['peak_gb']:.2f} GB, layer {r['layer_gb']:.2f} GB bf16")
    if len(points) >= 2:
        (e0, t0), (e1, t1) = points[0], points[-1]
        per_expert = (t1 - t0) / (e1 - e0)
        at_256 = t0 + per_expert * (256 - e0)
        read = r["glm5_layer_gb"] / args.read_gbps
        total = (GLM5_LAYERS - GLM5_DENSE) * (at_256 + read)
        print(f"projection: {per_expert:.2f} s per expert -> {at_256:.0f} s per 256-expert layer + {read:.0f} s "
              f"reading its {r['glm5_layer_gb']:.1f} GB at {args.read_gbps} GB/s; "
              f"{GLM5_LAYERS - GLM5_DENSE} MoE layers: {total / 3600:.1f} h "
              f"on {args.device} at {args.tokens} tokens (the dense layers add little)")


if __name__ == "__main__":
    main()
