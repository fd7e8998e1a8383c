"""Quantization recipes as data: which roles are quantized, in which layers, with which scale rule.

A recipe is ``manifests/recipes/<name>.yaml``; CLI policy flags become rules put in front of
the recipe's own, so the recorded recipe in the conversion manifest says exactly what was done.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, field_validator

from quant.errors import QuantgateError
from quant.formats.codecs import CODECS
from quant.formats.constants import ScaleRule
from quant.layout import Family, TensorRole, known_families, manifests_root
from quant.rungs import RUNGS
from quant.schema import Schema, load, nearest

ACTIONS = ("quantize", "keep")


class RecipeError(QuantgateError, ValueError):
    """A recipe that cannot be used as written; the message names the file and what to fix."""


def _known_format(fmt: str) -> str:
    if fmt not in CODECS:
        raise ValueError(nearest(fmt, CODECS, "format"))
    return fmt


def _known_rule_format(fmt: str | None) -> str | None:
    """A rule's format: a codec (``--to`` name) or a ladder rung (``quant.rungs``: mxfp4_fp8, bf16, ...)."""
    if fmt is not None and fmt not in CODECS and fmt not in RUNGS:
        raise ValueError(nearest(fmt, sorted({*CODECS, *RUNGS}), "format"))
    return fmt


class RuleEntry(Schema):
    """One recipe rule as written: ``{role: routed_expert, layers: [1], action: quantize, format: fp8}``."""
    role: str
    action: Literal[ACTIONS]
    mtp: bool | None = None  # None: any layer; true: the MTP (next-n) layer only; false: the main layers only
    layers: list[int] | None = None  # None: every layer; else the decoder layer indices (model.layers.N) it applies to
    # None: the recipe's own format; else a rung of the precision ladder (quant.rungs: mxfp4, mxfp4_fp8, fp8,
    # bf16), which only an mxfp4 recipe mixes (Quark's layer_quant_config)
    format: str | None = None
    # true: the rule applies only where the family lets the role be quantized (its engines build it with the
    # quant config); elsewhere the tensor is kept, where a plain rule would be refused
    quantizable_only: bool = False

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str, info: ValidationInfo) -> str:
        """A role no family gives a tensor would match nothing: a misspelt role must not pass silently."""
        roles = (info.context or {}).get("roles")
        if roles is not None and role not in roles:
            raise ValueError(nearest(role, sorted(roles), "role"))
        return role

    _format = field_validator("format")(_known_rule_format)


class RecipeFile(Schema):
    """A recipe as written (``manifests/recipes/*.yaml``)."""
    name: str | None = None  # the file's stem when absent
    format: str
    format_fixed: bool = False  # the recipe is for its format only (no ``--to`` of the same family)
    scale_rule: Literal[tuple(r.value for r in ScaleRule)] = ScaleRule("even").value
    activations: Literal["dynamic", "none"] = "dynamic"  # dynamic: W4A4; none: weight only (W4A16)
    rules: list[RuleEntry] | None = None  # tried in order, first match wins

    _format = field_validator("format")(_known_format)


def recipe_roles(family: Family | None = None) -> set[str]:
    """The roles a recipe rule may name: every discovered family's, ``family``'s (a manifest given
    by hand), and ``other`` (a tensor no role pattern matched)."""
    return {role.name for f in [*known_families(), *([family] if family else [])] for role in f.roles} | {"other"}


@dataclass(frozen=True)
class Rule:
    role: str
    action: str
    mtp: bool | None = None  # None: any layer
    quantizable_only: bool = False
    layers: tuple[int, ...] | None = None  # None: any layer
    format: str | None = None  # a rung (quant.rungs); None: the recipe's format

    def matches(self, role: TensorRole) -> bool:
        return self.role == role.role and (self.mtp is None or self.mtp == role.mtp) and \
            (role.quantizable or not self.quantizable_only) and (self.layers is None or role.layer in self.layers)


@dataclass(frozen=True)
class Recipe:
    name: str
    format: str
    scale_rule: ScaleRule
    weight_only: bool
    rules: tuple[Rule, ...] = field(default_factory=tuple)

    def action(self, role: TensorRole) -> str:
        return "keep" if self.rung(role) == "bf16" else "quantize"

    def rung(self, role: TensorRole) -> str:
        """The rung (``quant.rungs.RUNGS``) of a tensor: ``bf16`` where kept, else its rule's format or the
        recipe's own (a block-FP8 recipe's ``fp8`` is the codec, not the per-tensor rung: see ``mixed``)."""
        for rule in self.rules:
            if rule.matches(role):
                return "bf16" if rule.action == "keep" else rule.format or self.format
        return "bf16"

    @property
    def mixed(self) -> bool:
        """Whether some rule asks for another quantized rung than the recipe's format (Quark layer_quant_config)."""
        return any(r.action == "quantize" and r.format not in (None, "bf16", self.format) for r in self.rules)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["scale_rule"] = self.scale_rule.value
        return data


def load_recipe(path: Path | None = None, to: str | None = None, family: Family | None = None) -> Recipe:
    """The recipe at ``path``, or the default one for target format ``to`` (mxfp4 if neither);
    ``family``: a family manifest given by hand, whose roles a rule may name too.

    MX recipes are format-agnostic in what they quantize: ``--to mxfp6_e2m3`` with the default
    recipe quantizes the same roles to MXFP6. Only an mxfp4 recipe mixes formats, with the precision
    ladder's rungs (``quant.rungs``: Quark's layer_quant_config, which both engines read per layer).
    """
    path = path or manifests_root() / "recipes" / f"{CODECS[to or 'mxfp4'].default_recipe}.yaml"
    data = load(path, RecipeFile, "recipe", RecipeError,
                f"compare it with {manifests_root() / 'recipes' / 'mxfp4-w4a4-experts.yaml'}",
                {"roles": recipe_roles(family)})
    fmt = data.format
    if to and fmt != to and (CODECS[fmt].family != CODECS[to].family or data.format_fixed):
        raise RecipeError(f"{path}: a {fmt} recipe cannot produce --to {to}")
    fmt = to or fmt
    for i, raw in enumerate(data.rules or []):
        if raw.format == "bf16" and raw.action == "quantize":
            raise RecipeError(f"{path}: rules.{i}: format bf16 with action quantize; write action: keep")
        if (raw.format or fmt) != fmt and raw.format != "bf16" and (fmt != "mxfp4" or raw.format not in RUNGS):
            raise RecipeError(f"{path}: rules.{i}: asks for {raw.format} in a {fmt} checkpoint. Only an mxfp4 recipe "
                              f"mixes formats, with the ladder's rungs ({', '.join(RUNGS)}); convert the whole "
                              "checkpoint to one format")
    return Recipe(
        name=data.name or path.stem,
        format=fmt,
        scale_rule=ScaleRule(data.scale_rule),
        weight_only=data.activations == "none",
        rules=tuple(Rule(raw.role, "keep" if raw.format == "bf16" else raw.action, raw.mtp, raw.quantizable_only,
                         tuple(raw.layers) if raw.layers is not None else None, raw.format)
                    for raw in data.rules or []),
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
