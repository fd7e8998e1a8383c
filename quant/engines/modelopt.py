"""ModelOpt checkpoints as an engine release builds them: which scheme each module gets, from the config
the engine reads (config.json's ``quantization_config``, else hf_quant_config.json's whole content).

The decision is the engine's quantization layer, the same for every model class, so its rules are a
format rule file per engine (``manifests/engines/modelopt.<engine>.yaml``, schema ``RULES``, loaded by
``quant.engines.format_rules``). In vLLM (``layers/quantization/modelopt.py``):

- the config: ``ModelOptQuantConfigBase.from_config`` reads ``{"quantization": {"quant_algo", "exclude_modules",
  ...}}`` (hf_quant_config.json's shape) or a flat ``{"quant_algo", "ignore", ...}`` (config.json's); a
  ``quant_algo`` outside ``QUANT_ALGOS`` raises. A config naming its producer (``producer.name: modelopt``)
  is first given a quant_method by the architecture-config convertor, which raises on algos it does not map.
- the exclude list: ``apply_vllm_mapper`` turns each ``path*`` into ``path`` and ``path.*`` and runs the list
  through the model class's weight-name mapper; ``is_layer_excluded`` then matches the engine's module name
  exactly (``is_layer_skipped``: a fused module by its shards, which must agree; a FusedMoE when an entry
  containing "experts" contains its name), as a substring, and with ``fnmatch``.
- ``get_quant_method``: an excluded module unquantized, modules whose name holds a vision marker unquantized,
  the rest quantized with the config's algo (``lm_head`` only in releases whose ParallelLMHead takes it).
- MIXED_PRECISION: each module's algo from ``quantized_layers`` (``_resolve_quant_algo``: the name, its
  shards, entries under it), after the same exclusion; modules it does not find stay unquantized.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from typing import Literal

from quant.engines.format_rules import Decision, key
from quant.engines.match import MixedShards, fp8_skipped
from quant.engines.replay import mapped_entry
from quant.engines.rule_kinds import FusedModules, Rule
from quant.engines.rules import RuleSet
from quant.schema import Schema

MIXED = "MIXED_PRECISION"
MatchStep = Literal["exact", "substring", "fnmatch", "skipped", "glob"]
LookupStep = Literal["direct", "packed", "children", "experts_parent", "shards"]


class Mixed(Schema):
    """``ModelOptMixedPrecisionConfig``: how ``_resolve_quant_algo`` finds a module's algo in ``quantized_layers``
    (``lookup``, in order: ``direct`` the name; ``packed`` the class's packed shards, which must agree; ``children``
    any entry under the name; ``experts_parent`` for a ``.experts`` FusedMoE any entry under its parent; ``shards``
    q/k/v or gate/up entries beside a fused name), ``candidates`` (the name also as ``lm_head`` and with
    ``language_model.model.`` / ``model.language_model.`` swapped), and the algos it builds a Linear / a FusedMoE
    with, each with the scheme label it builds (any other algo: unquantized)."""
    lookup: list[LookupStep]
    candidates: bool
    linear: dict[str, str]
    moe: dict[str, str]


class Dispatch(Schema):
    """sglang: the config a ModelOpt checkpoint is built with (configs/model_config.py ``_parse_quant_hf_config``,
    ``_parse_modelopt_quant_config``; model_loader/weight_utils.py ``get_quant_config``) and what each ModelOpt
    config's ``from_config`` takes. ``modelopt``: a flat config whose quant_method is ``modelopt`` is ``parsed``
    by its quant_algo, as hf_quant_config.json is, or built with the ``fp8`` config (``QUANTIZATION_METHODS``).
    ``parsed``: quant_algo -> the config it gets (``fp8``, ``fp4``, or the name of a config quantgate does not
    replay); an algo not listed gets none: hf_quant_config.json's is not read (the checkpoint loads unquantized),
    a flat ``modelopt`` one goes to the ``fp8`` config. ``takes``: config -> the quant_algos its ``from_config``
    builds (any other raises). ``flat_exclude_keys``: config -> its flat config's exclude keys, the first present
    read (nested: ``exclude_modules``)."""
    modelopt: Literal["parsed", "fp8"]
    parsed: dict[str, str]
    takes: dict[Literal["fp8", "fp4"], list[str]]
    flat_exclude_keys: dict[Literal["fp8", "fp4"], list[str]]


class Skipped(Schema):
    """sglang's ``is_layer_skipped`` (quant.engines.match.fp8_skipped), the ``skipped`` match step: asked for a
    Linear (not a FusedMoE) before ``is_layer_excluded``."""
    match: Literal["substring", "module_path"]
    strip_dots: bool
    experts: Literal["replace", "or"]
    fallback_fused: FusedModules


class ModelOptRules(Schema):
    """A release's ModelOpt loading, each a ``Rule`` (value and citation); a rule set states what changed."""
    # quant_algo (upper-cased) -> the scheme label (quant.third_party) the release builds; others raise
    algos: Rule[dict[str, str]] | None = None
    moe_schemes: Rule[dict[str, str]] | None = None  # algo -> the label its FusedMoE method builds (others raise)
    # a config with producer.name modelopt: the nested quant_algos the convertor gives a quant_method (others raise)
    producer_algos: Rule[list[str] | None] | None = None
    nested_required: Rule[dict[str, list[str]]] | None = None  # algo -> keys its nested config must hold
    flat_exclude_keys: Rule[list[str]] | None = None  # the flat config's exclude keys, the first present read
    star_split: Rule[bool] | None = None  # apply_vllm_mapper: ``path*`` -> ``path``, ``path.*``
    class_mapper: Rule[bool] | None = None  # the exclude list goes through the class's weight-name mapper
    match: Rule[list[MatchStep]] | None = None  # is_layer_excluded's tests, in order
    fused_first: Rule[bool] | None = None  # a listed fused name is honoured before its shards are asked
    lm_head: Rule[bool] | None = None  # ParallelLMHead takes the quant method (else always unquantized)
    unquantized_markers: Rule[list[str]] | None = None  # a name holding one is built unquantized
    mixed: Rule[Mixed | None] | None = None
    dispatch: Rule[Dispatch | None] | None = None  # sglang: the config class first (None: vLLM's one config)
    skipped: Rule[Skipped | None] | None = None  # sglang: is_layer_skipped's switches
    # sglang apply_weight_name_mapper: a mapped entry starting with language_model. is also kept without it
    mapper_strips_language_model: Rule[bool] | None = None
    # sglang: the model classes (a rule set's model_class) whose MTP draft class is built with no quant config
    # under the FP4 config: every draft module unquantized, whatever the exclude list says
    bf16_drafts: Rule[list[str]] | None = None


RULES = ModelOptRules
KEY = key("modelopt")


def _cite(rules: RuleSet, rule: str) -> str:
    return rules.cites.get(f"{KEY}.{rule}", "").split(" (", 1)[0]


def _nested(qconfig: dict) -> dict | None:
    inner = qconfig.get("quantization")
    return inner if "quantization" in qconfig else None


def quant_algo(qconfig: dict) -> str:
    """The config's quant_algo as ``from_config`` reads it (upper-cased; "" when absent)."""
    inner = _nested(qconfig)
    algo = (inner if isinstance(inner, dict) else qconfig).get("quant_algo")
    return str(algo).upper() if algo else ""


def exclude_list(qconfig: dict, values: dict):
    """The exclude list ``from_config`` keeps: nested ``exclude_modules``, or the first flat key present."""
    inner = _nested(qconfig)
    if isinstance(inner, dict):
        return inner.get("exclude_modules", [])
    keys = values["flat_exclude_keys"]
    if dispatch := values.get("dispatch"):  # sglang: each config reads its own keys
        keys = dispatch["flat_exclude_keys"].get(sglang_config(qconfig, dispatch), [])
    for name in keys:
        if name in qconfig:
            return qconfig[name]
    return []


def _sglang_algo(qconfig: dict):
    """The quant_algo as sglang compares it: as written (vLLM upper-cases it)."""
    inner = _nested(qconfig)
    return (inner if isinstance(inner, dict) else {} if inner is not None else qconfig).get("quant_algo")


def sglang_config(qconfig: dict, dispatch: dict) -> str | None:
    """The config sglang builds a ModelOpt checkpoint with (``Dispatch``): ``fp8``, ``fp4``, the name of another
    config, or None (none: hf_quant_config.json's quant_algo is not read as a quantization)."""
    algo = _sglang_algo(qconfig)
    method = qconfig.get("quant_method") if _nested(qconfig) is None else None
    if method in ("modelopt_fp8", "modelopt_fp4"):  # a quant_method naming the config is taken as is
        return method.removeprefix("modelopt_")
    if method == "modelopt" and dispatch["modelopt"] == "fp8":
        return "fp8"
    parsed = dispatch["parsed"].get(algo) if isinstance(algo, str) else None
    return parsed or ("fp8" if method == "modelopt" else None)


def sglang_refused(qconfig: dict, rules: RuleSet) -> Decision | None:
    """sglang's decision for every module where its config selection or ``from_config`` decides before any
    module is built (None: a ModelOpt config is built and each module is decided on its own)."""
    dispatch = rules.values[KEY]["dispatch"]
    cite = _cite(rules, "dispatch")
    algo = _sglang_algo(qconfig)
    config = sglang_config(qconfig, dispatch)
    if config is None:
        return Decision(None, f"quant_algo {algo!r} is given no quantization method, so the checkpoint is built "
                              f"unquantized ({cite})", "serve a release that reads this quant_algo")
    if config not in dispatch["takes"]:
        return Decision(None, f"quant_algo {algo!r} is built with sglang's {config} ({cite})",
                        "check this release's loading by hand",
                        unread=f"how sglang's {config} loads {algo!r}")
    if algo not in dispatch["takes"][config]:
        message = "ModelOptFp8Config only supports static FP8 quantization" if config == "fp8" else \
            f"ModelOpt currently only supports: {', '.join(dispatch['takes'][config])} quantizations in sglang"
        return Decision(None, f"the ModelOpt {config.upper()} config refuses quant_algo {algo!r} ({cite})",
                        "fix the quantization config, or serve a release that takes it", f"ValueError: {message}")
    return None


def _int_like(value) -> bool:
    """``from_config``'s group_size: None, an int, or anything ``int()`` takes."""
    try:
        return value is None or isinstance(value, int) or int(value) is not None
    except (ValueError, TypeError):
        return False


def config_error(qconfig: dict, rules: RuleSet) -> tuple[str, str] | None:
    """(the release's message, its citation) where it refuses the config before building any module."""
    values = rules.values[KEY]
    inner = _nested(qconfig)
    algo = quant_algo(qconfig)
    producer = qconfig.get("producer")
    if isinstance(producer, dict) and producer.get("name") == "modelopt" and isinstance(inner, dict) \
            and inner.get("quant_algo") is not None and values["producer_algos"] is not None \
            and algo not in values["producer_algos"]:
        return f"ValueError: Unknown ModelOpt quant algo: {inner['quant_algo']}", _cite(rules, "producer_algos")
    if inner is not None and not isinstance(inner, dict):
        return "ValueError: Expected 'quantization' to be a dictionary in config", _cite(rules, "algos")
    if not algo:
        return "ValueError: Missing 'quant_algo' in quantization config", _cite(rules, "algos")
    kv_cache = inner.get("kv_cache_quant_algo") if isinstance(inner, dict) else None
    if kv_cache is not None and not isinstance(kv_cache, str):
        return f"ValueError: kv_cache_quant_algo must be a string, got {type(kv_cache)}", _cite(rules, "algos")
    if not isinstance(exclude_list(qconfig, values), list):
        return "ValueError: exclude_modules must be a list", _cite(rules, "flat_exclude_keys")
    if not _int_like((inner if isinstance(inner, dict) else qconfig).get("group_size")):
        return "ValueError: group_size must be an integer", _cite(rules, "algos")
    if algo not in values["algos"]:
        return (f"ValueError: ModelOpt currently only supports: {list(values['algos'])} quantizations in vLLM",
                _cite(rules, "algos"))
    missing = [k for k in values["nested_required"].get(algo, []) if isinstance(inner, dict) and k not in inner]
    if missing:
        message = f"ValueError: {algo} quantization requires the following fields in hf_quant_config.json: {missing}"
        return message, _cite(rules, "nested_required")
    return None


def exclude_entries(qconfig: dict, rules: RuleSet) -> list[str]:
    """The exclude list as ``is_layer_excluded`` matches it: ``apply_vllm_mapper``'s ``path*`` split and the
    class's weight-name mapper applied."""
    values = rules.values[KEY]
    entries = [e for e in exclude_list(qconfig, values) if isinstance(e, str)]
    mapper = class_mapper(rules)
    if mapper is None:  # the loader calls apply_vllm_mapper only for a class with a weight-name mapper
        return entries
    if values["star_split"]:
        entries = [part for e in entries
                   for part in ((e[:-1], e[:-1] + ".*") if len(e) >= 2 and e[-1] == "*" and e[-2] != "." else (e,))]
    mapped = [m for e in entries if (m := mapped_entry(e, mapper)) is not None]
    if values.get("mapper_strips_language_model"):
        mapped = list(dict.fromkeys(n for m in mapped for n in (m, m.removeprefix("language_model."))))
    return mapped


def class_mapper(rules: RuleSet) -> dict | None:
    """The model class's weight-name mapper (the family rule ``exclude_mapper``) where the release hands it to
    the ModelOpt config (``class_mapper``), else None."""
    mapper = rules.values.get("exclude_mapper")
    return mapper if rules.values[KEY]["class_mapper"] and mapper and mapper.get("style") == rules.engine else None


def excluded_by(module: str, entries: list[str], rules: RuleSet, moe: bool = False) -> str | None:
    """How ``is_layer_excluded`` excludes ``module`` (None: it does not); raises ``MixedShards`` where the
    engine raises (a fused module whose shards the list names only in part)."""
    values = rules.values[KEY]
    if not entries:
        return None
    for step in values["match"]:
        if step == "skipped" and not moe and fp8_skipped(module, entries, rules.fused("modelopt"),
                                                         **values["skipped"]):
            return "is_layer_skipped: an entry names it or its path (a fused module by its shards)"
        if step == "glob" and (hit := glob_hit(module, entries)):
            return f"is_layer_excluded: entry {hit!r} matches it or one of its dotted parts ('*' as any text)"
        if step == "exact" and fp8_skipped(module, entries, rules.fused("modelopt"), match="exact",
                                           experts="contained", fallback_fused={},
                                           fused_first=values["fused_first"]):
            return _exact_hit(module, entries, rules.fused("modelopt"))
        if step == "substring" and (hit := next((e for e in entries if e != module and e in module), None)):
            return f"entry {hit!r} is a substring of it"
        if step == "fnmatch" and (hit := next((e for e in entries if fnmatch(module, e)), None)):
            return f"entry {hit!r} matches it as a wildcard (fnmatch)"
    return None


MLA_FUSED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # sglang's fused_patterns


def glob_hit(module: str, entries: list[str]) -> str | None:
    """sglang ``ModelOptQuantConfig.is_layer_excluded``: the entry that excludes ``module``. Its ``*`` reads as
    any text, the rest literally, matching the whole name (and the name without ``language_model.``) or one
    of its dotted parts; an entry whose leaf is an MLA shard excludes the fused module whose leaf holds it."""
    names = [module, module.removeprefix("language_model.")] if module.startswith("language_model.") else [module]
    for entry in entries:
        pattern = re.compile(entry.replace(".", r"\.").replace("*", ".*"))
        if any(pattern.fullmatch(n) or any(pattern.fullmatch(part) for part in n.split(".")) for n in names):
            return entry
        tail = entry.rsplit(".", 1)[-1]
        if tail in MLA_FUSED and any(tail in n.rsplit(".", 1)[-1] for n in names):
            return entry
    return None


def _exact_hit(module: str, entries: list[str], fused: dict) -> str:
    """Which entries ``is_layer_skipped`` matched: the name, its shards, or an experts entry holding it."""
    leaf = module.rsplit(".", 1)[-1]
    if module in entries:
        return f"entry {module!r} names it"
    shards = [name for s in fused.get(leaf, []) if (name := module.replace(leaf, s)) in entries]
    if shards:
        return f"entries {', '.join(map(repr, shards))} name its shards"
    holder = next(e for e in entries if "experts" in e and module in e)
    return f"entry {holder!r} holds its name (is_layer_skipped's experts test)"


def _candidates(name: str, mixed: dict) -> list[str]:
    out = [name]
    if mixed["candidates"]:
        if name.endswith(".lm_head"):
            out.append("lm_head")
        for a, b in (("language_model.model.", "model.language_model."),
                     ("model.language_model.", "language_model.model.")):
            if name.startswith(a):
                out.append(b + name[len(a):])
                break
    return list(dict.fromkeys(out))


def mixed_algo(module: str, layers: dict, mixed: dict, fused: dict) -> str | None:
    """``_resolve_quant_algo``: the algo ``quantized_layers`` gives ``module`` (None: not found)."""
    def algo(entry: str) -> str:
        return str(layers[entry].get("quant_algo", "")).upper() if isinstance(layers[entry], dict) else ""

    def agreed(names: list[str]) -> str | None:
        found = {algo(n) for n in names if n in layers}
        if len(found) > 1:
            raise MixedShards(f"ValueError: Mixed quant_algo within fused layer {module}: {found}. All shards must "
                              "use the same quantization.")
        return found.pop() if found else None

    base, _, leaf = module.rpartition(".")
    for step in mixed["lookup"]:
        if step == "direct" and (hit := next((c for c in _candidates(module, mixed) if c in layers), None)):
            return algo(hit)
        if step == "packed" and leaf in fused and (
                found := agreed([f"{b}.{s}" for b in _candidates(base, mixed) for s in fused[leaf]])):
            return found
        if step == "children":
            for candidate in _candidates(module, mixed):
                if hit := next((k for k in layers if k.startswith(candidate + ".")), None):
                    return algo(hit)
        if step == "experts_parent" and module.endswith(".experts") and (
                hit := next((k for k in layers if k.startswith(module.rsplit(".experts", 1)[0] + ".")), None)):
            return algo(hit)
        if step == "shards" and leaf in ("qkv_proj", "gate_up_proj"):
            shards = ("q_proj", "k_proj", "v_proj") if leaf == "qkv_proj" else ("gate_proj", "up_proj")
            for candidate in _candidates(module, mixed):
                if found := agreed([f"{candidate.rsplit('.', 1)[0]}.{s}" for s in shards]):
                    return found
    return None


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet) -> Decision:
    """The scheme ``rules``' release builds ``module`` (the engine's name) with, and why."""
    values = rules.values[KEY]
    where = "MTP draft " if draft else ""
    if values.get("dispatch"):  # sglang: the config class is chosen first
        if refused := sglang_refused(qconfig, rules):
            return refused
        if draft and rules.model_class in values["bf16_drafts"] and \
                sglang_config(qconfig, values["dispatch"]) == "fp4":
            return Decision(None, f"the MTP draft of {rules.model_class} is built with no quant config under "
                                  f"modelopt_fp4 ({_cite(rules, 'bf16_drafts')})", "store the MTP draft bf16")
    elif error := config_error(qconfig, rules):
        message, cite = error
        return Decision(None, f"the ModelOpt config is refused ({cite})", "fix the quantization config", message)
    algo = quant_algo(qconfig)
    if moe and algo != MIXED and algo not in values["moe_schemes"]:  # raised for every FusedMoE, excluded or not
        return Decision(None, f"{algo} builds no FusedMoE method ({_cite(rules, 'moe_schemes')})",
                        "serve a release that builds it, or store the model's experts in another scheme",
                        f"NotImplementedError: {algo} quantization does not yet support MoE models")
    entries = exclude_entries(qconfig, rules)
    cite = _cite(rules, "match")
    try:
        how = excluded_by(module, entries, rules, moe)
    except re.error as exc:  # sglang compiles each entry as a pattern
        return Decision(None, f"an exclude entry is no valid pattern ({cite})", "fix the exclude list",
                        f"re.error: {exc}")
    except MixedShards as exc:
        return Decision(None, f"the exclude list names some of its shards only ({cite})",
                        f"list all shards of {module} or none", str(exc))
    if how:
        return Decision(None, f"{where}excluded: {how} ({cite})",
                        f"remove the exclude entries matching {module!r}, or store it bf16")
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "lm_head" and not values["lm_head"]:
        return Decision(None, f"ParallelLMHead takes no ModelOpt quant method ({_cite(rules, 'lm_head')})",
                        "store lm_head bf16 and list it in exclude_modules")
    if algo == MIXED:
        return _mixed(module, moe, qconfig, rules)
    if marker := next((m for m in values["unquantized_markers"] if m in module), None):
        return Decision(None, f"a name holding {marker!r} is built unquantized ({_cite(rules, 'unquantized_markers')})",
                        "store it bf16")
    if moe:
        return Decision(values["moe_schemes"][algo], f"{where}not excluded: its FusedMoE method for {algo} "
                                                     f"({_cite(rules, 'moe_schemes')})",
                        f"list {module!r} in the exclude list if it is stored bf16")
    return Decision(values["algos"][algo], f"{where}not excluded: built {algo} ({_cite(rules, 'algos')})",
                    f"list {module!r} in the exclude list if it is stored bf16")


def _mixed(module: str, moe: bool, qconfig: dict, rules: RuleSet) -> Decision:
    values = rules.values[KEY]
    mixed = values["mixed"]
    cite = _cite(rules, "mixed")
    inner = _nested(qconfig)
    layers = (inner if isinstance(inner, dict) else qconfig).get("quantized_layers")
    if mixed is None or not isinstance(layers, dict) or not layers:
        return Decision(None, f"MIXED_PRECISION needs quantized_layers ({cite})", "fix the quantization config",
                        "ValueError: MIXED_PRECISION quant_algo requires a non-empty 'quantized_layers' mapping")
    if mapper := class_mapper(rules):  # apply_vllm_mapper maps quantized_layers' keys too
        layers = {m: v for k, v in layers.items() if (m := mapped_entry(k, mapper)) is not None}
    try:
        algo = mixed_algo(module, layers, mixed, rules.fused("modelopt"))
    except MixedShards as exc:
        return Decision(None, f"quantized_layers gives its shards different algos ({cite})",
                        f"give all shards of {module} one quant_algo", str(exc))
    built = mixed["moe" if moe else "linear"]
    if algo is None or algo not in built:
        found = "no quantized_layers entry" if algo is None else f"quantized_layers' {algo}, which it does not build"
        return Decision(None, f"{found}: built unquantized ({cite})",
                        f"add {module!r} to quantized_layers if it is stored quantized")
    return Decision(built[algo], f"quantized_layers gives it {algo} ({cite})",
                    f"set {module!r}'s quant_algo in quantized_layers to the scheme it is stored in")
