"""How sglang builds a module of a Quark checkpoint with per-layer schemes (``quant.engines.quark_layers``):
``QuarkConfig`` in ``sglang/srt/layers/quantization/quark/quark.py``, the same for every model class.

For a module the exclude list leaves quantized, ``decide`` replays, with the rule values of
``manifests/engines/quark_layers.sglang.yaml`` (schema ``RULES``):

1. The config as the engine holds it: from 0.5.21 ``apply_weight_name_mapper`` renames the
   ``layer_quant_config`` keys with the class's weight-name mapper (``keys_mapped``: the mapper the exclude
   list goes through, ``exclude_mapper``). The MTP draft is another class (``draft_keys``, by the family's
   ``draft_exclude`` rule): its own mapper (DeepSeek-V3's renames model.layers.61 to model.decoder, which only
   a 61-layer model's keys name), or GLM's ``_resolve_nextn_quant_config``, which from 0.5.16 renames keys
   under model.layers.{num_hidden_layers} to the names its draft block asks (model.decoder.*) in every
   release; a key naming model.decoder.* (what quantgate's converter writes beside them) matches as written.
2. ``_find_matched_config``: a fused module (the class's packed_modules_mapping, ``quark_fused``) is asked
   through its shards, whose specs must be equal (else ValueError); else the first ``layer_quant_config``
   key matching the name by ``fnmatch``, then the module's class name in ``layer_type_quant_config``,
   then the global spec. A FusedMoE is asked by its own name (``...mlp.experts``): a key naming one expert
   matches nothing; from 0.5.21 (``expert_entries``) keys under ``<FusedMoE>.`` resolve it when no pattern
   does, and the release raises unless every expert from 0 up is named with the same projections and one
   spec.
3. The scheme the spec builds: the first of the release's ``linear_schemes`` / ``moe_schemes`` (in the
   order ``get_quant_method``, ``_get_scheme_from_config`` and ``get_moe_scheme`` try them) whose
   predicate (``SCHEMES``) the spec passes; a spec with quantized outputs or bias, or one no scheme
   takes, raises.

``shared_fusion_reason`` replays ``can_fuse_shared_expert``'s comparison of the routed and shared
experts' specs (the exclude entries' veto is ``quant.engines.fusion``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Literal

from quant.engines.format_rules import Decision
from quant.engines.rule_kinds import Rule
from quant.engines.rules import RuleSet
from quant.schema import Schema

KEY = "quark_layers"  # format_rules.key("quark-layers"): where a cut rule set keeps these rules

SchemeName = Literal["QuarkW4A4MXFP4", "QuarkW8A8Fp8", "QuarkW4A4MXFp4MoE", "QuarkW4A8MXFp4MoE",
                     "QuarkW8A8FP8MoE", "Fp8LinearMethod", "Fp8MoEMethod"]


class SharedFusion(Schema):
    """``QuarkConfig.can_fuse_shared_expert`` with a non-empty ``layer_quant_config``: whether it compares
    specs at all (``compares``), the decoder layers whose routed FusedMoE (``<base>.mlp.experts``) and shared
    expert body (``<base>.mlp.<shared>.<leaf>`` for each of ``leaves``) must have equal specs (``bases``), and
    the shared module's name: ``shared_expert``, or ``by_config`` (``shared_experts`` where a key names
    ``.shared_experts.``, else ``shared_expert``)."""
    compares: bool
    bases: list[str]
    leaves: list[str]
    shared: Literal["shared_expert", "by_config"]


class QuarkLayersRules(Schema):
    """A per-layer Quark rule set: each rule ``{value, cite}`` (``rule_kinds.Rule``), stating only what
    changed since the previous set."""
    keys_mapped: Rule[bool] | None = None  # the layer_quant_config keys renamed by the class's weight-name mapper
    expert_entries: Rule[bool] | None = None  # per-expert keys resolve a FusedMoE no pattern matches
    linear_schemes: Rule[list[SchemeName]] | None = None  # tried in this order for a LinearBase
    moe_schemes: Rule[list[SchemeName]] | None = None  # tried in this order for a FusedMoE
    shared_fusion: Rule[SharedFusion] | None = None


RULES = QuarkLayersRules


class _Raises(ValueError):  # control flow inside decide: always caught there, never a user error
    """The release raises building the module: its message, the rule that says so and what to do."""

    def __init__(self, message: str, rule: str, fix: str):
        super().__init__(message)
        self.rule, self.fix = rule, fix


def _is_mx_fp4(weight, inputs) -> bool:
    """quark.py QuarkConfig._is_mx_fp4: fp4 per_group 32 e8m0 weights (static) and activations (dynamic)."""
    if not isinstance(weight, dict) or not isinstance(inputs, dict):
        return False
    return all(spec.get("dtype") == "fp4" and spec.get("qscheme") == "per_group" and spec.get("group_size") == 32
               and spec.get("scale_format") == "e8m0" for spec in (weight, inputs)) and \
        weight.get("is_dynamic") is not True and inputs.get("is_dynamic") is not False


def _is_mx_w4a8(weight, inputs) -> bool:
    """quark.py QuarkConfig._is_mx_w4a8: MXFP4 static weights, static per-tensor FP8 activations."""
    if not isinstance(weight, dict) or not isinstance(inputs, dict):
        return False
    return weight.get("dtype") == "fp4" and weight.get("qscheme") == "per_group" and \
        weight.get("group_size") == 32 and not weight.get("is_dynamic") and weight.get("scale_format") == "e8m0" \
        and inputs.get("dtype") in ("fp8_e4m3", "fp8_e4m3fn") and inputs.get("qscheme") == "per_tensor" and \
        not inputs.get("is_dynamic")


def _is_fp8_w8a8(weight, inputs) -> bool:
    """quark.py QuarkConfig._is_fp8_w8a8: static FP8 e4m3 per-tensor or per-channel weights, FP8 activations
    dynamic or per-tensor."""
    if not isinstance(weight, dict) or not isinstance(inputs, dict):
        return False
    if not (weight.get("dtype") == "fp8_e4m3" and inputs.get("dtype") == "fp8_e4m3" and
            not weight.get("is_dynamic") and weight.get("qscheme") in ("per_tensor", "per_channel")):
        return False
    return bool(inputs.get("is_dynamic")) or inputs.get("qscheme") == "per_tensor"


def _is_block_fp8(spec: dict) -> bool:
    """quark.py QuarkConfig._get_block_fp8_config: static FP8 [n, k] block weights, dynamic FP8 activations,
    nothing else quantized."""
    weight, inputs = spec.get("weight") or {}, spec.get("input_tensors") or {}
    block = weight.get("block_size")
    return not spec.get("output_tensors") and not spec.get("bias") and \
        weight.get("dtype") in ("fp8_e4m3", "fp8_e4m3fn") and weight.get("qscheme") == "per_block" and \
        weight.get("is_dynamic") is False and isinstance(block, list) and len(block) == 2 and \
        inputs.get("dtype") in ("fp8_e4m3", "fp8_e4m3fn") and inputs.get("is_dynamic") is True


@dataclass(frozen=True)
class Scheme:
    takes: Callable[[dict], bool]  # the predicate on the matched spec
    label: str  # the rung (quant.rungs) it builds; fp8_block is no rung (block FP8 is its own format)


def _parts(test):
    return lambda spec: test(spec.get("weight"), spec.get("input_tensors"))


SCHEMES = {
    "QuarkW4A4MXFP4": Scheme(_parts(_is_mx_fp4), "mxfp4"),
    "QuarkW8A8Fp8": Scheme(_parts(_is_fp8_w8a8), "fp8"),  # capability >= 89: every GPU the replay judges
    "QuarkW4A4MXFp4MoE": Scheme(_parts(_is_mx_fp4), "mxfp4"),
    "QuarkW4A8MXFp4MoE": Scheme(_parts(_is_mx_w4a8), "mxfp4_fp8"),
    "QuarkW8A8FP8MoE": Scheme(_parts(_is_fp8_w8a8), "fp8"),
    "Fp8LinearMethod": Scheme(_is_block_fp8, "fp8_block"),
    "Fp8MoEMethod": Scheme(_is_block_fp8, "fp8_block"),
}


def linear_class(module: str) -> str:
    """The sglang Linear class a leaf is built as (layers/linear.py), what ``layer_type_quant_config`` is
    asked with."""
    leaf = module.rsplit(".", 1)[-1]
    return {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
            "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear",
            "gate": "ReplicatedLinear"}.get(leaf, "ColumnParallelLinear")


@dataclass(frozen=True)
class DraftKeys:
    """How the MTP draft's class renames the config's keys: ``mapper`` (its weight-name mapper, applied where
    the release maps keys: ``keys_mapped``) and ``remap`` (GLM's model.layers.{N} prefix, renamed always)."""
    mapper: dict | None = None
    remap: str | None = None


# GlmMoeDsaForCausalLMNextN._NEXTN_SPEC_WEIGHT_NAMES: the draft's own modules, named model.<x> (the block's are
# model.decoder.<x>)
_NEXTN_SPEC = ("shared_head.norm", "eh_proj", "enorm", "hnorm")


def draft_keys(rules: RuleSet, family: str, num_hidden_layers: int) -> DraftKeys:
    """The draft class's renaming of the config's keys in release ``rules``, by the family's ``draft_exclude``
    (quant.engines.replay.draft_exclude reads the same rule for the exclude list)."""
    from quant.engines.replay import nextn_mapper

    how = rules["draft_exclude"].get(family, "none")
    if how in ("nextn_mapper", "nextn_mapper_target"):
        return DraftKeys(nextn_mapper(how, num_hidden_layers, rules.values.get("exclude_mapper")))
    if how.startswith("mapper_61"):  # DeepseekV3ForCausalLMNextN.hf_to_sglang_mapper
        return DraftKeys({"style": "sglang", "substr": {"model.layers.61": "model.decoder"}})
    if how == "glm_remap":  # an empty WeightsMapper; _resolve_nextn_quant_config renames the keys itself
        return DraftKeys(remap=f"model.layers.{num_hidden_layers}")
    return DraftKeys()


def _glm_remapped(key: str, prefix: str) -> str:
    """glm4_moe.py GlmMoeDsaForCausalLMNextN._resolve_nextn_quant_config, _map_mtp_ckpt_name."""
    if not key.startswith(prefix + "."):
        return key
    return key.replace(prefix, "model" if any(part in key for part in _NEXTN_SPEC) else "model.decoder", 1)


def held_config(qconfig: dict, rule: dict, mapper: dict | None, remap: str | None = None) -> dict:
    """``layer_quant_config`` as the release holds it: from 0.5.21 its keys renamed by the class's weight-name
    mapper (QuarkConfig.apply_weight_name_mapper: WeightsMapper.apply_dict drops a key mapped to None), then
    by the GLM draft's own renaming (``remap``: the draft layer's prefix; a later key wins a name)."""
    from quant.engines.replay import mapped_entry

    keys = dict(qconfig.get("layer_quant_config") or {})
    if rule.get("keys_mapped") and mapper:
        keys = {m: spec for k, spec in keys.items() if (m := mapped_entry(k, mapper)) is not None}
    if remap:
        keys = {_glm_remapped(k, remap): spec for k, spec in keys.items()}
    return keys


def _same(a, b) -> bool:
    """utils.py deep_compare: equal dicts key by key, lists as sets."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return set(map(repr, a)) == set(map(repr, b))
    return a == b


def matched(name: str, cls: str, qconfig: dict, keys: dict, fused: dict, rule: dict) -> tuple[dict, str]:
    """quark.py QuarkConfig._find_matched_config: the spec the release gives ``name`` and which entry."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in fused:
        shards = [name.replace(leaf, shard) for shard in fused[leaf]]
        found = [matched(shard, cls, qconfig, keys, fused, rule) for shard in shards]
        if not all(_same(spec, found[0][0]) for spec, _ in found):
            raise _Raises(f"Found a different quantization configuration for {fused[leaf]} in {name}. SGLang requires "
                          "all to use the same scheme.", "linear_schemes",
                          f"give every shard of {name} ({', '.join(fused[leaf])}) one spec")
        return found[0][0], f"its shards {', '.join(fused[leaf])}: {found[0][1]}"
    for pattern, spec in keys.items():
        if fnmatchcase(name, pattern):
            return spec, f"layer_quant_config key {pattern!r}"
    if rule.get("expert_entries") and name.endswith(".experts"):
        prefix = name + "."
        entries = {k[len(prefix):]: spec for k, spec in keys.items() if k.startswith(prefix)}
        if entries:
            return _expert_entries(name, entries), f"its experts' layer_quant_config keys ({len(entries)})"
    types = qconfig.get("layer_type_quant_config") or {}
    if cls in types:
        return types[cls], f"layer_type_quant_config {cls!r}"
    return qconfig.get("global_quant_config") or {}, "global_quant_config (no key matches it)"


def _expert_entries(name: str, entries: dict[str, dict]) -> dict:
    """quark.py QuarkConfig._fused_expert_config: one FusedMoE spans every expert, so the keys naming them
    must pin experts 0..max with the same projections and one spec."""
    fix = f"give every expert of {name} one spec (one key {name + '*'!r})"
    by_expert: dict[int, set[str]] = {}
    for suffix in entries:
        index, _, projection = suffix.partition(".")
        if not index.isdigit() or not projection:
            raise _Raises(f"Found a per-expert entry {suffix!r} in {name} that is not <expert index>.<projection>.",
                          "expert_entries", fix)
        by_expert.setdefault(int(index), set()).add(projection)
    missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
    if missing:
        raise _Raises(f"Found per-expert entries in {name} that skip experts {missing[:4]}. SGLang requires all to "
                      "use the same scheme.", "expert_entries", fix)
    first = next(iter(by_expert.values()))
    if any(p != first for p in by_expert.values()):
        raise _Raises(f"Found different projections pinned per expert in {name}. SGLang requires all to use the "
                      "same scheme.", "expert_entries", fix)
    specs = list(entries.values())
    if not all(_same(spec, specs[0]) for spec in specs):
        raise _Raises(f"Found different quantization configurations among the experts of {name}. SGLang requires "
                      "all to use the same scheme.", "expert_entries", fix)
    return specs[0]


def _built(spec: dict, kind: str, rule: dict) -> str:
    """The first scheme of the release's list for ``kind`` (linear | moe) the spec passes, or _Raises."""
    schemes = rule[f"{kind}_schemes"]
    for name in schemes:  # block FP8 is asked before the output / bias check, which it checks itself
        if SCHEMES[name].takes(spec) and name.startswith("Fp8"):
            return name
    if spec.get("output_tensors") or spec.get("bias"):
        raise _Raises("Currently, Quark models with output_tensors and bias quantized are not supported",
                      f"{kind}_schemes", "quantize no output_tensors or bias")
    name = next((n for n in schemes if not n.startswith("Fp8") and SCHEMES[n].takes(spec)), None)
    if name is None:
        message = "No quark compatible scheme was found." if kind == "linear" else "Unsupported FusedMoe scheme"
        what = "Linear" if kind == "linear" else "FusedMoE"
        raise _Raises(message, f"{kind}_schemes", f"give it a spec this release builds a {what} with "
                      f"({', '.join(sorted({SCHEMES[n].label for n in schemes}))})")
    return name


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           members: tuple[str, ...] = (), draft_keys: DraftKeys | None = None) -> Decision:
    """The rung sglang release ``rules`` builds engine module ``module`` with (a FusedMoE as
    ``...mlp.experts``). ``draft``: a module of the MTP draft, whose class renames the keys its own way
    (``draft_keys``; None: not at all); ``members``: unused by sglang (a FusedMoE is asked by its own name)."""
    rule = rules.values[KEY]
    cites = {k.split(".", 1)[1]: v.split(" (")[0] for k, v in rules.cites.items() if k.startswith(KEY + ".")}
    renamed = (draft_keys or DraftKeys()) if draft else DraftKeys(rules.values.get("exclude_mapper"))
    mapper = renamed.mapper if renamed.mapper and renamed.mapper.get("style") == "sglang" else None
    kind = "moe" if moe else "linear"
    try:
        keys = held_config(qconfig, rule, mapper, renamed.remap)
        spec, why = matched(module, "FusedMoE" if moe else linear_class(module), qconfig, keys,
                            rules.fused("quark") or {}, rule)
        scheme = _built(spec, kind, rule)
    except _Raises as exc:
        return Decision(None, cites.get(exc.rule, ""), exc.fix, raises=str(exc))
    label = SCHEMES[scheme].label
    return Decision(label, f"{module} takes {why}, built as {scheme} ({label}; {cites.get(f'{kind}_schemes', '')})")


def shared_fusion_reason(qconfig: dict, rules: RuleSet) -> str | None:
    """Why quark.py QuarkConfig.can_fuse_shared_expert refuses fusion by the specs (None: they do not veto):
    a per-layer config whose routed FusedMoE and shared expert body get different specs at the layers it
    probes, or a probe the release raises on."""
    rule = rules.values[KEY]
    how = rule["shared_fusion"]
    keys = qconfig.get("layer_quant_config") or {}
    if not how["compares"] or not keys:
        return None
    shared = "shared_experts" if how["shared"] == "by_config" and any(".shared_experts." in k for k in keys) \
        else "shared_expert"
    fused = rules.fused("quark") or {}
    try:
        for base in how["bases"]:
            routed, _ = matched(f"{base}.mlp.experts", "Module", qconfig, keys, fused, rule)
            for leaf in how["leaves"]:
                name = f"{base}.mlp.{shared}.{leaf}"
                spec, why = matched(name, "Module", qconfig, keys, fused, rule)
                if not _same(routed, spec):
                    return f"{base}.mlp.experts and {name} ({why}) have different specs"
    except _Raises as exc:
        return f"the probe raises: {exc}"
    return None


__all__ = ["KEY", "RULES", "SCHEMES", "DraftKeys", "decide", "draft_keys", "held_config", "linear_class", "matched",
           "shared_fusion_reason"]
