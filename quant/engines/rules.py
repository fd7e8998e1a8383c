"""Engine rule sets as data: ``manifests/engines/<engine>.yaml``, one rule set per range of releases.

Each rule carries its value and a citation (file and function in the release it was read in).
A rule set starts from the previous one and overrides what changed, so the YAML only lists changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import yaml
from packaging.version import InvalidVersion, Version

from quant.errors import QuantgateError
from quant.layout import manifests_root

ENGINES = ("sglang", "vllm")


class UnknownEngine(QuantgateError, ValueError):
    """An ``--engine`` the rules do not cover (exit code 2)."""


@dataclass(frozen=True)
class RuleSet:
    engine: str
    first: str
    last: str
    values: dict
    cites: dict

    @property
    def id(self) -> str:
        return f"{self.engine} {self.first}" + (f"..{self.last}" if self.last != self.first else "")

    def covers(self, version: str) -> bool:
        return Version(self.first) <= Version(version) <= Version(self.last)

    def __getitem__(self, rule: str):
        return self.values[rule]

    def fused(self, kind: str) -> dict[str, list[str]]:
        return self["quark_fused"] if kind == "quark" else self["fp8_skip"]["fused"]


@cache
def rule_sets(engine: str) -> tuple[RuleSet, ...]:
    data = yaml.safe_load((manifests_root() / "engines" / f"{engine}.yaml").read_text())
    values: dict = {}
    cites: dict = {}
    out = []
    for raw in data["rule_sets"]:
        for name, rule in raw["rules"].items():
            values[name], cites[name] = rule["value"], rule["cite"]
        first, last = (str(v) for v in raw["versions"])
        out.append(RuleSet(data["engine"], first, last, dict(values), dict(cites)))
    return tuple(out)


def select(spec: str = "all") -> list[RuleSet]:
    """Rule sets for ``all``, ``sglang``, ``vllm`` or ``ENGINE==VERSION`` (the set covering it)."""
    engine, _, version = spec.partition("==")
    engines = ENGINES if engine == "all" and not version else (engine,)
    if any(e not in ENGINES for e in engines):
        raise UnknownEngine(f"unknown engine {engine!r}; known: {', '.join(ENGINES)} (see gate checkpoint --list-engines)")
    if not version:
        return [r for e in engines for r in rule_sets(e)]
    try:
        Version(version)
    except InvalidVersion:
        raise UnknownEngine(f"{spec!r}: {version!r} is not a version (e.g. sglang==0.5.23)") from None
    chosen = [r for r in rule_sets(engine) if r.covers(version)]
    if not chosen:
        known = ", ".join(r.id for r in rule_sets(engine))
        raise UnknownEngine(f"no {engine} rules cover {version}; the rules read so far cover: {known} "
                            "(read that release's sources before trusting a replay of it)")
    return chosen
