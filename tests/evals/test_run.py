"""``evals data`` / ``evals run``: real lm-eval against a tiny model, locally and over HTTP on loopback."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evals.bundle import BundleError, pair, read_bundle
from evals.cli import evals_main
from evals.data import BUNDLED_DATA_DIR, import_gpqa, import_gsm8k
from tests.evals.conftest import free_port, send_json

GSM8K = BUNDLED_DATA_DIR / "gsm8k"  # shipped with quantgate (MIT)
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


def synthetic_gsm8k(folder: Path, train: int = 20, test: int = 6) -> Path:
    """GSM8K's own layout and format with short made-up problems: 5-shot prompts that fit the tiny
    model's 2048-token context (the real exemplars take ~2,400 of its byte-level tokens)."""
    folder.mkdir(parents=True)
    for name, n, offset in (("train.jsonl", train, 100), ("test.jsonl", test, 0)):
        rows = [{"question": f"Problem {offset + i}: Tom has {i} apples and gets {i + 2} more. How many now?",
                 "answer": f"{i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2}\n#### {2 * i + 2}"}
                for i in range(n)]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    import_gsm8k(synthetic_gsm8k(data / "source"), data)
    import_gpqa(synthetic_gpqa(data / "gpqa.csv"), data)
    return data


def run_cli(*args) -> int:
    return evals_main(["run", *map(str, args)])


def test_local_model_bundle(glm_ckpt, data_dir, tmp_path, capfd):
    out = tmp_path / "local"
    assert run_cli("--benchmarks", "gsm8k", "--out", out, "--data-dir", data_dir, "--model", glm_ckpt,
                   "--limit", 3, *GEN) == 0
    said = capfd.readouterr()
    printed = said.out  # the score a person reads, with its n and interval
    assert re.search(r"gsm8k +0\.0%  \(95% CI 0\.0-\d+\.\d%; 3 items x 1 repeat, filter flexible-extract\)", printed), printed
    assert "6 rows = 6 gsm8k (3 items x 1 repeat x 2 scoring filters)" in printed
    for noise in ("fatal: not a git repository", "LOAD REPORT", "Generating train split", "specified through cli"):
        assert noise not in said.err, noise  # what a user cannot act on stays quiet (fd 2: git's own output too)
    run, rows = read_bundle(out)
    assert run["scores"]["gsm8k"] == {**run["scores"]["gsm8k"], "score": 0.0, "items": 3, "repeats": 1, "rows": 6}
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
    assert run["benchmarks"]["gpqa_diamond"]["settings"]["seeds"] == [0, 1]
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
    test.write_text(test.read_text().replace("apples", "pears", 1))
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
    good model, which cannot run here. With ``max_model_len`` set it reports it on /v1/models the way
    vLLM 0.33.0 and sglang 0.5.23 do (their ``ModelCard``), standing in for those GPU servers."""

    answers: dict[str, str] = {}
    max_model_len: int | None = None
    max_tokens_seen: set = set()

    def do_GET(self):  # noqa: N802
        if self.path != "/v1/models" or self.max_model_len is None:
            self.send_error(404)
            return
        send_json(self, {"object": "list", "data": [{"id": "scripted", "object": "model",
                                                     "max_model_len": self.max_model_len}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.max_tokens_seen.add(body.get("max_tokens"))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        texts = []
        for prompt in prompts:
            question = re.split(r"Question: |question:", prompt)[-1]
            texts.append(next((a for q, a in self.answers.items() if q in question), "no idea"))
        reply = {"id": "x", "object": "text_completion", "model": body["model"],
                 "choices": [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]}
        send_json(self, reply)

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
    assert run_cli(*args, "--base-url", dead) == 3  # a run that could not start: checked before anything is written
    assert "start the server or fix --base-url" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
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


def scripted_server(max_model_len=None):
    ScriptedModel.max_model_len, ScriptedModel.max_tokens_seen = max_model_len, set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/v1/completions"


def raw_gsm8k(folder: Path) -> Path:
    """GSM8K's own layout, DIR/gsm8k/{train,test}.jsonl, not imported."""
    synthetic_gsm8k(folder / "gsm8k")
    return folder


def test_gsm8k_ships_with_quantgate_with_licence_and_hashes():
    from evals.data import dataset_for

    dataset = dataset_for("gsm8k")  # checks every file against the shipped manifest's sha256
    assert dataset.folder == GSM8K and "MIT License" in (GSM8K / "LICENSE").read_text()
    assert [len((GSM8K / n).read_text().splitlines()) for n in ("train.jsonl", "test.jsonl")] == [7473, 1319]
    assert set(dataset.entry["files"]) == {"train.jsonl", "test.jsonl"}


def test_raw_layout_and_a_budget_that_fits_a_short_context_model(tmp_path):
    """A first run as a user makes it: GSM8K's own files, a small-context model, no --max-gen-toks.
    The context is 640 here, not 2048, only because a random model fills its whole budget and the
    tiny model generates slowly on CPU; the rule (context - longest prompt) is the same."""
    from evals.budget import local_context
    from quant.example import tiny_config, write_checkpoint

    model = write_checkpoint(tmp_path / "ctx640", {**tiny_config("glm_moe_dsa"), "max_position_embeddings": 640})
    raw = raw_gsm8k(tmp_path / "raw")
    assert run_cli("--benchmarks", "gsm8k", "--out", tmp_path / "r", "--data-dir", raw, "--model", model,
                   "--limit", 2) == 0
    run, rows = read_bundle(tmp_path / "r")
    budget, dataset = run["generation_budget"], run["benchmarks"]["gsm8k"]["dataset"]
    assert local_context(str(model)) == budget["context"] == 640 and budget["counted_in"] == "tokens"
    assert budget["max_gen_toks"] == run["max_gen_toks"] == 640 - budget["longest_prompt"] > 0
    assert run["benchmarks"]["gsm8k"]["settings"]["max_gen_toks"] == budget["max_gen_toks"]
    assert "hashed at run time" in dataset["source"]
    assert dataset["files"]["test.jsonl"] == hashlib.sha256((raw / "gsm8k" / "test.jsonl").read_bytes()).hexdigest()
    assert len(rows) == 4


def test_budget_from_the_servers_max_model_len(tmp_path, capsys):
    server, url = scripted_server(max_model_len=1500)
    try:
        common = ["--benchmarks", "gsm8k", "--data-dir", raw_gsm8k(tmp_path / "raw"), "--model", "scripted",
                  "--base-url", url, "--limit", 3]
        assert run_cli("--out", tmp_path / "s", *common) == 0
        sent = set(ScriptedModel.max_tokens_seen)
        code = run_cli("--out", tmp_path / "t", *common, "--max-gen-toks", 1400)
    finally:
        server.shutdown()
    budget = json.loads((tmp_path / "s" / "run.json").read_text())["generation_budget"]
    # no tokenizer given: prompts are counted in UTF-8 bytes, an upper bound on byte-level BPE tokens
    assert budget["context"] == 1500 and budget["counted_in"] == "bytes"
    assert sent == {budget["max_gen_toks"]} == {1500 - budget["longest_prompt"]}
    err = capsys.readouterr().err
    assert code == 2 and "--max-gen-toks 1400" in err and "(1500)" in err and f"at most {1500 - budget['longest_prompt']}" in err
    assert not (tmp_path / "t" / "run.json").exists()


@pytest.mark.parametrize("requested, context, longest, expect", [
    (None, 2048, 800, 1248), (None, 100_000, 800, 16384), (None, None, 800, 16384), (64, None, 800, 64),
    (1248, 2048, 800, 1248), (1249, 2048, 800, "lower --max-gen-toks to at most 1248"),
    (None, 2048, 2048, "no room to generate"),
])
def test_budget_rules(requested, context, longest, expect):
    from evals.budget import BudgetError, fit

    if isinstance(expect, str):
        with pytest.raises(BudgetError, match=re.escape(expect)):
            fit(requested, context, longest, "tokens")
    else:
        assert fit(requested, context, longest, "tokens").max_gen_toks == expect


def test_data_dir_mistakes_name_the_folder_the_line_and_the_fix(glm_ckpt, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    common = ["--benchmarks", "gsm8k", "--model", glm_ckpt, "--limit", 1, *GEN]
    assert run_cli("--out", tmp_path / "a", "--data-dir", empty, *common) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "evals data" in err and "train.jsonl" in err and "Traceback" not in err
    raw = raw_gsm8k(tmp_path / "raw")
    lines = (raw / "gsm8k" / "test.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"question": "q", "answer": "no final answer here"})
    (raw / "gsm8k" / "test.jsonl").write_text("\n".join(lines) + "\n")
    assert run_cli("--out", tmp_path / "b", "--data-dir", raw, *common) == 2
    assert f"{raw / 'gsm8k' / 'test.jsonl'}:3: not GSM8K format" in capsys.readouterr().err
    assert run_cli("--out", tmp_path / "c", "--benchmarks", "gpqa_diamond", "--model", glm_ckpt, *GEN) == 2
    assert "evals data --data-dir DATA --gpqa" in capsys.readouterr().err
