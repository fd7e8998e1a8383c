"""The run bundle: ``run.json`` (provenance) + ``samples.jsonl`` (one row per item x repeat x filter).

Two bundles pair up when they hold the same (benchmark, item_id, repeat, filter) keys with equal
``doc_hash``; the gate compares them row by row. Bundles are written only by ``BundleWriter``:
finished units under ``units/`` (each with the identity it was produced under: settings, model,
dataset sha256s), then ``samples.jsonl``, then ``run.json`` last, atomically: a folder with a
``run.json`` is a finished bundle, one without is a run in progress.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from evals.errors import BadInput
from quant.outputs import write_atomic
from quant.safe_files import make_folder, parse_json, read_json, read_regular, refuse_link

RUN_JSON, SAMPLES, UNITS = "run.json", "samples.jsonl", "units"
REQUIRED = ("benchmark", "item_id", "repeat", "filter", "score", "doc_hash", "prompt_hash")
SAMPLES_BYTES = 1 << 30  # a bundle's rows: ~30 MB for GSM8K x 10 repeats with texts kept (--keep-text)
log = logging.getLogger(__name__)


class BundleError(BadInput):
    """A bundle that cannot be read, or two that cannot be paired; the message names file and line."""


def key_of(row: dict) -> tuple[str, str, int, str]:
    return row["benchmark"], row["item_id"], row["repeat"], row["filter"]


def write_rows(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def _read_json(path: Path, what: str):
    try:
        return read_json(path, BundleError, what)
    except FileNotFoundError:
        raise BundleError(f"{path.parent}: not a finished run bundle ({path.name} missing)") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc.strerror}); check the file and its permissions") from None


def _read_lines(path: Path) -> list[str]:
    """The lines of a bundle's JSONL file (a regular file, at most ``SAMPLES_BYTES``, UTF-8)."""
    try:
        return read_regular(path, SAMPLES_BYTES, BundleError).decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise BundleError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}); rerun `evals run` to rewrite it") \
            from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc.strerror}); check the file and its permissions") from None


def _normalised(row, where: str) -> dict:
    """A sample row with its key fields in one type each (item id ``0`` and ``"0"`` are one item)."""
    if not isinstance(row, dict):
        raise BundleError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise BundleError(f"{where}: missing {missing}")
    score = row["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0 or math.isnan(score):
        raise BundleError(f"{where}: score {score!r} is not a number in 0..1")
    repeat = row["repeat"]
    if isinstance(repeat, str) and repeat.isascii() and repeat.isdigit():
        repeat = int(repeat)  # a repeat written as text ("0") is the same repeat
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise BundleError(f"{where}: repeat {repeat!r} is not a non-negative integer")
    for field in ("benchmark", "doc_hash", "prompt_hash"):
        if not isinstance(row[field], str):
            raise BundleError(f"{where}: {field} {row[field]!r} is not a string")
    for field in ("item_id", "filter"):
        if not isinstance(row[field], (str, int)) or isinstance(row[field], bool):
            raise BundleError(f"{where}: {field} {row[field]!r} is not a string or an integer")
    return {**row, "item_id": str(row["item_id"]), "repeat": repeat, "filter": str(row["filter"]),
            "score": float(score)}


def read_rows(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        raw = parse_json(line, f"{path}:{n}", BundleError, f"each line of {path.name} is one JSON object")
        rows.append(_normalised(raw, f"{path}:{n}"))
    return rows


def check_rows(rows: list[dict], where: str) -> None:
    """No duplicate keys, and one document per item (repeats of an item ran on the same data)."""
    seen: set = set()
    docs: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        if key_of(row) in seen:
            raise BundleError(f"{where}: duplicate (benchmark, item_id, repeat, filter) row {key_of(row)}")
        seen.add(key_of(row))
        docs.setdefault((row["benchmark"], row["item_id"]), set()).add(row["doc_hash"])
    mixed = sorted(k for k, v in docs.items() if len(v) > 1)
    if mixed:
        raise BundleError(f"{where}: {len(mixed)} item(s) carry more than one doc_hash (e.g. {mixed[0]}): its units "
                          "ran on different data; rerun them on one version of the data")


def read_bundle(run_dir: Path) -> tuple[dict, list[dict]]:
    """``(run.json, rows)`` of a finished bundle, validated; every problem is a BundleError naming the file."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise BundleError(f"{run_dir}: is a file; give the run bundle folder (it holds {RUN_JSON} and {SAMPLES})")
    if not run_dir.is_dir():
        raise BundleError(f"{run_dir}: no such run bundle folder")
    run = _read_json(run_dir / RUN_JSON, "a run bundle's run.json is written by `evals run` / `evals import-tau2`")
    if not isinstance(run, dict) or not isinstance(run.get("benchmarks"), dict):
        raise BundleError(f"{run_dir / RUN_JSON}: no 'benchmarks' mapping; not a run.json written by `evals run`")
    if not (run_dir / SAMPLES).exists():
        raise BundleError(f"{run_dir}: not a finished run bundle ({SAMPLES} missing)")
    rows = read_rows(run_dir / SAMPLES)
    if not rows:
        raise BundleError(f"{run_dir / SAMPLES}: no rows; the run scored nothing")
    check_rows(rows, str(run_dir / SAMPLES))
    return run, rows


def pair(reference: list[dict], candidate: list[dict]) -> list[tuple[dict, dict]]:
    """(reference, candidate) rows matched by key; refuses unequal item sets or documents."""
    ref, cand = {key_of(r): r for r in reference}, {key_of(r): r for r in candidate}
    only_ref, only_cand = sorted(ref.keys() - cand.keys()), sorted(cand.keys() - ref.keys())
    if only_ref or only_cand:
        raise BundleError(f"item sets differ: {len(only_ref)} rows only in the reference (e.g. {only_ref[:3]}), "
                          f"{len(only_cand)} only in the candidate (e.g. {only_cand[:3]})")
    changed = sorted(k for k in ref if ref[k]["doc_hash"] != cand[k]["doc_hash"])
    if changed:
        raise BundleError(f"{len(changed)} items have different documents (doc_hash), e.g. {changed[:3]}: "
                          "the two runs did not see the same data")
    return [(ref[k], cand[k]) for k in sorted(ref)]


def _changed(recorded, identity: dict) -> list[str]:
    """The keys of a unit's identity that differ from those it was recorded under."""
    recorded = recorded if isinstance(recorded, dict) else {}
    return sorted(k for k in identity.keys() | recorded.keys() if recorded.get(k) != identity.get(k))


class BundleWriter:
    """The one place a bundle is written: units as they finish, then samples, then run.json.

    A unit (a benchmark x repeat, a tau2 domain) is kept with the identity it was produced under
    (settings, model, dataset sha256s). On ``resume`` a unit whose identity still matches is
    reused, one that no longer matches is redone (and listed in ``redone`` with what changed);
    without ``resume`` a folder holding units is refused, so two runs never mix in one folder.
    """

    def __init__(self, out: Path, resume: bool = False):
        self.out, self.resume = Path(out), resume
        if self.out.is_file():
            raise BadInput(f"{self.out}: is a file; --out names a folder for the run bundle")
        if (self.out / RUN_JSON).exists() and not resume:
            raise BadInput(f"{self.out} already holds a finished run; choose a new --out")
        self.units = self.out / UNITS
        refuse_link(self.units)  # units are written (and read back) there: never through a link
        if not resume and self.units.is_dir() and any(self.units.iterdir()):
            raise BadInput(f"{self.out} holds an unfinished run ({self.units}); pass --resume to complete it, or "
                           "choose a new --out")
        self.redone: dict[str, list[str]] = {}

    def begin(self, units: dict[str, dict], model: str, benchmarks: list[str], tau2: dict | None = None) -> None:
        """Before the run writes anything: ``units`` (name: identity) are the units it will keep or
        produce. A finished bundle is resumed only to add units (the next look of ``--until-decided``):
        another model, a benchmark left out, a recorded unit measured otherwise or other tau2
        settings would replace what it holds, so that is refused and the bundle kept as it is."""
        if self.resume and (self.out / RUN_JSON).exists():
            self._check_only_adds(units, model, benchmarks, tau2)
        # A bundle being resumed is in progress again until finish() writes its new run.json.
        (self.out / RUN_JSON).unlink(missing_ok=True)

    def _check_only_adds(self, units: dict[str, dict], model: str, benchmarks: list[str], tau2: dict | None) -> None:
        run = _read_json(self.out / RUN_JSON, "a finished bundle's run.json is written by `evals run`")
        recorded = run if isinstance(run, dict) else {}
        keep = "--resume completes an interrupted run with the same model and settings; the bundle is kept as it " \
               "is: choose a new --out"
        if recorded.get("model") != model:
            raise BadInput(f"{self.out} is a finished run of --model {recorded.get('model')!r}, not {model!r}; {keep}")
        held = recorded.get("benchmarks") if isinstance(recorded.get("benchmarks"), dict) else {}
        left_out = sorted(set(held) - set(benchmarks))
        if left_out:
            raise BadInput(f"{self.out} is a finished run that also holds {left_out}; {keep}")
        tau2_before = held.get("tau2")
        if tau2 is not None and isinstance(tau2_before, dict) and json.loads(json.dumps(tau2)) != tau2_before.get("settings"):
            raise BadInput(f"{self.out} is a finished tau2 run with other tau2 settings; {keep}")
        for name, identity in units.items():
            meta = self.units / f"{name}.json"
            if meta.exists():
                before = _read_json(meta, "rerun without --resume into a new --out")
                before = before if isinstance(before, dict) else {}
                identity = json.loads(json.dumps(identity))
                changed = _changed(before, identity)
                if "settings" in changed and isinstance(before.get("settings"), dict):  # name the setting
                    changed = [k for k in changed if k != "settings"] + \
                        [f"settings {k}" for k in _changed(before["settings"], identity["settings"])]
                if changed:
                    raise BadInput(f"{self.out} is a finished run whose unit {name} was measured with another "
                                   f"{', '.join(changed)}; {keep}")

    def unit(self, name: str, identity: dict, produce: Callable[[], list[dict]]) -> tuple[list[dict], bool]:
        """``(rows, reused)``: the unit's rows, from disk when its identity matches, else produced now."""
        make_folder(self.units)
        rows_path, meta_path = self.units / f"{name}.jsonl", self.units / f"{name}.json"
        identity = json.loads(json.dumps(identity))  # as it reads back from disk (tuples become lists)
        if rows_path.exists() or meta_path.exists():
            recorded = _read_json(meta_path, "rerun without --resume into a new --out") if meta_path.exists() \
                else None
            if recorded == identity and rows_path.exists():
                return read_rows(rows_path), True
            changed = _changed(recorded, identity) if recorded else ["unfinished"]
            self.redone[name] = changed
            log.warning("unit %s no longer matches this run (%s): redoing it", name, ", ".join(changed))
            meta_path.unlink(missing_ok=True)
        rows = produce()
        write_rows(rows_path, rows)
        write_atomic(meta_path, json.dumps(identity, indent=2, sort_keys=True))  # the unit's completion marker
        return rows, False

    def finish(self, rows: list[dict], run: dict) -> dict:
        """Validate and write ``samples.jsonl``, then ``run.json`` (the bundle's completion marker)."""
        rows = [_normalised(r, f"{self.out / SAMPLES} row {n}") for n, r in enumerate(rows, 1)]
        check_rows(rows, str(self.out / SAMPLES))
        run = {**run, "rows": len(rows), **({"redone_on_resume": self.redone} if self.redone else {})}
        self.out.mkdir(parents=True, exist_ok=True)
        write_rows(self.out / SAMPLES, rows)
        write_atomic(self.out / RUN_JSON, json.dumps(run, indent=2, default=str))
        return run
