"""A table of published summary scores (``manifests/references/*.yaml``): the weaker, unpaired
comparison ``gate accuracy --reference-table`` adds when no per-item reference run exists."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from evals.errors import BadInput
from quant.layout import manifests_root
from quant.schema import Schema, load


class PublishedScore(Schema):
    score: float  # the published accuracy, 0..1
    se: float | None = None  # its standard error, where the publisher gives one
    n: int | None = None  # how many items it was measured on
    protocol: str | None = None  # how it was measured, in words (shots, seeds, temperature)

    @field_validator("score", "se")
    @classmethod
    def _fraction(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"{value} is not a score in [0, 1] (write 96% as 0.96)")
        return value


class ReferenceTable(Schema):
    model: str | None = None  # the published model the scores are of
    benchmarks: dict[str, PublishedScore]


def load_reference_table(path: Path) -> ReferenceTable:
    return load(path, ReferenceTable, "reference table", BadInput,
                f"compare it with the reference tables under {manifests_root() / 'references'}")
