"""The run bundle: ``run.json`` (provenance) + ``samples.jsonl`` (one row per item x repeat x filter).

Two bundles pair up when they hold the same (benchmark, item_id, repeat, filter) keys with equal
``doc_hash``; the gate compares them row by row.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN_JSON, SAMPLES = "run.json", "samples.jsonl"
REQUIRED = ("benchmark", "item_id", "repeat", "filter", "score", "doc_hash", "prompt_hash")


class BundleError(ValueError):
    pass


def write_samples(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(path)


def read_bundle(run_dir: Path) -> tuple[dict, list[dict]]:
    """``(run.json, rows)`` of a finished bundle, validated."""
    run_dir = Path(run_dir)
    try:
        run = json.loads((run_dir / RUN_JSON).read_text())
        rows = [json.loads(line) for line in (run_dir / SAMPLES).read_text().splitlines() if line.strip()]
    except FileNotFoundError as exc:
        raise BundleError(f"{run_dir}: not a finished run bundle ({exc.filename} missing)") from None
    for n, row in enumerate(rows, 1):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise BundleError(f"{run_dir / SAMPLES}:{n}: missing {missing}")
        if not 0.0 <= float(row["score"]) <= 1.0:
            raise BundleError(f"{run_dir / SAMPLES}:{n}: score {row['score']} outside 0..1")
    keys = [(r["benchmark"], r["item_id"], r["repeat"], r["filter"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise BundleError(f"{run_dir / SAMPLES}: duplicate (benchmark, item_id, repeat, filter) rows")
    return run, rows


def pair(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """Rows of two bundles matched by key; refuses unequal item sets or documents."""
    key = lambda r: (r["benchmark"], str(r["item_id"]), r["repeat"], r["filter"])  # noqa: E731
    left, right = {key(r): r for r in a}, {key(r): r for r in b}
    only_a, only_b = sorted(left.keys() - right.keys()), sorted(right.keys() - left.keys())
    if only_a or only_b:
        raise BundleError(f"item sets differ: {len(only_a)} rows only in the first (e.g. {only_a[:3]}), "
                          f"{len(only_b)} only in the second (e.g. {only_b[:3]})")
    changed = sorted(k for k in left if left[k]["doc_hash"] != right[k]["doc_hash"])
    if changed:
        raise BundleError(f"{len(changed)} items have different documents (doc_hash), e.g. {changed[:3]}: "
                          "the two runs did not see the same data")
    return [(left[k], right[k]) for k in sorted(left)]
