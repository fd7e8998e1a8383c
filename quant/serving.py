"""Engine naming: the exclude entries sglang and vLLM really match (SPEC sections 3-4).

Both engines call ``should_ignore_layer(prefix, exclude, packed_modules_mapping)`` with their own
module name and compare by exact string equality (or ``re.match`` for ``re:`` entries; no
globs). So the exclude list must hold engine module names:
- the checkpoint module name of every Linear left in bf16 (vLLM and the main layers of sglang);
- for the MTP layer, sglang's draft-model alias next to it (``model.decoder.*`` / ``model.*``;
  sglang ``python/sglang/srt/models/deepseek_nextn.py`` loads ``model.layers.{N}.*`` into a
  model whose prefix is ``model`` and whose decoder layer is ``model.decoder``);
- fused module names (``gate_up_proj``, ``fused_qkv_a_proj_with_mqa`` ...) where every shard is
  excluded, for code paths that look the fused name up directly;
- ``<layer>.mlp.experts`` when a layer's routed experts stay bf16: they load into one FusedMoE
  module of that name, which no per-expert entry matches in sglang.
"""

from __future__ import annotations

import re
from collections import defaultdict

from quant.layout import Family

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ROUTED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.[^.]+$")


class NamingError(ValueError):
    """A quantization choice the engines cannot load (the message says which modules and why)."""


def sglang_mtp_alias(module: str, num_hidden_layers: int, family: Family) -> str | None:
    """sglang's module name for an MTP-layer module, or None for a main-layer module."""
    match = _LAYER.match(module)
    if not match or int(match.group(1)) < num_hidden_layers:
        return None
    rest = match.group(2)
    if any(rest == part or rest.startswith(part + ".") for part in family.mtp_top_level):
        return "model." + rest
    return "model.decoder." + rest


def _fused_names(modules: set[str], family: Family) -> set[str]:
    """Fused module names whose every shard is in ``modules`` (routed experts excepted)."""
    fused: set[str] = set()
    for module in modules:
        if _ROUTED_EXPERT.match(module):
            continue
        parent, _, leaf = module.rpartition(".")
        for fused_leaf, shards in family.fused.items():
            if leaf in shards and all(f"{parent}.{s}" in modules for s in shards):
                fused.add(f"{parent}.{fused_leaf}")
    return fused


def check_fused_agreement(kept: set[str], quantized: set[str], family: Family) -> None:
    """Refuse a split that makes an engine raise "different quantization schemes"."""
    present = kept | quantized
    for module in sorted(kept):
        if _ROUTED_EXPERT.match(module):
            continue
        parent, _, leaf = module.rpartition(".")
        for fused_leaf, shards in family.fused.items():
            siblings = [f"{parent}.{s}" for s in shards if f"{parent}.{s}" in present]
            if leaf in shards and any(s in quantized for s in siblings):
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


def build_exclude(kept: set[str], quantized: set[str], family: Family, num_hidden_layers: int) -> list[str]:
    """The sorted, exact exclude list for modules left bf16 (``kept``), with engine aliases."""
    check_fused_agreement(kept, quantized, family)
    check_expert_agreement(kept, quantized)
    names = set(kept)
    names |= {aggregate for aggregate in expert_groups(kept)}
    names |= _fused_names(kept, family)
    aliases = {sglang_mtp_alias(name, num_hidden_layers, family) for name in names}
    names |= {alias for alias in aliases if alias}
    return sorted(names)
