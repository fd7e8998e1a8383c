"""How vllm builds a module of a Quark checkpoint with per-layer schemes (``quant.engines.quark_layers``).

vLLM's quantization layer decides, the same for every model class (quark/quark.py QuarkConfig, quark_moe.py
QuarkMoEMethod); the rule values per release are in ``manifests/engines/quark_layers.vllm.yaml`` (schema
``RULES``). ``decide`` replays them for one engine module the exclude list leaves quantized:

1. The spec (``_find_matched_config``), the config's keys renamed first by the class's weight-name mapper
   (QuarkConfig.apply_vllm_mapper, as for the exclude list: ``exclude_mapper``): the first ``layer_quant_config`` key
   matching the module's name, a key with ``*`` by fnmatch, one without as a string the name is contained in
   (``name_match``: so the exact key of one expert's projection, ``model.layers.1.mlp.experts.0.gate_proj``, contains
   the FusedMoE's name and selects the whole FusedMoE), else ``layer_type_quant_config`` (its keys compared with the
   layer's class object, never equal to a string: ``layer_type`` ``never``), else ``global_quant_config``. A fused
   module (the class's packed_modules_mapping, ``quark_fused``) is asked through its shards, which must resolve to
   one spec, else the release raises (``mixed_shards_error``).
2. A FusedMoE is asked once, by its own name (``model.layers.N.mlp.experts``, ``moe_asked``: ``module``),
   never per expert: a ``...experts.*`` key does not match it, ``...experts*`` does.
3. The scheme the spec is (``quant.rungs.rung_of_spec``) is built where the rule lists the rung for the
   module's kind (``linear_built`` / ``moe_built``: the class the release constructs), else the release
   raises (the rule's message). A spec of no rung is not judged (the replay says so).

The MTP draft is built with the same QuarkConfig (the draft model's quant config is the target's), so its
modules are decided the same way by their engine names.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from quant.engines.format_rules import Decision
from quant.engines.rule_kinds import Rule
from quant.engines.rules import RuleSet
from quant.rungs import RUNGS, rung_of_spec
from quant.schema import Schema

KEY = "quark_layers"  # format_rules.key("quark-layers"): where a cut rule set keeps these rules


class _Raises(ValueError):  # control flow inside decide: always caught there, never a user error
    """The release raises while it matches a module: its message, the rule that says so and what to do."""

    def __init__(self, message: str, rule: str, fix: str):
        super().__init__(message)
        self.rule, self.fix = rule, fix


class NameMatch(Schema):
    """How a ``layer_quant_config`` key matches a module name: ``pattern`` for a key with ``*`` (``fnmatch``:
    shell patterns, the whole name), ``plain`` for one without (``contained``: the name is a substring of
    the key; ``exact``: equal)."""
    pattern: Literal["fnmatch"]
    plain: Literal["contained", "exact"]


class Built(Schema):
    """What the release does with a rung's spec for one kind of module: the class it ``builds`` or the
    message it ``raises`` (the start of it: messages that quote the spec go on with it)."""
    builds: str | None = None
    raises: str | None = None


class QuarkLayersRules(Schema):
    """The rule fields of manifests/engines/quark_layers.vllm.yaml (each a ``rule_kinds.Rule``), each rule set
    stating only what changed since the previous one."""
    name_match: Rule[NameMatch] | None = None
    layer_type: Rule[Literal["never", "class_name"]] | None = None  # layer_type_quant_config's keys
    mixed_shards_error: Rule[str] | None = None  # a fused module's shards with different specs ({shards} {module})
    moe_asked: Rule[Literal["module", "experts"]] | None = None  # a FusedMoE by its own name or per expert
    linear_built: Rule[dict[str, Built]] | None = None  # rung -> what a Linear gets
    moe_built: Rule[dict[str, Built]] | None = None  # rung -> what a FusedMoE gets


RULES = QuarkLayersRules


def key_matches(name: str, key: str, rule: dict) -> bool:
    """quark.py QuarkConfig._find_matched_config (get_layer_quant_config_from_name from 0.29.0): fnmatch for
    a key with ``*``, else containment of the name in the key."""
    if "*" in key:
        return fnmatchcase(name, key)
    return name in key if rule["plain"] == "contained" else name == key


def mapped_key(key: str, rules: RuleSet) -> str | None:
    """A ``layer_quant_config`` key as the release holds it: QuarkConfig.apply_vllm_mapper renames the keys
    of the config's dicts by the class's weight-name mapper as it renames the exclude list (``exclude_mapper``;
    None: dropped)."""
    # imported here: the replay imports this module
    from quant.engines.replay import mapped_entry

    mapper = rules.values.get("exclude_mapper")
    if not mapper or mapper.get("style") != "vllm" or "quark" not in mapper.get("kinds", ["quark"]):
        return key
    return mapped_entry(key, mapper)


def held_config(qconfig: dict, rules: RuleSet) -> dict:
    """The config with its ``layer_quant_config`` keys as the release holds them (``mapped_key``)."""
    keys = qconfig.get("layer_quant_config") or {}
    return {**qconfig, "layer_quant_config": {m: spec for key, spec in keys.items()
                                              if (m := mapped_key(key, rules)) is not None}}


def layer_spec(name: str, qconfig: dict, rule: dict) -> tuple[dict | None, str]:
    """The spec a module that is not fused gets, and where it came from."""
    for key, spec in (qconfig.get("layer_quant_config") or {}).items():
        if key_matches(name, key, rule["name_match"]):
            return spec, f"layer_quant_config key {key!r}"
    # imported here: compressed_tensors imports the replay
    from quant.engines.compressed_tensors import linear_class

    by_type = qconfig.get("layer_type_quant_config") or {}
    if rule["layer_type"] == "class_name" and (cls := linear_class(name)) in by_type:  # a release keyed by name
        return by_type[cls], f"layer_type_quant_config key {cls!r}"
    return qconfig.get("global_quant_config"), "global_quant_config (no layer_quant_config key matches)"


def matched_spec(name: str, qconfig: dict, fused: dict[str, list[str]], rule: dict) -> tuple[dict | None, str]:
    """_find_matched_config: the spec the release gives engine module ``name`` (``_Raises`` where the shards
    of a fused module disagree)."""
    leaf = name.split(".")[-1]
    if leaf not in fused:
        return layer_spec(name, qconfig, rule)
    asked = [layer_spec(name.replace(leaf, shard), qconfig, rule) for shard in fused[leaf]]
    if any(spec != asked[0][0] for spec, _ in asked):
        raise _Raises(rule["mixed_shards_error"].format(shards=fused[leaf], module=name), "mixed_shards_error",
                      f"give every shard of {name} ({', '.join(fused[leaf])}) one layer_quant_config spec")
    return asked[0][0], f"its shards {', '.join(fused[leaf])} by {asked[0][1]}"


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           members: tuple[str, ...] = ()) -> Decision:
    """The rung release ``rules`` builds engine module ``module`` with (a FusedMoE as ``...mlp.experts``;
    ``members``: the engine's names of its checkpoint modules, per expert), or the error it raises."""
    rule = rules.values[KEY]
    cites = {k.split(".", 1)[1]: v.split(" (")[0] for k, v in rules.cites.items() if k.startswith(KEY + ".")}
    fused = {} if moe else (rules.values.get("quark_fused") or {})
    asked = module if not moe or rule["moe_asked"] == "module" or not members else members[0]
    try:
        spec, why = matched_spec(asked, held_config(qconfig, rules), fused, rule)
    except _Raises as exc:
        return Decision(None, cites.get(exc.rule, ""), exc.fix, raises=str(exc))
    what = "FusedMoE" if moe else "Linear"
    why = f"{asked} matches {why} ({cites.get('name_match', '')})"
    if draft:
        why += "; the MTP draft is built with the same QuarkConfig"
    rung = rung_of_spec(spec)
    if rung is None:
        return Decision(None, why, unread=f"the {what} scheme of a spec that is none of the ladder's rungs "
                                          f"({', '.join(r for r in RUNGS if r != 'bf16')})")
    built = (rule["moe_built"] if moe else rule["linear_built"]).get(rung) or {}
    table = "moe_built" if moe else "linear_built"
    if built.get("builds"):
        return Decision(rung, f"{why}: {RUNGS[rung].label} {rung}, built as {built['builds']} "
                              f"({cites.get(table, '')})")
    return Decision(rung, f"{why}: {RUNGS[rung].label} {rung}, which this release builds no {what} with "
                          f"({cites.get(table, '')})",
                    f"serve with a release that builds {rung} for a {what}, or give {module} another rung",
                    raises=built.get("raises") or f"no {what} scheme for {rung}")


def asked_name(module: str, role: str) -> str:
    """The name the release asks for a checkpoint Linear: its own, or a routed expert's FusedMoE
    (``...mlp.experts``, get_moe_method's layer_name); a fused module asks through its shards' names."""
    if role == "routed_expert" and ".experts." in module:
        return module[:module.rindex(".experts.") + len(".experts")]
    return module


def unmatched_keys(qconfig: dict, roles: dict[str, str], rules: RuleSet, others: set[str] = frozenset()) \
        -> list[str]:
    """The ``layer_quant_config`` keys that match no name the release asks for these modules (engine name ->
    its role) nor one of ``others`` (other releases' names of them): a key that selects nothing, such as
    ``...experts.*`` for a FusedMoE asked as ``...experts``."""
    rule = rules.values.get(KEY)
    if not rule:
        return []
    asked = {asked_name(m, role) for m, role in roles.items()} | set(others)
    return [key for key in qconfig.get("layer_quant_config") or {} if (held := mapped_key(key, rules)) is None
            or not any(key_matches(name, held, rule["name_match"]) for name in asked)]


__all__ = ["KEY", "RULES", "asked_name", "decide", "key_matches", "matched_spec", "unmatched_keys"]
