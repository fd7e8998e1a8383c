"""tau2-bench results files -> a run bundle the gate can pair.

Each simulation becomes one row: item ``<domain>/<task_id>``, repeat = trial, score = reward (0/1).
A domain's score is pass^1 (mean over tasks of the task's mean reward); the benchmark's number is
the macro: the unweighted mean of the per-domain pass^1, as tau2-bench results are reported.

Every simulation is classified by tau2 26.3's own termination reasons
(``tau2/data_model/simulation.py`` ``TerminationReason``, set in
``tau2/orchestrator/orchestrator.py``), because only failures of the measurement, not of the model,
may be discounted:

- task outcomes (the model's doing, scored as tau2 scores them): ``agent_stop``, ``user_stop``,
  ``max_steps``, ``too_many_errors`` (wrong-but-valid tool calls), ``judge_stop``, and
  ``agent_error`` when the agent broke the conversation protocol;
- ``user_error``: the user simulator broke the protocol -- an infrastructure error;
- a simulation that raised (saved by tau2's ``skip_failed_samples`` as a 0-reward ``agent_error``
  with ``skipped: true``; ``tau2/run.py`` ``run_tasks``): the reason comes from the events file
  ``evals run`` writes beside the results (``<domain>.events.jsonl``). The agent's own bad output
  -- arguments that are not JSON (``JSONDecodeError``), a conversation past the context window
  (``ContextWindowExceededError``) -- is a task failure; everything else (connection dropped,
  timeouts, server errors, the user simulator's or the evaluator's failures, or no recorded
  reason) is an infrastructure error.

``evals run`` runs a simulation that ended in an infrastructure error again (same task, trial and
seed) up to ``--tau2-infra-retries`` times before the domain finishes; each retry is a ``retry``
event, counted on the row (``retries``) and per domain in ``run.json``. What still failed scores 0
in both arms (counted the same way), is counted per domain in ``run.json`` with its reason, and
``evals run --resume`` runs it again; the gate flags an arm whose infrastructure-error rate is above
the policy's threshold.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from evals.bundle import BundleWriter
from evals.errors import BadInput
from quant.hashing import sha256_of
from quant.safe_files import read_regular

MODEL_OUTPUT_ERRORS = {"JSONDecodeError", "ContextWindowExceededError"}
INFRA_TERMINATIONS = {"user_error"}
# What both arms of a comparison must share (tau2's Info fields), and therefore every domain of a bundle.
SETTINGS = ("user_llm", "user_llm_args", "agent_llm_args", "num_trials", "max_steps", "max_errors", "seed")


class Tau2Error(BadInput):
    pass


RESULTS_BYTES = 1 << 30  # a results file holds every simulation's messages: far larger than any other JSON read


def load_results(path: Path) -> dict:
    """A results file validated by tau2's own pydantic models (``Results``), as plain JSON."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network lookups from litellm
    from tau2.data_model.simulation import Results

    try:
        data = read_regular(Path(path), RESULTS_BYTES, Tau2Error)  # a FIFO or /dev/zero: refused, never read
    except OSError as exc:
        raise Tau2Error(f"{path}: cannot be read ({exc.strerror or exc}); give tau2's results JSON file") from None
    try:
        return json.loads(Results.model_validate_json(data).model_dump_json())
    except Exception as exc:  # pydantic's ValidationError, JSON errors
        raise Tau2Error(f"{path}: not a tau2 results file ({type(exc).__name__}: {str(exc)[:300]})") from None


def _events(path: Path):
    """The events ``evals run`` recorded in an events file (none when missing; a line cut by a kill is passed over)."""
    if Path(path).exists():
        for line in read_regular(Path(path), RESULTS_BYTES, Tau2Error).decode(errors="replace").splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def events_of(path: Path) -> dict[tuple[str, int | None], dict]:
    """The latest recorded failure per (task id, seed) from an events file (missing: none)."""
    return {(str(e["task_id"]), e.get("seed")): e for e in _events(path) if e.get("event") == "error"}


def retries_of(path: Path) -> dict[tuple[str, int | None], int]:
    """How often each (task id, seed) was run again after an infrastructure error (``retry`` events)."""
    out: dict = {}
    for event in _events(path):
        if event.get("event") == "retry":
            key = (str(event["task_id"]), event.get("seed"))
            out[key] = out.get(key, 0) + 1
    return out


def classify(sim: dict, errors: dict) -> tuple[bool, str | None]:
    """``(infra_error, reason)`` of one simulation (see the module docstring)."""
    termination = str(sim["termination_reason"])
    if sim.get("skipped"):
        event = errors.get((str(sim["task_id"]), sim.get("seed")))
        if event is None:
            return True, "the simulation raised; no reason was recorded"
        reason = f"{event['side']}: {event['error_type']}: {event['message'][:300]}"
        return not (event["side"] == "agent" and event["error_type"] in MODEL_OUTPUT_ERRORS), reason
    if termination in INFRA_TERMINATIONS:
        return True, "the user simulator broke the conversation protocol"
    return False, None


def infra_simulations(results: dict, events: Path) -> set[str]:
    errors = events_of(events)
    return {s["id"] for s in results["simulations"] if classify(s, errors)[0]}


def _settings(info: dict) -> dict:
    user, agent = info.get("user_info") or {}, info.get("agent_info") or {}
    # where a model is served and with what key is not what it is: addresses differ between arms
    strip = lambda args: {k: v for k, v in (args or {}).items()  # noqa: E731
                          if k not in ("num_retries", "api_key", "api_base", "base_url")}
    return {"user_llm": user.get("llm"), "user_llm_args": strip(user.get("llm_args")),
            "agent_llm_args": strip(agent.get("llm_args")),
            "num_trials": info.get("num_trials"), "max_steps": info.get("max_steps"),
            "max_errors": info.get("max_errors"), "seed": info.get("seed")}


def domain_rows(path: Path) -> tuple[str, list[dict], dict]:
    """One domain's results file: ``(domain, rows, summary)``."""
    results = load_results(path)
    info = results["info"]
    domain = info["environment_info"]["domain_name"]
    errors = events_of(Path(path).with_suffix(".events.jsonl"))
    retries = retries_of(Path(path).with_suffix(".events.jsonl"))
    tasks = {t["id"]: t for t in results["tasks"]}
    rows, reasons, terminations = [], {}, {}
    for sim in results["simulations"]:
        if sim["task_id"] not in tasks:
            raise Tau2Error(f"{path}: simulation {sim.get('id')} names task {sim['task_id']} not in the file's tasks")
        infra, reason = classify(sim, errors)
        termination = str(sim["termination_reason"])
        terminations[termination] = terminations.get(termination, 0) + 1
        if reason:  # counted by kind, side and exception type; the full reason is in the row
            head = f"{'infra' if infra else 'model'}: " + ": ".join(reason.split(": ")[:2])
            reasons[head] = reasons.get(head, 0) + 1
        rows.append({"benchmark": "tau2", "domain": domain, "item_id": f"{domain}/{sim['task_id']}",
                     "repeat": int(sim["trial"]), "seed": sim.get("seed"), "filter": "reward",
                     "score": float((sim.get("reward_info") or {}).get("reward") or 0.0),
                     "doc_hash": sha256_of(tasks[sim["task_id"]]),
                     "prompt_hash": sha256_of(info["environment_info"].get("policy")),
                     "termination_reason": termination, "infra_error": infra, "error": reason,
                     "retries": retries.get((str(sim["task_id"]), sim.get("seed")), 0)})
    per_task: dict[str, list[float]] = {}
    for r in rows:
        per_task.setdefault(r["item_id"], []).append(r["score"])
    infra_rows = [r for r in rows if r["infra_error"]]
    summary = {"file": str(path), "sha256": sha256_of(Path(path)),
               "tasks": len(per_task), "simulations": len(rows), "infra_errors": len(infra_rows),
               "retries": sum(r["retries"] for r in rows),
               "model_errors": sum(1 for r in rows if r["error"] and not r["infra_error"]),
               "terminations": dict(sorted(terminations.items())),
               "errors": dict(sorted(reasons.items())),
               "pass1": sum(sum(v) / len(v) for v in per_task.values()) / max(1, len(per_task)),
               **_settings(info)}
    return domain, rows, summary


def rows_from_results(files: list[Path]) -> tuple[list[dict], dict]:
    """Bundle rows of tau2 results files (one per domain) and the benchmark's run.json entry."""
    domains: dict[str, dict] = {}
    rows: list[dict] = []
    for path in files:
        domain, drows, summary = domain_rows(path)
        if domain in domains:
            raise Tau2Error(f"{path}: a second results file for domain {domain!r} (first: {domains[domain]['file']}); "
                            "mixing splits or runs of one domain would double-count tasks: pass one file per domain")
        domains[domain] = summary
        rows += drows
    seen: dict[str, list[str]] = {}
    for summary in domains.values():
        seen.setdefault(json.dumps({k: summary[k] for k in SETTINGS}, sort_keys=True), []).append(summary["file"])
    if len(seen) > 1:
        found = json.dumps([json.loads(k) | {"files": v} for k, v in seen.items()])
        raise Tau2Error("results files disagree on the user simulator / agent sampling / trials / limits / seed, so "
                        f"their domains are not comparable: {found}")
    keys = [(r["item_id"], r["repeat"]) for r in rows]
    if len(keys) != len(set(keys)):
        raise Tau2Error("duplicate (task, trial) simulations in the results files")
    first = next(iter(domains.values()))
    simulations = sum(d["simulations"] for d in domains.values())
    infra = sum(d["infra_errors"] for d in domains.values())
    retried = sum(d["retries"] for d in domains.values())
    summary = {"domains": domains, "primary_filter": "reward",
               "macro_pass1": sum(d["pass1"] for d in domains.values()) / len(domains),
               "simulations": simulations, "infra_errors": infra, "retries": retried,
               "infra_error_rate": infra / simulations if simulations else None,
               **{k: first[k] for k in SETTINGS}}
    return rows, summary


def import_tau2(files: list[Path], out: Path) -> dict:
    writer = BundleWriter(out)
    rows, summary = rows_from_results(files)
    run = {"model": None, "endpoint": None, "api": "tau2", "created_unix": int(time.time()),
           "benchmarks": {"tau2": summary}}
    return writer.finish(rows, run)
