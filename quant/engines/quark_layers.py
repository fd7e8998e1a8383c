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


class Namings:
    """The engines' names of a checkpoint's Linear modules (``replay.draft_name``: the class's prefixes, the MTP
    draft's naming), computed once per distinct naming: what a ``layer_quant_config`` key is matched against."""

    def __init__(self, roles: dict[str, str], num_hidden_layers: int, family: str):
        self.roles, self.num_hidden_layers, self.family = roles, num_hidden_layers, family
        self._memo: dict[str, dict[str, str]] = {}
        self._renamed: set[str] | None = None
        self._unmatched: dict[str, list[str]] = {}  # per naming, mapper and matching rule: the keys matching none

    def names(self, rules: RuleSet) -> dict[str, str]:
        """Engine name -> role, for the modules ``rules``'s release loads."""
        # imported here: the replay imports this module
        from quant.engines.replay import draft_name

        naming = repr((rules["mtp_naming"], rules.values.get("module_names")))
        if naming not in self._memo:
            self._memo[naming] = {n: role for m, role in self.roles.items()
                                  if (n := draft_name(m, rules, self.num_hidden_layers))}
        return self._memo[naming]

    def renamed(self) -> set[str]:
        """Names some release gives a module other than its checkpoint name (sglang's ``model.decoder.*`` for
        the MTP layer): quantize writes a key for each, which the other releases never ask."""
        from quant.engines.rules import select

        if self._renamed is None:
            self._renamed = {n for rules in select("all", self.family) for n in self.names(rules)} - set(self.roles)
        return self._renamed

    def unmatched(self, rules: RuleSet, qconfig: dict, find) -> list[str]:
        """``find(qconfig, names, rules, renamed)`` once per distinct naming, mapper and rule values (a full-size
        checkpoint has thousands of names, the window tens of rule sets)."""
        memo = repr((rules.engine, rules["mtp_naming"], rules.values.get("module_names"),
                     rules.values.get("exclude_mapper"), rules.values.get(KEY)))
        if memo not in self._unmatched:
            self._unmatched[memo] = find(qconfig, self.names(rules), rules, self.renamed())
        return self._unmatched[memo]


def key_findings(rules: RuleSet, qconfig: dict, namings: Namings) -> list:
    """A config finding for each ``layer_quant_config`` key that selects no module in this release (where the
    engine's module says which names it asks: ``unmatched_keys``), a key for another release's name of a
    module (its draft alias) left alone."""
    from quant.engines.replay import Finding  # here: the replay imports this module

    unmatched = getattr(_ENGINES[rules.engine], "unmatched_keys", None)
    if unmatched is None or not isinstance(qconfig.get("layer_quant_config"), dict):
        return []
    return [Finding("config", rules.id, f"layer_quant_config[{key!r}]",
                    f"matches no module {rules.engine} asks for a scheme (a FusedMoE is asked by its own name "
                    "...mlp.experts, a fused module by its shards' names): the spec applies to nothing",
                    "key it by a name the engine asks (e.g. 'model.layers.N.mlp.experts*' for a layer's experts)")
            for key in namings.unmatched(rules, qconfig, unmatched)]


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           members: tuple[str, ...] = (), family: str = "", num_hidden_layers: int = 0) -> Decision:
    """The rung (``quant.rungs``) release ``rules`` builds engine module ``module`` with, a module the exclude
    list leaves quantized. ``members``: the engine's names of the checkpoint modules loaded into it (a
    FusedMoE's per-expert projections, a fused module's shards); ``family``, ``num_hidden_layers``: how sglang's
    MTP draft class renames the config's keys (``quark_layers_sglang.draft_keys``)."""
    extra = {"draft_keys": quark_layers_sglang.draft_keys(rules, family, num_hidden_layers)} \
        if rules.engine == "sglang" and draft else {}
    return _ENGINES[rules.engine].decide(module, moe=moe, draft=draft, qconfig=qconfig, rules=rules, members=members,
                                         **extra)
