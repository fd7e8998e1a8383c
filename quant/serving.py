"""The exclude list the converter writes: every engine module name the known sglang and vLLM
releases look up for the modules left unquantized.

The names come from the engine rules (``quant.engines``): for each rule set, the checkpoint name,
the draft (MTP) name the engine gives it (sglang: ``model.decoder.*`` / ``model.*``), the fused
module it is built into where all its shards stay unquantized (``gate_up_proj``,
``fused_qkv_a_proj*``), and ``<layer>.mlp.experts`` when a layer's routed experts stay unquantized.
Entries that match nothing in one engine are inert there. ``quant.plan`` then replays every rule set
on the planned checkpoint, so the writer and ``gate checkpoint`` cannot disagree.
"""

from __future__ import annotations

import re
from collections import defaultdict

from quant.engines import draft_name, rule_sets
from quant.engines.replay import class_name, draft_module_name, is_draft, mapped_entry, shard_parent
from quant.engines.rules import DEFAULT_FAMILY, ENGINES
from quant.errors import QuantgateError

_ROUTED_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")  # mlp.experts.E.*, block_sparse_moe.experts.E.*


class NamingError(QuantgateError, ValueError):
    """A quantization choice the engines cannot load (the message says which modules and why)."""


def _all_rule_sets(family):
    """Every rule set read for the family's model classes, in both engines."""
    return [r for engine in ENGINES for r in rule_sets(engine, family)]


def _built_fused(family=DEFAULT_FAMILY) -> dict[str, tuple[str, ...]]:
    """Fused module -> shards, as any release read for the family's classes builds them."""
    return {fused: tuple(shards) for r in _all_rule_sets(family) for fused, shards in r["built_fused"].items()}


def _fused_names(modules: set[str], family=DEFAULT_FAMILY) -> set[str]:
    """Fused module names whose every shard is in ``modules`` (routed experts excepted)."""
    fused: set[str] = set()
    for module in modules:
        if _ROUTED_EXPERT.match(module):
            continue
        for fused_leaf, shards in _built_fused(family).items():
            for parent in _shard_parents(module, shards):
                if all(f"{parent}.{s}" in modules for s in shards):
                    fused.add(f"{parent}.{fused_leaf}")
    return fused


def _absent_shards(kept: set[str], quantized: set[str], family=DEFAULT_FAMILY) -> set[str]:
    """Where releases disagree on a fused module's shards (sglang 0.5.17-0.5.19's MiniMax-M3
    index_qkv_proj lists an index_v_proj the release does not store; 0.5.20 lists index_q/k_proj only)
    and the shards stored all stay unquantized: the names of the shards not stored and the fused name.
    Listed, they make the releases that expect those shards see every shard excluded (not 'different
    quantization schemes'); in the others they name no module and are inert."""
    lists: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for r in _all_rule_sets(family):
        for fused in (r["built_fused"], r.values.get("quark_fused") or {}):
            for name, shards in fused.items():
                lists[name].add(tuple(shards))
    differing = {name: found for name, found in lists.items() if len(found) > 1}
    present, names = kept | quantized, set()
    for module in kept:
        if _ROUTED_EXPERT.match(module):
            continue
        for fused_leaf, found in differing.items():
            for parent in _shard_parents(module, tuple({s for shards in found for s in shards})):
                stored = {s for shards in found for s in shards if f"{parent}.{s}" in present}
                # the releases whose fused module is made of the stored shards, and what else they list
                absent = {s for shards in found if stored <= set(shards) for s in shards} - stored
                if absent and not any(f"{parent}.{s}" in quantized for s in stored):
                    names |= {f"{parent}.{s}" for s in absent} | {f"{parent}.{fused_leaf}"}
    return names


def _shard_parents(module: str, shards: tuple[str, ...]) -> list[str]:
    """The parent ``module`` is a shard of, for each shard it ends in."""
    return [parent for shard in shards if (parent := shard_parent(module, shard)) is not None]


def check_fused_agreement(kept: set[str], quantized: set[str], family=DEFAULT_FAMILY) -> None:
    """Refuse a split that makes an engine raise "different quantization schemes"."""
    present = kept | quantized
    for module in sorted(kept):
        if _ROUTED_EXPERT.match(module):
            continue
        for fused_leaf, shards in _built_fused(family).items():
            for parent in _shard_parents(module, shards):
                siblings = [f"{parent}.{s}" for s in shards if f"{parent}.{s}" in present]
                if not any(s in quantized for s in siblings):
                    continue
                raise NamingError(
                    f"{parent}.{fused_leaf}: shards {siblings} would be quantized differently; the engines fuse "
                    f"them into one module and refuse to load ('different quantization schemes'). "
                    f"Quantize all of {list(shards)} or none.")


def expert_groups(modules: set[str]) -> dict[str, set[str]]:
    """Routed-expert modules grouped by their FusedMoE module ``<layer>.mlp.experts``."""
    groups: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        match = _ROUTED_EXPERT.match(module)
        if match:
            groups[match.group(1)].add(module)
    return groups


def check_expert_agreement(kept: set[str], quantized: set[str]) -> None:
    kept_groups, quantized_groups = expert_groups(kept), expert_groups(quantized)
    for aggregate in sorted(kept_groups.keys() & quantized_groups.keys()):
        raise NamingError(
            f"{aggregate}: {len(kept_groups[aggregate])} routed-expert weights stay bf16 and "
            f"{len(quantized_groups[aggregate])} are quantized; the engines load all experts of a layer into one "
            f"FusedMoE module with one scheme. Quantize all routed experts of the layer or none.")


def check_draft_collisions(kept: set[str], quantized: set[str], num_hidden_layers: int, family=DEFAULT_FAMILY) -> None:
    """Refuse a draft module quantized otherwise than the main-model module its engine name is
    (sglang builds Qwen3-Next's mtp.layers.0.* as model.layers.0.*): one exclude list decides both."""
    present = kept | quantized
    for rules in _all_rule_sets(family):
        if rules["mtp_naming"]["style"] != "renames":
            continue
        for module in sorted(present):
            alias = draft_name(module, rules, num_hidden_layers) if is_draft(module, rules, num_hidden_layers) else None
            if alias in present and alias != module and (module in kept) != (alias in kept):
                raise NamingError(
                    f"{module}: {rules.engine} builds the draft's module as {alias}, the main model's module of that "
                    f"name, and looks both up in one exclude list; the recipe quantizes one of them only "
                    f"({'the draft' if alias in kept else 'the main model'}'s). Quantize the draft's "
                    f"{module.split('.')[-1]} as the main model's (or serve without the MTP draft from a checkpoint "
                    "without mtp.* tensors).")


def build_exclude(kept: set[str], quantized: set[str], num_hidden_layers: int, family=DEFAULT_FAMILY) -> list[str]:
    """The sorted, exact exclude list for modules left unquantized (``kept``), in the names every
    release read for the family's model classes looks up."""
    check_fused_agreement(kept, quantized, family)
    check_expert_agreement(kept, quantized)
    check_draft_collisions(kept, quantized, num_hidden_layers, family)
    names = set(kept) | set(expert_groups(kept)) | _fused_names(kept, family) | _absent_shards(kept, quantized, family)
    aliases = {alias for rules in _all_rule_sets(family) for name in names
               for alias in (draft_name(name, rules, num_hidden_layers),
                             draft_module_name(name, rules, num_hidden_layers),
                             _unmapped_draft_name(name, rules, num_hidden_layers))}
    return sorted(names | {alias for alias in aliases if alias} | _stored_fused_shards(kept, family))


def _unmapped_draft_name(module: str, rules, num_hidden_layers: int) -> str | None:
    """For a draft module that shares the main class's exclude list after the class's mapper renamed every
    entry under the draft's own prefix (dots.note in vLLM: model. -> language_model.model., while the draft
    builds model.layers.N.*), the draft's name as a ``re:`` entry: the mapper renames plain names only,
    and Quark matches a ``re:`` entry by re.match, so this one reaches the draft's module alone."""
    mapper = rules.values.get("exclude_mapper")
    if not mapper or "quark" not in mapper["kinds"] or not is_draft(module, rules, num_hidden_layers):
        return None
    name = draft_name(module, rules, num_hidden_layers)
    if name is None or mapped_entry(name, mapper) == name:
        return None
    return "re:" + re.escape(name) + "$"


def _stored_fused_shards(kept: set[str], family=DEFAULT_FAMILY) -> set[str]:
    """For a module stored as one tensor that a class builds under a fused name (GLM-5.3-Flash's vision
    attn.qkv, built as attn.qkv_proj), that fused module's shards under the class's name: a release whose
    Quark matching looks a fused module up by its shards only (sglang 0.5.20) finds them there."""
    out = set()
    for rules in _all_rule_sets(family):
        for name in kept:
            parent, _, leaf = class_name(name, rules).rpartition(".")
            if leaf != name.rpartition(".")[2] and leaf in rules["quark_fused"]:
                out.update(f"{parent}.{shard}" for shard in rules["quark_fused"][leaf])
    return out
