"""The gate on the trained example: bf16, FP8, MXFP4 (default recipe) and a damaging conversion, scored on arith.

    nice -n 10 python3 -m tests.benchmarks.trained_example_gate [--limit N] [--workdir DIR] [--json]

Writes the built-in trained example (``quantize --example``: DIR/bf16 and its default MXFP4
conversion, routed experts W4A4), the block-FP8 reference (``quantize --to fp8``) and a
deliberately damaging conversion (``DAMAGING_RECIPE``: every decoder Linear, attention and dense
MLP and shared experts too, MXFP4 W4A4 with the floor scale rule, which clips each block's
largest values), runs ``evals run --benchmarks arith`` on each (local, emulated as served), and
asks ``gate accuracy`` (policy ``POLICY``) three questions: FP8 vs bf16, MXFP4 vs FP8, damaged vs FP8. Prints each
arm's accuracy and each comparison's paired delta, one-sided bounds and verdict, at the policy's
margin. ``tests/evals/test_trained_example.py`` runs the same on fewer items in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

DAMAGING_RECIPE = Path(__file__).with_name("mxfp4-all-linear-floor.yaml")
# arith required, margin 0.025 as GSM8K's; shipped with the package, `--policy arith-example` by name
POLICY = Path(__file__).resolve().parents[2] / "manifests" / "gates" / "arith-example.yaml"
ARMS = ("bf16", "fp8", "mxfp4", "damaged")
COMPARISONS = (("fp8", "bf16"), ("mxfp4", "fp8"), ("damaged", "fp8"))  # (candidate, reference)


def build(workdir: Path, arms: tuple[str, ...] = ARMS) -> dict[str, Path]:
    """The checkpoints of ``arms`` (bf16 and mxfp4 always come together, from ``--example``),
    written under ``workdir``."""
    from quant.cli import main as quantize

    ex = workdir / "example"
    with contextlib.redirect_stdout(io.StringIO()):  # the conversions' own reports
        assert quantize(["--to", "mxfp4", "-q", "--example", str(ex)]) == 0
        if "fp8" in arms:
            assert quantize(["--to", "fp8", "-q", str(ex / "bf16"), str(ex / "fp8")]) == 0
        if "damaged" in arms:
            assert quantize(["--to", "mxfp4", "-q", "--recipe", str(DAMAGING_RECIPE), str(ex / "bf16"),
                             str(ex / "damaged")]) == 0
    return {arm: ex / arm for arm in arms}


def evaluate(models: dict[str, Path], runs: Path, limit: int | None, max_gen_toks: int | None) -> dict[str, float]:
    """``evals run --benchmarks arith`` on each arm; wall seconds per arm."""
    from evals.cli import evals_main

    seconds = {}
    for arm, model in models.items():
        started = time.time()
        args = ["run", "--benchmarks", "arith", "--model", str(model), "--out", str(runs / arm)]
        args += ["--limit", str(limit)] if limit else []
        args += ["--max-gen-toks", str(max_gen_toks)] if max_gen_toks else []
        assert evals_main(args) == 0, arm
        seconds[arm] = round(time.time() - started, 1)
    return seconds


def gate(runs: Path, candidate: str, reference: str) -> tuple[int, dict]:
    """``gate accuracy --benchmarks arith --policy POLICY --json``: (exit code, result)."""
    from evals.cli import main as gate_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gate_main(["accuracy", "--candidate", str(runs / candidate), "--reference", str(runs / reference),
                          "--benchmarks", "arith", "--policy", str(POLICY), "--json"])
    return code, json.loads(out.getvalue())


def summary(runs: Path) -> dict:
    """Per arm its accuracy; per comparison the gate's figures and verdict."""
    from evals.bundle import read_bundle

    arms = {}
    for arm in ARMS:
        run, rows = read_bundle(runs / arm)
        scores = [r["score"] for r in rows if r["filter"] == run["benchmarks"]["arith"]["primary_filter"]]
        arms[arm] = {"accuracy": round(sum(scores) / len(scores), 4), "n": len(scores),
                     "dtype": (run.get("local") or {}).get("dtype")}
    comparisons = []
    for candidate, reference in COMPARISONS:
        code, result = gate(runs, candidate, reference)
        b = next(b for b in result["benchmarks"] if b["benchmark"] == "arith")
        comparisons.append({"candidate": candidate, "reference": reference, "exit": code,
                            **{k: b.get(k) for k in ("delta", "lower", "upper", "margin", "verdict", "n_items")}})
    return {"arms": arms, "comparisons": comparisons}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.benchmarks.trained_example_gate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, help="items per run (default: all 250 arith test items)")
    p.add_argument("--max-gen-toks", type=int, help="generation budget (default: evals run's, the context's)")
    p.add_argument("--workdir", type=Path, help="keep checkpoints and runs here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qg-trained-gate-") as tmp:
        workdir = args.workdir or Path(tmp)
        models = build(workdir)
        seconds = evaluate(models, workdir / "runs", args.limit, args.max_gen_toks)
        result = {**summary(workdir / "runs"), "seconds": seconds}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("| arm | accuracy | n | dtype | eval s |\n|---|---|---|---|---|")
    for arm, a in result["arms"].items():
        print(f"| {arm} | {a['accuracy']:.3f} | {a['n']} | {a['dtype']} | {seconds[arm]} |")
    print("\n| candidate vs reference | delta | one-sided bounds | margin | verdict |\n|---|---|---|---|---|")
    for c in result["comparisons"]:
        print(f"| {c['candidate']} vs {c['reference']} | {c['delta']:+.3f} | [{c['lower']:+.3f}, {c['upper']:+.3f}] "
              f"| {c['margin']} | {c['verdict']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
