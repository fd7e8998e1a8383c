"""A newcomer's first hour: mistakes cost one line and nothing on disk, output a person can read,
and the words a user meets (README, every --help, manifests, the notebook, the page's code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evals.cli import evals_main, main as gate_main
from tests.conftest import quantize_cmd
from tests.evals.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
# "seed" is a random seed only: users do not know what "the seed" was (it is the Wafer write-up).
SEED_JARGON = re.compile(r"seed's|seed-style|-seed\.yaml|the seed\b(?! (?:of|for|per|in|is|that|used by|given))|"
                         r"seed (?:recipe|protocol|default|table|workload|outage)", re.IGNORECASE)


def help_texts() -> dict[str, str]:
    """Every command's and subcommand's --help, as a user sees it."""
    from evals.cli import build_evals_parser, build_parser
    from quant.cli import build_parser as quantize_parser

    texts = {"quantize": quantize_parser().format_help()}
    for prog, parser in (("gate", build_parser()), ("evals", build_evals_parser())):
        texts[prog] = parser.format_help()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        texts.update({f"{prog} {name}": p.format_help() for name, p in sub.choices.items()})
    return texts


def test_no_user_facing_text_says_the_seed():
    files = [REPO / "README.md", REPO / "docs" / "reference.md", REPO / "notebooks" / "dashboard.ipynb",
             *sorted((REPO / "manifests").rglob("*.yaml")), *sorted((REPO / "evals").glob("*.py")),
             *sorted((REPO / "quant").rglob("*.py"))]
    found = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1) if SEED_JARGON.search(line)]
    found += [f"{cmd} --help: {line.strip()}" for cmd, text in help_texts().items()
              for line in text.splitlines() if SEED_JARGON.search(line)]
    assert not found, "\n".join(found)
    assert SEED_JARGON.search("the seed's outage") and not SEED_JARGON.search("the seed of each repeat")


def test_every_evals_and_gate_subcommand_teaches_and_names_its_exit_codes():
    texts = help_texts()
    for cmd in ("evals run", "evals data", "evals import-tau2", "evals load", "gate accuracy", "gate checkpoint",
                "gate release", "gate kernels", "gate load"):
        assert cmd in texts, cmd
        assert "exit codes" in texts[cmd] or "exit codes" in texts[cmd.split()[0]], cmd
    for cmd in ("evals run", "evals data", "evals import-tau2"):
        assert "exit codes" in texts[cmd] and "example" in texts[cmd], cmd


def test_a_mistyped_model_folder_is_one_line_and_writes_nothing(tmp_path, capsys):
    code = evals_main(["run", "--benchmarks", "gsm8k", "--model", str(tmp_path / "ex" / "typo"),
                       "--out", str(tmp_path / "runs" / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "typo: no such folder" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_no_server_at_the_root_url_fails_before_building_anything(tmp_path, capsys):
    root = f"http://127.0.0.1:{free_port()}"
    code = evals_main(["run", "--benchmarks", "gsm8k", "--model", "m", "--base-url", root,
                       "--out", str(tmp_path / "runs" / "x")])
    err = capsys.readouterr().err
    assert code == 3 and f"{root}/v1/models did not answer" in err and "nothing was written" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("given, api, expect", [
    ("http://h:1", "completions", "http://h:1/v1/completions"),
    ("http://h:1/", "chat", "http://h:1/v1/chat/completions"),
    ("http://h:1/v1", "completions", "http://h:1/v1/completions"),
    ("http://h:1/v1/completions", "completions", "http://h:1/v1/completions"),
    ("http://h:1/v1/chat/completions", "chat", "http://h:1/v1/chat/completions"),
    ("http://h:1/v1/chat/completions", "completions", "is the /v1/chat/completions endpoint but --api is completions"),
])
def test_base_url_means_the_server_as_for_evals_load(given, api, expect):
    from evals._cli.evals_run import endpoint_url
    from evals.data import DataError

    if expect.startswith("http"):
        assert endpoint_url(given, api) == expect
    else:
        with pytest.raises(DataError, match=re.escape(expect)):
            endpoint_url(given, api)


def test_quantize_refuses_a_full_output_folder_before_printing_the_plan(glm_ckpt, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", str(glm_ckpt), str(dst)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "is not empty" in done.stderr and done.stdout == "", done.stdout
    assert (dst / "notes.txt").read_text() == "mine"


def test_a_reader_that_leaves_early_is_not_a_failure(glm_ckpt, tmp_path):
    """`quantize --dry-run --json | head`: the pipe's reader is gone before quantize writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run([*quantize_cmd(glm_ckpt, tmp_path / "dst"), "--dry-run", "--json"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    assert done.returncode == 0 and "Broken pipe" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_progress_reaches_100_percent_and_sizes_read_in_their_unit(glm_ckpt, tmp_path):
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", str(glm_ckpt), str(tmp_path / "dst")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    bars = [line for line in re.split(r"[\r\n]", done.stderr) if line.startswith("quantize")]
    assert bars and "100%" in bars[-1], bars[-3:]
    assert "0.000 GB" not in done.stdout and re.search(r"bytes +in [\d.]+ [km]?B -> out [\d.]+ [km]?B", done.stdout)


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (999, "999 B"), (1500, "1.5 kB"), (123_456_789, "123 MB"),
                                          (1.5e12, "1.5 TB"), (2.34e9, "2.34 GB")])
def test_sizes(nbytes, text):
    from quant.cli import size

    assert size(nbytes) == text


def test_gate_help_is_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as stop:
        gate_main(["--help"])
    assert stop.value.code == 0 and "exit codes" in capsys.readouterr().out


@pytest.mark.parametrize("missing, argv, extra", [
    ("lm_eval", ["evals", "run", "--benchmarks", "gsm8k", "--model", "{ckpt}", "--out", "{tmp}/o"], "evals"),
    ("tau2", ["evals", "import-tau2", "{tmp}/airline.json", "--out", "{tmp}/o"], "tau2"),
])
def test_a_job_whose_extra_is_missing_names_the_extra(glm_ckpt, tmp_path, missing, argv, extra):
    """As on a core install (`pip install quantgate`): the module is made unimportable in a fresh interpreter."""
    argv = [a.format(ckpt=glm_ckpt, tmp=tmp_path) for a in argv]
    (tmp_path / "airline.json").write_text("{}")
    entry = "evals_main" if argv[0] == "evals" else "main"
    code = (f"import sys; sys.modules[{missing!r}] = None; from evals.cli import {entry}; "
            f"sys.exit({entry}({argv[1:]!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and f"pip install 'quantgate[{extra}]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def readme_commands() -> list[str]:
    """Every `quantize` / `gate` / `evals` command in the README's bash blocks, continuations joined."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line):
                part = part.strip()
                if re.match(r"(quantize|gate|evals) ", part):
                    commands.append(part)
    return commands


def test_every_readme_command_parses_with_the_flags_its_help_lists():
    """README and --help cannot drift apart: each command in the README is parsed by the real parser."""
    import shlex

    from evals.cli import build_evals_parser, build_parser
    from quant.cli import build_parser as quantize_parser

    parsers = {"quantize": quantize_parser, "gate": build_parser, "evals": build_evals_parser}
    commands, refused = readme_commands(), []
    assert len(commands) >= 15, commands
    for command in commands:
        words = shlex.split(command, comments=True)
        try:
            parsers[words[0]]().parse_args(words[1:])
        except SystemExit as stop:
            if stop.code:
                refused.append(command)
    assert not refused, "README commands the CLI refuses:\n" + "\n".join(refused)


def test_gate_checkpoint_says_when_nothing_is_quantized(glm_ckpt, capsys):
    assert gate_main(["checkpoint", str(glm_ckpt), "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "nothing here is quantized" in out and "verdict: loads correctly" in out


def test_the_readme_example_commands_run_verbatim(tmp_path):
    """The README's commands on the built-in example that need no evaluation run (minutes of CPU) are
    run as written, in a folder laid out like a clone (its `tests/` tables for gate kernels)."""
    (tmp_path / "tests").symlink_to(REPO / "tests")
    runnable = [c for c in readme_commands() if re.search(r"(--example ex\b|\bex/(bf16|mxfp4) )", c)
                and not c.startswith(("evals", "gate release", "gate accuracy"))]
    assert [c.split()[0] for c in runnable] == ["gate", "quantize", "quantize"], runnable
    order = sorted(runnable, key=lambda c: (not c.startswith("quantize --to mxfp4"), c.startswith("gate")))
    for command in order:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
    assert (tmp_path / "ex" / "fp8" / "config.json").is_file() and (tmp_path / "ex" / "mxfp4" / "config.json").is_file()
