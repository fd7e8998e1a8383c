"""The gate policy as a typed object: per benchmark a non-inferiority margin, whether it is
required, an absolute floor and what an INCONCLUSIVE does; the confidence and the bootstrap.

The defaults live here and only here; ``manifests/gates/release.yaml`` says which values the
release gate uses and why. A policy file is read by the validating reader (``safe_files.read_yaml``:
a regular file, size capped, no aliases) and checked on load: a wrong key or value is a
``BadInput`` naming the file and the key. A policy shipped with the package is named by its file's
stem (``--policy arith-example``: ``manifests/gates/arith-example.yaml``) and found only there: a file
of that name in the working folder never stands in for it (a path is written as one: ``./release``).
Numbers that would void the bound's promise (too few bootstrap resamples for its level, a seed numpy
refuses) are refused, and so are numbers that would exhaust the machine (resamples past ``MAX_RESAMPLES``).

A benchmark has no hidden margin: one the policy does not name is judged only at a margin the user
names (``--margin BENCH=VALUE``), else refused.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from scipy import stats as sps

from evals.errors import BadInput
from quant.layout import manifests_root, read_yaml_mapping

INCONCLUSIVE_MODES = ("block", "warn")  # block: the release waits for more data; warn: reported only
POLICY_SUFFIXES = (".yaml", ".yml", ".json")  # a --policy with one of these (or a slash) is a path, never a name
# The bootstrap bound is a quantile of the resamples: its Monte Carlo error must stay small beside the
# sampling error it measures (``min_resamples``). Past MAX_RESAMPLES that error is under 0.005 standard
# errors at 95%, so more buy nothing, and each resample costs 8 bytes per array and time per benchmark.
MONTE_CARLO_SE = 0.1  # the most Monte Carlo error allowed in the bound, in standard errors of the delta
MAX_RESAMPLES = 1_000_000
SEED_MAX = 2**32 - 1  # numpy's seed range, as `evals run --seeds` takes it


@dataclass(frozen=True)
class BenchmarkPolicy:
    margin: float  # the non-inferiority margin on the paired delta (score units, 0..1); no default: named or refused
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
            benchmarks[bench] = replace(named, margin=margin) if named else BenchmarkPolicy(margin, required=False)
        return replace(self, benchmarks=benchmarks)

    def to_dict(self) -> dict:
        return asdict(self)


def finite_number(value) -> bool:
    """A real, finite number as YAML or JSON gives one (a bool is not one, NaN and Inf are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _typed(cls, raw, where: str):
    """``cls(**raw)`` with every key known and every value of its field's kind, else BadInput."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a mapping, got {raw!r}")
    known = {f.name: f for f in fields(cls) if f.name != "source"}  # the file it was read from is not a key of it
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise BadInput(f"{where}: unknown key(s) {unknown}; known: {sorted(known)} (a misspelt key would otherwise "
                       "leave its default in force): fix the policy")
    for name, f in known.items():
        if name not in raw and f.default is MISSING and f.default_factory is MISSING:
            raise BadInput(f"{where}.{name}: missing; it has no default (a benchmark's margin is named, never "
                           "assumed), e.g. {margin: 0.025}")
    for key, value in raw.items():
        kind = known[key].type
        number = finite_number(value)
        ok = (value is None and "None" in kind) or (
            "bool" in kind and isinstance(value, bool)) or (
            "float" in kind and number) or ("int" in kind and isinstance(value, int) and not isinstance(value, bool)) or (
            "str" in kind and isinstance(value, str))
        if not ok:
            raise BadInput(f"{where}.{key}: {value!r} is not a{'n' if kind.startswith('int') else ''} {kind}; fix "
                           "the policy (compare manifests/gates/release.yaml)")
    return cls(**raw)


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


def _check_bootstrap(bootstrap: Bootstrap, confidence: float, path: Path) -> None:
    least = min_resamples(confidence)
    if least > MAX_RESAMPLES:
        raise BadInput(f"{path}: confidence {confidence}: its bound needs {least} bootstrap resamples, more than the "
                       f"{MAX_RESAMPLES} allowed; use a confidence such as 0.95 or 0.99")
    if not least <= bootstrap.resamples <= MAX_RESAMPLES:
        raise BadInput(f"{path}: bootstrap.resamples {bootstrap.resamples}: the bound at confidence {confidence} needs "
                       f"from {least} (fewer leave it to chance) to {MAX_RESAMPLES} (more cost time and memory and "
                       "change nothing), e.g. 10000")
    if not 0 <= bootstrap.seed <= SEED_MAX:
        raise BadInput(f"{path}: bootstrap.seed {bootstrap.seed}: a whole number from 0 to {SEED_MAX}, e.g. 0")


def load_policy(path: Path | str | None = None) -> GatePolicy:
    """The policy at ``path`` (default: ``manifests/gates/release.yaml``; a bare name: a shipped one), validated."""
    path = policy_path(path)
    raw = dict(read_yaml_mapping(path, "gate policy", BadInput))  # one line naming file and line, or BadInput
    benchmarks = {}
    named = raw.pop("benchmarks", None) or {}
    if not isinstance(named, dict):
        raise BadInput(f"{path}: benchmarks: a {type(named).__name__} where a mapping of benchmark -> rules belongs; "
                       "compare manifests/gates/release.yaml")
    for bench, rules in named.items():
        if not isinstance(bench, str) or not bench:
            raise BadInput(f"{path}: benchmarks: the key {bench!r} is not a benchmark's name; write names as the runs "
                           "record them, e.g. gsm8k")
        at = f"{path}: benchmarks.{bench}"
        rules = _typed(BenchmarkPolicy, rules, at)
        if rules.inconclusive not in INCONCLUSIVE_MODES:
            raise BadInput(f"{at}.inconclusive must be one of {INCONCLUSIVE_MODES}")
        if not 0 <= rules.margin < 1:
            raise BadInput(f"{at}.margin {rules.margin} is not a score difference in [0, 1)")
        for key in ("floor", "max_infra_error_rate"):
            if getattr(rules, key) is not None and not 0 <= getattr(rules, key) <= 1:
                raise BadInput(f"{at}.{key} {getattr(rules, key)} is not a score or rate in [0, 1]")
        if rules.min_items < 0:
            raise BadInput(f"{at}.min_items {rules.min_items} is negative; 0 means no minimum")
        benchmarks[bench] = rules
    bootstrap = _typed(Bootstrap, raw.pop("bootstrap", None) or {}, f"{path}: bootstrap")
    kernels = _typed(KernelsPolicy, raw.pop("kernels", None) or {}, f"{path}: kernels")
    policy = _typed(GatePolicy, raw, str(path))
    if not 0.5 < policy.confidence < 1:
        raise BadInput(f"{path}: confidence {policy.confidence} must lie in (0.5, 1), e.g. 0.95")
    _check_bootstrap(bootstrap, policy.confidence, path)
    return replace(policy, bootstrap=Bootstrap(int(bootstrap.resamples), int(bootstrap.seed)),
                   benchmarks=benchmarks, kernels=kernels, source=str(path))
