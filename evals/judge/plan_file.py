"""A plan as input: the file of ``evals run --plan`` and the copy a run bundle carries in run.json.

Both are checked against ``PlanFile``, the schema of what ``gate plan`` writes (``design.make_plan``),
so a hostile or hand-edited plan is one line naming the file and the field (a misspelt key with the
nearest valid one), never a traceback: items and repeats positive integers, one seed per repeat,
looks rising strictly in repeats and information to the last repeat and to 1, every level a
one-sided confidence in (0.5, 1).

A plan decides nothing by itself. The gate judges a planned run at levels it computes from the
reviewer's policy (its confidence) and the plan's look schedule (each look's repeats and
information fraction), and refuses a plan whose confidence or levels differ from those, naming
both values: a candidate cannot choose the confidence it is judged at.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)
from scipy import stats as sps

from evals.errors import BadInput, Refused
from evals.judge import sequential
from quant.schema import JsonValue, Schema, load, validate

PLAN_VERSION = 1
LEVEL_TOLERANCE = 1e-6  # the levels are recomputed exactly as `gate plan` computes them; this only absorbs rounding
FIX = "write the plan with `gate plan --out PLAN`"


def _confidence(value: float) -> float:
    if not 0.5 < value < 1:
        raise ValueError(f"{value} is not a one-sided confidence in (0.5, 1)")
    return value


Confidence = Annotated[float, AfterValidator(_confidence)]


class PlannedLook(Schema):
    """One look of a benchmark's plan: after ``repeats`` repeats, at ``confidence`` (one-sided)."""
    repeats: PositiveInt
    information_fraction: float = Field(gt=0, le=1)
    confidence: Confidence
    look: int | None = None  # what gate plan wrote beside them, for people: the gate recomputes the levels
    alpha_spent: float | None = None
    z: float | None = None


class PlannedBenchmark(Schema):
    """One benchmark of a plan: what the run does (items, repeats, seeds, looks); the rest is the
    design ``gate plan`` wrote beside it for people (``design.Design``), which nothing judges by."""
    items: PositiveInt
    repeats: PositiveInt
    seeds: list[NonNegativeInt]
    looks: list[PlannedLook] = Field(min_length=1)
    benchmark: str | None = None
    margin: float | None = None
    drop: float | None = None
    power: float | None = None
    feasible: bool | None = None
    certifiable_margin: float | None = None
    expected_repeats: float | None = None
    assumptions: dict[str, JsonValue] | None = None
    benchmark_items: int | None = None
    max_repeats: int | None = None
    gpu_hours: dict[str, JsonValue] | None = None
    note: str = ""

    @model_validator(mode="after")
    def _schedule(self):
        if len(self.seeds) != self.repeats or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: {self.seeds} is not {self.repeats} distinct seeds, one per repeat")
        steps = [lk.repeats for lk in self.looks]
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != self.repeats:
            raise ValueError(f"looks: at {steps} repeats; looks must rise strictly to the plan's {self.repeats} "
                             "repeats")
        fractions = [lk.information_fraction for lk in self.looks]
        if any(b <= a for a, b in itertools.pairwise(fractions)) or fractions[-1] != 1:
            raise ValueError(f"looks: information fractions {fractions} must rise strictly to 1")
        return self


class PlanFile(Schema):
    """A plan as ``gate plan`` writes it (``design.make_plan``)."""
    plan_version: Literal[PLAN_VERSION]
    confidence: Confidence
    benchmarks: dict[str, PlannedBenchmark] = Field(min_length=1)
    made_by: str | None = None  # the rest: what gate plan wrote beside them, for people
    alpha: float | None = None
    policy: str | None = None
    power: float | None = None
    spending: str | None = None

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _names(cls, benchmarks):
        for bench in benchmarks if isinstance(benchmarks, dict) else ():
            if not isinstance(bench, str):
                raise ValueError(f"{bench!r} is not a benchmark name")  # noqa: TRY004 (pydantic reports ValueError)
        return benchmarks


def check_plan(plan, where: str, fix: str = FIX) -> dict:
    """``plan`` if it is a whole plan of ``PLAN_VERSION`` (see the module's docstring), else BadInput
    naming ``where`` (the file) and the field, and saying ``fix``."""
    if not isinstance(plan, dict):
        raise BadInput(f"{where}: a {type(plan).__name__} where a mapping belongs; {fix}")
    return validate(plan, PlanFile, where, "plan", BadInput, fix).model_dump(exclude_unset=True)


def read_plan(path: Path) -> dict:
    """The plan in the file ``path`` (YAML or JSON; a regular file, size capped, no aliases), checked."""
    try:  # the keys as written (a plan is carried on into the run bundle as it was)
        return load(Path(path), PlanFile, "plan", BadInput, FIX).model_dump(exclude_unset=True)
    except BadInput as exc:
        raise BadInput(f"--plan {exc}") from None


def levels(fractions: list[float], alpha: float) -> list[float]:
    """The one-sided confidence of each look at these information fractions, spending ``alpha``
    (as ``design.plan_looks`` computes them: one look is judged at ``1 - alpha`` itself)."""
    if len(fractions) == 1:
        return [1 - alpha]
    return [sequential.nominal_confidence(z) for z in sequential.boundaries(fractions, alpha)]


def plan_under_policy(plan, policy, where: str) -> dict:
    """A bundle's plan (``None``: an unplanned run) checked, and judged by the policy: refused (Refused,
    exit 2, naming both values) where its confidence or a look's level is not the policy's; the looks
    returned carry the levels computed here, never the bundle's numbers."""
    if plan is None:
        return {"benchmarks": {}}
    plan = check_plan(plan, where, "a run bundle's plan is the one `evals run --plan PLAN` recorded: rerun it with a "
                                   "plan written by `gate plan --out PLAN`")
    fix = "judge the run with the policy it was planned under, or plan and run it again (`gate plan --policy POLICY`)"
    if abs(plan["confidence"] - policy.confidence) > 1e-12:
        raise Refused(f"{where}.confidence: the plan's {plan['confidence']} is not the policy's {policy.confidence} "
                      f"({policy.source or 'the default policy'}); the gate judges at the policy's: {fix}")
    judged = {}
    for bench, entry in plan["benchmarks"].items():
        looks = entry["looks"]
        recomputed = levels([lk["information_fraction"] for lk in looks], 1 - policy.confidence)
        for k, (look, level) in enumerate(zip(looks, recomputed)):
            if abs(look["confidence"] - level) > LEVEL_TOLERANCE:
                raise Refused(f"{where}.benchmarks.{bench}.looks[{k}].confidence: the plan's {look['confidence']} is "
                              f"not {level:.6f}, the level the policy's confidence {policy.confidence} gives this "
                              f"look (information fraction {look['information_fraction']}); {fix}")
        judged[bench] = {**entry, "looks": [{**lk, "look": k + 1, "confidence": level,
                                             "z": float(sps.norm.ppf(level))}
                                            for k, (lk, level) in enumerate(zip(looks, recomputed))]}
    return {**plan, "benchmarks": judged}
