"""The gate policy as a typed object: per benchmark a non-inferiority margin, whether it is
required, an absolute floor and what an INCONCLUSIVE does; the confidence and the bootstrap.

The defaults live here and only here; ``manifests/gates/release.yaml`` says which values the
release gate uses and why. A policy file is read by the one YAML loader (``quant.schema.load``:
a regular file, size capped, no aliases) against ``PolicyFile``: a wrong key or value is a
``BadInput`` naming the file, the key and, for a misspelt key, the nearest valid one. A policy
shipped with the package is named by its file's stem (``--policy arith-example``:
``manifests/gates/arith-example.yaml``) and found only there: a file of that name in the working
folder never stands in for it (a path is written as one: ``./release``).
Numbers that would void the bound's promise (too few bootstrap resamples for its level, a seed numpy
refuses) are refused, and so are numbers that would exhaust the machine (resamples past ``MAX_RESAMPLES``).

A benchmark has no hidden margin: one the policy does not name is judged only at a margin the user
names (``--margin BENCH=VALUE``), else refused.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from scipy import stats as sps

from evals.errors import BadInput
from quant.layout import manifests_root
from quant.schema import Schema, load

INCONCLUSIVE_MODES = ("block", "warn")  # block: the release waits for more data; warn: reported only
POLICY_SUFFIXES = (".yaml", ".yml", ".json")  # a --policy with one of these (or a slash) is a path, never a name
# The bootstrap bound is a quantile of the resamples: its Monte Carlo error must stay small beside the
# sampling error it measures (``min_resamples``). Past MAX_RESAMPLES that error is under 0.005 standard
# errors at 95%, so more buy nothing, and each resample costs 8 bytes per array and time per benchmark.
MONTE_CARLO_SE = 0.1  # the most Monte Carlo error allowed in the bound, in standard errors of the delta
MAX_RESAMPLES = 1_000_000
SEED_MAX = 2**32 - 1  # numpy's seed range, as `evals run --seeds` takes it


class BenchmarkPolicy(Schema):
    margin: float  # the non-inferiority margin on the paired delta (score units, 0..1); no default: named or refused
    required: bool = True  # a verdict needs this benchmark compared
    floor: float | None = None  # candidate scores below this FAIL whatever the delta says
    inconclusive: Literal[INCONCLUSIVE_MODES] = "block"  # see INCONCLUSIVE_MODES
    min_items: int = 0  # fewer compared items: INCONCLUSIVE, blocking whatever the bounds say
    max_infra_error_rate: float | None = None  # tau2: an arm with more infrastructure errors is INCONCLUSIVE

    @field_validator("margin")
    @classmethod
    def _margin(cls, margin: float) -> float:
        if not 0 <= margin < 1:
            raise ValueError(f"{margin} is not a score difference in [0, 1)")
        return margin

    @field_validator("floor", "max_infra_error_rate")
    @classmethod
    def _rate(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"{value} is not a score or rate in [0, 1]")
        return value

    @field_validator("min_items")
    @classmethod
    def _min_items(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"{value} is negative; 0 means no minimum")
        return value


class Bootstrap(Schema):
    resamples: int = 10000  # checked against the confidence by the policy (``min_resamples``)
    seed: int = 0

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int) -> int:
        if not 0 <= seed <= SEED_MAX:
            raise ValueError(f"{seed}: a whole number from 0 to {SEED_MAX}, e.g. 0")
        return seed


class KernelsPolicy(Schema):
    # An untuned aiter MoE shape costs speed, not accuracy: a warning in the release report
    # unless the policy makes it block (``gate release --gpu ...`` runs ``gate kernels``).
    blocking: bool = False


def _default_if_null(value, info: ValidationInfo):
    """An empty key (``benchmarks:`` with nothing after it) is its default, as if it were absent."""
    return PolicyFile.model_fields[info.field_name].get_default(call_default_factory=True) if value is None else value


class PolicyFile(Schema):
    """A gate policy as written (``manifests/gates/*.yaml``)."""
    confidence: float = 0.95  # one-sided, for the bounds of the paired delta
    bootstrap: Bootstrap = Field(default_factory=Bootstrap)
    benchmarks: dict[str, BenchmarkPolicy] = Field(default_factory=dict)
    kernels: KernelsPolicy = Field(default_factory=KernelsPolicy)

    _nulls = field_validator("bootstrap", "benchmarks", "kernels", mode="before")(_default_if_null)

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _names(cls, benchmarks):
        for bench in benchmarks if isinstance(benchmarks, dict) else ():
            if not isinstance(bench, str) or not bench:
                raise ValueError(f"the key {bench!r} is not a benchmark's name; write names as the runs record "
                                 "them, e.g. gsm8k")
        return benchmarks

    @model_validator(mode="after")
    def _bound_holds(self):
        """Numbers that would void the bound's promise or exhaust the machine."""
        if not 0.5 < self.confidence < 1:
            raise ValueError(f"confidence {self.confidence} must lie in (0.5, 1), e.g. 0.95")
        least = min_resamples(self.confidence)
        if least > MAX_RESAMPLES:
            raise ValueError(f"confidence {self.confidence}: its bound needs {least} bootstrap resamples, more than "
                             f"the {MAX_RESAMPLES} allowed; use a confidence such as 0.95 or 0.99")
        if not least <= self.bootstrap.resamples <= MAX_RESAMPLES:
            raise ValueError(f"bootstrap.resamples {self.bootstrap.resamples}: the bound at confidence "
                             f"{self.confidence} needs from {least} (fewer leave it to chance) to {MAX_RESAMPLES} "
                             "(more cost time and memory and change nothing), e.g. 10000")
        return self


class GatePolicy(PolicyFile):
    """A policy and where it was read from (a file may not set that)."""
    source: str | None = None  # the file it was read from

    def of(self, benchmark: str) -> BenchmarkPolicy:
        """A benchmark's rules; one the policy does not name (nor ``--margin``) is refused, naming how to name it."""
        if benchmark not in self.benchmarks:
            raise BadInput(f"{benchmark}: the policy {self.source or '(built in)'} names no margin for it; pass "
                           f"--margin {benchmark}=VALUE, or a policy that names it ({policies_naming([benchmark])})")
        return self.benchmarks[benchmark]

    @property
    def required(self) -> list[str]:
        return sorted(b for b, rules in self.benchmarks.items() if rules.required)

    def with_margins(self, margins: dict[str, float]) -> GatePolicy:
        """The policy with some margins overridden or named (``gate ... --margin BENCH=VALUE``); a
        benchmark the policy does not name is then judged at that margin, and is not required."""
        benchmarks = dict(self.benchmarks)
        for bench, margin in margins.items():
            if not 0 <= margin < 1:
                raise BadInput(f"--margin {bench}={margin}: a margin is a score difference between 0 and 1")
            named = benchmarks.get(bench)
            benchmarks[bench] = named.model_copy(update={"margin": margin}) if named else \
                BenchmarkPolicy(margin=margin, required=False)
        return self.model_copy(update={"benchmarks": benchmarks})

    def to_dict(self) -> dict:
        return self.model_dump()


def finite_number(value) -> bool:
    """A real, finite number as YAML or JSON gives one (a bool is not one, NaN and Inf are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def shipped_policies() -> list[str]:
    """The names of the policies shipped under ``manifests/gates/``."""
    return sorted(p.stem for p in (manifests_root() / "gates").glob("*.yaml"))


def policies_naming(benchmarks: list[str]) -> str:
    """``--policy NAME`` of the shipped policies that name any of ``benchmarks``, else how to give one."""
    names = [name for name in shipped_policies() if set(benchmarks) & set(load_policy(name).benchmarks)]
    if names:
        return " or ".join(f"--policy {name} (shipped)" for name in names)
    return f"--policy FILE; shipped: {', '.join(shipped_policies())}"


def _shipped_hint(text: str) -> str:
    """How to name a shipped policy, for a --policy that found nothing."""
    stem = Path(text).name.rsplit(".", 1)[0]
    if stem in shipped_policies():
        return f"the shipped policy is named without a path or suffix: --policy {stem}"
    return f"a shipped policy is named by its name alone: {', '.join(shipped_policies())}"


def policy_path(path: Path | str | None) -> Path:
    """The file of ``--policy``: a shipped policy's name (a bare word: no slash, no suffix), found only
    under ``manifests/gates/``, or a path (a slash or a .yaml/.yml/.json suffix; a ``Path`` given by a
    caller is a path). A file in the working folder named like a shipped policy never replaces it: the
    release policy must not be swapped by whatever lies where the gate runs."""
    if path is None:
        return manifests_root() / "gates" / "release.yaml"
    text = str(path)
    if isinstance(path, Path) or "/" in text or text.endswith(POLICY_SUFFIXES):
        if not os.path.lexists(text):
            raise BadInput(f"--policy {text}: no such file; {_shipped_hint(text)}")
        return Path(text).absolute()  # the report names the file that judged, wherever the gate ran
    if text not in shipped_policies():
        here = f"; the file ./{text} here is a policy only written as a path: --policy ./{text}" \
            if os.path.lexists(text) else "; a policy file is given by its path (e.g. ./my-policy.yaml)"
        raise BadInput(f"--policy {text}: no shipped policy of that name (shipped: {', '.join(shipped_policies())})"
                       + here)
    return manifests_root() / "gates" / f"{text}.yaml"


def min_resamples(confidence: float) -> int:
    """The fewest resamples whose bound at one-sided ``confidence`` has a Monte Carlo standard error of at
    most ``MONTE_CARLO_SE`` standard errors of the delta: the alpha quantile of B resamples errs by
    sqrt(alpha (1 - alpha) / B) / phi(z_alpha) standard errors (a normal bootstrap distribution), so B is
    alpha (1 - alpha) / (MONTE_CARLO_SE phi(z_alpha))^2: 447 at 0.95, 1394 at 0.99. Fewer leave the bound
    to the draw (one resample puts it on the delta itself, which passes what the policy's own numbers call
    INCONCLUSIVE)."""
    alpha = 1 - confidence
    return math.ceil(alpha * (1 - alpha) / (MONTE_CARLO_SE * sps.norm.pdf(sps.norm.ppf(confidence))) ** 2)


def load_policy(path: Path | str | None = None) -> GatePolicy:
    """The policy at ``path`` (default: ``manifests/gates/release.yaml``; a bare name: a shipped one), validated."""
    path = policy_path(path)
    data = load(path, PolicyFile, "gate policy", BadInput,
                f"compare it with {manifests_root() / 'gates' / 'release.yaml'}")
    return GatePolicy(**dict(data), source=str(path))
