"""Guidance for an INCONCLUSIVE comparison that can be followed: never more items than the benchmark has."""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy import stats as sps

from evals import render
from evals.cli import main as gate
from evals.stats import guidance, variance_components
from tests.evals.test_gate import bundle


def test_variance_components_separate_repeat_noise_from_item_spread():
    # every item's two repeats disagree by 2 and agree on average: all noise, no item spread
    between, within = variance_components(np.array([[1.0, -1.0]] * 10))
    assert (between, within) == (0.0, pytest.approx(2.0))
    # repeats agree exactly, items differ: all item spread
    deltas = np.repeat(np.array([[1.0], [0.0], [-1.0], [0.0]]), 3, axis=1)
    assert variance_components(deltas) == (pytest.approx(np.var([1, 0, -1, 0], ddof=1)), 0.0)


def test_repeats_needed_reach_the_power_and_one_fewer_does_not():
    rng = np.random.default_rng(3)
    deltas = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=(198, 2))
    g = guidance(deltas, float(deltas.mean(axis=1).std(ddof=1)), -0.05, 0.03, 0.95, 198)
    target = (0.03 / (sps.norm.ppf(0.95) + sps.norm.ppf(0.8))) ** 2  # variance of the mean delta that decides it
    var_at = lambda r: (g.between + g.within / r) / 198  # noqa: E731
    assert g.exceeds_benchmark and g.repeats_needed > 2
    assert var_at(g.repeats_needed) <= target < var_at(g.repeats_needed - 1)


def seed_sized_gpqa(tmp_path, seed: int = 2):
    """GPQA-Diamond as the Wafer write-up ran it: 198 questions x 2 repeats at temperature 1.0, a candidate ~2 points lower."""
    rng = np.random.default_rng(seed)
    p = rng.beta(2.0, 0.2, 198)
    ref = (rng.random((198, 2)) < p[:, None]).astype(int).tolist()
    cand = (rng.random((198, 2)) < np.clip(p - 0.02, 0, 1)[:, None]).astype(int).tolist()
    return bundle(tmp_path / "ref", "gpqa_diamond", ref, repeats=2), bundle(tmp_path / "cand", "gpqa_diamond", cand,
                                                                             repeats=2)


def test_seed_sized_gpqa_names_repeats_or_a_margin_never_an_impossible_item_count(tmp_path, capsys):
    ref, cand = seed_sized_gpqa(tmp_path)
    code = gate(["accuracy", "--candidate", str(cand), "--reference", str(ref), "--benchmarks", "gpqa_diamond"])
    out = capsys.readouterr().out
    assert code == 1 and "INCONCLUSIVE" in out
    lines = [line for line in out.splitlines() if "would" in line]
    assert lines, out
    for line in lines:  # the note under the benchmark and the verdict's blocking reason
        assert re.search(r"\d+ repeats per item at the same temperature|certifies a margin of 0\.\d+", line), line
        counts = [int(n) for n in re.findall(r"(\d+) items", line)]
        assert all(n <= 198 for n in counts), line
        assert "198" in line  # says the benchmark's size is the limit


def test_guidance_within_the_benchmark_names_the_items():
    text = render.guidance({"items_needed": 620, "benchmark_items": 1319, "exceeds_benchmark": False, "repeats": 1})
    assert text.startswith("about 620 items would decide it") and "the benchmark has 1319" in text


def test_one_repeat_asks_for_a_second_before_promising_repeats():
    rng = np.random.default_rng(0)
    deltas = rng.choice([-1.0, 0.0, 0.0, 1.0], size=(198, 1))
    g = guidance(deltas, float(deltas.std(ddof=1)), -0.06, 0.03, 0.95, 198)
    text = render.guidance({**g.__dict__, "exceeds_benchmark": g.exceeds_benchmark})
    assert g.exceeds_benchmark and "run a second repeat" in text and "certifies a margin of 0.060" in text
