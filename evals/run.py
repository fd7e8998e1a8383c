"""Drive lm-eval against an OpenAI-compatible endpoint or a local HF model, into a run bundle.

A run is cut into units (benchmark x repeat); each finished unit is saved under ``units/`` so a
dead server costs only the unit in flight and ``--resume`` completes the bundle. Protocols are the
Wafer write-up's, as defaults: GSM8K first 200 test questions, 5-shot, greedy; GPQA-Diamond 198 questions,
temperature 1.0, two runs differing only in the request seed; tau2 (one ``tau2 run`` per domain
against the same endpoint, with a fixed user simulator) when asked for.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from evals import budget, checkpoint_identity
from evals import tasks as run_tasks
from evals.bundle import BundleWriter
from evals.checkpoint_identity import KEY as IDENTITY_KEY
from evals.data import dataset_for
from evals.errors import BadInput, RunFailed
from evals.tau2_run import Tau2Settings
from quant.checkpoint import TOKENIZER_FIX, tokenizer_problem
from quant.hashing import sha256_of
from quant.outputs import MANIFEST_NAME, DestinationLock
from quant.safe_files import read_json

PROTOCOLS = {
    # limit: items per run; seeds: one unit per seed; primary_filter: the lm-eval filter the gate
    # uses. flexible-extract scores the answer a model gives whatever its format, so a pair of
    # runs differs by what the model answers rather than by how it formats (strict-match rows are
    # kept beside it for the format-compliance view).
    "gsm8k": {"task": "quantgate_gsm8k", "limit": 200, "seeds": [0], "primary_filter": "flexible-extract"},
    "gpqa_diamond": {"task": "quantgate_gpqa_diamond", "limit": None, "seeds": [0, 1],
                     "primary_filter": "flexible-extract"},
    # the built-in example model's benchmark (evals/benchmarks/arith_make.py): all 250 test items, 0-shot
    "arith": {"task": "quantgate_arith", "limit": None, "seeds": [0], "primary_filter": "flexible-extract"},
}
# Local checkpoints generate greedily, KV-cached, this many prompts at a time (lm-eval's HFLM pads
# them on the left with an attention mask; generate derives position ids from it): on the built-in
# example, batches of 32 cost ~5 CPU ms per item-token against ~25 one at a time, and larger ones
# gain nothing (tests/benchmarks/bench_local_eval.py).
LOCAL_BATCH_SIZE = 32
# One torch thread on CPU: a small model is bound by Python and launch overhead, and on a shared
# machine two threads spinning in OpenMP barriers measured 12x slower per token than one.
LOCAL_CPU_THREADS = 1
DEFAULT_REQUEST_TIMEOUT_S = 600  # per request; a 16384-token answer from a slow server takes minutes
log = logging.getLogger(__name__)


class RunError(RunFailed):
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
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    seeds: list[int] | None = None
    keep_text: bool = False
    tau2: Tau2Settings | None = None  # with "tau2" in benchmarks: the user simulator, limits, concurrency
    device: str | None = None  # local model: cuda when present, else cpu
    dtype: str | None = None  # local model: None is bfloat16, what the engines compute in (float32 on request)
    activations: str | None = None  # local model: "bf16" where its config names no activation scheme (gpt-oss MXFP4)
    batch_size: int = LOCAL_BATCH_SIZE  # local model: prompts generated together (results do not depend on it)
    threads: int | None = None  # local model on cpu: torch threads (None: LOCAL_CPU_THREADS)
    plan: dict | None = None  # `gate plan`'s: each planned benchmark's items and seeds (recorded in run.json)
    repeats_now: dict[str, int] | None = None  # a sequential look: only a benchmark's first N repeats run yet
    checkpoint: Path | None = None  # with base_url: the quantgate checkpoint folder the server serves (hashed)

    def __post_init__(self) -> None:
        """Degenerate numbers are bad input here too, for the Python API (the CLI checks its flags first)."""
        for name in ("limit", "max_gen_toks", "concurrency", "batch_size", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BadInput(f"{name}={value!r}: give a whole number of at least 1")
        timeout = self.request_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise BadInput(f"request_timeout={timeout!r}: must be a positive finite number of seconds (0 does not "
                           "mean no limit)")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise BadInput(f"seeds={self.seeds!r}: a seed is repeated; each repeat needs its own seed")

    def _planned(self, benchmark: str) -> dict | None:
        return (self.plan or {}).get("benchmarks", {}).get(benchmark)

    def seeds_for(self, benchmark: str) -> list[int]:
        planned = self._planned(benchmark)
        return planned["seeds"] if planned else self.seeds or PROTOCOLS[benchmark]["seeds"]

    def limit_for(self, benchmark: str) -> int | None:
        planned = self._planned(benchmark)
        return planned["items"] if planned else self.limit if self.limit is not None else PROTOCOLS[benchmark]["limit"]

    def local_device(self) -> tuple[str, str]:
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return device, self.dtype or "bfloat16"

    def local_record(self, emulation: dict | None) -> dict:
        """What run.json says about how a local checkpoint computed (``local``)."""
        device, dtype = self.local_device()
        return {"device": device, "dtype": dtype,
                "dtype_from": "--dtype" if self.dtype else "default: bfloat16, as sglang and vLLM compute",
                "batch_size": self.batch_size, "threads": (self.threads or LOCAL_CPU_THREADS) if device == "cpu" else None,
                "emulation": emulation}


def fit_budget(spec: RunSpec, tasks: dict[str, run_tasks.RunTask]) -> budget.Budget:
    """The generation budget for this run: ``--max-gen-toks`` if it fits, else the largest that does."""
    if spec.base_url:
        context = budget.server_context(spec.base_url, spec.model)
        count, unit = budget.prompt_counter(spec.tokenizer, chat=spec.api == "chat")
    else:
        from evals.emulation import refuse_unbuildable

        refuse_unbuildable(Path(spec.model))  # before transformers reads a config it may not know (one line, exit 2)
        context = budget.local_context(spec.model)
        count, unit = budget.prompt_counter(spec.model, chat=False)
    longest = max(count(prompt) for b, task in tasks.items()
                  for prompt in budget.prompts(run_tasks.load(task), spec.limit_for(b)))
    return budget.fit(spec.max_gen_toks, context, longest, unit)


def _model(spec: RunSpec, seed: int) -> tuple[str, dict]:
    if spec.base_url:
        # Text prompts (not token ids): every OpenAI-compatible server takes them, and the server's
        # own tokenizer is the one the served model was exported with.
        args = {"base_url": spec.base_url, "model": spec.model, "seed": seed, "num_concurrent": spec.concurrency,
                "max_gen_toks": spec.max_gen_toks, "timeout": spec.request_timeout, "tokenized_requests": False,
                "tokenizer_backend": "huggingface" if spec.tokenizer else None}
        if spec.tokenizer:
            args["tokenizer"] = spec.tokenizer
        # evals.endpoint: lm-eval's clients, retrying only what may succeed (not a 400, say)
        return ("quantgate-local-chat-completions" if spec.api == "chat" else "quantgate-local-completions"), args
    return "hf", {"pretrained": _local_model(spec)[0], "tokenizer": spec.tokenizer or spec.model}


_LOADED: dict[tuple, tuple] = {}


def _local_model(spec: RunSpec):
    """``(model, emulation record or None)``, loaded once per run: a quantized checkpoint's weights
    decoded and its activations quantize-dequantized as served (``evals.emulation``)."""
    import torch

    from evals.emulation import load_model

    device, dtype = spec.local_device()
    key = (str(Path(spec.model).resolve()), device, dtype, spec.activations)
    if device == "cpu":
        torch.set_num_threads(spec.threads or LOCAL_CPU_THREADS)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_model(Path(spec.model), device, getattr(torch, dtype), spec.activations)
    return _LOADED[key]


def _eos(spec: RunSpec) -> str | None:
    """The end-of-sequence string lm-eval adds to the stop list: the model's own for a local model
    (``HFLM.generate_until``), the tokenizer's for a server when ``--tokenizer`` is given."""
    path = spec.tokenizer if spec.base_url else spec.model
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).eos_token


def stop_sequences(spec: RunSpec, benchmark: str, eos: str | None) -> list[str]:
    """The stop list every request of this benchmark carries, the same whatever ``--concurrency``:
    lm-eval 0.4.13 appends the EOS string only on its one-at-a-time path (``TemplateAPI.model_call``
    passes ``eos``, ``amodel_call`` does not), so it is put in the list here, before either path sees it.
    The chat endpoint sends at most four (``LocalChatCompletion._create_payload``: ``stop[:4]``)."""
    until = list(run_tasks.template(benchmark)["generation_kwargs"].get("until") or [])
    if eos and eos not in until:
        until.append(eos)
    return until[:4] if spec.base_url and spec.api == "chat" else until


def run_unit(spec: RunSpec, benchmark: str, repeat: int, seed: int, task: run_tasks.RunTask,
             stop: list[str]) -> list[dict]:
    import lm_eval

    import evals.endpoint  # noqa: F401  (registers the quantgate-local-* models with lm-eval)

    model, model_args = _model(spec, seed)
    started = time.time()
    results = lm_eval.simple_evaluate(  # the task as data: no folder is indexed, no file read back (evals.tasks)
        model=model, model_args=model_args, tasks=[task.fresh_config()], task_manager=run_tasks.task_manager(),
        limit=spec.limit_for(benchmark), log_samples=True, apply_chat_template=spec.api == "chat" and bool(spec.base_url),
        gen_kwargs={"max_gen_toks": spec.max_gen_toks, "until": stop}, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=budget.FEWSHOT_SEED,
        batch_size=1 if spec.base_url else spec.batch_size)  # a server batches by itself (--concurrency)
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


def served_checkpoint_sha256(folder: Path, verify: bool = True) -> str:
    """``--checkpoint``'s identity: the folder a server serves must be a checkpoint quantgate wrote
    (``verify=False``: its shards' names and sizes only, the early check before the run hashes them)."""
    ident = checkpoint_identity.identity(folder, verify)
    if ident is None:
        raise BadInput(f"--checkpoint {folder}: no {MANIFEST_NAME}, so not a checkpoint `quantize` wrote; "
                       "give the folder it wrote (the one served), or leave --checkpoint out")
    return ident.sha256


def checkpoint_provenance(spec: RunSpec) -> dict:
    """The identity of the quantgate checkpoint measured (local, or served with --checkpoint), its
    shards hashed against its manifest now, so a run (or a --resume) never measures a checkpoint whose
    shards changed under the same manifest; the chat template's hash if any."""
    out: dict = {}
    path = Path(spec.tokenizer or spec.model)
    if spec.base_url and spec.checkpoint:
        out["checkpoint"] = str(spec.checkpoint)
        out[IDENTITY_KEY] = served_checkpoint_sha256(spec.checkpoint)
    elif not spec.base_url and (ident := checkpoint_identity.identity(Path(spec.model))):
        out[IDENTITY_KEY] = ident.sha256
    config, jinja = path / "tokenizer_config.json", path / "chat_template.jinja"
    # transformers 5 saves the template as chat_template.jinja, and when that file exists it wins over
    # tokenizer_config.json's entry (tokenization_utils_base.py, PreTrainedTokenizerBase._from_pretrained)
    template = (jinja.read_text() if jinja.exists() else
                json.loads(config.read_text()).get("chat_template") if config.exists() else None)
    if template:
        out["chat_template_sha256"] = sha256_of(template)
    return out


def settings_of(spec: RunSpec, benchmark: str, eos: str | None, task_sha256: str) -> dict:
    """Everything that defines the measurement of ``benchmark`` (not the model measured): the gate
    refuses to pair two runs whose settings differ, and ``--resume`` redoes units recorded under others.
    ``task_sha256``: the task lm-eval ran, its data files named by file name (``evals.tasks``)."""
    task = run_tasks.template(benchmark)
    gen = task["generation_kwargs"]
    shots = task.get("num_fewshot", 0)
    served = bool(spec.base_url)
    return {
        "task": task["task"], "task_version": task.get("metadata", {}).get("version"),
        "api": spec.api if served else "hf", "apply_chat_template": served and spec.api == "chat",
        "limit": spec.limit_for(benchmark), "seeds": spec.seeds_for(benchmark), "primary_filter":
        PROTOCOLS[benchmark]["primary_filter"], "max_gen_toks": spec.max_gen_toks,
        "do_sample": gen.get("do_sample", False), "temperature": gen.get("temperature", 0.0),
        "stop": stop_sequences(spec, benchmark, eos), "num_fewshot": shots,
        "fewshot": {"split": task.get("fewshot_split"), "seed": budget.FEWSHOT_SEED,
                    "sampler": f"lm-eval 0.4.13 default ContextSampler: one Random({budget.FEWSHOT_SEED}) stream, "
                               f"rnd.sample(train, {shots}) drawn for each item in document order"} if shots else None,
        "request_timeout_s": spec.request_timeout if served else None,
        "local_dtype": None if served else spec.local_device()[1],
        "task_sha256": task_sha256,
    }


def tau2_measurement(settings: Tau2Settings) -> dict:
    """What defines a tau2 measurement: its recorded settings less the model measured, the servers'
    addresses and the throughput knobs (concurrency, retries), which differ between arms by design."""
    addresses = ("api_base", "api_key", "base_url", "num_retries")
    out = {k: v for k, v in settings.recorded().items() if k not in ("model", "api_base", "concurrency", "max_retries")}
    return {**out, "user_llm_args": {k: v for k, v in out["user_llm_args"].items() if k not in addresses}}


def _run_tau2(spec: RunSpec, units_dir: Path, resume: bool) -> tuple[list[dict], dict]:
    from evals.tau2 import Tau2Error, rows_from_results
    from evals.tau2_run import run_domains

    if spec.tau2 is None:
        raise RunError("tau2 needs a served model (--base-url) and a fixed user simulator (--tau2-user-llm), "
                       "the same for both arms of a comparison")
    # A look of a planned run (--until-decided) runs the first trials of the plan's: tau2 draws trial
    # seeds as a prefix (tau2_run.trial_seeds), so each next look only adds trials to the same measurement.
    trials = min(spec.tau2.trials, (spec.repeats_now or {}).get("tau2", spec.tau2.trials))
    try:
        files = run_domains(replace(spec.tau2, trials=trials), units_dir / "tau2", resume, more_trials=bool(spec.plan))
    except Tau2Error as exc:
        raise RunError(f"{exc}\nfinished simulations are kept: rerun with --resume") from exc
    rows, summary = rows_from_results(files)
    # Like an lm-eval benchmark's seeds, the trials recorded are the plan's (what the arms are compared on);
    # those run so far are the rows, and trials_run.
    return rows, {"benchmark": "tau2", "model": spec.model, **spec.tau2.recorded(), **summary,
                  "num_trials": spec.tau2.trials, "trials_run": trials, "settings": tau2_measurement(spec.tau2)}


def scores_of(rows: list[dict], benchmarks: dict[str, dict]) -> dict:
    """Per benchmark, on its primary filter: the mean score over items x repeats, with a 95% Wilson
    interval over items (a repeat of an item is not an independent item), and the shape of its rows."""
    import numpy as np

    from evals.judge.stats import wilson_interval

    out = {}
    for bench, entry in benchmarks.items():
        mine = [r for r in rows if r["benchmark"] == bench]
        filters = sorted({r["filter"] for r in mine})
        primary = entry.get("primary_filter") or (filters[0] if filters else None)
        by_item: dict[str, list[float]] = {}
        for r in mine:
            if r["filter"] == primary:
                by_item.setdefault(str(r["item_id"]), []).append(float(r["score"]))
        if not by_item:
            continue
        score, low, high = wilson_interval(np.array([np.mean(v) for v in by_item.values()]))
        out[bench] = {"filter": primary, "score": score, "ci_low": low, "ci_high": high, "items": len(by_item),
                      "repeats": len({r["repeat"] for r in mine}), "filters": len(filters), "rows": len(mine)}
    return out


def quiet_libraries() -> None:
    """Silence what lm-eval, transformers and datasets print that a user cannot act on: lm-eval's
    notes on how it was called, datasets' progress bars over the local JSONL, transformers' load
    report listing the MTP layer's tensors (its model has no MTP layer; the engines use it only for
    speculative decoding), and the `git describe` lm-eval 0.4.13 runs in the user's folder
    (``lm_eval.evaluator.simple_evaluate`` -> ``get_git_commit_hash``: "fatal: not a git repository").
    run.json records versions itself."""
    import lm_eval.evaluator

    for name in ("lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.api.task"):
        logging.getLogger(name).setLevel(logging.ERROR)
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    except ImportError:  # neither is needed against a server
        pass


def refuse_remote_code(folder: Path) -> None:
    """A local checkpoint whose config or tokenizer config names its own Python code (``auto_map``):
    transformers would ask whether to run it (and fail reading an answer from a closed stdin);
    quantgate never runs a checkpoint's code, so this is refused before anything loads it."""
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.is_file() and isinstance(config := read_json(path, BadInput, "fix the checkpoint"), dict) \
                and "auto_map" in config:
            raise BadInput(f"{path}: auto_map names Python code shipped with the checkpoint; quantgate never runs a "
                           "checkpoint's own code: use a model transformers supports natively, or serve it and pass "
                           "--base-url")


def require_tokenizer(folder: Path) -> None:
    """A local checkpoint is evaluated with its own tokenizer (every prompt, the generation budget, the
    stop string): a folder without one (a model's ``save_pretrained`` writes none) is refused before
    anything is written, instead of prompts counted as 0 tokens and lm-eval failing mid-run."""
    if why := tokenizer_problem(folder):
        raise BadInput(f"{folder}: {why}, so no prompt can be tokenized; {TOKENIZER_FIX}; nothing was written")


@contextmanager
def _one_writer(out: Path):
    """``out`` held by this run alone (the converter's lock, ``quant.outputs.DestinationLock``): a
    second ``evals run`` into it is refused naming the lock. A folder created here and left empty
    by a refusal is removed again, so a mistake leaves nothing behind."""
    out = Path(out)
    created = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError, PermissionError) as exc:
        raise BadInput(f"--out {out}: cannot be created ({exc.strerror}); choose a folder you can write") from None
    try:
        with DestinationLock(out, writer="evals run", error=BadInput):
            yield
    except BadInput:
        if created:
            try:
                out.rmdir()  # only if empty: nothing of this run (or anyone's) is ever removed
            except OSError:
                pass
        raise


def run(spec: RunSpec, resume: bool = False) -> dict:
    """Run every unit not already finished under the same identity, then write the bundle."""
    quiet_libraries()
    for local in ([] if spec.base_url else [spec.model]) + ([spec.tokenizer] if spec.tokenizer else []):
        refuse_remote_code(Path(local))
    if not spec.base_url:
        require_tokenizer(Path(spec.model))
    BundleWriter(spec.out, resume)  # a folder it would refuse is refused before anything loads
    provenance = checkpoint_provenance(spec)  # the shards measured are the manifest's, before they load
    lm_eval_benchmarks = [b for b in spec.benchmarks if b != "tau2"]
    datasets = {b: dataset_for(b, spec.data_dir) for b in lm_eval_benchmarks}
    with ExitStack() as open_data:
        tasks = {b: run_tasks.open_task(b, datasets[b], open_data) for b in lm_eval_benchmarks}
        generation = fit_budget(spec, tasks) if lm_eval_benchmarks else None
        if generation:
            spec = replace(spec, max_gen_toks=generation.max_gen_toks)
            log.info("max_gen_toks %d (%s)", generation.max_gen_toks, generation.how)
        eos = _eos(spec) if lm_eval_benchmarks else None
        local = None
        if not spec.base_url and lm_eval_benchmarks:  # load (or refuse) a local checkpoint before any unit runs
            local = spec.local_record(_local_model(spec)[1])
        with _one_writer(spec.out):
            return _run_units(spec, resume, datasets, tasks, generation, eos, local, provenance)


def _run_units(spec: RunSpec, resume: bool, datasets: dict, tasks: dict, generation, eos, local,
               provenance: dict) -> dict:
    started, timings = time.time(), {}
    benchmarks: dict[str, dict] = {}
    units: dict[str, tuple] = {}  # name: (benchmark, repeat, seed, identity)
    for benchmark, task in tasks.items():
        settings = settings_of(spec, benchmark, eos, task.measurement_sha256)
        benchmarks[benchmark] = {"settings": settings, "primary_filter": settings["primary_filter"],
                                 "dataset": datasets[benchmark].entry}
        seeds = spec.seeds_for(benchmark)  # all of them are the settings; a look runs the first few
        for repeat, seed in enumerate(seeds[:(spec.repeats_now or {}).get(benchmark, len(seeds))]):
            # A unit is reused only if measured the same way, of the same model, on the same data.
            identity = {"settings": settings, "seed": seed, "model": spec.model,
                        "dataset_sha256": datasets[benchmark].entry["files"]}
            if IDENTITY_KEY in provenance:  # the checkpoint measured (its shards), not only its name
                identity[IDENTITY_KEY] = provenance[IDENTITY_KEY]
            units[f"{benchmark}-r{repeat}"] = (benchmark, repeat, seed, identity)
    writer = BundleWriter(spec.out, resume)  # checked again, now that this run holds the folder
    writer.begin({name: unit[3] for name, unit in units.items()}, spec.model, list(spec.benchmarks),
                 tau2_measurement(spec.tau2) if spec.tau2 and "tau2" in spec.benchmarks else None)
    for benchmark, recorded in run_tasks.write_folder(spec.out, list(tasks.values()), resume, PROTOCOLS).items():
        benchmarks[benchmark]["task_yaml"] = recorded  # the file lm-eval got, as written, and its sha256
    rows: list[dict] = []
    for name, (benchmark, repeat, seed, identity) in units.items():
        t0 = time.time()

        def produce(benchmark=benchmark, repeat=repeat, seed=seed, settings=benchmarks[benchmark]["settings"]):
            try:
                return run_unit(spec, benchmark, repeat, seed, tasks[benchmark], settings["stop"])
            except Exception as exc:  # dead server, bad model: the finished units stay for --resume
                raise RunError(f"{benchmark} repeat {repeat} failed ({type(exc).__name__}: {exc}); finished "
                               f"units are kept in {writer.units}: fix the cause and rerun with --resume") from exc

        unit_rows, reused = writer.unit(name, identity, produce)
        if not reused:
            timings[name] = round(time.time() - t0, 2)
        rows += unit_rows
    if "tau2" in spec.benchmarks:
        t0 = time.time()
        tau2_rows, benchmarks["tau2"] = _run_tau2(spec, writer.units, resume)
        rows += tau2_rows
        timings["tau2"] = round(time.time() - t0, 2)
    run_json = {
        "model": spec.model, "endpoint": spec.base_url, "api": spec.api if spec.base_url else "hf-local",
        "tokenizer": spec.tokenizer, "benchmarks": benchmarks, "eos": eos,
        "max_gen_toks": spec.max_gen_toks, "generation_budget": generation.to_dict() if generation else None,
        "concurrency": spec.concurrency, "versions": _versions(),
        "timings_s": {"total": round(time.time() - started, 2), **timings}, **provenance,
        "created_unix": int(started), "keep_text": spec.keep_text,
        "local": local,  # device, dtype, batching and, for a quantized checkpoint, what was emulated (evals.emulation)
        **({"plan": spec.plan} if spec.plan else {}),  # the gate judges the run at the plan's looks
        "scores": scores_of(rows, benchmarks),
    }
    return writer.finish(rows, run_json)


__all__ = ["PROTOCOLS", "RunError", "RunSpec", "run"]
