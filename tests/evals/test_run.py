"""``evals data`` / ``evals run``: real lm-eval against a tiny model, locally and over HTTP on loopback."""

from __future__ import annotations

import csv
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evals.bundle import BundleError, pair, read_bundle
from evals.cli import evals_main
from evals.data import import_gpqa, import_gsm8k

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
GEN = ["--max-gen-toks", "8"]


def synthetic_gpqa(path: Path, n: int = 4) -> Path:
    """GPQA-format rows made up here (the real set is gated and never enters the repository)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["Record ID", "Question", "Correct Answer", "Incorrect Answer 1",
                                    "Incorrect Answer 2", "Incorrect Answer 3"])
        writer.writeheader()
        for i in range(n):
            writer.writerow({"Record ID": f"synthetic-{i}", "Question": f"Synthetic question {i}: pick the colour {i}.",
                             "Correct Answer": f"colour {i}", "Incorrect Answer 1": f"shape {i}",
                             "Incorrect Answer 2": f"size {i}", "Incorrect Answer 3": f"smell {i}"})
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    import_gsm8k(GSM8K, data)
    import_gpqa(synthetic_gpqa(data / "gpqa.csv"), data)
    return data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, seconds: float = 90) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {seconds} s")


@pytest.fixture(scope="session")
def served(glm_ckpt):
    """`transformers serve` on 127.0.0.1 serving the tiny GLM-5-layout model, started and stopped here."""
    port = free_port()
    proc = subprocess.Popen(["transformers", "serve", str(glm_ckpt), "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_cli(*args) -> int:
    return evals_main(["run", *map(str, args)])


def test_local_model_bundle(glm_ckpt, data_dir, tmp_path):
    out = tmp_path / "local"
    assert run_cli("--benchmarks", "gsm8k", "--out", out, "--data-dir", data_dir, "--model", glm_ckpt,
                   "--limit", 3, *GEN) == 0
    run, rows = read_bundle(out)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert run["benchmarks"]["gsm8k"]["dataset"]["files"] == manifest["gsm8k"]["files"]
    assert run["versions"]["lm_eval"] == "0.4.13" and run["chat_template_sha256"]
    assert run["benchmarks"]["gsm8k"]["primary_filter"] == "flexible-extract"
    assert sorted({(r["item_id"], r["filter"]) for r in rows}) == [
        (i, f) for i in ("0", "1", "2") for f in ("flexible-extract", "strict-match")]
    assert all(r["score"] == 0.0 for r in rows)  # a random model answers nothing right


def test_server_run_pairs_with_local_run(glm_ckpt, data_dir, served, tmp_path):
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 3, *GEN]
    assert run_cli("--out", tmp_path / "a", "--model", glm_ckpt, *common) == 0
    assert run_cli("--out", tmp_path / "b", "--model", glm_ckpt, "--base-url", served, "--tokenizer", glm_ckpt,
                   *common) == 0
    run_b, rows_b = read_bundle(tmp_path / "b")
    assert run_b["endpoint"] == served and run_b["api"] == "completions"
    pairs = pair(read_bundle(tmp_path / "a")[1], rows_b)
    assert len(pairs) == 6 and all(x["prompt_hash"] == y["prompt_hash"] for x, y in pairs)


def test_gpqa_two_seeds_and_no_text_unless_asked(glm_ckpt, data_dir, served, tmp_path):
    args = ["--benchmarks", "gpqa_diamond", "--data-dir", data_dir, "--model", glm_ckpt, "--base-url", served, *GEN]
    assert run_cli("--out", tmp_path / "g", *args) == 0
    run, rows = read_bundle(tmp_path / "g")
    assert run["benchmarks"]["gpqa_diamond"]["seeds"] == [0, 1]
    assert sorted({(r["repeat"], r["seed"]) for r in rows}) == [(0, 0), (1, 1)]
    assert {r["item_id"] for r in rows} == {f"synthetic-{i}" for i in range(4)}
    assert not any("response" in r for r in rows)
    assert "Synthetic question" not in (tmp_path / "g" / "samples.jsonl").read_text()
    assert run_cli("--out", tmp_path / "k", "--keep-text", "--seeds", "0", *args) == 0
    assert all("response" in r for r in read_bundle(tmp_path / "k")[1])


def test_gpqa_choice_order_is_frozen(tmp_path):
    source = synthetic_gpqa(tmp_path / "g.csv", n=8)
    import_gpqa(source, tmp_path / "a")
    import_gpqa(source, tmp_path / "b")
    first = (tmp_path / "a" / "gpqa_diamond" / "test.jsonl").read_text()
    assert first == (tmp_path / "b" / "gpqa_diamond" / "test.jsonl").read_text()
    rows = [json.loads(line) for line in first.splitlines()]
    assert len({r["answer"] for r in rows}) > 1  # the correct answer is not always in one place
    for r in rows:
        assert r["choices"]["ABCD".index(r["answer"][1])] == f"colour {r['id'].split('-')[1]}"


def test_changed_data_is_detected(data_dir, glm_ckpt, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    test = data / "gsm8k" / "test.jsonl"
    test.write_text(test.read_text().replace("Janet", "Jane", 1))
    code = run_cli("--benchmarks", "gsm8k", "--out", tmp_path / "r", "--data-dir", data, "--model", glm_ckpt,
                   "--limit", 1, *GEN)
    assert code == 2 and "changed since import" in capsys.readouterr().err


def test_pairing_refuses_other_items_and_other_documents(glm_ckpt, data_dir, tmp_path):
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--model", glm_ckpt, *GEN]
    assert run_cli("--out", tmp_path / "two", "--limit", 2, *common) == 0
    assert run_cli("--out", tmp_path / "three", "--limit", 3, *common) == 0
    with pytest.raises(BundleError, match="item sets differ"):
        pair(read_bundle(tmp_path / "two")[1], read_bundle(tmp_path / "three")[1])
    rows = read_bundle(tmp_path / "two")[1]
    forged = [dict(r, doc_hash="0" * 64) if r["item_id"] == "1" else r for r in rows]
    with pytest.raises(BundleError, match="different documents"):
        pair(rows, forged)


class ScriptedModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible completions endpoint that knows the answers: it proves the scoring path
    (prompt -> response -> lm-eval filters -> score) gives 1 for right answers. It stands in for a
    good model, which cannot run here."""

    answers: dict[str, str] = {}

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        texts = []
        for prompt in prompts:
            question = re.split(r"Question: |question:", prompt)[-1]
            texts.append(next((a for q, a in self.answers.items() if q in question), "no idea"))
        reply = {"id": "x", "object": "text_completion", "model": body["model"],
                 "choices": [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_scripted_model_that_knows_the_answers_scores_one(data_dir, tmp_path):
    gsm = [json.loads(line) for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:4]]
    gpqa = [json.loads(line) for line in (data_dir / "gpqa_diamond" / "test.jsonl").read_text().splitlines()]
    ScriptedModel.answers = {r["question"][:60]: " Let me think. #### " + r["answer"].split("####")[-1].strip()
                             for r in gsm}
    ScriptedModel.answers.update({r["Question"]: f" The answer is {r['answer']}." for r in gpqa})
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/completions"
        assert run_cli("--benchmarks", "gsm8k,gpqa_diamond", "--out", tmp_path / "s", "--data-dir", data_dir,
                       "--model", "scripted", "--base-url", url, "--limit", 4, "--seeds", "0", *GEN) == 0
    finally:
        server.shutdown()
    rows = read_bundle(tmp_path / "s")[1]
    assert len(rows) == 16 and all(r["score"] == 1.0 for r in rows), [r for r in rows if r["score"] != 1.0]


def test_dead_server_fails_clearly_and_resume_completes(glm_ckpt, data_dir, served, tmp_path, capsys):
    args = ["--benchmarks", "gsm8k,gpqa_diamond", "--out", tmp_path / "r", "--data-dir", data_dir,
            "--model", glm_ckpt, "--limit", 2, "--seeds", "0", *GEN]
    dead = f"http://127.0.0.1:{free_port()}/v1/completions"
    assert run_cli(*args, "--base-url", dead) == 1
    assert "rerun with --resume" in capsys.readouterr().err
    assert not (tmp_path / "r" / "run.json").exists()
    assert run_cli(*args, "--base-url", served, "--resume") == 0
    assert len(read_bundle(tmp_path / "r")[1]) == 8


def test_tau2_driven_against_the_loopback_server(glm_ckpt, data_dir, served, tmp_path):
    """`tau2 run` for real (its mock domain, 2 tasks), agent and fixed user simulator both the served
    tiny model; the results land in the bundle beside GSM8K."""
    api_base = served.rsplit("/v1", 1)[0] + "/v1"
    assert run_cli("--benchmarks", "gsm8k,tau2", "--out", tmp_path / "t", "--data-dir", data_dir, "--model", glm_ckpt,
                   "--base-url", served, "--limit", 2, *GEN, "--tau2-domains", "mock",
                   "--tau2-user-llm", f"openai/{glm_ckpt}",
                   "--tau2-user-llm-args", json.dumps({"api_base": api_base, "temperature": 0.0, "max_tokens": 16}),
                   "--tau2-max-steps", 4) == 0
    run, rows = read_bundle(tmp_path / "t")
    tau2 = run["benchmarks"]["tau2"]
    assert tau2["user_llm"] == f"openai/{glm_ckpt}" and tau2["domains"]["mock"]["tasks"] == 2
    tau2_rows = [r for r in rows if r["benchmark"] == "tau2"]
    assert len(tau2_rows) == 2 and all(r["item_id"].startswith("mock/") for r in tau2_rows)
    assert all(r["score"] == 0.0 for r in tau2_rows)  # a random model completes no task


def test_evals_data_cli_imports_and_says_when_the_hub_is_out_of_reach(tmp_path, capsys, monkeypatch):
    assert evals_main(["data", "--data-dir", str(tmp_path / "d"), "--gsm8k", str(GSM8K)]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert set(manifest["gsm8k"]["files"]) == {"train.jsonl", "test.jsonl"}
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no hub; say so, lose nothing
    assert evals_main(["data", "--data-dir", str(tmp_path / "d"), "--gsm8k", "hub"]) == 2
    assert "could not fetch openai/gsm8k" in capsys.readouterr().err
    assert json.loads((tmp_path / "d" / "manifest.json").read_text()) == manifest
