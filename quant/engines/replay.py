"""Replay of one engine release's loading on a checkpoint's headers: which modules it builds, under
which names, quantized or not, and whether the tensors on disk fit.

The rules are a ``RuleSet`` (data, with citations); the decisions go through ``quant.engines.match``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from quant.engines import format_rules, quark_layers
from quant.engines.fusion import cite as fusion_cite
from quant.engines.fusion import loader_mapped, map_61, no_fusion_reason
from quant.engines.match import (
    Exclude,
    MixedShards,
    fp8_fused_first,
    fp8_ignored_layers,
    fp8_skipped,
    quark_excluded,
)
from quant.engines.rules import RuleSet, rule_sets
from quant.engines.serving import DEFAULT, Serving, loads_under_archs
from quant.quark_config import THIRD_PARTY

# a decoder layer: model.layers.N, or model.language_model.layers.N where a vision-language release stores
# its text layers (GLM-5.3-Flash's draft layer N is such a layer; both engines' loaders drop language_model.)
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")
_GLM_DRAFT_EXPERTS = "model.decoder.mlp.experts"  # added by GlmMoeDsaForCausalLMNextN._resolve_nextn_quant_config


@dataclass(frozen=True)
class Module:
    """A checkpoint Linear: quantized on disk or not, its logical [out, in], its family role."""
    quantized: bool
    shape: tuple[int, int]
    role: str
    scheme: str = ""  # a third-party checkpoint's scheme label on disk (quant.third_party.scheme_label); "": bf16


@dataclass(frozen=True)
class Finding:
    check: str  # layout | config | engine | fusion | values (gate checkpoint --deep: decoded data)
    engine: str | None  # a rule set id ("sglang 0.5.21..0.5.23"), None for every engine
    module: str
    why: str
    fix: str


@dataclass(frozen=True)
class ReplayContext:
    """One engine release loading one checkpoint: what every replay function reads."""
    rules: RuleSet
    modules: dict[str, Module]  # the checkpoint's Linear modules
    qconfig: dict  # its quantization_config
    family: str
    num_hidden_layers: int
    # the quantization_config's kind: quark | fp8 | mxfp4 (quant.quark_config.config_kind) or a third-party
    # format, compressed-tensors | modelopt (format_kind), whose rules ``rules`` holds (format_rules.cut)
    kind: str
    fmt_name: str = ""  # the format as findings name it (MXFP4, FP8)
    config: dict = field(default_factory=dict)  # config.json's text model: architecture, expert counts, indexer rope
    serving: Serving = DEFAULT


@dataclass
class EngineModule:
    name: str  # the engine's module name
    members: list[str] = field(default_factory=list)  # checkpoint modules loaded into it
    build: str = "governed"  # governed (exclude decides) | bf16 (always unquantized) | quantized (always quantized)
    draft: bool = False
    moe: bool = False
    role: str = ""


def renamed(module: str, renames: dict[str, str]) -> str:
    """``module`` under a rename rule (``module_names``, ``mtp_naming.renames``): applied in order,
    each once where it applies; a key starting with ``^`` renames that prefix, any other key the
    first occurrence of that text."""
    for old, new in renames.items():
        if old.startswith("^") and module.startswith(old[1:]):
            module = new + module[len(old) - 1:]
        elif not old.startswith("^") and old in module:
            module = module.replace(old, new, 1)
    return module


def class_name(module: str, rules: RuleSet) -> str:
    """A checkpoint module under the prefix the model class builds it with (rule ``module_names``)."""
    return renamed(module, rules.values.get("module_names") or {})


def draft_layer(module: str, rules: RuleSet, num_hidden_layers: int) -> int | None:
    """Where a checkpoint module sits in the MTP draft: the index of its draft layer (0 for the first),
    -1 for a draft module outside the draft's layers (Qwen3-Next's mtp.fc), None when it is not the
    draft's. The draft is under its own prefix where the class reads one (``mtp_naming.prefix``,
    Qwen3-Next's mtp.*), else the decoder layers at or after num_hidden_layers."""
    prefix = rules["mtp_naming"].get("prefix")
    if prefix:
        if not module.startswith(prefix):
            return None
        index = module[len(prefix + "layers."):].partition(".")[0] if module.startswith(prefix + "layers.") else ""
        return int(index) if index.isdigit() else -1
    match = _LAYER.match(module)
    return int(match.group(1)) - num_hidden_layers if match and int(match.group(1)) >= num_hidden_layers else None


def is_draft(module: str, rules: RuleSet, num_hidden_layers: int) -> bool:
    """Whether a checkpoint module belongs to the MTP draft (see ``draft_layer``)."""
    return draft_layer(module, rules, num_hidden_layers) is not None


def draft_name(module: str, rules: RuleSet, num_hidden_layers: int) -> str | None:
    """The engine's name for a checkpoint module (None: the engine does not load it)."""
    naming = rules["mtp_naming"]
    draft = is_draft(module, rules, num_hidden_layers)
    if naming["style"] == "renames":  # the draft under its own prefix, renamed by the class's loader
        if not draft:
            return class_name(module, rules)
        index = max(draft_layer(module, rules, num_hidden_layers), 0)  # a module beside the layers: the first's
        layer = str(num_hidden_layers * naming.get("layer_times", 1) + index)
        return renamed(module, {old: new.replace("{layer}", layer) for old, new in naming["renames"].items()})
    if draft and naming["style"] == "dropped":
        return None  # the class skips the MTP layers' weights and builds no draft from them
    if naming.get("dropped_prefix") and module.startswith(naming["dropped_prefix"]):
        return None  # MTP modules stored outside the decoder stack, skipped the same way (MiniMax-M3)
    if not draft or naming["style"] != "decoder":
        return class_name(module, rules)
    if any(part in module for part in naming["skipped"]):
        return None
    rest = _LAYER.match(module).group(2)
    top_level = any(part in module for part in naming["top_level"])
    return (naming.get("top_level_as", "model.") if top_level else naming.get("decoder_as", "model.decoder.")) + rest


def draft_module_name(module: str, rules: RuleSet, num_hidden_layers: int) -> str | None:
    """The name a separately built draft class asks its quant config for a checkpoint module under the
    draft's prefix (rule ``draft_module_names``: DeepSeek-V4's MTP module, built as main layer
    ``as_layer`` under the draft's own layer prefix), or None. The replay builds no such draft; the
    converter writes these names in the exclude list beside the checkpoint's."""
    rule = rules.values.get("draft_module_names")
    if not rule or not module.startswith(rule["prefix"]):
        return None
    rest = module[len(rule["prefix"]):]
    if rest in rule["top_level"]:
        return rule["top_level"][rest].format(num_hidden_layers=num_hidden_layers)
    layer = f"model.layers.{rule['as_layer']}."
    main = class_name(f"layers.{rule['as_layer']}.{rest}", rules)
    if not main.startswith(layer):
        return None
    return rule["layer_as"].format(num_hidden_layers=num_hidden_layers) + main[len(layer):]


def nextn_mapper(how: str, num_hidden_layers: int, target: dict | None) -> dict:
    """The draft class's own weight-name mapper (GLM-5.3-Flash's Glm5NextForConditionalGenerationNextN.
    get_hf_to_sglang_mapper): ``nextn_mapper`` renames model.layers.{n} to model.decoder only;
    ``nextn_mapper_target`` joins the target class's mapper (``target``: its ``exclude_mapper``) with the draft
    layer's rules in both its stored and its normalized form, eh_proj / enorm / hnorm to model.*."""
    n = num_hidden_layers
    if how == "nextn_mapper":
        return {"style": "sglang", "substr": {f"model.layers.{n}": "model.decoder"}}
    draft = {}
    for layer in (f"model.language_model.layers.{n}", f"model.layers.{n}"):
        draft.update({f"{layer}.{leaf}": f"model.{leaf}" for leaf in ("eh_proj", "enorm", "hnorm")})
        draft[layer] = "model.decoder"
    target = target or {}
    return {**target, "style": "sglang", "substr": {**(target.get("substr") or {}), **draft}}


def draft_exclude(entries: list[str], rules: RuleSet, family: str, num_hidden_layers: int, kind: str,
                  raw: list[str] | None = None) -> tuple[list[str], bool]:
    """The exclude list the draft (MTP) model is built with, and whether the whole draft is bf16 (``raw``: the
    entries as the checkpoint writes them, before the main class's mapper; default ``entries``)."""
    how = rules["draft_exclude"].get(family, "none")
    if how in ("nextn_mapper", "nextn_mapper_target"):
        # the draft's mapper replaces the main class's (loader.py asks the draft class for it), on the entries as
        # written; the whole draft is bf16 when its mapped layer is excluded (DeepseekV3ForCausalLMNextN.
        # _resolve_nextn_quant_config, Quark only)
        mapper = nextn_mapper(how, num_hidden_layers, rules.values.get("exclude_mapper"))
        entries = [m for e in (entries if raw is None else raw) if (m := mapped_entry(e, mapper)) is not None]
        layer = mapped_entry(f"model.layers.{num_hidden_layers}", mapper)
        return entries, kind == "quark" and Exclude(entries).matches(layer)
    if how in ("mapper_61", "mapper_61_draft_bf16"):
        entries = [map_61(e) for e in entries]
        whole = how == "mapper_61_draft_bf16" and kind == "quark" and Exclude(entries).matches(
            map_61(f"model.layers.{num_hidden_layers}"))
        return entries, whole
    if how in ("mtp_any_draft_bf16", "mtp_experts_draft_bf16") and kind == "quark":
        # a draft shipped bf16 is detected from its mtp.* entries; the draft then takes no quant config at all
        mtp = [e for e in entries if e.startswith("mtp.")]
        return entries, bool(mtp) and (how == "mtp_any_draft_bf16" or any("mlp.experts" in e for e in mtp))
    if how == "mtp_layers_unshifted_quark" and kind == "quark":
        # the draft's layer i is built as mtp.layers.{num_hidden_layers + i}, which the unshifted entries never name
        return [e for e in entries if not e.startswith("mtp.layers.")], False
    if how == "glm_remap" and kind == "quark":
        prefix = f"model.layers.{num_hidden_layers}."
        mtp = [e for e in entries if e.startswith(prefix)]
        names = set(entries) | {draft_name(e, rules, num_hidden_layers) or e for e in mtp}
        if any(".mlp.experts." in e for e in mtp):
            names.add(_GLM_DRAFT_EXPERTS)
        return sorted(names), False
    return entries, False


def shard_parent(module: str, shard: str) -> str | None:
    """The module ``module`` is ``shard`` of (``<parent>.<shard>`` -> parent), else None; a shard may be
    dotted, named with its parent (DeepSeek-V4's compressor.wkv, fused with compressor.wgate)."""
    return module[:-len(shard) - 1] if module.endswith("." + shard) else None


def shards_of(fused: dict[str, list[str]]) -> dict[str, str]:
    """A fused-module rule (fused module -> its shards: ``built_fused``, ``quark_fused``,
    ``fp8_skip.fused``) as shard -> fused module, dotted shards first: DeepSeek-V4's compressor.wkv is
    fused with compressor.wgate, its attention's wkv with wq_a."""
    of = {shard: name for name, shards in fused.items() for shard in shards}
    return dict(sorted(of.items(), key=lambda item: -item[0].count(".")))


def fused_into(module: str, of: dict[str, str], dotted_only: bool = False) -> str | None:
    """The fused module a checkpoint module is loaded into (``of`` from ``shards_of``), else None."""
    for shard, fused in of.items():
        if dotted_only and "." not in shard:
            break
        if (parent := shard_parent(module, shard)) is not None:
            return f"{parent}.{fused}"
    return None


def stored_fused(module: str, built_fused: dict[str, list[str]], stored) -> str | None | bool:
    """Which fused module a layer whose kinds differ builds from a stored shard, by the shards the layer
    stores beside it: Kimi-K3's g_proj is a KDA layer's fused_qkvg_proj shard but its own module (or
    fused_qkv_a_g_proj's shard) in an MLA layer. The fused leaf with the most stored sibling shards; None when
    no fused module has one (the shard is built on its own); False where the leaf is no shard, is a shard of one
    fused module only, or the candidates tie (``fused_into`` decides)."""
    if any("." in shard and module.endswith("." + shard) for shards in built_fused.values() for shard in shards):
        return False  # a dotted shard (DeepSeek-V4's compressor.wkv) names its fused module itself
    counts = {}
    for fused, shards in built_fused.items():
        for shard in shards:
            if "." not in shard and (parent := shard_parent(module, shard)) is not None:
                counts[fused] = sum(f"{parent}.{s}" in stored for s in shards if s != shard)
    if not counts:
        return False
    best = max(counts, key=lambda fused: counts[fused])
    if not counts[best]:
        return None
    return False if len(counts) == 1 or list(counts.values()).count(counts[best]) > 1 else best


def _rename_leaf(name: str, leaf: str) -> str:
    return f"{name.rpartition('.')[0]}.{leaf}"


_MEMO: dict[tuple, tuple] = {}  # (what a result depends on) -> (the objects keyed by id, kept alive; the result)


def _memo(key: tuple, pinned: tuple, compute):
    """One verify run replays many releases and serving setups over one checkpoint's modules; the
    parts that depend only on the modules and a rule set's values are computed once per pair (the
    objects in ``key`` by id are pinned in the entry, so an id cannot be reused while it is cached)."""
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) > 256:
            _MEMO.clear()
        hit = _MEMO[key] = (pinned, compute())
    return hit[1]


def engine_modules(ctx: ReplayContext, whole_draft_bf16: bool = False) -> dict[str, EngineModule]:
    """The modules the engine builds from the checkpoint's Linear modules (``whole_draft_bf16``: the
    draft is built without quant config, from ``draft_exclude``). The result is shared: do not change it."""
    indexer_bf16 = indexer_bf16_leaves(ctx.rules, ctx.serving, ctx.config)
    quantized = quantized_leaves(ctx.rules, ctx.kind, ctx.qconfig)
    key = ("engine_modules", id(ctx.modules), id(ctx.rules.values), ctx.num_hidden_layers, ctx.kind,
           whole_draft_bf16, indexer_bf16, quantized)
    return _memo(key, (ctx.modules, ctx.rules.values),
                 lambda: _engine_modules(ctx, whole_draft_bf16, indexer_bf16, quantized))


def _engine_modules(ctx: ReplayContext, whole_draft_bf16: bool, indexer_bf16: frozenset[str],
                    quantized: frozenset[tuple[str, str]]) -> dict[str, EngineModule]:
    rules, num_hidden_layers, kind = ctx.rules, ctx.num_hidden_layers, ctx.kind
    built: dict[str, EngineModule] = {}
    experts: dict[str, EngineModule] = {}  # checkpoint "<layer>.mlp.experts" -> its FusedMoE (the common case, fast)
    fused_of = shards_of(rules["built_fused"])
    max_draft = rules["mtp_naming"]["max_layers"]
    for module, info in ctx.modules.items():
        moe = info.role == "routed_expert"
        # a stacked expert tensor (Step-3.7's moe.gate_proj.weight) has no ".experts." until the class names it
        if moe and ".experts." in module:
            group = experts.get(module[:module.rindex(".experts.") + len(".experts")])
            if group is not None:
                group.members.append(module)
                continue
        index = draft_layer(module, rules, num_hidden_layers)
        draft = index is not None
        if draft and max_draft is not None and index >= max_draft:
            continue  # not loaded (the config check reports the count)
        name = draft_name(module, rules, num_hidden_layers)
        if name is None:
            continue
        leaf = name.rpartition(".")[2]
        if moe:
            name = name[:name.rindex(".experts.") + len(".experts")]
        else:
            # an indexer module joins a dotted shard's fused module only, never an attention's by its leaf
            indexer = info.role == "indexer"
            fused = False if indexer else stored_fused(module, rules["built_fused"], ctx.modules)
            if fused is False:  # the layer's stored shards do not decide: the fused names do
                name = fused_into(name, fused_of, dotted_only=indexer) or name
            elif fused:  # the fused module whose other shards the layer stores
                name = _rename_leaf(name, fused)
        entry = built.get(name)
        if entry is None:
            entry = built[name] = EngineModule(name, draft=draft, moe=moe, role=info.role,
                                               build=_build(info.role, leaf, rules, kind, draft and whole_draft_bf16,
                                                            indexer_bf16, quantized))
            if moe and ".experts." in module:
                experts[module[:module.rindex(".experts.") + len(".experts")]] = entry
        entry.members.append(module)
    return built


def indexer_bf16_leaves(rules: RuleSet, serving: Serving, config: dict) -> frozenset[str]:
    """The DSA indexer's Linear leaves built bf16 (no quant config) on this platform: sglang >= 0.5.15
    on CUDA fuses wk into a bf16 wk_weights_proj when the indexer's rope is interleaved
    (``use_dsa_indexer_fusion = CUDA and not is_neox_style``)."""
    indexer = rules["indexer"]
    if indexer is None:  # a model class without a DSA indexer
        return frozenset()
    leaves = {leaf for leaf in ("wq_b", "wk", "weights_proj") if indexer[leaf] == "bf16"}
    interleaved = indexer.get("interleaved_always") or config.get("indexer_rope_interleave", False)
    if indexer["wk_fused_bf16_on_cuda"] and serving.platform == "cuda" and interleaved:
        leaves.add("wk")
    return frozenset(leaves)


def quantized_leaves(rules: RuleSet, kind: str, qconfig: dict) -> frozenset[tuple[str, str]]:
    """The (role, leaf) pairs this class builds with the quant config whatever the exclude list says
    (rule ``built_quantized``, per kind, for the configs it names: sglang's DeepSeek-V4 builds wo_a
    for its FP8 GEMM under block FP8 128x128)."""
    rule = (rules.values.get("built_quantized") or {}).get(kind)
    if not rule:
        return frozenset()
    if "weight_block_size" in rule and list(qconfig.get("weight_block_size") or []) != rule["weight_block_size"]:
        return frozenset()
    return frozenset((role, leaf) for role, leaves in rule["leaves"].items() for leaf in leaves)


def _build(role: str, leaf: str, rules: RuleSet, kind: str, draft_bf16: bool, indexer_bf16: frozenset[str],
           quantized: frozenset[tuple[str, str]] = frozenset()) -> str:
    # lm_head is in unquantized_roles because Quark's and block FP8's get_quant_method build no method for a
    # ParallelLMHead; the third-party formats' may (their decide says, per release)
    if draft_bf16 or (role in rules["unquantized_roles"] and not (role == "lm_head" and kind in THIRD_PARTY)):
        return "bf16"
    if (role, leaf) in quantized:
        return "quantized"
    if leaf in (rules.values.get("unquantized_leaves") or {}).get(role, ()):
        return "bf16"
    if role == "mtp_proj":  # quant_config: built with a Quark config only; any_quant_config: with any
        governed = rules["eh_proj"] == "any_quant_config" or (rules["eh_proj"] == "quant_config" and kind == "quark")
        return "governed" if governed else "bf16"
    if role == "indexer":
        return "bf16" if leaf in indexer_bf16 else "governed"
    return "governed"


def for_platform(value, serving: Serving):
    """A rule value as the class built on ``serving``'s platform has it: the keys under
    ``platforms: {<platform>: ...}`` replace the rest (vLLM 0.33.0 imports some model classes from a
    per-platform file: models/minimax_m3/__init__.py, nvidia/model.py on CUDA, amd/model.py on ROCm)."""
    if not isinstance(value, dict) or "platforms" not in value:
        return value
    return {**{k: v for k, v in value.items() if k != "platforms"}, **value["platforms"].get(serving.platform, {})}


def exclude_entries(qconfig: dict, rules: RuleSet, kind: str, serving: Serving = DEFAULT, mapped: bool = True) \
        -> list[str]:
    """The exclude list as the main class matches it (``mapped`` False: as the checkpoint writes it)."""
    if kind == "mxfp4":  # a release's native MXFP4 config: the engines read no exclude list (mxfp4_native)
        return []
    if kind == "fp8":
        skip = rules["fp8_skip"]
        entries = fp8_ignored_layers(qconfig, skip["keys"], skip["keys_mode"], skip["model_prefix_variants"])
    else:
        entries = qconfig.get("exclude")
        entries = [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else []
    # the class's weight-name mapper, for the kinds it is applied to
    mapper = for_platform(rules.values.get("exclude_mapper"), serving)
    if not mapped or not mapper or kind not in mapper["kinds"]:
        return entries
    return [m for e in entries if (m := mapped_entry(e, mapper)) is not None]


def mapped_entry(entry: str, mapper: dict) -> str | None:
    """An exclude entry as the model class's weight-name mapper renames it before matching
    (``exclude_mapper``, substrings, then prefixes, then suffixes; None drops the entry). ``style``
    sglang: models/utils.py WeightsMapper._map_name (QuarkConfig.apply_weight_name_mapper), the
    longest match of each kind only; vllm: WeightsMapper._map_name_with_shard (QuarkConfig.apply_vllm_mapper),
    every match in order."""
    longest = mapper["style"] == "sglang"
    for kind in ("substr", "prefix", "suffix"):
        items = list((mapper.get(kind) or {}).items())
        for old, new in sorted(items, key=lambda item: len(item[0]), reverse=True) if longest else items:
            hit = old in entry if kind == "substr" else entry.startswith(old) if kind == "prefix" else entry.endswith(old)
            if hit:
                if new is None:
                    return None
                entry = new.join(entry.rsplit(old, 1)) if kind == "suffix" else entry.replace(old, new, 1)
                if longest:
                    break
    return entry


def excluded(name: str, exclude: Exclude, rules: RuleSet, kind: str, moe: bool) -> bool:
    """The engine's decision for one module (raises ``MixedShards`` where the engine raises)."""
    if kind == "mxfp4":  # native MXFP4 (gpt-oss): the routed experts quantized, every Linear unquantized
        native = rules["mxfp4_native"]
        return native["linear"] == "unquantized" if not moe else native["experts"] != "mxfp4"
    if kind == "fp8":
        skip = rules["fp8_skip"]
        return fp8_skipped(name, exclude.entries, skip["fused"], match=skip["match"], experts=skip["experts"],
                           fallback_fused=skip["fallback_fused"], fused_first=fp8_fused_first(skip))
    match = rules["quark_match"]
    return quark_excluded(name, exclude, rules["quark_fused"], fused_first=match["fused_first"],
                          experts_prefix=match["experts_prefix"], routed_experts=moe,
                          error=rules["mixed_shards_error"])


def replay(ctx: ReplayContext) -> list[Finding]:
    """Findings for one engine release, from the checkpoint's Linear modules, its quantization_config
    and ``config.json``, served as ``ctx.serving``."""
    findings, slots, entries = _replay(ctx)
    return findings + fusion_findings(ctx, entries, slots)


def loads_under(ctx: ReplayContext) -> list[tuple[Serving, bool]]:
    """Whether this release loads the checkpoint on each GPU arch of ``loads_under_archs``, with expert parallelism
    off and on (ep = tp), with fusion on and off: the module checks once per platform, fusion per
    condition."""
    out = []
    for platform, arches in loads_under_archs().items():
        # an arch, not a GPU model
        on_platform = replace(ctx.serving, platform=platform, gpu_arch=arches[0], gpu=None)
        findings, slots, entries = _replay(replace(ctx, serving=on_platform))
        for arch in arches:
            for ep in sorted({1, ctx.serving.tp}):
                for disable in (False, True):
                    serving = replace(on_platform, gpu_arch=arch, ep=ep, disable_shared_experts_fusion=disable)
                    fused = fusion_findings(replace(ctx, serving=serving), entries, slots)
                    out.append((serving, not findings and not fused))
    return out


def _replay(ctx: ReplayContext) -> tuple[list[Finding], dict[str, bool], list[str]]:
    """The module findings, each FusedMoE's slot scheme (quantized or not), and the exclude entries."""
    rules, modules, kind, fmt_name, serving = ctx.rules, ctx.modules, ctx.kind, ctx.fmt_name, ctx.serving
    entries = exclude_entries(ctx.qconfig, rules, kind, serving)
    draft_entries, whole_draft_bf16 = draft_exclude(entries, rules, ctx.family, ctx.num_hidden_layers, kind,
                                                    exclude_entries(ctx.qconfig, rules, kind, serving, mapped=False))
    lists = {False: Exclude(entries), True: Exclude(draft_entries)}
    where = "modules_to_not_convert" if kind == "fp8" else "exclude"
    findings = []

    def finding(module: str, why: str, fix: str) -> None:
        findings.append(Finding("engine", rules.id, module, why, fix))

    slots: dict[str, bool] = {}  # FusedMoE name -> whether its expert slots are quantized
    layered = kind == "quark" and quark_layers.per_layer(ctx.qconfig)  # modules' rungs decided per layer
    labelled = kind in THIRD_PARTY or layered
    built = engine_modules(ctx, whole_draft_bf16)
    for name, em in sorted(built.items()):
        # a third-party or per-layer Quark checkpoint's parts by their scheme label ("": bf16), the others by
        # quantized or not
        on_disk = {modules[m].scheme if labelled else modules[m].quantized for m in em.members}
        what = "FusedMoE" if em.moe else "fused module" if len(em.members) > 1 else "module"
        if len(on_disk) > 1:
            parts = sorted(s or "bf16" for s in on_disk) if labelled else [fmt_name, "bf16"]
            finding(name, f"its checkpoint parts are partly {', partly '.join(parts)} "
                          f"({', '.join(sorted(em.members))}); the {what} loads all of them with one scheme",
                    "quantize all of them or none" if not labelled else "store all of them in one scheme")
            continue
        quantized_on_disk = on_disk.pop()
        if quantized_on_disk and (permuted := _rotary_permuted(em, rules, kind)):
            outcome = f"the packed {fmt_name} rows are permuted but not their scales: it loads wrong" \
                if rules["qk_rotary_permute"].get("scales_left") else \
                f"a packed {fmt_name} weight cannot take that view (and its scales are not permuted)"
            finding(name, f"{rules.engine}'s loader views {permuted} as [heads, head_dim/2, 2, hidden] to permute "
                          f"it for rotary; {outcome}", "keep q_proj and k_proj bf16 (list them in exclude)")
            continue
        if quantized_on_disk and em.moe and (renamed := _expert_scales_renamed(rules, kind)):
            finding(name, f"{rules.engine}'s loader renames the experts' {renamed['dtype']} {renamed['scale']} to "
                          f"{renamed['renamed']} ({rules.cites['expert_scales_renamed'].split(' (', 1)[0]}), which "
                          f"the {fmt_name} MoE method does not create: the load fails (KeyError)",
                    "serve with a release that loads it (gate checkpoint names them), or keep the experts bf16")
            continue
        if em.build == "bf16":
            if em.moe:
                slots[name] = False
            if quantized_on_disk and em.role == "indexer" and kind in rules["indexer"]["wk_dequantized"]:
                continue  # the loader dequantizes it into the bf16 slot
            if quantized_on_disk and em.draft and whole_draft_bf16:
                finding(name, f"{rules.engine} builds the whole MTP draft bf16 (its exclude entries for the draft "
                              f"drop the draft's quant config: {rules.cites['draft_exclude'].split(' (', 1)[0]}); "
                              f"an {fmt_name} weight cannot load", "keep the draft's experts bf16 too (quantize "
                              "--mtp-experts bf16), or serve without the MTP draft")
                continue
            if quantized_on_disk:
                how = "as a plain bf16 Linear" if em.role == "mtp_proj" else f"unquantized ({em.role})"
                on = f" on {serving.platform}" if em.role == "indexer" and rules.engine == "sglang" else ""
                finding(name, f"{rules.engine} builds {name.rsplit('.', 1)[-1]} {how}{on}; an {fmt_name} weight "
                              "cannot load", "keep it bf16 (quantgate's recipes never quantize it)")
            continue
        if kind in THIRD_PARTY:  # the format's rules decide (quant.engines.format_rules)
            _decided(ctx, em, name, what, quantized_on_disk, finding, slots, kind)
            continue
        if em.build == "quantized":
            _forced_quantized(ctx, em, name, quantized_on_disk, lists[em.draft], where, finding)
            continue
        try:
            expect_quantized = not excluded(name, lists[em.draft], rules, kind, em.moe)
        except MixedShards as exc:
            finding(name, f"the {where} list names some of its shards only: the engine raises {exc}",
                    f"list all shards of {name} or none")
            continue
        if em.moe:
            slots[name] = expect_quantized
        if expect_quantized and not quantized_on_disk:
            names = ", ".join(repr(n) for n in _names_to_list(name, rules, kind))
            finding(name, _bf16_meets_slot(em, modules, fmt_name, kind), f"list {names} in {where} (quantize "
                                                                           "writes them)")
        elif not expect_quantized and quantized_on_disk:
            finding(name, f"{fmt_name} weight on disk but the {where} list makes this {what} bf16: packed bytes "
                          "would load as weights", f"remove the {where} entries matching {name!r}")
        elif expect_quantized and layered:  # which rung: the release's per-layer matching decides
            _decided(ctx, em, name, what, quantized_on_disk, finding, slots, quark_layers.KIND)
    return findings, slots, entries


def _decided(ctx: ReplayContext, em: EngineModule, name: str, what: str, on_disk: str, finding,
             slots: dict[str, bool], kind: str) -> None:
    """A module of a third-party checkpoint, or one a per-layer Quark config quantizes (``kind``
    ``quark-layers``): the scheme this release builds it with (the format module's ``decide`` under the cut
    rule set's format rules) against the scheme its tensors are stored in."""
    rules = ctx.rules
    if rules.values.get(format_rules.key(kind)) is None:
        finding(name, f"how {rules.engine} {rules.release or rules.first} loads {kind} checkpoints was not read: "
                      "whether it loads is unknown", f"read it into {format_rules.rules_path(kind, rules.engine).name}")
        return
    if kind == quark_layers.KIND:  # the engine's names of its members: a FusedMoE asks per expert
        extra = {"members": tuple(name + m[m.rindex(".experts.") + len(".experts"):] if em.moe and ".experts." in m
                                  else m for m in em.members), "family": ctx.family,
                 "num_hidden_layers": ctx.num_hidden_layers}
    else:
        extra = {"expert_leaves": leaves} if kind == "compressed-tensors" and (leaves := _expert_leaves(em)) else {}
    decision = format_rules.format_module(kind).decide(name, moe=em.moe, draft=em.draft, qconfig=ctx.qconfig,
                                                       rules=rules, **extra)
    if em.moe:
        slots[name] = decision.scheme is not None
    stored = on_disk or "bf16"
    if decision.unread:
        finding(name, f"{decision.unread} was not read for {rules.engine} {rules.release or rules.first}: whether "
                      f"this {what} ({stored} on disk) loads is unknown ({decision.why})", decision.fix)
    elif decision.raises:
        finding(name, f"{rules.engine} raises building this {what} ({stored} on disk): {decision.raises} "
                      f"({decision.why})", decision.fix or "re-export the checkpoint")
    elif decision.scheme is None and on_disk:
        finding(name, f"{stored} on disk, but {rules.engine} builds this {what} unquantized ({decision.why}): its "
                      "packed weights and scales load as garbage or have no parameter to load into",
                decision.fix or "store it bf16 or make the config quantize it")
    elif decision.scheme is not None and decision.scheme != on_disk:
        finding(name, f"{stored} on disk, but {rules.engine} builds this {what} as {decision.scheme} "
                      f"({decision.why}): the loader asks for tensors the checkpoint does not hold",
                decision.fix or f"make the config's scheme for {name} match its tensors")


# a FusedMoE's checkpoint names of an expert's gate, up and down projections, by the leaves its experts store:
# Mixtral's and MiniMax's w1 / w3 / w2 (vLLM 0.32.0 models/mixtral.py: FusedMoE(ckpt_names=("w1", "w2", "w3")),
# gate, down, up), which compressed-tensors asks from 0.32.0 (the rule moe_match.expert_leaves: checkpoint)
_CHECKPOINT_LEAVES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _expert_leaves(em: EngineModule) -> tuple[str, str, str] | None:
    if not em.moe:
        return None
    stored = {m.rpartition(".")[2] for m in em.members}
    return next((leaves for leaves in _CHECKPOINT_LEAVES if set(leaves) <= stored), None)


def _forced_quantized(ctx: ReplayContext, em: EngineModule, name: str, quantized_on_disk: bool, exclude: Exclude,
                      where: str, finding) -> None:
    """A module built with the quant config whatever the exclude list says (``built_quantized``):
    a bf16 weight cannot load, and an exclude entry for it makes the quant method unquantized where
    the class asserts a quantized one."""
    rules, kind = ctx.rules, ctx.kind
    leaf = name.rsplit(".", 1)[-1]
    why = f"{rules.engine} builds {leaf} quantized whatever {where} says ({rules['built_quantized'][kind]['reason']})"
    if not quantized_on_disk:
        finding(name, f"{why}; a bf16 {leaf} cannot load: {rules['built_quantized'][kind]['error']}",
                f"quantize {leaf} ({rules['built_quantized'][kind]['fix']})")
    elif excluded(name, exclude, rules, kind, em.moe):
        finding(name, f"{why}; the {where} entry matching it makes its quant method unquantized and the class's "
                      "assertion fails ('FP8 quant_config must create weight_scale_inv')",
                f"remove the {where} entries matching {name!r}")


def _expert_scales_renamed(rules: RuleSet, kind: str) -> dict | None:
    """The loader's rename of quantized expert scales that this kind's MoE method cannot take (rule
    ``expert_scales_renamed``: sglang's MiMo-V2), or None."""
    rule = rules.values.get("expert_scales_renamed")
    return rule if rule and kind in rule["fails"] else None


def _rotary_permuted(em: EngineModule, rules: RuleSet, kind: str) -> str | None:
    """The checkpoint weight of ``em`` that the loader reshapes for rotary and cannot in this format
    (rule ``qk_rotary_permute``: sglang's Llama-4), or None."""
    rule = rules.values.get("qk_rotary_permute")
    if not rule or kind not in rule["fails"]:
        return None
    return next((m for m in em.members if m.rpartition(".")[2] in rule["leaves"]
                 and not any(skip in m for skip in rule["unless_name_has"])), None)


def _shared_by_moe(modules: dict[str, Module], rules: RuleSet, num_hidden_layers: int) -> dict[str, list[str]]:
    """Each FusedMoE's engine name -> the checkpoint's shared-expert modules of that layer (shared: do not change)."""
    return _memo(("shared_by_moe", id(modules), id(rules.values), num_hidden_layers), (modules, rules.values),
                 lambda: _shared_modules(modules, rules, num_hidden_layers))


def _shared_modules(modules: dict[str, Module], rules: RuleSet, num_hidden_layers: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    shared = f".{rules['shared_experts_fusion'].get('shared', 'shared_experts')}."  # Qwen3-Next: shared_expert
    for module, info in modules.items():
        if info.role == "shared_expert" and shared in module:
            block = module[:module.index(shared)]  # <layer>.mlp, or <layer>.block_sparse_moe
            name = draft_name(f"{block}.experts.0.gate_proj", rules, num_hidden_layers)
            if name is not None:
                out.setdefault(name[:name.rindex(".experts.") + len(".experts")], []).append(module)
    return out


def _routed_rungs(modules: dict[str, Module], rules: RuleSet) -> dict[str, str]:
    """Each MoE block (``<layer>.mlp``) -> the rung its routed experts are stored in, for a per-layer checkpoint:
    the rung the FusedMoE's expert slots are built in (one scheme per FusedMoE)."""
    shared = f".{rules['shared_experts_fusion'].get('shared', 'shared_experts')}."
    out: dict[str, str] = {}
    for module, info in modules.items():
        if info.role != "shared_expert" and ".experts." in module and shared not in module and info.scheme:
            out.setdefault(module[:module.index(".experts.")], info.scheme if info.quantized else "bf16")
    return out


def fusion_findings(ctx: ReplayContext, entries: list[str], slots: dict[str, bool]) -> list[Finding]:
    """A fused shared expert whose dtype on disk differs from its FusedMoE's expert slots: one
    finding per runner (main model, MTP draft), naming the ways out (``entries``, ``slots``: from
    ``_replay``). A per-layer Quark checkpoint compares rungs (the shared expert's stored rung against its
    layer's routed rung): the release probes only some layers' specs (quark.py: can_fuse_shared_expert), so a
    layer it does not probe can still meet a slot of another rung."""
    rules, modules, family, num_hidden_layers = ctx.rules, ctx.modules, ctx.family, ctx.num_hidden_layers
    kind, fmt_name, config, serving, qconfig = ctx.kind, ctx.fmt_name, ctx.config, ctx.serving, ctx.qconfig
    if rules.engine != "sglang" or not rules.values.get("shared_experts_fusion"):
        return []
    layered = kind == "quark" and quark_layers.per_layer(qconfig)
    routed = _routed_rungs(modules, rules) if layered else {}
    marker = f".{rules['shared_experts_fusion'].get('shared', 'shared_experts')}."

    def rungs(moe: str, shared: str) -> tuple[str, str]:  # (the slot's, the shared expert's on disk)
        if layered and shared[:shared.index(marker)] in routed:
            disk = modules[shared].scheme if modules[shared].quantized and modules[shared].scheme else "bf16"
            return (routed[shared[:shared.index(marker)]] if slots[moe] else "bf16"), disk
        return (fmt_name if slots[moe] else "bf16"), (fmt_name if modules[shared].quantized else "bf16")

    clashes: dict[bool, list[tuple[str, str]]] = {}
    by_layer = lambda item: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", item[0])]
    for moe, shared in sorted(_shared_by_moe(modules, rules, num_hidden_layers).items(), key=by_layer):
        if moe not in slots:
            continue
        draft = is_draft(shared[0], rules, num_hidden_layers)
        bad = [s for s in shared if len(set(rungs(moe, s))) > 1]
        if bad:
            clashes.setdefault(draft, []).append((moe, bad[0]))
    findings = []
    for draft, clash in sorted(clashes.items()):
        runner_entries = loader_mapped(entries, rules, family) if draft else entries
        if no_fusion_reason(rules, family, config, kind, runner_entries, serving, draft, qconfig) is not None:
            continue
        moe, shared = clash[0]
        slot, disk = rungs(moe, shared)
        runner = "the MTP draft" if draft else "the main model"
        ok = [] if layered else [r for r in rule_sets("sglang", family) if no_fusion_reason(
            r, family, config, kind, loader_mapped(entries, r, family) if draft else entries, serving, draft)]
        slot_index = config.get(rules["shared_experts_fusion"].get("experts_key", "n_routed_experts"),
                                config.get("num_local_experts"))
        findings.append(Finding(
            "fusion", rules.id, moe,
            f"{rules.engine} fuses {runner}'s shared expert into the routed FusedMoE as expert {slot_index} "
            f"({fusion_cite(rules)}; {serving.label()}): the {disk} shared expert "
            f"({shared}) meets the FusedMoE's {slot} expert slots; load fails ({len(clash)} MoE layer(s))"
            + ("; quark.py: can_fuse_shared_expert compares the specs only at the layers it probes" if layered else ""),
            (f"serve with {release_spans(ok, family)}, or " if ok else "")
            + "start sglang with --disable-shared-experts-fusion"
            + (f", or give the shared expert its layer's routed rung ({slot})" if layered else "")
            + (", or store the draft's shared and routed experts in one dtype" if draft else "")))
    return findings + _unloaded_draft_slot(ctx, entries)


def _draft_fuses_unloaded(rules: RuleSet, ctx: ReplayContext, entries: list[str]) -> bool:
    """Whether this release's MTP draft fuses its shared expert while the draft's loader has no remap of
    mlp.shared_expert into the fused slot (rule ``draft_shared_remap``)."""
    rule = rules.values.get("shared_experts_fusion") or {}
    if rule.get("decided_by") != "can_fuse_shared_expert" or rule.get("draft_shared_remap", True):
        return False
    draft_entries, whole_bf16 = draft_exclude(entries, rules, ctx.family, ctx.num_hidden_layers, ctx.kind)
    draft_kind = None if whole_bf16 else ctx.kind  # a draft built bf16 has no quant config to veto
    if no_fusion_reason(rules, ctx.family, ctx.config, draft_kind, draft_entries, ctx.serving, True,
                        ctx.qconfig) is not None:
        return False
    return rule.get("draft_decision", "own") == "own" or \
        no_fusion_reason(rules, ctx.family, ctx.config, ctx.kind, entries, ctx.serving, False, ctx.qconfig) is None


def _unloaded_draft_slot(ctx: ReplayContext, entries: list[str]) -> list[Finding]:
    """A fused MTP draft whose loader never fills the shared expert's slot: no error, the draft runs with an
    unloaded expert (its acceptance rate collapses), so it is a finding like a failed load."""
    rules = ctx.rules
    drafts = [(moe, shared) for moe, shared in _shared_by_moe(ctx.modules, rules, ctx.num_hidden_layers).items()
              if is_draft(shared[0], rules, ctx.num_hidden_layers)]
    if not drafts or not _draft_fuses_unloaded(rules, ctx, entries):
        return []
    moe, shared = drafts[0]
    ok = [r for r in rule_sets("sglang", ctx.family)
          if not _draft_fuses_unloaded(r, replace(ctx, rules=r),
                                       exclude_entries(ctx.qconfig, r, ctx.kind, ctx.serving))]
    slot = ctx.config.get(rules["shared_experts_fusion"]["experts_key"])
    return [Finding(
        "fusion", rules.id, moe,
        f"{rules.engine} fuses the MTP draft's shared expert into its FusedMoE as expert {slot} ({fusion_cite(rules)}; "
        f"{ctx.serving.label()}) but the draft's loader has no mlp.shared_expert -> mlp.experts.{slot} remap: "
        f"{shared[0]} is never loaded into the slot; the draft loads wrong, without an error",
        (f"serve with {release_spans(ok, ctx.family)}, or " if ok else "")
        + "start sglang with --disable-shared-experts-fusion, or serve without the MTP draft")]


def release_spans(ok: list[RuleSet], family: str) -> str:
    """Rule sets as release spans ('sglang >= 0.5.18' when a span runs to the last release read for
    the family's class)."""
    order = [r.id for r in rule_sets("sglang", family)]
    spans: list[list[RuleSet]] = []
    for r in ok:
        if spans and order.index(r.id) == order.index(spans[-1][-1].id) + 1:
            spans[-1].append(r)
        else:
            spans.append([r])
    last = rule_sets("sglang", family)[-1].last
    return " or ".join(f"sglang >= {s[0].first}" if s[-1].last == last else f"sglang {s[0].first}"
                       if s[0].first == s[-1].last else f"sglang {s[0].first}..{s[-1].last}" for s in spans)


def _names_to_list(name: str, rules: RuleSet, kind: str) -> list[str]:
    """The entries this release honours for ``name``: its shards where it only expands fused names."""
    leaf = name.rsplit(".", 1)[-1]
    fused = rules.fused(kind)
    fused_first = rules["quark_match"]["fused_first"] if kind == "quark" else fp8_fused_first(rules["fp8_skip"])
    if leaf in fused and not fused_first:
        return [name.replace(leaf, shard) for shard in fused[leaf]]
    return [name]


def _bf16_meets_slot(em: EngineModule, modules: dict[str, Module], fmt_name: str, kind: str) -> str:
    shard = min(em.members, key=lambda m: not m.endswith("gate_proj"))  # w13 / the first shard loads first
    out, cols = modules[shard].shape
    if kind == "fp8":
        return (f"bf16 weight [{out}, {cols}] meets an FP8 {'FusedMoE' if em.moe else 'slot'}: it is cast to float8 "
                "without a scale; loads silently wrong")
    packed = cols * (6 if fmt_name.startswith("MXFP6") else 4) // 8
    if em.moe:
        return (f"bf16 experts meet an {fmt_name} FusedMoE: RuntimeError: The size of tensor a ({packed}) must "
                f"match the size of tensor b ({cols}) at non-singleton dimension 1")
    part_of = f" (shard {shard.rsplit('.', 1)[-1]} of this fused module)" if len(em.members) > 1 else ""
    return (f"bf16 weight [{out}, {cols}]{part_of} meets an {fmt_name} slot [{out}, {packed}]: AssertionError "
            "on shapes at load (the outage in the Wafer write-up)")
