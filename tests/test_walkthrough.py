"""The README's walkthrough on the built-in example runs anywhere: every command of its section, as
written, in an empty folder (no clone around it: the arith policy is the package's own), with the
installed entry points (what a user runs, not the source tree).

The one change is size: each `evals run` without `--plan` gets `--limit LIMIT` and `gate plan` gets
`--items arith=LIMIT` (both documented flags; the planned runs then run the plan's LIMIT items), so
the eleven commands take about 60 CPU seconds instead of several minutes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.walkthrough_time import section_commands

LIMIT = 80  # the first items where MXFP4 and FP8 differ are 61 and 71: a pilot must show a variance


def small(command: str) -> str:
    words = shlex.split(command)
    if words[:2] == ["evals", "run"] and "--plan" not in words:
        return f"{command} --limit {LIMIT}"
    if words[:2] == ["gate", "plan"]:
        return f"{command} --items arith={LIMIT}"
    return command


def test_the_readme_walkthrough_runs_verbatim_in_an_empty_folder(tmp_path):
    commands = section_commands()
    assert not [c for c in commands if "tests/" in c], "the walkthrough must not need a clone's tests/ folder"
    assert [c.split()[:2] for c in commands if c.startswith("gate plan") or "--until-decided" in c] == [
        ["gate", "plan"], ["evals", "run"]], commands  # it plans the example and decides look by look
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for command in map(small, commands):
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (command, done.stderr[-3000:])
    assert (tmp_path / "page" / "report.html").is_file()
    release = json.loads((tmp_path / "runs" / "mxfp4" / "report.json").read_text())
    assert release["provenance"]["policy"]["path"].endswith("arith-example.yaml")
    plan = (tmp_path / "plan.yaml").read_text()
    assert "arith:" in plan and f"items: {LIMIT}" in plan
    planned = next(Path(c.split("--out ")[1].split()[0]) for c in commands if "--until-decided" in c)
    looks = json.loads((tmp_path / planned / "looks.json").read_text())
    assert looks and all(b["final"] for b in looks[-1]["benchmarks"].values())  # decided: a final verdict
