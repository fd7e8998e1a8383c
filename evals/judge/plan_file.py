"""A plan as input: the file of ``evals run --plan`` and the copy a run bundle carries in run.json.

Both are checked field by field against what ``gate plan`` writes (``design.make_plan``), so a
hostile or hand-edited plan is one line naming the file and the field, never a traceback: items
and repeats positive integers, one seed per repeat, looks rising strictly in repeats and
information to the last repeat and to 1, every level a one-sided confidence in (0.5, 1).

A plan decides nothing by itself. The gate judges a planned run at levels it computes from the
reviewer's policy (its confidence) and the plan's look schedule (each look's repeats and
information fraction), and refuses a plan whose confidence or levels differ from those, naming
both values: a candidate cannot choose the confidence it is judged at.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from scipy import stats as sps

from evals.judge import sequential
from evals.errors import BadInput, Refused
from evals.judge.policy import finite_number
from quant.safe_files import read_yaml

PLAN_VERSION = 1
LEVEL_TOLERANCE = 1e-6  # the levels are recomputed exactly as `gate plan` computes them; this only absorbs rounding
FIX = "write the plan with `gate plan --out PLAN`"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class _Fields:
    """Field checks that raise BadInput naming ``where.key``, the value found and ``fix``."""

    def __init__(self, fix: str):
        self.fix = fix

    def need(self, entry: dict, key: str, where: str, ok, what: str):
        if key not in entry:
            raise BadInput(f"{where}.{key}: missing; {self.fix}")
        value = entry[key]
        if not ok(value):
            raise BadInput(f"{where}.{key}: {value!r} is not {what}; {self.fix}")
        return value

    def mapping(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            raise BadInput(f"{where}: a {type(value).__name__} where a mapping belongs; {self.fix}")
        return value


def _confidence(value) -> bool:
    return finite_number(value) and 0.5 < value < 1


def check_plan(plan, where: str, fix: str = FIX) -> dict:
    """``plan`` if it is a whole plan of ``PLAN_VERSION`` (see the module's docstring), else BadInput
    naming ``where`` (the file) and the field, and saying ``fix``."""
    f = _Fields(fix)
    _need, _mapping = f.need, f.mapping
    plan = _mapping(plan, where)
    version = plan.get("plan_version")
    if version != PLAN_VERSION:
        raise BadInput(f"{where}.plan_version: {version!r}, not {PLAN_VERSION}; {fix}")
    _need(plan, "confidence", where, _confidence, "a one-sided confidence in (0.5, 1)")
    benchmarks = _mapping(_need(plan, "benchmarks", where, lambda v: True, ""), f"{where}.benchmarks")
    if not benchmarks:
        raise BadInput(f"{where}.benchmarks: empty; {fix}")
    for bench, entry in benchmarks.items():
        at = f"{where}.benchmarks.{bench}"
        if not isinstance(bench, str):
            raise BadInput(f"{at}: {bench!r} is not a benchmark name; {fix}")
        entry = _mapping(entry, at)
        _need(entry, "items", at, _positive_int, "a positive integer")
        repeats = _need(entry, "repeats", at, _positive_int, "a positive integer")
        seeds = _need(entry, "seeds", at, lambda v: isinstance(v, list) and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v), "a list of non-negative integers")
        if len(seeds) != repeats or len(set(seeds)) != len(seeds):
            raise BadInput(f"{at}.seeds: {seeds} is not {repeats} distinct seeds, one per repeat; {fix}")
        looks = _need(entry, "looks", at, lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of looks")
        for k, look in enumerate(looks):
            look = _mapping(look, f"{at}.looks[{k}]")
            _need(look, "repeats", f"{at}.looks[{k}]", _positive_int, "a positive integer")
            _need(look, "information_fraction", f"{at}.looks[{k}]", lambda v: finite_number(v) and 0 < v <= 1,
                  "an information fraction in (0, 1]")
            _need(look, "confidence", f"{at}.looks[{k}]", _confidence, "a one-sided confidence in (0.5, 1)")
        steps = [lk["repeats"] for lk in looks]
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != repeats:
            raise BadInput(f"{at}.looks: at {steps} repeats; looks must rise strictly to the plan's {repeats} "
                           f"repeats; {fix}")
        fractions = [lk["information_fraction"] for lk in looks]
        if any(b <= a for a, b in itertools.pairwise(fractions)) or fractions[-1] != 1:
            raise BadInput(f"{at}.looks: information fractions {fractions} must rise strictly to 1; {fix}")
    return plan


def read_plan(path: Path) -> dict:
    """The plan in the file ``path`` (YAML or JSON; a regular file, size capped, no aliases), checked."""
    where = f"--plan {path}"
    try:
        data = read_yaml(Path(path), BadInput, FIX)
    except BadInput as exc:
        raise BadInput(f"--plan {exc}") from None
    return check_plan(data, where)


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
