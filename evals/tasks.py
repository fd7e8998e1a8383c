"""The lm-eval task of each benchmark for one run: built as data, written where this run alone
writes, handed to lm-eval as the very config written.

- Built as data, never as text with paths pasted in: the shipped template
  (``evals/benchmarks/<benchmark>.yaml``) is parsed, its data files are set as values, and the
  file is emitted with ``yaml.safe_dump``; any quote, backslash, newline or non-ASCII character in
  a path stays itself.
- The data files are named by descriptor (``/proc/self/fd/N``), not by the user's path:
  datasets 5.2.0 reads each ``data_files`` entry as an fsspec pattern (``datasets/data_files.py``,
  ``resolve_pattern``: ``*?[`` glob, ``::`` chained hops, ``proto://`` a protocol), so a folder
  named ``a[1]`` or ``x::y`` would be another file or none. The descriptor is opened here (a
  regular file, never a FIFO) and checked against the dataset's recorded sha256, so lm-eval reads
  the very file that was hashed; datasets' cache keys it by the file's resolved path and mtime
  (``_get_single_origin_metadata``), as it would the path.
- Written into ``OUT/tasks``, a folder this run creates itself (``write_folder``): a fresh run
  refuses a ``tasks`` folder it finds, ``--resume`` removes the files an earlier run wrote there
  (unread) and refuses anything else. Nothing in it is ever read back: lm-eval gets the config
  parsed from the text written, through a ``TaskManager`` that indexes no folder, so a YAML, an
  ``include`` or a ``!function`` hook planted there never runs.
- Each task's sha256 is recorded twice in run.json: ``task_yaml`` (the file as written, data
  descriptors and all) and, in the benchmark's settings that the gate compares, ``task_sha256``:
  the same config with each data file named by its file name alone (the files' contents are the
  dataset's sha256s, compared on their own), so two runs of one task compare equal wherever their
  data lives, and a rescored task (another metric, filter or regex) is not comparable.
"""

from __future__ import annotations

import copy
import errno
import os
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from evals.data import DataError, Dataset
from evals.errors import BadInput
from quant.hashing import sha256_of
from quant.outputs import write_atomic
from quant.safe_files import open_regular_fd

TASKS = "tasks"  # OUT/tasks
HEADER = ("# written by `evals run` for this run and handed to lm-eval as parsed from this text; the data files are\n"
          "# the process's descriptors of the files whose sha256s run.json records under the benchmark's dataset\n")


def template(benchmark: str) -> dict:
    """The benchmark's lm-eval task as shipped (``evals/benchmarks/<benchmark>.yaml``)."""
    return yaml.safe_load(resources.files("evals.benchmarks").joinpath(f"{benchmark}.yaml").read_text())


def emit(config: dict) -> str:
    """``config`` as YAML text that parses back to ``config`` itself (checked: a path is data, never syntax)."""
    text = HEADER + yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=1 << 30)
    if yaml.safe_load(text) != config:
        raise AssertionError("yaml.safe_dump did not round-trip a task config")
    return text


def _with_data(config: dict, data_files: dict[str, str]) -> dict:
    config = copy.deepcopy(config)
    config["dataset_kwargs"] = {**config.get("dataset_kwargs", {}), "data_files": data_files}
    return config


@dataclass(frozen=True)
class RunTask:
    benchmark: str
    config: dict  # what lm-eval gets: parsed back from ``text``
    text: str  # OUT/tasks/<benchmark>.yaml
    sha256: str  # of ``text``
    measurement_sha256: str  # of the config with each data file named by its file name (compared by the gate)

    @property
    def name(self) -> str:
        return self.config["task"]

    def fresh_config(self) -> dict:
        """A copy for lm-eval to build from (it merges overrides into the dict it is given)."""
        return copy.deepcopy(self.config)


def open_task(benchmark: str, dataset: Dataset, stack: ExitStack) -> RunTask:
    """The run's task for ``benchmark``: its data files opened (closed with ``stack``) and checked
    against the sha256s recorded for the run."""
    shipped = template(benchmark)
    splits = list(shipped["dataset_kwargs"]["data_files"])
    by_fd, by_name = {}, {}
    for split in splits:
        name = f"{split}.jsonl"
        path = dataset.folder / name
        try:
            fd = open_regular_fd(path, DataError)
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-import the data with `evals data`") from None
        stack.callback(os.close, fd)
        by_fd[split], by_name[split] = f"/proc/self/fd/{fd}", name
        if sha256_of(Path(by_fd[split])) != dataset.entry["files"].get(name):
            raise DataError(f"{path}: changed while the run was reading it (sha256 differs from the one just checked); "
                            "make sure nothing writes the data folder, and rerun")
    text = emit(_with_data(shipped, by_fd))
    return RunTask(benchmark, yaml.safe_load(text), text, sha256_of(text),
                   sha256_of(emit(_with_data(shipped, by_name))))


def task_manager():
    """lm-eval's task manager with nothing indexed: tasks are given to it as configs, never found in a folder."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False)


def load(task: RunTask):
    """lm-eval's Task for ``task`` (to build its prompts)."""
    return task_manager().load([task.fresh_config()])["tasks"][task.name]


def _ours(benchmarks) -> set[str]:
    return {f"{b}.yaml{partial}" for b in benchmarks for partial in ("", ".partial")}


def write_folder(out: Path, tasks: list[RunTask], resume: bool, known_benchmarks) -> dict[str, dict]:
    """``OUT/tasks``, created now for this run, holding each task's YAML; run.json's ``task_yaml`` per benchmark.

    A fresh run refuses a ``tasks`` entry it finds (it did not write it). ``--resume`` removes what
    an earlier run wrote there (``<benchmark>.yaml``, a stale ``.partial``; unlinked, never read or
    followed) and refuses a folder holding anything else."""
    folder = Path(out) / TASKS
    if os.path.lexists(folder):
        if not resume or folder.is_symlink() or not folder.is_dir():
            raise BadInput(f"{folder}: already there, and `evals run` writes its task files only into a folder it "
                           "creates for the run: remove it (or choose a new --out)"
                           + ("" if resume else "; an interrupted run's folder: pass --resume"))
        foreign = sorted(entry.name for entry in os.scandir(folder) if entry.name not in _ours(known_benchmarks))
        if foreign:
            raise BadInput(f"{folder}: holds {foreign[0]!r}, which `evals run` never writes: remove it (or choose a "
                           "new --out); nothing there is read")
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                raise BadInput(f"{folder / entry.name}: a folder where `evals run` writes a file: remove it")
            os.unlink(folder / entry.name)
        os.rmdir(folder)
    try:
        os.mkdir(folder)
    except FileExistsError:
        raise BadInput(f"{folder}: created by someone else while `evals run` was starting; make sure nothing else "
                       "writes into --out, and rerun") from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.EACCES, errno.EROFS):
            raise BadInput(f"{folder}: cannot be created ({exc.strerror}); choose a --out you can write") from None
        raise
    recorded = {}
    for task in tasks:
        write_atomic(folder / f"{task.benchmark}.yaml", task.text)
        recorded[task.benchmark] = {"file": f"{TASKS}/{task.benchmark}.yaml", "sha256": task.sha256}
    return recorded
