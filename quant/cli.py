"""``quantize``: bf16 Hugging Face MoE checkpoint -> MXFP4 checkpoint that sglang and vLLM load."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import os
import sys
from pathlib import Path

from quant.decode_plan import make_decode_plan
from quant.errors import ConvertError, QuantgateError
from quant.example import FAMILIES, MLA_SIZES
from quant.formats.codecs import CODECS
from quant.formats.constants import ScaleRule
from quant.layout import FAMILIES_ENV, UnknownFamilyError, families_listing, load_family, manifests_root
from quant.outputs import check_destination, write_atomic
from quant.plan import Plan, PlanError, make_plan
from quant.recipe import load_recipe, with_overrides
from quant.release_check import parse_serve
from quant.safe_files import refuse_link
from quant.static_scales import load_measured_inputs

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
LADDER_START = manifests_root() / "recipes" / "mxfp4-all-linear.yaml"  # --ladder's default start: every Linear W4A4
SENSITIVITY_NAME = "sensitivity.json"  # where --ladder keeps the sensitivity pass it measured, in DST

DESCRIPTION = """\
Convert a bf16 Hugging Face MoE checkpoint of one of the model families listed below into AMD Quark 0.13's
MXFP4 format, byte for byte what Quark's file-to-file exporter writes, with an exclude list that sglang
and vLLM really match (including sglang's model.decoder.* names for the MTP layer).

What is quantized is data: the model family manifest (manifests/families/<family>/family.yaml) says which
tensor is what; the recipe (manifests/recipes/) says which roles become MXFP4. The default recipe quantizes
routed experts only (W4A4) and keeps everything else bf16.

Output appears atomically: each shard under its final name only when complete, and
conversion_manifest.json (hashes, recipe, per-tensor error) last.

exit codes: 0 done, 1 failed while converting (disk full: --resume), 2 bad input (message says what to fix)
or refused (another run is writing DST), 130 interrupted"""

EPILOG = """\
examples:
  quantize --to mxfp4 --example /tmp/qg            # the trained tiny GLM-5-layout example, converted
  quantize --to mxfp4 /ckpt/GLM-5-bf16 /ckpt/GLM-5-mxfp4 --dry-run
  quantize --to mxfp4 SRC DST --shared-experts mxfp4 --mtp-experts bf16 --json
  quantize --to mxfp4 SRC DST --serve sglang==0.5.23 --serve vllm==0.33.0   # refuse what those would not load
  quantize --to mxfp4 SRC DST --resume             # finish an interrupted run
  quantize --to bf16 /ckpt/GLM-5-mxfp4 /ckpt/GLM-5-mxfp4-as-bf16   # exact decode, for evaluation
  quantize --to mxfp4 --ladder --calibration arith SRC DST   # per layer W4A4 / W4A8 / W8A8 / bf16, measured"""


class _Parser(argparse.ArgumentParser):
    def format_help(self) -> str:
        """The help, ending with the families read from their folders when it is shown (not on every run),
        so it lists exactly what quantize reads, a family added by a folder included."""
        try:
            families = families_listing()
        except UnknownFamilyError as exc:  # a broken QUANTGATE_FAMILIES root: help still prints, naming it
            families = f"  (not listed: {exc})"
        return (f"{super().format_help()}\nmodel families (manifests/families/<family>/, then each root in "
                f"{FAMILIES_ENV}):\n{families}\n")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _byte_count(text: str) -> int:
    """``4096``, ``800MB``, ``1.2GB``, ``0.4 TB`` (decimal units, as quantize prints sizes)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    number = text.strip().upper().rstrip("BKMGT ")
    unit = text.strip().upper()[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (4096, 800MB, 1.2GB)") from None
    if not 1 <= value < float("inf"):  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of bytes, at least one")
    return int(value)


def _error_budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a relative error (a number such as 0.05, at least 0)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="quantize", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", type=Path, help="source checkpoint folder (config.json, shards, index)")
    p.add_argument("dst", nargs="?", type=Path, help="output folder; must be empty (or see --overwrite)")
    p.add_argument("--to", required=True, choices=[*CODECS, "bf16"],
                   help="target format: mxfp4 (Quark, W4A4); mxfp6_e2m3 / mxfp6_e3m2 (Quark MXFP6: vLLM loads it, "
                        "sglang's Quark loader does not yet); fp8 (DeepSeek-V3-style 128x128 block FP8, to build "
                        "your own reference); or bf16 to decode any of those exactly back to plain bf16 "
                        "(transformers cannot load Quark MXFP4 MoE checkpoints; this lets any machine evaluate one)")
    p.add_argument("--recipe", type=Path, metavar="FILE",
                   help="recipe YAML (default: manifests/recipes/mxfp4-w4a4-experts.yaml)")
    p.add_argument("--family-manifest", type=Path, metavar="FILE",
                   help="model-family YAML, for a model_type no family folder names (or add the family as a folder: "
                        f"<root>/<family>/family.yaml with <root> listed in {FAMILIES_ENV})")
    p.add_argument("--shared-experts", choices=["bf16", "mxfp4", "quantize"],
                   help="shared experts: bf16 (the default, as the Wafer write-up served them) or mxfp4 (= quantize, in "
                        "the --to format). bf16 loads in sglang >= 0.5.18, which then skips its shared-expert "
                        "fusion (a speed cost); 0.5.9-0.5.17 fuse regardless of the dtype and fail to load it on "
                        "ROCm gfx942+ / CUDA sm80+ unless started with --disable-shared-experts-fusion "
                        "(gate checkpoint checks each release)")
    p.add_argument("--mtp-experts", choices=["mxfp4", "quantize", "bf16"],
                   help="routed experts of the MTP layer: mxfp4 (= quantize; recommended) or bf16 "
                        "(then both expert aggregates, model.layers.N.mlp.experts and model.decoder.mlp.experts, "
                        "are excluded)")
    p.add_argument("--weight-only", action="store_true",
                   help="W4A16 config (no input_tensors spec); sglang's quark loader needs W4A4, vLLM loads it")
    p.add_argument("--scale-rule", choices=[r.value for r in ScaleRule],
                   help="MXFP4 block-scale rule: even (Quark default), floor (OCP), ceil")
    p.add_argument("--serve", action="append", default=[], metavar="ENGINE==X",
                   help="the engine release the output is served by (repeatable: sglang==0.5.23, vllm==0.33.0): the "
                        "plan refuses (exit 2, nothing written) what it would not load on the default serving setup "
                        "(MI355X, TP 8), and a release not in the window or neither read nor carried for the family. "
                        "Without it, every release read or carried is replayed: what the newest of an engine would not "
                        "load is refused, older releases that fail are named in a warning with the ways out")
    ladder = p.add_argument_group("precision ladder (per-layer rungs chosen by a measured sensitivity pass)")
    ladder.add_argument("--ladder", action="store_true",
                        help="start from --recipe (default: manifests/recipes/mxfp4-all-linear.yaml, every decoder "
                             "Linear W4A4) and lift the (layer, role) units whose layer output the sensitivity pass "
                             "finds most changed, one rung at a time (W4A4 -> W4A8 -> W8A8 -> bf16, skipping rungs a "
                             "--serve release, or the newest of each engine, does not build), until the budget holds; "
                             "the choice and its measurements go in conversion_manifest.json (gate release shows them)")
    ladder.add_argument("--calibration", metavar="DATA",
                        help="what the sensitivity pass reads: a JSONL file of prompts (a 'question' or 'text' field "
                             "per line) or a benchmark name (arith, gsm8k: its train split); an item that is an "
                             "evaluation item is refused")
    ladder.add_argument("--calibration-items", type=_positive_int, default=64, metavar="N",
                        help="the first N prompts of --calibration (default 64)")
    ladder.add_argument("--sensitivity", type=Path, metavar="FILE",
                        help="the sensitivity sidecar: reused if it exists (measured on SRC), else the pass writes it "
                             "there; without it the pass's sidecar is kept as DST/sensitivity.json. Without --ladder: "
                             "where a mixed --recipe's W4A8 (mxfp4_fp8) and W8A8 (fp8) rungs take their static FP8 "
                             "input scales from (amax / 448; a MoE layer's experts the layer's max, as the engines "
                             "serve them)")
    ladder.add_argument("--error-budget", type=_error_budget, metavar="X",
                        help="no unit's relative layer-output error above X (default, with no --byte-budget: the "
                             "largest error any unit shows at W8A8)")
    ladder.add_argument("--byte-budget", type=_byte_count, metavar="B",
                        help="the laddered Linears' weights at most B bytes (1.2GB, 800MB, 4096); alone, spent on the "
                             "most sensitive units first")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (what is quantized, kept, aliased; bytes in/out) from headers only")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a previous conversion at DST (one quantize wrote: its manifest or progress file); "
                        "any other folder, a checkpoint that may be your source included, is refused")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted conversion in DST: shards recorded as done are re-checked "
                        "(size, sha256) and kept, the rest redone; same options as the first run")
    p.add_argument("--strict", action="store_true",
                   help="refuse (exit 2) a NaN/Inf in a tensor kept as it is (norms, attention, ... by the recipe); "
                        "without it that tensor is copied unchanged with a warning naming it. NaN/Inf in a weight to "
                        "quantize is always refused")
    p.add_argument("--workers", type=_positive_int, metavar="N",
                   help="worker processes, one shard each (default: one per two cores, at most one per 4 GB of "
                        "work and the shard count; each worker's kernel gets its cores but one)")
    p.add_argument("--device", default="cpu",
                   help="where the quantization math runs: cpu (default; fast bf16 kernel) or cuda[:N]")
    p.add_argument("--example", type=Path, metavar="DIR",
                   help="write the built-in example to DIR/bf16 and convert it into DIR/mxfp4: a tiny MoE trained on "
                        "the arith benchmark (`evals run --benchmarks arith --model DIR/mxfp4` scores it)")
    p.add_argument("--example-weights", choices=("trained", "random"), default="trained",
                   help="the --example checkpoint's weights: trained (default; tiny MLA sizes) or seeded random "
                        "(any --example-mla)")
    p.add_argument("--example-family", choices=FAMILIES, default="glm_moe_dsa",
                   help="naming family of the --example checkpoint")
    p.add_argument("--example-mla", choices=MLA_SIZES, default="tiny",
                   help="MLA sizes of the --example checkpoint: tiny, or real (kv_lora_rank 512 + rope 64, what MLA "
                        "kernels accept; for loading the example in a real engine; needs --example-weights random)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def size(nbytes: float) -> str:
    """Bytes in the unit that keeps three significant figures readable (``12.3 MB``, ``1.50 TB``)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(nbytes) < 1000:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    return f"{nbytes:.3g} TB"


def _human_plan(plan: Plan) -> str:
    s = plan.summary()
    if plan.decodes:
        lines = [f"source      {s['source']}  ({s['from']}, {s['shards']} shards)",
                 f"tensors     {s['tensors_decoded']} {s['from']} weights decoded to bf16, {s['tensors_copied']} copied"
                 + (f"; experts written back into {s['fused_tensors_written']} fused tensors, as the release stores "
                    "them" if s["fused_tensors_written"] else ""),
                 f"bytes       in {size(s['bytes_in'])} -> out {size(s['bytes_out'])}"]
        return "\n".join(lines + [f"warning     {w}" for w in s["warnings"]])
    lines = [
        f"source      {s['source']}  ({s['family']}, {s['shards']} shards, {s['num_hidden_layers']} layers, "
        f"MTP layers {', '.join(s['mtp_layers']) or 'none'})",
        f"recipe      {s['recipe']['name']} -> {s['recipe']['format']}, scale rule {s['recipe']['scale_rule']}"
        f"{', weight only' if s['recipe']['weight_only'] else ''}",
        f"tensors     {s['tensors']}: {s['tensors_quantized']} to {s['recipe']['format'].upper()}, "
        f"{s['tensors_kept']} kept",
    ]
    for role, counts in sorted(s["by_role"].items()):
        lines.append(f"  {role:<14} quantize {counts['quantize']:>7}   keep {counts['keep']:>7}")
    if "rungs" in s:  # a mixed recipe: each layer's rung per role, and the bytes each rung writes
        lines.append("rungs       " + ", ".join(f"{rung} {r['label']} {r['modules']} Linears {size(r['bytes'])}"
                                                for rung, r in s["rungs"].items()))
        lines += [f"  layer {'-' if u['layer'] is None else u['layer']:<3} {u['role']:<14} {u['rung']:<10} "
                  f"{u['label']:<7} {u['modules']:>6} Linears {size(u['bytes']):>9}{'  (MTP)' if u['mtp'] else ''}"
                  for u in s["units"]]
        if s.get("static_scales"):
            lines.append(f"static      {len(s['static_scales'])} FP8 input scales from {s['calibration']['path']}")
    lines += [
        f"bytes       in {size(s['bytes_in'])} -> out {size(s['bytes_out'])}",
        f"exclude     {s['exclude_count']} exact module names, {len(s['draft_aliases'])} of them the engines' own names (an MTP draft's model.decoder.*, a class's own layer prefix)",
    ]
    lines += [f"  alias {a}" for a in s["draft_aliases"][:8]]
    if len(s["draft_aliases"]) > 8:
        lines.append(f"  ... {len(s['draft_aliases']) - 8} more (--json lists all)")
    for engine, states in s["releases"].items():
        said = [f"{key.replace('_', ' ')} {', '.join(states[key])}" for key in ("loads", "fails", "needs_reading",
                                                                               "not_built") if states.get(key)]
        served = f" (served: {', '.join(states['serve'])})" if states["serve"] else ""
        lines.append(f"{'releases' if engine == next(iter(s['releases'])) else '':<12}{engine}{served}: "
                     + "; ".join(said))
    lines += [f"{'by TP' if i == 0 else '':<12}{line}" for i, line in enumerate(s["block_fp8_tp"])]
    lines += [f"warning     {w}" for w in s["warnings"]]
    return "\n".join(lines)


def _human_done(manifest: dict, dst: Path) -> str:
    from quant.convert import MANIFEST_NAME

    s = manifest["summary"]
    what = f"{s['tensors_decoded']} tensors decoded" if s["tensors_decoded"] else f"{s['tensors_quantized']} tensors quantized"
    return (f"done        {what}, {size(s['bytes_in'])} in, {size(s['bytes_out'])} out, "
            f"{manifest['seconds']:.1f} s, {size(s['bytes_in'] / max(manifest['seconds'], 1e-9))}/s\n"
            f"output      {dst}  (manifest: {dst / MANIFEST_NAME})")


def _check_ladder_options(args: argparse.Namespace) -> None:
    """The ladder's options make sense together, before anything is measured or written."""
    given = [flag for flag, value in (("--calibration", args.calibration), ("--error-budget", args.error_budget),
                                      ("--byte-budget", args.byte_budget)) if value is not None]
    if not args.ladder:
        if given:
            raise PlanError(f"{given[0]} is an option of the precision ladder: add --ladder")
        return
    if args.to != "mxfp4":
        raise PlanError(f"--ladder --to {args.to}: only an mxfp4 checkpoint mixes rungs per layer; use --to mxfp4")
    if args.resume:
        raise PlanError("--ladder --resume: a resumed conversion keeps its plan; rerun the finished choice "
                        "with --recipe (conversion_manifest.json records it) or start again with --overwrite")
    if args.calibration is None and not (args.sensitivity and args.sensitivity.exists()):
        raise PlanError("--ladder needs what to measure with: --calibration DATA (a JSONL prompt file or a "
                        "benchmark's name, e.g. arith), or --sensitivity FILE a previous pass wrote")


def _ladder_plan(args: argparse.Namespace, start, family, serve):
    """The sensitivity sidecar (read from --sensitivity, or measured now), the plan of the ladder's choice
    on it, its manifest record, and where the sidecar is."""
    import tempfile

    from quant.ladder import Budget, plan_ladder
    from quant.sensitivity import run as measure

    sidecar = args.sensitivity
    if sidecar is None or not sidecar.exists():
        if sidecar is None:  # kept in DST once converted (a dry run measures into a folder removed at exit)
            scratch = tempfile.TemporaryDirectory(prefix="quantgate-sensitivity-")
            atexit.register(scratch.cleanup)
            sidecar = Path(scratch.name) / SENSITIVITY_NAME
        else:
            refuse_link(sidecar)
        if not args.json and not args.quiet:
            print(f"sensitivity {args.src} on {args.calibration}, one decoder layer at a time -> {sidecar}",
                  flush=True)
        measure(args.src, args.calibration, sidecar, items=args.calibration_items, scale_rule=start.scale_rule)
    plan, ladder = plan_ladder(args.src, start, family, serve, sidecar,
                               Budget(args.error_budget, args.byte_budget), args.calibration)
    if not args.sensitivity:
        ladder["sensitivity"]["path"] = SENSITIVITY_NAME  # where it is kept: in the checkpoint folder
    return plan, ladder, sidecar


def _human_ladder(ladder: dict) -> str:
    from quant.ladder import describe
    from quant.rungs import RUNGS

    lines = [f"ladder      {describe(ladder)}"]
    for unit in ladder["units"]:
        moved = f"{RUNGS[unit['start']].label} -> {RUNGS[unit['rung']].label}" if unit["rung"] != unit["start"] \
            else RUNGS[unit["rung"]].label
        errors = "  ".join(f"{RUNGS[r].label} {e:.4f}" for r, e in unit["error"].items())
        lines.append(f"  {'MTP ' if unit['mtp'] else ''}layer {unit['layer']:<3} {unit['role']:<14} {moved:<16} "
                     f"error {errors}")
    for role, rungs in ladder["rungs_skipped"].items():
        lines += [f"  skipped {RUNGS[rung].label} for {role}: {why if len(why) < 240 else why[:240] + ' ...'}"
                  for rung, why in rungs.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    serve = tuple(dict.fromkeys(parse_serve(spec) for spec in args.serve))  # refused before anything is written
    if serve and args.to == "bf16":
        raise PlanError("--serve checks a quantized output; --to bf16 decodes to plain bf16, which every release loads")
    if args.example:
        if args.to == "bf16":
            raise PlanError("--example converts bf16 to a quantized format; run --to bf16 on its output afterwards")
        if args.src or args.dst:
            raise PlanError("--example DIR takes no SRC/DST: it writes DIR/bf16 and converts it into DIR/mxfp4")
        if args.example.exists() and not args.example.is_dir():
            raise PlanError(f"--example {args.example}: a file, not a folder; choose a new folder")
        for folder in (args.example / "bf16", args.example / args.to):  # written into: never through a link
            refuse_link(folder)
        if (args.example / "bf16").exists() and any((args.example / "bf16").iterdir()):
            raise ConvertError(f"{args.example / 'bf16'} is not empty; choose a new --example folder")
        trained = args.example_weights == "trained"
        if trained and args.example_mla != "tiny":
            raise PlanError(f"--example-mla {args.example_mla}: the trained example has tiny MLA sizes; add "
                            "--example-weights random for a random checkpoint with real MLA sizes")
        from quant.example import write_example

        options = {} if trained else {"mla": args.example_mla}
        args.src, args.dst = (write_example(args.example / "bf16", args.example_family, trained=trained, **options),
                              args.example / args.to)
    if not args.src or not args.dst:
        raise PlanError("give SRC and DST folders (or --example DIR); see quantize --help")
    _check_ladder_options(args)
    if not args.dry_run:  # refuse before a 25-line plan scrolls the reason away
        check_destination(args.src, args.dst, args.overwrite, args.resume)
    family = load_family(args.family_manifest) if args.family_manifest else None
    if args.to == "bf16":  # a fused family's experts go back into its release's fused tensors
        plan = make_decode_plan(args.src, family)
    else:
        start = args.recipe or (LADDER_START if args.ladder else None)
        recipe = with_overrides(load_recipe(start, args.to, family), shared_experts=args.shared_experts,
                                mtp_experts=args.mtp_experts, weight_only=args.weight_only or None,
                                scale_rule=args.scale_rule)
        if args.ladder:
            plan, ladder, sidecar = _ladder_plan(args, recipe, family, serve)
        else:  # a mixed recipe's static input scales come from a sensitivity file
            calibration = load_measured_inputs(args.sensitivity) if args.sensitivity else None
            plan = make_plan(args.src, recipe, family, serve, calibration)
    if args.dry_run:
        print(json.dumps({**plan.summary(), **({"ladder": ladder} if args.ladder else {})}, indent=2) if args.json
              else _human_plan(plan) + (f"\n{_human_ladder(ladder)}" if args.ladder else ""))
        return EXIT_OK
    from quant.convert import (
        convert,  # loads the numba kernel: only when there is data to convert
    )

    if not args.json:
        print(_human_plan(plan) + (f"\n{_human_ladder(ladder)}" if args.ladder else ""), flush=True)
    if args.device != "cpu":
        import torch

        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            raise PlanError(f"--device {args.device}: no such device here (torch sees "
                            f"{torch.cuda.device_count()} CUDA devices); use --device cpu")
    manifest = convert(plan, args.dst, overwrite=args.overwrite, resume=args.resume, workers=args.workers,
                       device=args.device, show_progress=not (args.quiet or args.json), command=["quantize", *argv],
                       strict=args.strict, ladder=ladder if args.ladder else None)
    if args.ladder and not args.sensitivity:  # the measurement stays with what it chose: reusable, --sensitivity
        write_atomic(args.dst / SENSITIVITY_NAME, sidecar.read_bytes())
    print(json.dumps({"plan": plan.summary(), "manifest": manifest}, indent=2) if args.json
          else _human_done(manifest, args.dst))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the command
        atexit.register(gc.freeze)  # exiting need not collect what numba built (0.3 s measured)
        # No BLAS work here, but numba loads scipy's and numpy's OpenBLAS, whose idle threads spin:
        # 3% of a conversion's CPU (perf). Set before numpy loads; spawned workers inherit it.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return run(args, argv)
    except BrokenPipeError:  # `quantize --dry-run --json | head`: the reader left; that is not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays quiet
        return EXIT_OK
    except QuantgateError as exc:  # each error carries its exit code: 2 bad input, 1 a failed run (disk full)
        print(f"quantize: {'failed' if exc.exit_code == EXIT_FAILED else 'error'}: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # finished shards stay, no partial file is left: --resume
        print(f"quantize: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("quantize: interrupted; finished shards are kept and no partial file is left: "
              "rerun with --resume to finish", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
