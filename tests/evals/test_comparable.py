"""The gate compares only what is comparable, says so, and reads bad bundles as bad input (exit 2)."""

from __future__ import annotations

import json

import pytest

from evals.cli import main as gate
from tests.evals.test_gate import binary_pair, bundle

CHAT_256 = {"api": "chat", "max_gen_toks": 256, "temperature": 0.0, "stop": ["Question:"], "request_timeout_s": 600}
COMPLETIONS_16K = {**CHAT_256, "api": "completions", "max_gen_toks": 16384}


def with_settings(path, benchmark: str, settings: dict, prompt: str = "p"):
    """Give a synthetic bundle recorded settings (and, optionally, other prompts)."""
    run = json.loads((path / "run.json").read_text())
    run["benchmarks"][benchmark]["settings"] = settings
    (path / "run.json").write_text(json.dumps(run))
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    (path / "samples.jsonl").write_text("".join(json.dumps({**r, "prompt_hash": prompt + r["item_id"]}) + "\n"
                                                for r in rows))
    return path


def gate_json(capsys, *args) -> tuple[int, dict, str]:
    code = gate([*map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {}), out.err


def test_runs_that_measured_differently_are_refused_naming_each_difference(tmp_path, capsys):
    ref, cand = binary_pair(80, 2, 2)
    r = with_settings(bundle(tmp_path / "r", "gsm8k", ref), "gsm8k", COMPLETIONS_16K)
    c = with_settings(bundle(tmp_path / "c", "gsm8k", cand), "gsm8k", CHAT_256, prompt="chat")
    args = ("accuracy", "--candidate", c, "--reference", r, "--benchmarks", "gsm8k")
    code, result, err = gate_json(capsys, *args)
    assert code == 2 and not result
    assert 'gsm8k: api: reference "completions", candidate "chat"' in err
    assert "gsm8k: max_gen_toks: reference 16384, candidate 256" in err
    assert "gsm8k: prompt_hash: the prompts differ on 80 of 80 items" in err
    assert "temperature" not in err and "--allow-setting-differences" in err

    code, result, err = gate_json(capsys, *args, "--allow-setting-differences")
    assert code in (0, 1) and result["verdict"] in ("PASS", "INCONCLUSIVE")
    assert len(result["setting_differences"]["gsm8k"]) == 3
    assert gate([*map(str, args), "--allow-setting-differences"]) in (0, 1)
    text = capsys.readouterr().out
    assert text.startswith("NOT LIKE FOR LIKE") and "COMPARED ACROSS DIFFERENT SETTINGS" in text


def test_equal_settings_pair_and_a_missing_record_is_a_difference(tmp_path, capsys):
    ref, cand = binary_pair(1000, 1, 1)
    r = with_settings(bundle(tmp_path / "r", "gsm8k", ref), "gsm8k", COMPLETIONS_16K)
    c = with_settings(bundle(tmp_path / "c", "gsm8k", cand), "gsm8k", COMPLETIONS_16K)
    code, result, _ = gate_json(capsys, "accuracy", "--candidate", c, "--reference", r, "--benchmarks", "gsm8k")
    assert code == 0 and result["setting_differences"] is None
    old = bundle(tmp_path / "old", "gsm8k", cand)  # a bundle from before settings were recorded
    code, _, err = gate_json(capsys, "accuracy", "--candidate", old, "--reference", r, "--benchmarks", "gsm8k")
    assert code == 2 and "settings recorded only in the reference run" in err


def test_release_report_labels_a_comparison_across_settings(glm_ckpt, tmp_path, capsys):
    from quant.convert import convert
    from quant.plan import make_plan
    from quant.recipe import load_recipe
    from tests.evals.test_gate import evaluated, gsm8k_policy

    ckpt = tmp_path / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), ckpt, show_progress=False)
    ref, cand = binary_pair(1000, 3, 3)
    r = with_settings(bundle(tmp_path / "r", "gsm8k", ref), "gsm8k", COMPLETIONS_16K)
    c = with_settings(evaluated(bundle(tmp_path / "c", "gsm8k", cand), ckpt), "gsm8k",
                      {**COMPLETIONS_16K, "max_gen_toks": 8192})
    code, report, _ = gate_json(capsys, "release", ckpt, "--candidate", c, "--reference", r, "--policy",
                                gsm8k_policy(tmp_path / "p.yaml"), "--allow-setting-differences")
    assert code == 0 and report["verdict"] == "RELEASE"
    text = (c / "report.md").read_text()
    assert "NOT LIKE FOR LIKE" in text and "max_gen_toks: reference 16384, candidate 8192" in text


def test_a_verdict_needs_every_required_benchmark(tmp_path, capsys):
    """A tau2-only comparison (tau2 optional) with a large drop used to PASS, exit 0."""
    domains = ["airline"] * 10 + ["retail"] * 10
    ref, cand = [1] * 20, [1] * 20
    for i in range(0, 20, 3):
        cand[i] = 0
    r = bundle(tmp_path / "r", "tau2", ref, domains=domains, primary="reward")
    c = bundle(tmp_path / "c", "tau2", cand, domains=domains, primary="reward")
    code, result, _ = gate_json(capsys, "accuracy", "--candidate", c, "--reference", r)
    assert code == 1 and result["verdict"] == "INCONCLUSIVE"
    assert "gsm8k: required by the policy but not compared (the runs do not hold it)" in result["blocking"]
    code, result, _ = gate_json(capsys, "accuracy", "--candidate", c, "--reference", r, "--benchmarks", "tau2")
    assert result["scope"] == ["tau2"] and result["not_compared"] == []  # a scoped answer, said to be one


def write_bundle(path, lines, run=None):
    path.mkdir()
    (path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (path / "run.json").write_text(run if run is not None else json.dumps({"benchmarks": {"gsm8k": {}}}))
    return path


ROW = {"benchmark": "gsm8k", "item_id": "0", "repeat": 0, "filter": "flexible-extract", "score": 1.0,
       "doc_hash": "d0", "prompt_hash": "p0"}


@pytest.mark.parametrize("name, lines, run, message", [
    ("malformed line", [json.dumps(ROW), "{not json"], None, "samples.jsonl:2: not valid JSON"),
    ("score abc", [json.dumps({**ROW, "score": "abc"})], None, "samples.jsonl:1: score 'abc' is not a number"),
    ("score null", [json.dumps({**ROW, "score": None})], None, "samples.jsonl:1: score None is not a number"),
    ("run.json not JSON", [json.dumps(ROW)], "{oops", "run.json: not valid JSON"),
    ("run.json without benchmarks", [json.dumps(ROW)], json.dumps({"model": "m"}), "run.json: no 'benchmarks'"),
    ("empty samples", [""], None, "samples.jsonl: no rows"),
    ("0 and '0'", [json.dumps({**ROW, "item_id": 0}), json.dumps(ROW)], None, "duplicate (benchmark, item_id"),
    ("two documents", [json.dumps(ROW), json.dumps({**ROW, "repeat": 1, "doc_hash": "other"})], None,
     "carry more than one doc_hash"),
])
def test_bad_bundle_input_exits_2_naming_file_and_line(tmp_path, capsys, name, lines, run, message):
    bad = write_bundle(tmp_path / "bad", lines, run)
    good = write_bundle(tmp_path / "good", [json.dumps(ROW)])
    for args in (("--candidate", bad, "--reference", good), ("--candidate", good, "--reference", bad)):
        code, _, err = gate_json(capsys, "accuracy", *args)
        assert code == 2 and message in err and str(bad) in err and "Traceback" not in err, (name, err)


def test_a_file_for_a_folder_and_reference_candidate_wording(tmp_path, capsys):
    good = write_bundle(tmp_path / "good", [json.dumps(ROW)])
    code, _, err = gate_json(capsys, "accuracy", "--candidate", good / "run.json", "--reference", good)
    assert code == 2 and "is a file; give the run bundle folder" in err
    other = write_bundle(tmp_path / "other", [json.dumps({**ROW, "item_id": "1"})])
    code, _, err = gate_json(capsys, "accuracy", "--candidate", other, "--reference", good)
    assert code == 2 and "only in the reference" in err and "only in the candidate" in err and "first" not in err


def test_bad_policy_is_bad_input(tmp_path, capsys):
    ref, cand = binary_pair(50, 1, 1)
    r, c = bundle(tmp_path / "r", "gsm8k", ref), bundle(tmp_path / "c", "gsm8k", cand)
    (tmp_path / "p.yaml").write_text("benchmarks:\n  gsm8k: {margin: two}\n")
    code, _, err = gate_json(capsys, "accuracy", "--candidate", c, "--reference", r, "--policy", tmp_path / "p.yaml")
    assert code == 2 and "benchmarks.gsm8k.margin: " in err and "not 'two'" in err
    code, _, err = gate_json(capsys, "accuracy", "--candidate", c, "--reference", r, "--margin", "gsm8k=x")
    assert code == 2 and "expected BENCH=VALUE" in err
