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
from evals.tau2 import rows_from_results  # noqa: E402


def results_file(path, domain: str, rewards: dict[str, list[float]], user_llm: str = "gpt-4.1",
                 reasons: dict[str, tuple[str, bool]] | None = None, max_steps: int = 100) -> str:
    """A tau2 results file built with tau2's own models; ``reasons``: task id -> (termination reason,
    skipped) for its trials, agent_stop and not skipped otherwise."""
    tasks = [Task(id=t, user_scenario=UserScenario(instructions=f"do {t}"), evaluation_criteria=EvaluationCriteria())
             for t in rewards]
    sims = []
    for task_id, trials in rewards.items():
        reason, skipped = (reasons or {}).get(task_id, ("agent_stop", False))
        for trial, reward in enumerate(trials):
            sims.append(SimulationRun(id=f"{domain}-{task_id}-{trial}", task_id=task_id, start_time="t0", end_time="t1",
                                      duration=1.0, termination_reason=TerminationReason(reason),
                                      reward_info=RewardInfo(reward=reward), messages=[], trial=trial, seed=trial,
                                      skipped=skipped))
    info = Info(git_commit="abc", num_trials=len(next(iter(rewards.values()))), max_steps=max_steps, max_errors=10,
                user_info=UserInfo(implementation="user_simulator", llm=user_llm),
                agent_info=AgentInfo(implementation="llm_agent", llm="served-model"),
                environment_info=EnvironmentInfo(domain_name=domain, policy=f"{domain} policy"), seed=300)
    Results(info=info, tasks=tasks, simulations=sims).save(path)
    return str(path)


def test_three_domains_macro_and_infra_errors(tmp_path, capsys):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1, 0], "2": [0, 0]},
                          reasons={"2": ("agent_error", True)}),
             results_file(tmp_path / "r.json", "retail", {"1": [0, 0], "2": [1, 0], "3": [1, 1]}),
             results_file(tmp_path / "t.json", "telecom", {"9": [1, 1]})]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "bundle")]) == 0
    run, rows = read_bundle(tmp_path / "bundle")
    tau2 = run["benchmarks"]["tau2"]
    assert tau2["domains"]["airline"]["pass1"] == pytest.approx(0.25)
    assert tau2["domains"]["retail"]["pass1"] == pytest.approx(0.5)
    assert tau2["macro_pass1"] == pytest.approx((0.25 + 0.5 + 1.0) / 3)  # unweighted mean of domains
    # a simulation that raised with no recorded reason is counted as an infrastructure error
    assert tau2["infra_errors"] == 2 and tau2["domains"]["airline"]["infra_errors"] == 2
    assert tau2["infra_error_rate"] == pytest.approx(2 / 12)
    assert len(rows) == 12 and {r["item_id"] for r in rows} >= {"airline/1", "retail/3", "telecom/9"}


def test_classified_by_termination_reason_and_recorded_failure(tmp_path):
    """Model failures (tau2's too_many_errors, max_steps, a protocol-breaking agent_error, the agent's
    unparsable tool call) are task failures; the user simulator's and the connection's are infra."""
    path = results_file(tmp_path / "airline.json", "airline", {t: [0] for t in "abcdef"}, reasons={
        "a": ("too_many_errors", False), "b": ("max_steps", False), "c": ("agent_error", False),
        "d": ("user_error", False), "e": ("agent_error", True), "f": ("agent_error", True)})
    events = [{"event": "error", "task_id": "e", "seed": 0, "side": "agent", "error_type": "JSONDecodeError",
               "message": "Expecting value"},
              {"event": "error", "task_id": "f", "seed": 0, "side": "user", "error_type": "APIConnectionError",
               "message": "Connection error."}]
    (tmp_path / "airline.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows, summary = rows_from_results([path])
    infra = {r["item_id"].split("/")[1]: r["infra_error"] for r in rows}
    assert infra == {"a": False, "b": False, "c": False, "d": True, "e": False, "f": True}
    assert summary["domains"]["airline"]["errors"] == {
        "infra: the user simulator broke the conversation protocol": 1, "infra: user: APIConnectionError": 1,
        "model: agent: JSONDecodeError": 1}
    assert summary["domains"]["airline"]["terminations"] == {"agent_error": 3, "max_steps": 1, "too_many_errors": 1,
                                                              "user_error": 1}


def test_refuses_two_files_of_one_domain(tmp_path, capsys):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1]}),
             results_file(tmp_path / "b.json", "airline", {"2": [0]})]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "o")]) == 2
    assert "a second results file for domain 'airline'" in capsys.readouterr().err


@pytest.mark.parametrize("differ", [{"user_llm": "claude"}, {"max_steps": 30}])
def test_refuses_domains_run_with_different_settings(tmp_path, capsys, differ):
    files = [results_file(tmp_path / "a.json", "airline", {"1": [1]}),
             results_file(tmp_path / "r.json", "retail", {"2": [0]}, **differ)]
    assert evals_main(["import-tau2", *files, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "disagree on the user simulator" in err and str(next(iter(differ.values()))) in err


def test_not_a_results_file(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    assert evals_main(["import-tau2", str(tmp_path / "x.json"), "--out", str(tmp_path / "o")]) == 2
    assert "not a tau2 results file" in capsys.readouterr().err


def test_run_tau2_needs_an_endpoint_and_a_user_simulator(tmp_path, capsys):
    code = evals_main(["run", "--benchmarks", "tau2", "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path),
                       "--model", "m"])
    err = capsys.readouterr().err
    assert code == 2 and "--tau2-user-llm" in err and "evals import-tau2" in err
