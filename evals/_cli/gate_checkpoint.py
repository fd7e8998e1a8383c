"""``gate checkpoint``: prove a checkpoint loads correctly in sglang and vLLM."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evals.errors import EXIT_BLOCK, EXIT_PASS, BadInput
from quant.engines import serving as setup

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

  gate checkpoint DIR                         every release read, of both engines
  gate checkpoint DIR --engine sglang         every sglang release read, reported per rule set
  gate checkpoint DIR --engine sglang==0.5.23 that release (a .postN release names the rules it follows)
  gate checkpoint DIR --platform cuda --gpu-arch sm90 --ep 8
  gate checkpoint DIR --gpu mi300x            ROCm gfx942 (the GPU models: manifests/kernels/gpus.yaml)
  gate checkpoint DIR --disable-shared-experts-fusion

exit codes: 0 loads correctly in every engine asked for; 1 it would not (or would load wrong);
2 the input is unreadable or not a checkpoint"""


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
    for engine in report.engines:
        findings = report.for_engine(engine)
        lines.append(f"\n{engine}: {'OK' if not findings else f'{len(findings)} problem(s)'}")
        for f in findings:
            lines += [f"  PROBLEM  [{f.check}] {f.module}", f"           why: {f.why}", f"           fix: {f.fix}"]
        lines += _conditions(report.conditions.get(engine, []))
    if report.modules_quantized == 0 and report.modules_checked:
        lines.append("\nnote: nothing here is quantized (no quantized Linear weight, "
                     "no quantization_config): it loads as a plain checkpoint")
    lines.append("\nverdict: " + ("loads correctly" if report.ok else "would NOT load correctly"))
    return "\n".join(lines)


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
