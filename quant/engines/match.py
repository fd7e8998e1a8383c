"""The one matcher: does an engine build a module quantized, given the checkpoint's exclude list?

Each function mirrors one engine function, switched by the rule set's data (see
``manifests/engines/*.yaml`` for the file and release each switch comes from). The converter's
exclude list and ``gate checkpoint`` both decide through here, and
``tests/quant/test_engine_sources.py`` runs the engines' own functions beside these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from quant.errors import QuantgateError


class MixedShards(QuantgateError, ValueError):
    """The engine raises at load: the shards of one fused module disagree (message = the engine's)."""


FP8_MIXED = ("ValueError: Detected some but not all shards of {module} are quantized. All shards of fused layers "
             "to have the same precision.")  # both engines' is_layer_skipped


class Exclude:
    """An exclude list, indexed once: exact entries in a set, ``re:`` entries compiled."""

    def __init__(self, entries: Iterable[str]):
        self.entries = [e for e in entries if isinstance(e, str)]
        self.exact = {e for e in self.entries if not e.startswith("re:")}
        self.patterns = [re.compile(e[3:]) for e in self.entries if e.startswith("re:")]

    def matches(self, name: str) -> bool:
        return name in self.exact or any(p.match(name) for p in self.patterns)


def _any_match(name: str, exclude: Exclude) -> bool:
    return exclude.matches(name)


def _shards(module: str, leaf: str, shard_leaves: Iterable[str]) -> list[str]:
    return [module.replace(leaf, shard) for shard in shard_leaves]  # both engines use str.replace


def quark_excluded(module: str, exclude: Exclude, fused: Mapping[str, list[str]], *, fused_first: bool,
                   experts_prefix: str, routed_experts: bool, error: str) -> bool:
    """Quark ``should_ignore_layer``: True when ``module`` is built unquantized.

    ``experts_prefix``: ``none``; ``any_entry`` (sglang >= 0.5.21: a name ending in ``.experts`` is
    excluded when any entry starts with ``<name>.``); ``children`` (vLLM's check_children for routed
    experts: a non-``re:`` entry equal to the name or starting with ``<name>.``).
    """
    if experts_prefix == "children" and routed_experts and any(
            e == module or e.startswith(module + ".") for e in exclude.exact):
        return True
    leaf = module.rsplit(".", 1)[-1]
    if (fused_first or leaf not in fused) and _any_match(module, exclude):
        return True
    if experts_prefix == "any_entry" and module.endswith(".experts") and any(
            e.startswith(module + ".") for e in exclude.entries):
        return True
    if leaf not in fused:
        return False
    decisions = [_any_match(shard, exclude) for shard in _shards(module, leaf, fused[leaf])]
    if len(set(decisions)) > 1:
        raise MixedShards(error.format(module=module, shards=list(fused[leaf])))
    return decisions[0]


def fp8_ignored_layers(qconfig: dict, keys: list[str], keys_mode: str, model_prefix_variants: bool) -> list[str]:
    """The entries an engine's ``Fp8Config.from_config`` keeps (sglang: first key present, both
    ``model.``-prefixed and bare; vLLM: ``ignored_layers`` unless empty, else ``modules_to_not_convert``)."""
    entries = None
    for key in keys:
        if keys_mode == "first_present" and key in qconfig:
            entries = qconfig[key]
            break
        if keys_mode == "first_nonempty" and qconfig.get(key):
            entries = qconfig[key]
            break
    entries = list(entries or [])
    if model_prefix_variants:
        entries = [v for e in entries for v in (e.removeprefix("model."), "model." + e.removeprefix("model."))]
    return entries


def _module_path_match(entry: str, module: str, strip_dots: bool = True) -> bool:
    if strip_dots:  # sglang >= 0.5.13: an entry "model.layers.1." names that layer's path
        entry, module = entry.rstrip("."), module.rstrip(".")
    return entry == module or module.startswith(entry + ".") or f".{entry}." in f".{module}."


def fp8_fused_first(skip: Mapping) -> bool:
    """Whether an FP8 rule honours a listed fused name before asking its shards (vLLM's exact match
    from 0.24.0 does; sglang and older vLLM only ask the shards)."""
    stated = skip.get("fused_first")
    return skip["match"] == "exact" if stated is None else stated


def fp8_skipped(module: str, ignored: list[str], fused: Mapping[str, list[str]], *, match: str, experts: str,
                fallback_fused: Mapping[str, list[str]], fused_first: bool | None = None,
                strip_dots: bool = True) -> bool:
    """FP8 ``is_layer_skipped``: True when ``module`` is built unquantized.

    ``match``: ``exact`` (vLLM), ``substring`` (sglang <= 0.5.10: ``entry in module``) or
    ``module_path`` (sglang >= 0.5.11: whole dotted components or a path prefix). ``experts``:
    how a name containing "experts" is decided outside the fused path (``contained``: vLLM returns
    whether an entry containing "experts" contains the name; ``replace`` / ``or``: sglang replaces /
    ors its first answer with that test). ``strip_dots``: ``module_path`` strips an entry's trailing dots
    (sglang 0.5.11-0.5.12 does not: there ``model.layers.1.`` matches nothing).
    """
    hit = {"exact": lambda name: name in ignored,
           "substring": lambda name: any(e in name for e in ignored),
           "module_path": lambda name: any(_module_path_match(e, name, strip_dots) for e in ignored)}[match]
    leaf = module.rsplit(".", 1)[-1]
    if (match == "exact" if fused_first is None else fused_first) and leaf in fused and hit(module):
        return True  # vLLM >= 0.24.0: a listed fused name is honoured before expanding
    mapping = fused if leaf in fused else fallback_fused
    if leaf in mapping:
        decisions = [hit(shard) for shard in _shards(module, leaf, mapping[leaf])]
        if len(set(decisions)) > 1:
            raise MixedShards(FP8_MIXED.format(module=module))
        return decisions[0]
    contained = "experts" in module and any(module in e for e in ignored if "experts" in e)
    if match == "exact":
        return contained if "experts" in module else hit(module)
    skipped = hit(module)
    if "gate_up_proj" in module:
        return skipped or (module.replace("gate_up_proj", "gate_proj") in ignored
                           and module.replace("gate_up_proj", "up_proj") in ignored)
    if "experts" in module:
        return contained if experts == "replace" else skipped or contained
    return skipped
