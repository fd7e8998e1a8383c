"""Hostile inputs, third campaign: plan files, policies and
the plan a run bundle carries, each read by one validating reader and judged by the reviewer's policy.

Every case runs the real command on real files (links to /dev/zero, FIFOs, alias bombs; as its own
process where a hang or the exit status itself is the point, else through the CLI's ``main``) and
ends with the files outside the output folder unchanged (``outside``); each bad input is one line
naming the file and the field, exit 2, never a traceback or a hang.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from evals.cli import evals_main
from evals.cli import main as gate_main
from evals.judge.plan_file import levels
from tests.evals.test_gate import binary_pair, bundle
from tests.evals.test_hostile_evals import as_process, cli, one_line, outside  # noqa: F401  (outside: a fixture)

pytestmark = pytest.mark.usefixtures("outside")  # every case: the files outside the output folder unchanged

MARGIN_POLICY = "benchmarks:\n  gsm8k: {margin: 0.025, required: true}\n"
BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + k)}: &{chr(98 + k)} [{', '.join(['*' + chr(97 + k)] * 9)}]\n" for k in range(8))


def honest_plan(items: int = 200, fractions: tuple[float, ...] = (1.0,), confidence: float = 0.95) -> dict:
    """A plan as `gate plan` writes it (``design.make_plan``), for GSM8K: one look per entry of ``fractions``."""
    looks = [{"look": k + 1, "repeats": k + 1, "information_fraction": t, "confidence": c}
             for k, (t, c) in enumerate(zip(fractions, levels(list(fractions), 1 - confidence)))]
    return {"plan_version": 1, "made_by": "gate plan", "alpha": round(1 - confidence, 12), "confidence": confidence,
            "benchmarks": {"gsm8k": {"benchmark": "gsm8k", "items": items, "repeats": len(fractions), "margin": 0.025,
                                     "looks": looks, "seeds": list(range(len(fractions)))}}}


@pytest.fixture
def lost3(tmp_path):
    """200 GSM8K items, 3 lost and none won, at margin 0.025: INCONCLUSIVE at 0.95 (exit 1), the issue's case."""
    ref, cand = binary_pair(200, 3, 0)
    policy = tmp_path / "policy.yaml"
    policy.write_text(MARGIN_POLICY)
    return bundle(tmp_path / "ref", "gsm8k", ref), bundle(tmp_path / "cand", "gsm8k", cand), policy


def _carry_plan(cand, plan) -> None:
    run = json.loads((cand / "run.json").read_text())
    run["plan"] = plan
    (cand / "run.json").write_text(json.dumps(run))


def _accuracy(ref, cand, policy, *extra):
    return as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--policy", policy, *extra)


def _accuracy_in(capsys, ref, cand, policy, *extra) -> tuple[int, str, str]:
    return cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref, "--policy", policy, *extra)


# ---- item 2: the candidate does not choose the level it is judged at ------------------------------------

def test_without_a_plan_three_lost_of_200_blocks(lost3):
    ref, cand, policy = lost3
    out = _accuracy(ref, cand, policy, "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["verdict"] == "INCONCLUSIVE"


BUNDLE_PLANS = {
    # the reproduction: one look at 0.5 (no plan-wide confidence) turned exit 1 into PASS, exit 0
    "one look at 0.5": ({"plan_version": 1, "benchmarks": {"gsm8k": {"items": 200, "seeds": [0], "repeats": 1, "looks": [
        {"look": 1, "repeats": 1, "information_fraction": 1.0, "confidence": 0.5}]}}}, "confidence: a required key"),
    "0.5 everywhere": (honest_plan() | {"confidence": 0.5}, "confidence: 0.5 is not a one-sided"),
    "plan at 0.6": (json.loads(json.dumps(honest_plan(confidence=0.6))),
                    "plan.confidence: the plan's 0.6 is not the policy's 0.95"),
    "look at 0.6 under 0.95": (
        json.loads(json.dumps(honest_plan()).replace('"information_fraction": 1.0, "confidence": 0.95',
                                                     '"information_fraction": 1.0, "confidence": 0.6')),
        "plan.benchmarks.gsm8k.looks[0].confidence: the plan's 0.6 is not 0.950000"),
    "two looks, the first at 0.6": (
        {**honest_plan(fractions=(0.5, 1.0)), "benchmarks": {"gsm8k": {
            **honest_plan(fractions=(0.5, 1.0))["benchmarks"]["gsm8k"],
            "looks": [{"look": 1, "repeats": 1, "information_fraction": 0.5, "confidence": 0.6},
                      honest_plan(fractions=(0.5, 1.0))["benchmarks"]["gsm8k"]["looks"][1]]}}},
        "looks[0].confidence: the plan's 0.6 is not 0.99"),
    "confidence a string": (honest_plan() | {"confidence": "0.95x"}, "confidence: Input should be a valid number"),
    "confidence 0.0": (honest_plan() | {"confidence": 0.0}, "confidence: 0.0 is not a one-sided confidence"),
    "confidence 1.0": (honest_plan() | {"confidence": 1.0}, "confidence: 1.0 is not a one-sided confidence"),
    "benchmarks a list": (honest_plan() | {"benchmarks": ["gsm8k"]}, "benchmarks: Input should be a valid dict"),
    "plan a list": ([honest_plan()], "plan: a list where a mapping belongs"),
}


@pytest.mark.parametrize("case", BUNDLE_PLANS)
def test_a_bundle_plan_that_differs_from_the_policy_is_refused_never_obeyed(case, lost3, capsys):
    ref, cand, policy = lost3
    plan, says = BUNDLE_PLANS[case]
    _carry_plan(cand, plan)
    if case == "one look at 0.5":  # the reproduction, as its own process: exit 0 before
        out = _accuracy(ref, cand, policy)
        code, err = out.returncode, out.stderr
    else:
        code, _, err = _accuracy_in(capsys, ref, cand, policy)
    assert code == 2, err
    one_line(err, str(cand / "run.json"), says)


def test_an_honest_plan_is_judged_at_the_policys_level(lost3):
    ref, cand, policy = lost3
    _carry_plan(cand, honest_plan())
    out = _accuracy(ref, cand, policy, "--json")
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["verdict"] == "INCONCLUSIVE"
    assert result["benchmarks"][0]["look"]["confidence"] == pytest.approx(0.95, abs=1e-12)


def test_a_policy_at_another_confidence_refuses_the_plan_naming_both(lost3):
    ref, cand, policy = lost3
    policy.write_text("confidence: 0.9\n" + MARGIN_POLICY)
    _carry_plan(cand, honest_plan())
    out = _accuracy(ref, cand, policy)
    assert out.returncode == 2
    one_line(out.stderr, f"{cand / 'run.json'}: plan.confidence: the plan's 0.95 is not the policy's 0.9", str(policy))


def test_until_decided_refuses_a_plan_of_another_confidence_before_any_run(lost3, glm_ckpt, tmp_path):
    ref, _, policy = lost3
    policy.write_text("confidence: 0.9\n" + MARGIN_POLICY)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(honest_plan(items=3, fractions=(0.5, 1.0))))
    out = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--model", glm_ckpt, "--out", tmp_path / "out",
                     "--plan", plan, "--until-decided", "--reference", ref, "--policy", policy)
    assert out.returncode == 2
    one_line(out.stderr, "--plan.confidence: the plan's 0.95 is not the policy's 0.9")
    assert not (tmp_path / "out").exists()


# ---- item 6: plan files through the validating reader ------------------------------------------------

def _edit(change) -> str:
    plan = honest_plan(items=3, fractions=(0.5, 1.0))
    change(plan, plan["benchmarks"]["gsm8k"])
    return yaml.safe_dump(plan)


PLAN_FILES = {
    "0 items": (_edit(lambda p, g: g.update(items=0)), "benchmarks.gsm8k.items: Input should be greater than 0, not 0"),
    "-5 items": (_edit(lambda p, g: g.update(items=-5)), "gsm8k.items: Input should be greater than 0, not -5"),
    "items true": (_edit(lambda p, g: g.update(items=True)), "gsm8k.items: Input should be a valid integer, not True"),
    "a list for benchmarks": (_edit(lambda p, g: p.update(benchmarks=[g])), "benchmarks: Input should be a valid dict"),
    "a list for a benchmark": (_edit(lambda p, g: p["benchmarks"].update(gsm8k=[3, 2])),
                               "benchmarks.gsm8k: Input should be a valid dictionary"),
    "a list for a look": (_edit(lambda p, g: g["looks"].__setitem__(0, [1, 0.5])),
                          "benchmarks.gsm8k.looks.0: Input should be a valid dictionary"),
    "the plan a list": ("- 1\n- 2\n", "a YAML list, not a mapping"),
    "a number for a benchmark name": (_edit(lambda p, g: p["benchmarks"].update({1: json.loads(json.dumps(g))})),
                                      "benchmarks: 1 is not a benchmark name"),
    "missing looks": (_edit(lambda p, g: g.pop("looks")), "benchmarks.gsm8k.looks: a required key, missing"),
    "no looks": (_edit(lambda p, g: g.update(looks=[])), "benchmarks.gsm8k.looks: List should have at least 1 item"),
    "looks at 1, 2, 2 repeats": (
        _edit(lambda p, g: g.update(repeats=2, looks=[*g["looks"], dict(g["looks"][1])])),
        "benchmarks.gsm8k: looks: at [1, 2, 2] repeats; looks must rise strictly"),
    "looks past the repeats": (_edit(lambda p, g: g.update(repeats=1, seeds=[0])),
                               "looks: at [1, 2] repeats; looks must rise strictly to the plan's 1 repeats"),
    "fractions falling": (_edit(lambda p, g: g["looks"][0].update(information_fraction=1.0)),
                          "information fractions [1.0, 1.0] must rise strictly to 1"),
    "seeds repeated": (_edit(lambda p, g: g.update(seeds=[0, 0])), "seeds: [0, 0] is not 2 distinct seeds"),
    "seeds negative": (_edit(lambda p, g: g.update(seeds=[0, -1])), "seeds.1: Input should be greater than or equal"),
    "confidence 0.95x": (_edit(lambda p, g: p.update(confidence="0.95x")),
                         "confidence: Input should be a valid number, not '0.95x'"),
    "confidence 1.0": (_edit(lambda p, g: p.update(confidence=1.0)), "confidence: 1.0 is not a one-sided confidence"),
    "a look at 0.0": (_edit(lambda p, g: g["looks"][0].update(confidence=0.0)), "looks.0.confidence: 0.0 is not"),
    "version 2": (_edit(lambda p, g: p.update(plan_version=2)), "plan_version: Input should be 1, not 2"),
    "a misspelt key": (_edit(lambda p, g: g.update(sedes=g.pop("seeds"))),
                       "benchmarks.gsm8k: unknown key 'sedes' (did you mean 'seeds'?)"),
    "alias bomb": (BILLION_LAUGHS, "an alias (*name), which quantgate does not expand"),
    "5000-digit items": (_edit(lambda p, g: g.update(items=1)).replace("items: 1", "items: " + "9" * 5000),
                         "an integer of 5000 digits"),
    "deep nesting": ("a: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
    "not YAML": ("benchmarks: [1\n", ":2: not valid YAML"),
    "not UTF-8": (b"\xff\xfe\x00plan", "not valid YAML"),
    "over 1 MiB": ("# " + "x" * (1 << 20) + "\n", "larger than 1 MiB"),
}


def _evals_run_plan(glm_ckpt, tmp_path, plan):
    return as_process("evals_main", "run", "--benchmarks", "gsm8k", "--model", glm_ckpt, "--out", tmp_path / "out",
                      "--plan", plan, timeout=60)


@pytest.mark.parametrize("case", PLAN_FILES)
def test_bad_plan_files_are_one_line_naming_the_field(case, glm_ckpt, tmp_path, capsys):
    content, says = PLAN_FILES[case]
    plan = tmp_path / "plan.yaml"
    plan.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = cli(capsys, evals_main, "run", "--benchmarks", "gsm8k", "--model", glm_ckpt, "--out",
                       tmp_path / "out", "--plan", plan)
    assert code == 2, err[-2000:]
    one_line(err, f"--plan {plan}", says)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "folder", "missing"])
def test_a_plan_that_is_no_regular_file_is_refused_without_hanging(special, glm_ckpt, tmp_path):
    plan = tmp_path / "plan.yaml"
    if special == "fifo":
        os.mkfifo(plan)
    elif special == "dev-zero":
        plan.symlink_to("/dev/zero")
    elif special == "folder":
        plan.mkdir()
    out = _evals_run_plan(glm_ckpt, tmp_path, plan)  # a FIFO read would wait for a writer past the timeout
    assert out.returncode == 2
    one_line(out.stderr, f"--plan {plan}", "not found" if special == "missing" else "not a regular file")


def test_a_plan_gate_plan_writes_reads_back(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    code, _, _ = cli(capsys, gate_main, "plan", "--benchmarks", "gpqa_diamond", "--items", "gpqa_diamond=20",
                     "--max-repeats", "gpqa_diamond=3", "--out", plan)
    assert code in (0, 1)
    from evals.judge.plan_file import read_plan

    written = read_plan(plan)
    assert [lk["repeats"] for lk in written["benchmarks"]["gpqa_diamond"]["looks"]] == [1, 2, 3]


# ---- policies through the same reader; gate accuracy's confidence ------------------------------------

POLICIES = {
    "confidence 0.0": ("confidence: 0.0\n" + MARGIN_POLICY, "confidence 0.0 must lie in (0.5, 1)"),
    "confidence 1.0": ("confidence: 1.0\n" + MARGIN_POLICY, "confidence 1.0 must lie in (0.5, 1)"),
    "confidence 0.95x": ("confidence: 0.95x\n" + MARGIN_POLICY,
                         "confidence: Input should be a valid number, not '0.95x'"),
    "confidence .nan": ("confidence: .nan\n" + MARGIN_POLICY, "confidence: Input should be a finite number, not nan"),
    "margin .inf": ("benchmarks:\n  gsm8k: {margin: .inf}\n",
                    "benchmarks.gsm8k.margin: Input should be a finite number, not inf"),
    "min_items 1.5": ("benchmarks:\n  gsm8k: {margin: 0.02, min_items: 1.5}\n",
                      "min_items: Input should be a valid integer, not 1.5"),
    "min_items -1": ("benchmarks:\n  gsm8k: {margin: 0.02, min_items: -1}\n", "min_items: -1 is negative"),
    "floor 2": ("benchmarks:\n  gsm8k: {margin: 0.02, floor: 2}\n", "benchmarks.gsm8k.floor: 2.0 is not a score"),
    "benchmarks a list": ("benchmarks: [gsm8k]\n", "benchmarks: Input should be a valid dictionary"),
    "a benchmark a list": ("benchmarks:\n  gsm8k: [0.02]\n", "benchmarks.gsm8k: Input should be a valid dictionary"),
    "resamples 0": ("bootstrap: {resamples: 0}\n" + MARGIN_POLICY,
                    "bootstrap.resamples 0: the bound at confidence 0.95 needs from 447"),
    "alias bomb": (BILLION_LAUGHS, "an alias (*name)"),
    "a list": ("- gsm8k\n", "a YAML list, not a mapping"),
    "source set by the file": ("source: elsewhere.yaml\n" + MARGIN_POLICY, "unknown key 'source'"),
    "no margin": ("benchmarks:\n  gsm8k: {required: true}\n", "benchmarks.gsm8k.margin: a required key, missing"),
    "a misspelt key": ("benchmarks:\n  gsm8k: {margn: 0.5, margin: 0.02}\n",
                       "benchmarks.gsm8k: unknown key 'margn' (did you mean 'margin'?)"),
}


@pytest.mark.parametrize("case", POLICIES)
def test_bad_policies_are_one_line_naming_the_field(case, lost3, capsys):
    ref, cand, policy = lost3
    content, says = POLICIES[case]
    policy.write_text(content)
    code, _, err = _accuracy_in(capsys, ref, cand, policy)
    assert code == 2, err[-2000:]
    one_line(err, str(policy), says)


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_a_policy_that_is_no_regular_file_is_refused_without_hanging(special, lost3):
    ref, cand, policy = lost3
    policy.unlink()
    os.mkfifo(policy) if special == "fifo" else policy.symlink_to("/dev/zero")
    out = _accuracy(ref, cand, policy)
    assert out.returncode == 2
    one_line(out.stderr, str(policy), "not a regular file")


@pytest.mark.parametrize("table, says", [
    ("benchmarks: [gsm8k]\n", "benchmarks: Input should be a valid dictionary"),
    ("benchmarks:\n  gsm8k: {se: 0.01}\n", "benchmarks.gsm8k.score: a required key, missing"),
    ("benchmarks:\n  gsm8k: {scor: 0.9}\n", "benchmarks.gsm8k: unknown key 'scor' (did you mean 'score'?)"),
    ("benchmarks:\n  gsm8k: {score: 96}\n", "in [0, 1]"),
    (BILLION_LAUGHS, "an alias"),
])
def test_a_bad_reference_table_is_one_line(table, says, lost3, tmp_path, capsys):
    ref, cand, policy = lost3
    path = tmp_path / "table.yaml"
    path.write_text(table)
    code, _, err = _accuracy_in(capsys, ref, cand, policy, "--reference-table", path)
    assert code == 2
    one_line(err, str(path), says)


# ---- no hidden margin; the example's policy ships with the package --------------------

@pytest.fixture
def arith(tmp_path):
    ref, cand = binary_pair(250, 2, 3)
    return bundle(tmp_path / "ref", "arith", ref), bundle(tmp_path / "cand", "arith", cand)


def test_a_benchmark_the_policy_does_not_name_is_refused_saying_how_to_name_it(arith, tmp_path):
    ref, cand = arith
    out = as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--benchmarks", "arith",
                     cwd=tmp_path)
    assert out.returncode == 2
    one_line(out.stderr, "arith: the policy", "names no margin for it", "--margin arith=VALUE", "arith-example")


def test_the_shipped_example_policy_is_found_by_name_from_any_folder(arith, tmp_path):
    ref, cand = arith
    out = as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--policy", "arith-example",
                     "--json", cwd=tmp_path)
    result = json.loads(out.stdout)
    assert out.returncode in (0, 1) and result["policy"]["source"].endswith("manifests/gates/arith-example.yaml")
    assert result["benchmarks"][0]["margin"] == 0.025
    named = as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--benchmarks", "arith",
                       "--margin", "arith=0.03", "--json", cwd=tmp_path)
    assert named.returncode in (0, 1) and json.loads(named.stdout)["benchmarks"][0]["margin"] == 0.03
    unknown = as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--policy", "arith-exampel",
                         cwd=tmp_path)
    assert unknown.returncode == 2
    one_line(unknown.stderr, "--policy arith-exampel: no shipped policy", "arith-example", "release")


# ---- gate plan: pilots without variance, pilots partly repeated ----------------------------------------

def test_gate_plan_with_a_pilot_that_shows_no_variance_says_so(tmp_path):
    same = [[1, 1]] * 50
    ref, cand = (bundle(tmp_path / name, "gpqa_diamond", same, repeats=2) for name in ("ref", "cand"))
    out = as_process("main", "plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", ref, "--pilot-candidate",
                     cand)
    assert out.returncode == 2
    one_line(out.stderr, "gpqa_diamond: no variance to plan with (between 0, within 0", "give a pilot with more items")
    stated = as_process("main", "plan", "--benchmarks", "gpqa_diamond", "--between", "gpqa_diamond=0", "--within",
                        "gpqa_diamond=0")
    assert stated.returncode == 2
    one_line(stated.stderr, "no variance to plan with", "stated: --between/--within")
    # a reference alone whose repeats agree: within 0, so the design needs no repeats
    alone = as_process("main", "plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", ref, "--json")
    assert json.loads(alone.stdout)["benchmarks"]["gpqa_diamond"]["repeats"] == 1


def test_gate_plan_with_a_partly_repeated_pilot_is_one_line(tmp_path):
    ref = bundle(tmp_path / "ref", "gpqa_diamond", [[1, 0]] * 30, repeats=2)
    rows = [json.loads(line) for line in (ref / "samples.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["repeat"] == 0 or r["item_id"] == "0"]  # one item has its second repeat
    (ref / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    out = as_process("main", "plan", "--benchmarks", "gpqa_diamond", "--pilot-reference", ref)
    assert out.returncode == 2
    one_line(out.stderr, f"--pilot-reference {ref}: gpqa_diamond: 1 of 30 items have every repeat (2)")


# ---- tau2 results files: JSON inputs through the same regular-file read ------------------------------

@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_evals_import_tau2_refuses_a_results_file_that_is_no_regular_file(special, tmp_path):
    results = tmp_path / "airline.json"
    os.mkfifo(results) if special == "fifo" else results.symlink_to("/dev/zero")
    out = as_process("evals_main", "import-tau2", results, "--out", tmp_path / "bundle", timeout=120)  # hung on a FIFO
    assert out.returncode == 2
    one_line(out.stderr, str(results), "not a regular file")
    assert not (tmp_path / "bundle").exists()
