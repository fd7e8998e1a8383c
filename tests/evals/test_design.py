"""``gate plan`` and the sequential looks: published boundary values, designs within the benchmark's
size, and the power approximation and the looks' false pass checked through the real decision
function (``gate.compare_benchmark``) on simulated paired outcomes."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from evals.judge import sequential
from evals.cli import main as gate
from evals.judge.design import (
    DEFAULT_ASSUMPTIONS,
    Assumptions,
    design,
    differing_share,
    expected_df,
    gate_looks,
    observed_levels,
    operating,
    outcome_rates,
    paired_pilot,
    plan_looks,
    planned_look,
    se_of,
)
from evals.errors import BadInput
from evals.judge.gate import BENCHMARK_ITEMS, PASS, compare_benchmark, judge
from evals.judge.plan_file import read_plan
from evals.judge.policy import BenchmarkPolicy, Bootstrap, GatePolicy
from evals.judge.stats import exact_power, paired_se, pooled_df, variance_components


def test_boundaries_are_the_published_lan_demets_obrien_fleming_values():
    # gsDesign's sfLDOF, 4 equally spaced looks, one-sided 0.025: 4.3326, 2.9631, 2.3590, 2.0141
    assert sequential.boundaries([0.25, 0.5, 0.75, 1], 0.025) == pytest.approx([4.3326, 2.9631, 2.3590, 2.0141],
                                                                                abs=2e-4)
    assert sequential.boundaries([1.0], 0.05) == pytest.approx([1.6449], abs=1e-4)  # one look: the fixed test
    z = sequential.boundaries([0.3, 0.6, 1.0], 0.05)
    ops = operating([{"information_fraction": t, "z": zk} for t, zk in zip([0.3, 0.6, 1.0], z)], 0.0)
    assert ops["pass"] == pytest.approx(0.05, abs=1e-4)  # under the null the looks spend exactly alpha
    assert ops["fail"] == pytest.approx(0.05, abs=1e-4)  # and the mirror boundary as much, on the other side
    assert sum(ops["stop_by_look"]) < 1
    assert sequential.spent(0.3, 0.05) < 0.002 and sequential.spent(1.0, 0.05) == pytest.approx(0.05)


def test_designs_stay_within_the_benchmark_and_say_when_none_certifies():
    gsm = design("gsm8k", DEFAULT_ASSUMPTIONS["gsm8k"], 0.02, 0.01, 0.05, 0.8, BENCHMARK_ITEMS["gsm8k"], 1, 150)
    assert gsm.items == 1319 and gsm.repeats == 1 and not gsm.feasible and gsm.power < 0.8
    assert "no design within 1319 items x 1 repeats certifies a margin of 0.02" in gsm.note
    assert gsm.certifiable_margin > 0.02 and f"it certifies {np.ceil(gsm.certifiable_margin * 1000) / 1000:.3f}" in gsm.note
    easy = design("gsm8k", DEFAULT_ASSUMPTIONS["gsm8k"], 0.05, 0.01, 0.05, 0.8, 1319, 1, 150)
    assert easy.feasible and 150 <= easy.items < 1319 and easy.power >= 0.8
    # one outcome per item: the printed power is the exact rule's, summed over every trinomial outcome; the
    # normal approximation (the bound 1.645 se below the delta) overstated it
    rates = outcome_rates(DEFAULT_ASSUMPTIONS["gsm8k"], 0.01)
    assert easy.power == pytest.approx(exact_power(easy.items, *rates, 0.05, 0.95))
    assert exact_power(easy.items - 2 * 1319 // 200, *rates, 0.05, 0.95) < 0.8  # about the fewest that reach it
    normal = operating(easy.looks, 0.04 / se_of("gsm8k", DEFAULT_ASSUMPTIONS["gsm8k"], easy.items, 1))["pass"]
    assert normal > easy.power + 0.03
    gpqa = design("gpqa_diamond", Assumptions(0.005, 0.05, "stated"), 0.03, 0.01, 0.05, 0.8, 198, 8, 100)
    assert gpqa.feasible and gpqa.items <= 198 and 1 < gpqa.repeats <= 8 and len(gpqa.looks) == gpqa.repeats
    assert 1 <= gpqa.expected_repeats < gpqa.repeats  # looks stop early at the drop on average


def test_power_is_computed_at_the_distance_the_gate_decides_by():
    """Averaged items: the gate's bound lies stats.bound_distance standard errors below the delta (an
    expanded t quantile over the items that differ), not 1.645; the plan's power and certified margin
    use that distance, so they are below what the normal boundary gives."""
    stated = DEFAULT_ASSUMPTIONS["gpqa_diamond"]
    looks = plan_looks(stated, 2, 0.05, sequential_looks=False)
    decided = gate_looks("gpqa_diamond", stated, 198, looks, 0.01)
    df = expected_df("gpqa_diamond", stated, 198, 2, 0.01)
    assert 30 < df < 60  # about 40 of 198 questions differ after two repeats
    assert decided[0]["z"] == pytest.approx(np.sqrt((df + 1) / df) * sps.t.ppf(0.95, df)) and decided[0]["z"] > 1.69
    drift = 0.03 / se_of("gpqa_diamond", stated, 198, 2)
    d = design("gpqa_diamond", stated, 0.04, 0.01, 0.05, 0.8, 198, 2, 100, sequential_looks=False)
    assert d.power == pytest.approx(operating(decided, drift)["pass"]) and d.power < operating(looks, drift)["pass"] - 0.02
    # tau2: the domains' degrees of freedom pooled as the gate pools them (airline's 50 tasks weigh most)
    assert expected_df("tau2", DEFAULT_ASSUMPTIONS["tau2"], 278, 4, 0.01) < 0.5 * 278


def _policy(margin: float, confidence: float = 0.95) -> GatePolicy:
    return GatePolicy(confidence=confidence, bootstrap=Bootstrap(resamples=1000, seed=0),
                      benchmarks={"gsm8k": BenchmarkPolicy(margin=margin, floor=None)})


def _rows(matrix: np.ndarray) -> list[dict]:
    return [{"benchmark": "gsm8k", "item_id": str(i), "repeat": r, "filter": "f", "score": float(matrix[i, r])}
            for i in range(matrix.shape[0]) for r in range(matrix.shape[1])]


def _simulate(rng, n: int, repeats: int, drop: float) -> tuple[np.ndarray, np.ndarray, Assumptions]:
    """Per-item success odds p (80% always right, 20% coin flips), the candidate's p - drop on the
    coin flips' share of it; arms sampled independently per repeat. Returns both arms and the
    variance components this model has (for the design)."""
    flip = rng.random(n) < 0.2
    p = np.where(flip, 0.5, 1.0)
    shift = np.where(flip, drop / 0.2, 0.0)
    q = p - shift
    ref = (rng.random((n, repeats)) < p[:, None]).astype(float)
    cand = (rng.random((n, repeats)) < q[:, None]).astype(float)
    within = 0.2 * (0.25 + (0.5 - drop / 0.2) * (0.5 + drop / 0.2))
    return ref, cand, Assumptions(between=0.2 * 0.8 * (drop / 0.2) ** 2, within=within, source="simulation")


def test_power_approximation_matches_the_real_decision_function():
    rng = np.random.default_rng(7)
    n, repeats, margin, drop, sims = 300, 2, 0.04, 0.01, 200
    passes = 0
    for _ in range(sims):
        ref, cand, assumed = _simulate(rng, n, repeats, drop)
        pairs = list(zip(_rows(ref), _rows(cand)))
        passes += compare_benchmark("gsm8k", pairs, _policy(margin)).verdict == PASS
    looks = [{"information_fraction": 1.0, "z": 1.6449}]
    predicted = operating(looks, (margin - drop) / se_of("gsm8k", assumed, n, repeats))["pass"]
    assert 0.3 < predicted < 0.9  # a design where the check can tell
    # 200 simulations: binomial sd ~0.035; the gate's bound is a little more conservative than this normal
    # approximation on skewed (losses-only) deltas: t tails over the items that differ, BCa's skew correction
    assert passes / sims == pytest.approx(predicted, abs=0.12)


def test_looks_at_their_observed_levels_hold_false_pass_where_naive_looks_inflate_it():
    """A candidate exactly at the margin, judged after each of 4 repeats by the gate's decision
    function: at 0.95 every time it passes at some look far more than 5%; at the levels the gate
    spends on each look's observed information it does not, even under a plan whose stated item
    model has a quarter of the true noise between repeats (the plan's early fractions too large)."""
    rng = np.random.default_rng(3)
    n, margin, sims = 200, 0.05, 150
    true = _simulate(rng, n, 1, margin)[2]
    stated = Assumptions(true.between, true.within / 4, "stated, wrong")
    entry = {"items": n, "assumptions": stated.__dict__, "looks": plan_looks(stated, 4, 0.05)}
    policy, rules = _policy(margin), _policy(margin).of("gsm8k")
    naive = observed = 0
    for _ in range(sims):
        ref, cand, _ = _simulate(rng, n, 4, margin)
        verdicts = []
        for k in range(1, 5):
            level = observed_levels("gsm8k", entry, 0.05, ref[:, :k], cand[:, :k])[-1]["confidence"]
            args = (ref[:, :k].mean(axis=1), cand[:, :k].mean(axis=1), None, rules)
            verdicts.append((judge(*args, policy)[1], judge(*args, policy.model_copy(update={"confidence": level}))[1]))
        naive += any(v == PASS for v, _ in verdicts)
        stopped = next((w for _, w in verdicts if w != "INCONCLUSIVE"), "INCONCLUSIVE")
        observed += stopped == PASS
    assert observed / sims <= 0.08 and naive > observed


def test_observed_fractions_spend_on_the_information_seen():
    """Look j's fraction is its information over the larger of the plan's final information and the
    final information its own data predict; the plan's last look is 1."""
    assert sequential.observed_fractions([100, 150, 180], [400, 300, 200], 300, True) == pytest.approx([0.25, 0.5, 1])
    assert sequential.observed_fractions([100, 150], [200, 200], 300, False) == pytest.approx([1 / 3, 0.5])
    # a look that saw no more than the one before spends (almost) nothing
    t = sequential.observed_fractions([100, 90], [300, 300], 300, False)
    assert t[1] > t[0] and sequential.spent(t[1], 0.05) - sequential.spent(t[0], 0.05) < 1e-6
    # boundaries of looks so far: the first look's is the one a plan with that first fraction has
    assert sequential.look_boundaries([0.25], 0.05)[0] == pytest.approx(sequential.boundaries([0.25, 1], 0.05)[0],
                                                                        abs=1e-6)
    # noisier repeats than planned: the levels are stricter than the plan's at the same look
    rng = np.random.default_rng(4)
    stated = Assumptions(0.04, 0.02, "stated")
    entry = {"items": 198, "assumptions": stated.__dict__, "looks": plan_looks(stated, 4, 0.05)}
    p = rng.beta(1, 1, 198)
    ref, cand = (rng.random((198, 4)) < p[:, None]).astype(float), (rng.random((198, 4)) < p[:, None]).astype(float)
    levels = observed_levels("gpqa_diamond", entry, 0.05, ref[:, :2], cand[:, :2])
    assert [lk["repeats"] for lk in levels] == [1, 2]
    assert levels[1]["information_fraction"] < entry["looks"][1]["information_fraction"]
    assert levels[1]["confidence"] > entry["looks"][1]["confidence"]
    assert observed_levels("gpqa_diamond", entry, 0.05, ref, cand)[-1]["information_fraction"] == 1.0


def test_tau2_designs_have_every_task():
    """A plan for 277 tau2 tasks could never be followed: `evals run --plan` runs all 278."""
    for margin in (0.05, 0.08, 0.2):
        d = design("tau2", DEFAULT_ASSUMPTIONS["tau2"], margin, 0.01, 0.05, 0.8, 278, 8, 20)
        assert d.items == 278


def test_planned_look_says_whether_a_run_follows_its_plan():
    plan = {"confidence": 0.95, "benchmarks": {"gpqa_diamond": {"items": 198, "looks": [
        {"look": 1, "repeats": 1, "confidence": 0.999}, {"look": 2, "repeats": 2, "confidence": 0.96}]}}}
    first = planned_look(plan, "gpqa_diamond", 198, 1, 0.95)
    assert first["follows"] and first["look"] == 1 and not first["final"] and first["confidence"] == 0.999
    assert planned_look(plan, "gpqa_diamond", 198, 2, 0.95)["final"]
    off = planned_look(plan, "gpqa_diamond", 150, 3, 0.95)
    assert not off["follows"] and off["confidence"] is None
    assert off["findings"] == ["150 items compared, the plan has 198",
                               "3 repeats is no look of the plan (looks at [1, 2] repeats)"]


def test_gate_plan_cli_prints_writes_and_refuses_bad_flags(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    small_shifts = ["--between", "gpqa_diamond=0.005", "--within", "gpqa_diamond=0.05"]
    code = gate(["plan", "--benchmarks", "gsm8k,gpqa_diamond", "--throughput", "gpqa_diamond=1000", "--out", str(out),
                 "--json", "--margin", "gsm8k=0.02", "--margin", "gpqa_diamond=0.03", *small_shifts])
    printed = json.loads(capsys.readouterr().out)
    assert code == 1  # GSM8K cannot certify 0.02 at a drop of 0.01 on 1319 items: said, and exit 1
    assert printed == yaml.safe_load(out.read_text()) == read_plan(out)
    gpqa = printed["benchmarks"]["gpqa_diamond"]
    assert gpqa["feasible"] and gpqa["seeds"] == list(range(gpqa["repeats"]))
    assert gpqa["gpu_hours"]["max"] == pytest.approx(gpqa["items"] * gpqa["repeats"] / 1000)
    assert gate(["plan", "--benchmarks", "gpqa_diamond", "--drop", "0.005", *small_shifts]) == 0
    text = capsys.readouterr().out
    assert "gpqa_diamond: " in text and "looks: 1 rep at 0.99" in text and "stated: --between/--within" in text
    assert gate(["plan", "--benchmarks", "gpqa_diamond", "--margin", "gpqa_diamond=0.03"]) == 1  # out of reach at 198
    assert "no design within 198 items x 8 repeats certifies a margin of 0.03" in capsys.readouterr().out
    assert gate(["plan", "--benchmarks", "gsm8k", "--margin", "gsm8k=0.05"]) == 0
    assert "NO DESIGN" not in capsys.readouterr().out
    for bad, says in ((["--items", "gsm8k=5000"], "the benchmark has 1319"), (["--drop", "gsm8k=x"], "--drop"),
                      (["--benchmarks", "mmlu"], "unknown"), (["--pilot-candidate", str(tmp_path)], "needs")):
        assert gate(["plan", *bad]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(BadInput, match="plan.yaml.missing: not found; write the plan with `gate plan"):
        read_plan(tmp_path / "plan.yaml.missing")


def test_bootstrap_of_per_item_means_over_three_repeats_is_centred():
    """A look after 3 repeats has per-item means in thirds; computed as a difference of two means the
    same third can differ in its last bit, and the lattice bootstrap once dropped all but one of such
    twins (the resamples then centred far from the delta and a candidate at the margin passed)."""
    from evals.judge.stats import _bootstrap_means

    rng = np.random.default_rng(5)
    ref, cand = (rng.random((198, 3)) < 0.8).astype(float), (rng.random((198, 3)) < 0.77).astype(float)
    d = cand.mean(axis=1) - ref.mean(axis=1)
    assert len(np.unique(d)) > len(np.unique(np.round(d * 3)))  # the twins are there
    boot = _bootstrap_means([d], 20000, np.random.default_rng(0))
    assert boot.mean() == pytest.approx(d.mean(), abs=0.002) and boot.std() == pytest.approx(d.std() / np.sqrt(198),
                                                                                              rel=0.05)


def test_a_pilot_gives_the_variance_components(tmp_path, capsys):
    from evals.judge.stats import variance_components
    from tests.evals.test_gate import bundle

    rng = np.random.default_rng(2)
    ref, cand = (rng.random((120, 3)) < 0.8).astype(int), (rng.random((120, 3)) < 0.75).astype(int)
    r = bundle(tmp_path / "r", "gpqa_diamond", ref.tolist(), repeats=3)
    c = bundle(tmp_path / "c", "gpqa_diamond", cand.tolist(), repeats=3)
    code = gate(["plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", str(r), "--pilot-candidate", str(c),
                 "--json"])
    assumed = json.loads(capsys.readouterr().out)["benchmarks"]["gpqa_diamond"]["assumptions"]
    between, within = variance_components((cand - ref).astype(float))
    assert code in (0, 1) and assumed["between"] == pytest.approx(between) and assumed["within"] == pytest.approx(within)
    assert assumed["source"].startswith("pilot: ") and "120 items x 3 repeats" in assumed["source"]
    assert assumed["differing"] == pytest.approx(list(differing_share((cand - ref).astype(float))))
    gate(["plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", str(r), "--pilot-candidate", str(c)])
    shares = ", ".join(f"{v:.1%}" for v in assumed["differing"])
    assert f"items that differ after 1.. repeats: {shares}" in capsys.readouterr().out
    gate(["plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", str(r), "--json"])  # one arm: within only
    alone = json.loads(capsys.readouterr().out)["benchmarks"]["gpqa_diamond"]["assumptions"]
    assert alone["within"] == pytest.approx(2 * ref.var(axis=1, ddof=1).mean()) and alone["between"] == 0.025
    one = bundle(tmp_path / "one", "gsm8k", ref[:, 0].tolist())
    assert gate(["plan", "--benchmarks", "gsm8k", "--pilot-reference", str(one)]) == 2
    assert "one repeat, which shows no sampling noise" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["heterogeneous", "concentrated"])
def test_the_benchmarks_item_models_have_the_cells_delta_and_discordance(model):
    """tests/benchmarks/sim_gate.py's operating characteristics mean something only if each item model
    simulates the true delta its cell names (exactly, in expectation) at about its discordance."""
    from tests.benchmarks.sim_gate import GPQA, MODELS

    rng = np.random.default_rng(1)
    ref, cand = MODELS[model](rng, GPQA, 200_000, 1, 0.10, -0.04)
    d = (cand - ref)[:, 0]
    assert d.mean() == pytest.approx(-0.04, abs=3 * d.std() / np.sqrt(len(d)))
    assert 0.08 < np.mean(d != 0) < 0.14  # about the cell's (uncoupled redraws add some on items near 1/2)
    if model == "concentrated":  # the losses fall on 10-20% of the items
        lost = ref[:, 0] > cand[:, 0]
        assert 0 < lost.mean() < 0.2


def test_differing_share_counts_the_items_whose_arms_differ_after_each_repeat():
    """The gate's degrees of freedom count items whose mean delta is not 0 (``stats._bca``): an item that
    lost one repeat and won the next ties, one that differed once stays differing."""
    deltas = np.array([[1, -1, 0], [0, 0, 0], [0, 1, 0], [-1, 0, 0], [0, 0, 1]])
    assert differing_share(deltas) == pytest.approx((0.4, 0.4, 0.6))  # ties after 2: the first item
    # per-item means in thirds (the twins of test_bootstrap_of_per_item_means...): sums, so no last-bit noise
    rng = np.random.default_rng(5)
    ref, cand = (rng.random((198, 3)) < 0.8).astype(float), (rng.random((198, 3)) < 0.77).astype(float)
    assert differing_share(cand - ref)[-1] == np.mean(np.round(3 * (cand.mean(axis=1) - ref.mean(axis=1))) != 0)


def test_a_paired_pilot_gives_the_macro_standard_error_and_the_degrees_of_freedom(tmp_path, capsys):
    """tau2's domains at their own spreads: the stated model (one pooled variance times the macro factor)
    misstates the macro's standard error; the pilot's per-domain components, weighted as the macro
    weighs them, give the gate's own (``stats.paired_se`` with the domains) at the benchmark's shares."""
    rng = np.random.default_rng(11)
    sizes, spread = {"airline": 50, "retail": 114, "telecom": 114}, {"airline": 0.6, "retail": 0.3, "telecom": 0.1}
    strata = np.repeat(list(sizes), list(sizes.values()))
    flip = np.concatenate([rng.random(n) < spread[d] for d, n in sizes.items()])  # items the candidate may change
    ref = (rng.random((278, 3)) < 0.7).astype(float)
    cand = np.where(flip[:, None] & (rng.random((278, 3)) < 0.5), 1 - ref, ref)
    assumed = paired_pilot("tau2", ref, cand, strata, "pilot: test")
    assert all(variance_components((cand - ref)[strata == d])[0] > 0 for d in sizes)  # no domain's floored at 0
    gate_se = paired_se(ref.mean(axis=1), cand.mean(axis=1), strata)
    assert se_of("tau2", assumed, 278, 3) == pytest.approx(gate_se, rel=1e-9)
    pooled = Assumptions(*variance_components(cand - ref), "pooled")
    assert abs(se_of("tau2", pooled, 278, 3) / gate_se - 1) > 0.1  # the equal-spread model is off here
    assert assumed.source == "pilot: test, 278 items x 3 repeats in 3 domains"
    assert assumed.differing == differing_share(cand - ref) and len(assumed.differing) == 3
    # `gate plan` plans from the same: the pilot bundles' rows carry each task's domain
    from tests.evals.test_gate import bundle

    arms = [bundle(tmp_path / name, "tau2", m.tolist(), repeats=3, domains=list(strata)) for name, m in
            (("r", ref), ("c", cand))]
    gate(["plan", "--benchmarks", "tau2", "--pilot-reference", str(arms[0]), "--pilot-candidate", str(arms[1]), "--json"])
    planned = json.loads(capsys.readouterr().out)["benchmarks"]["tau2"]["assumptions"]
    assert (planned["between"], planned["within"]) == pytest.approx((assumed.between, assumed.within))
    # no domains: the plain variance components
    plain = paired_pilot("gpqa_diamond", ref, cand)
    assert (plain.between, plain.within) == pytest.approx(variance_components(cand - ref))


def test_the_pilots_differing_share_sets_the_expected_degrees_of_freedom():
    """Where the same items differ at every repeat (damage concentrated on a few), fewer items differ than
    independent repeats predict, the gate's bound lies further out, and the plan's power is lower."""
    stated = DEFAULT_ASSUMPTIONS["gpqa_diamond"]
    concentrated = replace(stated, differing=(0.10, 0.12))
    assert expected_df("gpqa_diamond", concentrated, 198, 2, 0.01) == pytest.approx(pooled_df([1.0], [198 * 0.12]))
    assert expected_df("gpqa_diamond", concentrated, 198, 2, 0.01) < expected_df("gpqa_diamond", stated, 198, 2, 0.01) - 10
    # past the pilot's repeats: its last share extended as independent repeats
    assert expected_df("gpqa_diamond", concentrated, 198, 4, 0.01) == pytest.approx(
        pooled_df([1.0], [198 * (1 - 0.88 ** 2)]))
    looks = plan_looks(stated, 2, 0.05, sequential_looks=False)
    power = lambda a: design("gpqa_diamond", a, 0.04, 0.01, 0.05, 0.8, 198, 2, 198, False).power  # noqa: E731
    assert power(concentrated) < power(stated) - 0.005
    assert gate_looks("gpqa_diamond", concentrated, 198, looks, 0.01)[0]["z"] > gate_looks(
        "gpqa_diamond", stated, 198, looks, 0.01)[0]["z"]
