"""How an engine release builds each module of a compressed-tensors checkpoint (``quant_method:
compressed-tensors``, llm-compressor's format): which config group (or none) its quantization layer gives
the module, and whether it builds that scheme or raises. The format's own resolution
(``quant.third_party.Config.resolve``) says what the checkpoint stores; this is what the engine asks for.

The decision is the engine's quantization layer, the same for every model class; only the names it is
asked with come from the class (its packed_modules_mapping as ``quark_fused``, its hf_to_vllm_mapper as
``exclude_mapper``). Rule values per release are in ``manifests/engines/compressed_tensors.<engine>.yaml``
(schema ``RULES``); ``decide`` replays them for one engine module:

1. The config as the engine holds it: config groups whose only target is an ``...Attention`` class are
   dropped (``attention_groups``), another group without weights args raises (``weightless_group``), as
   do weights args of a refused activation ordering (``actorder_refused``); each group's targets map to its
   args (a target in two groups: the later wins); ``ignore`` entries and targets that are layer paths (a
   dot, no ``re:``) go through the class's weight-name mapper (vLLM ``apply_vllm_mapper``).
2. ``ignore`` (``ignore_match``): an entry matches a name exactly or by ``re:`` (re.match); a fused module
   (qkv_proj, gate_up_proj) is asked through its shards, which must agree (else the engine raises), unless
   the fused name itself is listed (``fused_first``: ``exact``, listed exactly; ``any``, matched by any entry).
3. The config group (``target_match``): the first target matching the name, the module's class name
   (case-insensitive substring, or ``re:``), or all shards of a fused module, in the rule's ``order``; a
   module no target matches raises or is built unquantized (``unmatched``).
4. A FusedMoE (``moe_match``) is asked as expert 0's three projections (``{module}.0.gate_proj`` ...: the
   names fixed, or the class's checkpoint names), its class named ``class_name``, a ``Linear`` target
   standing for it too; the three must resolve to one scheme (else the engine raises), and an ignored
   projection makes the whole FusedMoE unquantized. A FusedMoE prefix in ``ignore`` (``...mlp.experts``)
   matches none of those names.
5. ``lm_head`` (ParallelLMHead): built unquantized whatever the config says (``unquantized``), or given
   a scheme like a Linear, a ValueError while matching meaning unquantized (``scheme``), or quantized only
   where a target names it and ignore does not, class targets not counting (``by_name``, sglang).
6. The scheme the group names: the compressed-tensors preset its args are (``PRESETS``: the library's
   PRESET_SCHEMES, and weight-only FP8), built when the rule lists it for the module's kind (``linear_schemes`` /
   ``moe_schemes``), else the release raises (its exception and words vary by preset and release). Args of
   no preset are not judged (the label on disk is taken as built, and ``why`` says so).

sglang (``compressed_tensors.sglang.yaml``) differs by rule values: a plain ignore entry matched as a
substring, later as a dotted suffix (``ignore_match.plain``); before 0.5.17 only the top-level ``format``
read (``group_format``) and before 0.5.16 a pack-quantized group's activations not read
(``activation_formats``); a Linear preset built only from the formats it lists (``linear_formats``); MXFP4
experts built by Mxfp4MoEMethod before ignore is asked from 0.5.17 (``mxfp4_moe``); the WNA16 experts'
constructor refusing a top-level format other than pack-quantized and, until 0.5.14, reading the ``Linear``
target's args (``wna16_moe``).
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Literal

from quant.engines.format_rules import Decision
from quant.engines.replay import mapped_entry
from quant.engines.rule_kinds import Rule
from quant.engines.rules import RuleSet
from quant.schema import Schema
from quant.third_party import CT, scheme_label


class _Raises(ValueError):  # control flow inside decide: always caught there, never a user error
    """The release raises while it reads the config or matches a module: its message, the rule that says so
    and what to do."""

    def __init__(self, message: str, rule: str, fix: str):
        super().__init__(message)
        self.rule, self.fix = rule, fix


KEY = "compressed_tensors"  # format_rules.key("compressed-tensors"): where a cut rule set keeps these rules

# The names a FusedMoE asks for expert 0 when the release does not take the class's checkpoint names.
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


class IgnoreMatch(Schema):
    """How ``ignore`` decides a module. ``fused_first``: a fused module's own name decides before its
    shards when listed ``exact`` (vLLM < 0.30.0: ``layer_name not in ignore``) or matched by ``any`` entry
    (vLLM >= 0.30.0: quantization/utils/config_utils.py find_matching_patterns). ``fnmatch``: entries also
    match as shell patterns. ``plain``: how an entry without ``re:`` matches a name: ``exact``; ``contains``
    (sglang < 0.5.17: a case-insensitive substring, so a parent module's entry takes its children); ``suffix``
    (sglang >= 0.5.17: the name or a dotted suffix of it). ``mixed_shards_error``: the message raised when
    some shards only are listed (``{module}``, ``{shards}``: the fused module and its shard leaves)."""
    fused_first: Literal["exact", "any"]
    fnmatch: bool
    plain: Literal["exact", "contains", "suffix"] = "exact"
    mixed_shards_error: str


class TargetMatch(Schema):
    """How a config group's ``targets`` are matched: ``order`` of the three ways (``name``: exact or
    ``re:``; ``class``: the module's class name, case-insensitive substring or ``re:``; ``fused``: every
    shard of a fused module by name, the first shard's target), and a module no target matches:
    ``raise`` (``unmatched_error``, ``{module}``) or built ``unquantized``."""
    order: list[Literal["name", "class", "fused"]]
    unmatched: Literal["raise", "unquantized"]
    unmatched_error: str = ""


class MoeMatch(Schema):
    """How a FusedMoE is given its scheme: ``class_name`` (its class: a ``Linear`` target is copied to this
    name before matching), ``expert_leaves`` (``fixed``: expert 0's gate_proj / up_proj / down_proj;
    ``checkpoint``: the class's checkpoint names for them), ``mixed_error`` (raised when the three differ)."""
    class_name: str
    expert_leaves: Literal["fixed", "checkpoint"]
    mixed_error: str


class ActorderRefused(Schema):
    """Weights args whose ``actorder`` (activation ordering, GPTQ's; ``true`` is ``group``) the release
    refuses when it reads the config, every module with them: ``orders``, and its message (``{actorder}``)."""
    orders: list[str]
    error: str


class Wna16Moe(Schema):
    """sglang's CompressedTensorsWNA16MoE, which the experts of ``presets`` get: it refuses a top-level format
    not in ``formats``; ``args``: the weights args it reads, the matched group's (``matched``) or the
    ``Linear`` target's (``linear_target``: a config without one raises KeyError)."""
    presets: list[str]
    formats: list[str]
    args: Literal["matched", "linear_target"]


class CompressedTensorsRules(Schema):
    """A compressed-tensors rule set: each rule ``{value, cite}`` (``rule_kinds.Rule``), stating only what
    changed since the previous set."""
    attention_groups: Rule[Literal["dropped", "kept"]] | None = None
    weightless_group: Rule[Literal["raise", "skipped"]] | None = None  # a group without weights args
    actorder_refused: Rule[ActorderRefused] | None = None
    ignore_match: Rule[IgnoreMatch] | None = None
    target_match: Rule[TargetMatch] | None = None
    moe_match: Rule[MoeMatch] | None = None
    lm_head: Rule[Literal["unquantized", "scheme", "by_name"]] | None = None
    # sglang's differences (a rule not stated is vLLM's way): a group's own ``format`` read or only the
    # top-level one; the formats whose groups' input_activations are read (None: every format); MXFP4 experts
    # through the scheme path or given Mxfp4MoEMethod before ignore is asked; the WNA16 experts' own checks
    group_format: Rule[bool] | None = None
    activation_formats: Rule[list[str] | None] | None = None
    mxfp4_moe: Rule[Literal["scheme", "before_ignore"]] | None = None
    wna16_moe: Rule[Wna16Moe] | None = None
    linear_formats: Rule[dict[str, list[str]] | None] | None = None  # preset ("*": any) -> formats it builds from
    int_weight_only_refused: Rule[bool] | None = None  # an activation format's weight-only int group refuses the config
    linear_schemes: Rule[list[str]] | None = None  # the PRESETS a Linear is built with
    moe_schemes: Rule[list[str]] | None = None  # the PRESETS a FusedMoE is built with


RULES = CompressedTensorsRules

# compressed-tensors' preset schemes (quantization/quant_scheme.py PRESET_SCHEMES, 0.20.1) and weight-only
# FP8, by the args that tell them apart: weights and input activations as (type, num_bits, strategy, symmetric, dynamic,
# group_size: only where the scheme fixes it). The args llm-compressor writes for each preset name.
_INT8_TOKEN = ("int", 8, "token", True, True, None)
_FP8_TOKEN = ("float", 8, "token", True, True, None)
PRESETS: dict[str, tuple[tuple, tuple | None]] = {
    "W4A16": (("int", 4, "group", True, False, None), None),
    "W4A16_ASYM": (("int", 4, "group", False, False, None), None),
    "W8A16": (("int", 8, "group", True, False, None), None),
    "W8A8": (("int", 8, "channel", True, False, None), _INT8_TOKEN),
    "W4A8": (("int", 4, "group", True, False, None), _INT8_TOKEN),
    "W4AFP8": (("int", 4, "group", True, False, None), _FP8_TOKEN),
    "FP8": (("float", 8, "tensor", True, False, None), ("float", 8, "tensor", True, False, None)),
    "FP8_DYNAMIC": (("float", 8, "channel", True, False, None), _FP8_TOKEN),
    "FP8_BLOCK": (("float", 8, "block", True, False, None), ("float", 8, "group", True, True, 128)),
    "NVFP4A16": (("float", 4, "tensor_group", True, False, 16), None),
    "NVFP4": (("float", 4, "tensor_group", True, False, 16), ("float", 4, "tensor_group", True, "local", 16)),
    "MXFP4A16": (("float", 4, "group", True, False, 32), None),
    "MXFP4": (("float", 4, "group", True, False, 32), ("float", 4, "group", True, True, 32)),
    "MXFP4XFP8": (("float", 4, "group", True, False, 32), ("float", 8, "group", True, True, 128)),
    "MXFP8A16": (("float", 8, "group", True, False, 32), None),
    "MXFP8": (("float", 8, "group", True, False, 32), ("float", 8, "group", True, True, 32)),
    # weight-only FP8: no library preset, a recipe's weights-only scheme (the library writes it naive-quantized)
    "FP8A16": (("float", 8, "tensor", True, False, None), None),
    "FP8A16_CHANNEL": (("float", 8, "channel", True, False, None), None),
    "FP8A16_BLOCK": (("float", 8, "block", True, False, None), None),
}


def _args(args: dict | None) -> tuple | None:
    """Quantization args as ``PRESETS`` compares them, with the library's defaults (QuantizationArgs:
    type int, symmetric, static; strategy from group_size: none tensor, positive group, -1 channel)."""
    if not isinstance(args, dict):
        return None
    group = args.get("group_size")
    strategy = args.get("strategy") or ("tensor" if group is None else "group" if group > 0 else "channel")
    return (args.get("type", "int"), args.get("num_bits", 8), strategy, args.get("symmetric", True) is not False,
            args.get("dynamic", False), group)


def _same(args: tuple | None, preset: tuple | None) -> bool:
    if args is None or preset is None:
        return args is preset
    return args[:5] == preset[:5] and (preset[5] is None or args[5] == preset[5])


def preset(weights: dict | None, activations: dict | None) -> str | None:
    """The preset (``PRESETS``) a group's weights and input activations are, None when they are none."""
    ours = _args(weights), _args(activations)
    return next((name for name, (w, a) in PRESETS.items() if _same(ours[0], w) and _same(ours[1], a)), None)


def _hit(value: str, target: str, contains: bool = False, shell: bool = False, plain: str = "exact") -> bool:
    """utils.py _is_equal_or_regex_match (later quantization/utils/config_utils.py is_equal_or_regex_match);
    ``plain``: how an entry without ``re:`` matches (``IgnoreMatch.plain``)."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains or plain == "contains":
        return target.lower() in value.lower()
    if plain == "suffix" and value.endswith("." + target):
        return True
    return target == value or (shell and fnmatchcase(value, target))


def ignored(name: str, ignore: list[str], fused: dict[str, list[str]], rule: dict) -> tuple[bool, str | None]:
    """utils.py should_ignore_layer: whether ``name`` is ignored, and the entry that decided (a ValueError
    with the release's message where its shards disagree)."""
    shell, plain = rule["fnmatch"], rule.get("plain", "exact")

    def entry(value: str) -> str | None:
        return next((e for e in ignore if _hit(value, e, shell=shell, plain=plain)), None)

    leaf = name.split(".")[-1]
    if rule["fused_first"] == "any" and (hit := entry(name)):
        return True, hit
    if leaf in fused and not (rule["fused_first"] == "exact" and name in ignore):
        hits = [entry(name.replace(leaf, shard)) for shard in fused[leaf]]
        if len({h is not None for h in hits}) > 1:
            raise _Raises(rule["mixed_shards_error"].format(module=name, shards=fused[leaf]), "ignore_match",
                         f"list every shard of {name} in ignore ({', '.join(fused[leaf])}), or none")
        return hits[0] is not None, hits[0]
    hit = entry(name)
    return hit is not None, hit


def matched_target(name: str, cls: str, targets: list[str], fused: dict[str, list[str]], order: list[str]) \
        -> tuple[str | None, str]:
    """utils.py find_matched_target: the first target matching ``name`` by each way of ``order``, and how."""
    for way in order:
        if way == "name":
            found = next((t for t in targets if _hit(name, t)), None)
        elif way == "class":
            found = next((t for t in targets if _hit(cls, t, contains=True)), None)
        else:
            found = _fused_target(name, targets, fused)
        if found is not None:
            return found, way
    return None, ""


def _fused_target(name: str, targets: list[str], fused: dict[str, list[str]]) -> str | None:
    """utils.py _match_fused_layer: every shard of the fused module the name ends with matched by a target."""
    key = next((k for k in fused if name.endswith(k)), None)
    if key is None:
        return None
    found = [next((t for t in targets if _hit(name.replace(key, shard), t)), None) for shard in fused[key]]
    return found[0] if all(found) else None


def linear_class(module: str) -> str:
    """The vLLM Linear class a leaf is built as (linear.py), for class-name targets: every one contains
    ``Linear``, which is what llm-compressor writes."""
    leaf = module.rsplit(".", 1)[-1]
    return {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
            "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear"}.get(leaf, "ColumnParallelLinear")


def engine_config(qconfig: dict, rules: RuleSet) -> tuple[dict[str, dict], list[str]]:
    """compressed_tensors.py CompressedTensorsConfig.from_config + apply_vllm_mapper: target -> its group
    (``{"name", "weights", "input_activations", "format"}``) and the ignore list, as the engine matches them."""
    rule = rules.values[KEY]
    mapper = rules.values.get("exclude_mapper")
    mapper = mapper if mapper and mapper.get("style") == rules.engine else None

    def mapped(entry: str) -> str | None:
        is_path = "." in entry and not entry.startswith("re:")
        return mapped_entry(entry, mapper) if is_path and mapper else entry

    targets: dict[str, dict] = {}
    for name, group in (qconfig.get("config_groups") or {}).items():
        listed = [str(t) for t in group.get("targets") or []]
        if rule["attention_groups"] == "dropped" and len(listed) == 1 and listed[0].endswith("Attention"):
            continue  # attention quantization is the KV cache's: its group builds no module
        if group.get("weights") is None:
            if rule["weightless_group"] == "raise":
                raise _Raises(f"config group {name!r} has no weights args: the release validates them as "
                             "QuantizationArgs, and None is none", "weightless_group",
                             f"give config group {name!r} its weights args, or move what it quantizes to "
                             "kv_cache_scheme")
            continue  # activations only: nothing a module's weights are built with
        order = group["weights"].get("actorder")
        order = "group" if order is True else order.lower() if isinstance(order, str) else None
        if order in rule["actorder_refused"]["orders"]:
            raise _Raises(rule["actorder_refused"]["error"].format(actorder=repr(order)), "actorder_refused",
                         "serve with a release that reads it, or quantize again with actorder static or weight")
        for target in listed:
            if (key := mapped(target)) is not None:
                fmt = group.get("format") if rule.get("group_format", True) and group.get("format") \
                    else qconfig.get("format")
                read = rule.get("activation_formats")  # sglang: other formats' groups are weight-only
                if rule.get("int_weight_only_refused") and read is not None and fmt in read and \
                        not group.get("input_activations") and group["weights"].get("type", "int") == "int":
                    raise _Raises(f"config group {name!r}: integer weights without input_activations in format "
                                 f"{fmt!r}: the release asserts float weights there (AssertionError)",
                                 "int_weight_only_refused", "store integer weight-only groups pack-quantized")
                targets[key] = {"name": name, "weights": group["weights"], "format": fmt,
                                "stored_format": group.get("format") or qconfig.get("format"),
                                "top_format": qconfig.get("format"),
                                "input_activations": group.get("input_activations") if read is None or fmt in read
                                else None}
    ignore = [m for e in qconfig.get("ignore") or [] if (m := mapped(str(e))) is not None]
    return targets, ignore


def _scheme_dict(name: str, cls: str, targets: dict[str, dict], ignore: list[str], fused: dict, rule: dict) \
        -> tuple[dict | None, str]:
    """get_scheme_dict: the group the engine gives ``name`` (None: unquantized) and the mechanism."""
    skip, entry = ignored(name, ignore, fused, rule["ignore_match"])
    if skip:
        return None, f"{name} matches ignore entry {entry!r}" if entry else f"{name} is ignored"
    if not targets:  # no group quantizes weights (attention or sparsity only): nothing to match
        return None, "no config group quantizes weights"
    match = rule["target_match"]
    target, way = matched_target(name, cls, list(targets), fused, match["order"])
    if target is None:
        if match["unmatched"] == "raise":
            raise _Raises(match["unmatched_error"].format(module=name), "target_match",
                         f"list {name} in ignore or give it a config group target (releases that build an "
                         "unmatched module bf16 load it)")
        return None, f"no config group target matches {name} (nor its class {cls})"
    how = {"name": "name", "class": f"class {cls}", "fused": "its shards"}[way]
    return targets[target], f"{name} matches target {target!r} of config group {targets[target]['name']!r} by {how}"


def _no_scheme(kind: str, name: str | None) -> str:
    return (f"no {'FusedMoE' if kind == 'moe' else 'Linear'} scheme for {name} args: the cited function raises "
            "(NotImplementedError, ImportError, ValueError or RuntimeError by release)")


def _built(group: dict, kind: str, module: str, rule: dict, cite: str) -> Decision:
    """The scheme a release builds from ``group`` for a module of ``kind`` (linear | moe), or its error."""
    label = scheme_label(CT, {**group["weights"], "format": group.get("stored_format", group.get("format"))})
    name = preset(group["weights"], group.get("input_activations"))
    formats = rule.get(f"{kind}_formats") or {}
    formats = formats.get(name, formats.get("*"))
    if formats is not None and group.get("format") not in formats:
        return Decision(label, f"group {group['name']!r} (preset {name}) is read as format {group.get('format')!r}, "
                               f"which this release builds no {kind} module from ({cite})",
                        "serve with a release that reads the group's own format", raises=_no_scheme(kind, name))
    if name is None:
        return Decision(label, f"group {group['name']!r} is no compressed-tensors preset: the scheme it builds "
                               "was not read, taken as stored")
    if name not in rule[f"{kind}_schemes"]:
        return Decision(label, f"group {group['name']!r} is preset {name}, which this release builds no "
                               f"{'FusedMoE' if kind == 'moe' else 'Linear'} with ({cite})",
                        "serve with a release that builds it, or quantize with a preset it builds",
                        raises=_no_scheme(kind, name))
    wna16 = rule.get("wna16_moe") if kind == "moe" else None
    if wna16 and name in wna16["presets"] and group.get("top_format") not in wna16["formats"]:
        return Decision(label, f"group {group['name']!r} is preset {name}, whose CompressedTensorsWNA16MoE refuses "
                               f"the top-level format {group.get('top_format')!r} ({cite})",
                        "serve with a release that builds it, or store the experts pack-quantized",
                        raises="ValueError: For Fused MoE layers, only pack-quantized is supported")
    return Decision(label, f"preset {name}")


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           expert_leaves: tuple[str, str, str] = EXPERT_LEAVES) -> Decision:
    """The engine release's decision for engine module ``module`` (its name after the class's renames and
    fusion; a FusedMoE as ``...mlp.experts``) of a compressed-tensors checkpoint. ``draft``: a module of the
    MTP draft (decided the same way: the draft class takes the same quant config). ``expert_leaves``: the
    class's checkpoint names of an expert's gate, up and down projections (read where ``moe_match``'s
    ``expert_leaves`` is ``checkpoint``)."""
    rule, cites = rules.values[KEY], {k.split(".", 1)[1]: v.split(" (")[0] for k, v in rules.cites.items()
                                      if k.startswith(KEY + ".")}
    fused = rules.fused(CT) or {}
    try:
        targets, ignore = engine_config(qconfig, rules)
        if moe:
            return _decide_moe(module, targets, ignore, fused, rule, cites, expert_leaves, qconfig.get("format"))
        if module.rsplit(".", 1)[-1] == "lm_head":
            if rule["lm_head"] == "unquantized":
                return Decision(None, f"ParallelLMHead is built unquantized whatever the config says "
                                      f"({cites.get('lm_head', '')})", "keep lm_head bf16 (list it in ignore)")
            if rule["lm_head"] == "by_name":
                return _lm_head_by_name(module, targets, ignore, fused, rule, cites)
            try:
                group, why = _scheme_dict(module, "ParallelLMHead", targets, ignore, fused, rule)
            except ValueError as exc:  # get_quant_method: a ValueError while matching builds it unquantized
                return Decision(None, f"{exc} (caught: unquantized; {cites.get('lm_head', '')})")
        else:
            group, why = _scheme_dict(module, linear_class(module), targets, ignore, fused, rule)
    except _Raises as exc:  # a group without weights, a refused actorder, shards listed unevenly, no target
        return Decision(None, cites.get(exc.rule, ""), exc.fix, raises=str(exc))
    if group is None:
        return Decision(None, f"{why} ({cites.get('target_match', '')})")
    built = _built(group, "linear", module, rule, cites.get("linear_schemes", ""))
    return Decision(built.scheme, f"{why}: {built.why}", built.fix, built.raises)


def _lm_head_by_name(module: str, targets: dict, ignore: list[str], fused: dict, rule: dict, cites: dict) \
        -> Decision:
    """sglang get_lm_head_scheme: the head is quantized only where a target names it (exactly, ``re:`` or as
    ignore's plain entries match) and ignore does not; class targets such as ``Linear`` do not count."""
    skip, entry = ignored(module, ignore, fused, rule["ignore_match"])
    plain = rule["ignore_match"].get("plain", "exact")
    target = None if skip else next((t for t in targets if _hit(module, t, plain=plain)), None)
    if target is None:
        why = f"ignore entry {entry!r}" if skip else "no config group target names it"
        return Decision(None, f"ParallelLMHead unquantized: {why} ({cites.get('lm_head', '')})")
    group = targets[target]
    if (group["weights"] or {}).get("block_structure"):
        return Decision(None, f"target {target!r} names {module} with block-quantized weights "
                              f"({cites.get('lm_head', '')})", "quantize lm_head per channel or per tensor, or keep "
                              "it bf16", raises="Block-quantized lm_head is not supported; use channel or tensor "
                                                "weight scales for the head.")
    built = _built(group, "linear", module, rule, cites.get("linear_schemes", ""))
    return Decision(built.scheme, f"target {target!r} names {module}: {built.why}", built.fix, built.raises)


def _mxfp4_experts(targets: dict, top_format: str | None) -> bool:
    """sglang _is_mxfp4_moe: the top-level format names mxfp4, or the FusedMoE / Linear target's weights are
    symmetric float4 in groups of 32."""
    if "mxfp4" in (top_format or ""):
        return True
    return any(_args(targets[key]["weights"])[:4] == ("float", 4, "group", True) and
               targets[key]["weights"].get("group_size") == 32 for key in ("FusedMoE", "Linear") if key in targets)


def _decide_moe(module: str, targets: dict, ignore: list[str], fused: dict, rule: dict, cites: dict,
                expert_leaves: tuple[str, str, str], top_format: str | None = None) -> Decision:
    """CompressedTensorsMoEMethod.get_moe_method: expert 0's three projections asked one by one."""
    how = rule["moe_match"]
    cls = how["class_name"]
    if "Linear" in targets and cls not in targets:  # _add_fused_moe_to_target_scheme_map
        targets = {**targets, cls: targets["Linear"]}
    if rule.get("mxfp4_moe") == "before_ignore" and _mxfp4_experts(targets, top_format):
        return Decision("mxfp4", f"an MXFP4 config: every FusedMoE is built MXFP4 before ignore is asked "
                                 f"({cites.get('mxfp4_moe', '')})", "list no MXFP4 FusedMoE in ignore, or store "
                                 "it MXFP4")
    leaves = expert_leaves if how["expert_leaves"] == "checkpoint" else EXPERT_LEAVES
    asked = [_scheme_dict(f"{module}.0.{leaf}", cls, targets, ignore, fused, rule) for leaf in leaves]
    groups = [_group_args(g) for g, _ in asked]
    if any(g != groups[-1] for g in groups):
        return Decision(None, f"expert 0's projections resolve differently: {'; '.join(w for _, w in asked)} "
                              f"({cites.get('moe_match', '')})", "give every projection of the experts one scheme",
                        raises=how["mixed_error"])
    group, why = asked[-1]
    probe = f"the FusedMoE is asked as expert 0's projections {module}.0.{{{', '.join(leaves)}}} " \
            f"({cites.get('moe_match', '')})"
    wna16 = rule.get("wna16_moe")
    if group and wna16 and wna16["args"] == "linear_target" and "Linear" not in targets and \
            preset(group["weights"], group.get("input_activations")) in wna16["presets"]:
        return Decision(None, f"{why}: CompressedTensorsWNA16MoE reads the Linear target's args and the config has "
                              f"none ({cites.get('wna16_moe', '')})", "target the Linears with Linear",
                        raises="KeyError: 'Linear'")
    if group is None:
        return Decision(None, f"{probe}: {why}")
    built = _built(group, "moe", module, rule, cites.get("moe_schemes", ""))
    fix = built.fix
    if module in ignore:  # the entry a reader expects to keep the FusedMoE bf16
        why += f"; ignore entry {module!r} names the FusedMoE itself, which is never asked"
        fix = fix or f"list every expert's projections of {module} in ignore (or 're:{re.escape(module)}\\..*')"
    return Decision(built.scheme, f"{probe}, none ignored: {why}: {built.why}", fix, built.raises)


def _group_args(group: dict | None) -> tuple | None:
    """What get_moe_method compares of the three projections' scheme dicts (their args and format)."""
    if group is None:
        return None
    return _args(group["weights"]), _args(group.get("input_activations")), group.get("format")


__all__ = ["EXPERT_LEAVES", "KEY", "PRESETS", "RULES", "decide", "engine_config", "ignored", "matched_target",
           "preset"]
