"""``evals load --repeats`` with a reference server: real guidellm sweeps, interleaved, against the stand-in
server on 127.0.0.1 (tests/evals/load_server.py), then ``gate load`` on them. The full A/A and half-capacity
pairs take tens of minutes: tests/benchmarks/load_aa_real.py."""

from __future__ import annotations

from datetime import datetime

from evals.cli import evals_main
from evals.load import read_sweeps
from quant.example import write_tokenizer
from tests.evals.load_server import serve
from tests.evals.test_load import run_gate


def test_interleaved_repeats_against_one_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GUIDELLM__MAX_WORKER_PROCESSES", "1")  # one worker is plenty at 2 req/s
    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok", 512, 4096)
    server = serve(prefill_s=0.1)  # 10 req/s: 2 req/s meets any sane SLO
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code = evals_main(["load", "--base-url", url, "--model", "standin", "--tokenizer", str(tmp_path / "tok"),
                           "--out", str(tmp_path / "cand"), "--reference-base-url", url,
                           "--reference-out", str(tmp_path / "ref"), "--repeats", "2", "--rates", "2",
                           "--max-requests", "4", "--max-seconds", "60", "--prompt-tokens", "64",
                           "--output-tokens", "4", "--ttft-slo", "30"])
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert code == 0 and "reference sweep 2:" in out and f"gate load --candidate {tmp_path / 'cand'}" in out
    sweeps = {arm: read_sweeps(tmp_path / arm) for arm in ("ref", "cand")}
    assert {arm: [p.name for p, _ in s] for arm, s in sweeps.items()} == {"ref": ["sweep-1", "sweep-2"],
                                                                          "cand": ["sweep-1", "sweep-2"]}
    # A B A B: each sweep starts after the previous one (of the other arm) finished
    order = sorted((b["timings"]["started"], arm, p.name) for arm, s in sweeps.items() for p, b in s)
    assert [(arm, name) for _, arm, name in order] == [("ref", "sweep-1"), ("cand", "sweep-1"), ("ref", "sweep-2"),
                                                       ("cand", "sweep-2")]
    timings = [b["timings"] for _, arm, name in order for p, b in sweeps[arm] if p.name == name]
    for before, after in zip(timings, timings[1:]):
        assert datetime.fromisoformat(before["finished"]) <= datetime.fromisoformat(after["started"])
    for s in sweeps.values():
        for _, b in s:
            assert [r["rate"] for r in b["rates"]] == [2.0] and b["rates"][0]["successful"] >= 1
            assert len(b["rates"][0]["ttft_s"]) == b["rates"][0]["successful"]
    # every rate met the SLO: no knee is bracketed, and the gate says which rates to add (blocking, exit 1)
    code, result = run_gate(capsys, "load", "--candidate", tmp_path / "cand", "--reference", tmp_path / "ref",
                            "--json")
    assert code == 1 and result["verdict"] == "INCONCLUSIVE" and "add higher --rates" in result["why"]
    assert [k["sweep"] for k in result["arms"]["reference"]["sweeps"]] == [str(tmp_path / "ref" / "sweep-1"),
                                                                           str(tmp_path / "ref" / "sweep-2")]
