"""The precision ladder: which rung (``quant.rungs.LADDER``) each (decoder layer, role) unit gets.

A measured sensitivity pass (``quant.sensitivity``'s sidecar) gives, per unit and rung, the relative error
of that decoder layer's output with only that role's Linears at the rung, and the unit's weight bytes at
each rung. Starting from a recipe (every unit it quantizes at its rung, usually MXFP4 W4A4), the ladder
lifts the unit with the largest error one rung at a time (W4A4 -> W4A8 -> W8A8 -> bf16, skipping rungs a
target engine release does not build for that role) until the budget holds:

- an error budget: no unit's error above it (default: the largest error any unit shows at W8A8, i.e. no
  layer worse than a whole-model FP8 conversion's worst one, which the gate passes on the example);
- a byte budget: the units' weights together at most that many bytes; with no error budget given the
  ladder spends it on the most sensitive units first.

The choice is a mixed recipe (rules with ``layers`` and ``format`` ahead of the start recipe's own), which
the converter writes like any other; the choice and its measurements go in the conversion manifest
(``record``), and ``gate release`` prints ``describe``'s line of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from quant.errors import QuantgateError
from quant.layout import TensorRole
from quant.recipe import Recipe, Rule
from quant.rungs import LADDER, RUNGS

KEPT = "bf16"


class LadderError(QuantgateError, ValueError):
    """The budget cannot hold, or the sidecar cannot be used with this source; the message says what to change."""


@dataclass(frozen=True)
class Unit:
    """One (decoder layer, role) unit as the sensitivity pass measured it."""
    layer: int
    role: str
    mtp: bool
    error: dict[str, float]  # rung -> relative L2 error of the layer's output (bf16: 0 by definition)
    bytes: dict[str, int]  # rung -> stored bytes of the unit's Linear weights (and scales)

    @property
    def key(self) -> tuple[int, str, bool]:
        return self.layer, self.role, self.mtp

    @property
    def name(self) -> str:
        return f"{'MTP ' if self.mtp else ''}layer {self.layer} {self.role}"

    def error_at(self, rung: str) -> float:
        return 0.0 if rung == KEPT else self.error[rung]


@dataclass(frozen=True)
class Budget:
    error: float | None = None  # no unit's error above this
    bytes: int | None = None  # the units' bytes together at most this


def units_of(sidecar: dict, source: str = "the sensitivity file") -> list[Unit]:
    """The units of a loaded sidecar (``quant.sensitivity.load_sensitivity``), each with an error for
    every quantized rung it lists and bytes for every rung; anything missing is refused, naming it."""
    units = []
    for i, raw in enumerate(sidecar.get("units") or []):
        try:
            unit = Unit(int(raw["layer"]), str(raw["role"]), bool(raw.get("mtp", False)),
                        {k: float(v) for k, v in raw["error"].items()}, {k: int(v) for k, v in raw["bytes"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LadderError(f"{source}: units[{i}] is not a measured unit ({exc!r}); rerun the sensitivity pass "
                              "(quantize --ladder --calibration DATA)") from None
        missing = [r for r in LADDER if r not in unit.bytes or (r != KEPT and r not in unit.error)]
        if missing:
            raise LadderError(f"{source}: units[{i}] ({unit.name}) has no measurement for {', '.join(missing)}; "
                              "rerun the sensitivity pass")
        units.append(unit)
    if not units:
        raise LadderError(f"{source}: no measured units; rerun the sensitivity pass on the source checkpoint")
    return units


def start_rung(recipe: Recipe, unit: Unit) -> str:
    """The rung ``recipe`` gives the unit's Linears (``bf16`` where it keeps them)."""
    return recipe.rung(TensorRole(unit.role, linear=True, quantizable=True, layer=unit.layer, mtp=unit.mtp))


def default_error_budget(units: list[Unit]) -> float:
    """The largest error any unit shows at W8A8: no layer worse than a whole-model FP8 conversion's worst."""
    return max(u.error_at("fp8") for u in units)


@dataclass(frozen=True)
class Choice:
    unit: Unit
    start: str
    rung: str

    @property
    def error(self) -> float:
        return self.unit.error_at(self.rung)

    @property
    def nbytes(self) -> int:
        return self.unit.bytes[self.rung]


def choose(units: list[Unit], start: Recipe, budget: Budget,
           allowed: Callable[[str, str], bool] = lambda role, rung: True) -> list[Choice]:
    """Per unit the rung: the start recipe's, lifted one rung at a time, the most erring unit first, until
    ``budget`` holds. ``allowed(role, rung)``: whether the served releases build ``rung`` for ``role``
    (bf16 always loads). Units the start recipe keeps bf16 stay bf16. Refuses (``LadderError``) a budget
    that cannot hold, naming the units in the way."""
    def lifted(choice: Choice) -> Choice | None:
        higher = LADDER[LADDER.index(choice.rung) + 1:]
        rung = next((r for r in higher if r == KEPT or allowed(choice.unit.role, r)), None)
        return replace(choice, rung=rung) if rung and choice.rung != KEPT else None

    choices = {}
    for u in units:  # a start rung the served releases do not build is lifted to the next one they do
        first = Choice(u, start_rung(start, u), start_rung(start, u))
        choices[u.key] = first if first.rung == KEPT or allowed(u.role, first.rung) else lifted(first)

    def total() -> int:
        return sum(c.nbytes for c in choices.values())

    if budget.bytes is not None and total() > budget.bytes:
        raise LadderError(f"--byte-budget {budget.bytes}: the start recipe's units alone take {total()} bytes; "
                          f"raise the budget, or start from a cheaper --recipe")
    while True:
        wanted = [c for c in choices.values() if budget.error is None or c.error > budget.error]
        steps = [(c, up) for c in wanted if (up := lifted(c))
                 and (budget.bytes is None or total() - c.nbytes + up.nbytes <= budget.bytes)]
        if not steps:
            break
        current, up = max(steps, key=lambda step: (step[0].error, -step[0].unit.layer))
        choices[current.unit.key] = up
    over = [c for c in choices.values() if budget.error is not None and c.error > budget.error]
    if over:
        worst = sorted(over, key=lambda c: -c.error)[:4]
        named = ", ".join(f"{c.unit.name} at {RUNGS[c.rung].label} ({c.error:.4g})" for c in worst)
        why = f"--byte-budget {budget.bytes} leaves no room" if budget.bytes is not None else "no rung is left"
        raise LadderError(f"error budget {budget.error:.4g} cannot hold: {len(over)} unit(s) stay above it ({named}); "
                          f"{why}: raise --error-budget or --byte-budget")
    return list(choices.values())


def skipped_rungs(units: list[Unit], start: Recipe, build: Callable[[Recipe], object]) -> dict[str, dict[str, str]]:
    """Per role, the quantized rungs the served releases do not build for it, with the reason: ``build`` (the
    plan, with its replay of every served release) refuses a recipe giving that role's units the rung and
    keeping everything else bf16, so a refusal is that rung's, not another role's."""
    skipped: dict[str, dict[str, str]] = {}
    for role in dict.fromkeys(u.role for u in units if start_rung(start, u) != KEPT):
        layers = tuple(sorted({u.layer for u in units if u.role == role and start_rung(start, u) != KEPT}))
        for rung in LADDER[:-1]:
            probe = Recipe(f"{start.name}+{role}-{rung}", start.format, start.scale_rule, start.weight_only,
                           (Rule(role, "quantize", False, False, layers, rung),))
            try:
                build(probe)
            except QuantgateError as exc:
                skipped.setdefault(role, {})[rung] = str(exc)
    return skipped


def ladder_recipe(start: Recipe, choices: list[Choice]) -> Recipe:
    """``start`` with one rule per (role, draft or not, rung) the ladder moved, naming its layers, ahead of
    the start's own rules (first match wins): the recipe the converter writes and the manifest records."""
    groups: dict[tuple[str, bool, str], list[int]] = {}
    for c in choices:
        if c.rung != c.start:
            groups.setdefault((c.unit.role, c.unit.mtp, c.rung), []).append(c.unit.layer)
    rules = tuple(Rule(role, "keep" if rung == KEPT else "quantize", mtp, False, tuple(sorted(layers)), rung)
                  for (role, mtp, rung), layers in sorted(groups.items()))
    return Recipe(f"{start.name}+ladder", start.format, start.scale_rule, start.weight_only, rules + start.rules)


def record(choices: list[Choice], budget: Budget, *, default_budget: bool, sidecar: dict, sidecar_file: dict,
           skipped: dict[str, dict[str, str]]) -> dict:
    """The conversion manifest's ``ladder``: what was measured, the budget, and per unit its rung."""
    calibration = {k: v for k, v in (sidecar.get("calibration") or {}).items() if k != "item_sha256"}
    return {
        "sensitivity": {**sidecar_file, "calibration": calibration,
                        **{k: sidecar.get(k) for k in ("seconds", "peak_rss_bytes")}},
        "budget": {"error": budget.error, "bytes": budget.bytes, "error_is_default": default_budget},
        "rungs_skipped": skipped,
        "bytes": {"start": sum(c.unit.bytes[c.start] for c in choices), "chosen": sum(c.nbytes for c in choices),
                  "fp8": sum(c.unit.bytes["fp8" if c.start != KEPT else KEPT] for c in choices)},
        "max_error": {"start": max(c.unit.error_at(c.start) for c in choices), "chosen": max(c.error for c in choices)},
        "units": [{"layer": c.unit.layer, "role": c.unit.role, "mtp": c.unit.mtp, "start": c.start, "rung": c.rung,
                   "error": c.unit.error, "bytes": c.unit.bytes}
                  for c in sorted(choices, key=lambda c: (c.unit.mtp, c.unit.layer, c.unit.role))],
    }


def describe(ladder: dict) -> str:
    """One line of a manifest's ``ladder`` record, as ``quantize`` and ``gate release`` print it."""
    counts: dict[str, int] = {}
    for unit in ladder["units"]:
        counts[unit["rung"]] = counts.get(unit["rung"], 0) + 1
    rungs = ", ".join(f"{counts[r]} {RUNGS[r].label}" for r in LADDER if r in counts)
    budget, sizes, cal = ladder["budget"], ladder["bytes"], ladder["sensitivity"].get("calibration") or {}
    limits = [f"error <= {budget['error']:.4g}" + (" (the worst W8A8 unit's)" if budget.get("error_is_default")
                                                    else "")] if budget.get("error") is not None else []
    limits += [f"bytes <= {budget['bytes']}"] if budget.get("bytes") is not None else []
    return (f"{len(ladder['units'])} units: {rungs}; largest layer error {ladder['max_error']['chosen']:.4g} "
            f"(start {ladder['max_error']['start']:.4g}; budget {', '.join(limits)}); Linear weights "
            f"{sizes['chosen']} bytes (start {sizes['start']}, all W8A8 {sizes['fp8']}); calibrated on "
            f"{cal.get('source', '?')} ({cal.get('items', '?')} items, {cal.get('tokens', '?')} tokens)")


def calibration_source(data: str) -> str:
    """How a sidecar records calibration data ``data``: a benchmark's train split as ``<name>:train``."""
    from quant.calibration import benchmark_named

    benchmark = benchmark_named(data)
    return f"{benchmark}:train" if benchmark else data


def plan_ladder(src: Path, start: Recipe, family, serve: tuple[tuple[str, str], ...], sidecar_path: Path,
                budget: Budget, calibration: str | None = None):
    """The plan of ``start`` lifted by the ladder on the measurements in ``sidecar_path`` (a sensitivity pass
    over ``src``; ``calibration``: the data the user named, which must be the data it was measured on), and
    the manifest's ``ladder`` record. Neither budget given: the default error budget."""
    from quant.checkpoint import Checkpoint
    from quant.hashing import sha256_of
    from quant.plan import make_plan
    from quant.sensitivity import load_sensitivity
    from quant.static_scales import load_measured_inputs

    checkpoint = Checkpoint.open(src)
    sens = load_sensitivity(sidecar_path)
    if sens.source.get("config_sha256") != sha256_of(checkpoint.config_path):
        raise LadderError(f"--sensitivity {sidecar_path}: measured on {sens.source.get('path')}, whose config.json is "
                          f"not {checkpoint.config_path}; measure this source (drop --sensitivity, or name a new file)")
    measured_on = sens.calibration.get("source")
    if calibration is not None and calibration_source(calibration) != measured_on:
        raise LadderError(f"--sensitivity {sidecar_path}: calibrated on {measured_on}, not --calibration "
                          f"{calibration}; name the data it was measured on, or a new --sensitivity file")
    sidecar = sens.model_dump()
    # what the start keeps bf16 (the indexer, say) is not laddered: the record and its bytes are the start's Linears
    units = [u for u in units_of(sidecar, str(sidecar_path)) if start_rung(start, u) != KEPT]
    if not units:
        raise LadderError(f"{start.name} quantizes none of the units {sidecar_path} measured; start from a recipe "
                          "that quantizes decoder Linears (--recipe FILE)")
    scales = load_measured_inputs(Path(sidecar_path))

    def build(recipe: Recipe):
        return make_plan(checkpoint, recipe, family, serve, scales)

    skipped = skipped_rungs(units, start, build)
    default = budget.error is None and budget.bytes is None
    budget = Budget(error=default_error_budget(units)) if default else budget
    choices = choose(units, start, budget, lambda role, rung: rung not in skipped.get(role, {}))
    plan = build(ladder_recipe(start, choices))
    return plan, record(choices, budget, default_budget=default, sidecar=sidecar,
                        sidecar_file={"path": str(sidecar_path), "sha256": scales.sha256}, skipped=skipped)


def manifest_line(manifest: dict) -> str | None:
    """``describe`` of a conversion manifest's ladder record; None for a conversion the ladder did not choose."""
    ladder = manifest.get("ladder") if isinstance(manifest, dict) else None
    if ladder is None:
        return None
    try:
        return describe(ladder)
    except (KeyError, TypeError, ValueError, AttributeError):  # a hand-edited or newer record: say so, judge on
        return "recorded, but not in the form this quantgate writes (see conversion_manifest.json's ladder)"


__all__ = ["Budget", "Choice", "LadderError", "Unit", "choose", "default_error_budget", "describe", "ladder_recipe",
           "manifest_line", "plan_ladder", "record", "skipped_rungs", "start_rung", "units_of"]
