"""The gate policy as a typed object: per benchmark a non-inferiority margin, whether it is
required, an absolute floor and what an INCONCLUSIVE does; the confidence and the bootstrap.

The defaults live here and only here; ``manifests/gates/release.yaml`` says which values the
release gate uses and why. A policy file is validated on load: a wrong key or value is a
``BadInput`` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from evals.errors import BadInput
from quant.layout import manifests_root, read_yaml_mapping

INCONCLUSIVE_MODES = ("block", "warn")  # block: the release waits for more data; warn: reported only


@dataclass(frozen=True)
class BenchmarkPolicy:
    margin: float = 0.02  # the non-inferiority margin on the paired delta (score units, 0..1)
    required: bool = True  # a verdict needs this benchmark compared
    floor: float | None = None  # candidate scores below this FAIL whatever the delta says
    inconclusive: str = "block"  # see INCONCLUSIVE_MODES
    min_items: int = 0  # fewer compared items: INCONCLUSIVE, blocking whatever the bounds say
    max_infra_error_rate: float | None = None  # tau2: an arm with more infrastructure errors is INCONCLUSIVE


@dataclass(frozen=True)
class Bootstrap:
    resamples: int = 10000
    seed: int = 0


@dataclass(frozen=True)
class KernelsPolicy:
    # An untuned aiter MoE shape costs speed, not accuracy: a warning in the release report
    # unless the policy makes it block (``gate release --gpu ...`` runs ``gate kernels``).
    blocking: bool = False


@dataclass(frozen=True)
class GatePolicy:
    confidence: float = 0.95  # one-sided, for the bounds of the paired delta
    bootstrap: Bootstrap = field(default_factory=Bootstrap)
    benchmarks: dict[str, BenchmarkPolicy] = field(default_factory=dict)
    kernels: KernelsPolicy = field(default_factory=KernelsPolicy)
    source: str | None = None  # the file it was read from

    def of(self, benchmark: str) -> BenchmarkPolicy:
        """A benchmark's rules; one the policy does not name gets the defaults, and is not required."""
        return self.benchmarks.get(benchmark, BenchmarkPolicy(required=False))

    @property
    def required(self) -> list[str]:
        return sorted(b for b, rules in self.benchmarks.items() if rules.required)

    def with_margins(self, margins: dict[str, float]) -> GatePolicy:
        """The policy with some margins overridden (``gate ... --margin BENCH=VALUE``)."""
        benchmarks = dict(self.benchmarks)
        for bench, margin in margins.items():
            if not 0 <= margin < 1:
                raise BadInput(f"--margin {bench}={margin}: a margin is a score difference between 0 and 1")
            benchmarks[bench] = replace(self.of(bench), margin=margin)
        return replace(self, benchmarks=benchmarks)

    def to_dict(self) -> dict:
        return asdict(self)


def _typed(cls, raw, where: str):
    """``cls(**raw)`` with every key known and every value of its field's kind, else BadInput."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a mapping, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise BadInput(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    for key, value in raw.items():
        kind = known[key].type
        ok = (value is None and "None" in kind) or (
            "bool" in kind and isinstance(value, bool)) or (
            ("float" in kind or "int" in kind) and isinstance(value, (int, float)) and not isinstance(value, bool)) or (
            "str" in kind and isinstance(value, str))
        if not ok:
            raise BadInput(f"{where}.{key}: {value!r} is not a {kind}")
    return cls(**raw)


def load_policy(path: Path | None = None) -> GatePolicy:
    """The policy at ``path`` (default: ``manifests/gates/release.yaml``), validated."""
    path = Path(path) if path else manifests_root() / "gates" / "release.yaml"
    raw = dict(read_yaml_mapping(path, "gate policy", BadInput))  # one line naming file and line, or BadInput
    benchmarks = {}
    for bench, rules in (raw.pop("benchmarks", None) or {}).items():
        rules = _typed(BenchmarkPolicy, rules, f"{path}: benchmarks.{bench}")
        if rules.inconclusive not in INCONCLUSIVE_MODES:
            raise BadInput(f"{path}: benchmarks.{bench}.inconclusive must be one of {INCONCLUSIVE_MODES}")
        if not 0 <= rules.margin < 1:
            raise BadInput(f"{path}: benchmarks.{bench}.margin {rules.margin} is not a score difference in [0, 1)")
        benchmarks[bench] = rules
    bootstrap = _typed(Bootstrap, raw.pop("bootstrap", None) or {}, f"{path}: bootstrap")
    kernels = _typed(KernelsPolicy, raw.pop("kernels", None) or {}, f"{path}: kernels")
    policy = _typed(GatePolicy, raw, str(path))
    if not 0.5 < policy.confidence < 1:
        raise BadInput(f"{path}: confidence {policy.confidence} must lie in (0.5, 1), e.g. 0.95")
    return replace(policy, bootstrap=Bootstrap(int(bootstrap.resamples), int(bootstrap.seed)),
                   benchmarks=benchmarks, kernels=kernels, source=str(path))
