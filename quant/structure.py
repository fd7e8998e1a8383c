"""A checkpoint's structure against its config.json and its family manifest, checked alike by the
converter (``quantize`` refuses the first problem, exit 2) and the checker (``gate checkpoint``
lists them all), for every family from its manifest alone:

- the counts config.json declares (layers, routed experts, MTP layers, the MoE layer step an
  engine reads) are integers in range, and no larger than the shards can hold, before anything is
  sized from them (``declared_counts``: a bad value is bad input, one line naming the key);
- layer and expert indices in tensor names are written one way: ``experts.01`` beside
  ``experts.1`` would both read as expert 1, and one would silently take the other's place;
- every MoE layer (one holding a router or routed experts, MTP layers included) holds every routed
  expert the config declares, each with the tensors its siblings have; a fused tensor holds exactly
  that many experts, beside its bias where the release has one;
- the tensors the manifest requires (``required_tensors``) are there;
- a table of expert ids (DeepSeek-V4's hash routing) is an integer table whose values
  (``expert_id_findings``, which reads them) name experts that exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quant import blocks
from quant.checkpoint import Checkpoint
from quant.engines import Finding, select
from quant.errors import CheckpointError
from quant.formats.constants import BLOCK
from quant.layout import Family, TensorRole

INDEX_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
SHOWN = 4  # examples named in one finding
ID_ROWS = 1 << 16  # rows of an expert id table read at a time


@dataclass(frozen=True)
class Declared:
    """The counts config.json declares, validated (``declared_counts``)."""
    layers: int
    experts: int | None  # routed experts per MoE layer; None for a family without experts_key
    mtp: int | None  # MTP layers; None where the config omits the key
    experts_key: str = ""  # the config key ``experts`` was read from


def _bounded_int(config_path, config: dict, key: str, where: str, low: int, high: int, why: str) -> int | None:
    """``config[key]`` as an integer in ``[low, high]`` (None when absent); anything else is refused
    naming the key: a float, a string, a bool or a value out of range is no count."""
    if key not in config:
        return None
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{config_path}: {where}{key} is {value!r:.40}, not an integer; write the release's "
                              "value as a JSON integer")
    if not low <= value <= high:
        raise CheckpointError(f"{config_path}: {where}{key} is {value}, outside {low}..{high} ({why}); restore "
                              "config.json from the original checkpoint")
    return value


def declared_counts(checkpoint: Checkpoint, family: Family) -> Declared:
    """Every count and size the family reads from config.json, refused (``CheckpointError``, exit 2)
    unless an integer no larger than the shards can hold: a layer or expert has at least one tensor,
    or one row of a fused tensor, so a count beyond the tensors (or the longest dimension) is not
    this checkpoint's; checked from the headers before anything is sized from the counts."""
    text = family.text_config(checkpoint.config)
    where = f"{family.text_config_key}." if family.text_config_key else ""
    path = checkpoint.config_path
    infos = checkpoint.tensors().values()
    tensors = len(infos)
    longest = max((d for info in infos for d in info.shape), default=0)
    capacity = max(tensors, longest)
    held = f"the shards hold {tensors} tensors"
    layers = _bounded_int(path, text, family.num_layers_key, where, 0, tensors, f"each layer has a tensor; {held}")
    if layers is None:
        raise CheckpointError(f"{path}: no {where}{family.num_layers_key!r}; add it (the model's config.json always "
                              "has it)")
    experts, experts_key = None, next((k for k in family.experts_keys if k in text), "")
    if family.experts_keys:
        if not experts_key:
            raise CheckpointError(f"{path}: no {where}{family.experts_keys[0]!r}; add the release's routed expert "
                                  "count")
        experts = _bounded_int(path, text, experts_key, where, 1, capacity,
                               f"each expert has a tensor or a row of a fused one; {held}, the longest dimension "
                               f"is {longest}")
    mtp = _bounded_int(path, text, family.mtp_layers_key, where, 0, tensors, f"each MTP layer has a tensor; {held}")
    for key in sorted({r["step"] for r in _moe_layer_rules(family)}):  # the engines' MoE layer step
        _bounded_int(path, text, key, where, 0, tensors, f"a step over the layers; {held}")
    if family.fused_experts:
        for spec in family.fused_experts.tensors:
            for key in (spec.out_key, spec.in_key):
                if _bounded_int(path, text, key, where, 1, max(longest, 1) * BLOCK, "a tensor dimension") is None:
                    raise CheckpointError(f"{path}: no {where}{key!r}; add it (the {family.name} release's "
                                          "config.json has it: the fused experts' sizes)")
            inner = text.get(spec.in_key)
            # a family whose release is MXFP4 blocks (gpt-oss): its engines' kernels and our decoder
            # run blocks of 32 along each expert's input, whatever the checkpoint's own dtype
            if family.fused_experts.writes == "blocks" and isinstance(inner, int) and inner % BLOCK:
                raise CheckpointError(f"{path}: {where}{spec.in_key} is {inner}, not a multiple of {BLOCK}: the "
                                      f"{family.name} release's MXFP4 blocks run along it, {BLOCK} values a block; "
                                      "restore config.json from the original checkpoint")
    return Declared(layers, experts, mtp, experts_key)


def _moe_layer_rules(family: Family) -> list[dict]:
    return [rule for rules in select("all", family) if isinstance(rule := rules.values.get("moe_layers"), dict)]


def _canonical(index: str) -> bool:
    return index == "0" or (index[:1] in "123456789" and index.isascii() and index.isdigit())


def _shown(items: list) -> str:
    return ", ".join(map(str, items[:SHOWN])) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def structure_findings(checkpoint: Checkpoint, family: Family, declared: Declared) -> list[Finding]:
    """What the config and manifest declare that the checkpoint lacks or holds twice, from headers only."""
    tensors = checkpoint.tensors()
    roles = {name: family.classify(name, declared.layers) for name in tensors}  # once: every check reads them
    findings = _index_findings(tensors, family, roles)
    findings += _expert_findings(tensors, family, declared, family.text_config(checkpoint.config), roles)
    findings += _required_findings(tensors, family, declared, roles)
    findings += _expert_table_layout(tensors, family, roles)
    return findings


def _index_findings(tensors, family: Family, roles: dict[str, TensorRole]) -> list[Finding]:
    """Layer and expert indices written with a leading zero (``layers.01``, ``experts.01``): read as
    numbers they collide with (or stand in for) the plainly written one."""
    layer_head = re.compile(re.escape(family.layers_prefix) + r"\.(\d+)\.")
    odd = []
    for name in tensors:
        indices = [m.group(1) for m in [layer_head.match(name)] if m]
        if (m := family.expert_match(name, roles[name].role)) is not None:
            indices.append(m.group("expert"))
        if any(not _canonical(index) for index in indices):
            odd.append(name)
    if not odd:
        return []
    return [Finding("layout", None, min(odd), f"a layer or expert index with a leading zero ({len(odd)} such "
                    "tensors): read as a number it is the same layer or expert as the plainly written one, and one "
                    "would silently take the other's place", "rename it as the release writes indices (no leading "
                    "zeros), or remove the stray copy")]


def _expert_findings(tensors, family: Family, declared: Declared, text: dict,
                     roles: dict[str, TensorRole]) -> list[Finding]:
    """Every MoE layer (a layer with a router) with every routed expert the config declares, stored
    per expert or fused."""
    if declared.experts is None:
        return []
    per_expert: dict[str, dict[int, set[str]]] = {}  # container (``...mlp.experts.``) -> expert -> its tensors
    fused: dict[str, list] = {}  # fused tensor (a ``_blocks`` one by its fused name) -> (its spec, its info)
    routers, with_experts, dense, decoder = set(), set(), set(), set()
    for name, info in tensors.items():
        role = roles[name]
        if role.layer is not None and not role.mtp:
            decoder.add(role.layer)
        if role.role == "router":
            routers.add(role.layer)
        elif role.role == "dense_mlp":
            dense.add(role.layer)
        if (m := family.expert_match(name, role.role)) is not None:
            if _canonical(m.group("expert")):  # a stray spelling is _index_findings'
                per_expert.setdefault(name[:m.start("expert")], {}).setdefault(int(m.group("expert")), set()).add(
                    name[m.end("expert"):])
            with_experts.add(role.layer)
        elif family.fused_experts and (spec := family.fused_experts.match(blocks.fused_name(name) or name)):
            fused[blocks.fused_name(name) or name] = [spec, info]
            with_experts.add(role.layer)
    findings = [f for container, found in sorted(per_expert.items())
                for f in _container_findings(container, found, declared)]
    findings += _fused_findings(tensors, fused, family, declared, text)
    if bare := sorted(layer for layer in routers - with_experts if layer is not None):
        findings.append(Finding("layout", None, f"layer {bare[0]}", f"layers {_shown(bare)} have a router but none "
                                f"of the {declared.experts} routed experts config.json declares",
                                "re-copy the missing shards (or fix the index that omits them)"))
    # a layer stripped of its whole MoE block (router and experts) looks dense but holds no MLP
    if no_mlp := sorted(decoder - routers - with_experts - dense):
        findings.append(Finding("layout", None, f"layer {no_mlp[0]}", f"layers {_shown(no_mlp)} hold no MLP: no "
                                f"router, none of the {declared.experts} routed experts and no dense MLP",
                                "re-copy the missing shards (or fix the index that omits them)"))
    return findings


def _container_findings(container: str, found: dict[int, set[str]], declared: Declared) -> list[Finding]:
    """One layer's per-expert tensors: experts ``0..count-1``, each with the tensors its siblings have."""
    count, key = declared.experts, declared.experts_key
    findings = []
    members = set().union(*found.values())
    if beyond := sorted(e for e in found if e >= count):
        findings.append(Finding("layout", None, f"{container}{beyond[0]}", f"config.json {key} is {count} but "
                                f"the checkpoint holds expert(s) {_shown(beyond)} beyond them",
                                "restore the release's config.json (or remove the stray experts)"))
    if lacking := _first_lacking(count, found, members):
        first = lacking[0]
        gone = sorted(members - found.get(first, set()))
        whole = sum(1 for e, held in found.items() if e < count and held == members)
        shown = ", ".join(map(str, lacking)) + (" ..." if count - whole > len(lacking) else "")
        findings.append(Finding("layout", None, container.rstrip("."), f"config.json declares {count} routed "
                                f"experts but experts {shown} have no tensor or lack some "
                                f"(expert {first}: no {container}{first}{gone[0]})",
                                "re-copy the missing shards (or fix the index that omits them)"))
    return findings


def _fused_findings(tensors, fused: dict[str, list], family: Family, declared: Declared, text: dict) -> list[Finding]:
    """Each fused tensor holds ``count`` experts (the experts axis comes first in every fused layout),
    with its bias where the release has one, and every fused tensor of its layer is there."""
    count, key = declared.experts, declared.experts_key
    findings, by_container = [], {}
    for name, (spec, info) in sorted(fused.items()):
        container, _, last = name.rpartition(".")
        by_container.setdefault(container, set()).add(last)
        held = info.shape[0] if info.shape else 0
        if held != count:
            findings.append(Finding("layout", None, info.name, f"{info.dtype}{list(info.shape)} holds {held} experts "
                                    f"but config.json {key} is {count}", "re-export the checkpoint (or restore the "
                                    "release's config.json)"))
        if spec.bias:
            findings += _bias_findings(tensors, name, count, text[spec.out_key] * len(spec.projections))
    for container, held in sorted(by_container.items()):
        wanted = {spec.name for spec in family.fused_experts.tensors if spec.fused_name(container)}
        if missing := sorted(wanted - held):
            findings.append(Finding("layout", None, f"{container}.{missing[0]}", f"the layer's other fused expert "
                                    f"tensors are there ({', '.join(sorted(held))}) but not {', '.join(missing)}",
                                    "re-copy the missing shards (or fix the index that omits them)"))
    return findings


def _first_lacking(count: int, found: dict[int, set[str]], members: set[str]) -> list[int]:
    """The first experts of ``0..count-1`` absent or lacking one of ``members``: work follows what is
    on disk, not the count (every expert there is looked at once, the absent ones until SHOWN)."""
    lacking, expert = [], 0
    while len(lacking) < SHOWN and expert < count:
        if found.get(expert) != members:
            lacking.append(expert)
        expert += 1
    return lacking


def _bias_findings(tensors, fused_name: str, count: int, rows: int) -> list[Finding]:
    """A fused tensor's bias, ``<fused>_bias`` ``[experts, out]``: the engines load it with the experts."""
    bias = tensors.get(fused_name + "_bias")
    if bias is None:
        return [Finding("layout", None, fused_name + "_bias", f"{fused_name} has no bias beside it: the engines load "
                        "the experts with their biases (they would stay uninitialised)",
                        "copy the release's expert bias tensors")]
    if tuple(bias.shape) != (count, rows) or bias.dtype not in ("BF16", "F16", "F32"):
        return [Finding("layout", None, bias.name, f"{bias.dtype}{list(bias.shape)} is not the float bias "
                        f"[{count}, {rows}] (experts, out) of the fused experts beside it",
                        "copy the release's expert bias tensors")]
    return []


def _required_findings(tensors, family: Family, declared: Declared, roles: dict[str, TensorRole]) -> list[Finding]:
    """The manifest's ``required_tensors``: for every decoder layer, every MTP module present, once
    where a draft is present, or once per checkpoint."""
    if not family.required_tensors:
        return []
    mtp_layers = sorted({role.layer for role in roles.values() if role.mtp and role.layer is not None})
    prefixes = {"layer": [f"{family.layers_prefix}.{i}" for i in range(declared.layers)],
                "mtp": [family.mtp_module_prefix(layer, declared.layers) for layer in mtp_layers],
                "draft": [""] if mtp_layers else [], "model": [""]}
    missing = [entry.name.format(prefix=prefix) for entry in family.required_tensors
               for prefix in prefixes[entry.per] if entry.name.format(prefix=prefix) not in tensors]
    if not missing:
        return []
    return [Finding("layout", None, missing[0], f"a tensor the {family.name} release holds and its engines load is "
                    f"missing ({len(missing)} such: {_shown(missing)})", "re-copy the missing shards (or fix the "
                    "index that omits them)")]


def _expert_table_layout(tensors, family: Family, roles: dict[str, TensorRole]) -> list[Finding]:
    """A table of expert ids must be an integer table, ``[tokens, experts per token]``."""
    findings = []
    for name, info in sorted(tensors.items()):
        if _expert_ids(family, roles[name].role) and (info.dtype not in INDEX_DTYPES or len(info.shape) != 2):
            findings.append(Finding("layout", None, name, f"{info.dtype}{list(info.shape)}: an expert id table is a "
                                    "2-D integer tensor [tokens, experts per token]", "copy the release's table"))
    return findings


def _expert_ids(family: Family, role_name: str) -> bool:
    """Whether a tensor of role ``role_name`` holds expert ids (the role's ``expert_ids``)."""
    role = family.role_named(role_name)
    return role is not None and role.expert_ids


def expert_id_findings(checkpoint: Checkpoint, family: Family, declared: Declared) -> list[Finding]:
    """The values of every table of expert ids: each must name one of the declared experts (an id
    beyond them indexes outside the experts when the engines route by it). Reads those tables only,
    a bounded number of rows at a time."""
    if declared.experts is None:
        return []
    findings = []
    for file, header in checkpoint.headers.items():
        tables = [info for name, info in sorted(header.tensors.items())
                  if _expert_ids(family, family.classify(name, 0).role)
                  and info.dtype in INDEX_DTYPES and len(info.shape) == 2]
        if not tables:
            continue
        # imported only here: a dry run of any other family loads no numeric stack
        from safetensors import safe_open

        with safe_open(str(checkpoint.path(file)), "np") as handle:
            for info in tables:
                table = handle.get_slice(info.name)
                for start in range(0, info.shape[0], ID_ROWS):
                    rows = table[start:min(start + ID_ROWS, info.shape[0])]  # safetensors does not clamp
                    bad = (rows < 0) | (rows >= declared.experts)
                    if bad.any():
                        row = start + int(bad.nonzero()[0][0])
                        findings.append(Finding("values", None, info.name, f"row {row} names expert "
                                                f"{int(rows[bad][0])}, but config.json {declared.experts_key} is "
                                                f"{declared.experts}", "copy the release's table (and its "
                                                "config.json)"))
                        break
    return findings

