"""``gate plan``: items x repeats per benchmark before the run, with its sequential looks fixed."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from evals._cli.common import dumps, margins
from evals.errors import EXIT_BLOCK, EXIT_PASS, BadInput

HELP = """\
Design the runs before making them. Per benchmark of the policy: the fewest answers (items x
repeats; tau2: tasks x trials) whose gate passes a candidate that is truly --drop worse than the
reference with --power, never more items than the benchmark has; the looks (one after each
repeat) with their Lan-DeMets O'Brien-Fleming levels at the planned information (the gate spends
alpha on the information each look observed), so a run can stop early (`evals run
--until-decided`) without raising the false pass rate; the margin the design certifies at that
power; GPU hours where --throughput is given. tau2 designs run every task (only trials vary).
A one-outcome design's power (GSM8K, 1 repeat) is exact: the gate's rule summed over every
outcome. When no design within the limits certifies the policy's margin, it says so and gives the
margin the largest design certifies.

Variance per item comes from a pilot (--pilot-reference [--pilot-candidate]: bundles of a small
run) or from stated assumptions (--between/--within; defaults in evals/judge/design.py, printed).

examples:
  gate plan                                            # the release policy, drop 0.01, power 0.8
  gate plan --drop gpqa_diamond=0.02 --max-repeats gpqa_diamond=16 --throughput 2000 --out plan.yaml
  gate plan --pilot-reference runs/fp8-pilot --pilot-candidate runs/mxfp4-pilot --json
  evals run --plan plan.yaml ...                       # the run records its plan; the gate checks it

exit codes: 0 every benchmark has a design that reaches the power; 1 some has none (the plan is
still printed and written: it shows the best there is); 2 bad input"""


def register(sub) -> None:
    p = sub.add_parser("plan", help="items x repeats per benchmark for a target power, with sequential looks",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", help="gate policy: a shipped one by name (release, arith-example; default: release), "
                                     "or a file by its path (./my-policy.yaml: a slash or a .yaml/.yml suffix)")
    p.add_argument("--benchmarks", metavar="B1,B2", help="plan only these (default: the policy's benchmarks)")
    p.add_argument("--margin", action="append", default=[], metavar="BENCH=VALUE", help="override a margin")
    p.add_argument("--drop", action="append", default=[], metavar="[BENCH=]VALUE",
                   help="the plausible true drop (reference - candidate) to have power against (default 0.01)")
    p.add_argument("--power", type=float, default=0.8, help="target power (default %(default)s)")
    p.add_argument("--max-repeats", action="append", default=[], metavar="BENCH=R",
                   help="repeats allowed (default gsm8k 1 (greedy), gpqa_diamond 8, tau2 8 trials; at most 16)")
    p.add_argument("--items", action="append", default=[], metavar="BENCH=N",
                   help="items available if fewer than the benchmark has (never more)")
    p.add_argument("--between", action="append", default=[], metavar="BENCH=V",
                   help="stated variance of the items' true paired deltas")
    p.add_argument("--within", action="append", default=[], metavar="BENCH=V",
                   help="stated variance of one repeat's paired delta about its item's (sampling noise)")
    p.add_argument("--pilot-reference", type=Path, help="a pilot run bundle of the reference")
    p.add_argument("--pilot-candidate", type=Path, help="a pilot run bundle of a candidate, paired with the reference")
    p.add_argument("--throughput", action="append", default=[], metavar="[BENCH=]ANSWERS",
                   help="answers per GPU hour per arm, for the GPU-time estimate")
    p.add_argument("--fixed", action="store_true", help="one look at the end (no early stopping)")
    p.add_argument("--out", type=Path, help="write the plan here (.yaml/.yml as YAML, else JSON)")
    p.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    p.set_defaults(func=run)


def _per_bench(items: list[str], flag: str, benchmarks: list[str], cast=float) -> dict:
    """``BENCH=V`` items (a bare ``V`` applies to every benchmark) as a mapping."""
    out = {}
    for item in items:
        bench, sep, value = item.rpartition("=")
        try:
            v = cast(value)
        except ValueError:
            raise BadInput(f"{flag} {item!r}: expected [BENCH=]VALUE, e.g. {flag} gsm8k=0.01") from None
        if sep and bench not in benchmarks:
            raise BadInput(f"{flag} {item!r}: {bench} is not planned here ({', '.join(benchmarks)})")
        for b in ([bench] if sep else benchmarks):
            out[b] = v
    return out


def run(args: argparse.Namespace) -> int:
    from evals.judge.design import (
        DEFAULT_ASSUMPTIONS,
        DEFAULT_DROP,
        MAX_REPEATS,
        Assumptions,
        design,
        make_plan,
        pilot_assumptions,
        write_plan,
    )
    from evals.judge.gate import BENCHMARK_ITEMS
    from evals.judge.policy import load_policy
    from evals.judge.stats import MAX_REPEATS as MOST_REPEATS

    policy = load_policy(args.policy).with_margins(margins(args.margin))
    benchmarks = [b for b in (args.benchmarks or "").split(",") if b] or sorted(policy.benchmarks)
    unknown = [b for b in benchmarks if b not in BENCHMARK_ITEMS]
    if unknown:
        raise BadInput(f"--benchmarks: {unknown} unknown; plannable: {sorted(BENCHMARK_ITEMS)}")
    if not 0.5 <= args.power < 1:
        raise BadInput(f"--power {args.power}: a power in [0.5, 1), e.g. 0.8")
    if args.pilot_candidate and not args.pilot_reference:
        raise BadInput("--pilot-candidate needs --pilot-reference (the pilot's two arms are paired)")
    drops = _per_bench(args.drop, "--drop", benchmarks)
    repeats = _per_bench(args.max_repeats, "--max-repeats", benchmarks, int)
    items = _per_bench(args.items, "--items", benchmarks, int)
    between, within = _per_bench(args.between, "--between", benchmarks), _per_bench(args.within, "--within", benchmarks)
    throughput = _per_bench(args.throughput, "--throughput", benchmarks)
    for flag, values in (("--drop", drops), ("--between", between), ("--within", within)):
        if any(not 0 <= v < 1 for v in values.values()):
            raise BadInput(f"{flag}: values lie in [0, 1)")
    if any(v < 1 for v in (*repeats.values(), *items.values())) or any(v <= 0 for v in throughput.values()):
        raise BadInput("--max-repeats, --items and --throughput take positive values")
    for bench, r in repeats.items():  # each repeat is a look the plan integrates: 2000 of them never finished
        if r > MOST_REPEATS:
            raise BadInput(f"--max-repeats {bench}={r}: a plan has at most {MOST_REPEATS} repeats (past them what is "
                           f"left of one repeat's noise is under 1/{MOST_REPEATS}: more items, not repeats, lower the "
                           f"rest); e.g. --max-repeats {bench}={MOST_REPEATS}")
    designs = []
    for bench in benchmarks:
        rules = policy.of(bench)  # a benchmark without a margin first: no pilot can plan it
        stated = DEFAULT_ASSUMPTIONS[bench]
        if bench in between or bench in within:
            stated = Assumptions(between.get(bench, stated.between), within.get(bench, stated.within),
                                 "stated: --between/--within")
        assumed = pilot_assumptions(bench, args.pilot_reference, args.pilot_candidate, stated) \
            if args.pilot_reference else stated
        if assumed.between + assumed.within <= 0:
            raise BadInput(f"{bench}: no variance to plan with (between 0, within 0: {assumed.source}); no item's "
                           "paired delta varies, so every design would look certain: give a pilot with more items, "
                           "or state --between/--within")
        available = items.get(bench, BENCHMARK_ITEMS[bench])
        if available > BENCHMARK_ITEMS[bench]:
            raise BadInput(f"--items {bench}={available}: the benchmark has {BENCHMARK_ITEMS[bench]}")
        if bench == "tau2":  # a tau2 run has whole task sets: a plan no run can follow is refused here
            from evals.judge.design import tau2_tasks_per_domain
            from evals.tau2_run import DOMAINS

            tau2_tasks_per_domain(available, DOMAINS)
        designs.append(design(bench, assumed, rules.margin, drops.get(bench, DEFAULT_DROP), 1 - policy.confidence,
                              args.power, available, repeats.get(bench, MAX_REPEATS[bench]),
                              min(rules.min_items, available) or 1, not args.fixed, throughput.get(bench)))
    plan = make_plan(designs, policy, args.power)
    if args.out:
        write_plan(plan, args.out)
    print(dumps(plan) if args.json else text(plan, args.out))
    return EXIT_PASS if all(d.feasible for d in designs) else EXIT_BLOCK


def _rounded_up(margin: float) -> float:
    """A certified margin to 3 decimals, rounded up: never claim more than the design certifies."""
    return math.ceil(margin * 1000) / 1000


def text(plan: dict, out: Path | None) -> str:
    lines = [(f"plan at one-sided confidence {plan['confidence']} (alpha {plan['alpha']:g}), power "
              f"{plan['power']:.0%}, {plan['spending']}; policy {plan['policy']}")]
    for bench, d in plan["benchmarks"].items():
        lines.append(f"\n{bench}: {d['items']} items x {d['repeats']} repeats (of {d['benchmark_items']} x "
                     f"{d['max_repeats']} allowed), margin {d['margin']}, plausible drop {d['drop']}")
        how = ("exact: the gate's rule summed over every outcome" if d["repeats"] == 1 and bench != "tau2"
               else "normal approximation of the sequential rule at the gate's bound distances")
        lines.append(f"  power {d['power']:.1%} at the drop ({how}); certifies a margin of "
                     f"{_rounded_up(d['certifiable_margin']):.3f} with {plan['power']:.0%} power; expected repeats at the "
                     f"drop {d['expected_repeats']:.2f}")
        a = d["assumptions"]
        lines.append(f"  variance per item: between {a['between']:.4g}, within {a['within']:.4g} ({a['source']})"
                     + (f"; items that differ after 1.. repeats: {', '.join(f'{v:.1%}' for v in a['differing'])}"
                        if a.get("differing") else ""))
        lines.append("  looks: " + "; ".join(f"{lk['repeats']} rep at {lk['confidence']:.5f}" for lk in d["looks"])
                     + (" (at the planned information; the gate spends on each look's observed information)"
                        if len(d["looks"]) > 1 else ""))
        if d["gpu_hours"]:
            g = d["gpu_hours"]
            lines.append(f"  GPU hours per arm: at most {g['max']:.1f}, expected {g['expected_at_drop']:.1f} at the "
                         f"drop ({g['answers_per_gpu_hour']:g} answers per GPU hour)")
        if d["note"]:
            lines.append(f"  NO DESIGN REACHES THE POWER: {d['note']}")
    if out:
        lines.append(f"\nplan written to {out}; run both arms with `evals run --plan {out}`")
    return "\n".join(lines)
