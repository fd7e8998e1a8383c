"""The precision ladder on the trained example: all-Linear W4A4 fails the gate, the ladder's choice passes it.

    nice -n 10 python3 -m tests.benchmarks.ladder_example [--limit N] [--workdir DIR] [--sensitivity FILE]
        [--error-budget X] [--json]

Writes the built-in trained example (``quantize --example``: DIR/bf16), and converts it three ways, every
decoder Linear (attention, dense MLP, shared and routed experts) in each:

- ``fp8``: block FP8 (``quantize --to fp8``), the reference a team builds, to compare bytes with;
- ``w4a4``: MXFP4 W4A4 with Quark's default scale rule (``manifests/recipes/mxfp4-all-linear.yaml``);
- ``ladder``: ``quantize --to mxfp4 --ladder --calibration arith`` (arith's TRAIN split, disjoint from the
  250 test items by hash) from that start, served by sglang 0.5.23 and vLLM 0.33.0 / 0.34.0 (``--serve``).

Then ``evals run --benchmarks arith`` on each and on bf16 (local, emulated as served), ``gate accuracy --policy
arith-example`` of each against bf16, and ``gate checkpoint --engine`` of the ladder's output for each served
release. Prints the table the README shows: per arm the Linears' bytes (every tensor of the laddered roles'
Linears: weights, scales, input scales), the checkpoint's bytes, accuracy, delta and bounds against bf16, verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

from tests.benchmarks.trained_example_gate import evaluate, gate

START = Path(__file__).resolve().parents[2] / "manifests" / "recipes" / "mxfp4-all-linear.yaml"
SERVED = ("sglang==0.5.23", "vllm==0.33.0", "vllm==0.34.0")
ARMS = ("bf16", "fp8", "w4a4", "ladder")
LADDERED_ROLES = ("attention", "dense_mlp", "shared_expert", "routed_expert")
SUFFIXES = (".weight", ".weight_scale", ".weight_scale_inv", ".input_scale")


def ladder_command(ex: Path, sensitivity: Path | None, error_budget: float | None) -> list[str]:
    serve = [arg for release in SERVED for arg in ("--serve", release)]
    return (["--to", "mxfp4", "--ladder", "--calibration", "arith", *serve]
            + (["--sensitivity", str(sensitivity)] if sensitivity else [])
            + (["--error-budget", str(error_budget)] if error_budget is not None else [])
            + [str(ex / "bf16"), str(ex / "ladder")])


def build(workdir: Path, sensitivity: Path | None, error_budget: float | None) -> dict[str, Path]:
    from quant.cli import main as quantize

    ex = workdir / "example"
    with contextlib.redirect_stdout(io.StringIO()):  # the conversions' own reports
        assert quantize(["--to", "mxfp4", "-q", "--example", str(ex)]) == 0
        assert quantize(["--to", "fp8", "-q", str(ex / "bf16"), str(ex / "fp8")]) == 0
        assert quantize(["--to", "mxfp4", "-q", "--recipe", str(START), str(ex / "bf16"), str(ex / "w4a4")]) == 0
        assert quantize(["-q", *ladder_command(ex, sensitivity, error_budget)]) == 0
    return {arm: ex / arm for arm in ARMS}


def linear_bytes(folder: Path) -> int:
    """Bytes of every stored tensor of the laddered roles' Linears (weights and their scales)."""
    from quant.checkpoint import Checkpoint, config_int
    from quant.layout import family_for

    checkpoint = Checkpoint.open(folder)
    family = family_for(checkpoint.config)
    layers = config_int(family.text_config(checkpoint.config), family.num_layers_key, checkpoint.config_path)
    total = 0
    for header in checkpoint.headers.values():
        for info in header.tensors.values():
            module = next((info.name.removesuffix(s) for s in SUFFIXES if info.name.endswith(s)), None)
            if module and family.classify(module + ".weight", layers).role in LADDERED_ROLES:
                total += info.nbytes
    return total


def checkpoint_loads(folder: Path) -> dict[str, int]:
    """``gate checkpoint --engine RELEASE`` of ``folder`` for each served release: its exit code (0: loads)."""
    from evals.cli import main as gate_main

    codes = {}
    for release in SERVED:
        with contextlib.redirect_stdout(io.StringIO()):
            codes[release] = gate_main(["checkpoint", str(folder), "--engine", release])
    return codes


def measure(workdir: Path, limit: int | None, sensitivity: Path | None, error_budget: float | None) -> dict:
    from evals.bundle import read_bundle

    models = build(workdir, sensitivity, error_budget)
    runs = workdir / "runs"
    seconds = evaluate(models, runs, limit, None)
    arms = {}
    for arm, model in models.items():
        run, rows = read_bundle(runs / arm)
        scores = [r["score"] for r in rows if r["filter"] == run["benchmarks"]["arith"]["primary_filter"]]
        manifest = json.loads((model / "conversion_manifest.json").read_text()) if arm != "bf16" else None
        arms[arm] = {"accuracy": round(sum(scores) / len(scores), 4), "n": len(scores), "eval_seconds": seconds[arm],
                     "linear_bytes": linear_bytes(model),
                     "checkpoint_bytes": manifest["summary"]["bytes_out"] if manifest else
                     sum(p.stat().st_size for p in model.glob("*.safetensors"))}
        if arm != "bf16":
            code, result = gate(runs, arm, "bf16")
            b = next(b for b in result["benchmarks"] if b["benchmark"] == "arith")
            arms[arm].update({"exit": code, **{k: b.get(k) for k in ("delta", "lower", "upper", "margin", "verdict")}})
    ladder = json.loads((models["ladder"] / "conversion_manifest.json").read_text())["ladder"]
    return {"arms": arms, "ladder": ladder, "gate_checkpoint": checkpoint_loads(models["ladder"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.benchmarks.ladder_example", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, help="items per run (default: all 250 arith test items)")
    p.add_argument("--workdir", type=Path, help="keep checkpoints and runs here (default: a temporary folder)")
    p.add_argument("--sensitivity", type=Path, help="reuse (or keep) the sensitivity pass's sidecar")
    p.add_argument("--error-budget", type=float, help="the ladder's --error-budget (default: its own)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qg-ladder-") as tmp:
        result = measure(args.workdir or Path(tmp), args.limit, args.sensitivity, args.error_budget)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from quant.ladder import describe
    from quant.rungs import RUNGS

    names = {"bf16": "bf16", "fp8": "FP8 block 128x128 (W8A8), every Linear", "w4a4": "MXFP4 W4A4, every Linear",
             "ladder": "ladder (start: MXFP4 W4A4, every Linear)"}
    print("| arm | Linear bytes | checkpoint bytes | accuracy (n) | delta vs bf16 | one-sided 95% bounds | verdict |")
    print("|---|---|---|---|---|---|---|")
    for arm, a in result["arms"].items():
        vs = f"{a['delta']:+.3f} | [{a['lower']:+.3f}, {a['upper']:+.3f}] | {a['verdict']}" if "delta" in a \
            else "- | - | (reference)"
        print(f"| {names[arm]} | {a['linear_bytes']:,} | {a['checkpoint_bytes']:,} | {a['accuracy']:.3f} ({a['n']}) "
              f"| {vs} |")
    print(f"\nladder: {describe(result['ladder'])}")
    for unit in result["ladder"]["units"]:
        print(f"  layer {unit['layer']} {unit['role']}: {RUNGS[unit['rung']].label} (W4A4 error "
              f"{unit['error']['mxfp4']:.4f}, at its rung {unit['error'].get(unit['rung'], 0.0):.4f})")
    for release, code in result["gate_checkpoint"].items():
        print(f"gate checkpoint --engine {release}: exit {code} ({'loads' if code == 0 else 'does NOT load'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
