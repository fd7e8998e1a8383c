"""Benchmark data, offline-first, every file's sha256 recorded in each run bundle.

Where a benchmark's files come from (``dataset_for``):
- GSM8K ships with quantgate (``evals/benchmarks/data``, MIT licence, sha256s in its manifest.json):
  ``evals run --benchmarks gsm8k`` needs no ``--data-dir``.
- arith (the built-in example model's benchmark, ``evals/benchmarks/arith_make.py``) ships the same
  way and is always read from there, whatever ``--data-dir`` says.
- A folder prepared by ``evals data`` (``<data-dir>/manifest.json`` records every file's sha256,
  checked before a run).
- GSM8K's own layout, ``<data-dir>/gsm8k/{train,test}.jsonl`` (or those two files directly in
  ``<data-dir>``): validated and hashed at run time.
- GPQA-Diamond only through ``evals data``, with the choice order frozen at import: lm-eval's own
  GPQA task shuffles the choices at load time with the global ``random`` inside ``datasets.map``,
  and the datasets cache replays a stale order (a warm cache ignores ``--seed``), so two arms of a
  comparison could see different orders. GPQA is gated and never bundled: the user supplies it.
"""

from __future__ import annotations

import csv
import json
import logging
import io
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from evals.errors import BadInput
from quant.hashing import sha256_of
from quant.outputs import copy_atomic, write_atomic
from quant.safe_files import make_folder, parse_json, read_json, read_regular, refuse_link

MANIFEST = "manifest.json"
GPQA_FREEZE_SEED = 0
BUNDLED_DATA_DIR = Path(str(resources.files("evals.benchmarks").joinpath("data")))
GSM8K_FILES = ("train.jsonl", "test.jsonl")
SHIPPED = ("gsm8k", "arith")  # in BUNDLED_DATA_DIR; arith is evals/benchmarks/arith_make.py's output
GSM8K_ANSWER = re.compile(r"####\s*-?[0-9][0-9.,]*\s*$")  # the official answer ends "#### N"
DATA_BYTES = 256 << 20  # GSM8K's files are 4 MB, GPQA-Diamond's CSV 2 MB
log = logging.getLogger(__name__)


class DataError(BadInput):
    pass


def _update_manifest(data_dir: Path, benchmark: str, files: dict[str, Path], source: str) -> dict:
    manifest_path = data_dir / MANIFEST
    refuse_link(manifest_path)  # it is rewritten below: refused before anything is read through it
    manifest = _read_manifest(manifest_path) if manifest_path.exists() else {}
    manifest[benchmark] = {"source": source, "files": {name: sha256_of(p) for name, p in files.items()}}
    write_atomic(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest[benchmark]


def _sha256(path: Path) -> str:
    """A data file's sha256, read as a regular file (a FIFO or device is refused, not waited on)."""
    return sha256_of(read_regular(path, DATA_BYTES, DataError))


def _read_text(path: Path) -> str:
    """A data file's text: a regular file (a FIFO or device is refused, not waited on), UTF-8."""
    try:
        return read_regular(path, DATA_BYTES, DataError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); give the official file") \
            from None


def check_gsm8k_file(path: Path) -> None:
    """Every line a JSON object with a ``question`` and an ``answer`` ending ``#### N``; else name the line."""
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        row = parse_json(line, f"{path}:{n}", DataError, "GSM8K files hold one JSON object per line")
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and GSM8K_ANSWER.search(str(row.get("answer", "")))):
            raise DataError(f"{path}:{n}: not GSM8K format: needs a 'question' and an 'answer' ending '#### N'")


def import_gsm8k(source_dir: Path, data_dir: Path) -> dict:
    """Copy GSM8K's official ``train.jsonl`` / ``test.jsonl`` (question, answer ending ``#### N``)."""
    out = make_folder(data_dir / "gsm8k")
    files = {}
    for name in GSM8K_FILES:
        src = Path(source_dir) / name
        if not src.exists():
            raise DataError(f"{src}: missing; point --gsm8k at the folder holding GSM8K's train.jsonl and test.jsonl")
        check_gsm8k_file(src)
        copy_atomic(src, out / name)
        files[name] = out / name
    return _update_manifest(data_dir, "gsm8k", files, str(source_dir))


HUB_SOURCES = {"gsm8k": ("openai/gsm8k", "main"), "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond")}


def fetch_from_hub(benchmark: str, staging: Path) -> Path:
    """Download a benchmark with ``datasets`` into ``staging`` in its official file layout.

    GSM8K is public; GPQA is gated (accept its terms on the hub and log in first). Nothing here
    is used unless asked for with ``hub``: the offline path is the default.
    """
    repo, name = HUB_SOURCES[benchmark]
    try:
        import datasets

        data = datasets.load_dataset(repo, name)
    except Exception as exc:  # offline, gated, no credentials
        raise DataError(f"could not fetch {repo} ({name}) from the hub: {type(exc).__name__}: {str(exc)[:300]}; "
                        "download the official files yourself and pass their path instead") from None
    staging.mkdir(parents=True, exist_ok=True)
    if benchmark == "gsm8k":
        for split in ("train", "test"):
            data[split].to_json(str(staging / f"{split}.jsonl"), lines=True, force_ascii=False)
        return staging
    data["train"].to_csv(str(staging / "gpqa_diamond.csv"), index=False)
    return staging / "gpqa_diamond.csv"


def _read_gpqa_rows(path: Path) -> list[dict]:
    text = _read_text(path)
    if path.suffix == ".csv":
        try:
            return list(csv.DictReader(io.StringIO(text, newline="")))
        except csv.Error as exc:  # e.g. a field over csv's 128 kB limit
            raise DataError(f"{path}: not a CSV quantgate can read ({exc}); give GPQA's official CSV") from None
    rows = [parse_json(line, f"{path}:{n}", DataError, "each line holds one GPQA row as a JSON object")
            for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path}: a line is not a JSON object; each line holds one GPQA row as a JSON object")
    return rows


def stock_preprocess(text: str | None) -> str:
    """lm-eval 0.4.13's ``preprocess`` of a GPQA choice (``lm_eval/tasks/gpqa/cot_zeroshot/utils.py``),
    so the prompt text is stock's: the question is left as it is, each choice goes through this."""
    if text is None:
        return " "
    return text.strip().replace(" [title]", ". ").replace("  ", " ")


def import_gpqa(source: Path, data_dir: Path, seed: int = GPQA_FREEZE_SEED) -> dict:
    """GPQA-Diamond from the official CSV (or JSONL with the same columns), choice order frozen.

    The prompt text is lm-eval's ``gpqa_diamond_cot_zeroshot``'s (question untouched, choices through
    its ``preprocess``); only the order of the choices differs: stock shuffles at load time with the
    global ``random``, here each question's order is drawn once from ``Random(f"{seed}:{record id}")``.
    """
    rows = _read_gpqa_rows(Path(source))
    needed = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
    out_rows = []
    for n, row in enumerate(rows):
        missing = [k for k in needed if k not in row]
        if missing:
            raise DataError(f"{source}: row {n} lacks {missing}; expected GPQA's official columns")
        rng = random.Random(f"{seed}:{row.get('Record ID', n)}")  # per-question, order-independent
        choices = [stock_preprocess(row[k]) for k in
                   ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3", "Correct Answer")]
        rng.shuffle(choices)
        out_rows.append({"id": row.get("Record ID") or f"q{n}", "Question": row["Question"],
                         "choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                         "choices": choices,
                         "answer": f"({'ABCD'[choices.index(stock_preprocess(row['Correct Answer']))]})"})
    out = make_folder(data_dir / "gpqa_diamond")
    write_atomic(out / "test.jsonl", "".join(json.dumps(r) + "\n" for r in out_rows))
    return _update_manifest(data_dir, "gpqa_diamond", {"test.jsonl": out / "test.jsonl"},
                            f"{source} (choices frozen with seed {seed})")


@dataclass(frozen=True)
class Dataset:
    """A benchmark's files for one run: the folder holding them and the entry run.json records."""

    folder: Path
    entry: dict  # {"source": where it came from, "files": {name: sha256}}


def _raw_gsm8k_folder(data_dir: Path) -> Path | None:
    for folder in (data_dir / "gsm8k", data_dir):
        if all((folder / name).is_file() for name in GSM8K_FILES):
            return folder
    return None


def dataset_for(benchmark: str, data_dir: Path | None = None) -> Dataset:
    """Where ``benchmark``'s files are for a run, checked and hashed (see the module docstring)."""
    if data_dir is None:
        if benchmark in SHIPPED:
            return Dataset(BUNDLED_DATA_DIR / benchmark, verify_data(BUNDLED_DATA_DIR, benchmark))
        raise DataError(f"{benchmark} does not ship with quantgate (it is gated): import your copy with "
                        f"`evals data --data-dir DATA --gpqa FILE`, then pass --data-dir DATA")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: not a folder; pass a folder prepared by `evals data`, or one holding "
                        f"GSM8K's train.jsonl and test.jsonl (directly or under gsm8k/)")
    manifest = data_dir / MANIFEST
    if manifest.exists() and benchmark in _read_manifest(manifest):
        return Dataset(data_dir / benchmark, verify_data(data_dir, benchmark))
    if benchmark == "arith":  # generated, never imported: the shipped copy is the one
        return dataset_for("arith")
    raw = _raw_gsm8k_folder(data_dir) if benchmark == "gsm8k" else None
    if raw is not None:
        for name in GSM8K_FILES:
            check_gsm8k_file(raw / name)
        return Dataset(raw, {"source": f"{raw} (GSM8K's own files, hashed at run time)",
                             "files": {name: _sha256(raw / name) for name in GSM8K_FILES}})
    if benchmark == "gsm8k" and manifest.exists():
        log.warning("%s has no gsm8k; using the GSM8K copy shipped with quantgate", data_dir)
        return dataset_for("gsm8k")
    if benchmark == "gsm8k":
        raise DataError(f"{data_dir}: holds neither {MANIFEST} (from `evals data --data-dir {data_dir} --gsm8k DIR`) "
                        f"nor GSM8K's own train.jsonl and test.jsonl (under {data_dir / 'gsm8k'}); do one of the two, "
                        f"or omit --data-dir to use the GSM8K copy shipped with quantgate")
    raise DataError(f"{data_dir}: {benchmark} not imported; run `evals data --data-dir {data_dir} "
                    f"--{benchmark.split('_')[0]} ...` first")


def _read_manifest(path: Path) -> dict:
    try:
        manifest = read_json(path, DataError, "re-import the data with `evals data`")
    except OSError as exc:
        raise DataError(f"{path}: unreadable ({exc}); re-import the data with `evals data`") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a data manifest (expected a JSON object); re-import the data with `evals data`")
    return manifest


def verify_data(data_dir: Path, benchmark: str) -> dict:
    """The manifest entry of ``benchmark``, after checking its files still have the recorded hashes."""
    manifest_path = Path(data_dir) / MANIFEST
    if not manifest_path.exists():
        raise DataError(f"{data_dir}: no {MANIFEST}; import the data first with `evals data`")
    entry = _read_manifest(manifest_path).get(benchmark)
    if entry is None:
        raise DataError(f"{data_dir}: {benchmark} not imported; run `evals data --{benchmark.split('_')[0]} ...`")
    for name, digest in entry["files"].items():
        path = Path(data_dir) / benchmark / name
        if not path.exists() or _sha256(path) != digest:
            raise DataError(f"{path}: changed since import (sha256 differs from {MANIFEST}); re-import it")
    return entry
