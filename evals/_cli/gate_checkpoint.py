"""``gate checkpoint``: prove a checkpoint loads correctly in sglang and vLLM."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_BLOCK, EXIT_PASS, BadInput
from quant.engines import serving as setup
from quant.release_check import named
from quant.release_results import shape_label

HELP = """\
Replay sglang's and vLLM's loading rules on a quantized checkpoint (Quark MXFP4/MXFP6 or block
FP8), from headers and config alone: layout (every quantized weight has a fitting scale, index and
shards agree, tokenizer present), config (the Quark schema, router keys, MTP layer count), and per
engine release the module each tensor loads into (fused gate_up_proj / fused_qkv_a_proj*, the
FusedMoE ...mlp.experts, sglang's model.decoder.* names for the MTP draft) with that release's
exclude matching, compared with the dtypes on disk. The rules are data read from each release's
source (manifests/engines/*.yaml, with file and function); --list-engines shows them.

Loading also depends on how sglang is started: it folds the shared expert into the routed FusedMoE
(shared-expert fusion) on ROCm gfx942+ and CUDA sm80+ unless --disable-shared-experts-fusion is
given or (0.5.18+) the exclude list keeps the shared experts bf16; a shared expert whose dtype differs
from the routed experts' then cannot load. On CUDA, 0.5.15+ builds the DSA indexer's wk bf16. The
checks assume the serving setup below (default: MI355X, ROCm gfx950, TP 8, fusion on; gate kernels and
gate release take the same flags) and list, per sglang release, the GPUs and switches under which the
checkpoint loads.

By default every release of the window (manifests/engines/releases.yaml: sglang from 0.5.9, vLLM from
0.16.0, .postN included) is answered for: per engine the release ranges that fail with their findings,
the ranges that load, each range's shared-expert fusion and the MoE shape it runs (experts, top-k;
a perf note where a release does not fuse and the newest does), and the releases not replayed:
"needs reading" (a source its rules cite changed since the release read) or "not built" (the release
has no such model class). A release not replayed is never vouched for: the verdict then reads "loads
correctly in every release read; not read: ...". A pipeline pins the release it serves with --engine
sglang==X (exit 2 where X is not a registry release of the window, or not read for the family).

A checkpoint with MTP layers is checked with its draft by default (--speculative: as the families'
published serving commands start the engine); --no-speculative checks the server started without
it: the draft's findings are then listed apart and do not fail.

  gate checkpoint DIR                         every release of the window, both engines
  gate checkpoint DIR --engine sglang         every sglang release of the window
  gate checkpoint DIR --engine sglang==0.5.23 that release (a .postN release names the rules it follows)
  gate checkpoint DIR --no-speculative        served without the MTP draft
  gate checkpoint DIR --platform cuda --gpu-arch sm90 --ep 8
  gate checkpoint DIR --gpu mi300x            ROCm gfx942 (the GPU models: manifests/kernels/gpus.yaml)
  gate checkpoint DIR --disable-shared-experts-fusion
  gate checkpoint DIR --tp 8 [--ep 8]         block FP8: each rank's partitions checked at that size (stated
                                              only; otherwise the report lists the TP sizes it loads at)

exit codes: 0 loads correctly in every release replayed; 1 some release would not (or would load wrong);
2 the input is unreadable or not a checkpoint, or the release asked for is unknown or not read"""


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="prove a checkpoint loads correctly in sglang and vLLM", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, nargs="?", help="checkpoint folder (config.json, shards, index)")
    p.add_argument("--list-engines", action="store_true",
                   help="list the engine releases whose rules are known, with each rule's source, and exit")
    setup.add_arguments(p)
    p.add_argument("--deep", action="store_true",
                   help="also read tensor data: decode every quantized weight and flag NaN/Inf codes or results, "
                        "E8M0 0xFF scales, NaN/Inf/negative FP8 scales, all-zero scale rows, NaN/Inf in bf16 tensors")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(func=run)


def human(report) -> str:
    lines = [f"checkpoint  {report.checkpoint}  ({report.modules_checked} Linear modules checked)",
             f"serving     {report.serving.label()}"]
    if report.has_draft:
        lines.append("draft       " + ("checked with the MTP draft (--speculative, the default: as the families' "
                                       "published serving commands run it)" if report.serving.speculative else
                                       "served without the MTP draft (--no-speculative): its findings do not fail"))
    if every := [f for f in report.findings if f.engine is None]:
        lines.append(f"\nevery release: {len(every)} problem(s)")
        lines += _problems(every)
    for engine in dict.fromkeys(r.engine for r in report.releases):
        lines.append("")
        for results, found in report.groups(engine):
            pinned = len(report.releases) == 1  # one release asked for: named with the rules it follows
            label = results[0].rules if pinned else named(engine, [r.release for r in results])
            lines.append(f"{label}: {'OK' if not found else f'{len(found)} problem(s)'}")
            lines += _problems(found)
            lines += _conditions(report.conditions.get(results[0].rules, []))
        lines += _draft(report, engine) + _not_read(report, engine) + _moe(report, engine)
    if report.block_fp8_tp:
        stated = "" if report.serving.check_tp else " (--tp not stated, so not checked: pass --tp N)"
        lines += [f"\nblock FP8 by TP size{stated}:", *(f"  {line}" for line in report.block_fp8_tp)]
    if report.modules_quantized == 0 and report.modules_checked:
        lines.append("\nnote: nothing here is quantized (no quantized Linear weight, "
                     "no quantization_config): it loads as a plain checkpoint")
    lines.append("\nverdict: " + report.verdict)
    return "\n".join(lines)


def _problems(findings) -> list[str]:
    lines = []
    for f in findings:
        lines += [f"  PROBLEM  [{f.check}] {f.module}", f"           why: {f.why}", f"           fix: {f.fix}"]
    return lines


def _draft(report, engine: str) -> list[str]:
    """Without the draft, what it would find (with it, its findings are among the problems above)."""
    if report.serving.speculative:
        return []
    apart = {r.rules: [f for f in report.draft_findings if f.engine == r.rules] for r in report.replayed(engine)}
    bad = [r.release for r in report.replayed(engine) if apart[r.rules]]
    if not bad:
        return []
    shown = next(found for found in apart.values() if found)
    return [(f"  with the MTP draft (--speculative), {named(engine, bad)} would also find: "
             f"[{shown[0].check}] {shown[0].module}: {shown[0].why}")]


def _not_read(report, engine: str) -> list[str]:
    """The releases not replayed, and those carried over, grouped by what the window says of them."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in report.not_read(engine) + [r for r in report.replayed(engine) if r.state == "carried"]:
        grouped.setdefault((r.state, r.detail), []).append(r.release)
    lines = [f"{named(engine, releases)}: " + (detail if state == "carried" else f"{state}, not replayed"
                                                + (f" ({detail})" if detail else ""))
             for (state, detail), releases in grouped.items()]
    if report.not_read(engine):
        lines.append(f"  (python -m quant.engines.window report --engine {engine} --family {report.family} names each "
                     "rule and function that changed)")
    return lines


def _moe(report, engine: str) -> list[str]:
    """Per release, the shared-expert fusion and the MoE shape the engine runs, even where it loads;
    a note where a release does not fuse and the newest release replayed does (a perf difference)."""
    replayed = [r for r in report.replayed(engine) if r.rules in report.moe]
    if not replayed:
        return []
    shapes: dict[tuple, list[str]] = {}
    for r in replayed:
        fusion = report.fusion.get(r.rules)
        why = _fusion_words(fusion["why"], r.rules) if fusion else "the shared expert runs apart from the FusedMoE"
        shapes.setdefault((shape_label(report.moe[r.rules]), why), []).append(r.release)
    lines = [f"{named(engine, releases)}: MoE {shape} ({why})" for (shape, why), releases in shapes.items()]
    newest = replayed[-1]
    top = report.moe[newest.rules]
    slower = [r for r in replayed if report.moe[r.rules]["fused_shared"] < top["fused_shared"]]
    if slower:
        lines.append(f"  perf: {named(engine, [r.release for r in slower])}: the shared expert is not fused, "
                     f"so the MoE runs {shape_label(report.moe[slower[0].rules])} where {engine} {newest.release} runs "
                     f"{shape_label(top)} (it loads either way; the kernels are tuned per shape: gate kernels "
                     f"--engine {engine}=={slower[0].release})")
    return lines


def _fusion_words(why: str, rules_id: str) -> str:
    """The fusion decision without the rule set it came from (the line names the releases)."""
    return why.replace(f" ({rules_id})", "").replace(f"; {rules_id})", ")")


def _conditions(conditions) -> list[str]:
    """The GPUs and switches that fail, where others load (--json lists every condition)."""
    if not conditions or len({ok for _, ok in conditions}) < 2:
        return []
    fails: dict[str, list[str]] = {}
    for s, ok in conditions:
        if not ok:
            how = f"ep {s.ep}" + (" with --disable-shared-experts-fusion" if s.disable_shared_experts_fusion else "")
            fails.setdefault(f"{s.platform} {s.gpu_arch}", []).append(how)
    shown = "; ".join(f"{gpu} ({', '.join(how)})" for gpu, how in fails.items())
    return [f"  fails on  {shown}", "  loads on  the other GPUs and settings checked (--json: loads_under)"]


def list_engines(spec: str, as_json: bool) -> str:
    from quant.engines import select

    rule_sets = select(spec)
    if as_json:
        return json.dumps([{"id": r.id, "engine": r.engine, "first": r.first, "last": r.last,
                            "rules": {k: {"value": r.values[k], "cite": r.cites[k]} for k in r.values}}
                           for r in rule_sets], indent=2)
    lines = []
    for r in rule_sets:
        lines.append(f"{r.id}")
        lines += [f"  {name:<20} {json.dumps(r.values[name])}\n  {'':<20} {r.cites[name]}" for name in r.values]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from quant.verify import verify

    if args.list_engines:
        print(list_engines(args.engine, args.json))
        return EXIT_PASS
    if args.dir is None:
        raise BadInput("give a checkpoint folder (or --list-engines)")
    report = verify(args.dir, args.engine, args.deep, setup.from_args(args))
    print(json.dumps(report.to_dict(), indent=2) if args.json else human(report))
    return EXIT_PASS if report.ok else EXIT_BLOCK
