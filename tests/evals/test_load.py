"""``evals load`` against a real `transformers serve` (guidellm driving it) and ``gate load`` on synthetic sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from importlib import metadata

import pytest

from evals.cli import evals_main
from evals.cli import main as gate
from evals.judge.knee import p95_rank
from evals.load import FORMAT, Workload, read_load_bundle
from tests.evals.conftest import free_port, wait_healthy

# The tiny profile: 64-token prompts (60% a shared prefix), 8 output tokens, two rates. --max-requests
# lets every request finish, however slow the host; --no-ignore-eos because
# transformers serve rejects that field with HTTP 422.
TINY = ["--prompt-tokens", 64, "--output-tokens", 8, "--rates", "1,2", "--max-requests", 3, "--max-seconds", 120,
        "--no-ignore-eos", "--repeats", 1]


def sweep(served, glm_ckpt, out, *extra) -> int:
    return evals_main(["load", "--base-url", served, "--model", str(glm_ckpt), "--tokenizer", str(glm_ckpt),
                       "--out", str(out), *map(str, TINY), *map(str, extra)])


def run_gate(capsys, *args) -> tuple[int, dict | str]:
    code = gate([*map(str, args)])
    out = capsys.readouterr()
    return code, json.loads(out.out) if "--json" in args and out.out.strip() else out.out + out.err


@pytest.fixture(scope="module")
def sweeps(served, glm_ckpt, tmp_path_factory, monkeypatch_module):
    """Two real sweeps: A within a generous SLO (both rates run), B with an SLO nothing meets (stops at once)."""
    monkeypatch_module.setenv("GUIDELLM__MAX_WORKER_PROCESSES", "1")  # one worker is plenty at 2 req/s
    root = tmp_path_factory.mktemp("load")
    codes = sweep(served, glm_ckpt, root / "a", "--ttft-slo", 1000), sweep(served, glm_ckpt, root / "b",
                                                                          "--ttft-slo", 1e-6)
    return codes, root / "a", root / "b"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_sweep_against_the_served_model_writes_a_valid_bundle(sweeps, served, glm_ckpt):
    (code_a, code_b), a, b = sweeps
    assert code_a == 0 and code_b == 0
    assert sorted(p.name for p in a.iterdir()) == ["sweep-1"]  # --repeats 1: one sweep folder
    a = a / "sweep-1"
    bundle = read_load_bundle(a)
    assert bundle["format"] == FORMAT and bundle["tool"] == {"name": "guidellm", "version": metadata.version("guidellm")}
    assert bundle["server"]["model"] == str(glm_ckpt) and str(glm_ckpt) in bundle["server"]["reported_models"]
    assert bundle["workload"] == Workload(64, 8, 0.6, False).to_dict() and bundle["workload"]["prefix_tokens"] == 38
    assert [r["rate"] for r in bundle["rates"]] == [1.0, 2.0] and bundle["stopped"] is None
    for row in bundle["rates"]:
        # guidellm counts requests that ended inside its measurement window (seen: 2 of the 3 at 2 req/s)
        assert 1 <= row["successful"] <= 3 and (row["errored"], row["errors"]) == (0, {})
        assert row["successful"] + row["incomplete"] <= 3
        assert row["success_fraction"] == 1.0 and row["achieved_rps"] > 0 and row["output_tok_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] and 1 <= row["output_tokens_mean"] <= 8
        assert 60 <= row["prompt_tokens_mean"] <= 70  # 38 prefix + 26 unique tokens, joined by a space
        # every successful request's TTFT is kept, and guidellm's p95 is their inverse-CDF p95 (the knee's bootstrap
        # resamples these)
        assert len(row["ttft_s"]) == row["successful"]
        assert sorted(row["ttft_s"])[p95_rank(len(row["ttft_s"])) - 1] == pytest.approx(row["ttft_p95_s"], rel=1e-9)
        scenario = json.loads((a / "rates" / f"rate-{row['rate']:g}" / "scenario.json").read_text())["spec"]
        assert scenario["data"][0] == {"kind": "synthetic_text", "prompt_tokens": 26, "prefix_tokens": 38,
                                            "prefix_count": 1}
        assert scenario["backend"]["max_tokens"] == 8 and scenario["profile"]["rate"] == [row["rate"]]
        report = a / row["report"]
        assert '"prompt":' not in report.read_text()  # the synthetic prompts are dropped, timings kept
        timings = json.loads(report.read_text())["benchmarks"][0]["requests"]["successful"][0]["info"]["timings"]
        assert timings["request_start"] < timings["first_token_iteration"] <= timings["request_end"]
    # the stripped report is still guidellm's format: its own loader reads it (in a subprocess: importing
    # guidellm installs uvloop's event-loop policy process-wide)
    check = subprocess.run([sys.executable, "-c", "import sys; from guidellm.benchmark.schemas import "
                            "GenerativeBenchmarksReport as R; print(len(R.load_file(sys.argv[1]).benchmarks))",
                            str(a / bundle["rates"][0]["report"])], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "1", check.stderr[-2000:]


def test_a_rate_past_the_slo_ends_the_sweep(sweeps):
    _, _, b = sweeps
    bundle = read_load_bundle(b / "sweep-1")
    assert [r["rate"] for r in bundle["rates"]] == [1.0]  # nothing met the SLO: nothing to bisect
    assert "broke the SLO" in bundle["stopped"] and "add lower --rates" in bundle["stopped"]


def test_two_real_sweeps_gated(sweeps, capsys):
    _, a, b = sweeps
    code, out = run_gate(capsys, "load", "--candidate", b, "--reference", a)
    assert code == 2 and "different SLOs" in out
    code, result = run_gate(capsys, "load", "--candidate", b, "--reference", a, "--ttft-slo", 1000, "--json")
    assert code == 1 and result["verdict"] == "INCONCLUSIVE"  # blocking, as gate accuracy's
    assert "every rate up to 2 req/s met the SLO: add higher --rates" in result["why"]
    code, out = run_gate(capsys, "load", "--candidate", b, "--reference", a, "--ttft-slo", 1e-6)
    assert code == 1 and "verdict: INCONCLUSIVE" in out and "reference's knee is 0" in out


def test_dead_server_ends_cleanly_with_nothing_measured(glm_ckpt, tmp_path, capsys):
    code = sweep(f"http://127.0.0.1:{free_port()}", glm_ckpt, tmp_path / "dead")
    err = capsys.readouterr().err
    assert code == 3 and "could not finish" in err and "is the server up?" in err
    assert not (tmp_path / "dead").exists()  # the server is checked before any folder is made


def test_server_dying_mid_sweep_keeps_what_was_measured(glm_ckpt, tmp_path, monkeypatch, capsys):
    """A second real server, stopped once the first rate's report is written: the sweep ends there, exit 0."""
    monkeypatch.setenv("GUIDELLM__MAX_WORKER_PROCESSES", "1")
    port = free_port()
    with (tmp_path / "serve.log").open("w") as log:
        server = subprocess.Popen(["transformers", "serve", str(glm_ckpt), "--host", "127.0.0.1", "--port", str(port),
                                   "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
    first = tmp_path / "out" / "sweep-1" / "rates" / "rate-1" / "guidellm-report.json"

    def stop_after_first_rate():
        while not first.exists() and server.poll() is None:
            time.sleep(0.2)
        server.terminate()

    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, log=tmp_path / "serve.log")
        threading.Thread(target=stop_after_first_rate, daemon=True).start()
        code = sweep(f"http://127.0.0.1:{port}", glm_ckpt, tmp_path / "out", "--ttft-slo", 1000)
    finally:
        server.terminate()
        server.wait(timeout=30)
    bundle = read_load_bundle(tmp_path / "out" / "sweep-1")
    assert code == 0 and bundle["rates"][0]["rate"] == 1.0 and bundle["rates"][0]["successful"] >= 1
    # where the sweep notices depends on when the server went (the check before 2 req/s, guidellm's own
    # backend check, or 2 req/s with every request refused); a rate it ruined is never counted as load
    assert len(bundle["rates"]) == 1 and bundle["stopped"]
    assert "stopped: " in capsys.readouterr().out


def test_bad_input_is_refused_before_any_request(glm_ckpt, served, sweeps, tmp_path, capsys):
    _, a, _ = sweeps
    before = (a / "sweep-1" / "load.json").read_text()
    assert sweep(served, glm_ckpt, a) == 2 and "already holds a load bundle" in capsys.readouterr().err
    assert (a / "sweep-1" / "load.json").read_text() == before and not (a / "sweep-2").exists()
    assert evals_main(["load", "--base-url", served, "--model", "not-served", "--tokenizer", str(glm_ckpt),
                       "--out", str(tmp_path / "x")]) == 2
    assert "not served" in capsys.readouterr().err
    assert evals_main(["load", "--base-url", served, "--model", "m", "--tokenizer", "t", "--out", str(tmp_path / "y"),
                       "--rates", "1,zero"]) == 2
    assert evals_main(["load", "--base-url", served, "--model", "m", "--tokenizer", "t", "--out", str(tmp_path / "y"),
                       "--prefix-hit", "1.5"]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_dry_run_prints_the_seed_scenario(tmp_path, capsys):
    assert evals_main(["load", "--base-url", "http://127.0.0.1:1/v1/completions", "--model", "m", "--tokenizer", "t",
                       "--out", str(tmp_path / "z"), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    spec = plan["scenario"]["spec"]
    assert plan["order"] == [f"candidate sweep {k}: {tmp_path / 'z' / f'sweep-{k}'}" for k in (1, 2, 3)]
    assert plan["rates"][0] == 0.5 and spec["backend"]["target"] == "http://127.0.0.1:1"
    assert spec["data"][0] == {"kind": "synthetic_text", "prompt_tokens": 8000, "prefix_tokens": 12000,
                               "prefix_count": 1, "output_tokens": 1000}
    assert {"kind": "max_duration", "seconds": 300} in spec["constraints"] and not (tmp_path / "z").exists()


# --- synthetic load bundles for the gate's tests (tests/evals/test_load_gate.py, test_dashboard.py) ---------


def load_bundle(path, rows, slo=5.0, prompt_tokens=20000, repeats=3, spread=0.02):
    """A load bundle of ``repeats`` sweeps (``path/sweep-K``; ``repeats=0``: one sweep in ``path/load.json``)
    with rows (rate, achieved RPS, TTFT p95 s, success fraction); sweep K's achieved RPS is scaled by
    1 + spread x (K - middle), so the sweeps differ as repeats do; output tok/s = 1000 x RPS."""
    def sweep(folder, scale):
        folder.mkdir(parents=True)
        rates = [{"rate": rate, "achieved_rps": rps * scale, "output_tok_s": 1000 * rps * scale, "ttft_p50_s": ttft / 2,
                  "ttft_p95_s": ttft, "itl_p50_ms": 20.0, "successful": 100, "errored": round(100 * (1 - ok) / ok),
                  "incomplete": 0, "success_fraction": ok, "errors": {}} for rate, rps, ttft, ok in rows]
        (folder / "load.json").write_text(json.dumps({
            "format": FORMAT, "state": "done", "tool": {"name": "guidellm", "version": "0.8.1"},
            "workload": Workload(prompt_tokens).to_dict(), "ttft_slo_s": slo, "min_success": 0.99, "rates": rates}))

    if not repeats:
        sweep(path, 1.0)
    for k in range(repeats):
        sweep(path / f"sweep-{k + 1}", 1 + spread * (k - (repeats - 1) / 2))
    return path


REFERENCE = [(1, 0.99, 1.0, 1), (2, 1.98, 2.2, 1), (3, 2.5, 8.0, 1)]
