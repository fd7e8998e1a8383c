"""What a run sends and keeps: the same requests whatever the concurrency, recorded settings, a
retry rule that repeats only what may succeed, and ``--resume`` that never mixes data.

The server here is a real HTTP server on loopback that records each request and answers as told
(a GPU engine cannot run here; what matters is what lm-eval sends and how the run reacts).
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evals.bundle import read_bundle
from evals.cli import evals_main
from evals.data import BUNDLED_DATA_DIR
from tests.evals.conftest import send_json


class Recorder(BaseHTTPRequestHandler):
    """Completions endpoint: records every request body; answers ``status[seed]`` (a list, popped)
    when told to, else a fixed text."""

    requests: list[dict] = []
    status: dict[int, list[int]] = {}

    def do_GET(self):  # noqa: N802  (no /v1/models: the run keeps its default budget)
        self.send_error(404)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).requests.append(body)
        queued = type(self).status.get(body.get("seed"), [])
        if queued:
            self.send_error(queued.pop(0), "scripted failure")
            return
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        send_json(self, {"id": "x", "object": "text_completion", "model": body["model"], "choices": [
            {"index": i, "text": " #### 7", "finish_reason": "stop"} for i in range(len(prompts))]})

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Recorder.requests, Recorder.status = [], {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/v1/completions"
    httpd.shutdown()


@pytest.fixture
def gsm8k_dir(tmp_path):
    """GSM8K in its own layout, in a folder the test may edit (hashed at run time)."""
    shutil.copytree(BUNDLED_DATA_DIR / "gsm8k", tmp_path / "data" / "gsm8k", ignore=shutil.ignore_patterns("LICENSE"))
    return tmp_path / "data"


def run(out, data, url, *extra) -> int:
    return evals_main(["run", "--benchmarks", "gsm8k", "--out", str(out), "--data-dir", str(data), "--model",
                       "scripted", "--base-url", url, "--max-gen-toks", "8", *map(str, extra)])


def test_requests_are_the_same_whatever_the_concurrency_and_recorded(glm_ckpt, gsm8k_dir, server, tmp_path):
    sent = {}
    for concurrency in (1, 3):
        Recorder.requests = []
        assert run(tmp_path / f"c{concurrency}", gsm8k_dir, server, "--limit", 3, "--tokenizer", glm_ckpt,
                   "--concurrency", concurrency, "--request-timeout", 123) == 0
        sent[concurrency] = sorted(json.dumps({k: v for k, v in r.items()}, sort_keys=True) for r in Recorder.requests)
    assert sent[1] == sent[3] and len(sent[1]) == 3
    run_json, _ = read_bundle(tmp_path / "c3")
    settings = run_json["benchmarks"]["gsm8k"]["settings"]
    assert json.loads(sent[3][0])["stop"] == settings["stop"] and run_json["eos"] in settings["stop"]
    assert settings["request_timeout_s"] == 123 and settings["temperature"] == 0.0 and settings["seeds"] == [0]
    assert settings["num_fewshot"] == 5 and "Random(1234)" in settings["fewshot"]["sampler"]


def test_a_4xx_is_not_retried_but_408_and_429_are(gsm8k_dir, server, tmp_path, capsys):
    Recorder.status = {0: [400]}
    assert run(tmp_path / "bad", gsm8k_dir, server, "--limit", 1) == 3
    err = capsys.readouterr().err
    assert len(Recorder.requests) == 1 and "answered HTTP 400" in err and "--resume" in err
    Recorder.requests, Recorder.status = [], {0: [429, 408]}
    assert run(tmp_path / "busy", gsm8k_dir, server, "--limit", 1) == 0
    assert len(Recorder.requests) == 3


def test_resume_after_the_data_changed_redoes_the_units_it_invalidates(gsm8k_dir, server, tmp_path, capsys):
    out = tmp_path / "r"
    Recorder.status = {1: [400]}  # the second repeat dies: a run cut short after one finished unit
    assert run(out, gsm8k_dir, server, "--limit", 2, "--seeds", "0,1") == 3
    assert (out / "units" / "gsm8k-r0.json").exists() and not (out / "run.json").exists()
    assert run(out, gsm8k_dir, server, "--limit", 2, "--seeds", "0,1") == 2  # no mixing without --resume
    assert "holds an unfinished run" in capsys.readouterr().err

    test = gsm8k_dir / "gsm8k" / "test.jsonl"  # the data changes: one question re-imported differently
    test.write_text(test.read_text().replace("Janet", "Jane", 1))
    assert run(out, gsm8k_dir, server, "--limit", 2, "--seeds", "0,1", "--resume") == 0
    run_json, rows = read_bundle(out)
    assert run_json["redone_on_resume"] == {"gsm8k-r0": ["dataset_sha256"]}
    docs = {r["doc_hash"] for r in rows if r["item_id"] == "0"}
    assert len(docs) == 1  # one document per item: both repeats ran on the new data
    assert run_json["benchmarks"]["gsm8k"]["dataset"]["files"]["test.jsonl"] == \
        json.loads((out / "units" / "gsm8k-r0.json").read_text())["dataset_sha256"]["test.jsonl"]


def test_gpqa_prompt_text_is_stock_lm_eval(tmp_path):
    """Stock gpqa_diamond_cot_zeroshot leaves the question as given and runs each choice through its
    preprocess(); the prepared file does the same (only the choice order is frozen, documented)."""
    import csv
    import importlib.util
    from importlib import resources

    import lm_eval
    import yaml

    from evals.data import import_gpqa

    stock_dir = __import__("pathlib").Path(lm_eval.__file__).parent / "tasks" / "gpqa" / "cot_zeroshot"
    spec = importlib.util.spec_from_file_location("stock_gpqa_utils", stock_dir / "utils.py")
    stock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stock)
    raw = {"Record ID": "synthetic-0", "Question": "  Which  colour? [title] Synthetic ",
           "Correct Answer": " red  [title]x ", "Incorrect Answer 1": "blue ", "Incorrect Answer 2": " green",
           "Incorrect Answer 3": "a  b"}
    with (tmp_path / "g.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(raw))
        writer.writeheader()
        writer.writerow(raw)
    import_gpqa(tmp_path / "g.csv", tmp_path / "data")
    (row,) = [json.loads(line) for line in (tmp_path / "data" / "gpqa_diamond" / "test.jsonl").read_text().splitlines()]
    assert row["Question"] == raw["Question"]
    wanted = [stock.preprocess(raw[k]) for k in ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3",
                                                 "Correct Answer")]
    assert sorted(row["choices"]) == sorted(wanted) and row["choices"]["ABCD".index(row["answer"][1])] == wanted[3]
    ours = yaml.safe_load(resources.files("evals.benchmarks").joinpath("gpqa_diamond.yaml").read_text())
    theirs = yaml.safe_load((stock_dir / "_gpqa_cot_zeroshot_yaml").read_text().replace("!function ", ""))
    assert ours["doc_to_text"] == theirs["doc_to_text"] and ours["filter_list"] == theirs["filter_list"]
