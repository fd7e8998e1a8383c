"""The one renderer of an accuracy result: the same table and notes for the CLI, report.md and
the dashboard (a score with its interval, a delta with its bounds, each written one way)."""

from __future__ import annotations

CONVENTION = ("Scores in percent, deltas, bounds and margins in percentage points (pts). Scores: mean over items (repeats averaged per item) with a two-sided 95% Wilson interval; tau2: the "
              "macro (mean of per-domain pass^1) with a 95% interval from resampling tasks within domains. Delta: "
              "paired (candidate - reference, same items); bounds: one-sided at the policy's confidence, exact for "
              "one 0/1 outcome per item (the exact unconditional test on Tango's statistic, both discordant counts), "
              "else a BCa paired bootstrap (resampling items; tau2 within domains), with the loss rate's exact "
              "Clopper-Pearson bound where few items lost and it is more conservative (each benchmark names its "
              "method).")
COLUMNS = ("eval", "filter", "items x repeats", "reference", "candidate", "delta", "one-sided bounds", "margin",
           "verdict")


def _num(x: float | None, fmt: str = ".4f") -> str:
    """A number as written everywhere; undefined (None from strict JSON, or NaN) as ``-``."""
    return "-" if x is None or x != x else format(x, fmt)


def pct(x: float | None) -> str:
    """A score as a percentage, one decimal (``96.5%``)."""
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def points(x: float | None) -> str:
    """A difference of scores in percentage points, two decimals, signed (``-1.05 pts``)."""
    return "-" if x is None or x != x else f"{100 * x:+.2f} pts"


def score(s: dict) -> str:
    """``96.5% [93.9, 99.1]``: a score with its two-sided 95% interval, in percent."""
    return f"{pct(s['score'])} [{_num(_100(s['ci_low']), '.1f')}, {_num(_100(s['ci_high']), '.1f')}]"


def _100(x: float | None) -> float | None:
    return None if x is None else 100 * x


AT_THE_MARGIN = "at the margin"


def versus(x: float, edge: float, digits: int = 4) -> str:
    """``x`` signed with the fewest decimals (from ``digits``, up to 8) that tell it apart from ``edge``,
    so a bound a hair from the margin never prints as the margin (``-0.02497``, not ``-0.0250``
    against ``-0.025``); one that equals it says so."""
    for d in range(digits, 9):
        if format(x, f"+.{d}f") != format(edge, f"+.{d}f"):
            return format(x, f"+.{d}f")
    return f"{x:+.{digits}f} ({AT_THE_MARGIN})"


def bounds(b: dict) -> str:
    """``[lower, upper] pts``, each with the digits it takes to compare it with -margin honestly."""
    edge = -100 * b["margin"]
    return f"[{versus(100 * b['lower'], edge, 2)}, {versus(100 * b['upper'], edge, 2)}] pts"


def table(accuracy: dict) -> list[dict]:
    """One row per benchmark, every cell a string, keyed by ``COLUMNS``."""
    return [dict(zip(COLUMNS, ("tau2 macro" if b["benchmark"] == "tau2" else b["benchmark"], b["filter"],
                               f"{b['n_items']} x {b['repeats']}", score(b["reference"]), score(b["candidate"]),
                               points(b["delta"]), bounds(b), points(-b["margin"]), b["verdict"])))
            for b in accuracy["benchmarks"]]


def notes(b: dict) -> list[str]:
    """What decided a benchmark's verdict and what else the comparison shows."""
    out = [f"rule: {b['rule']}"]
    if b.get("bound_method") and b["bound_method"] not in b["rule"]:
        out.append(f"bounds: {b['bound_method']}")
    if b["mcnemar_p"] is not None:
        out.append(f"discordant: reference-only {b['discordant_ref_only']}, candidate-only "
                   f"{b['discordant_cand_only']}, exact McNemar p = {b['mcnemar_p']:.4f}")
    if b.get("guidance"):
        out.append(guidance(b["guidance"]))
    if b["noise"]:
        out.append(f"noise floor: the reference rerun differs on {b['noise']['reference_self_discordant']} items, "
                   f"the candidate on {b['noise']['candidate_discordant']}: "
                   f"{'within noise' if b['noise']['within_noise'] else 'beyond noise'}")
    if b.get("infra"):
        infra = b["infra"]
        dropped = infra.get("dropped_pairs")
        out.append("infrastructure errors: " + ", ".join(
            f"{arm} {infra[arm]['errors']}/{infra[arm]['simulations']}"
            + (f" ({infra[arm]['retries']} retried)" if infra[arm].get("retries") else "")
            for arm in ("reference", "candidate"))
            + (f"; {dropped} (task, trial) pairs dropped from both arms ("
               + ", ".join(f"{d} {n}" for d, n in infra["dropped_by_domain"].items()) + ")" if dropped else ""))
    if b["per_stratum"] and b["benchmark"] != "tau2":  # tau2's domains get rows of their own
        out.append("per seed (repeat): " + ", ".join(
            f"{k}: {v['reference']:.3f} -> {v['candidate']:.3f}" for k, v in b["per_stratum"].items()))
    if b.get("setting_differences"):
        out.append("COMPARED ACROSS DIFFERENT SETTINGS (--allow-setting-differences): " +
                   "; ".join(d.split(": ", 1)[1] for d in b["setting_differences"]))
    return out


def _power(p: float) -> str:
    """A power as a whole percent that never rounds a chance of failing away (0.996 is '>99%', not '100%')."""
    return ">99%" if 0.99 < p < 1 else "<1%" if 0 < p < 0.01 else f"{p:.0%}"


def guidance(g: dict) -> str:
    """What it takes from here to decide an INCONCLUSIVE result (``stats.guidance``): a design the run
    does not have yet, with its conditional power at the observed delta and at 0, or why none
    would; always the margin the data certify now. Where no item differed the power is at the rate the
    data leave plausible, said so, or none is promised; a greedy run is never told to repeat."""
    size, n, r, m = g["benchmark_items"] or g["n_items"], g["n_items"], g["repeats"], g["margin"]
    at = f"at the observed delta {g['observed_delta']:+.4f}"
    design = f"{g['design_items']} items x {g['design_repeats']}"
    unmeasured = f"none of these {n} items differed, so how often items differ is unmeasured"
    rate = g.get("assumed_discordance")
    if g["power_at_observed"] is None:
        power = ""
    elif rate is not None:  # the observed delta is 0 and so is the delta the power is taken at
        power = (f"{_power(g['power_at_observed'])} power were items to differ {rate:.1%} of the time ({unmeasured}; "
                 f"{rate:.1%} is the most the data leave plausible, and fewer only raise the power)")
    else:
        power = f"{_power(g['power_at_observed'])} power {at}, {_power(g['power_at_zero'])} were the true delta 0"
    if g["action"] == "loss":
        out = (f"the observed delta {versus(g['observed_delta'], -m)} is beyond the margin -{m}: more data would more likely "
               f"FAIL it than pass it" + (f" ({design}: {power})" if power else ""))
    elif g["action"] == "items" and not power:
        out = (f"at least {g['items_needed'] - n} more items ({g['items_needed']} of the benchmark's {size}) at {r} "
               f"repeat{'s' if r > 1 else ''}: the fewest that could certify {m} were none of them to differ; "
               f"{unmeasured}: no power is promised")
    elif g["action"] == "items":
        out = (f"{g['items_needed'] - n} more items ({g['items_needed']} of the benchmark's {size}) at {r} "
               f"repeat{'s' if r > 1 else ''} would reach {power}")
    elif g["action"] == "repeats":
        out = (f"all {g['items_needed']} items at {g['repeats_needed']} repeats (now {n} x {r}, same temperature) would "
               f"reach {power}")
    elif g["action"] == "second_repeat":
        out = ((f"{design} would not reach it ({power}); " if power else f"the benchmark has no items beyond these {n}; ")
               + "with one repeat the noise between repeats is unknown: run a second repeat (another seed, same "
               "temperature) to learn whether repeats would decide it")
    elif g.get("greedy"):
        out = ("repeats at temperature 0 (greedy) reproduce the answers, so only more items add information"
               + (f", and all {g['design_items']} items would reach only {power}" if power else
                  f", and the benchmark has no items beyond these {n}")
               + f"; the most it could certify there is about {g['best_margin']:.3f}")
    else:
        out = (f"no number of repeats on {size} items certifies {m} {at}" + (f" ({design}: {power})" if power else "")
               + f"; the most it could certify there is about {g['best_margin']:.3f}")
    return out + f"; the data certify a margin of {g['certified_margin']:.3f} (the one-sided lower bound, rounded up)"


def caveats(accuracy: dict) -> list[str]:
    """Lines that qualify the whole comparison; they head every rendering."""
    out = []
    if accuracy.get("setting_differences"):
        out.append("NOT LIKE FOR LIKE: the runs measured differently and were compared anyway "
                   "(--allow-setting-differences); see each benchmark's notes")
    if accuracy.get("scope"):
        out.append(f"scope: only {', '.join(accuracy['scope'])} compared (--benchmarks); not a release verdict")
    return out


def text(accuracy: dict) -> str:
    """The CLI's table: aligned columns, notes under each benchmark, then the verdict."""
    rows = table(accuracy)
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in COLUMNS}
    line = lambda cells: "  ".join(cells[c].ljust(widths[c]) for c in COLUMNS).rstrip()  # noqa: E731
    out = [*caveats(accuracy), line({c: c for c in COLUMNS})]
    for row, b in zip(rows, accuracy["benchmarks"]):
        out += [line(row), *domain_lines(b), *[f"    {n}" for n in notes(b)]]
    out.append(CONVENTION)
    for u in accuracy.get("unpaired") or []:
        out.append(f"UNPAIRED vs published {u['benchmark']}: {u['candidate']:.4f} vs {u['reference']:.4f}, delta "
                   f"{u['delta']:+.4f}" + (f", 95% CI [{u['ci95'][0]:+.3f}, {u['ci95'][1]:+.3f}]"
                                           if u["se"] == u["se"] else "") + " (summary scores only: weaker)")
    each = ", ".join(f"{b['benchmark']} {b['verdict']}" + ("" if b["required"] else " (optional)")
                     for b in accuracy["benchmarks"])
    blocking = accuracy["blocking"]
    out.append(f"verdict: {accuracy['verdict']} [{each}]" + (f" ({'; '.join(blocking)})" if blocking else ""))
    return "\n".join(out)


def domain_lines(b: dict) -> list[str]:
    """tau2: one line per domain under the macro (n, both scores with intervals, delta and bounds)."""
    if b["benchmark"] != "tau2":
        return []
    out = []
    for domain, d in (b["per_stratum"] or {}).items():
        (rl, rh), (cl, ch) = d["reference_ci"], d["candidate_ci"]
        out.append(f"  {domain:<12} {d['n']:>5} {d['reference']:.4f} [{rl:.4f}, {rh:.4f}] {d['candidate']:.4f} "
                   f"[{cl:.4f}, {ch:.4f}] {d['delta']:+.4f} [{d['lower']:+.4f}, {d['upper']:+.4f}]")
    return out


def markdown(accuracy: dict) -> list[str]:
    """report.md's accuracy section."""
    out = [f"> **{c}**" for c in caveats(accuracy)]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(f"**{r[c]}**" if c == "verdict" else r[c] for c in COLUMNS) + " |"
            for r in table(accuracy)]
    out += ["", CONVENTION, ""]
    for b in accuracy["benchmarks"]:
        out += [f"**{b['benchmark']}**: " + "; ".join(notes(b)), ""]
    return out
