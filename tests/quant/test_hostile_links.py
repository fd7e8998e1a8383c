"""Hostile inputs, second campaign, for ``quantize`` and ``gate checkpoint``: links where quantgate
writes, links and special files where it reads, numbers no header may hold, configs that declare
far more than the files hold, Ctrl-C under workers, a source cut short mid-conversion.

Every case is real (symlinks, FIFOs, /dev/zero, processes and signals) and ends with the same
check: every file outside SRC and DST (``outside``: a 0600 secret, a victim file) is byte-for-byte
what it was. Each refusal is one line naming the path, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from quant.outputs import INDEX_NAME, LOCK_NAME, PROGRESS_NAME, atomic_file, write_atomic
from quant.safetensors_io import PARTIAL_SUFFIX, ShardError, ShardWriter, read_header
from quant.safe_files import check_source_file
from tests.conftest import default_sigint, quantize_cmd
from tests.quant.test_hostile import SHARD1, edit_json, gate, mxfp4_ckpt, one_line_error, quantize, rewrite_header, src  # noqa: F401
from tests.quant.test_scale import same_checkpoint

SECRET = b"API_KEY=do-not-publish\n"
VICTIM = b"a file of someone else's, never to be written\n"


@pytest.fixture
def outside(tmp_path):
    """A folder outside SRC and DST: its files must be unchanged after every case."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret").write_bytes(SECRET)
    (folder / "secret").chmod(0o600)
    (folder / "victim").write_bytes(VICTIM)
    before = _tree(folder)
    yield folder
    assert _tree(folder) == before, "a file outside SRC/DST changed"


def _tree(folder: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.lstat().st_mode))
            for p in sorted(folder.iterdir())}


# ---- writes never follow a link ------------------------------------------------------------------

@pytest.mark.parametrize("to, resume", [("mxfp4", False), ("mxfp4", True), ("bf16", False)])
def test_lock_file_that_is_a_link_is_refused_and_its_target_untouched(to, resume, glm_ckpt, mxfp4_ckpt, outside,
                                                                     tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / LOCK_NAME).symlink_to(outside / "victim")
    code, err = quantize(capsys, mxfp4_ckpt if to == "bf16" else glm_ckpt, dst, *(["--resume"] if resume else []),
                         to=to)
    assert code == 2
    one_line_error(err, str(dst / LOCK_NAME), "symbolic link", "remove the link")


def test_lock_file_that_is_a_fifo_is_refused_without_hanging(glm_ckpt, outside, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    os.mkfifo(dst / LOCK_NAME)
    out = subprocess.run(quantize_cmd(glm_ckpt, dst), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    one_line_error(out.stderr, str(dst / LOCK_NAME), "not a regular file")


@pytest.mark.parametrize("planted", ["config.json", INDEX_NAME, "tokenizer_config.json", SHARD1,
                                     SHARD1 + PARTIAL_SUFFIX, PROGRESS_NAME])
def test_resume_refuses_a_link_planted_in_the_output_folder(planted, glm_ckpt, outside, tmp_path, capsys):
    """An interrupted run's DST, with a link planted under a name the run writes: refused before
    any write (the link named), the target untouched."""
    dst = tmp_path / "dst"
    _interrupted_run(glm_ckpt, dst)
    (dst / planted).unlink(missing_ok=True)
    (dst / planted).symlink_to(outside / "victim")
    code, err = quantize(capsys, glm_ckpt, dst, "--resume")
    assert code == 2
    one_line_error(err, str(dst / planted), "symbolic link")


def _interrupted_run(src: Path, dst: Path) -> None:
    """DST as a run killed (SIGKILL) right after it recorded its progress file leaves it."""
    proc = subprocess.Popen(quantize_cmd(src, dst), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (dst / PROGRESS_NAME).exists():
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    assert (dst / PROGRESS_NAME).exists() and not (dst / "conversion_manifest.json").exists()


def test_partial_and_final_names_planted_as_links(outside, tmp_path):
    """The shared writer: a stale ``.partial`` that is a link is removed, never written through; a
    final name that is a link is refused naming it; a partial planted after the removal fails the
    exclusive create rather than being followed."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "report.json.partial").symlink_to(outside / "victim")
    write_atomic(folder / "report.json", "{}")
    assert (folder / "report.json").read_text() == "{}" and not (folder / "report.json.partial").exists()
    (folder / "link.json").symlink_to(outside / "victim")
    with pytest.raises(Exception, match="link.json: a symbolic link where quantgate writes"):
        write_atomic(folder / "link.json", "{}")
    (folder / "s.safetensors.partial").symlink_to(outside / "victim")
    writer = ShardWriter(folder / "s.safetensors", [("t", "U8", (4,))])
    writer.write("t", 0, b"abcd")
    writer.commit()
    with safe_open(str(folder / "s.safetensors"), "pt") as f:
        assert f.get_tensor("t").tolist() == list(b"abcd")
    with atomic_file(folder / "again.json", 0o640) as f:  # a copy's partial gets exactly its source's mode
        f.write(b"ok")
    assert stat.S_IMODE((folder / "again.json").stat().st_mode) == 0o640
    old = os.umask(0o077)  # any other file: 0644 less the user's umask, never looser
    try:
        write_atomic(folder / "private.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((folder / "private.json").stat().st_mode) == 0o600


# ---- reads: links leaving SRC, special files, sizes --------------------------------------------

@pytest.mark.parametrize("target", ["secret", "environ", "fifo"])
def test_auxiliary_file_linking_out_of_the_source_or_to_a_special_file_is_refused(target, src, outside, tmp_path,
                                                                                  capsys):
    link = src / "notes.txt"
    if target == "fifo":
        os.mkfifo(src / "pipe")
        link.symlink_to(src / "pipe")
    else:
        link.symlink_to(outside / "secret" if target == "secret" else Path("/proc/self/environ"))
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(link), "symbolic link to", "not a regular file" if target == "fifo" else "outside")
    leaked = [p for p in (tmp_path / "dst").rglob("*") if p.is_file() and SECRET in p.read_bytes()] \
        if (tmp_path / "dst").exists() else []
    assert not leaked


def test_auxiliary_files_inside_the_source_are_copied_with_their_permissions(src, outside, tmp_path, capsys):
    (src / "private_notes.txt").write_bytes(SECRET)
    (src / "private_notes.txt").chmod(0o600)
    (src / "tokenizer_alias.json").symlink_to("tokenizer_config.json")  # a link that stays inside: fine
    os.mkfifo(src / "a_pipe")  # a FIFO is not a file to copy: skipped, not waited on
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 0, err
    copied = tmp_path / "dst" / "private_notes.txt"
    assert copied.read_bytes() == SECRET and stat.S_IMODE(copied.stat().st_mode) == 0o600
    alias = tmp_path / "dst" / "tokenizer_alias.json"
    assert not alias.is_symlink() and alias.read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert not (tmp_path / "dst" / "a_pipe").exists()


@pytest.mark.parametrize("command", ["quantize", "gate"])
def test_shard_linking_out_of_the_source_is_refused(command, src, outside, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"  # outside SRC too, checked on its own
    elsewhere.mkdir()
    shutil.move(src / SHARD1, elsewhere / SHARD1)
    (src / SHARD1).symlink_to(elsewhere / SHARD1)
    before = hashlib.sha256((elsewhere / SHARD1).read_bytes()).hexdigest()
    if command == "gate":
        code, _, err = gate(capsys, src)
    else:
        code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(src / SHARD1), "outside the checkpoint folder")
    assert hashlib.sha256((elsewhere / SHARD1).read_bytes()).hexdigest() == before


def test_hugging_face_cache_snapshot_links_into_its_blobs_are_read(glm_ckpt, outside, tmp_path, capsys):
    """The hub cache keeps every file as snapshots/<rev>/<name> -> ../../blobs/<sha>: not a link
    leaving the checkpoint, so converted as usual."""
    repo = tmp_path / "models--org--glm"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for p in glm_ckpt.iterdir():
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copy(p, blobs / digest)
        (snapshot / p.name).symlink_to(Path("../../blobs") / digest)
    assert check_source_file(snapshot, SHARD1) == snapshot / SHARD1
    code, err = quantize(capsys, snapshot, tmp_path / "dst")
    assert code == 0, err
    code, out, _ = gate(capsys, tmp_path / "dst")
    assert code == 0, out


SPECIAL = {"fifo": lambda p: os.mkfifo(p), "dev-zero": lambda p: p.symlink_to("/dev/zero"),
           "dev-urandom": lambda p: p.symlink_to("/dev/urandom")}


def gate_cmd(*args) -> list[str]:
    """``gate`` as its own process (a FIFO must not hang it)."""
    return [sys.executable, "-c", "import sys; from evals.cli import main; sys.exit(main(sys.argv[1:]))",
            *map(str, args)]


@pytest.mark.parametrize("special", SPECIAL)
@pytest.mark.parametrize("file", ["config.json", INDEX_NAME])
def test_config_or_index_as_a_special_file_is_refused_without_hanging(file, special, src, outside, tmp_path):
    (src / file).unlink()
    SPECIAL[special](src / file)
    for command in (quantize_cmd(src, tmp_path / "dst"), gate_cmd("checkpoint", src)):
        out = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        one_line_error(out.stderr, str(src / file), "not a regular file" if special == "fifo" else "outside")


@pytest.mark.parametrize("special", SPECIAL)
def test_progress_file_as_a_special_file_is_refused_on_resume(special, glm_ckpt, outside, tmp_path):
    dst = tmp_path / "dst"
    _interrupted_run(glm_ckpt, dst)
    (dst / PROGRESS_NAME).unlink()
    if special == "fifo":
        os.mkfifo(dst / PROGRESS_NAME)
    else:
        (dst / PROGRESS_NAME).symlink_to("/dev/zero")
    out = subprocess.run(quantize_cmd(glm_ckpt, dst, "--resume"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    one_line_error(out.stderr, str(dst / PROGRESS_NAME))


JSON_BOMBS = {
    "deep nesting": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "5000-digit integer": b'{"num_hidden_layers": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("bomb", JSON_BOMBS)
@pytest.mark.parametrize("file", ["config.json", INDEX_NAME, PROGRESS_NAME])
def test_json_bombs_are_one_line_exit_2(file, bomb, glm_ckpt, src, outside, tmp_path, capsys):
    if file == PROGRESS_NAME:
        dst = tmp_path / "dst"
        _interrupted_run(glm_ckpt, dst)
        (dst / file).write_bytes(JSON_BOMBS[bomb])
        code, err = quantize(capsys, glm_ckpt, dst, "--resume")
        assert code == 2
        one_line_error(err, str(dst / file))
        return
    (src / file).write_bytes(JSON_BOMBS[bomb])
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(src / file), "nested too deeply" if bomb == "deep nesting" else "5000 digits")
    code, _, err = gate(capsys, src)
    assert code == 2 and str(src / file) in err


# ---- header numbers: what safetensors accepts, exactly -----------------------------------------

def _write_raw_shard(path: Path, header_text: str, data: bytes = b"") -> None:
    body = header_text.encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


T = '"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
HEADERS = {
    "shape 2**64 x 0": '{"t":{"dtype":"U8","shape":[18446744073709551616,0],"data_offsets":[0,0]}}',
    "shape 2**64-1 x 0": '{"t":{"dtype":"U8","shape":[18446744073709551615,0],"data_offsets":[0,0]}}',
    "elements overflow usize": '{"t":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}',
    "bytes overflow usize": '{"t":{"dtype":"BF16","shape":[9223372036854775808],"data_offsets":[0,0]}}',
    "offset 2**64": '{"t":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551616,18446744073709551616]}}',
    "5000-digit dim": '{"t":{"dtype":"U8","shape":[' + "9" * 5000 + '],"data_offsets":[0,2]}}',
    "float dim": '{"t":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}',
    "duplicate tensor, last wins and fits": "{" + T.replace("[2]", "[9]").replace("[0,2]", "[0,9]") + "," + T + "}",
    "duplicate tensor, last wins and leaves a gap": "{" + T + "," + T.replace("[2]", "[1]").replace("[0,2]", "[0,1]")
                                                    + "}",
    "duplicate __metadata__": '{"__metadata__":{"a":"b"},"__metadata__":{"c":"d"},' + T + "}",
    "duplicate metadata key": '{"__metadata__":{"a":"b","a":"c"},' + T + "}",
    "duplicate dtype field": '{"t":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}',
    "duplicate unknown field": '{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1,"x":2}}',
    "__metadata__ 0": '{"__metadata__":0,' + T + "}",
    "__metadata__ a list": '{"__metadata__":[],' + T + "}",
    "__metadata__ a string": '{"__metadata__":"x",' + T + "}",
    "__metadata__ null": '{"__metadata__":null,' + T + "}",
    "__metadata__ number value": '{"__metadata__":{"a":1},' + T + "}",
    "__metadata__ null value": '{"__metadata__":{"a":null},' + T + "}",
    "__metadata__ strings": '{"__metadata__":{"a":"b"},' + T + "}",
}


@pytest.mark.parametrize("case", HEADERS)
def test_headers_are_accepted_exactly_when_the_safetensors_library_accepts_them(case, tmp_path):
    path = tmp_path / "x.safetensors"
    _write_raw_shard(path, HEADERS[case], b"xy")
    try:
        with safe_open(str(path), "pt") as f:
            library = ("ok", sorted(f.keys()), f.metadata())
    except Exception:  # noqa: BLE001  (the library's own refusal, whatever its type)
        library = ("refused",)
    if library[0] == "ok":
        library = ("ok", library[1], library[2] or {})  # the library says None for no or null metadata
    try:
        header = read_header(path)
        ours = ("ok", sorted(header.tensors), dict(header.metadata))
    except ShardError as exc:
        ours = ("refused",)
        assert str(path) in str(exc) and len(str(exc)) < 400  # one line naming the file, not the 5000 digits
    assert ours == library


@pytest.mark.parametrize("dim", [str(2**64), "9" * 5000])
def test_header_numbers_beyond_usize_are_refused_by_quantize_and_gate(dim, src, outside, tmp_path, capsys):
    """Before: [2**64, 0] was converted (exit 0) into a header safetensors refuses; 5000 digits was
    a ValueError traceback. A zero-size tensor at offset 0 leaves every other tensor as it was."""
    placeholder = 7777777

    def add_empty(header):
        header["model.layers.0.extra.weight"] = {"dtype": "BF16", "shape": [0, placeholder], "data_offsets": [0, 0]}
        return header

    rewrite_header(src / SHARD1, add_empty)
    raw = (src / SHARD1).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    body = raw[8:8 + n].replace(str(placeholder).encode(), dim.encode())
    (src / SHARD1).write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(src / SHARD1))
    assert len(err) < 1000  # the number is not echoed back in full
    assert not (tmp_path / "dst").exists()
    code, _, err = gate(capsys, src)
    assert code == 2 and str(src / SHARD1) in err and "Traceback" not in err


# ---- a config that declares far more than the files hold ----------------------------------------

def _limited(megabytes: int):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))
    return limit


@pytest.mark.parametrize("key", ["num_hidden_layers", "n_routed_experts"])
def test_a_billion_declared_layers_or_experts_take_constant_memory(key, mxfp4_ckpt, glm_ckpt, outside, tmp_path):
    """Before: ``gate checkpoint`` grew to 21.6 GB and the OOM killer took the machine. Now both
    commands finish under a 3 GB address-space limit, in seconds, refusing the config in one line:
    a count beyond what the shards can hold is not this checkpoint's."""
    for name, folder in (("gate", mxfp4_ckpt), ("quantize", glm_ckpt)):
        src = Path(shutil.copytree(folder, tmp_path / name))
        edit_json(src / "config.json", lambda c: c.update({key: 10**9}))
        command = (quantize_cmd(src, tmp_path / f"{name}-out", "--dry-run") if name == "quantize" else
                   gate_cmd("checkpoint", src))
        started = time.monotonic()
        out = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=_limited(3072))
        assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr, out.stderr
        assert out.returncode == 2, (out.returncode, out.stderr)
        one_line_error(out.stderr, str(src / "config.json"), f"{key} is {10**9}", "restore config.json")
        assert time.monotonic() - started < 120


# ---- Ctrl-C under workers; a source cut short mid-conversion -------------------------------------

def test_ctrl_c_with_two_workers_is_one_line_exit_130_and_resumes_identically(multi_shard_ckpt, multi_shard_reference,
                                                                             outside, tmp_path):
    """Ctrl-C reaches the whole process group (the terminal sends it so): the parent and both
    workers. One line, exit 130, no partial file, no worker traceback; --resume finishes to the
    same bytes as an uninterrupted run."""
    dst = tmp_path / "out"
    proc = subprocess.Popen(quantize_cmd(multi_shard_ckpt, dst, "--workers", "2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list(dst.glob("*.safetensors.partial"))) >= 1 and _recorded(dst):
            break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert len(err.strip().splitlines()) == 1 and "rerun with --resume" in err
    assert not list(dst.glob("*" + PARTIAL_SUFFIX))
    subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume", "--workers", "2"), check=True, capture_output=True)
    same_checkpoint(dst, multi_shard_reference)


def test_ctrl_c_stops_at_a_chunk_boundary_not_where_the_signal_lands(multi_shard_ckpt, tmp_path, monkeypatch):
    """The handler only marks the interrupt; the conversion raises at its next chunk. Raised where
    the signal landed (once inside ShardWriter.write's queue hand-off, under load), the interrupt
    lost a wake-up and a worker hung joining its writer thread (1 run in 6 of the test above on a
    loaded machine). Here Ctrl-C comes in the middle of a chunk's progress report, in this process
    (--workers 1): the report finishes, the next chunk raises, nothing partial is left, no helper
    thread survives and the previous SIGINT handler is back."""
    from quant import convert as convert_module
    from quant.plan import make_plan
    from quant.recipe import load_recipe

    after_signal, real = [], convert_module.convert_shard

    def interrupted_once(job, advance):
        def report(nbytes):
            if not after_signal:
                os.kill(os.getpid(), signal.SIGINT)
                after_signal.append(nbytes)  # reached only if the signal did not raise here
            advance(nbytes)
        return real(job, report)

    monkeypatch.setattr(convert_module, "convert_shard", interrupted_once)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            convert_module.convert(make_plan(multi_shard_ckpt, load_recipe()), tmp_path / "out", workers=1,
                                   show_progress=False)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert after_signal, "the signal raised where it landed"
    assert not list((tmp_path / "out").glob("*" + PARTIAL_SUFFIX))
    assert not [t.name for t in threading.enumerate() if t.name in ("shard-writer", "sha256-output")]


def _recorded(dst: Path) -> bool:
    try:
        return bool(json.loads((dst / PROGRESS_NAME).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return False


def test_source_shard_truncated_mid_conversion_is_one_line_never_sigbus(multi_shard_ckpt, outside, tmp_path):
    """The shard being read is truncated (to half) while the converter is frozen mid-shard. It then
    continues: the truncation waits on its read lease until it has stopped touching the mapping,
    so no SIGBUS; one line naming the shard, no partial left; restored, --resume finishes."""
    from tests.conftest import interrupt_midway

    src = Path(shutil.copytree(multi_shard_ckpt, tmp_path / "src"))
    dst = tmp_path / "out"
    cut, threads = [], []

    def truncate_in_flight():  # runs while the converter is frozen
        partial = next(dst.glob("*" + PARTIAL_SUFFIX))
        cut.append(src / partial.name.removesuffix(PARTIAL_SUFFIX))
        threads.append(threading.Thread(target=os.truncate, args=(cut[0], cut[0].stat().st_size // 2)))
        threads[0].start()

    code, err = interrupt_midway(src, dst, signal.SIGSTOP, on_stop=truncate_in_flight)
    threads[0].join(timeout=120)
    assert code != -signal.SIGBUS and "Traceback" not in err, (code, err)
    assert code == 2, err
    one_line_error(err, str(cut[0]), "--resume")
    assert not list(dst.glob("*" + PARTIAL_SUFFIX))
    shutil.copy(multi_shard_ckpt / cut[0].name, cut[0])  # restored
    subprocess.run(quantize_cmd(src, dst, "--resume"), check=True, capture_output=True)
    fresh = tmp_path / "fresh"
    subprocess.run(quantize_cmd(src, fresh), check=True, capture_output=True)
    same_checkpoint(dst, fresh)
