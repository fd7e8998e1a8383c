"""Comments, docstrings and docs say why, never which issue asked: an issue number means nothing to a
reader without the tracker, and the reason it stood for is what the next change needs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".sh"}


def test_no_text_cites_an_issue_number_in_place_of_the_reason():
    cited = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.suffix not in SUFFIXES or any(p.startswith(".") or p in ("build", "dist") for p in parts):
            continue
        if not path.is_file() or "egg-info" in str(path):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if CITATION.search(line):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not cited, "say the reason instead of the issue number:\n" + "\n".join(cited)
