"""Engine rule sets as data, keyed by the engine's model class: ``manifests/engines/<engine>.yaml``
holds the DeepSeek-V2 class's rules (DeepseekV2/V3ForCausalLM, GlmMoeDsaForCausalLM and their
drafts) and the rules of the quantization layer every model shares (``engine_wide``); a family
folder's ``<engine>.yaml`` (``manifests/families/<family>/``, named ``<engine>.<family>`` here) holds
another model class's rules, read for that class in the releases it lists. A family manifest names
its class per engine; adding a family is its folder: the manifest plus the rules read for its classes.

Each rule carries its value and a citation (file and function in the release it was read in); every
rule kind and the file's shape are defined once, strictly, in ``quant.engines.rule_kinds``, so a misspelt
rule or key refuses the file (exit 2, naming the file, the key and the nearest valid name).
A rule set starts from the previous one and overrides what changed, so the YAML only lists changes.
Only releases that were read are replayed: ``checked`` lists them, ``post_releases`` maps each
``.postN`` to the release whose rule set it follows (a post release sorts after its base, so a
version range alone would hand it the next set's rules). A release not read for a family's class
is refused for that family, never replayed with another class's rules.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Annotated

from packaging.version import InvalidVersion, Version
from pydantic import Field, model_validator

from quant.engines.rule_kinds import RuleFile
from quant.engines.rule_kinds import Version as Release
from quant.errors import QuantgateError
from quant.layout import (
    Family,
    family_dirs,
    family_named,
    known_families,
    manifests_root,
)
from quant.recipe import recipe_roles
from quant.safe_files import read_yaml
from quant.schema import Schema, load, nearest

ENGINES = ("sglang", "vllm")
DEFAULT_FAMILY = "glm_moe_dsa"  # the product's target (GLM-5): what callers that name no family mean


class UnknownEngine(QuantgateError, ValueError):
    """An ``--engine`` the rules do not cover (exit code 2)."""


class RuleFileError(UnknownEngine):
    """An engine rule file that cannot be read or breaks its schema (exit code 2): no engine release can be
    replayed from it, so every command that asks for its rules refuses as for an engine it does not cover."""


@dataclass(frozen=True)
class RuleSet:
    engine: str
    first: str
    last: str
    values: dict
    cites: dict
    release: str | None = None  # the one release asked for (--engine sglang==X), read in the wheel of X
    model_class: str = ""  # the engine's model class these rules were read for

    @property
    def id(self) -> str:
        span = f"{self.engine} {self.first}" + (f"..{self.last}" if self.last != self.first else "")
        return span if self.release is None else f"{self.engine} {self.release} (rules of {span.split(' ', 1)[1]})"

    def covers(self, version: str) -> bool:
        return Version(self.first) <= Version(version) <= Version(self.last)

    def __getitem__(self, rule: str):
        return self.values[rule]

    def fused(self, kind: str) -> dict[str, list[str]]:
        """The fused modules the quantization layer expands into shards for ``kind``: Quark's and the
        third-party formats' are the class's packed_modules_mapping (``quark_fused``), block FP8's its own."""
        return self["fp8_skip"]["fused"] if kind == "fp8" else self["quark_fused"]


def rules_path(name: str) -> Path:
    """The file of the rule set named ``name``: ``sglang`` / ``vllm`` (the DeepSeek-V2 class and the
    engine-wide rules, ``manifests/engines/``) or ``<engine>.<family>`` (that family folder's rules)."""
    engine, _, family = name.partition(".")
    return manifests_root() / "engines" / f"{engine}.yaml" if not family else family_dirs()[family] / f"{engine}.yaml"


# Rule values keyed by family name (the engine's own file serves two families, GLM-5 and DeepSeek-V3)
FAMILY_KEYED = (("draft_exclude",), ("shared_experts_fusion", "arch"), ("shared_experts_fusion", "draft_arch"))


@cache
def rule_file(name: str) -> RuleFile:
    """The rule file ``name``, checked against its schema and its per-family values' keys."""
    path = rules_path(name)
    file = load(path, RuleFile, "engine rule file", RuleFileError,
                "each rule kind and its keys are defined in quant/engines/rule_kinds.py",
                context={"roles": recipe_roles()})
    _check_family_keys(path, file)
    return file


def _check_family_keys(path: Path, file: RuleFile) -> None:
    """Each family a value is keyed by must be one this file's classes build: a folder copied for a
    new family that kept the original's key would otherwise fall silently to the default (no
    shared-expert fusion, the draft's exclude entries as they are)."""
    built = sorted(f.name for f in known_families() if f.engine_class.get(file.engine) in file.model_classes)
    for i, entry in enumerate(file.rule_sets):
        rules = entry.rules.model_dump(by_alias=True, exclude_unset=True)
        for rule, *keys in FAMILY_KEYED:
            value = (rules.get(rule) or {}).get("value")
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            for family in set(value or {}) - set(built):
                where = ".".join([f"rule_sets.{i}.rules.{rule}.value", *keys])
                raise RuleFileError(f"{path}: not a valid engine rule file: {where}: {nearest(family, built, 'family')}"
                                    f"; key it by a family that {', '.join(file.model_classes)} build")


class ReleaseWindow(Schema):
    """``manifests/engines/releases.yaml``: every registry release of each engine in the window read."""
    sglang: Annotated[list[Release], Field(min_length=1)]
    vllm: Annotated[list[Release], Field(min_length=1)]

    @model_validator(mode="after")
    def _sorted(self):
        for engine in ENGINES:
            listed = getattr(self, engine)
            if [Version(v) for v in listed] != sorted(Version(v) for v in listed) or len(set(listed)) != len(listed):
                raise ValueError(f"{engine}: list each release once, oldest first")
        return self


@cache
def window(engine: str) -> tuple[str, ...]:
    """Every registry release of ``engine`` in the window quantgate reads, oldest first."""
    file = load(manifests_root() / "engines" / "releases.yaml", ReleaseWindow, "release window", RuleFileError,
                "list each engine's registry releases, oldest first")
    return tuple(getattr(file, engine))


def _class_files(engine: str) -> list[str]:
    return [engine] + [f"{engine}.{family}" for family, folder in family_dirs().items()
                       if (folder / f"{engine}.yaml").is_file()]


def rules_file(engine: str, family: Family | str) -> str:
    """The rule file read for the family's model class in ``engine`` (exit 2 when none is)."""
    if isinstance(family, str):
        return _rules_file_named(engine, family)
    model_class = family.engine_class.get(engine)
    if model_class is None:
        raise UnknownEngine(f"family {family.name}: its manifest names no {engine} model class (engine_classes."
                            f"{engine}); read the class in the {engine} wheel and add it with its rule file")
    names = [name for name in _class_files(engine) if model_class in rule_file(name).model_classes]
    if len(names) > 1:  # which one the replay read would depend on the folders' order
        raise RuleFileError(f"family {family.name}: {' and '.join(str(rules_path(n)) for n in names)} both list its "
                            f"{engine} class {model_class}; a class's rules live in one file (a copied folder lists its "
                            "new family's class in model_classes)")
    if names:
        return names[0]
    raise UnknownEngine(f"family {family.name}: no {engine} rules were read for its model class {model_class} "
                        f"(no family folder's {engine}.yaml lists it); read that class's loading in the wheels "
                        f"and write {engine}.yaml in the family's folder before converting or checking this family")


@cache
def _rules_file_named(engine: str, family: str) -> str:
    return rules_file(engine, family_named(family))


def releases_read(engine: str, family: Family | str = DEFAULT_FAMILY) -> dict[str, str]:
    """Each release whose sources were read for the family's class -> the release its rule set is
    chosen by (itself, or the base of a ``.postN``)."""
    file = rule_file(rules_file(engine, family))
    return {**{v: v for v in file.checked}, **(file.post_releases or {})}


def _raw_sets(name: str) -> tuple[RuleSet, ...]:
    """A rule file's sets, each rule's value as plain data in the file's shape (what the replay reads)."""
    file = rule_file(name)
    values: dict = {}
    cites: dict = {}
    out = []
    for entry in file.rule_sets:
        for rule, stated in entry.rules.model_dump(by_alias=True, exclude_unset=True).items():
            values[rule], cites[rule] = stated["value"], stated["cite"]
        first, last = entry.versions
        out.append(RuleSet(file.engine, first, last, dict(values), dict(cites), model_class=file.model_classes[0]))
    return tuple(out)


@cache
def _rule_sets(name: str) -> tuple[RuleSet, ...]:
    """A rule file's sets; a model class's file takes the engine-wide rules (the quantization layer's
    matching, config schema and error text) from the engine file's set covering its span, which must
    not change inside the span, and must state every other rule itself."""
    engine = name.split(".", 1)[0]
    own = _raw_sets(name)
    if name == engine:
        return own
    base = _raw_sets(engine)
    shared = rule_file(engine).engine_wide or []
    out = []
    for rules in own:
        covering = [b for b in base if Version(b.first) <= Version(rules.last) and Version(b.last) >= Version(rules.first)]
        if not covering or any({k: b.values[k] for k in shared} != {k: covering[0].values[k] for k in shared}
                               for b in covering):
            raise UnknownEngine(f"{rules_path(name)}: {rules.first}..{rules.last} spans releases whose "
                                f"engine-wide rules ({', '.join(shared)}) differ in {engine}.yaml; split the set there")
        missing = sorted(set(base[-1].values) - set(shared) - set(rules.values))
        if missing:
            raise UnknownEngine(f"{rules_path(name)}: {rules.first}..{rules.last} does not state "
                                f"{', '.join(missing)}; read them for {rules.model_class} in the wheel")
        values = {**{k: covering[0].values[k] for k in shared}, **rules.values}
        cites = {**{k: covering[0].cites[k] for k in shared}, **rules.cites}
        out.append(replace(rules, values=values, cites=cites))
    return tuple(out)


def rule_sets(engine: str, family: Family | str = DEFAULT_FAMILY) -> tuple[RuleSet, ...]:
    """The rule sets read for the family's model class in ``engine``, oldest first."""
    return _rule_sets(rules_file(engine, family))


def cites_digest(name: str) -> str:
    """A digest of a rule file's rule sets (spans and every rule's cite, engine-wide ones included): the lock
    (``quant.engines.window``) holds the one it was computed for, so a changed cite or span shows it stale."""
    data = [[r.first, r.last, sorted(r.cites.items())] for r in _rule_sets(name)]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]


READ, CARRIED, NEEDS_READING, NOT_BUILT = "read", "carried", "needs reading", "not built"  # a release's states
REPLAYED = (READ, CARRIED)  # the states a replay answers for; the others are named, never guessed


def window_release(engine: str, version: str) -> str | None:
    """The window's spelling of ``version`` (``0.5.10.post1``, ``0.33.0``), None when it is not a registry
    release of the window (``version`` must parse: callers refuse one that does not, in their own words)."""
    wanted = Version(version)
    return next((v for v in window(engine) if Version(v) == wanted), None)


@dataclass(frozen=True)
class ReleaseState:
    """One window release for one family's class: ``read``, ``carried`` (not read; every symbol cited by the
    rule set of read release ``follows`` hashes identical in it), ``needs reading`` (``changed``: the rules and
    symbols whose source differs from read release ``follows``) or ``not built`` (the release registers no
    such class). ``rules_of``: the read release whose rule set a read or carried release replays."""
    release: str
    state: str
    follows: str | None = None
    changed: tuple[str, ...] = ()
    rules_of: str | None = None

    def as_dict(self) -> dict:
        return {**asdict(self), "changed": list(self.changed)}


def shown_path(name: str) -> Path:
    """The rule file as a maintainer types it: relative to the repository, or whole for a family
    folder outside it (``QUANTGATE_FAMILIES``)."""
    path = rules_path(name)
    return path.relative_to(manifests_root().parent) if path.is_relative_to(manifests_root().parent) else path


def lock_command(name: str) -> str:
    return f"python -m quant.engines.window lock {shown_path(name)}"


@cache
def _lock(name: str) -> dict | None:
    """The rule file's lock, None when missing or computed for other cites or another window (stale)."""
    path = rules_path(name).with_name(rules_path(name).stem + ".lock.yaml")
    if not path.is_file():
        return None
    lock = read_yaml(path, RuleFileError, f"regenerate it: {lock_command(name)}")
    engine = name.split(".", 1)[0]
    if not isinstance(lock, dict) or lock.get("cites") != cites_digest(name):
        return None
    try:
        hashes = {key: _expand(engine, ranges) for key, ranges in lock["hashes"].items()}
        classes = {c: _expand(engine, ranges) for c, ranges in lock["model_classes"].items()}
        sets = {tuple(s["versions"]): s["rules"] for s in lock["rule_sets"]}
    except (KeyError, ValueError, AttributeError, TypeError):
        return None
    if any(set(h) != set(window(engine)) for h in [*hashes.values(), *classes.values()]) or \
            any(key not in hashes for rules_ in sets.values() for keys in rules_.values() for key in keys):
        return None  # written for another window, or a merge of two locks
    return {"sets": sets, "hashes": hashes, "classes": classes}


def _expand(engine: str, ranges: dict[str, str]) -> dict[str, str]:
    """``{"first..last": value}`` over the window -> ``{release: value}``."""
    order = list(window(engine))
    out = {}
    for span, value in ranges.items():
        first, _, last = span.partition("..")
        out.update({r: value for r in order[order.index(first):order.index(last or first) + 1]})
    return out


def lock_stale(name: str) -> bool:
    return _lock(name) is None


def release_states(engine: str, family: Family | str = DEFAULT_FAMILY) -> dict[str, ReleaseState]:
    """Every window release of ``engine`` (oldest first) for the family's model class, with its state."""
    family = family_named(family) if isinstance(family, str) else family
    return _release_states(engine, family.name, rules_file(engine, family), family.engine_class[engine])


@cache
def _release_states(engine: str, family: str, name: str, model_class: str) -> dict[str, ReleaseState]:
    read = releases_read(engine, family)
    lock = _lock(name)
    order = list(window(engine))
    out = {}
    for release in order:
        if release in read:
            out[release] = ReleaseState(release, READ, read[release], rules_of=read[release])
        elif lock is None:
            out[release] = ReleaseState(release, NEEDS_READING, changed=(f"no current lock: {lock_command(name)}",))
        elif lock["classes"].get(model_class, {}).get(release) != "built":
            out[release] = ReleaseState(release, NOT_BUILT)
        else:
            out[release] = _compared(release, read, lock, order)
    return out


def _compared(release: str, read: dict[str, str], lock: dict, order: list[str]) -> ReleaseState:
    """Carried from the nearest read release (older first, then newer) whose rule set's cited symbols all hash
    identical in ``release``; else needs reading, naming what changed since the nearest older read release."""
    index = order.index(release)
    older = [r for r in order[:index] if r in read][-1:]
    newer = [r for r in order[index + 1:] if r in read][:1]
    verdict = None
    for other in older + newer:
        rule_set = next(s for s in lock["sets"] if Version(s[0]) <= Version(read[other]) <= Version(s[1]))
        # a symbol the read release lacks proves nothing (its cite was stated for another release)
        changed = tuple(f"{rule}: {key}" for rule, keys in lock["sets"][rule_set].items() for key in keys
                        if lock["hashes"][key][release] != lock["hashes"][key][other]
                        or lock["hashes"][key][other] == "absent")
        if not changed:
            return ReleaseState(release, CARRIED, other, rules_of=read[other])
        verdict = verdict or ReleaseState(release, NEEDS_READING, other, changed)
    return verdict or ReleaseState(release, NEEDS_READING, changed=("no release read",))


def releases_replayed(engine: str, family: Family | str = DEFAULT_FAMILY) -> dict[str, str]:
    """Each read or carried window release -> the read release whose rule set it replays (``.postN`` releases
    read outside the window included)."""
    states = release_states(engine, family)
    return {**releases_read(engine, family), **{r: s.rules_of for r, s in states.items() if s.rules_of}}


def clear_caches() -> None:
    """Forget the files read (after a lock or the window was rewritten in this process)."""
    for fn in (rule_file, window, _rules_file_named, _rule_sets, _lock, _release_states):
        fn.cache_clear()


def select(spec: str = "all", family: Family | str = DEFAULT_FAMILY) -> list[RuleSet]:
    """Rule sets for ``all``, ``sglang``, ``vllm`` or ``ENGINE==VERSION`` (the set covering the read
    release it replays: itself, or the read release it is carried from), for the family's model classes."""
    engine, _, version = spec.partition("==")
    engines = ENGINES if engine == "all" and not version else (engine,)
    if any(e not in ENGINES for e in engines):
        raise UnknownEngine(f"unknown engine {engine!r}; known: {', '.join(ENGINES)} (see gate checkpoint --list-engines)")
    if not version:
        return [r for e in engines for r in rule_sets(e, family)]
    try:
        Version(version)
    except InvalidVersion:
        raise UnknownEngine(f"{spec!r}: {version!r} is not a version (e.g. sglang==0.5.23)") from None
    replayed = releases_replayed(engine, family)
    release = next((v for v in replayed if Version(v) == Version(version)), None)
    if release is None:
        raise UnknownEngine(_not_replayed(engine, version, family))
    chosen = [r for r in rule_sets(engine, family) if r.covers(replayed[release])]
    if len(chosen) != 1:
        raise UnknownEngine(f"{engine} {version} was read but {len(chosen)} rule sets cover it; fix "
                            f"{rules_path(rules_file(engine, family))} (each release read belongs to "
                            "exactly one set)")
    return [replace(r, release=release) for r in chosen]


def _not_replayed(engine: str, version: str, family: Family | str) -> str:
    """Why ``engine==version`` cannot be replayed for the family: not a registry release of the window, a
    release that does not build its class, or one whose cited sources changed since the nearest read one."""
    name = family.name if isinstance(family, Family) else family
    model_class = rule_sets(engine, family)[0].model_class
    known = window(engine)
    states = release_states(engine, family)
    replayed = ", ".join(v for v, s in states.items() if s.state in REPLAYED) or "none"
    release = window_release(engine, version)
    if release is None:
        why = (f": it is not a registry release of the window ({known[0]}..{known[-1]}, manifests/engines/"
               "releases.yaml; python -m quant.engines.window refresh adds new ones)")
    elif states[release].state == NOT_BUILT:
        return (f"{engine} {version} does not build family {name}: it registers no {engine} class "
                f"{model_class}; the releases that build it and were read or carried over: {replayed}")
    elif states[release].follows:
        changed = dict.fromkeys(c.split(": ", 1)[0] for c in states[release].changed)
        why = f" (since {states[release].follows}, the sources its rules {', '.join(changed)} cite changed)"
    else:
        why = f" ({states[release].changed[0]})"
    return (f"{engine} {version} has not been read for family {name} ({engine} class {model_class}){why}; the "
            f"releases read or carried over for it are: {replayed} (read that release's sources for this class "
            f"and add it to {rules_path(rules_file(engine, family)).name}'s checked before trusting a replay of it)")
