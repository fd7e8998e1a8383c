"""Time the README's local walkthrough, command by command, exactly as the README writes it.

    python3 -m tests.benchmarks.walkthrough_time [--keep DIR]

Takes the bash block under "Evaluating a quantized checkpoint as served, locally" in README.md
(continuations joined), runs each command in an empty folder (the arith policy ships with the
package), one after another as a user would, and prints per command its
exit code, wall seconds, CPU seconds (user + system of the command's processes) and peak RSS, then
the totals and the machine's load average before and after (a shared machine inflates wall time;
CPU seconds are the figure to compare). A command exiting other than 0 or 1 stops the run.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "### Evaluating a quantized checkpoint as served, locally"


def _commands(block: str) -> list[str]:
    """A bash block's commands, comment lines and trailing comments dropped, continuations joined."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def walkthrough_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The commands of the first bash block after SECTION, comments dropped, continuations joined."""
    text = readme.read_text()
    return _commands(re.search(r"```bash\n(.*?)```", text[text.index(SECTION):], re.S)[1])


def section_commands(readme: Path = REPO / "README.md") -> list[str]:
    """Every bash block of SECTION (up to the next heading), in order: the walkthrough and what follows it."""
    text = readme.read_text()
    body = text[text.index(SECTION) + len(SECTION):]
    body = body[:re.search(r"^#{2,4} ", body, re.M).start()]  # the next heading (a bash comment has one #)
    return [c for block in re.findall(r"```bash\n(.*?)```", body, re.S) for c in _commands(block)]


def run(commands: list[str], folder: Path) -> list[dict]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    rows = []
    for command in commands:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rows.append({"command": command, "exit": done.returncode, "wall_s": time.monotonic() - started,
                     "cpu_s": cpu, "peak_rss_gb": after.ru_maxrss / 1e6})
        print(f"{done.returncode:>4}  {rows[-1]['wall_s']:7.1f}  {cpu:7.1f}  {command}", flush=True)
        if done.returncode not in (0, 1):
            print(done.stderr[-3000:], file=sys.stderr)
            break
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.benchmarks.walkthrough_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", type=Path, help="run in this new folder and keep it (default: a temporary one)")
    args = p.parse_args(argv)
    commands = walkthrough_commands()
    load = os.getloadavg()[0]
    print(f"{len(commands)} commands from README.md; load average {load:.2f} on {os.cpu_count()} cores")
    print("exit   wall s    CPU s  command")
    with tempfile.TemporaryDirectory(prefix="walkthrough-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=False) if args.keep else None
        rows = run(commands, folder)
    wall, cpu = sum(r["wall_s"] for r in rows), sum(r["cpu_s"] for r in rows)
    print(f"total: {wall:.0f} s wall ({wall / 60:.1f} min), {cpu:.0f} CPU s, peak RSS "
          f"{max(r['peak_rss_gb'] for r in rows):.2f} GB; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0 if len(rows) == len(commands) else 1


if __name__ == "__main__":
    raise SystemExit(main())
