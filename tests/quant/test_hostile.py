"""Hostile inputs and concurrent writers: every case exits 2 (bad input, refused) or 1 (a real
failure) with one line naming the file and the fix, never a traceback; nothing outside DST is
written, the source is never changed, and nothing stale or half-written is kept.

Real files throughout; real processes where the case is about processes (signals, a second
writer, orphaned workers), a real tmpfs where the case is a full disk.
"""

from __future__ import annotations

import hashlib
import json
import os
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
import torch
from safetensors import safe_open

from evals.cli import main as gate_main
from quant.cli import main as quantize_main
from quant.example import tensor_shapes, tiny_config, write_checkpoint
from quant.outputs import INDEX_NAME, LOCK_NAME, MANIFEST_NAME, PROGRESS_NAME, DestinationLock
from quant.safetensors_io import PARTIAL_SUFFIX
from tests.conftest import quantize_cmd
from tests.quant.test_scale import same_checkpoint, small_disk  # noqa: F401  (fixture)

SHARD1 = "model-00001-of-00003.safetensors"
KEPT = "model.layers.0.self_attn.q_a_proj.weight"  # bf16 in every recipe


def tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (paths relative to it)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def quantize(capsys, *args, to: str = "mxfp4") -> tuple[int, str]:
    code = quantize_main(["--to", to, "-q", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def gate(capsys, folder: Path, *args) -> tuple[int, str, str]:
    code = gate_main(["checkpoint", str(folder), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line or "failed:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def src(glm_ckpt, tmp_path) -> Path:
    """A private copy of the tiny GLM-5 checkpoint, free to damage."""
    return Path(shutil.copytree(glm_ckpt, tmp_path / "src"))


@pytest.fixture(scope="module")
def mxfp4_ckpt(glm_ckpt, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("hostile_mxfp4") / "out"
    subprocess.run(quantize_cmd(glm_ckpt, dst), check=True, capture_output=True)
    return dst


def edit_json(path: Path, change) -> None:
    """Apply ``change`` (which edits in place) to a JSON file."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rewrite_header(path: Path, change, extra: bytes = b"") -> None:
    """Replace a shard's JSON header by ``change(header)``, keeping its data (plus ``extra`` bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = change(header)
    if header is None:
        raise AssertionError("change() must return the header")
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:] + extra)


# ---- 1. shard names from the index are plain file names inside the folder ----------------------

@pytest.mark.parametrize("command", ["mxfp4", "bf16", "gate"])
@pytest.mark.parametrize("kind", ["parent", "absolute", "subfolder"])
def test_index_cannot_point_outside_the_folder(command, kind, glm_ckpt, mxfp4_ckpt, tmp_path, capsys):
    """An index entry naming ../victim/x, /abs/x or sub/x is refused before anything is read or
    written: the victim file and the source stay byte-identical, nothing appears outside DST."""
    src = Path(shutil.copytree(mxfp4_ckpt if command == "bf16" else glm_ckpt, tmp_path / "src"))
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.copy(src / SHARD1, victim / SHARD1)
    (src / "sub").mkdir()
    shutil.copy(src / SHARD1, src / "sub" / SHARD1)
    name = {"parent": f"../victim/{SHARD1}", "absolute": str(victim / SHARD1), "subfolder": f"sub/{SHARD1}"}[kind]
    edit_json(src / INDEX_NAME, lambda index: index["weight_map"].update(
        {t: name for t, f in index["weight_map"].items() if f == SHARD1}))
    before = tree(tmp_path)
    if command == "gate":
        code, _, err = gate(capsys, src)
    else:
        code, err = quantize(capsys, src, tmp_path / "dst", to=command)
    assert code == 2
    one_line_error(err, INDEX_NAME, repr(name), "not a plain *.safetensors file name", "fix the index entry")
    assert tree(tmp_path) == before  # nothing read-and-replaced, nothing written anywhere
    assert not (tmp_path / "dst").exists()


# ---- 2. header offsets: what the safetensors library refuses, refused with shard and tensor ------

def _first(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _second(header: dict) -> str:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[1]


def _shift(header: dict, name: str, by: int) -> dict:
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + by, end + by]
    return header


def _last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


HEADER_CASES = {
    # case: (change, extra bytes appended, what the message must say, names the tensor)
    "negative offsets": (lambda h: _shift(h, _first(h), -64), b"", "not two ordered non-negative integers", True),
    "overlapping": (lambda h: _shift(h, _second(h), -2), b"", "overlaps the tensor before it", True),
    "gap": (lambda h: _shift(h, _last(h), 2), b"\0\0", "leaves a gap at byte", True),
    "trailing bytes": (lambda h: h, b"\0" * 8, "8 bytes after the last tensor", False),
    "string offsets": (lambda h: {**h, _first(h): {**h[_first(h)], "data_offsets": ["0", "8"]}}, b"",
                       "not two ordered non-negative integers", True),
    "no dtype": (lambda h: {**h, _first(h): {k: v for k, v in h[_first(h)].items() if k != "dtype"}}, b"",
                 "unsupported or missing dtype None", True),
    "negative shape": (lambda h: {**h, _first(h): {**h[_first(h)], "shape": [-1, 64]}}, b"",
                       "not a list of non-negative integers", True),
    "header a list": (lambda h: [1, 2], b"", "header is a JSON list, not an object", False),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_corrupt_header_is_refused_like_safetensors_does(case, src, tmp_path, capsys):
    change, extra, says, names_tensor = HEADER_CASES[case]
    shard = src / SHARD1
    tensor = _first(json.loads(shard.read_bytes()[8:8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]]))
    rewrite_header(shard, change, extra)
    with pytest.raises(Exception):  # the oracle: the library the engines load shards with refuses it too
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    before = tree(src)
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(shard), says)
    if names_tensor and case not in ("overlapping", "gap"):
        assert f"tensor {tensor}" in err
    assert tree(src) == before and not (tmp_path / "dst").exists()
    code, _, err = gate(capsys, src)
    assert code == 2 and str(shard) in err and says in err


# ---- 3. shards and tensors the index does not name ---------------------------------------------

def test_shard_the_index_does_not_list_is_refused_by_quantize_and_flagged_by_the_gate(src, mxfp4_ckpt, tmp_path,
                                                                                     capsys):
    shutil.copy(src / SHARD1, src / "model-extra.safetensors")
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, "model-extra.safetensors", f"not listed in {INDEX_NAME}", "move them out of the folder")
    assert not (tmp_path / "dst").exists()
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    shutil.copy(checked / SHARD1, checked / "model-extra.safetensors")
    code, out, _ = gate(capsys, checked)
    assert code == 1 and "model-extra.safetensors" in out and "lists no tensor" in out


def test_empty_weight_map_is_refused(src, tmp_path, capsys):
    edit_json(src / INDEX_NAME, lambda index: index.update(weight_map={}))
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, INDEX_NAME, "weight_map lists no tensor", "regenerate the index")
    assert gate(capsys, src)[0] == 2


def test_tensor_missing_from_the_index_is_converted_and_the_message_says_so(src, tmp_path, capsys):
    forgotten = "model.layers.1.mlp.experts.0.up_proj.weight"
    edit_json(src / INDEX_NAME, lambda index: index["weight_map"].pop(forgotten))
    code = quantize_main(["--to", "mxfp4", "-q", "--json", str(src), str(tmp_path / "dst")])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert any(forgotten in w and "converted by the recipe like the others and listed in the output index" in w
               for w in plan["warnings"])
    out_index = json.loads((tmp_path / "dst" / INDEX_NAME).read_text())["weight_map"]
    assert forgotten in out_index and forgotten + "_scale" in out_index  # really converted, really listed
    assert gate(capsys, tmp_path / "dst")[0] == 0


def test_gate_flags_layers_the_config_declares_but_the_checkpoint_lacks(mxfp4_ckpt, tmp_path, capsys):
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    edit_json(checked / "config.json", lambda c: c.update(num_hidden_layers=6))  # layers 4, 5 never written
    code, out, _ = gate(capsys, checked)
    assert code == 1 and "layers 4, 5 have no tensor" in out


def test_gate_flags_routed_experts_the_config_declares_but_the_checkpoint_lacks(mxfp4_ckpt, tmp_path, capsys):
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    edit_json(checked / "config.json", lambda c: c.update(n_routed_experts=6))  # 4 on disk
    code, out, _ = gate(capsys, checked)
    assert code == 1 and "declares 6 routed experts but experts 4, 5 have no tensor" in out
    assert "model.layers.1.mlp.experts" in out


def test_gate_never_passes_a_checkpoint_with_no_linear_module(tmp_path, capsys):
    from safetensors.torch import save_file

    folder = tmp_path / "norms"
    folder.mkdir()
    save_file({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    # one layer: a config declaring more layers than the shards hold tensors is refused outright (exit 2)
    (folder / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=1)))
    code, out, _ = gate(capsys, folder)
    assert code == 1 and "0 Linear modules checked" in out and "no Linear module" in out


# ---- 4. --resume proves every kept shard's source unchanged --------------------------------------

def test_resume_redoes_a_shard_whose_source_changed_even_with_mtime_restored(multi_shard_ckpt, tmp_path):
    from tests.conftest import interrupt_midway

    src = Path(shutil.copytree(multi_shard_ckpt, tmp_path / "src"))
    dst = tmp_path / "out"
    code, _ = interrupt_midway(src, dst, signal.SIGKILL)
    assert code == -signal.SIGKILL
    kept = sorted(json.loads((dst / PROGRESS_NAME).read_text())["shards"])
    assert kept
    changed = src / kept[0]
    st = changed.stat()
    with changed.open("r+b") as f:  # same size, same mtime, other bytes: a silent upstream fix
        f.seek(st.st_size - 2)
        byte = f.read(1)
        f.seek(st.st_size - 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = subprocess.run(quantize_cmd(src, dst, "--resume", "--json"), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{changed}: the source changed since it was converted; converting it again" in out.stderr
    manifest = json.loads(out.stdout)["manifest"]
    assert manifest["resumed_shards"] == len(kept) - 1
    for record in manifest["shards"]:  # the provenance matches the source as it is now
        assert record["source_sha256"] == hashlib.sha256((src / record["file"]).read_bytes()).hexdigest()
    fresh = tmp_path / "fresh"
    subprocess.run(quantize_cmd(src, fresh), check=True, capture_output=True)
    same_checkpoint(dst, fresh)


def test_source_changed_during_conversion_is_never_kept(multi_shard_ckpt, tmp_path):
    """The shard being read is rewritten mid-run: that run stops (exit 2, file named) or, if the
    change landed after the read, --resume notices it; either way the result is the new source's."""
    from tests.conftest import interrupt_midway

    src = Path(shutil.copytree(multi_shard_ckpt, tmp_path / "src"))
    dst = tmp_path / "out"
    changed = []

    def rewrite(source: Path):
        with source.open("r+b") as f:
            f.seek(source.stat().st_size - 2)
            byte = f.read(1)
            f.seek(source.stat().st_size - 2)
            f.write(bytes([byte[0] ^ 0x01]))
        changed.append(source)

    # The converter holds a read lease on the shard it reads (quant/shard.py SourceGuard): the write
    # waits until the converter, continued, sees the pending change and stops; so it runs beside it.
    writers = []

    def rewrite_in_flight():  # runs while the converter is frozen
        partial = next(dst.glob("*" + PARTIAL_SUFFIX))
        writers.append(threading.Thread(target=rewrite, args=(src / partial.name.removesuffix(PARTIAL_SUFFIX),)))
        writers[0].start()

    code, err = interrupt_midway(src, dst, signal.SIGSTOP, on_stop=rewrite_in_flight)
    writers[0].join()
    assert changed and code in (0, 2), err
    if code == 0:
        # Frozen after the shard's last read (the original bytes were converted) or before its first
        # (the output header is written from the plan before the source is opened, so the new bytes
        # were): either way the record names the bytes really converted, and the output is theirs.
        record = next(r for r in json.loads((dst / MANIFEST_NAME).read_text())["shards"]
                      if r["file"] == changed[0].name)
        converted = {hashlib.sha256(folder.joinpath(changed[0].name).read_bytes()).hexdigest(): folder
                     for folder in (multi_shard_ckpt, src)}
        assert record["source_sha256"] in converted
        fresh = tmp_path / "fresh"
        subprocess.run(quantize_cmd(converted[record["source_sha256"]], fresh), check=True, capture_output=True)
        assert (dst / changed[0].name).read_bytes() == (fresh / changed[0].name).read_bytes()
        return
    one_line_error(err, str(changed[0]), "changed while it was being converted", "--resume")
    assert not list(dst.glob("*" + PARTIAL_SUFFIX))
    subprocess.run(quantize_cmd(src, dst, "--resume"), check=True, capture_output=True)
    fresh = tmp_path / "fresh"
    subprocess.run(quantize_cmd(src, fresh), check=True, capture_output=True)
    same_checkpoint(dst, fresh)


def test_resume_refuses_a_progress_file_missing_a_field(glm_ckpt, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / PROGRESS_NAME).write_text(json.dumps({"fingerprint": "x", "shards": {SHARD1: {"size": 1}}}))
    (dst / SHARD1).write_bytes(b"kept")
    code, err = quantize(capsys, glm_ckpt, dst, "--resume")
    assert code == 2
    one_line_error(err, str(dst / PROGRESS_NAME), "missing, unreadable or incomplete", "--overwrite")
    assert (dst / SHARD1).read_bytes() == b"kept"  # refused before touching anything


# ---- 5. one writer per DST ----------------------------------------------------------------------

@pytest.mark.parametrize("second", [["--overwrite"], ["--resume"]])
def test_second_writer_is_refused_naming_the_first(second, multi_shard_ckpt, multi_shard_reference, tmp_path):
    dst = tmp_path / "out"
    first = subprocess.Popen(quantize_cmd(multi_shard_ckpt, dst), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.time() + 120
    while not (dst / PROGRESS_NAME).exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.005)
    first.send_signal(signal.SIGSTOP)  # hold the first writer mid-run, lock taken
    try:
        out = subprocess.run(quantize_cmd(multi_shard_ckpt, dst, *second), capture_output=True, text=True,
                             timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert out.returncode == 2, out.stderr
    assert f"is being written by another quantize run (pid {first.pid})" in out.stderr
    assert "Traceback" not in out.stderr
    assert first.wait(timeout=300) == 0, first.stderr.read()
    same_checkpoint(dst, multi_shard_reference)  # the first run's output is whole; the lock file is gone
    assert not (dst / LOCK_NAME).exists()


def test_stale_lock_of_a_killed_writer_does_not_block(multi_shard_ckpt, multi_shard_reference, tmp_path):
    from tests.conftest import interrupt_midway

    dst = tmp_path / "out"
    interrupt_midway(multi_shard_ckpt, dst, signal.SIGKILL)
    assert (dst / LOCK_NAME).exists()  # left by kill -9; the kernel released the lock itself
    subprocess.run(quantize_cmd(multi_shard_ckpt, dst, "--resume"), check=True, capture_output=True)
    same_checkpoint(dst, multi_shard_reference)


def test_decoder_takes_the_same_lock(mxfp4_ckpt, tmp_path, capsys):
    """``--to bf16`` writes through the same lock (flock: two opens conflict even in one process)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    with DestinationLock(dst):
        code, err = quantize(capsys, mxfp4_ckpt, dst, to="bf16")
    assert code == 2
    one_line_error(err, str(dst), f"is being written by another quantize run (pid {os.getpid()})")
    assert list(dst.iterdir()) == []


# ---- 6. workers die with their parent -------------------------------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_parent_is_killed(multi_shard_ckpt, tmp_path):
    dst = tmp_path / "out"
    parent = subprocess.Popen(quantize_cmd(multi_shard_ckpt, dst, "--workers", "2"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline, workers = time.time() + 120, []
    while time.time() < deadline and parent.poll() is None:
        workers = _children(parent.pid)
        if len(workers) == 2 and list(dst.glob("*" + PARTIAL_SUFFIX)):
            break
        time.sleep(0.01)
    assert len(workers) == 2, "the two workers never started"
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while any(map(_alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    orphans = [pid for pid in workers if _alive(pid)]
    for pid in orphans:  # a failing run must not leave them converting, then idling, forever
        os.kill(pid, signal.SIGKILL)
    assert not orphans, "workers outlived their parent"


# ---- 7. malformed inputs: exit 2, one line, never a traceback -------------------------------------

def test_empty_linear_weight_is_refused_at_plan_time(tmp_path, capsys):
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    src = write_checkpoint(tmp_path / "src", tiny_config(), overrides={expert: torch.zeros(0, 64, dtype=torch.bfloat16)})
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, expert, "has no elements", "keep this role bf16")
    assert not (tmp_path / "dst").exists()


CONFIG_CASES = {
    "config a list": ("config.json", b"[1, 2]", "a JSON list, not an object"),
    "config binary": ("config.json", b"\x80\x81\xfe\xff\x00", "not valid JSON"),
    "layers a word": ("config.json", None, "num_hidden_layers is 'three', not a non-negative integer"),
    "weight_map a list": (INDEX_NAME, b'{"weight_map": ["model-00001-of-00003.safetensors"]}',
                          "weight_map is list, not an object"),
    "index a string": (INDEX_NAME, b'"model-00001-of-00003.safetensors"', "a JSON str, not an object"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_malformed_config_or_index(case, src, tmp_path, capsys):
    file, content, says = CONFIG_CASES[case]
    if content is None:
        edit_json(src / file, lambda c: c.update(num_hidden_layers="three"))
    else:
        (src / file).write_bytes(content)
    code, err = quantize(capsys, src, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(src / file), says)
    code, _, err = gate(capsys, src)
    assert code == 2 and says in err


MANIFEST_CASES = {
    # case: (flag, YAML text, what the message must say)
    "recipe not YAML": ("--recipe", "rules: [1\n", ":2: not valid YAML"),
    "recipe a list": ("--recipe", "- 1\n", "a YAML list, not a mapping"),
    "recipe rules a string": ("--recipe", "format: mxfp4\nrules: abc\n", "rules: Input should be a valid list"),
    "recipe rule without role": ("--recipe", "format: mxfp4\nrules: [{action: keep}]\n",
                                 "rules.0.role: a required key, missing"),
    "recipe bad scale rule": ("--recipe", "format: mxfp4\nscale_rule: up\n",
                              "scale_rule: Input should be 'even', 'floor' or 'ceil', not 'up'"),
    "family not YAML": ("--family-manifest", "roles: [1\n", ":2: not valid YAML"),
    "family a list": ("--family-manifest", "- 1\n", "a YAML list, not a mapping"),
    "family role without pattern": ("--family-manifest", "family: f\nmodel_types: [x]\nroles: [{role: r}]\n",
                                    "roles.0.pattern: a required key, missing"),
    "family bad regex": ("--family-manifest", "family: f\nmodel_types: [x]\nroles: [{role: r, pattern: '('}]\n",
                         "roles.0.pattern: '(' is not a regular expression"),
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_malformed_recipe_or_family_manifest(case, glm_ckpt, tmp_path, capsys):
    flag, text, says = MANIFEST_CASES[case]
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(text)
    code, err = quantize(capsys, flag, manifest, glm_ckpt, tmp_path / "dst")
    assert code == 2
    one_line_error(err, str(manifest), says)
    assert not (tmp_path / "dst").exists()


def test_output_path_that_cannot_be_a_folder(glm_ckpt, mxfp4_ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    for to, src in (("mxfp4", glm_ckpt), ("bf16", mxfp4_ckpt)):
        code, err = quantize(capsys, src, tmp_path / "afile" / "out", to=to)
        assert code == 2
        one_line_error(err, "cannot create the output folder", "Not a directory")
    code, err = quantize(capsys, "--example", tmp_path / "afile")
    assert code == 2 and "a file, not a folder" in err
    assert (tmp_path / "afile").read_text() == "mine"
    with pytest.raises(SystemExit) as exc:
        quantize_main(["--to", "mxfp4", "--workers", "0", str(glm_ckpt), str(tmp_path / "dst")])
    assert exc.value.code == 2 and "'0' is not a whole number of at least 1" in capsys.readouterr().err


def test_fifo_named_as_a_shard_does_not_hang(src, tmp_path):
    (src / SHARD1).unlink()
    os.mkfifo(src / SHARD1)
    out = subprocess.run(quantize_cmd(src, tmp_path / "dst"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    one_line_error(out.stderr, str(src / SHARD1), "not a regular file")


def test_unreadable_source_is_bad_input(src, tmp_path):
    """Files and folders the user may not read: exit 2, not 1. Root reads everything, so as root
    the command runs without the capabilities that bypass file permissions (setpriv)."""
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: every file is readable")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    for target in (src / "config.json", src / SHARD1, src):
        mode = target.stat().st_mode
        target.chmod(0)
        try:
            out = subprocess.run(prefix + quantize_cmd(src, tmp_path / "dst"), capture_output=True, text=True,
                                 timeout=120)
        finally:
            target.chmod(stat.S_IMODE(mode))
        assert out.returncode == 2, out.stderr
        one_line_error(out.stderr, "cannot be read (Permission denied)", "permissions")
        assert not (tmp_path / "dst").exists()


def test_disk_full_at_every_step_is_clear_and_resumable(glm_ckpt, small_disk, tmp_path, capsys):  # noqa: F811
    """A tmpfs with N inodes fails the run at its N-th file: aux copy, a shard, the progress record,
    the index, config.json, the manifest. Every step: exit 1, the disk-full line with --resume, no
    partial file; then, with room again, --resume finishes byte-identical to an unhindered run."""
    reference = tmp_path / "reference"
    assert quantize(capsys, glm_ckpt, reference)[0] == 0
    failed_at = set()
    for inodes in range(4, 40):
        subprocess.run(["mount", "-o", f"remount,nr_inodes={inodes}", str(small_disk)], check=True)
        dst = small_disk / "out"
        code, err = quantize(capsys, glm_ckpt, dst)
        if code == 0:
            break
        assert code == 1, err
        one_line_error(err, "disk full writing into", "free space and rerun with --resume")
        failed_at.add(err.split("(")[1].split(")")[0] if "(" in err else "?")
        assert not list(dst.rglob("*" + PARTIAL_SUFFIX)) and not (dst / MANIFEST_NAME).exists()
        subprocess.run(["mount", "-o", "remount,nr_inodes=1000", str(small_disk)], check=True)
        code, err = quantize(capsys, glm_ckpt, dst, "--resume")
        assert code == 0, err
        same_checkpoint(dst, reference)
        shutil.rmtree(dst)
    assert {"config.json", MANIFEST_NAME, PROGRESS_NAME, SHARD1} <= failed_at, failed_at


# ---- gate checkpoint: malformed quantization_config --------------------------------------------------

@pytest.mark.parametrize("exclude, says", [
    ("model.layers.0.self_attn", "must be a list of module names; it is the str 'model.layers.0.self_attn'"),
    (7, "must be a list of module names; it is the int 7"),
])
def test_gate_exclude_not_a_list_is_one_finding(exclude, says, mxfp4_ckpt, tmp_path, capsys):
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    edit_json(checked / "config.json", lambda c: c["quantization_config"].update(exclude=exclude))
    code, out, err = gate(capsys, checked, "--json")
    assert code == 1 and not err
    findings = [f for e in json.loads(out)["engines"].values() for f in e["findings"]]
    assert {f["why"] for f in findings} == {says}  # one finding, no misleading engine findings after it


def test_gate_bad_regex_is_a_finding_not_a_crash(mxfp4_ckpt, tmp_path, capsys):
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    edit_json(checked / "config.json", lambda c: c["quantization_config"]["exclude"].append("re:model.(layers"))
    code, out, err = gate(capsys, checked)
    assert code == 1 and not err
    assert "re:model.(layers" in out and "not a valid regular expression" in out


def test_gate_quantization_config_a_string(mxfp4_ckpt, tmp_path, capsys):
    checked = Path(shutil.copytree(mxfp4_ckpt, tmp_path / "checked"))
    edit_json(checked / "config.json", lambda c: c.update(quantization_config="quark"))
    code, out, err = gate(capsys, checked)
    assert code == 1 and not err
    assert "quantization_config" in out and "must be an object, not a str" in out


def test_gate_on_a_file_or_a_missing_folder(mxfp4_ckpt, tmp_path, capsys):
    code, _, err = gate(capsys, mxfp4_ckpt / "config.json")
    assert code == 2 and "a file, not a folder" in err
    code, _, err = gate(capsys, tmp_path / "nowhere")
    assert code == 2 and "no such folder" in err


@pytest.mark.parametrize("text, says", [("rules: [1\n", ":2: not valid YAML"), ("- 1\n", "a YAML list, not a mapping")])
def test_gate_accuracy_policy_not_a_yaml_mapping(text, says, tmp_path, capsys):
    (tmp_path / "policy.yaml").write_text(text)
    code = gate_main(["accuracy", "--candidate", str(tmp_path), "--reference", str(tmp_path),
                      "--policy", str(tmp_path / "policy.yaml")])
    assert code == 2
    one_line_error(capsys.readouterr().err, str(tmp_path / "policy.yaml"), says)


# ---- 8. NaN/Inf in a tensor the recipe keeps --------------------------------------------------------

def test_non_finite_kept_weight_warns_and_strict_refuses(tmp_path):
    config = tiny_config()
    weight = (torch.randn(tensor_shapes(config)[KEPT][0]) * 0.05).to(torch.bfloat16)
    weight[3, 5] = float("inf")
    src = write_checkpoint(tmp_path / "src", config, overrides={KEPT: weight})
    out = subprocess.run(quantize_cmd(src, tmp_path / "dst", "--json"), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{KEPT}: NaN/Inf at row 3, column 5 in a tensor kept as it is" in out.stderr
    assert f"{KEPT}: NaN/Inf at row 3, column 5, kept as it is" in json.loads(out.stdout)["manifest"]["warnings"]
    out = subprocess.run(quantize_cmd(src, tmp_path / "strict", "--strict"), capture_output=True, text=True)
    assert out.returncode == 2
    one_line_error(out.stderr, KEPT, "NaN/Inf at row 3, column 5", "--strict refuses it")
    assert not list((tmp_path / "strict").glob("*.safetensors*"))
    assert not (tmp_path / "strict" / MANIFEST_NAME).exists()
