"""How each engine release loads a third-party quantization format (compressed-tensors, ModelOpt): the
format's rule file per engine (``manifests/engines/<format>.<engine>.yaml``), and the family rule sets cut
where the format's loading changed, so every release is replayed with its own format rules.

A format's loading is the engine's quantization layer, the same for every model class (like block FP8's
partition checks, ``quant.engines.block_partition``), so its rule spans are its own: they need not agree
with a family's. A family rule set that spans a format change is replayed once per part (``cut``), each part
named by its releases. A format module (``FORMAT_MODULES``) defines its rules' schema (``RULES``: each
field a ``rule_kinds.Rule``) and ``decide``, the engine's decision for one module it builds.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from functools import cache
from typing import Annotated

from packaging.version import Version
from pydantic import Field

from quant.engines.rule_kinds import Version as Release
from quant.engines.rules import RuleFileError, RuleSet, window
from quant.layout import manifests_root
from quant.schema import Schema, load, validate

# a third-party kind (quant.quark_config.format_kind) -> the module holding its RULES and decide
# quark-layers: a Quark checkpoint's per-layer schemes (the exclude list is the family rules')
FORMAT_MODULES = {"compressed-tensors": "quant.engines.compressed_tensors", "modelopt": "quant.engines.modelopt",
                  "quark-layers": "quant.engines.quark_layers"}


def key(kind: str) -> str:
    """Where a cut rule set keeps the format's rules (``values[key]``, cites ``f"{key}.{rule}"``) and the
    stem of its rule files: ``compressed_tensors``, ``modelopt``."""
    return kind.replace("-", "_")


@dataclass(frozen=True)
class Decision:
    """One engine release's decision for one module it builds from a third-party checkpoint."""
    scheme: str | None  # the scheme label (quant.third_party.scheme_label) it builds; None: unquantized
    why: str  # the mechanism in a finding's words: the entry or target that decided, the function cited
    fix: str = ""  # what to do where the checkpoint disagrees
    raises: str | None = None  # the release raises building this module (its message)
    unread: str | None = None  # what of the release's building of this module quantgate has not read (unknown)


class FormatEntry(Schema):
    """The releases ``versions: [first, last]`` (each registry release between them read) share these rules."""
    versions: Annotated[list[Release], Field(min_length=2, max_length=2)]
    rules: dict  # validated by the format module's RULES


class FormatFile(Schema):
    """``manifests/engines/<format>.<engine>.yaml``: one format's loading in one engine; rule sets oldest
    first, each listing what changed, together covering every release of the window."""
    format: str
    engine: str
    rule_sets: Annotated[list[FormatEntry], Field(min_length=1)]


@dataclass(frozen=True)
class FormatSpan:
    first: str
    last: str
    values: dict  # rule -> value, carried over from the sets before
    cites: dict

    def covers(self, release: str) -> bool:
        return Version(self.first) <= Version(release) <= Version(self.last)


def format_module(kind: str):
    return importlib.import_module(FORMAT_MODULES[kind])


def rules_path(kind: str, engine: str):
    return manifests_root() / "engines" / f"{key(kind)}.{engine}.yaml"


@cache
def format_spans(kind: str, engine: str) -> tuple[FormatSpan, ...] | None:
    """The format's rule spans in ``engine``, oldest first; None where no rule file was written (its
    loading was not read: the replay says so for every module)."""
    path = rules_path(kind, engine)
    if not path.is_file():
        return None
    compare = f"its rules are defined in {FORMAT_MODULES[kind].replace('.', '/')}.py (RULES)"
    file = load(path, FormatFile, "format rule file", RuleFileError, compare)
    if (file.format, file.engine) != (kind, engine):
        raise RuleFileError(f"{path}: says format {file.format!r}, engine {file.engine!r}; it holds {kind!r} in "
                            f"{engine!r} (the file's name)")
    schema = format_module(kind).RULES
    values: dict = {}
    cites: dict = {}
    spans = []
    for i, entry in enumerate(file.rule_sets):
        stated = validate(entry.rules, schema, path, f"format rule file (rule_sets.{i}.rules)", RuleFileError,
                          compare).model_dump(exclude_unset=True)
        for rule, rule_value in stated.items():
            values[rule], cites[rule] = rule_value["value"], rule_value["cite"]
        spans.append(FormatSpan(*entry.versions, dict(values), dict(cites)))
    _check_cover(path, engine, spans)
    return tuple(spans)


def _check_cover(path, engine: str, spans: list[FormatSpan]) -> None:
    """Spans oldest first, no window release in two of them (it would be replayed with whichever came first).
    A release in none (one the window gained since the file was read) is replayed as not read."""
    if [Version(s.first) for s in spans] != sorted(Version(s.first) for s in spans):
        raise RuleFileError(f"{path}: rule sets must be oldest first")
    for release in window(engine):
        if len([s for s in spans if s.covers(release)]) > 1:
            raise RuleFileError(f"{path}: {engine} {release} is covered by more than one rule set; each release "
                                "belongs to one: fix the spans")


def unread(kind: str, engine: str) -> list[str]:
    """The window releases of ``engine`` no span of the format's rule file covers (all where there is no file)."""
    spans = format_spans(kind, engine) or ()
    return [r for r in window(engine) if not any(s.covers(r) for s in spans)]


_CUTS: dict[tuple, RuleSet] = {}  # one object per cut: the replay memoizes on the identity of its values


def cut(rules: RuleSet, kind: str, release: str) -> RuleSet:
    """``rules`` (a family rule set, replaying ``release``) with the format rules of the span covering
    ``release`` under ``values[key(kind)]`` (None: not read in this engine), narrowed to the releases the
    two share, so releases replayed with other format rules get another rule set (another id)."""
    spans = format_spans(kind, rules.engine)
    span = next((s for s in spans if s.covers(release)), None) if spans else None
    memo = (rules.id, kind, span and span.first)
    if memo not in _CUTS:
        values, cites = {**rules.values, key(kind): span and span.values}, dict(rules.cites)
        first, last = rules.first, rules.last
        if span is not None:
            cites.update({f"{key(kind)}.{rule}": cite for rule, cite in span.cites.items()})
            first = max(first, span.first, key=Version)
            last = min(last, span.last, key=Version)
            if Version(first) > Version(last):  # a carried release outside its rule set's span: on its own
                first = last = release
        _CUTS[memo] = replace(rules, first=first, last=last, values=values, cites=cites)
    return _CUTS[memo]


def clear_caches() -> None:
    format_spans.cache_clear()
    _CUTS.clear()


__all__ = ["Decision", "FORMAT_MODULES", "FormatSpan", "clear_caches", "cut", "format_module",
           "format_spans", "key", "unread"]
