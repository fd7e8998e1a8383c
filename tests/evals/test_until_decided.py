"""``gate plan`` -> ``evals run --plan`` -> ``evals run --until-decided`` end to end on the tiny example
model (local, CPU): the plan recorded in run.json, each look judged at the plan's level, the run
stopping at the first final verdict or at the plan's last look, and the gate saying when a run
does not follow its plan."""

from __future__ import annotations

import json

from evals.bundle import read_bundle
from evals.cli import main as gate
from tests.evals.test_run import GEN, data_dir, run_cli  # noqa: F401  (data_dir: the synthetic GSM8K fixture)


def test_plan_then_until_decided_on_the_example_model(glm_ckpt, data_dir, tmp_path, capsys):  # noqa: F811
    policy = tmp_path / "policy.yaml"
    policy.write_text("benchmarks:\n  gsm8k: {margin: 0.0, required: true}\n")
    plan = tmp_path / "plan.yaml"
    # 3 items cannot certify anything: the plan says so (exit 1) and is the largest design, 3 x 2 with 2 looks
    assert gate(["plan", "--policy", str(policy), "--items", "gsm8k=3", "--max-repeats", "gsm8k=2", "--between",
                 "gsm8k=0.01", "--within", "gsm8k=0.2", "--out", str(plan)]) == 1
    assert "NO DESIGN REACHES THE POWER" in capsys.readouterr().out
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--model", glm_ckpt, "--plan", plan, *GEN]
    ref = tmp_path / "ref"
    assert run_cli("--out", ref, *common) == 0
    ref_run, ref_rows = read_bundle(ref)
    assert ref_run["plan"]["benchmarks"]["gsm8k"]["items"] == 3 and ref_run["benchmarks"]["gsm8k"]["settings"]["seeds"] \
        == [0, 1]
    assert {(r["item_id"], r["repeat"]) for r in ref_rows} == {(str(i), k) for i in range(3) for k in range(2)}
    capsys.readouterr()

    # a margin the 3 equal items clear even at look 1's level (no item lost: exact bound about -0.81):
    # PASS at the first look, the second repeat never runs
    policy.write_text("benchmarks:\n  gsm8k: {margin: 0.9, required: true}\n")
    cand = tmp_path / "cand"
    assert run_cli("--out", cand, *common, "--until-decided", "--reference", ref, "--policy", policy) == 0
    looks = json.loads((cand / "looks.json").read_text())
    assert len(looks) == 1 and looks[0]["benchmarks"]["gsm8k"]["verdict"] == "PASS"
    assert looks[0]["benchmarks"]["gsm8k"]["confidence"] > 0.99  # look 1's spent level, not 0.95
    assert {r["repeat"] for r in read_bundle(cand)[1]} == {0}
    capsys.readouterr()

    # margin 0: the same model (delta 0 exactly) is never PASS nor FAIL, so every look runs (repeat 0 kept
    # by --resume), the last one final
    policy.write_text("benchmarks:\n  gsm8k: {margin: 0.0, required: true}\n")
    assert run_cli("--out", cand, *common, "--until-decided", "--reference", ref, "--policy", policy, "--resume") == 1
    printed = capsys.readouterr().out
    looks = json.loads((cand / "looks.json").read_text())
    assert [entry["repeats"]["gsm8k"] for entry in looks] == [1, 2]
    first, last = (entry["benchmarks"]["gsm8k"] for entry in looks)
    assert first["verdict"] == last["verdict"] == "INCONCLUSIVE" and not first["final"] and last["final"]
    assert first["confidence"] > 0.99 > last["confidence"] > 0.95  # the plan's spent levels
    assert printed.count("INCONCLUSIVE r") == 2 and '"looks": 2' in printed

    # the gate on the finished candidate: judged at look 2 of 2, following its plan
    result = json.loads(_gate(capsys, cand, ref, policy))
    bench = result["benchmarks"][0]
    assert bench["look"]["look"] == 2 and bench["look"]["follows"] and "look 2 of 2" in bench["rule"]

    # a run off its plan (the plan edited to 2 items after the run): the gate says so and blocks
    run = json.loads((cand / "run.json").read_text())
    run["plan"]["benchmarks"]["gsm8k"]["items"] = 2
    (cand / "run.json").write_text(json.dumps(run))
    result = json.loads(_gate(capsys, cand, ref, policy, code=1))
    assert "does not follow its plan (3 items compared, the plan has 2)" in result["benchmarks"][0]["rule"]

    # flags that contradict the plan, or an until-decided without a reference: one line, exit 2
    assert run_cli("--out", tmp_path / "x", *common, "--limit", 2) == 2
    assert "fixes items and seeds" in capsys.readouterr().err
    assert run_cli("--out", tmp_path / "y", *common, "--until-decided") == 2
    assert "needs --plan PLAN and --reference REF" in capsys.readouterr().err


def _gate(capsys, cand, ref, policy, code: int | None = None) -> str:
    got = gate(["accuracy", "--candidate", str(cand), "--reference", str(ref), "--policy", str(policy),
                "--benchmarks", "gsm8k", "--json"])
    if code is not None:
        assert got == code
    return capsys.readouterr().out
