"""Hostile inputs, fourth campaign, for gate policies: a file in the working folder named like a shipped
policy, policy numbers that void the bound's promise or exhaust the machine, keys of the wrong kind.

Shipped policies are found by name only in the package; a path is written as one (``./release``), and
every rendering names the file that judged. Each bad policy is one line naming the file and the key,
exit 2; the real CLI runs on real files (in-process through ``main``, from the folder that holds the
planted file), and the files outside the output folder stay unchanged (``outside``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from evals.cli import evals_main, main as gate_main
from evals.judge.policy import MAX_RESAMPLES, load_policy, min_resamples
from quant.layout import manifests_root
from tests.evals.test_gate import binary_pair, bundle, evaluated
from tests.evals.test_hostile_evals import as_process, cli, one_line, outside  # noqa: F401  (outside: a fixture)

pytestmark = pytest.mark.usefixtures("outside")

SHIPPED = manifests_root() / "gates"
LENIENT = "benchmarks:\n  arith: {margin: 0.5}\n"  # planted: passes a 10-point loss


@pytest.fixture
def worse(tmp_path, monkeypatch):
    """arith runs 10 points apart (30 lost, 5 won of 250: FAIL at the shipped 0.025), and a working folder
    holding files named ``arith-example`` and ``release`` that would pass them."""
    ref, cand = binary_pair(250, 30, 5)
    r, c = bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("arith-example", "release"):
        (work / name).write_text(LENIENT)
    monkeypatch.chdir(work)
    return r, c, work


def test_a_file_named_like_a_shipped_policy_never_replaces_it(worse, capsys):
    ref, cand, work = worse
    code, out, err = cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref,
                         "--policy", "arith-example")
    assert code == 1 and "verdict: FAIL" in out, out + err  # PASS under the planted file
    assert f"policy: {SHIPPED / 'arith-example.yaml'}" in out  # the terminal names the file that judged
    code, out, _ = cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref,
                       "--policy", "arith-example", "--json")
    assert code == 1 and json.loads(out)["policy"]["source"] == str(SHIPPED / "arith-example.yaml")
    # the planted ./release passed it too; the shipped release policy names no margin for arith
    code, _, err = cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref, "--policy", "release")
    assert code == 2
    one_line(err, f"arith: the policy {SHIPPED / 'release.yaml'} names no margin for it")
    # written as a path, the file is the policy, and named by its full path
    code, out, _ = cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref,
                       "--policy", "./arith-example")
    assert code == 0 and f"policy: {work / 'arith-example'}" in out


def test_gate_release_under_a_shipped_name_is_judged_by_the_shipped_file(worse, tmp_path, capsys, glm_ckpt):
    from quant.convert import convert
    from quant.plan import make_plan
    from quant.recipe import load_recipe

    ref, cand, _ = worse
    ckpt = tmp_path / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), ckpt, show_progress=False)
    evaluated(cand, ckpt)
    reports = tmp_path / "reports"
    code, out, err = cli(capsys, gate_main, "release", ckpt, "--candidate", cand, "--reference", ref,
                         "--policy", "arith-example", "--report-dir", reports)
    assert code == 1 and "release verdict: BLOCK" in out, out + err  # RELEASE under the planted file
    shipped = f"policy: {SHIPPED / 'arith-example.yaml'} (sha256 "
    assert shipped in out and shipped in (reports / "report.md").read_text().replace("**", "").replace("- ", "")
    assert json.loads((reports / "report.json").read_text())["provenance"]["policy"]["path"] == \
        str(SHIPPED / "arith-example.yaml")


def test_a_folder_named_like_a_shipped_policy_leaves_the_name_usable(tmp_path, monkeypatch, capsys):
    ref, cand = binary_pair(250, 2, 3)
    r, c = bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)
    (tmp_path / "arith-example").mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, gate_main, "accuracy", "--candidate", c, "--reference", r, "--policy", "arith-example")
    assert code == 0 and f"policy: {SHIPPED / 'arith-example.yaml'}" in out, err


@pytest.mark.parametrize("given, says", [
    ("arith-example.yaml", "--policy arith-example.yaml: no such file; the shipped policy is named without a path "
                           "or suffix: --policy arith-example"),
    ("./release", "--policy ./release: no such file; the shipped policy is named without a path or suffix: "
                  "--policy release"),
    ("mine.yaml", "--policy mine.yaml: no such file; a shipped policy is named by its name alone: arith-example, "
                  "release"),
    ("releas", "--policy releas: no shipped policy of that name (shipped: arith-example, release)"),
])
def test_a_policy_that_names_nothing_suggests_the_shipped_names(given, says, tmp_path, monkeypatch, capsys):
    ref, cand = binary_pair(250, 2, 3)
    r, c = bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, gate_main, "accuracy", "--candidate", c, "--reference", r, "--policy", given)
    assert code == 2
    one_line(err, says)


def test_a_file_here_under_an_unshipped_bare_name_is_named_as_a_path(tmp_path, monkeypatch, capsys):
    ref, cand = binary_pair(250, 2, 3)
    r, c = bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)
    (tmp_path / "strict").write_text("benchmarks:\n  arith: {margin: 0.01}\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, gate_main, "accuracy", "--candidate", c, "--reference", r, "--policy", "strict")
    assert code == 2
    one_line(err, "--policy strict: no shipped policy of that name", "--policy ./strict")


def test_a_pilot_without_a_policy_is_told_the_shipped_one_that_names_its_benchmark(tmp_path):
    ref, cand = binary_pair(250, 2, 3)
    r, c = bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)
    out = as_process("main", "plan", "--pilot-reference", r, "--pilot-candidate", c, timeout=120)
    assert out.returncode == 2
    one_line(out.stderr, f"--pilot-reference {r}: holds no", "--policy arith-example (shipped)")
    named = as_process("main", "plan", "--benchmarks", "arith", "--pilot-reference", r, timeout=120)
    assert named.returncode == 2
    one_line(named.stderr, "arith: the policy", "--margin arith=VALUE", "--policy arith-example (shipped)")


# ---- numbers that void the promise, or exhaust the machine ---------------------------------------------

GPQA_POLICY = "benchmarks:\n  gpqa_diamond: {margin: 0.04}\n"


@pytest.fixture
def straddles(tmp_path):
    """60 GPQA questions x 2 repeats whose bounds straddle -0.04 at 10000 resamples (INCONCLUSIVE); one
    resample put the bound on the delta (+0.042) and passed it."""
    rng = np.random.default_rng(0)
    ref, cand = ((rng.random((60, 2)) < 0.7).astype(int).tolist() for _ in range(2))
    r = bundle(tmp_path / "ref", "gpqa_diamond", ref, repeats=2)
    c = bundle(tmp_path / "cand", "gpqa_diamond", cand, repeats=2)
    policy = tmp_path / "policy.yaml"
    policy.write_text(GPQA_POLICY)
    return r, c, policy


def judged(capsys, straddles, policy_text: str | None = None) -> tuple[int, str, str]:
    """`gate accuracy` on the straddling pair under the policy file, rewritten first when text is given."""
    ref, cand, policy = straddles
    if policy_text is not None:
        policy.write_text(policy_text)
    return cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref, "--policy", policy)


def test_the_straddling_case_is_inconclusive_at_the_shipped_resamples(straddles, capsys):
    code, out, _ = judged(capsys, straddles)
    assert code == 1 and "INCONCLUSIVE" in out


@pytest.mark.parametrize("bootstrap, says", [
    ("{resamples: 1}", "bootstrap.resamples 1: the bound at confidence 0.95 needs from 447"),
    ("{resamples: 446}", "bootstrap.resamples 446: the bound at confidence 0.95 needs from 447"),
    ("{resamples: 1000000000}", f"bootstrap.resamples 1000000000: the bound at confidence 0.95 needs from 447 "
                                f"(fewer leave it to chance) to {MAX_RESAMPLES}"),
    ("{resamples: 1.5}", "bootstrap.resamples: Input should be a valid integer, not 1.5"),
    ("{seed: -1}", "bootstrap.seed: -1: a whole number from 0 to 4294967295"),
    ("{seed: 4294967296}", "bootstrap.seed: 4294967296: a whole number from 0 to 4294967295"),
    ("{seed: 0.5}", "bootstrap.seed: Input should be a valid integer, not 0.5"),
    ("{seed: true}", "bootstrap.seed: Input should be a valid integer, not True"),
])
def test_bootstrap_numbers_that_void_the_bound_are_refused(bootstrap, says, straddles, capsys):
    code, out, err = judged(capsys, straddles, f"bootstrap: {bootstrap}\n" + GPQA_POLICY)
    assert code == 2 and not out, out
    one_line(err, str(straddles[2]), says)


def test_a_confidence_whose_bound_needs_more_than_the_most_resamples_is_refused(straddles, capsys):
    code, _, err = judged(capsys, straddles, "confidence: 0.999999\nbootstrap: {resamples: 1000000}\n" + GPQA_POLICY)
    assert code == 2
    one_line(err, str(straddles[2]),
             f"confidence 0.999999: its bound needs {min_resamples(0.999999)} bootstrap resamples")
    # at 0.99 the floor rises with the level: 10000 holds, 1000 does not
    code, _, err = judged(capsys, straddles, "confidence: 0.99\nbootstrap: {resamples: 1000}\n" + GPQA_POLICY)
    assert code == 2
    one_line(err, "bootstrap.resamples 1000: the bound at confidence 0.99 needs from 1394")


def test_the_minimum_resamples_bound_the_monte_carlo_error_to_a_tenth_of_a_standard_error():
    """The alpha quantile of B normal draws errs by sqrt(alpha (1 - alpha) / B) / phi(z) standard
    deviations: measured, at the floor, it is about 0.1."""
    least = min_resamples(0.95)
    rng = np.random.default_rng(0)
    quantiles = np.quantile(rng.standard_normal((4000, least)), 0.05, axis=1)
    assert 0.09 < quantiles.std() < 0.11 and least == 447
    for shipped in ("release", "arith-example"):  # the shipped policies hold it with room
        assert load_policy(shipped).bootstrap.resamples >= 10 * min_resamples(load_policy(shipped).confidence)


@pytest.mark.parametrize("benchmarks, says", [
    ("{1: {margin: 0.02}}", "benchmarks: the key 1 is not a benchmark's name"),
    ("{null: {margin: 0.02}}", "benchmarks: the key None is not a benchmark's name"),
    ("{true: {margin: 0.02}}", "benchmarks: the key True is not a benchmark's name"),
    ("{'': {margin: 0.02}}", "benchmarks: the key '' is not a benchmark's name"),
    ("{gpqa_diamond: {margin: 0.04, required: 1}}",
     "benchmarks.gpqa_diamond.required: Input should be a valid boolean, not 1"),
    ("{gpqa_diamond: {margin: 0.04, inconclusive: 0}}",
     "benchmarks.gpqa_diamond.inconclusive: Input should be 'block' or 'warn', not 0"),
    ("{gpqa_diamond: {margin: 0.04, max_infra_error_rate: -0.1}}", "max_infra_error_rate: -0.1 is not a score or rate"),
])
def test_policy_keys_of_the_wrong_kind_are_one_line(benchmarks, says, straddles, capsys):
    code, _, err = judged(capsys, straddles, f"benchmarks: {benchmarks}\n")
    assert code == 2
    one_line(err, str(straddles[2]), says)


def test_kernels_blocking_must_be_a_bool(straddles, capsys):
    code, _, err = judged(capsys, straddles, "kernels: {blocking: 'no'}\n" + GPQA_POLICY)
    assert code == 2
    one_line(err, str(straddles[2]), "kernels.blocking: Input should be a valid boolean, not 'no'")


def test_a_planned_run_under_a_policy_without_its_benchmark_runs_nothing(glm_ckpt, tmp_path, capsys):
    """`evals run --until-decided` on an arith plan without --policy ran look 1 on the model, then failed at the
    gate; the release policy names no margin for arith, so it is refused before any model runs, naming the
    shipped policy that does."""
    plan = tmp_path / "plan.yaml"
    assert gate_main(["plan", "--policy", "arith-example", "--items", "arith=3", "--out", str(plan)]) in (0, 1)
    ref = bundle(tmp_path / "ref", "arith", [1, 1, 1])
    cand = tmp_path / "cand"
    capsys.readouterr()
    code, _, err = cli(capsys, evals_main, "run", "--benchmarks", "arith", "--model", glm_ckpt, "--plan", plan,
                       "--until-decided", "--reference", ref, "--out", cand, "--max-gen-toks", 8)
    assert code == 2
    one_line(err, "arith: the policy", "names no margin for it", "--policy arith-example (shipped)")
    assert not cand.exists()
