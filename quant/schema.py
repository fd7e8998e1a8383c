"""YAML data files checked against a declared schema when they are read, in one place.

Every YAML input is read by ``load``: the bounded reader (``safe_files.read_yaml``), a mapping
required, then the file's schema.

A schema is a pydantic model deriving from ``Schema``: every key known (an unknown key is named
with the nearest valid one, so a misspelt key is never silently ignored), types strict (``4.0``
or ``"4"`` is no count), numbers finite and in the range the field declares. ``validate`` turns
the first violation into one line naming the file and the key path (``fused_experts.tensors.0.names``),
raised as the caller's error class. ``template_problem`` checks a ``str.format`` template against
the fields the code supplies: a field it does not supply would be a KeyError, a format spec like
``{e:1500000000}`` a 1.5 GB string per call.
"""

from __future__ import annotations

import difflib
import math
import string
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    model_validator,
)

from quant.safe_files import read_yaml

Model = TypeVar("Model", bound="Schema")


def _json_value(value):
    """``value`` if JSON writes it as it is: strings, integers, booleans, null, finite numbers, and
    lists and string-keyed mappings of them (``json.dumps`` would write ``.inf`` as invalid JSON)."""
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        if bad := next((key for key in value if not isinstance(key, str)), None):
            raise ValueError(f"key {bad!r:.60} is not a string")
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if value is not None and not isinstance(value, (str, int, float)):
        raise ValueError(f"{value!r:.60} is not a JSON value")
    return value


JsonValue = Annotated[Any, AfterValidator(_json_value)]  # a value copied into a JSON file (config.json)


def nearest(name: str, known, kind: str = "key") -> str:
    """``unknown <kind> 'name' (did you mean 'x'?)``, or the known names listed when none is close."""
    known = [str(k) for k in known]
    near = difflib.get_close_matches(str(name), known, 1)
    hint = f"did you mean {near[0]!r}?" if near else f"known {kind}s: {', '.join(known)}"
    return f"unknown {kind} {str(name)!r:.80} ({hint})"


class Schema(BaseModel):
    """The base of every file schema: strict, finite, frozen, no unknown keys."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        """An unknown key named with the nearest valid name (pydantic's own message names neither)."""
        if isinstance(data, dict):
            known = [field.alias or name for name, field in cls.model_fields.items()]
            for key in data:
                if key not in known:
                    raise ValueError(nearest(key, known))
        return data


def validate(data, schema: type[Model], path: Path, what: str, error: type[Exception], compare: str,
             context: dict | None = None) -> Model:
    """``data`` (a file's parsed YAML) as ``schema``; the first violation raises ``error`` as one
    line naming ``path`` (a ``what``), the key and what is wrong (``compare``: where to see a valid file).
    ``context`` reaches the schema's validators (the names valid where only the running code knows them)."""
    try:
        return schema.model_validate(data, context=context)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = "".join(f"{key}: " if i == len(first["loc"]) - 1 else f"{key}." for i, key in enumerate(first["loc"]))
        why = "a required key, missing" if first["type"] == "missing" else first["msg"].removeprefix("Value error, ")
        if first["type"] not in ("value_error", "missing"):
            why += f", not {first['input']!r:.60}"
        raise error(f"{path}: not a valid {what}: {where}{why}; {compare}") from None


def load(path: Path, schema: type[Model], what: str, error: type[Exception], compare: str = "",
         context: dict | None = None) -> Model:
    """The YAML file at ``path`` (a ``what``: "recipe", "gate policy") as ``schema``. A file that
    cannot be read, is not YAML, is not a mapping or breaks the schema raises ``error`` as one line
    naming the file, the key path and, for an unknown key, the nearest valid name; ``compare`` says
    where to see a valid file."""
    compare = compare or f"fix the {what}"
    data = read_yaml(Path(path), error, compare)
    if not isinstance(data, dict):
        raise error(f"{path}: a YAML {type(data).__name__}, not a mapping; {compare}")
    return validate(data, schema, path, what, error, compare, context)


def template_problem(template: str, fields: tuple[str, ...], every: bool = True) -> str | None:
    """Why ``template`` is not a ``str.format`` template of ``fields`` (``every``: each exactly once,
    as names parsed back by them need), plain (no format spec, conversion or literal brace); None
    where it is."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"{template!r:.80} is not a template ({exc})"
    used = [name for _, name, _, _ in parsed if name is not None]
    if any("{" in text or "}" in text for text, *_ in parsed):
        return f"{template!r:.80} holds a literal brace; tensor names have none"
    if unknown := [name for name in used if name not in fields]:
        supplied = ", ".join(f"{{{f}}}" for f in fields) or "none"
        return f"field {{{unknown[0][:80]}}} is not one quantgate supplies ({supplied})"
    if spec := next((f"{{{n}:{s}}}" if s else f"{{{n}!{c}}}" for _, n, s, c in parsed if s or c), None):
        return f"{spec[:80]}: a format spec or conversion; write the plain field (the names are parsed back by it)"
    if every and (missing := [f for f in fields if used.count(f) != 1]):
        return f"{template!r:.80} must use {{{missing[0]}}} exactly once (each name must be distinct and parsed back)"
    return None
