"""Hostile inputs, third campaign, for ``evals run``'s own inputs and output folder: code and
rescoring planted in ``OUT/tasks``, paths that YAML
or datasets would read as syntax, two runs into one folder, degenerate flags, ``--resume`` into
another model's finished bundle, and the served checkpoint's identity.

Real ``evals run`` (processes where a planted hook could run or a lock is held), real lm-eval, real
HTTP servers on 127.0.0.1, real files, links and FIFOs; files outside the output folders are
hashed before and after (``outside``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from evals.bundle import read_bundle
from evals.cli import evals_main, main as gate_main
from tests.conftest import default_sigint
from tests.evals.test_gate import gsm8k_policy
from tests.evals.test_hostile_evals import CLI, as_process, hostile, one_line, outside  # noqa: F401  (fixtures)
from tests.evals.test_run import ScriptedModel

GEN = ["--max-gen-toks", "8"]


class Recorder(ScriptedModel):
    """The scripted completions endpoint (any model name: it lists none), keeping every prompt it is sent."""

    prompts: list[str] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        type(self).prompts += prompts
        from tests.evals.conftest import send_json

        send_json(self, {"id": "x", "object": "text_completion", "model": body["model"], "choices": [
            {"index": i, "text": " #### 7", "finish_reason": "stop"} for i in range(len(prompts))]})


@pytest.fixture
def recorder():
    Recorder.prompts, Recorder.max_model_len = [], None
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/completions"
    server.shutdown()


def gsm8k_rows(folder: Path, tag: str) -> Path:
    """GSM8K-format files whose every question names ``tag``: which folder a prompt came from is in its text."""
    folder.mkdir(parents=True)
    for name, n in (("train.jsonl", 8), ("test.jsonl", 3)):
        rows = [{"question": f"[{tag}] {name} {i}: 2 + {i} = ?", "answer": f"2 + {i}\n#### {2 + i}"} for i in range(n)]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def imported(data_dir: Path, tag: str) -> Path:
    """``data_dir`` prepared by the real ``evals data`` from GSM8K-format files tagged ``tag``."""
    source = gsm8k_rows(data_dir.parent / f"source-{abs(hash(str(data_dir)))}", tag)
    assert evals_main(["data", "--data-dir", str(data_dir), "--gsm8k", str(source)]) == 0
    return data_dir


def run(*args) -> int:
    return evals_main(["run", *map(str, args)])


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's sha256, a link's target, a folder as such."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = (f"link:{os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir()
                    else hashlib.sha256(path.read_bytes()).hexdigest())
    return out


# ---- OUT/tasks is this run's alone; nothing planted there is read or run -------------

PLANTED_HOOK = """\
task: quantgate_gsm8k
include: gsm8k.yaml
process_docs: !function hook.docs
"""


def plant_hook(tasks: Path, outside: Path) -> None:
    tasks.mkdir(parents=True)
    (tasks / "00.yaml").write_text(PLANTED_HOOK)
    (tasks / "hook.py").write_text(f"open({str(outside / 'ran')!r}, 'w').write('ran')\n"
                                   "def docs(dataset):\n    return dataset\n")


def test_a_planted_task_and_hook_never_run(hostile, outside, tmp_path):
    """Before: lm-eval indexed every YAML under OUT/tasks, so this hook ran inside `evals run` (exit 0)."""
    root, handler, _ = hostile
    args = ["run", "--benchmarks", "gsm8k", "--limit", "2", "--base-url", f"{root}/v1/completions", "--model", "m"]
    fresh = tmp_path / "fresh"
    plant_hook(fresh / "tasks", outside)
    out = as_process("evals_main", *args, "--out", fresh, timeout=600)
    assert out.returncode == 2, out.stderr
    one_line(out.stderr, str(fresh / "tasks"), "already there", "creates for the run")
    resumed = tmp_path / "resumed"  # an interrupted run's folder, resumed: the planted entries are named
    (resumed / "units").mkdir(parents=True)
    plant_hook(resumed / "tasks", outside)
    out = as_process("evals_main", *args, "--out", resumed, "--resume", timeout=600)
    assert out.returncode == 2, out.stderr
    one_line(out.stderr, str(resumed / "tasks"), "'00.yaml'", "never writes")
    assert not (outside / "ran").exists() and not (fresh / "run.json").exists() and not (resumed / "run.json").exists()
    assert (resumed / "tasks" / "hook.py").is_file()  # refused, not cleaned up: nothing of the user's is removed


RESCORE = {"metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                            "regexes_to_ignore": [".*"]}]}  # every answer and target scrubbed to "": all right


def test_a_planted_rescoring_task_never_rescores_and_a_rescored_run_is_not_comparable(hostile, outside, tmp_path,
                                                                                    capsys):
    root, handler, _ = hostile
    args = ["--benchmarks", "gsm8k", "--limit", 4, "--base-url", f"{root}/v1/completions", "--model", "m"]
    assert run("--out", tmp_path / "honest", *args) == 0
    honest, honest_rows = read_bundle(tmp_path / "honest")
    assert honest["scores"]["gsm8k"]["score"] < 1.0  # so a rescoring that marks every answer right would show
    interrupted = tmp_path / "interrupted"
    (interrupted / "units").mkdir(parents=True)
    (interrupted / "tasks").mkdir()
    shipped = yaml.safe_load((tmp_path / "honest" / "tasks" / "gsm8k.yaml").read_text())
    (interrupted / "tasks" / "gsm8k.yaml").write_text(yaml.safe_dump({**shipped, **RESCORE}))
    (interrupted / "tasks" / "gsm8k.yaml.partial").symlink_to(outside / "victim")
    assert run("--out", interrupted, *args, "--resume") == 0
    resumed, rows = read_bundle(interrupted)
    assert resumed["scores"]["gsm8k"] == honest["scores"]["gsm8k"]
    assert sorted((r["item_id"], r["filter"], r["score"]) for r in rows) == \
        sorted((r["item_id"], r["filter"], r["score"]) for r in honest_rows)
    written = (interrupted / "tasks" / "gsm8k.yaml").read_bytes()
    assert resumed["benchmarks"]["gsm8k"]["task_yaml"] == {
        "file": "tasks/gsm8k.yaml", "sha256": hashlib.sha256(written).hexdigest()}
    assert "regexes_to_ignore: ['.*']" not in written.decode() and os.listdir(interrupted / "tasks") == ["gsm8k.yaml"]
    # the same task on the same data compares equal wherever the data lives; another scoring does not
    settings = resumed["benchmarks"]["gsm8k"]["settings"]
    assert settings["task_sha256"] == honest["benchmarks"]["gsm8k"]["settings"]["task_sha256"]
    policy = gsm8k_policy(tmp_path / "policy.yaml")
    run_json = interrupted / "run.json"
    forged = json.loads(run_json.read_text())
    forged["benchmarks"]["gsm8k"]["settings"]["task_sha256"] = hashlib.sha256(b"rescored").hexdigest()
    run_json.write_text(json.dumps(forged))
    capsys.readouterr()
    code = gate_main(["accuracy", "--candidate", str(interrupted), "--reference", str(tmp_path / "honest"),
                      "--policy", str(policy)])
    err = capsys.readouterr().err
    assert code == 2 and "not comparable" in err and "gsm8k: task_sha256: reference" in err, err
    assert [line for line in err.splitlines() if line.startswith("  gsm8k:")] == [
        line for line in err.splitlines() if "task_sha256" in line]  # the one difference named


# ---- a path is data, never YAML or glob syntax ---------------------------------------

PATHS = {"double quote": 'd"q', "backslash": "dd\\tx", "newline": "new\nline", "unicode": "dätä-数据-€",
         "glob brackets": "br[a]ck", "chained-hop colons": "co::lon", "yaml syntax": "x: {y: [z]} # c"}


@pytest.mark.parametrize("case", PATHS)
def test_any_data_dir_path_means_itself(case, recorder, outside, tmp_path):
    name = PATHS[case]
    data = imported(tmp_path / name, tag="the intended folder")
    if case == "backslash":  # the folder a backslash-t pasted into YAML text became: never read
        imported(tmp_path / "dd\tx", tag="the decoy folder")
    assert run("--benchmarks", "gsm8k", "--out", tmp_path / "out", "--data-dir", data, "--model", "scripted",
               "--base-url", recorder, "--limit", 3, *GEN) == 0
    run_json, rows = read_bundle(tmp_path / "out")
    manifest = json.loads((data / "manifest.json").read_text())
    assert run_json["benchmarks"]["gsm8k"]["dataset"]["files"] == manifest["gsm8k"]["files"]
    assert len(Recorder.prompts) == 3 and all("[the intended folder] test.jsonl" in p for p in Recorder.prompts)
    assert not any("decoy" in p for p in Recorder.prompts) and len({r["item_id"] for r in rows}) == 3
    task = yaml.safe_load((tmp_path / "out" / "tasks" / "gsm8k.yaml").read_text())
    assert all(re.fullmatch(r"/proc/self/fd/\d+", p) for p in task["dataset_kwargs"]["data_files"].values())


def test_task_sha256_does_not_depend_on_where_the_data_lives(recorder, tmp_path):
    """The same files in two folders: equal task_sha256 (the gate pairs them); task_yaml differs only if the descriptors do."""
    one, two = imported(tmp_path / "one", "same"), tmp_path / "two"
    two.mkdir()
    for sub in ("gsm8k",):
        (two / sub).mkdir()
        for f in (one / sub).iterdir():
            (two / sub / f.name).write_bytes(f.read_bytes())
    (two / "manifest.json").write_bytes((one / "manifest.json").read_bytes())
    for data, out in ((one, "a"), (two, "b")):
        assert run("--benchmarks", "gsm8k", "--out", tmp_path / out, "--data-dir", data, "--model", "scripted",
                   "--base-url", recorder, "--limit", 2, *GEN) == 0
    a, b = (read_bundle(tmp_path / o)[0]["benchmarks"]["gsm8k"]["settings"] for o in ("a", "b"))
    assert a == b and len(a["task_sha256"]) == 64


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_a_data_file_swapped_for_a_special_file_is_refused_without_hanging(special, tmp_path, outside):
    """Before: the manifest check hashed the file by path, so a FIFO there hung `evals run`."""
    data = imported(tmp_path / "data", tag="x")
    test = data / "gsm8k" / "test.jsonl"
    test.unlink()
    os.mkfifo(test) if special == "fifo" else test.symlink_to("/dev/zero")
    model = tmp_path / "model"  # a local folder: the data is checked before any model is loaded
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")  # past the tokenizer check, which comes first
    out = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--data-dir", data, "--model", model,
                     "--out", tmp_path / "out", timeout=120)
    assert out.returncode == 2, out.stderr
    one_line(out.stderr, str(test), "not a regular file")
    assert not (tmp_path / "out").exists()


# ---- one writer per output folder ------------------------------------------------------

def test_a_second_evals_run_into_the_same_out_is_refused_naming_the_lock(hostile, outside, tmp_path):
    root, handler, _ = hostile
    handler.mode, handler.get_mode = "trickle", "ok"  # the first run waits on its first completion
    out = tmp_path / "run"
    args = ["run", "--benchmarks", "gsm8k", "--limit", "2", "--base-url", f"{root}/v1/completions", "--model", "m",
            "--out", str(out), "--request-timeout", "300"]
    first = subprocess.Popen([sys.executable, "-c", CLI.format("evals_main"), *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_sigint)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and handler.started < 3 and first.poll() is None:  # 2 GETs, then a completion
            time.sleep(0.1)
        assert first.poll() is None and (out / ".quantgate.lock").is_file()
        second = as_process("evals_main", *args, timeout=600)
        assert second.returncode == 2, second.stderr
        one_line(second.stderr, str(out / ".quantgate.lock"), f"another evals run (pid {first.pid})")
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130 and not (out / "run.json").exists()


# ---- degenerate flags are bad input, refused at once ----------------------

DEGENERATE = {
    "--limit 0": (["--limit", "0"], "--limit 0: give a whole number of at least 1"),
    "--limit -5": (["--limit", "-5"], "--limit -5: give a whole number of at least 1"),
    "--max-gen-toks 0": (["--max-gen-toks", "0"], "--max-gen-toks 0: give a whole number of at least 1"),
    "--concurrency 0": (["--concurrency", "0"], "--concurrency 0"),
    "--base-url without scheme": (["--base-url", "127.0.0.1:8000"], "e.g. http://127.0.0.1:8000"),
    "--base-url localhost:8000": (["--base-url", "localhost:8000/v1"], "e.g. http://localhost:8000/v1"),
    "--seeds 0,0": (["--seeds", "0,0"], "--seeds '0,0': a seed is repeated"),
    "--seeds -1": (["--seeds", "-1"], "from 0 to 4294967295"),
    "--request-timeout 0": (["--request-timeout", "0"], "--request-timeout 0.0: must be a positive finite number"),
    "--request-timeout -1": (["--request-timeout", "-1"], "must be a positive finite number"),
    "--request-timeout nan": (["--request-timeout", "nan"], "--request-timeout nan: must be a positive finite"),
    "--request-timeout inf": (["--request-timeout", "inf"], "must be a positive finite number"),
    "--tau2-trials 0": (["--tau2-trials", "0"], "--tau2-trials 0"),
    "--checkpoint without --base-url": (["--checkpoint", "."], "--checkpoint is for a served model"),
}


@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_flags_exit_2_at_once_in_one_line(case, tmp_path, capsys):
    flags, says = DEGENERATE[case]
    started = time.monotonic()
    code = run("--benchmarks", "gsm8k", "--model", "/no/such/model", "--out", tmp_path / "out", *flags)
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 5, err
    one_line(err, says)
    assert not (tmp_path / "out").exists()


def test_resume_into_a_finished_bundle_with_another_model_or_settings_keeps_it(recorder, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--benchmarks", "gsm8k", "--out", out, "--base-url", recorder, *GEN]
    assert run(*common, "--model", "model-a", "--limit", 2) == 0
    before = tree_hashes(out)
    sent = len(Recorder.prompts)
    for other, says in ((["--model", "model-b", "--limit", 2], "finished run of --model 'model-a', not 'model-b'"),
                        (["--model", "model-a", "--limit", 3], "unit gsm8k-r0 was measured with another settings limit"),
                        (["--model", "model-a", "--limit", 2, "--seeds", "1"], "settings seeds"),
                        (["--model", "model-a", "--limit", 2, "--max-gen-toks", 9], "settings max_gen_toks")):
        capsys.readouterr()
        assert run(*common[:-2], *other, "--resume") == 2
        err = capsys.readouterr().err
        one_line(err, str(out), says, "the bundle is kept")
        assert tree_hashes(out) == before and len(Recorder.prompts) == sent
    # the same run resumed keeps every unit (nothing is sent again) and rewrites the same bundle
    assert run(*common, "--model", "model-a", "--limit", 2, "--resume") == 0
    assert len(Recorder.prompts) == sent
    after = tree_hashes(out)
    assert sorted(after) == sorted(before) and after["samples.jsonl"] == before["samples.jsonl"]


# ---- the served checkpoint's identity, as evals run records it -------------------------------

def served_checkpoint(folder: Path, weights: bytes = b"weights") -> Path:
    """A folder as `quantize` writes it: a shard and the conversion_manifest.json that records its sha256."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    shard = {"file": "model.safetensors", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}
    (folder / "conversion_manifest.json").write_text(json.dumps({"format": "mxfp4", "shards": [shard]}))
    return folder


def test_a_server_run_records_the_served_checkpoints_identity(recorder, tmp_path, capsys):
    from evals.checkpoint_identity import identity

    ckpt = served_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    common = ["--benchmarks", "gsm8k", "--base-url", recorder, "--model", "served", "--limit", 2, *GEN]
    assert run(*common, "--out", out, "--checkpoint", ckpt) == 0
    run_json = read_bundle(out)[0]
    assert run_json["checkpoint_sha256"] == identity(ckpt).sha256  # the local --model path's function
    assert run_json["checkpoint"] == str(ckpt)
    # resuming the finished bundle with another served checkpoint would mix two checkpoints: refused, kept
    other = served_checkpoint(tmp_path / "other", b"other weights")
    before = tree_hashes(out)
    capsys.readouterr()
    assert run(*common, "--out", out, "--checkpoint", other, "--resume") == 2
    one_line(capsys.readouterr().err, "checkpoint_sha256", "the bundle is kept")
    assert tree_hashes(out) == before


def test_checkpoint_flag_mistakes_are_one_line(recorder, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    fifo = served_checkpoint(tmp_path / "fifo")
    (fifo / "conversion_manifest.json").unlink()
    os.mkfifo(fifo / "conversion_manifest.json")
    common = ["--benchmarks", "gsm8k", "--base-url", recorder, "--model", "served", "--limit", 2, *GEN]
    for folder, says in ((tmp_path / "missing", "no such folder"), (plain, "no conversion_manifest.json"),
                         (fifo, "not a regular file")):
        capsys.readouterr()
        assert run(*common, "--out", tmp_path / "out", "--checkpoint", folder) == 2
        one_line(capsys.readouterr().err, str(folder), says)
        assert not (tmp_path / "out" / "run.json").exists()
