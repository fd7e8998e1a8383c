"""The one renderer of an accuracy result: the same table and notes for the CLI, report.md and
the dashboard (a score with its interval, a delta with its bounds, each written one way)."""

from __future__ import annotations

CONVENTION = ("Scores: mean over items (repeats averaged per item) with a two-sided 95% Wilson interval; tau2: the "
              "macro (mean of per-domain pass^1) with a 95% interval from resampling tasks within domains. Delta: "
              "paired (candidate - reference, same items); bounds: one-sided BCa paired bootstrap "
              "(resampling items; tau2 within domains) at the policy's confidence, or the exact Clopper-Pearson "
              "bound on the loss rate where few items lost and it is more conservative (each benchmark names its "
              "method).")
COLUMNS = ("eval", "filter", "items x repeats", "reference", "candidate", "delta", "one-sided bounds", "margin",
           "verdict")


def _num(x: float | None, fmt: str = ".4f") -> str:
    """A number as written everywhere; undefined (None from strict JSON, or NaN) as ``-``."""
    return "-" if x is None or x != x else format(x, fmt)


def score(s: dict) -> str:
    """``0.9650 [0.9393, 0.9907]``: a score with its two-sided interval."""
    return f"{_num(s['score'])} [{_num(s['ci_low'])}, {_num(s['ci_high'])}]"


def bounds(b: dict) -> str:
    return f"[{b['lower']:+.4f}, {b['upper']:+.4f}]"


def table(accuracy: dict) -> list[dict]:
    """One row per benchmark, every cell a string, keyed by ``COLUMNS``."""
    return [dict(zip(COLUMNS, ("tau2 macro" if b["benchmark"] == "tau2" else b["benchmark"], b["filter"], f"{b['n_items']} x {b['repeats']}", score(b["reference"]),
                               score(b["candidate"]), f"{b['delta']:+.4f}", bounds(b), f"-{b['margin']}",
                               b["verdict"]))) for b in accuracy["benchmarks"]]


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
            f"{arm} {infra[arm]['errors']}/{infra[arm]['simulations']}" for arm in ("reference", "candidate"))
            + (f"; {dropped} (task, trial) pairs dropped from both arms ("
               + ", ".join(f"{d} {n}" for d, n in infra["dropped_by_domain"].items()) + ")" if dropped else ""))
    if b["per_stratum"] and b["benchmark"] != "tau2":  # tau2's domains get rows of their own
        out.append("per seed (repeat): " + ", ".join(
            f"{k}: {v['reference']:.3f} -> {v['candidate']:.3f}" for k, v in b["per_stratum"].items()))
    if b.get("setting_differences"):
        out.append("COMPARED ACROSS DIFFERENT SETTINGS (--allow-setting-differences): " +
                   "; ".join(d.split(": ", 1)[1] for d in b["setting_differences"]))
    return out


def guidance(g: dict) -> str:
    """What would decide an INCONCLUSIVE result, never more items than the benchmark has
    (``stats.guidance``): the items, else the repeats, and the margin the data certifies."""
    size = g["benchmark_items"]
    if not g["exceeds_benchmark"]:
        return (f"about {g['items_needed']} items would decide it at this per-item spread (80% power)"
                + (f"; the benchmark has {size}" if size else ""))
    out = f"more items than the benchmark's {size} would be needed at this spread; "
    if g["repeats"] < 2:
        out += ("with one repeat the noise between repeats is unknown: run a second repeat (another seed, same "
                "temperature) to learn whether repeats would decide it")
    elif g["repeats_needed"]:
        out += (f"{g['repeats_needed']} repeats per item at the same temperature (now {g['repeats']}) would reach the "
                f"same power on all {size} (estimated from the disagreement between repeats)")
    else:
        out += (f"no number of repeats would: the items differ beyond the noise between repeats (at best a margin of "
                f"{g['floor_margin']:.3f} with many repeats)")
    return out + f"; the current data certifies a margin of {g['certifiable_margin']:.3f} (one-sided lower bound)"


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
