"""How often the gate passes a bad candidate or blocks a good one, at the Wafer write-up's sample sizes.

    python -m tests.benchmarks.sim_gate [--trials 400]

Simulates paired per-item outcomes: each item has a difficulty drawn so the reference scores
about the Wafer write-up's level (GSM8K 0.965, n=200, 1 greedy repeat; GPQA-Diamond 0.92, n=198, 2 sampled
repeats), the candidate agrees with the reference except on a discordant fraction, and its true
delta is set exactly. Runs the real gate (bootstrap and all) on each simulated pair and prints the
rate of each verdict for: a lossless candidate (delta 0), one exactly at the margin, and one a
point beyond it. Not a test: a statistics experiment for the closing note.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from evals.gate import accuracy_gate
from evals.policy import load_policy
from tests.evals.test_gate import bundle

SETTINGS = {"gsm8k": (200, 1, 0.965, 0.04), "gpqa_diamond": (198, 2, 0.92, 0.10)}  # n, repeats, ref acc, discordance


def simulate(rng, n: int, repeats: int, acc: float, discord: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Binary outcomes [n, repeats] with P(discordant) = discord and E[cand - ref] = delta exactly:
    the candidate loses a reference-correct answer with p_loss and gains a wrong one with p_gain,
    acc * p_loss + (1 - acc) * p_gain = discord and (1 - acc) * p_gain - acc * p_loss = delta."""
    p_gain, p_loss = (discord + delta) / (2 * (1 - acc)), (discord - delta) / (2 * acc)
    ref = (rng.random((n, repeats)) < acc).astype(int)
    u = rng.random((n, repeats))
    cand = np.where(ref == 1, (u >= p_loss).astype(int), (u < p_gain).astype(int))
    return ref, cand


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples per gate call")
    args = parser.parse_args()
    policy = load_policy()
    policy["bootstrap"] = {"resamples": args.resamples, "seed": 0}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for bench, (n, repeats, acc, discord) in SETTINGS.items():
            margin = policy["benchmarks"][bench]["margin"]
            policy["benchmarks"][bench]["floor"] = None
            for label, delta in (("lossless (delta 0)", 0.0), (f"at the margin (-{margin})", -margin),
                                 (f"beyond it (-{margin + 0.01:.2f})", -margin - 0.01)):
                counts: Counter = Counter()
                realised = []
                for t in range(args.trials):
                    ref, cand = simulate(rng, n, repeats, acc, discord, delta)
                    realised.append(cand.mean() - ref.mean())
                    base = Path(tmp) / f"{bench}-{label[:4]}-{t}"
                    r = bundle(base / "r", bench, ref if repeats > 1 else ref[:, 0], repeats=repeats)
                    c = bundle(base / "c", bench, cand if repeats > 1 else cand[:, 0], repeats=repeats)
                    counts[accuracy_gate(c, r, policy)["benchmarks"][0]["verdict"]] += 1
                rates = {k: counts[k] / args.trials for k in ("PASS", "INCONCLUSIVE", "FAIL")}
                print(f"{bench:<13} n={n} x{repeats} margin {margin}: {label:<26} realised delta "
                      f"{np.mean(realised):+.4f}  PASS {rates['PASS']:.3f}  INCONCLUSIVE {rates['INCONCLUSIVE']:.3f}  "
                      f"FAIL {rates['FAIL']:.3f}")


if __name__ == "__main__":
    main()
