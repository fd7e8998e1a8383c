"""Quantization recipes as data: which roles are quantized, in which layers, with which scale rule.

A recipe is ``manifests/recipes/<name>.yaml``; CLI policy flags become rules put in front of
the recipe's own, so the recorded recipe in the conversion manifest says exactly what was done.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from quant.formats.codecs import CODECS
from quant.formats.constants import ScaleRule
from quant.layout import TensorRole, manifests_root, read_yaml_mapping

ACTIONS = ("quantize", "keep")


class RecipeError(ValueError):
    pass


@dataclass(frozen=True)
class Rule:
    role: str
    action: str
    mtp: bool | None = None  # None: any layer

    def matches(self, role: TensorRole) -> bool:
        return self.role == role.role and (self.mtp is None or self.mtp == role.mtp)


@dataclass(frozen=True)
class Recipe:
    name: str
    format: str
    scale_rule: ScaleRule
    weight_only: bool
    rules: tuple[Rule, ...] = field(default_factory=tuple)

    def action(self, role: TensorRole) -> str:
        for rule in self.rules:
            if rule.matches(role):
                return rule.action
        return "keep"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["scale_rule"] = self.scale_rule.value
        return data


def load_recipe(path: Path | None = None, to: str | None = None) -> Recipe:
    """The recipe at ``path``, or the default one for target format ``to`` (mxfp4 if neither).

    MX recipes are format-agnostic in what they quantize: ``--to mxfp6_e2m3`` with the default
    recipe quantizes the same roles to MXFP6. A recipe may not mix formats per role: no
    engine is known here to load that (sglang's Quark loader takes fp4 only).
    """
    path = path or manifests_root() / "recipes" / f"{CODECS[to or 'mxfp4'].default_recipe}.yaml"
    data = read_yaml_mapping(path, "recipe", RecipeError)
    fmt = data.get("format")
    if not isinstance(fmt, str) or fmt not in CODECS:
        raise RecipeError(f"{path}: format {fmt!r} is not supported (supported: {', '.join(CODECS)})")
    if to and fmt != to and (CODECS[fmt].family != CODECS[to].family or data.get("format_fixed")):
        raise RecipeError(f"{path}: a {fmt} recipe cannot produce --to {to}")
    fmt = to or fmt
    rules = []
    if not isinstance(data.get("rules") or [], list):
        raise RecipeError(f"{path}: rules must be a list of {{role, action}} mappings")
    for raw in data.get("rules") or []:
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise RecipeError(f"{path}: rule {raw!r} is not a mapping with a role; write rules as "
                              "{role: routed_expert, action: quantize}")
        if raw.get("action") not in ACTIONS:
            raise RecipeError(f"{path}: rule {raw} needs action one of {ACTIONS}")
        if raw.get("format", fmt) != fmt:
            raise RecipeError(f"{path}: rule {raw} asks for {raw['format']} in a {fmt} checkpoint. Mixed formats are "
                              "refused: sglang's Quark loader accepts only fp4, and vLLM's per-layer Quark configs "
                              "are not proven here; convert the whole checkpoint to one format")
        rules.append(Rule(raw["role"], raw["action"], raw.get("mtp")))
    activations = data.get("activations", "dynamic")
    if activations not in ("dynamic", "none"):
        raise RecipeError(f"{path}: activations must be 'dynamic' (W4A4) or 'none' (W4A16), got {activations!r}")
    try:
        scale_rule = ScaleRule(data.get("scale_rule", "even"))
    except ValueError:
        raise RecipeError(f"{path}: scale_rule {data.get('scale_rule')!r} is not one of "
                          f"{[r.value for r in ScaleRule]}") from None
    return Recipe(
        name=data.get("name", path.stem),
        format=fmt,
        scale_rule=scale_rule,
        weight_only=activations == "none",
        rules=tuple(rules),
    )


def with_overrides(recipe: Recipe, *, shared_experts: str | None = None, mtp_experts: str | None = None,
                   weight_only: bool | None = None, scale_rule: str | None = None) -> Recipe:
    """Apply the CLI's policy flags; each becomes a rule ahead of the recipe's own."""
    to_action = {"bf16": "keep", "mxfp4": "quantize", "quantize": "quantize"}
    extra: list[Rule] = []
    if mtp_experts:
        extra.append(Rule("routed_expert", to_action[mtp_experts], mtp=True))
    if shared_experts:
        extra.append(Rule("shared_expert", to_action[shared_experts]))
    return Recipe(
        name=recipe.name,
        format=recipe.format,
        scale_rule=ScaleRule(scale_rule) if scale_rule else recipe.scale_rule,
        weight_only=recipe.weight_only if weight_only is None else weight_only,
        rules=tuple(extra) + recipe.rules,
    )
