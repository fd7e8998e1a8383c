"""Write the arith benchmark: templated multi-step arithmetic word problems in GSM8K's format.

Each row is ``{"id", "question", "answer"}`` with the answer's worked steps ending ``#### N``,
like GSM8K, but short (one or two sentences, two steps, whole numbers below 100), so a
model of a few hundred thousand parameters can learn it on a CPU in minutes and a local
evaluation of hundreds of items takes seconds per item at most. Fixed random seed: the files
shipped in ``evals/benchmarks/data/arith`` are exactly what this writes.

    python3 -m evals.benchmarks.arith_make            # rewrites data/arith/{train,test}.jsonl + manifest
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261201
TRAIN_ITEMS, TEST_ITEMS = 8000, 250
NAMES = ["Tom", "Ana", "Li", "Sam", "Mia", "Omar", "Eva", "Raj", "Zoe", "Ben", "Ivy", "Leo"]
THINGS = ["apples", "pens", "cards", "books", "eggs", "coins", "shells", "stickers", "cookies", "marbles"]


def _make(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) from one of the templates, numbers drawn from ``rng``."""
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 9)
        c = rng.randint(1, min(9, a + b - 1))
        r = a + b - c
        return (f"{name} has {a} {thing}, buys {b} more and gives away {c}. How many are left?",
                f"{a} + {b} = {a + b}. {a + b} - {c} = {r}.\n#### {r}")
    if kind == 1:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, min(9, a * b - 1))
        r = a * b - c
        return (f"{name} has {a} bags of {b} {thing} and uses {c}. How many are left?",
                f"{a} * {b} = {a * b}. {a * b} - {c} = {r}.\n#### {r}")
    if kind == 2:
        a, b = rng.randint(2, 5), rng.randint(2, 9)
        paid = 20 if a * b <= 20 else 50
        r = paid - a * b
        return (f"{thing.capitalize()} cost ${a} each. {name} buys {b} and pays ${paid}. How much change?",
                f"{b} * {a} = {b * a}. {paid} - {b * a} = {r}.\n#### {r}")
    if kind == 3:
        a, b = rng.randint(2, 30), rng.randint(2, 9)
        r = a + a + b
        return (f"{name} has {a} {thing}. {other} has {b} more. How many do they have together?",
                f"{a} + {b} = {a + b}. {a} + {a + b} = {r}.\n#### {r}")
    a, b, c = rng.randint(2, 20), rng.randint(2, 5), rng.randint(2, 5)
    r = a + b * c
    return (f"{name} has {a} {thing} and gets {b} boxes of {c}. How many now?",
            f"{b} * {c} = {b * c}. {a} + {b * c} = {r}.\n#### {r}")


def make_rows(seed: int = SEED, train: int = TRAIN_ITEMS, test: int = TEST_ITEMS) -> dict[str, list[dict]]:
    """Train and test rows; no test question appears in train."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"test": [], "train": []}
    for split, n in (("test", test), ("train", train)):
        while len(splits[split]) < n:
            question, answer = _make(rng)
            if question in seen:
                continue
            seen.add(question)
            splits[split].append({"id": f"{split}-{len(splits[split])}", "question": question, "answer": answer})
    return splits


def write(data_dir: Path, seed: int = SEED) -> dict:
    """Write ``data_dir/arith/{train,test}.jsonl`` and record their sha256s in ``data_dir/manifest.json``."""
    from evals.data import _update_manifest

    out = data_dir / "arith"
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in make_rows(seed).items():
        files[f"{split}.jsonl"] = out / f"{split}.jsonl"
        files[f"{split}.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = (f"quantgate's arith generator (evals/benchmarks/arith_make.py, seed {seed}): {TRAIN_ITEMS} train and "
              f"{TEST_ITEMS} test templated arithmetic word problems in GSM8K's format")
    return _update_manifest(data_dir, "arith", dict(sorted(files.items())), source)


def main(argv: list[str] | None = None) -> int:
    from evals.data import BUNDLED_DATA_DIR

    p = argparse.ArgumentParser(prog="python3 -m evals.benchmarks.arith_make", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=BUNDLED_DATA_DIR, help="folder to write arith/ and manifest.json into")
    args = p.parse_args(argv)
    print(json.dumps(write(args.data_dir), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
