"""Hostile inputs, second campaign, for ``evals`` and ``gate``: links where they write, FIFOs and
devices where they read, bundles with numbers and types no run writes, crafted aiter sources,
servers that redirect, trickle or never stop answering, Ctrl-C.

Real links, FIFOs, /dev/zero, processes, and real HTTP servers on 127.0.0.1 (127.0.0.2 as the
"other host" a redirect points to). Every case ends with the files outside the output folder
(``outside``: a 0600 secret, a victim) byte-for-byte unchanged; refusals are one line, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evals.cli import evals_main, main as gate_main
from evals.data import BUNDLED_DATA_DIR
from tests.conftest import default_sigint
from tests.evals.conftest import send_json
from tests.evals.test_gate import binary_pair, bundle, evaluated, gsm8k_policy
from tests.evals.test_load import REFERENCE, load_bundle

VICTIM = b"a file of someone else's, never to be written\n"


@pytest.fixture
def outside(tmp_path):
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret").write_bytes(b"API_KEY=do-not-publish\n")
    (folder / "secret").chmod(0o600)
    (folder / "victim").write_bytes(VICTIM)
    before = {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.lstat().st_mode))
              for p in folder.iterdir()}
    yield folder
    after = {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.lstat().st_mode))
             for p in folder.iterdir()}
    assert after == before, "a file outside the output folder changed"


def one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def cli(capsys, main, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


CLI = "import sys; from evals.cli import {0}; sys.exit({0}(sys.argv[1:]))"


def as_process(main: str, *args, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    """``gate`` (main) or ``evals`` (evals_main) as its own process: a FIFO must not hang it."""
    return subprocess.run([sys.executable, "-c", CLI.format(main), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


# ---- run bundles: special files, bombs, values no run writes ----------------------------------------

@pytest.fixture
def pair(tmp_path):
    ref, cand = binary_pair(40, 2, 2)
    return bundle(tmp_path / "ref", "gsm8k", ref), bundle(tmp_path / "cand", "gsm8k", cand), \
        gsm8k_policy(tmp_path / "policy.yaml")


def accuracy(capsys, pair) -> tuple[int, str, str]:
    ref, cand, policy = pair
    return cli(capsys, gate_main, "accuracy", "--candidate", cand, "--reference", ref, "--policy", policy)


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "dev-urandom"])
@pytest.mark.parametrize("file", ["samples.jsonl", "run.json"])
def test_bundle_file_as_a_special_file_is_refused_without_hanging(file, special, pair, outside):
    ref, cand, policy = pair
    (cand / file).unlink()
    if special == "fifo":
        os.mkfifo(cand / file)
    else:
        (cand / file).symlink_to(f"/dev/{special.split('-')[1]}")
    out = as_process("main", "accuracy", "--candidate", cand, "--reference", ref, "--policy", policy)
    assert out.returncode == 2
    one_line(out.stderr, str(cand / file), "not a regular file")


ROW = {"benchmark": "gsm8k", "item_id": "0", "repeat": 0, "filter": "flexible-extract", "score": 1.0,
       "doc_hash": "d0", "prompt_hash": "p0"}
BAD_ROWS = {
    "repeat 0.9": ('{"repeat": 0.9}', "repeat 0.9 is not a non-negative integer"),
    "repeat Infinity": ('{"repeat": Infinity}', "repeat inf is not a non-negative integer"),
    "repeat -1": ('{"repeat": -1}', "repeat -1 is not a non-negative integer"),
    "repeat true": ('{"repeat": true}', "repeat True is not a non-negative integer"),
    "benchmark a list": ('{"benchmark": ["gsm8k"]}', "benchmark ['gsm8k'] is not a string"),
    "doc_hash a list": ('{"doc_hash": [1, 2]}', "doc_hash [1, 2] is not a string"),
    "doc_hash an object": ('{"doc_hash": {}}', "doc_hash {} is not a string"),
    "item_id a list": ('{"item_id": [0]}', "item_id [0] is not a string or an integer"),
    "5000-digit repeat": ('{"repeat": ' + "9" * 5000 + "}", "5000 digits"),
    "deep nesting": ('{"doc_hash": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bundle_rows_with_values_no_run_writes_are_refused(case, pair, outside, capsys):
    ref, cand, _ = pair
    change, says = BAD_ROWS[case]
    first = json.dumps(ROW)[:-1] + ", " + change[1:]  # the key appears twice: JSON keeps the last
    lines = (cand / "samples.jsonl").read_text().splitlines()
    (cand / "samples.jsonl").write_text("\n".join([first, *lines[1:]]) + "\n")
    code, _, err = accuracy(capsys, pair)
    assert code == 2
    one_line(err, f"{cand / 'samples.jsonl'}:1", says)


@pytest.mark.parametrize("content, says", [
    (b"[]", "no 'benchmarks' mapping"),
    (b'{"benchmarks": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"benchmarks": {}, "rows": ' + b"1" * 5000 + b"}", "5000 digits"),
    (b"\xff\xfe\x00", "not valid JSON"),
])
def test_run_json_bombs_are_refused(content, says, pair, outside, capsys):
    ref, cand, _ = pair
    (cand / "run.json").write_bytes(content)
    code, _, err = accuracy(capsys, pair)
    assert code == 2
    one_line(err, str(cand / "run.json"), says)


# ---- load bundles ------------------------------------------------------------------------------------

def _edit_load(path: Path, change) -> None:
    data = json.loads((path / "load.json").read_text())
    change(data)
    (path / "load.json").write_text(json.dumps(data))


LOAD_CASES = {
    "a list": (lambda d: d.clear(), "a JSON list", True),
    "no rates": (lambda d: d.pop("rates"), "rates is 'None', not a list", False),
    "no workload": (lambda d: d.pop("workload"), "workload is 'None'", False),
    "row lacks keys": (lambda d: d["rates"][0].pop("ttft_p95_s"), "rates[0] lacks ['ttft_p95_s']", False),
    "success_fraction NaN": (lambda d: d["rates"][1].update(success_fraction=float("nan")),
                             "2 req/s has 100 successful requests but success_fraction=nan", False),
    "success_fraction 1.5": (lambda d: d["rates"][1].update(success_fraction=1.5),
                             "rates[1].success_fraction is '1.5', not a fraction in 0..1", False),
    "negative RPS": (lambda d: d["rates"][1].update(achieved_rps=-2.0), "2 req/s has 100 successful requests but a "
                     "negative TTFT or RPS", False),
    "rate a string": (lambda d: d["rates"][0].update(rate="1"), "rates[0].rate is '1', not a positive number", False),
    "RPS a string": (lambda d: d["rates"][0].update(achieved_rps="fast"), "rates[0].achieved_rps is 'fast'", False),
    "TTFT Infinity": (lambda d: d["rates"][2].update(ttft_p95_s=float("inf")), "3 req/s has 100 successful requests "
                      "but ttft_p95_s=inf", False),
    "SLO a string": (lambda d: d.update(ttft_slo_s="5"), "ttft_slo_s is '5'", False),
    "successful a float": (lambda d: d["rates"][0].update(successful=99.5), "rates[0].successful is '99.5', not a count",
                           False),
}


@pytest.mark.parametrize("case", LOAD_CASES)
def test_load_bundles_with_values_no_sweep_writes_are_refused_naming_the_value(case, tmp_path, outside, capsys):
    ref, cand = load_bundle(tmp_path / "ref", REFERENCE, repeats=0), load_bundle(tmp_path / "cand", REFERENCE, repeats=0)
    change, says, whole = LOAD_CASES[case]
    if whole:
        (cand / "load.json").write_text("[]")
    else:
        _edit_load(cand, change)
    code, _, err = cli(capsys, gate_main, "load", "--candidate", cand, "--reference", ref)
    assert code == 2
    one_line(err, str(cand), says)  # the bundle (its load.json, or the folder with the rate)


def test_load_bundle_as_a_fifo_is_refused_without_hanging(tmp_path, outside):
    ref = load_bundle(tmp_path / "ref", REFERENCE, repeats=0)
    (tmp_path / "cand").mkdir()
    os.mkfifo(tmp_path / "cand" / "load.json")
    out = as_process("main", "load", "--candidate", tmp_path / "cand", "--reference", ref)
    assert out.returncode == 2
    one_line(out.stderr, "load.json", "not a regular file")


# ---- evals data: links where it writes, special and hostile inputs ------------------------------------

GPQA_HEADER = "Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3,Record ID\n"
GPQA_ROW = "What is 2+2? (synthetic),4,3,5,22,rec1\n"  # a synthetic row in GPQA's format, not a GPQA question


@pytest.mark.parametrize("planted", ["manifest.json", "gpqa_diamond/test.jsonl", "gpqa_diamond/test.jsonl.partial",
                                     "manifest.json.partial", "gpqa_diamond"])
def test_evals_data_never_writes_through_a_link(planted, tmp_path, outside, capsys):
    csv_path = tmp_path / "gpqa.csv"
    csv_path.write_text(GPQA_HEADER + GPQA_ROW)
    data = tmp_path / "data"
    (data / "gpqa_diamond").mkdir(parents=True)
    if planted == "gpqa_diamond":
        (data / planted).rmdir()
        (data / planted).symlink_to(outside)
    else:
        (data / planted).symlink_to(outside / "victim")
    code, _, err = cli(capsys, evals_main, "data", "--data-dir", data, "--gpqa", csv_path)
    if planted.endswith(".partial"):  # a stale partial: removed, never written through; the import succeeds
        assert code == 0, err
        assert not (data / planted).exists() and (data / planted.removesuffix(".partial")).is_file()
        return
    assert code == 2
    one_line(err, str(data / planted), "symbolic link")


@pytest.mark.parametrize("case", ["fifo", "dev-zero", "not utf-8", "200 kB field", "jsonl bomb"])
def test_evals_data_refuses_hostile_gpqa_files(case, tmp_path, outside):
    source = tmp_path / ("gpqa.jsonl" if case == "jsonl bomb" else "gpqa.csv")
    if case == "fifo":
        os.mkfifo(source)
    elif case == "dev-zero":
        source.symlink_to("/dev/zero")
    elif case == "not utf-8":
        source.write_bytes((GPQA_HEADER + GPQA_ROW).encode() + b"\xff\xfe bad bytes\n")
    elif case == "200 kB field":
        source.write_text(GPQA_HEADER + "x" * 200_000 + ",4,3,5,22,rec1\n")
    else:
        source.write_text('{"Question": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    says = {"fifo": "not a regular file", "dev-zero": "not a regular file", "not utf-8": "not UTF-8",
            "200 kB field": "field larger than field limit", "jsonl bomb": "nested too deeply"}[case]
    out = as_process("evals_main", "data", "--data-dir", tmp_path / "data", "--gpqa", source)
    assert out.returncode == 2
    one_line(out.stderr, str(source), says)
    assert not (tmp_path / "data" / "manifest.json").exists()


@pytest.mark.parametrize("case", ["fifo", "dev-zero", "bomb"])
def test_data_manifest_that_is_hostile_is_refused(case, hostile, tmp_path, outside):
    data = tmp_path / "data"
    shutil.copytree(BUNDLED_DATA_DIR / "gsm8k", data / "gsm8k")
    manifest = data / "manifest.json"
    if case == "fifo":
        os.mkfifo(manifest)
    elif case == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        manifest.write_text('{"gsm8k": ' + "[" * 100_000 + "]" * 100_000 + "}")
    out = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--data-dir", data, "--model", "m", "--base-url",
                     f"{hostile[0]}/v1/completions", "--out", tmp_path / "run")  # a live server: the data is what fails
    assert out.returncode == 2
    one_line(out.stderr, str(manifest))


# ---- gate release --plots, gate kernels --untuned-out: links where they write -------------------------

def test_gate_release_report_and_plots_never_write_through_links(tmp_path, outside, capsys, glm_ckpt):
    from quant.convert import convert
    from quant.plan import make_plan
    from quant.recipe import load_recipe

    ckpt = tmp_path / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), ckpt, show_progress=False)
    ref, cand = binary_pair(40, 2, 2)
    r, c = bundle(tmp_path / "ref", "gsm8k", ref), evaluated(bundle(tmp_path / "cand", "gsm8k", cand), ckpt)
    policy = gsm8k_policy(tmp_path / "policy.yaml")
    reports, plots = tmp_path / "reports", tmp_path / "plots"
    reports.mkdir()
    plots.mkdir()
    for name in ("report.json.partial", "report.md.partial"):  # stale partials planted as links
        (reports / name).symlink_to(outside / "victim")
    for name in ("report.html.partial", "forest.png.partial", "heatmap.png.partial"):
        (plots / name).symlink_to(outside / "victim")
    args = ["release", ckpt, "--candidate", c, "--reference", r, "--policy", policy, "--report-dir", reports,
            "--plots", plots]
    code, _, err = cli(capsys, gate_main, *args)
    assert code in (0, 1), err
    assert (reports / "report.json").is_file() and not (reports / "report.json").is_symlink()
    assert (plots / "report.html").is_file() and not list(plots.glob("*.partial"))
    (plots / "report.html").unlink()
    (plots / "report.html").symlink_to(outside / "victim")  # a final name that is a link: refused, named
    code, _, err = cli(capsys, gate_main, *args)
    assert code == 2
    one_line(err, str(plots / "report.html"), "symbolic link")


def test_gate_kernels_untuned_out_never_writes_through_a_link(tmp_path, outside, capsys):
    from tests.quant.test_kernels import AITER

    config = tmp_path / "ckpt"
    config.mkdir()
    from quant.example import glm5_config

    (config / "config.json").write_text(json.dumps(glm5_config()))
    untuned = tmp_path / "untuned_fmoe.csv"
    (tmp_path / "untuned_fmoe.csv.partial").symlink_to(outside / "victim")
    args = ["kernels", config, "--gpu", "mi355x", "--tp", "8", "--aiter-configs", AITER, "--untuned-out", untuned]
    code, _, err = cli(capsys, gate_main, *args)
    assert code in (0, 1) and "Traceback" not in err
    assert untuned.is_file() and not (tmp_path / "untuned_fmoe.csv.partial").exists()
    untuned.unlink()
    untuned.symlink_to(outside / "victim")
    code, _, err = cli(capsys, gate_main, *args)
    assert code == 2
    one_line(err, str(untuned), "symbolic link")


# ---- gate kernels --aiter-configs: a crafted fused_moe.py runs nothing ----------------------------------

CRAFTED = {
    "tiers": "_PADDED_M_TIERS = (open({marker!r}, 'w').write('ran'), 32768)\n",
    "default argument": "def get_padded_M(M, tiers=open({marker!r}, 'w').write('ran')):\n    return M\n",
    "decorator": "@(lambda f: open({marker!r}, 'w').write('ran') or f)\ndef get_padded_M(M):\n    return M\n",
    "body": "def get_padded_M(M):\n    open({marker!r}, 'w').write('ran')\n    return M\n",
    "import in body": "def get_padded_M(M):\n    import os\n    return M\n",
    "huge shift": "def get_padded_M(M):\n    return 1 << 10**9\n",
    "endless loop": "def nextPow2(n):\n    return nextPow2(n)\ndef get_padded_M(M):\n    return nextPow2(M)\n",
}


@pytest.mark.parametrize("case", CRAFTED)
def test_crafted_fused_moe_py_runs_no_code(case, tmp_path, outside, capsys):
    from tests.quant.test_kernels import AITER

    aiter = tmp_path / "aiter"
    shutil.copytree(AITER, aiter / "configs")
    marker = outside / "ran"
    source = CRAFTED[case].format(marker=str(marker))
    if "get_padded_M" not in source:
        source += "def get_padded_M(M):\n    return M\n"
    (aiter / "fused_moe.py").write_text(source)
    config = tmp_path / "ckpt"
    config.mkdir()
    from quant.example import glm5_config

    (config / "config.json").write_text(json.dumps(glm5_config()))
    code, _, err = cli(capsys, gate_main, "kernels", config, "--gpu", "mi355x", "--tp", "8", "--aiter-configs",
                       aiter / "configs")
    assert not marker.exists()
    assert code == 2
    one_line(err, str(aiter / "fused_moe.py"))


def test_aiter_table_not_utf8_or_with_a_200kb_field_is_refused(tmp_path, outside, capsys):
    from tests.quant.test_kernels import AITER, HEADER, FP4_ROWS

    config = tmp_path / "ckpt"
    config.mkdir()
    from quant.example import glm5_config

    (config / "config.json").write_text(json.dumps(glm5_config()))
    for content, says in ((HEADER.encode() + b"\n\xff\xfe\n", "not UTF-8"),
                          ((HEADER + "\n" + FP4_ROWS[0].replace("flydsl_moe1", "x" * 200_000)).encode(),
                           "field larger than field limit"),
                          ((HEADER + "\n" + FP4_ROWS[0].replace(",1,6144,", "," + "9" * 5000 + ",6144,")).encode(),
                           "not an integer")):
        configs = tmp_path / f"configs-{len(content)}"
        shutil.copytree(AITER, configs)
        (configs / "tuned_fmoe.csv").write_bytes(content)
        code, _, err = cli(capsys, gate_main, "kernels", config, "--gpu", "mi355x", "--tp", "8", "--aiter-configs",
                           configs)
        assert code == 2
        one_line(err, str(configs / "tuned_fmoe.csv"), says)
    configs = tmp_path / "configs-fifo"
    shutil.copytree(AITER, configs)
    (configs / "tuned_fmoe.csv").unlink()
    os.mkfifo(configs / "tuned_fmoe.csv")
    out = as_process("main", "kernels", config, "--gpu", "mi355x", "--tp", "8", "--aiter-configs", configs)
    assert out.returncode == 2
    one_line(out.stderr, str(configs / "tuned_fmoe.csv"), "not a regular file")


# ---- OSError and Ctrl-C in gate / evals -------------------------------------------------------------

def test_os_errors_are_one_line_exit_2(tmp_path, outside, capsys):
    """Before: gate and evals caught only their own errors, so an OSError was a traceback."""
    from tests.quant.test_kernels import AITER
    from quant.example import glm5_config

    config = tmp_path / "ckpt"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(glm5_config()))
    (tmp_path / "afile").write_text("a file where a folder is wanted")
    code, _, err = cli(capsys, gate_main, "kernels", config, "--gpu", "mi355x", "--tp", "8", "--aiter-configs", AITER,
                       "--untuned-out", tmp_path / "afile" / "untuned.csv")
    assert code == 2
    one_line(err, str(tmp_path / "afile"), "Not a directory")


# ---- servers: redirects, trickles, huge bodies; auto_map; Ctrl-C during evals run -------------------------

class Hostile(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint misbehaving as ``mode`` says (``get_mode`` for GET, by default
    the same); counts the requests it starts and records each one's duration."""

    mode, get_mode = "ok", None
    started = 0
    seconds: list[float] = []
    target = ""

    def do_GET(self):  # noqa: N802
        self._answer(self.get_mode or self.mode)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(self.mode)

    def _answer(self, mode: str) -> None:
        type(self).started += 1
        began = time.monotonic()
        try:
            if mode == "redirect":
                self.send_response(307)
                self.send_header("Location", self.target)
                self.send_header("content-length", "0")
                self.end_headers()
            elif mode == "trickle":
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "1000")
                self.end_headers()
                for _ in range(1000):  # one byte a second: each read is quick, the whole never ends
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
            elif mode == "huge":
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(100 << 20))
                self.end_headers()
                block = b" " * (1 << 20)
                for _ in range(100):
                    self.wfile.write(block)
            else:
                send_json(self, {"data": [{"id": "m", "max_model_len": 4096}], "choices": [
                    {"index": 0, "text": " #### 7", "finish_reason": "stop"}]})
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            type(self).seconds.append(time.monotonic() - began)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    """Two real servers: the hostile one on 127.0.0.1 and the "other host" on 127.0.0.2."""
    Hostile.seconds = []
    servers = []
    for host in ("127.0.0.1", "127.0.0.2"):
        handler = type(f"Handler_{host.replace('.', '_')}", (Hostile,), {"seconds": [], "started": 0})
        httpd = ThreadingHTTPServer((host, 0), handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append((httpd, handler))
    (main, handler), (other, other_handler) = servers
    handler.target = f"http://127.0.0.2:{other.server_port}/v1/completions"
    yield f"http://127.0.0.1:{main.server_port}", handler, other_handler
    for httpd, _ in servers:
        httpd.shutdown()


def _client(root: str, timeout: int):
    from evals.endpoint import Completions

    return Completions(base_url=f"{root}/v1/completions", model="m", tokenizer_backend=None, tokenized_requests=False,
                       timeout=timeout, num_concurrent=1)


@pytest.mark.parametrize("mode, says", [("redirect", "redirects are not followed"),
                                        ("huge", "more than 64 MiB")])
def test_completions_refuse_redirects_and_huge_bodies(mode, says, hostile, outside):
    from evals.endpoint import RequestRejected

    root, handler, other = hostile
    handler.mode = mode
    client = _client(root, timeout=30)
    with pytest.raises(RequestRejected, match=says):
        client.model_call(["2+2="], generate=True, gen_kwargs={"max_gen_toks": 8})
    # counted when a request starts: the handler's finally may run after the client has raised
    assert handler.started == 1  # refused at once: not retried
    assert other.started == 0  # nothing reached the other host


def test_completion_timeout_bounds_the_whole_request_of_a_trickling_server(hostile, outside):
    import asyncio

    root, handler, _ = hostile
    handler.mode = "trickle"
    client = _client(root, timeout=2)
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        client.model_call(["2+2="], generate=True, gen_kwargs={"max_gen_toks": 8})
    elapsed = time.monotonic() - started
    assert elapsed < 5 * 2 + 10 + 10  # five attempts of 2 s each, plus their backoff: bounded, not 14 minutes
    time.sleep(3)  # the server notices each closed connection at its next write
    assert len(handler.seconds) == 5 and max(handler.seconds) < 2 + 3  # each attempt cut at its 2 s


@pytest.mark.parametrize("mode, says", [("redirect", "a redirect to"), ("huge", "more than 8 MiB"),
                                        ("trickle", "no complete answer within 2 s")])
def test_models_probe_is_bounded(mode, says, hostile, outside):
    from evals.probe import ProbeError, get_json

    root, handler, other = hostile
    handler.mode = mode
    started = time.monotonic()
    with pytest.raises(ProbeError, match=says):
        get_json(f"{root}/v1/models", timeout=2)
    assert time.monotonic() - started < 4 and other.started == 0


def test_load_probe_of_a_redirecting_server_is_a_clear_error(hostile, outside):
    from evals.load import LoadError, served_models

    root, handler, other = hostile
    handler.mode = "redirect"
    with pytest.raises(LoadError, match="redirects are not followed"):
        served_models(root, timeout=2)
    assert other.started == 0


def test_evals_run_against_a_redirecting_server_names_it(hostile, outside, tmp_path):
    root, handler, other = hostile
    handler.mode = "redirect"
    out = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--limit", "2", "--base-url",
                     f"{root}/v1/completions", "--model", "m", "--out", tmp_path / "run", timeout=600)
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert "redirects are not followed" in out.stderr and "--resume" in out.stderr
    assert other.started == 0


def test_evals_run_refuses_a_checkpoint_with_its_own_code(glm_ckpt, tmp_path, outside):
    model = Path(shutil.copytree(glm_ckpt, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "modeling_evil.py").write_text(f"open({str(outside / 'ran')!r}, 'w').write('ran')\n")
    out = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--limit", "2", "--model", model,
                     "--out", tmp_path / "run", timeout=600, stdin=subprocess.DEVNULL)
    assert out.returncode == 2
    one_line(out.stderr, str(model / "config.json"), "auto_map")
    assert not (outside / "ran").exists() and not (tmp_path / "run" / "run.json").exists()


def test_ctrl_c_during_evals_run_is_one_line_130_and_resumable(hostile, outside, tmp_path):
    root, handler, _ = hostile
    handler.mode, handler.get_mode = "trickle", "ok"  # the run waits on its first completion
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CLI.format("evals_main"), "run", "--benchmarks", "gsm8k", "--limit",
                             "2", "--base-url", f"{root}/v1/completions", "--model", "m", "--out", str(out),
                             "--request-timeout", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    deadline = time.time() + 300
    while time.time() < deadline and handler.started < 2 and proc.poll() is None:  # the probe, then a completion
        time.sleep(0.1)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err and "--resume" in err
    assert not (out / "run.json").exists() and not list(out.rglob("*.partial"))
    handler.mode = "ok"
    done = as_process("evals_main", "run", "--benchmarks", "gsm8k", "--limit", "2", "--base-url",
                      f"{root}/v1/completions", "--model", "m", "--out", out, "--resume", timeout=600)
    assert done.returncode == 0, done.stderr
    assert (out / "run.json").is_file()


def test_evals_run_never_writes_through_links_in_its_output_folder(hostile, outside, tmp_path):
    """Stale partials planted as links (bundle files, the unit, the task YAML) are removed, never
    written through; a tasks folder a fresh run did not create, or a units folder that is a link, is refused."""
    root, handler, _ = hostile
    out = tmp_path / "run"
    (out / "units").mkdir(parents=True)
    (out / "tasks").mkdir()
    planted = [out / "run.json.partial", out / "samples.jsonl.partial", out / "units" / "gsm8k-r0.jsonl.partial",
               out / "units" / "gsm8k-r0.json.partial", out / "tasks" / "gsm8k.yaml.partial"]
    for link in planted:
        link.symlink_to(outside / "victim")
    args = ["run", "--benchmarks", "gsm8k", "--limit", "2", "--base-url", f"{root}/v1/completions", "--model", "m",
            "--out", out]
    done = as_process("evals_main", *args, "--resume", timeout=600)  # an interrupted run's folder, resumed
    assert done.returncode == 0, done.stderr
    assert (out / "run.json").is_file() and not any(p.is_symlink() or p.exists() for p in planted)
    again = tmp_path / "again"
    (again / "tasks").mkdir(parents=True)
    (again / "tasks" / "gsm8k.yaml").symlink_to(outside / "victim")
    refused = as_process("evals_main", *args[:-1], again, timeout=600)
    assert refused.returncode == 2
    one_line(refused.stderr, str(again / "tasks"), "already there")
    third = tmp_path / "third"
    third.mkdir()
    (third / "units").symlink_to(outside)
    refused = as_process("evals_main", *args[:-1], third, timeout=600)
    assert refused.returncode == 2
    one_line(refused.stderr, str(third / "units"), "symbolic link")
