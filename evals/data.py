"""Benchmark data, offline-first: imported once into a data folder with its sha256s recorded.

``<data-dir>/gsm8k/{train,test}.jsonl`` in GSM8K's own format; ``<data-dir>/gpqa_diamond/test.jsonl``
with the choice order frozen at import (lm-eval's own GPQA task shuffles at load time with the
global ``random`` inside ``datasets.map``, so a warm cache ignores ``--seed``: SPEC section 6).
``<data-dir>/manifest.json`` records every file's sha256, which each run bundle copies.
GPQA is never bundled with quantgate: the user supplies the file.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
GPQA_FREEZE_SEED = 0


class DataError(ValueError):
    pass


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _update_manifest(data_dir: Path, benchmark: str, files: dict[str, Path], source: str) -> dict:
    manifest_path = data_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest[benchmark] = {"source": source, "files": {name: sha256_of(p) for name, p in files.items()}}
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest[benchmark]


def import_gsm8k(source_dir: Path, data_dir: Path) -> dict:
    """Copy GSM8K's official ``train.jsonl`` / ``test.jsonl`` (question, answer ending ``#### N``)."""
    out = data_dir / "gsm8k"
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "test"):
        src = Path(source_dir) / f"{split}.jsonl"
        if not src.exists():
            raise DataError(f"{src}: missing; point --gsm8k at the folder holding GSM8K's train.jsonl and test.jsonl")
        for n, line in enumerate(src.read_text().splitlines(), 1):
            row = json.loads(line)
            if "question" not in row or "####" not in row.get("answer", ""):
                raise DataError(f"{src}:{n}: not GSM8K format (question, answer ending '#### N')")
        shutil.copyfile(src, out / f"{split}.jsonl")
        files[f"{split}.jsonl"] = out / f"{split}.jsonl"
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
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def import_gpqa(source: Path, data_dir: Path, seed: int = GPQA_FREEZE_SEED) -> dict:
    """GPQA-Diamond from the official CSV (or JSONL with the same columns), choice order frozen."""
    rows = _read_gpqa_rows(Path(source))
    needed = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
    out_rows = []
    for n, row in enumerate(rows):
        missing = [k for k in needed if k not in row]
        if missing:
            raise DataError(f"{source}: row {n} lacks {missing}; expected GPQA's official columns")
        rng = random.Random(f"{seed}:{row.get('Record ID', n)}")  # per-question, order-independent
        choices = [row["Incorrect Answer 1"], row["Incorrect Answer 2"], row["Incorrect Answer 3"], row["Correct Answer"]]
        choices = [c.strip() for c in choices]
        rng.shuffle(choices)
        out_rows.append({"id": row.get("Record ID") or f"q{n}", "Question": row["Question"].strip(),
                         "choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                         "choices": choices,
                         "answer": f"({'ABCD'[choices.index(row['Correct Answer'].strip())]})"})
    out = data_dir / "gpqa_diamond"
    out.mkdir(parents=True, exist_ok=True)
    (out / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out_rows))
    return _update_manifest(data_dir, "gpqa_diamond", {"test.jsonl": out / "test.jsonl"},
                            f"{source} (choices frozen with seed {seed})")


def verify_data(data_dir: Path, benchmark: str) -> dict:
    """The manifest entry of ``benchmark``, after checking its files still have the recorded hashes."""
    manifest_path = Path(data_dir) / MANIFEST
    if not manifest_path.exists():
        raise DataError(f"{data_dir}: no {MANIFEST}; import the data first with `evals data`")
    entry = json.loads(manifest_path.read_text()).get(benchmark)
    if entry is None:
        raise DataError(f"{data_dir}: {benchmark} not imported; run `evals data --{benchmark.split('_')[0]} ...`")
    for name, digest in entry["files"].items():
        path = Path(data_dir) / benchmark / name
        if not path.exists() or sha256_of(path) != digest:
            raise DataError(f"{path}: changed since import (sha256 differs from {MANIFEST}); re-import it")
    return entry
