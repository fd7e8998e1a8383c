"""How each engine release builds the modules of a Quark checkpoint with per-layer schemes (a non-empty
``layer_quant_config`` or ``layer_type_quant_config``: a mixed checkpoint of the precision ladder,
``quant.rungs``): which rung each module it quantizes gets, or that it raises building it.

The exclude list is matched as for any Quark checkpoint (``quant.engines.replay.excluded``); a module it
leaves quantized is decided here, per engine by its own module (``quark_layers_vllm``,
``quark_layers_sglang``), each with its rules in ``manifests/engines/quark_layers.<engine>.yaml`` (spans of
their own: ``quant.engines.format_rules``, kind ``quark-layers``).
"""

from __future__ import annotations

from quant.engines import quark_layers_sglang, quark_layers_vllm
from quant.engines.format_rules import Decision
from quant.engines.rules import RuleSet

KIND = "quark-layers"  # the format_rules kind: rule files quark_layers.<engine>.yaml, cut rule sets' values key
KEY = "quark_layers"
_ENGINES = {"vllm": quark_layers_vllm, "sglang": quark_layers_sglang}


class RULES(quark_layers_vllm.RULES, quark_layers_sglang.RULES):
    """Both engines' rule fields (each engine's file states its own)."""


def per_layer(qconfig) -> bool:
    """Whether a Quark config gives some modules their own scheme (the replay then asks ``decide``)."""
    return isinstance(qconfig, dict) and any(qconfig.get(k) for k in ("layer_quant_config", "layer_type_quant_config"))


def key_findings(rules: RuleSet, qconfig: dict, roles: dict[str, str]) -> list:
    """A config finding for each ``layer_quant_config`` key that selects no module in this release (where the
    engine's module says which names it asks: ``unmatched_keys``); ``roles``: checkpoint Linear -> its role."""
    from quant.engines.replay import Finding  # here: the replay imports this module

    unmatched = getattr(_ENGINES[rules.engine], "unmatched_keys", None)
    if unmatched is None or not isinstance(qconfig.get("layer_quant_config"), dict):
        return []
    return [Finding("config", rules.id, f"layer_quant_config[{key!r}]",
                    f"matches no module {rules.engine} asks for a scheme (a FusedMoE is asked by its own name "
                    "...mlp.experts, a fused module by its shards' names): the spec applies to nothing",
                    "key it by a name the engine asks (e.g. 'model.layers.N.mlp.experts*' for a layer's experts)")
            for key in unmatched(qconfig, roles, rules)]


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           members: tuple[str, ...] = ()) -> Decision:
    """The rung (``quant.rungs``) release ``rules`` builds engine module ``module`` with, a module the exclude
    list leaves quantized. ``members``: the engine's names of the checkpoint modules loaded into it (a
    FusedMoE's per-expert projections, a fused module's shards)."""
    return _ENGINES[rules.engine].decide(module, moe=moe, draft=draft, qconfig=qconfig, rules=rules, members=members)
