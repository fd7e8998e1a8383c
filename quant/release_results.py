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

from packaging.version import InvalidVersion

from quant.engines.rules import (
    CARRIED,
    ENGINES,
    NEEDS_READING,
    NOT_BUILT,
    REPLAYED,
    ReleaseState,
    RuleSet,
    UnknownEngine,
    release_states,
    rule_sets,
    select,
    window,
    window_release,
)
from quant.layout import Family

# the config keys the engines read the routed experts per token from (DeepSeek/Qwen style, gpt-oss)
TOPK_KEYS = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class ReleaseResult:
    """One release's place in a ``gate checkpoint`` report."""
    engine: str
    release: str
    state: str  # read | carried | needs reading | not built
    rules: str | None  # the id of the rule set replayed for it (its findings' ``engine``); None: not replayed
    detail: str = ""  # carried: from which read release; needs reading: what changed since which


@dataclass(frozen=True)
class Target:
    """One release ``gate checkpoint`` answers for, and the rule set replayed for it (None: not replayed)."""
    engine: str
    state: ReleaseState
    rules: RuleSet | None

    model_class: str = ""

    def result(self) -> ReleaseResult:
        return ReleaseResult(self.engine, self.state.release, self.state.state, self.rules and self.rules.id,
                             detail(self.state, self.model_class))


def detail(state: ReleaseState, model_class: str) -> str:
    """Why a release is carried or not replayed, in a few words (``python -m quant.engines.window report``
    names every rule and symbol)."""
    if state.state == CARRIED:
        return f"carried from {state.follows}: every source its rules cite is identical"
    if state.state == NOT_BUILT:
        return f"the release registers no {model_class}"
    if state.state == NEEDS_READING and state.follows:
        return f"a source its rules cite changed since {state.follows}"
    return "; ".join(state.changed)


def check_spec(spec: str) -> None:
    """Refuse an unknown engine, a version that is not one, or a release outside the window, before
    anything is read (whether a release is read depends on the checkpoint's family)."""
    engine, _, version = spec.partition("==")
    if engine not in (*ENGINES, "all") or (engine == "all" and version):
        raise UnknownEngine(f"unknown engine {engine!r}; known: {', '.join(ENGINES)} (see gate checkpoint "
                            "--list-engines)")
    if not version:
        return
    try:
        release = window_release(engine, version)
    except InvalidVersion:
        raise UnknownEngine(f"{spec!r}: {version!r} is not a version (e.g. sglang==0.5.23)") from None
    if release is None:
        raise UnknownEngine(f"{engine} {version} is not a registry release in the window quantgate reads "
                            f"({window(engine)[0]}..{window(engine)[-1]}, manifests/engines/releases.yaml); "
                            "name one of those")


def _covering(engine: str, family: Family, rules_of: str) -> RuleSet:
    return next(r for r in rule_sets(engine, family) if r.covers(rules_of))


def targets(spec: str, family: Family) -> list[Target]:
    """The releases ``spec`` asks for (``all``, ``sglang``, ``vllm``, ``ENGINE==VERSION``), each with the
    rule set that replays it. A release named alone must be read or carried for the family (exit 2
    otherwise, naming its state); an engine none of whose releases is read or carried is refused."""
    check_spec(spec)
    engine, _, version = spec.partition("==")
    if version:
        state = release_states(engine, family)[window_release(engine, version)]
        # select refuses one not replayed, naming its state
        return [Target(engine, state, select(spec, family)[0], family.engine_class[engine])]
    engines = ENGINES if engine == "all" else (engine,)
    out = [Target(e, s, _covering(e, family, s.rules_of) if s.state in REPLAYED else None, family.engine_class[e])
           for e in engines for s in release_states(e, family).values()]
    if not any(t.rules for t in out):
        raise UnknownEngine(f"family {family.name}: no release of {' or '.join(engines)} in the window is read or "
                            "carried for its model class; nothing can be replayed")
    return out


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
