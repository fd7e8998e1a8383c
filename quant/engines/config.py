"""What an engine release refuses or misreads in ``config.json`` itself: the Quark schema, the
exclude list's type, the router keys its model code reads, and the MTP layer count."""

from __future__ import annotations

from quant.engines.replay import Finding
from quant.engines.rules import RuleSet


def quark_findings(rules: RuleSet, qconfig: dict) -> list[Finding]:
    want = rules["quark_config"]
    findings = []

    def finding(where: str, why: str, fix: str) -> None:
        findings.append(Finding("config", rules.id, where, why, fix))

    weight = (qconfig.get("global_quant_config") or {}).get("weight") or {}
    inputs = (qconfig.get("global_quant_config") or {}).get("input_tensors")
    if want["requires_export"] and not isinstance(qconfig.get("export"), dict):
        finding("quantization_config.export", f"missing: {rules.engine}'s QuarkConfig.from_config raises",
                "add Quark's export block (quantgate writes it)")
    if weight.get("dtype") not in want["formats"]:
        finding("global_quant_config.weight", f"{rules.engine}'s Quark loader does not accept weight dtype "
                f"{weight.get('dtype')!r}", f"use one of {want['formats']} or serve with another engine")
    if want["requires_input_tensors"] and weight.get("dtype") == "fp4" and not inputs:
        finding("global_quant_config.input_tensors", f"MXFP4 weight-only (W4A16): {rules.engine}'s Quark loader needs "
                "W4A4 (an fp4 input_tensors spec)", "re-export without --weight-only")
    if want["exclude_must_be_list"] and qconfig.get("exclude") is None:
        finding("quantization_config.exclude", f"missing or null: {rules.engine} iterates it as a list (TypeError "
                "at load)", 'write "exclude": [] at least')
    return findings


def router_tensors(tensors, family, num_hidden_layers: int) -> tuple[list[str], list[str]]:
    """The checkpoint's router bias and router weight tensors, by the family's roles (computed once,
    checked per release)."""
    roles = {t: family.classify(t, num_hidden_layers).role for t in tensors}
    # a router beside a hash table (router_hash: DeepSeek-V4's tid2eid) routes by token id, no bias
    hashed = {t.rpartition(".")[0] for t, r in roles.items() if r == "router_hash"}
    return (sorted(t for t, r in roles.items() if r == "router_bias"),
            sorted(t for t, r in roles.items() if r == "router" and t.endswith(".weight")
                   and t.rpartition(".")[0] not in hashed))


def model_findings(rules: RuleSet, config: dict, routers: tuple[list[str], list[str]], num_hidden_layers: int,
                   mtp_layers: set[int], mtp_key: str = "num_nextn_predict_layers",
                   moe_present: set[int] | None = None, mtp_default: int = 0) -> list[Finding]:
    """Router keys and the tensors they imply (``routers`` from ``router_tensors``); the MTP layers
    the config promises."""
    findings = []

    def finding(where: str, why: str, fix: str) -> None:
        findings.append(Finding("config", rules.id, where, why, fix))

    router = rules["router"]
    for key in router["reads"]:
        if key not in config:
            finding(f"config.json {key}", f"{rules.engine}'s model code reads config.{key} as an attribute "
                    "(AttributeError at load unless the config class supplies it)", f"add {key!r} (the source "
                    "checkpoint's value; DeepSeek-V3 and GLM-5 use topk_method 'noaux_tc')")
    biases, routers = routers
    # bias_when: the topk_method for which the class creates e_score_correction_bias, "always", "never",
    # or "config:<key>" (created when that config key is true)
    when_key = router["bias_when"].removeprefix("config:") if router["bias_when"].startswith("config:") else None
    noaux = router["bias_when"] == "always" or (bool(config.get(when_key)) if when_key else
                                                config.get("topk_method") == router["bias_when"])
    if biases and when_key and not noaux:
        finding(biases[0], f"{len(biases)} router bias tensors but config.{when_key} is {config.get(when_key)!r}: "
                f"{rules.engine} creates the bias only when it is true (unexpected tensors at load)",
                f"set \"{when_key}\": true (the source checkpoint's value)")
    if biases and router["bias_when"] == "never":
        finding(biases[0], f"{len(biases)} e_score_correction_bias tensors but {rules.engine}'s model class creates "
                "no router bias (unexpected tensors at load)", "drop them: this family's router has no bias")
    elif biases and not noaux and not when_key:
        finding(biases[0], f"{len(biases)} e_score_correction_bias tensors but topk_method is "
                f"{config.get('topk_method')!r}: {rules.engine} creates the bias only for {router['bias_when']!r} "
                "(KeyError for the unexpected tensor at load)", f"set \"topk_method\": \"{router['bias_when']}\"")
    if noaux and len(biases) < len(routers):
        when = "the model class always creates one" if router["bias_when"] == "always" else \
            f"config.{when_key} is true" if when_key else f"topk_method {router['bias_when']!r}"
        finding("e_score_correction_bias", f"{when} but only {len(biases)} of "
                f"{len(routers)} routers have a bias tensor: the rest stay uninitialised (loads silently wrong)",
                "copy the source checkpoint's e_score_correction_bias tensors")
    findings += layer_findings(rules, config, moe_present)
    declared = int(config.get(mtp_key) or 0) if mtp_key in config else mtp_default
    if declared != len(mtp_layers):
        finding(f"config.json {mtp_key}", f"declares {declared} MTP layer(s){'' if mtp_key in config else ' (absent)'}; "
                f"the checkpoint holds {len(mtp_layers)} (draft layers {sorted(mtp_layers)}): "
                "speculative decoding loads a draft that is not there or ignores one that is",
                "make the count match the model.layers.N.* tensors")
    limit = rules["mtp_naming"]["max_layers"]
    if limit is not None and declared > limit:
        finding("config.json num_nextn_predict_layers", f"{rules.engine} asserts at most {limit} MTP layer "
                "('Only 1 nextn layer is supported') when it loads the draft", "serve without the MTP draft")
    return findings


def moe_layers_built(rules: RuleSet, config: dict) -> set[int] | None:
    """The decoder layers this release builds as MoE layers from the config, for a class whose rule
    is a step (``moe_layers: {step: KEY, zero: all|none, experts: KEY}``: MoE when (i + 1) % step == 0;
    a step of 0 means every layer or none, as the class reads it); None for other classes."""
    rule = rules.values.get("moe_layers")
    if not isinstance(rule, dict):
        return None
    layers, step = config.get("num_hidden_layers"), config.get(rule["step"], 1)
    if not isinstance(layers, int) or not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None  # the config checks name a missing or malformed key
    if step == 0:
        return set(range(layers)) if rule["zero"] == "all" and (config.get(rule["experts"]) or 0) > 0 else set()
    return {i for i in range(layers) if (i + 1) % step == 0}


def _spans(layers: set[int]) -> str:
    shown = sorted(layers)
    return "none" if not shown else ", ".join(map(str, shown[:8])) + (f", ... ({len(shown)} layers)" if len(shown) > 8 else "")


def layer_findings(rules: RuleSet, config: dict, moe_present: set[int] | None = None) -> list[Finding]:
    """Layers the release builds as MoE layers where the checkpoint's are dense, or the other way
    round: ``moe_layers: all`` against the config's dense layers (Qwen3-MoE), or a step rule against
    the layers holding routed experts (``moe_present``, from the tensors; else the config's own
    ``moe_layers`` list, as transformers builds it)."""
    rule = rules.values.get("moe_layers")
    if isinstance(rule, dict):
        built = moe_layers_built(rules, config)
        declared = moe_present if moe_present is not None else config.get("moe_layers")
        if built is None or not isinstance(declared, (list, set)) or built == set(declared):
            return []
        step = config.get(rule["step"], 1)
        return [Finding("config", rules.id, f"config.json {rule['step']}",
                        f"{rules.engine} builds MoE layers {_spans(built)} from {rule['step']} {step} "
                        f"({rules.cites['moe_layers'].split(' (')[0]}); the checkpoint's routed experts are in layers "
                        f"{_spans(set(declared))}: the other layers' weights have no module to load into (load fails)",
                        f"set {rule['step']} to the release's value (its routed experts every N-th layer)")]
    if rule != "all":
        return []
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not dense and step in (1, None):
        return []
    return [Finding("config", rules.id, "config.json mlp_only_layers",
                    f"declares dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}) but {rules.engine} "
                    f"builds every layer MoE ({rules.cites['moe_layers'].split(' (')[0]}): the dense layers' MLP weights "
                    "are skipped and their experts never loaded (loads silently wrong)",
                    "serve with vLLM, which honours mlp_only_layers and decoder_sparse_step")]


def engine_layer_kinds(rules: RuleSet, config: dict, num_hidden_layers: int) -> tuple[list[str] | None, str]:
    """The attention kind the release builds each decoder layer with (``layer_kinds``: from an
    interval key, or a per-layer list falling back to the interval), or None and why it cannot."""
    rule = rules["layer_kinds"]
    listed = config.get(rule["key"]) if rule["from"] == "list" else None
    if isinstance(listed, list):
        return [str(k) for k in listed], f"config.{rule['key']}"
    key = rule["key"] if rule["from"] == "interval" else rule["interval_key"]
    interval = config.get(key, rule.get("interval_default"))
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        return None, f"config.{key} is {interval!r}"
    return [rule["full"] if (layer + 1) % interval == 0 else rule["linear"] for layer in range(num_hidden_layers)], \
        f"config.{key} {interval}"


def layer_kind_findings(rules: RuleSet, config: dict, family, roles_by_layer: dict[int, set[str]],
                        num_hidden_layers: int) -> list[Finding]:
    """Decoder layers whose attention tensors are not the kind this release builds them as (a hybrid
    family: Qwen3-Next's linear_attn / self_attn layers), ``roles_by_layer`` from the checkpoint."""
    if not family.layer_kinds or not rules.values.get("layer_kinds"):
        return []
    role_of = dict(family.layer_kinds)
    kinds, source = engine_layer_kinds(rules, config, num_hidden_layers)
    if kinds is None:
        return [Finding("config", rules.id, f"config.json {source.split()[0].removeprefix('config.')}",
                        f"{source}: {rules.engine} computes each layer's attention kind from it "
                        f"({rules.cites['layer_kinds'].split(' (')[0]}; AttributeError or a wrong layout at load)",
                        "write the release's value (Qwen3-Next: full_attention_interval 4)")]
    if len(kinds) < num_hidden_layers:
        return [Finding("config", rules.id, "config.json layer_types", f"{len(kinds)} entries for {num_hidden_layers} "
                        "layers: the engine indexes it per layer (IndexError at load)", "list one kind per layer")]
    builds = rules["layer_kinds"].get("builds")
    unbuilt = sorted({kind for kind in kinds[:num_hidden_layers] if builds is not None and kind not in builds})
    if unbuilt:
        return [Finding("config", rules.id, f"config.json {rules['layer_kinds']['key']}",
                        f"names {', '.join(unbuilt)}, a layer kind {rules.engine} does not build "
                        f"({rules.cites['layer_kinds'].split(' (')[0]}; KeyError at load)",
                        f"write the kind as this release names it ({', '.join(builds)})")]
    wrong = [(layer, kinds[layer], sorted(have)) for layer, have in sorted(roles_by_layer.items())
             if layer < num_hidden_layers and have and role_of.get(kinds[layer]) not in have]
    if not wrong:
        return []
    layer, kind, have = wrong[0]
    return [Finding("config", rules.id, f"model.layers.{layer}", f"{rules.engine} builds it as {kind} ({source}) but its "
                    f"attention tensors are {', '.join(have)}: they would not load ({len(wrong)} layer(s))",
                    f"make config.json's layer kinds ({rules['layer_kinds']['key']}) match the checkpoint's layers")]
