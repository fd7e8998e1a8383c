"""Engine rule sets as data: ``manifests/engines/<engine>.yaml``, one rule set per range of releases.

Each rule carries its value and a citation (file and function in the release it was read in).
A rule set starts from the previous one and overrides what changed, so the YAML only lists changes.
Only releases that were read are replayed: ``checked`` lists them, ``post_releases`` maps each
``.postN`` to the release whose rule set it follows (a post release sorts after its base, so a
version range alone would hand it the next set's rules).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    release: str | None = None  # the one release asked for (--engine sglang==X), read in the wheel of X

    @property
    def id(self) -> str:
        span = f"{self.engine} {self.first}" + (f"..{self.last}" if self.last != self.first else "")
        return span if self.release is None else f"{self.engine} {self.release} (rules of {span.split(' ', 1)[1]})"

    def covers(self, version: str) -> bool:
        return Version(self.first) <= Version(version) <= Version(self.last)

    def __getitem__(self, rule: str):
        return self.values[rule]

    def fused(self, kind: str) -> dict[str, list[str]]:
        return self["quark_fused"] if kind == "quark" else self["fp8_skip"]["fused"]


@cache
def _manifest(engine: str) -> dict:
    return yaml.safe_load((manifests_root() / "engines" / f"{engine}.yaml").read_text())


def releases_read(engine: str) -> dict[str, str]:
    """Each release whose sources were read -> the release its rule set is chosen by (itself, or
    the base of a ``.postN``)."""
    data = _manifest(engine)
    posts = {str(k): str(v) for k, v in (data.get("post_releases") or {}).items()}
    return {**{str(v): str(v) for v in data["checked"]}, **posts}


@cache
def rule_sets(engine: str) -> tuple[RuleSet, ...]:
    data = _manifest(engine)
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
    read = releases_read(engine)
    release = next((v for v in read if Version(v) == Version(version)), None)
    if release is None:
        raise UnknownEngine(f"{engine} {version} has not been read; the releases read are: {', '.join(read)} "
                            "(read that release's sources before trusting a replay of it; a .postN release "
                            "needs its own entry)")
    chosen = [r for r in rule_sets(engine) if r.covers(read[release])]
    if len(chosen) != 1:
        raise UnknownEngine(f"{engine} {version} was read but {len(chosen)} rule sets cover it; fix "
                            f"manifests/engines/{engine}.yaml (each release read belongs to exactly one set)")
    return [replace(r, release=release) for r in chosen]
