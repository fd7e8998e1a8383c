"""How sglang builds a module of a Quark checkpoint with per-layer schemes (``quant.engines.quark_layers``)."""

from __future__ import annotations

from quant.engines.format_rules import Decision
from quant.engines.rules import RuleSet
from quant.schema import Schema


class RULES(Schema):
    """The rule fields of manifests/engines/quark_layers.sglang.yaml (each a ``rule_kinds.Rule``)."""


def decide(module: str, *, moe: bool, draft: bool, qconfig: dict, rules: RuleSet,
           members: tuple[str, ...] = ()) -> Decision:
    return Decision(None, "not read yet", unread=f"sglang's per-layer Quark schemes")
