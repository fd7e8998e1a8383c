"""Hostile inputs, fourth campaign: counts that ran into tau2 or never finished are refused at once.

``evals run --tau2-infra-retries -1`` failed inside tau2 (exit 3) and ``1000000000`` retried a failing
server for ever; ``gate plan --max-repeats gpqa_diamond=2000`` integrated 2000 looks and never answered.
Each is one line naming the flag, exit 2, within seconds, before any server is asked or anything written.
"""

from __future__ import annotations

import time

import pytest

from evals.cli import evals_main, main as gate_main
from evals.judge.stats import MAX_REPEATS
from evals.tau2_run import MAX_RETRIES
from tests.evals.test_hostile_evals import as_process, cli, one_line, outside  # noqa: F401  (outside: a fixture)

pytestmark = pytest.mark.usefixtures("outside")


@pytest.mark.parametrize("retries, says", [
    (-1, "--tau2-infra-retries -1: give a whole number of at least 0"),
    (MAX_RETRIES + 1, f"--tau2-infra-retries {MAX_RETRIES + 1}: at most {MAX_RETRIES}"),
    (1000000000, f"--tau2-infra-retries 1000000000: at most {MAX_RETRIES}"),
    ("--tau2-max-retries", f"--tau2-max-retries 1000000000: at most {MAX_RETRIES}"),  # litellm's, per call
])
def test_tau2_retries_out_of_range_are_refused_before_any_server_is_asked(retries, says, tmp_path, capsys):
    started = time.monotonic()
    # port 9 (discard): nothing answers; a refusal that asked it first would name the server instead
    code, _, err = cli(capsys, evals_main, "run", "--benchmarks", "tau2", "--model", "m", "--base-url",
                       "http://127.0.0.1:9/v1", "--tau2-user-llm", "openai/u", "--out", tmp_path / "out",
                       *(["--tau2-max-retries", 1000000000] if retries == "--tau2-max-retries" else
                         ["--tau2-infra-retries", retries]))
    assert code == 2 and time.monotonic() - started < 5, err
    one_line(err, says)
    assert not (tmp_path / "out").exists()


def test_gate_plan_refuses_more_repeats_than_it_plans_at_once():
    started = time.monotonic()
    out = as_process("main", "plan", "--benchmarks", "gpqa_diamond", "--max-repeats", "gpqa_diamond=2000", timeout=60)
    assert out.returncode == 2 and time.monotonic() - started < 30, out.stderr  # hung before
    one_line(out.stderr, f"--max-repeats gpqa_diamond=2000: a plan has at most {MAX_REPEATS} repeats",
             f"--max-repeats gpqa_diamond={MAX_REPEATS}")


def test_gate_plan_refuses_one_repeat_past_the_most_for_every_benchmark(capsys):
    code, _, err = cli(capsys, gate_main, "plan", "--max-repeats", str(MAX_REPEATS + 1))
    assert code == 2
    one_line(err, "--max-repeats ", f"={MAX_REPEATS + 1}: a plan has at most {MAX_REPEATS} repeats")
