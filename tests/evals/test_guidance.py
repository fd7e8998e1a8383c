"""Guidance for an INCONCLUSIVE comparison is what it takes from here, at the observed delta: each
defect found in it is pinned here (data the run already has, pass advice on a loss, a power that
assumed a delta of 0, a certified margin rounded down)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as sps

from evals.judge import render
from evals.cli import main as gate
from evals.judge.gate import compare_benchmark
from evals.judge.policy import load_policy
from evals.judge.stats import (certified_margin, conditional_power, exact_passes, exact_power, guidance, paired_delta,
                                unmeasured_discordance, variance_components)
from tests.evals.test_gate import binary_pair, bundle
from tests.evals.test_stats import pairs_of


def repeated_pairs(ref: np.ndarray, cand: np.ndarray, benchmark: str = "gpqa_diamond") -> list[tuple[dict, dict]]:
    out = []
    for i in range(ref.shape[0]):
        for r in range(ref.shape[1]):
            row = {"benchmark": benchmark, "item_id": str(i), "repeat": r, "filter": "flexible-extract",
                   "score": float(ref[i, r])}
            out.append((row, {**row, "score": float(cand[i, r])}))
    return out


def gpqa_like(repeats: int, seed: int, drop: float = 0.02, spread: float = 0.15):
    """198 questions at temperature 1.0: most near-certain, some coin flips, and a per-question
    quantization shift around ``drop`` (the items differ in how much they lose)."""
    rng = np.random.default_rng(seed)
    p = rng.beta(2.0, 0.25, 198)
    q = np.clip(p - rng.normal(drop, spread, 198), 0, 1)
    return ((rng.random((198, repeats)) < p[:, None]).astype(int),
            (rng.random((198, repeats)) < q[:, None]).astype(int))


def judged(pairs, benchmark="gpqa_diamond", **margins):
    """``compare_benchmark`` at margins fixed here (GSM8K 0.02, GPQA 0.03), whatever the shipped policy says."""
    policy = load_policy().with_margins({"gsm8k": 0.02, "gpqa_diamond": 0.03, **margins})
    result = compare_benchmark(benchmark, pairs, policy)
    return result, (render.guidance(result.guidance) if result.guidance else None)


def test_variance_components_separate_repeat_noise_from_item_spread():
    # every item's two repeats disagree by 2 and agree on average: all noise, no item spread
    between, within = variance_components(np.array([[1.0, -1.0]] * 10))
    assert (between, within) == (0.0, pytest.approx(2.0))
    # repeats agree exactly, items differ: all item spread
    deltas = np.repeat(np.array([[1.0], [0.0], [-1.0], [0.0]]), 3, axis=1)
    assert variance_components(deltas) == (pytest.approx(np.var([1, 0, -1, 0], ddof=1)), 0.0)


def test_conditional_power_is_the_chance_the_final_bound_clears_the_margin():
    """Against a direct derivation: the final delta is the information-weighted mean of the data so
    far and the new data (normal, variance 1 / dI around the true delta)."""
    delta_now, var_now, var_final, margin, true = -0.01, 0.012 ** 2, 0.007 ** 2, 0.02, -0.005
    i_now, i_final = 1 / var_now, 1 / var_final
    # final = (i_now * delta_now + dI * new) / i_final > -margin + z / sqrt(i_final)
    threshold = ((-margin + sps.norm.ppf(0.95) / np.sqrt(i_final)) * i_final - i_now * delta_now) / (i_final - i_now)
    direct = 1 - sps.norm.cdf((threshold - true) * np.sqrt(i_final - i_now))
    assert conditional_power(delta_now, var_now, var_final, margin, 0.95, true) == pytest.approx(direct)
    # more data helps when the truth is inside the margin, and cannot when it sits on it
    assert conditional_power(-0.01, var_now, 1e-9, margin, 0.95, -0.01) == pytest.approx(1.0)
    assert conditional_power(-0.01, var_now, 1e-9, margin, 0.95, -0.03) == pytest.approx(0.0)


def test_the_certified_margin_is_rounded_up():
    assert certified_margin(-0.0304) == 0.031  # printed as 0.030 before, which the bound does not certify
    assert certified_margin(-0.03) == 0.03 and certified_margin(0.01) == 0.0


def test_a_full_benchmark_is_never_told_to_run_items_it_has():
    """"about 749 items would decide it ... the benchmark has 1319" on a 1319-item run."""
    result, text = judged(pairs_of(*binary_pair(1319, 40, 22)), "gsm8k")
    assert result.verdict == "INCONCLUSIVE" and result.guidance["action"] == "none"  # GSM8K is greedy: no repeat
    assert result.items_to_decide is None and not re.search(r"\d+ more items", text)
    assert "the benchmark has no items beyond these 1319" in text and "another seed" not in text


def test_more_items_are_named_only_beyond_those_run_with_the_power_at_the_observed_delta_and_at_0():
    result, text = judged(pairs_of(*binary_pair(400, 8, 6)), "gsm8k")
    g = result.guidance
    assert result.verdict == "INCONCLUSIVE" and g["action"] == "items" and 400 < g["items_needed"] <= 1319
    assert f"{g['items_needed'] - 400} more items ({g['items_needed']} of the benchmark's 1319)" in text
    assert f"at the observed delta {result.delta:+.4f}" in text and "were the true delta 0" in text
    assert g["power_at_observed"] >= 0.8 and g["power_at_observed"] != g["power_at_zero"]
    # one outcome per item: the powers printed are the exact rule's for the items still to run (the
    # normal approximation of the bound once promised "1 more items would reach 100% power")
    n_items = g["items_needed"]
    assert g["power_at_observed"] == pytest.approx(exact_power(n_items, 8 / 400, 6 / 400, 0.02, 0.95, 8, 6, 400))
    assert g["power_at_zero"] == pytest.approx(exact_power(n_items, 7 / 400, 7 / 400, 0.02, 0.95, 8, 6, 400))
    assert exact_power(n_items - n_items // 4, 8 / 400, 6 / 400, 0.02, 0.95, 8, 6, 400) < 0.8  # not far too many


def test_a_near_miss_is_not_promised_a_certain_pass_by_one_more_item():
    """200 items, 4 lost and 3 won at 0.03 (the exact bound -0.0313): no "1 more items would reach
    100% power"; the design named reaches the power by the exact rule."""
    result, text = judged(pairs_of(*binary_pair(200, 4, 3)), "gsm8k", gsm8k=0.03)
    g = result.guidance
    assert result.verdict == "INCONCLUSIVE" and g["action"] == "items" and g["items_needed"] > 210
    assert 0.8 <= g["power_at_observed"] < 1 and "100% power" not in text and "1 more items" not in text


def test_repeats_are_named_only_beyond_those_run():
    """"4 repeats (now 4)"."""
    for seed in range(20):
        ref, cand = gpqa_like(4, seed, drop=0.0, spread=0.05)
        result, text = judged(repeated_pairs(ref, cand))
        if result.guidance and result.guidance["action"] == "repeats":
            break
    else:
        pytest.fail("no simulated GPQA run asked for repeats")
    assert result.guidance["repeats_needed"] > 4 and f"(now 198 x 4, same temperature)" in text
    assert not re.search(r"\b4 repeats\b", text)


def test_a_loss_gets_no_pass_advice():
    """delta -0.047 with 16 vs 0 discordant items was told "about 246 items would decide it"."""
    result, text = judged(pairs_of(*binary_pair(340, 16, 0)), "gsm8k", gsm8k=0.04)
    assert result.verdict == "INCONCLUSIVE" and result.delta == pytest.approx(-16 / 340)
    assert result.guidance["action"] == "loss" and result.items_to_decide is None
    assert "is beyond the margin -0.04: more data would more likely FAIL it" in text
    assert "would reach" not in text and "would decide" not in text


def test_no_number_of_repeats_certifies_the_margin_when_the_items_differ_that_much():
    """GPQA 198 x 8, an observed drop of 0.026 that differs between questions: said plainly, with
    what the data certify."""
    ref, cand = gpqa_like(8, 23)
    result, text = judged(repeated_pairs(ref, cand))
    g = result.guidance
    assert result.verdict == "INCONCLUSIVE" and g["action"] == "none" and g["repeats_needed"] is None
    assert f"no number of repeats on 198 items certifies 0.03 at the observed delta {result.delta:+.4f}" in text
    assert g["best_margin"] > 0.03 and g["power_at_observed"] < 0.8 and g["design_repeats"] == 16
    assert f"the data certify a margin of {certified_margin(result.lower):.3f}" in text


def test_one_repeat_asks_for_a_second_before_promising_repeats():
    rng = np.random.default_rng(0)
    deltas = rng.choice([-1.0, 0.0, 0.0, 1.0], size=(198, 1))
    p = paired_delta(np.zeros(198), deltas[:, 0], 0.95, 2000, 0)
    g = guidance(deltas, p, 0.03, 0.95, 198)
    text = render.guidance(g.__dict__)
    assert g.action == "second_repeat" and "run a second repeat" in text
    assert f"certify a margin of {certified_margin(p.lower):.3f}" in text


def test_the_cli_names_the_guidance_on_a_write_up_sized_gpqa_run(tmp_path, capsys):
    """GPQA-Diamond as the Wafer write-up ran it: 198 questions x 2 repeats at temperature 1.0."""
    ref, cand = gpqa_like(2, 7)
    r = bundle(tmp_path / "ref", "gpqa_diamond", ref.tolist(), repeats=2)
    c = bundle(tmp_path / "cand", "gpqa_diamond", cand.tolist(), repeats=2)
    code = gate(["accuracy", "--candidate", str(c), "--reference", str(r), "--benchmarks", "gpqa_diamond"])
    out = capsys.readouterr().out
    assert code == 1 and "INCONCLUSIVE" in out
    lines = [line for line in out.splitlines() if "the data certify a margin of" in line]
    assert len(lines) == 2, out  # the note under the benchmark and the verdict's blocking reason
    for line in lines:
        counts = [int(n) for n in re.findall(r"(\d+) items", line)]
        assert all(n <= 198 for n in counts), line


# ---- fourth campaign: no promise where nothing differed; greedy runs are never told to repeat ----------

def test_no_item_differing_promises_no_certain_pass():
    """40 arith items, 0 vs 0 discordant: "124 more items (164 of 250) would reach 100% power"; run that
    way, items differ and it is INCONCLUSIVE again. The power is now the exact rule's at the most often
    items may differ that 0 of 40 leaves plausible (7.2%), and 250 items do not reach 80% there."""
    result, text = judged(pairs_of(*binary_pair(40, 0, 0, wrong_both=3)), "arith", arith=0.025)
    g, rate = result.guidance, unmeasured_discordance(40, 0.95)
    assert result.verdict == "INCONCLUSIVE" and g["assumed_discordance"] == pytest.approx(rate)
    assert "100%" not in text and "164 of" not in text and g["action"] == "none"
    assert g["power_at_observed"] == pytest.approx(exact_power(250, rate / 2, rate / 2, 0.025, 0.95, 0, 0, 40))
    assert 0.3 < g["power_at_observed"] < 0.8 and f"were items to differ {rate:.1%} of the time" in text
    assert "none of these 40 items differed" in text and "another seed" not in text
    assert exact_power(164, rate / 2, rate / 2, 0.025, 0.95, 0, 0, 40) < 0.5  # the design once promised 100%
    assert exact_passes(0, 0, 164, 0.025, 0.95)  # ... which only a run with no item differing would deliver


def test_no_item_differing_names_the_design_that_reaches_the_power_at_the_plausible_rate():
    result, text = judged(pairs_of(*binary_pair(130, 0, 0, wrong_both=5)), "gsm8k", gsm8k=0.02)
    g, rate = result.guidance, unmeasured_discordance(130, 0.95)
    at = lambda items: exact_power(items, rate / 2, rate / 2, 0.02, 0.95, 0, 0, 130)  # noqa: E731
    assert result.verdict == "INCONCLUSIVE" and g["action"] == "items", text
    assert at(g["items_needed"]) >= 0.8 > at(g["items_needed"] - 1)
    assert g["power_at_observed"] == pytest.approx(at(g["items_needed"])) and g["power_at_observed"] < 1
    assert f"{g['items_needed'] - 130} more items ({g['items_needed']} of the benchmark's 1319)" in text


def test_repeated_items_none_differing_get_a_floor_of_items_not_a_power():
    """GPQA 80 questions x 2 repeats, the arms alike on every one: the rule-of-three count of items is
    the fewest that could certify the margin were none to differ, not a design with "100% power"."""
    same = np.array([[1, 1]] * 72 + [[0, 0]] * 8)
    result, text = judged(repeated_pairs(same, same.copy()), "gpqa_diamond", gpqa_diamond=0.03)
    g = result.guidance
    assert result.verdict == "INCONCLUSIVE" and g["action"] == "items" and g["power_at_observed"] is None, text
    assert "power" not in text.split("; the data certify")[0].replace("no power is promised", "")
    assert f"at least {g['items_needed'] - 80} more items" in text and "no power is promised" in text


def _record_sampling(bundle_dir, benchmark, **settings):
    run = json.loads((bundle_dir / "run.json").read_text())
    run["benchmarks"][benchmark]["settings"] = settings
    (bundle_dir / "run.json").write_text(json.dumps(run))


@pytest.mark.parametrize("sampling, repeat_advised", [
    ({"do_sample": False, "temperature": 0.0}, False),  # greedy, as the run recorded it
    ({"do_sample": True, "temperature": 1.0}, True),  # sampled: a second repeat shows the noise
])
def test_a_second_seed_is_advised_only_where_repeats_differ(sampling, repeat_advised, tmp_path, capsys):
    """One repeat of 198 GPQA questions, 10 lost and 6 won, at 0.04: a sampled run is told to run a second
    repeat; a greedy one (temperature 0: a repeat reproduces the answers) is told that only items add."""
    ref, cand = binary_pair(198, 10, 6)
    r, c = bundle(tmp_path / "ref", "gpqa_diamond", ref), bundle(tmp_path / "cand", "gpqa_diamond", cand)
    for arm in (r, c):
        _record_sampling(arm, "gpqa_diamond", **sampling)
    policy = tmp_path / "policy.yaml"
    policy.write_text("benchmarks:\n  gpqa_diamond: {margin: 0.04}\n")
    code = gate(["accuracy", "--candidate", str(c), "--reference", str(r), "--policy", str(policy)])
    out = capsys.readouterr().out
    assert code == 1 and "INCONCLUSIVE" in out
    assert ("run a second repeat (another seed" in out) == repeat_advised, out
    assert ("repeats at temperature 0 (greedy) reproduce the answers, so only more items add information" in out) \
        != repeat_advised
