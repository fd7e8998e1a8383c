"""Where quantize's output loads: every engine release the replay answers for (read, or carried over
by identical cited source), each replayed on the planned checkpoint, named as ranges of the release
window (``manifests/engines/releases.yaml``).

Without ``--serve`` the plan refuses what the newest release answered for of an engine would not load
(the recipe is at fault: no newer release is there to serve it), and warns about older releases that
fail, naming them and the ways out. ``--serve ENGINE==X`` names the releases the output is for: the
plan refuses what any of them would not load (exit 2, nothing written), and only warns about the rest.
Releases the replay cannot answer for are named, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

from packaging.version import InvalidVersion, Version

from quant.engines import Finding, RuleSet, UnknownEngine, quark_layers, select
from quant.engines.format_rules import cut
from quant.engines.rules import (
    ENGINES,
    release_states,
    releases_replayed,
    window,
    window_release,
)
from quant.errors import QuantgateError
from quant.layout import Family
from quant.quark_config import config_kind


class ServeError(QuantgateError, ValueError):
    """A ``--serve`` release that is not one, was not read, or would not load the output (exit code 2)."""


def parse_serve(spec: str) -> tuple[str, str]:
    """``ENGINE==X`` as (engine, the window's spelling of X); refused unless X is a registry release
    of the window quantgate reads."""
    engine, sep, version = spec.partition("==")
    if engine not in ENGINES:
        raise ServeError(f"--serve {spec}: unknown engine {engine!r}; name one of {', '.join(ENGINES)} and the "
                         f"release you serve, e.g. --serve sglang=={window('sglang')[-1]}")
    if not sep or not version:
        raise ServeError(f"--serve {spec}: name the release you serve, e.g. --serve {engine}=={window(engine)[-1]}")
    try:
        release = window_release(engine, version)
    except InvalidVersion:
        raise ServeError(f"--serve {spec}: {version!r} is not a version (e.g. {engine}=={window(engine)[-1]})") \
            from None
    if release is None:
        raise ServeError(f"--serve {spec}: {engine} {version} is not a registry release in the window quantgate "
                         f"reads ({engine} {window(engine)[0]} to {window(engine)[-1]}, manifests/engines/"
                         "releases.yaml); name one of those (a newer release is added to the window and read first)")
    return engine, release


def release_ranges(engine: str, releases) -> list[str]:
    """``releases`` as runs of consecutive window releases ('0.5.13-0.5.17', '0.33.0'), oldest first."""
    order = window(engine)
    listed = set(releases)
    runs: list[list[str]] = []
    previous = None
    for index, release in enumerate(order):
        if release not in listed:
            continue
        if runs and previous == index - 1:
            runs[-1].append(release)
        else:
            runs.append([release])
        previous = index
    outside = sorted(listed - set(order), key=Version)  # read, though not in the window file: named as they are
    return [run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs] + outside


def named(engine: str, releases) -> str:
    """'sglang 0.5.13-0.5.17, 0.5.20'."""
    return f"{engine} {', '.join(release_ranges(engine, releases))}"


@dataclass(frozen=True)
class Outcome:
    """One rule set replayed on the planned checkpoint, for the window releases that follow it."""
    rules: RuleSet
    releases: tuple[str, ...]
    findings: tuple[Finding, ...]  # what the release would not load (the MTP draft's included)
    fusion: tuple[Finding, ...]  # a fused shared expert in another dtype than its FusedMoE's slots
    without_draft: Callable[[], list[Finding]]  # the findings when the output is served without its MTP draft

    @property
    def loads(self) -> bool:
        return not self.findings and not self.fusion

    @cached_property
    def draft_only(self) -> bool:
        """Every finding goes away without the MTP draft (replayed again only where a message needs it)."""
        return not self.loads and not self.without_draft()


def rule_sets(family: Family, qconfig: dict) -> list[RuleSet]:
    """The family's rule sets, each cut by the spans of the per-layer Quark rules where ``qconfig`` has per-layer
    schemes: a release replays the rules its own quark.py was read into (``format_rules.cut``), as gate
    checkpoint does."""
    sets = select("all", family)
    if not (config_kind(qconfig) == "quark" and quark_layers.per_layer(qconfig)):
        return sets
    cuts = {id(c): c for rules in sets for release, base in releases_replayed(rules.engine, family).items()
            if rules.covers(base) for c in [cut(rules, quark_layers.KIND, release)]}
    return list(cuts.values())


def outcomes(family: Family, replayed: Callable[[RuleSet, bool], list[Finding]],
             sets: list[RuleSet] | None = None) -> list[Outcome]:
    """Each rule set read for the family's classes (``sets``: those, cut by ``rule_sets``), replayed with and
    (where something fails) without the MTP draft (``replayed(rules, with_draft)``)."""
    out = []
    for rules in sets if sets is not None else select("all", family):
        found = replayed(rules, True)
        releases = tuple(v for v, base in releases_replayed(rules.engine, family).items() if rules.covers(base))
        fusion = tuple(f for f in found if f.check == "fusion")
        findings = tuple(f for f in found if f.check != "fusion")
        out.append(Outcome(rules, releases, findings, fusion, partial(replayed, rules, False)))
    return out


def not_answered(engine: str, family: Family) -> dict[str, list[str]]:
    """The window releases the replay cannot answer for, by state: ``needs reading`` (a cited function
    changed, or no lock proves it unchanged) and ``not built`` (the release has no such model class)."""
    known = releases_replayed(engine, family)
    out: dict[str, list[str]] = {}
    for release, state in release_states(engine, family).items():
        if release not in known:
            out.setdefault(state.state, []).append(release)
    return out


def summary(results: list[Outcome], family: Family, serve: tuple[tuple[str, str], ...]) -> dict:
    """Per engine, the release ranges that load the output, fail, need reading and do not build the
    family's class (plan JSON; only the first two were replayed)."""
    out = {}
    for engine in ENGINES:
        mine = [o for o in results if o.rules.engine == engine]
        out[engine] = {"loads": release_ranges(engine, [v for o in mine if o.loads for v in o.releases]),
                       "fails": release_ranges(engine, [v for o in mine if not o.loads for v in o.releases]),
                       **{state.replace(" ", "_"): release_ranges(engine, rest)
                          for state, rest in not_answered(engine, family).items()},
                       "serve": [v for e, v in serve if e == engine]}
    return out


def ways_out(outcome: Outcome, results: list[Outcome], first: Finding) -> str:
    """The releases of the engine that load the output, serving without the draft where only the draft
    fails, and the finding's own fix (for a fused shared expert: the switch, or the recipe that stores it
    in its FusedMoE's dtype)."""
    loading = [v for o in results if o.rules.engine == outcome.rules.engine and o.loads for v in o.releases]
    ways = [f"serve {named(outcome.rules.engine, loading)}"] if loading else []
    if outcome.draft_only:
        ways.append("serve without the MTP draft (no speculative decoding: only the draft's modules fail)")
    if first.check == "fusion":
        ways.append("start sglang with --disable-shared-experts-fusion")
        if "meets the FusedMoE's" in first.why:  # a dtype clash (not a draft loader that never fills the slot)
            experts = "the MTP draft's" if outcome.draft_only else "each MoE layer's"
            ways[-1] += (f", or store {experts} shared and routed experts in one dtype (--shared-experts, "
                         "--mtp-experts)")
    else:
        ways.append(first.fix)
    return "; ".join(ways)


def check_serve(results: list[Outcome], family: Family, serve: tuple[tuple[str, str], ...],
                also: Callable[[RuleSet], list[Finding]] | None = None) -> None:
    """Refuse (exit 2) what a ``--serve`` release would not load, or a release neither read nor carried
    for the family; ``also(rules)``: what else that one release (``rules.release``) refuses to build."""
    for engine, release in serve:
        try:
            rules = select(f"{engine}=={release}", family)[0]
        except UnknownEngine as exc:
            raise ServeError(f"--serve {engine}=={release}: {exc}") from None
        outcome = next(o for o in results if o.rules.engine == engine and release in o.releases)
        found = list(outcome.findings + outcome.fusion)
        extra = also(rules) if also else []
        if not found and not extra:
            continue
        first = (found + extra)[0]
        more = len(found) + len(extra) - 1
        ways = ways_out(outcome, results, first) if found else first.fix
        raise ServeError(f"--serve {engine}=={release}: {engine} {release} would not load this output: "
                         f"{first.module}: {first.why}" + (f" (and {more} more)" if more else "")
                         + f". Ways out: {ways}")


def failing_newest(results: list[Outcome]) -> list[Finding]:
    """The findings of each engine's newest release answered for (none refuse under ``--serve``)."""
    newest = {}
    for outcome in results:
        if outcome.releases and (outcome.rules.engine not in newest or Version(outcome.rules.last) >=
                                 Version(newest[outcome.rules.engine].rules.last)):
            newest[outcome.rules.engine] = outcome
    return [f for o in newest.values() for f in o.findings]


def release_warnings(results: list[Outcome], family: Family) -> list[str]:
    """One warning per engine and failure (the same findings over a range of releases), naming the
    releases, what fails and the ways out; then the releases not read."""
    groups: dict[tuple, list[Outcome]] = {}
    for outcome in results:
        if outcome.findings:
            key = (outcome.rules.engine, tuple((f.module, f.why) for f in outcome.findings))
            groups.setdefault(key, []).append(outcome)
    warnings = []
    for (engine, _), group in groups.items():
        first = group[0].findings[0]
        more = len(group[0].findings) - 1
        releases = [v for o in group for v in o.releases]
        warnings.append(f"{named(engine, releases)} would not load this output: {first.module}: {first.why}"
                        + (f" (and {more} more)" if more else "")
                        + f". Ways out: {ways_out(group[0], results, first)}; --serve {engine}==X refuses it "
                          "for the release you serve")
    unread = [f"{named(engine, rest)} ({state})" for engine in ENGINES
              for state, rest in not_answered(engine, family).items()]
    if unread:
        warnings.append(f"not replayed for family {family.name}'s classes: {'; '.join(unread)}: whether a release "
                        "that needs reading loads this output is unknown, and one that does not build the class "
                        "cannot serve it (python -m quant.engines.window report names what changed)")
    return warnings


__all__ = ["Outcome", "ServeError", "check_serve", "failing_newest", "named", "not_answered", "outcomes",
           "parse_serve", "release_ranges", "release_warnings", "summary", "ways_out"]
