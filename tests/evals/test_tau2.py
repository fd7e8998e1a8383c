"""``evals import-tau2`` on results files built through tau2's own pydantic models."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
from tau2.data_model.simulation import (AgentInfo, Info, Results, RewardInfo, SimulationRun,  # noqa: E402
                                        TerminationReason, UserInfo)
from tau2.data_model.tasks import EvaluationCriteria, Task, UserScenario  # noqa: E402
from tau2.environment.environment import EnvironmentInfo  # noqa: E402

from evals.bundle import read_bundle  # noqa: E402
from evals.cli import evals_main  # noqa: E402


def results_file(path, domain: str, rewards: dict[str, list[float]], user_llm: str = "gpt-4.1",
                 errors: int = 0) -> str:
    tasks = [Task(id=t, user_scenario=UserScenario(instructions=f"do {t}"), evaluation_criteria=EvaluationCriteria())
             for t in rewards]
    sims = []
    for task_id, trials in rewards.items():
        for trial, reward in enumerate(trials):
            reason = TerminationReason.AGENT_ERROR if errors > 0 else TerminationReason.AGENT_STOP
            errors -= reason == TerminationReason.AGENT_ERROR
            sims.append(SimulationRun(id=f"{domain}-{task_id}-{trial}", task_id=task_id, start_time="t0", end_time="t1",
                                      duration=1.0, termination_reason=reason, reward_info=RewardInfo(reward=reward),
                                      messages=[], trial=trial, seed=trial))
    info = Info(git_commit="abc", num_trials=len(next(iter(rewards.values()))), max_steps=100, max_errors=10,
                user_info=UserInfo(implementation="user_simulator", llm=user_llm),
                agent_info=AgentInfo(implementation="llm_agent", llm="served-model"),
                environment_info=EnvironmentInfo(domain_name=domain, policy=f"{domain} policy"), seed=300)
    Results(info=info, tasks=tasks, simulations=sims).save(path)
    return str(path)


def test_three_domains_macro_and_infra_errors(tmp_path, capsys):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1, 0], "2": [1, 1]}, errors=1),
             results_file(tmp_path / "r.json", "retail", {"1": [0, 0], "2": [1, 0], "3": [1, 1]}),
             results_file(tmp_path / "t.json", "telecom", {"9": [1, 1]})]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "bundle")]) == 0
    run, rows = read_bundle(tmp_path / "bundle")
    tau2 = run["benchmarks"]["tau2"]
    assert tau2["domains"]["airline"]["pass1"] == pytest.approx(0.75)
    assert tau2["domains"]["retail"]["pass1"] == pytest.approx(0.5)
    assert tau2["macro_pass1"] == pytest.approx((0.75 + 0.5 + 1.0) / 3)  # unweighted mean of domains
    assert tau2["infra_errors"] == 1 and tau2["domains"]["airline"]["infra_errors"] == 1
    assert len(rows) == 12 and {r["item_id"] for r in rows} >= {"airline/1", "retail/3", "telecom/9"}


def test_refuses_two_files_of_one_domain(tmp_path, capsys):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1]}),
             results_file(tmp_path / "b.json", "airline", {"2": [0]})]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "o")]) == 2
    assert "a second results file for domain 'airline'" in capsys.readouterr().err


def test_refuses_different_user_simulators(tmp_path, capsys):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1]}, user_llm="gpt-4.1"),
             results_file(tmp_path / "r.json", "retail", {"2": [0]}, user_llm="claude")]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "disagree on the user simulator" in err and "claude" in err


def test_not_a_results_file(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    assert evals_main(["import-tau2", str(tmp_path / "x.json"), "--out", str(tmp_path / "o")]) == 2
    assert "not a tau2 results file" in capsys.readouterr().err


def test_run_tau2_needs_an_endpoint_and_a_user_simulator(tmp_path, capsys):
    code = evals_main(["run", "--benchmarks", "tau2", "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path),
                       "--model", "m"])
    err = capsys.readouterr().err
    assert code == 2 and "--tau2-user-llm" in err and "evals import-tau2" in err
