"""sglang's shared-expert fusion: whether a release folds the shared expert into the routed FusedMoE
(as expert ``n_routed_experts``), decided as the release decides it, per model (the main model and
the MTP draft are separate runners).

Fused, the shared expert's weights are copied into the FusedMoE's expert slot, which is built by
the routed experts' scheme: a bf16 shared expert cannot load into an MXFP4 slot, nor an MXFP4 one
into a bf16 slot. The rule data is ``shared_experts_fusion`` in ``manifests/engines/sglang.yaml``;
vLLM's fusion (ROCm AITER, opt-in by environment variable) checks each layer's schemes itself
(vLLM 0.33.0 ``fused_moe/utils.py: resolve_layer_fused_shared_expert``), so it has no rule here.
"""

from __future__ import annotations

from quant.engines.quark_layers import per_layer
from quant.engines.quark_layers_sglang import shared_fusion_reason
from quant.engines.rules import RuleSet
from quant.engines.serving import Serving, capabilities
from quant.layout import Family

_MAPPER_61 = ("model.layers.61", "model.decoder")  # sglang DeepseekV3ForCausalLMNextN.hf_to_sglang_mapper


def map_61(entry: str) -> str:
    """An exclude entry as the DeepSeek-V3 draft class's hf_to_sglang_mapper renames it."""
    return entry.replace(*_MAPPER_61, 1) if _MAPPER_61[0] in entry else entry


def _vetoes(rules: RuleSet, entries: list[str], config: dict) -> list[str]:
    """The exclude entries that make QuarkConfig.can_fuse_shared_expert False (each keeps a shared
    expert unquantized); empty when the release fuses regardless."""
    how = rules["shared_experts_fusion"]["exclude_veto"]
    if how == "none":
        return []
    base = config.get("num_hidden_layers")
    nextn = int(config.get("num_nextn_predict_layers") or 0)
    draft_prefixes = tuple(f"model.layers.{base + i}." for i in range(nextn)) if isinstance(base, int) else ()

    def draft_layer(entry: str) -> bool:
        return entry.startswith("mtp.") or (how == "draft_layers" and entry.startswith(draft_prefixes))

    return [e for e in entries if "shared_expert" in e and "shared_expert_gate" not in e and not draft_layer(e)]


def loader_mapped(entries: list[str], rules: RuleSet, family: str) -> list[str]:
    """The exclude list the draft runner's quant config holds when fusion is decided: the loader has
    applied the draft class's hf_to_sglang_mapper (model_loader/loader.py: _get_quantization_config),
    not yet the class's own _resolve_nextn_quant_config."""
    if rules["draft_exclude"].get(family, "none").startswith("mapper_61"):
        return [map_61(e) for e in entries]
    return list(entries)


def no_fusion_reason(rules: RuleSet, family: str, config: dict, kind: str, entries: list[str], serving: Serving,
                     draft: bool, qconfig: dict | None = None) -> str | None:
    """None when the release fuses the shared expert of this model (main or draft); else why not,
    in the engine's terms. ``entries``: the exclude list this runner's quant config holds; ``qconfig``: the
    quantization_config, whose per-layer specs a Quark release compares at the layers it probes."""
    if not rules.values.get("shared_experts_fusion"):
        return "no shared-expert fusion in this engine or model class"
    rule = rules["shared_experts_fusion"]
    if serving.disable_shared_experts_fusion:
        return "--disable-shared-experts-fusion"
    if rule["decided_by"] == "can_fuse_shared_expert":
        return _qwen2_moe_reason(rules, config, kind, entries, serving, qconfig)
    vetoes = _vetoes(rules, entries, config) if rule["decided_by"] == "shared_experts_fusion_disable_reason" and \
        kind == "quark" else []
    if vetoes:
        return (f"the exclude list keeps shared experts unquantized ({vetoes[0]!r}; quark.py: "
                "can_fuse_shared_expert)")
    if rule["decided_by"] == "shared_experts_fusion_disable_reason" and (veto := _spec_veto(rules, kind, qconfig)):
        return veto
    architectures = config.get("architectures") or [None]
    if rule["arch"] is None:  # the class compares no architecture (and no expert counts beyond a shared one)
        pass
    elif draft:
        arch = rule["draft_arch"].get(family)
        if arch is None or arch["config"] != arch["class"]:
            return f"the draft class compares {arch and arch['class']!r}, the draft config says {arch and arch['config']!r}"
    elif architectures[0] != rule["arch"].get(family):
        return f"architecture {architectures[0]!r} is not {rule['arch'].get(family)!r}"
    routed, shared = config.get("n_routed_experts"), config.get("n_shared_experts")
    if rule["routed_experts"] == "any":  # num_fusable_shared_experts: n_shared_experts or 0
        if not shared:
            return "the model has no shared expert"
    else:
        needs = rule["routed_experts"].get(routed)
        if needs is None or (needs != "any" and needs != kind) or shared != rule["shared_experts"]:
            return f"{routed} routed + {shared} shared experts is not a fused configuration"
    if serving.platform not in rule["min_capability"]:  # the class never fuses on this platform
        return f"the class fuses only on {', '.join(sorted(rule['min_capability']))}"
    least = tuple(rule["min_capability"][serving.platform])
    if serving.capability < least:
        return f"{serving.gpu_arch} is below capability {least}"
    ep_least = rule["ep_min_capability"].get(serving.platform)
    if serving.ep > 1 and (ep_least is None or serving.capability < tuple(ep_least)):
        return f"expert parallelism on {serving.platform} {serving.gpu_arch}"
    return None


def _spec_veto(rules: RuleSet, kind: str | None, qconfig: dict | None) -> str | None:
    """can_fuse_shared_expert's comparison of a per-layer Quark config's routed and shared expert specs at the
    layers the release probes (``quark_layers`` rules, on rule sets cut for a per-layer checkpoint)."""
    if kind != "quark" or not per_layer(qconfig) or not rules.values.get("quark_layers"):
        return None
    reason = shared_fusion_reason(qconfig, rules)
    return reason and f"{reason} (quark.py: can_fuse_shared_expert)"


def main_model_fusion(rules: RuleSet, family: Family, config: dict, kind: str | None, entries: list[str],
                      serving: Serving, qconfig: dict | None = None) -> tuple[int, str]:
    """How many shared experts this release folds into the main model's routed FusedMoE (0 when it
    does not) and the decision in words: the one answer ``gate checkpoint`` replays and ``gate
    kernels`` sizes the MoE by. ``config``: config.json (the family reads its text config from it);
    ``entries``: the exclude list as the release matches it."""
    text = family.text_config(config)
    reason = no_fusion_reason(rules, family.name, text, kind, entries, serving, draft=False, qconfig=qconfig)
    if reason is not None:
        return 0, f"not fused ({rules.id}): {reason}"
    shared = text.get("n_shared_experts") or 1  # a Qwen2-MoE-style block has one (get_num_shared_experts)
    routed = next((text[k] for k in family.experts_keys if k in text), None)
    return shared, f"fused as expert {routed} (topk + {shared}; {rules.id})"


def _qwen2_moe_reason(rules: RuleSet, config: dict, kind: str, entries: list[str], serving: Serving,
                      qconfig: dict | None = None) -> str | None:
    """sglang's Qwen2-MoE block decision (Qwen3-Next): on the platforms the class fuses on, one
    shared expert (get_num_shared_experts) of the routed experts' size, and a quant config whose
    can_fuse_shared_expert does not veto (Quark: no excluded shared expert; FP8 has no such hook)."""
    rule = rules["shared_experts_fusion"]
    if serving.platform not in rule["platforms"]:
        return f"the class fuses only on {', '.join(rule['platforms'])}"
    size, moe = config.get("shared_expert_intermediate_size") or 0, config.get("moe_intermediate_size")
    shared = config.get("n_shared_experts")
    if (shared if shared is not None else int(size > 0)) <= 0 or size <= 0:
        return "the model has no shared expert"
    if size != moe:
        return f"shared_expert_intermediate_size {size} is not moe_intermediate_size {moe}"
    vetoes = _vetoes(rules, entries, config) if kind == "quark" else []
    if vetoes:
        return (f"the exclude list keeps shared experts unquantized ({vetoes[0]!r}; quark.py: "
                "can_fuse_shared_expert)")
    return _spec_veto(rules, kind, qconfig)


def fusing_gpus(rules: RuleSet) -> str:
    """Where this release's class fuses (tensor parallel, fusion on), in GPU names: the least capability
    per platform (``min_capability``) or, for Qwen2-MoE-style blocks, the platforms it fuses on."""
    rule = rules["shared_experts_fusion"]
    if rule["decided_by"] == "can_fuse_shared_expert":
        names = {"rocm": "ROCm with aiter", "cuda": "CUDA"}
        return ", ".join(names[p] for p in rule["platforms"])
    named = []
    for platform, least in sorted(rule["min_capability"].items(), reverse=True):  # rocm first: the target
        archs = [arch for arch, cap in capabilities()[platform].items() if cap >= tuple(least)]
        named.append(f"{'ROCm' if platform == 'rocm' else 'CUDA'} {archs[0]}+" if archs else None)
    return ", ".join(n for n in named if n)


def cite(rules: RuleSet) -> str:
    rule = rules["shared_experts_fusion"]
    return f"{rule.get('file', 'deepseek_v2.py')}: {rule['decided_by']}"
