"""The one YAML loader (``quant.schema.load``): every way a file can be wrong is one error naming
the file and the key, raised as the caller's error class."""

from __future__ import annotations

import pytest
from pydantic import Field

from quant.schema import Schema, load


class Sample(Schema):
    name: str
    count: int = Field(1, ge=1)


class SampleError(Exception):
    pass


@pytest.mark.parametrize("text, needles", [
    ("name: a\ncont: 2\n", ("unknown key 'cont'", "did you mean 'count'?")),
    ("name: a\ncount: '2'\n", ("count:", "'2'")),
    ("name: a\ncount: 0\n", ("count:", "greater than or equal to 1")),
    ("count: 2\n", ("name: a required key, missing",)),
    ("- name: a\n", ("a YAML list, not a mapping",)),
    ("name: [a\n", ("not valid YAML",)),
])
def test_a_bad_file_is_one_error_naming_file_and_key(tmp_path, text, needles):
    path = tmp_path / "sample.yaml"
    path.write_text(text)
    with pytest.raises(SampleError) as caught:
        load(path, Sample, "sample", SampleError, "compare it with the manual")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)), message
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(SampleError, match="not found"):
        load(tmp_path / "absent.yaml", Sample, "sample", SampleError)


def test_a_valid_file_is_its_schema(tmp_path):
    (tmp_path / "sample.yaml").write_text("name: a\ncount: 3\n")
    assert load(tmp_path / "sample.yaml", Sample, "sample", SampleError) == Sample(name="a", count=3)
