"""Block FP8 under tensor and expert parallelism: whether each engine release builds a checkpoint's
block-quantized weights (``quantization_config.weight_block_size``, 128x128 for ``quantize --to fp8``)
at a TP / EP size, or raises ``... is not divisible by weight quantization block_n = 128``.

The engines cut every Linear and FusedMoE into per-rank partitions and check each against the block,
in their quantization layer, the same for every model class; how they check is rule data per engine
and release (``manifests/engines/block_fp8.<engine>.yaml``, schema ``rule_kinds.BlockFp8File``):

- Linear: a row-parallel module's input partition (in / TP) % block_k, and each output partition of a
  column-parallel one (out / TP; a merged layer's shards, e.g. gate_up or qkv, one each, checked at any
  TP) % block_n. vLLM lets a merged layer with a misfit shard through (``merged_mismatch_allowed``).
- FusedMoE: the intermediate size per rank (TP / EP: split; EP over all ranks: whole) % block; sglang on
  ROCm (aiter) pads it to 128, vLLM from 0.29.0 refines the block down to a divisor of at least 32.

How each module is partitioned is the engines' Linear class for its name (``PARALLEL``): the same
leaves build the same classes in every family both engines serve (attention q/k/v/o, MLA's q_b/kv_b,
dense and shared-expert MLPs). A leaf not listed is not judged (nothing is claimed for it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache

from packaging.version import Version

from quant.engines.replay import Finding, Module
from quant.engines.rule_kinds import BlockFp8File
from quant.engines.rules import ENGINES, RuleFileError, RuleSet, window
from quant.engines.serving import BadServing
from quant.layout import manifests_root
from quant.schema import load

TP_SIZES = (1, 2, 4, 8, 16)  # the sizes quantize and gate checkpoint state the loading TPs for

# leaf -> (partition, the merged module the engines stack it into, None: built alone). Column: the
# output split over TP ranks; row: the input. (sglang/srt/layers/linear.py and vllm/model_executor/
# layers/linear.py: QKVParallelLinear for q/k/v, MergedColumnParallelLinear for gate/up, w1/w3;
# ColumnParallelLinear for MLA's q_b_proj / kv_b_proj; RowParallelLinear for o_proj, down_proj, w2.)
PARALLEL: dict[str, tuple[str, str | None]] = {
    "q_proj": ("column", "qkv_proj"), "k_proj": ("column", "qkv_proj"), "v_proj": ("column", "qkv_proj"),
    "gate_proj": ("column", "gate_up_proj"), "up_proj": ("column", "gate_up_proj"),
    "w1": ("column", "w13"), "w3": ("column", "w13"),
    "q_b_proj": ("column", None), "kv_b_proj": ("column", None),
    "o_proj": ("row", None), "down_proj": ("row", None), "w2": ("row", None),
}
KV_LEAVES = ("k_proj", "v_proj")  # QKVParallelLinear replicates KV heads when TP exceeds them
MOE_COLUMN = ("gate_proj", "up_proj", "w1", "w3")  # a routed expert's leaf: its out is the intermediate size
MOE_ROW = ("down_proj", "w2")  # its in is the intermediate size


@dataclass(frozen=True)
class BlockRules:
    engine: str
    first: str
    last: str
    linear: dict
    moe: dict
    cites: dict

    @property
    def span(self) -> str:
        return f"{self.engine} {self.first}" + (f"-{self.last}" if self.last != self.first else "")

    def overlaps(self, first: str, last: str) -> bool:
        return Version(self.first) <= Version(last) and Version(first) <= Version(self.last)


@cache
def block_rules(engine: str) -> tuple[BlockRules, ...]:
    """The block-FP8 rule sets of ``engine``, oldest first, each with the rules it carries over."""
    path = manifests_root() / "engines" / f"block_fp8.{engine}.yaml"
    file = load(path, BlockFp8File, "block FP8 rule file", RuleFileError,
                "each rule and its keys are defined in quant/engines/rule_kinds.py (BlockFp8File)")
    values: dict = {}
    cites: dict = {}
    out = []
    for entry in file.rule_sets:
        for rule, stated in entry.rules.model_dump(exclude_unset=True).items():
            values[rule], cites[rule] = stated["value"], stated["cite"]
        if missing := {"linear", "moe"} - set(values):
            raise RuleFileError(f"{path}: {entry.versions[0]}..{entry.versions[1]} does not state "
                                f"{', '.join(sorted(missing))}; read it in the wheel")
        out.append(BlockRules(engine, *entry.versions, values["linear"], values["moe"], dict(cites)))
    return tuple(out)


def covering(engine: str, first: str, last: str) -> list[BlockRules]:
    """The block rule sets read for any release from ``first`` to ``last``."""
    return [r for r in block_rules(engine) if r.overlaps(first, last)]


def not_read(engine: str, first: str = "0", last: str | None = None) -> list[str]:
    """The window's releases from ``first`` to ``last`` that no block rule span covers (a release the
    registry added since the rule files were read): their partitions are never guessed."""
    spans = block_rules(engine)
    return [v for v in window(engine) if Version(first) <= Version(v) <= Version(last or v)
            and not any(Version(r.first) <= Version(v) <= Version(r.last) for r in spans)]


def block_size(qconfig: dict | None) -> tuple[int, int] | None:
    """An FP8 quantization_config's [block_n, block_k], None when the weights are not block-quantized."""
    block = (qconfig or {}).get("weight_block_size") if (qconfig or {}).get("quant_method") == "fp8" else None
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return block[0], block[1]
    return None


@dataclass(frozen=True)
class Part:
    """One kind of block-quantized module as the engines partition it (modules alike share one: a model's
    92,000 routed experts are one Part). ``kind`` row: ``sizes`` (in,); column: each merged shard's out,
    ``kv`` marking the shards whose heads are replicated past TP; moe: (intermediate, hidden)."""
    module: str  # the first module of this kind (a FusedMoE: its experts' parent), named in findings
    kind: str  # row | column | moe
    role: str  # its family role (the way out names it)
    sizes: tuple[int, ...]
    kv: tuple[bool, ...] = ()
    merged: str | None = None  # the merged module's leaf (qkv_proj, gate_up_proj, w13)
    shards: tuple[str, ...] = ()  # column: the modules of ``sizes``, in order


def parts(modules: dict[str, Module], shared_fused: bool = False) -> list[Part]:
    """The quantized modules the engines check against the block, one Part per kind; routed experts
    as their FusedMoE (its intermediate size from the experts' shapes), and the shared expert too where
    sglang fuses it into that FusedMoE (``shared_fused``)."""
    found: dict[tuple, Part] = {}
    groups: dict[str, list[str]] = {}
    experts = ("routed_expert", "shared_expert") if shared_fused else ("routed_expert",)
    for name, module in modules.items():  # the checkpoint's order: the first module of a kind is named
        if not module.quantized:
            continue
        parent, _, leaf = name.rpartition(".")
        if module.role in experts:
            out, inner = module.shape
            sizes = (out // 2, inner) if leaf.endswith("gate_up_proj") else (out, inner) if leaf in MOE_COLUMN \
                else (inner, out) if leaf in MOE_ROW else None
            if sizes and ("moe", sizes) not in found:  # the FusedMoE: the per-expert names' parent
                found["moe", sizes] = Part(re.sub(r"\.\d+$", "", parent), "moe", module.role, sizes)
        elif leaf in PARALLEL and module.role != "vision":
            parallel, group = PARALLEL[leaf]
            if parallel == "row":
                key = ("row", module.shape[1], module.role)
                found.setdefault(key, Part(name, "row", module.role, (module.shape[1],)))
            else:
                groups.setdefault(f"{parent}.{group}" if group else name, []).append(name)
    for shards in groups.values():
        sizes = tuple(modules[s].shape[0] for s in shards)
        kv = tuple(s.rpartition(".")[2] in KV_LEAVES for s in shards)
        merged = PARALLEL[shards[0].rpartition(".")[2]][1] if len(shards) > 1 else None
        role = modules[shards[0]].role
        found.setdefault(("column", sizes, kv, role), Part(shards[0], "column", role, sizes, kv, merged, tuple(shards)))
    return list(found.values())


@dataclass(frozen=True)
class Misfit:
    """A module a release refuses at a TP / EP size, and why."""
    module: str
    role: str
    why: str


def _split(size: int, ranks: int) -> str:
    return f"{size}/{ranks} = {size / ranks:g}" if ranks > 1 else str(size)


def misfits(rules: BlockRules, found: list[Part], text: dict, block: tuple[int, int], tp: int, ep: int = 1,
            platform: str = "rocm") -> list[Misfit]:
    """The modules ``rules``' release raises on at TP ``tp`` / EP ``ep`` (one per kind of module)."""
    block_n, block_k = block
    out = []
    for part in found:
        if part.kind == "row":
            if tp > 1 and part.sizes[0] % (tp * block_k):
                why = f"row-parallel input partition {_split(part.sizes[0], tp)} is not divisible by block_k {block_k}"
                out.append(Misfit(part.module, part.role, why))
        elif part.kind == "column":
            if tp == 1 and part.merged is None:
                continue  # neither split nor merged: nothing is checked
            kv_heads = text.get("num_key_value_heads")
            ranks = [kv_heads if kv and isinstance(kv_heads, int) and 0 < kv_heads < tp else tp for kv in part.kv]
            bad = [(name, size, r) for name, size, r in zip(part.shards, part.sizes, ranks, strict=True)
                   if size % (r * block_n)]
            if bad and not (part.merged and rules.linear["merged_mismatch_allowed"]):
                name, size, r = bad[0]
                merged = f" of the merged {part.merged}" if part.merged else ""
                why = (f"column-parallel output partition{merged} {_split(size, r)} is not divisible by "
                       f"block_n {block_n}")
                out.append(Misfit(name, part.role, why))
        elif why := _moe_misfit(rules.moe, part.sizes, block, tp, ep, platform):
            out.append(Misfit(part.module, part.role, why))
    return out


def _moe_misfit(rule: dict, sizes: tuple[int, ...], block: tuple[int, int], tp: int, ep: int,
                platform: str) -> str | None:
    intermediate, hidden = sizes
    block_n, block_k = block
    ranks = max(1, tp // ep)  # EP takes its ranks from TP's: the experts split, each one's intermediate whole
    if intermediate % (ranks * block_n) == 0 and (tp == 1 or intermediate % (ranks * block_k) == 0):
        return None
    if platform == "rocm" and rule.get("rocm_pads") and rule["rocm_pads"] == block_n == block_k:
        return None  # aiter pads the partition to whole blocks
    refined = math.gcd(block_n, block_k, intermediate // ranks, hidden) if intermediate % ranks == 0 else 0
    if rule["misfit"] == "refine" and refined >= rule["refine_min"]:
        return None
    tail = f" (nor refined: gcd {refined} < {rule['refine_min']})" if rule["misfit"] == "refine" else ""
    return (f"FusedMoE intermediate partition {_split(intermediate, ranks)} is not divisible by block_n {block_n}"
            f"{tail}")


def block_findings(rule_set: RuleSet, modules: dict[str, Module], text: dict, qconfig: dict | None,
                   serving, shared_fused: bool = False) -> list[Finding]:
    """What ``rule_set``'s releases raise on when they build this block-FP8 checkpoint at the stated TP / EP
    (nothing where TP was not stated: ``tp_summary`` then says at which sizes it loads)."""
    block = block_size(qconfig)
    if block is None or not serving.check_tp:
        return []
    first, last = (rule_set.release, rule_set.release) if rule_set.release else (rule_set.first, rule_set.last)
    found, findings = parts(modules, shared_fused), []
    if unread := not_read(rule_set.engine, first, last):
        findings.append(Finding("engine", rule_set.id, "quantization_config.weight_block_size",
                                f"block FP8 at TP {serving.tp}: the partition checks of {rule_set.engine} "
                                f"{', '.join(unread)} were not read, so whether it loads is unknown",
                                f"read the cited functions in that wheel into manifests/engines/block_fp8."
                                f"{rule_set.engine}.yaml (tests/quant/test_block_partition.py checks them)"))
    for rules in covering(rule_set.engine, first, last):
        bad = misfits(rules, found, text, block, serving.tp, serving.ep, serving.platform)
        if not bad:
            continue
        loads = loading_tps(rules, found, text, block, serving.ep, serving.platform)
        more = f" (and {len(bad) - 1} more kind(s) of module)" if len(bad) > 1 else ""
        where = "" if rule_set.release or (rules.first, rules.last) == (first, last) else f" in {rules.span}"
        findings.append(Finding(
            "engine", rule_set.id, bad[0].module,
            f"block FP8 {block[0]}x{block[1]} at TP {serving.tp}" + (f", EP {serving.ep}" if serving.ep > 1 else "")
            + f": {bad[0].why}{where}: the release raises ValueError building it{more} "
              f"({_cite(rules, bad[0])})",
            f"serve at {_tps(loads)}, or {way_out(bad[0].role)}"))
    return findings


def way_out(role: str) -> str:
    """How quantize keeps a refused module's role bf16."""
    if role == "shared_expert":
        return "quantize with --shared-experts bf16 (the shared experts kept bf16)"
    return f"quantize with a recipe that keeps role {role} bf16 (--recipe FILE)"


def tp_warning(modules: dict[str, Module], text: dict, qconfig: dict | None, tp: int = 8,
               platform: str = "rocm") -> str | None:
    """quantize's warning when its block-FP8 output does not load at ``tp`` (the default serving) in some
    release span, naming the spans, the first module refused and the ways out; None where it loads."""
    block = block_size(qconfig)
    if block is None:
        return None
    found = parts(modules)
    failing = {engine: [(rules, bad[0]) for rules in block_rules(engine)
                        if (bad := misfits(rules, found, text, block, tp, 1, platform))] for engine in ENGINES}
    spans = ", ".join(_joined(engine, [r for r, _ in failed]) for engine, failed in failing.items() if failed)
    if not spans:
        return None
    failed = [pair for engine in ENGINES for pair in failing[engine]]
    loads = sorted(set.intersection(*(set(loading_tps(r, found, text, block, 1, platform)) for r, _ in failed)))
    first = failed[-1][1]  # the newest release's reason
    return (f"block FP8 {block[0]}x{block[1]} at TP {tp} ({platform}) does not load in {spans}: {first.module}: "
            f"{first.why} (the release raises ValueError building it). Ways out: serve at {_tps(loads)}, or "
            f"{way_out(first.role)}")


def _joined(engine: str, failed: list[BlockRules]) -> str:
    """The failing rule spans of ``engine``, neighbours in its rule file joined into one range."""
    spans: list[list[str]] = []
    every = block_rules(engine)
    for rules in failed:
        index = every.index(rules)
        if spans and index and every[index - 1] in failed:
            spans[-1][1] = rules.last
        else:
            spans.append([rules.first, rules.last])
    return ", ".join(f"{engine} {a}" + (f"-{b}" if b != a else "") for a, b in spans)


def _cite(rules: BlockRules, misfit: Misfit) -> str:
    return rules.cites["moe" if misfit.why.startswith("FusedMoE") else "linear"].split(" (")[0]


def loading_tps(rules: BlockRules, found: list[Part], text: dict, block: tuple[int, int], ep: int = 1,
                platform: str = "rocm") -> list[int]:
    return [tp for tp in TP_SIZES if not misfits(rules, found, text, block, tp, min(ep, tp), platform)]


def _tps(loads: list[int]) -> str:
    return f"TP {', '.join(map(str, loads))}" if loads else "no TP up to 16 (keep these modules bf16)"


def tp_summary(modules: dict[str, Module], text: dict, qconfig: dict | None, engines=ENGINES, ep: int = 1,
               platform: str = "rocm", shared_fused: tuple[str, ...] = ()) -> list[str]:
    """Per engine and block rule span (spans alike joined), the TP sizes at which a block-FP8 checkpoint
    loads, and the first module refused at each other size; [] for a checkpoint that is not block FP8.
    ``shared_fused``: the engines whose newest release replayed fuses the shared expert into the FusedMoE."""
    block = block_size(qconfig)
    if block is None:
        return []
    lines = []
    for engine in engines:
        found = parts(modules, engine in shared_fused)
        spans: list[tuple[str, str, str]] = []
        for rules in block_rules(engine):
            refused = [(tp, bad[0]) for tp in TP_SIZES
                       if (bad := misfits(rules, found, text, block, tp, min(ep, tp), platform))]
            loads = [tp for tp in TP_SIZES if tp not in dict(refused)]
            said = f"loads at {_tps(loads)}" + "".join(
                f"; not at TP {tp}: {m.module}: {m.why}" for tp, m in refused[:1]) + \
                (f" (nor at TP {', '.join(str(tp) for tp, _ in refused[1:])})" if len(refused) > 1 else "")
            if spans and spans[-1][2] == said:
                spans[-1] = (spans[-1][0], rules.last, said)
            else:
                spans.append((rules.first, rules.last, said))
        lines += [f"{engine} {first}" + (f"-{last}" if last != first else "") + f" ({platform}"
                  + (f", EP {ep}" if ep > 1 else "") + f"): block FP8 {block[0]}x{block[1]} {said}"
                  for first, last, said in spans]
        lines += [f"{engine} {', '.join(unread)}: block FP8 partition checks not read"] if (
            unread := not_read(engine)) else []
    return lines


def check_heads(text: dict, serving, config_path) -> None:
    """Both engines split the attention heads over the TP ranks (an uneven split asserts at load): a
    stated TP that does not divide them describes no launch (exit 2)."""
    heads = text.get("num_attention_heads")
    if serving.check_tp and isinstance(heads, int) and heads > 0 and heads % serving.tp:
        raise BadServing(f"--tp {serving.tp}: {config_path} has num_attention_heads {heads}, which TP "
                         f"{serving.tp} does not divide (the engines split the heads over the ranks); use a TP "
                         "that divides it")
