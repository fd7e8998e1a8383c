"""``evals run --until-decided``: run a planned candidate look by look and stop once the gate's verdict
is final, or at the plan's last look.

Look k runs each undecided benchmark's repeats up to the plan's k-th look (finished repeats are
kept, as by ``--resume``; tau2's repeats are trials: its domains grow to the look's trials, whose
seeds are the first of the plan's, ``evals.tau2_run.trial_seeds``), writes the bundle, and judges it against the reference with the gate
(``gate.accuracy_gate``), which judges each benchmark at its look's level (``evals.judge.design``,
``evals.judge.sequential``). A benchmark that PASSes or FAILs stops; an INCONCLUSIVE one goes on to
its next look; an INCONCLUSIVE at the last look is final. Every look is kept in ``looks.json``
beside the bundle and printed as it happens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from evals.errors import BadInput
from evals.judge.plan_file import plan_under_policy
from quant.outputs import write_atomic

LOOKS_FILE = "looks.json"
log = logging.getLogger(__name__)


def run_until_decided(spec, reference: Path, policy, resume: bool = False) -> dict:
    """``{"looks": [...], "accuracy": the last look's gate result}``; ``spec.plan`` is required."""
    from evals.judge.gate import FAIL, PASS, accuracy_gate
    from evals.run import run

    if not spec.plan:
        raise BadInput("--until-decided needs --plan: the plan fixes the looks and the level each is judged at")
    plan_under_policy(spec.plan, policy, "--plan")  # a plan made under another confidence is refused before any run
    for benchmark in spec.benchmarks:  # and a benchmark the policy names no margin for (it names the shipped one)
        policy.of(benchmark)
    looks = {b: spec.plan["benchmarks"][b]["looks"] for b in spec.benchmarks}
    at = dict.fromkeys(spec.benchmarks, 0)  # each benchmark's current look (index)
    history: list[dict] = []
    while True:
        repeats_now = {b: looks[b][at[b]]["repeats"] for b in spec.benchmarks}
        run(replace(spec, repeats_now=repeats_now), resume=resume or bool(history))
        accuracy = accuracy_gate(spec.out, reference, policy, benchmarks=spec.benchmarks)
        by_bench = {r["benchmark"]: r for r in accuracy["benchmarks"]}
        entry = {"look": len(history) + 1, "repeats": repeats_now, "verdict": accuracy["verdict"], "benchmarks": {
            b: {"verdict": r["verdict"], "look": (r["look"] or {}).get("look"), "of": (r["look"] or {}).get("of"),
                "confidence": r["confidence"], "delta": r["delta"], "lower": r["lower"], "upper": r["upper"],
                "margin": r["margin"],
                "final": r["verdict"] in (PASS, FAIL) or bool((r["look"] or {}).get("final")) or not r["decidable"]}
            for b, r in by_bench.items()}}
        history.append(entry)
        write_atomic(Path(spec.out) / LOOKS_FILE, json.dumps(history, indent=2))
        log.info("look %d: %s", entry["look"], "; ".join(
            f"{b} {v['verdict']} at {repeats_now[b]} repeats (one-sided {v['confidence']:.5f}, delta {v['delta']:+.4f})"
            for b, v in entry["benchmarks"].items()))
        going_on = [b for b, v in entry["benchmarks"].items() if not v["final"]]
        if not going_on:
            return {"looks": history, "accuracy": accuracy}
        for b in going_on:
            at[b] += 1


def render(result: dict) -> str:
    from evals.judge.render import versus

    lines = ["look  " + "  ".join(f"{b:>28}" for b in result["looks"][0]["benchmarks"]) + "  verdict"]
    for entry in result["looks"]:
        # each bound with the digits that tell it from -margin (a pass by a hair never prints as the margin)
        cells = [f"{v['verdict']} r{entry['repeats'][b]} [{versus(v['lower'], -v['margin'], 3)},"
                 f"{versus(v['upper'], -v['margin'], 3)}]" for b, v in entry["benchmarks"].items()]
        lines.append(f"{entry['look']:>4}  " + "  ".join(f"{c:>28}" for c in cells) + f"  {entry['verdict']}")
    return "\n".join(lines)
