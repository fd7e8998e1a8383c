"""``gate checkpoint`` over the release window: which rule set answers for each registry release of an
engine, what each release is reported as, and the MoE shape it runs (named as release ranges by
``quant.release_check.named``).

Each release of the window (``manifests/engines/releases.yaml``) is in one state for a family's model
class: **read** (its sources were read: a rule set covers it), **carried** (not read, but every source
its rules cite is identical to a read release's: it follows that release's rules), **needs reading**
(a cited function changed) or **not built** (the release has no such model class). Only read and
carried releases are replayed; the others are named, never guessed, so a verdict over them is
qualified.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from quant.engines.rules import (
    ENGINES,
    RuleSet,
    UnknownEngine,
    releases_read,
    rule_sets,
    select,
    window,
)
from quant.layout import Family

READ, CARRIED, NEEDS_READING, NOT_BUILT = "read", "carried", "needs reading", "not built"
REPLAYED = (READ, CARRIED)
# the config keys the engines read the routed experts per token from (DeepSeek/Qwen style, gpt-oss)
TOPK_KEYS = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class ReleaseState:
    release: str
    state: str  # read | carried | needs reading | not built
    follows: str | None = None  # the read release whose rules replay it (itself, a .postN's base, or carried from)
    detail: str = ""  # carried: from which release; needs reading: what changed


@dataclass(frozen=True)
class Target:
    """One release ``gate checkpoint`` answers for, and the rule set replayed for it (None: not replayed)."""
    engine: str
    state: ReleaseState
    rules: RuleSet | None


@dataclass(frozen=True)
class ReleaseResult:
    """One release's place in a ``gate checkpoint`` report."""
    engine: str
    release: str
    state: str  # read | carried | needs reading | not built
    rules: str | None  # the id of the rule set replayed for it (its findings' ``engine``); None: not replayed
    detail: str = ""


def window_states(engine: str, family: Family) -> list[ReleaseState]:
    """Every window release of ``engine`` in its state for the family's model class, oldest first."""
    read = releases_read(engine, family)
    by_version = {Version(v): v for v in read}
    out = []
    for release in window(engine):
        match = by_version.get(Version(release))
        if match is None:
            out.append(ReleaseState(release, NEEDS_READING, detail="not read for this model class"))
        else:
            out.append(ReleaseState(release, READ, read[match]))
    return out


def _covering(engine: str, family: Family, follows: str) -> RuleSet:
    chosen = [r for r in rule_sets(engine, family) if r.covers(follows)]
    if len(chosen) != 1:
        raise UnknownEngine(f"{engine} {follows}: {len(chosen)} rule sets cover it for family {family.name}; each "
                            "release read belongs to exactly one set")
    return chosen[0]


def targets(spec: str, family: Family) -> list[Target]:
    """The releases ``spec`` asks for (``all``, ``sglang``, ``vllm``, ``ENGINE==VERSION``), each with the
    rule set that replays it. A release named alone must be in the window and read or carried (exit 2
    otherwise); an engine none of whose releases is read or carried for the family is refused."""
    engine, _, version = spec.partition("==")
    if version:
        states = {Version(s.release): s for s in window_states(engine, family)} if engine in ENGINES else {}
        state = states.get(_version(spec, version))
        if state is None and engine in ENGINES:
            raise UnknownEngine(f"{engine} {version} is not a registry release in the window quantgate reads "
                                f"({window(engine)[0]}..{window(engine)[-1]}, manifests/engines/releases.yaml); "
                                "name one of those")
        chosen = select(spec, family)  # refuses an unknown engine and a release not read, naming what was read
        return [Target(engine, state, chosen[0])]
    engines = ENGINES if engine == "all" else (engine,)
    select(spec, family)  # an unknown engine is refused the same way as ever
    out = [Target(e, s, _covering(e, family, s.follows) if s.state in REPLAYED else None)
           for e in engines for s in window_states(e, family)]
    if not any(t.rules for t in out):
        raise UnknownEngine(f"family {family.name}: no release of {' or '.join(engines)} in the window is read or "
                            "carried for its model class; nothing can be replayed")
    return out


def _version(spec: str, version: str) -> Version:
    try:
        return Version(version)
    except ValueError:
        raise UnknownEngine(f"{spec!r}: {version!r} is not a version (e.g. sglang==0.5.23)") from None


def moe_shape(text: dict, family: Family, fused_shared: int) -> dict | None:
    """The MoE one layer runs as the engine builds it: routed experts (+ a fused shared expert as one
    more) and experts per token (+ the fused one); None for a config without routed experts."""
    routed = next((text[k] for k in family.experts_keys if isinstance(text.get(k), int)), None)
    topk = next((text[k] for k in TOPK_KEYS if isinstance(text.get(k), int)), None)
    if routed is None or topk is None:
        return None
    return {"experts": routed + fused_shared, "topk": topk + fused_shared, "fused_shared": fused_shared}


def shape_label(shape: dict) -> str:
    return f"{shape['experts']} experts, top-{shape['topk']}"
