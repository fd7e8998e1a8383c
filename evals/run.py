"""Drive lm-eval against an OpenAI-compatible endpoint or a local HF model, into a run bundle.

A run is cut into units (benchmark x repeat); each finished unit is saved under ``units/`` so a
dead server costs only the unit in flight and ``--resume`` completes the bundle. Protocols are the
seed's, as defaults: GSM8K first 200 test questions, 5-shot, greedy; GPQA-Diamond 198 questions,
temperature 1.0, two runs differing only in the request seed; tau2 (one ``tau2 run`` per domain
against the same endpoint, with a fixed user simulator) when asked for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import dataclass, replace
from importlib import metadata, resources
from pathlib import Path

from evals import budget
from evals.bundle import RUN_JSON, SAMPLES, write_samples
from evals.data import Dataset, dataset_for
from evals.tau2_run import Tau2Settings

PROTOCOLS = {
    # limit: items per run; seeds: one unit per seed; primary_filter: the lm-eval filter the gate
    # uses. flexible-extract scores the answer a model gives whatever its format, so a pair of
    # runs differs by what the model answers rather than by how it formats (strict-match rows are
    # kept beside it for the format-compliance view).
    "gsm8k": {"task": "quantgate_gsm8k", "limit": 200, "seeds": [0], "primary_filter": "flexible-extract"},
    "gpqa_diamond": {"task": "quantgate_gpqa_diamond", "limit": None, "seeds": [0, 1],
                     "primary_filter": "flexible-extract"},
}
log = logging.getLogger(__name__)


class RunError(RuntimeError):
    pass


@dataclass
class RunSpec:
    benchmarks: list[str]
    out: Path
    model: str
    data_dir: Path | None = None  # None: GSM8K shipped with quantgate (GPQA needs a folder from `evals data`)
    base_url: str | None = None
    tokenizer: str | None = None
    api: str = "completions"
    limit: int | None = None
    concurrency: int = 1
    max_gen_toks: int | None = None  # None: the largest budget that fits the model (evals.budget)
    seeds: list[int] | None = None
    keep_text: bool = False
    tau2: Tau2Settings | None = None  # with "tau2" in benchmarks: the user simulator, limits, concurrency

    def seeds_for(self, benchmark: str) -> list[int]:
        return self.seeds or PROTOCOLS[benchmark]["seeds"]

    def limit_for(self, benchmark: str) -> int | None:
        return self.limit if self.limit is not None else PROTOCOLS[benchmark]["limit"]


def _task_dir(spec: RunSpec, datasets: dict[str, Dataset]) -> Path:
    """The benchmark YAMLs with each benchmark's data folder filled in (lm-eval's include_path)."""
    tasks = spec.out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for benchmark, dataset in datasets.items():
        template = resources.files("evals.benchmarks").joinpath(f"{benchmark}.yaml").read_text()
        (tasks / f"{benchmark}.yaml").write_text(template.replace("{benchmark_dir}", str(dataset.folder.resolve())))
    return tasks


def fit_budget(spec: RunSpec, tasks: Path, benchmarks: list[str]) -> budget.Budget:
    """The generation budget for this run: ``--max-gen-toks`` if it fits, else the largest that does."""
    if spec.base_url:
        context = budget.server_context(spec.base_url, spec.model)
        count, unit = budget.prompt_counter(spec.tokenizer, chat=spec.api == "chat")
    else:
        context = budget.local_context(spec.model)
        count, unit = budget.prompt_counter(spec.model, chat=False)
    longest = max(count(prompt) for b in benchmarks
                  for prompt in budget.prompts(tasks, PROTOCOLS[b]["task"], spec.limit_for(b)))
    return budget.fit(spec.max_gen_toks, context, longest, unit)


def _model(spec: RunSpec, seed: int) -> tuple[str, dict]:
    if spec.base_url:
        # Text prompts (not token ids): every OpenAI-compatible server takes them, and the server's
        # own tokenizer is the one the served model was exported with.
        args = {"base_url": spec.base_url, "model": spec.model, "seed": seed, "num_concurrent": spec.concurrency,
                "max_retries": 5, "max_gen_toks": spec.max_gen_toks, "timeout": 600, "tokenized_requests": False,
                "tokenizer_backend": "huggingface" if spec.tokenizer else None}
        if spec.tokenizer:
            args["tokenizer"] = spec.tokenizer
        return ("local-chat-completions" if spec.api == "chat" else "local-completions"), args
    return "hf", {"pretrained": spec.model, "device": "cpu", "dtype": "float32"}


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def run_unit(spec: RunSpec, benchmark: str, repeat: int, seed: int, tasks: Path) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, model_args = _model(spec, seed)
    started = time.time()
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[PROTOCOLS[benchmark]["task"]],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        limit=spec.limit_for(benchmark), log_samples=True, apply_chat_template=spec.api == "chat" and bool(spec.base_url),
        gen_kwargs={"max_gen_toks": spec.max_gen_toks}, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=budget.FEWSHOT_SEED, batch_size=1)
    samples = results["samples"][PROTOCOLS[benchmark]["task"]]
    rows = []
    for s in samples:
        item_id = s["doc"].get("id", s["doc_id"])
        row = {"benchmark": benchmark, "item_id": str(item_id), "repeat": repeat, "seed": seed,
               "filter": s["filter"], "score": float(s["exact_match"]), "doc_hash": s["doc_hash"],
               "prompt_hash": s["prompt_hash"], "target_hash": s.get("target_hash")}
        if spec.keep_text or benchmark != "gpqa_diamond":  # GPQA text stays out of the bundle unless asked
            row["response"] = s["filtered_resps"][0] if s["filtered_resps"] else None
        rows.append(row)
    log.info("%s repeat %d: %d rows in %.1f s", benchmark, repeat, len(rows), time.time() - started)
    return rows


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("lm_eval", "transformers", "torch", "quantgate"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def _checkpoint_provenance(spec: RunSpec) -> dict:
    """Manifest hash when the model is a local quantgate checkpoint; chat template hash if any."""
    out: dict = {}
    path = Path(spec.tokenizer or spec.model)
    manifest = Path(spec.model) / "conversion_manifest.json"
    if manifest.exists():
        out["checkpoint_manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    config, jinja = path / "tokenizer_config.json", path / "chat_template.jinja"
    # transformers 5 saves the template as chat_template.jinja, and when that file exists it wins over
    # tokenizer_config.json's entry (tokenization_utils_base.py, PreTrainedTokenizerBase._from_pretrained)
    template = (jinja.read_text() if jinja.exists() else
                json.loads(config.read_text()).get("chat_template") if config.exists() else None)
    if template:
        out["chat_template_sha256"] = _hash(template if isinstance(template, str) else json.dumps(template))
    return out


def settings_of(spec: RunSpec, benchmark: str) -> dict:
    """What must be equal for two runs of a benchmark to be comparable (and for --resume)."""
    return {"benchmark": benchmark, "limit": spec.limit_for(benchmark), "seeds": spec.seeds_for(benchmark),
            "max_gen_toks": spec.max_gen_toks, "api": spec.api if spec.base_url else "hf",
            "primary_filter": PROTOCOLS[benchmark]["primary_filter"], "model": spec.model}


def _run_tau2(spec: RunSpec, units_dir: Path, resume: bool) -> tuple[list[dict], dict]:
    from evals.tau2 import Tau2Error, rows_from_results
    from evals.tau2_run import run_domains

    if spec.tau2 is None:
        raise RunError("tau2 needs a served model (--base-url) and a fixed user simulator (--tau2-user-llm), "
                       "the same for both arms of a comparison")
    try:
        files = run_domains(spec.tau2, units_dir / "tau2", resume)
    except Tau2Error as exc:
        raise RunError(f"{exc}\nfinished simulations are kept: rerun with --resume") from exc
    rows, summary = rows_from_results(files)
    return rows, {"benchmark": "tau2", "model": spec.model, **spec.tau2.recorded(), **summary}


def run(spec: RunSpec, resume: bool = False) -> dict:
    if (spec.out / RUN_JSON).exists() and not resume:
        raise RunError(f"{spec.out} already holds a finished run; choose a new --out")
    spec.out.mkdir(parents=True, exist_ok=True)
    lm_eval_benchmarks = [b for b in spec.benchmarks if b != "tau2"]
    datasets = {b: dataset_for(b, spec.data_dir) for b in lm_eval_benchmarks}
    units_dir = spec.out / "units"
    units_dir.mkdir(exist_ok=True)
    tasks = _task_dir(spec, datasets)
    generation = fit_budget(spec, tasks, lm_eval_benchmarks) if lm_eval_benchmarks else None
    if generation:
        spec = replace(spec, max_gen_toks=generation.max_gen_toks)
        log.info("max_gen_toks %d (%s)", generation.max_gen_toks, generation.how)
    started, timings = time.time(), {}
    rows: list[dict] = []
    for benchmark in lm_eval_benchmarks:
        settings = settings_of(spec, benchmark)
        for repeat, seed in enumerate(spec.seeds_for(benchmark)):
            unit = units_dir / f"{benchmark}-r{repeat}.jsonl"
            meta = unit.with_suffix(".json")
            if unit.exists() and meta.exists() and json.loads(meta.read_text()) == settings:
                rows += [json.loads(line) for line in unit.read_text().splitlines()]
                continue
            if unit.exists() and not resume:
                raise RunError(f"{unit} exists from another run; pass --resume or choose a new --out")
            t0 = time.time()
            try:
                unit_rows = run_unit(spec, benchmark, repeat, seed, tasks)
            except Exception as exc:  # dead server, bad model: the finished units stay for --resume
                raise RunError(f"{benchmark} repeat {repeat} failed ({type(exc).__name__}: {exc}); finished units "
                               f"are kept in {units_dir}: fix the cause and rerun with --resume") from exc
            write_samples(unit, unit_rows)
            meta.write_text(json.dumps(settings))
            timings[f"{benchmark}-r{repeat}"] = round(time.time() - t0, 2)
            rows += unit_rows
    benchmarks = {b: {**settings_of(spec, b), "dataset": datasets[b].entry} for b in lm_eval_benchmarks}
    if "tau2" in spec.benchmarks:
        t0 = time.time()
        tau2_rows, benchmarks["tau2"] = _run_tau2(spec, units_dir, resume)
        rows += tau2_rows
        timings["tau2"] = round(time.time() - t0, 2)
    write_samples(spec.out / SAMPLES, rows)
    run_json = {
        "model": spec.model, "endpoint": spec.base_url, "api": spec.api if spec.base_url else "hf-local",
        "tokenizer": spec.tokenizer, "benchmarks": benchmarks,
        "max_gen_toks": spec.max_gen_toks, "generation_budget": generation.to_dict() if generation else None,
        "concurrency": spec.concurrency, "versions": _versions(),
        "timings_s": {"total": round(time.time() - started, 2), **timings}, **_checkpoint_provenance(spec),
        "created_unix": int(started), "rows": len(rows), "keep_text": spec.keep_text,
    }
    (spec.out / RUN_JSON).write_text(json.dumps(run_json, indent=2))
    return run_json


__all__ = ["PROTOCOLS", "RunError", "RunSpec", "run"]
