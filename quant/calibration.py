"""Calibration prompts for the sensitivity pass, never drawn from what the gate evaluates.

``DATA`` is a JSONL file of prompts (each line an object with a ``question`` or ``text`` field) or a
shipped benchmark's name (``arith``, ``gsm8k``: its TRAIN split, ``arith:train`` spelt out too). Every
item is hashed: the sha256 of its normalized question (``text`` for a plain prompt), lower-cased with
runs of whitespace made one space, so a copy that differs only in spacing or case is still caught. An
item whose hash is a test item's of any shipped benchmark is refused (exit 2): static activation scales and
the ladder's choice measured on the items the gate then scores would certify the data they were fitted on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from evals.data import SHIPPED, dataset_for
from quant.errors import QuantgateError
from quant.hashing import sha256_of
from quant.safe_files import read_regular

BENCHMARKS = SHIPPED  # the benchmarks quantgate ships with both splits (their files' sha256s checked on use)
CALIBRATION_BYTES = 1 << 30
PROMPT = "Question: {question}\nAnswer:"  # the shipped benchmarks' doc_to_text (evals/benchmarks/*.yaml)


class CalibrationError(QuantgateError, ValueError):
    """Calibration data that cannot be used: unreadable, empty, or overlapping evaluation items (exit 2)."""


@dataclass(frozen=True)
class Calibration:
    source: str  # the file's path, or "<benchmark>:train"
    prompts: tuple[str, ...]  # what the model reads, in order
    item_sha256: tuple[str, ...]  # one per prompt: sha256 of its normalized question / text

    def to_dict(self) -> dict:
        return {"source": self.source, "items": len(self.prompts), "item_sha256": list(self.item_sha256)}


def normalized(text: str) -> str:
    return " ".join(text.split()).lower()


def item_hash(text: str) -> str:
    return sha256_of(normalized(text))


def prompt_of(row: dict) -> tuple[str, str]:
    """``(prompt, hashed text)`` of one item: a question in the benchmarks' own prompt format, followed by its
    answer where the item has one (the tokens the model produces when evaluated reach the layers too), or a
    plain ``text``."""
    if isinstance(row.get("question"), str):
        prompt = PROMPT.format(question=row["question"])
        if isinstance(row.get("answer"), str):
            prompt += " " + row["answer"]
        return prompt, row["question"]
    return row["text"], row["text"]


def _rows(path: Path, where: str) -> list[tuple[int, dict]]:
    try:
        data = read_regular(path, CALIBRATION_BYTES, CalibrationError)
    except OSError as exc:
        raise CalibrationError(f"{where}: cannot be read ({exc.strerror}); give a JSONL file of prompts or a "
                               f"benchmark name ({', '.join(BENCHMARKS)})") from None
    rows = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{where} line {number}: not JSON ({exc.msg}); one object per line") from None
        text = row.get("question", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise CalibrationError(f"{where} line {number}: no 'question' or 'text' string; each line is an object "
                                   'such as {"question": "..."} or {"text": "..."}')
        rows.append((number, row))
    return rows


@cache
def evaluation_hashes() -> dict[str, str]:
    """sha256 of every shipped benchmark's test question -> the benchmark's name."""
    hashes = {}
    for benchmark in BENCHMARKS:
        path = dataset_for(benchmark).folder / "test.jsonl"
        hashes.update({item_hash(prompt_of(row)[1]): benchmark for _, row in _rows(path, str(path))})
    return hashes


def benchmark_named(data: str) -> str | None:
    """The benchmark ``data`` names (``arith`` or ``arith:train``), None for anything else."""
    name, _, split = data.partition(":")
    if name in BENCHMARKS and split in ("", "train"):
        return name
    if name in BENCHMARKS:
        raise CalibrationError(f"--calibration {data}: only a benchmark's train split calibrates ({name}:train); "
                               "its test split is what the gate evaluates")
    return None


def load_calibration(data: str, items: int | None = None) -> Calibration:
    """The first ``items`` prompts of ``data`` (all if None), refused where any is an evaluation item."""
    benchmark = benchmark_named(data)
    if benchmark:
        path, source = dataset_for(benchmark).folder / "train.jsonl", f"{benchmark}:train"
    else:
        path, source = Path(data), data
        if not path.is_file():
            raise CalibrationError(f"--calibration {data}: no such file and not a benchmark name; give a JSONL file of "
                                   f"prompts ('question' or 'text' per line) or one of {', '.join(BENCHMARKS)}")
    rows = _rows(path, source)[:items]
    if not rows:
        raise CalibrationError(f"{source}: holds no prompt; give at least one line with a 'question' or 'text'")
    prompts, hashes = zip(*((prompt, item_hash(text)) for prompt, text in map(prompt_of, (r for _, r in rows))))
    tests = evaluation_hashes()
    overlap = [(number, tests[h]) for (number, _), h in zip(rows, hashes) if h in tests]
    if overlap:
        benchmarks = sorted({b for _, b in overlap})
        lines = ", ".join(str(n) for n, _ in overlap[:5]) + (" ..." if len(overlap) > 5 else "")
        raise CalibrationError(f"{source}: {len(overlap)} of {len(rows)} calibration items are test items of "
                               f"{', '.join(benchmarks)} (same sha256 of the normalized question; line {lines}): "
                               "remove them, or calibrate on a benchmark's train split (--calibration arith)")
    return Calibration(source, tuple(prompts), tuple(hashes))
