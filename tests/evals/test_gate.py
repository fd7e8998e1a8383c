"""``gate accuracy`` / ``gate release``: the known values of docs/reference.md §7, verdicts on synthetic bundles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evals.cli import main as gate
from evals.judge.gate import accuracy_gate
from evals.judge.policy import load_policy
from evals.judge.stats import items_to_decide, mcnemar_exact_p, paired_delta
from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe


def bundle(path, benchmark: str, scores, repeats: int = 1, domains=None, doc="d", primary="flexible-extract"):
    """A synthetic run bundle: ``scores[item]`` (or ``scores[item][repeat]``)."""
    path.mkdir(parents=True)
    rows = []
    for i, s in enumerate(scores):
        for r in range(repeats):
            row = {"benchmark": benchmark, "item_id": str(i), "repeat": r, "filter": primary,
                   "score": float(s[r] if repeats > 1 else s), "doc_hash": f"{doc}{i}", "prompt_hash": f"p{i}"}
            if domains is not None:
                row["domain"] = domains[i]
            rows.append(row)
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # each arm its own model: two runs with the same scores are still two runs (a copy of one is refused)
    (path / "run.json").write_text(json.dumps({"model": path.name, "benchmarks": {benchmark: {"primary_filter": primary}}}))
    return path


def evaluated(path: Path, checkpoint: Path) -> Path:
    """A synthetic bundle that records ``checkpoint`` as the one it evaluated, as `evals run --model DIR` does."""
    from evals.checkpoint_identity import identity

    run = json.loads((path / "run.json").read_text())
    run["checkpoint_sha256"] = identity(checkpoint).sha256
    (path / "run.json").write_text(json.dumps(run))
    return path


def gsm8k_policy(path: Path) -> Path:
    """The release policy with GSM8K the only required benchmark (for single-benchmark bundles)."""
    path.write_text("benchmarks:\n  gsm8k: {margin: 0.02, required: true, floor: 0.80}\n")
    return path


def binary_pair(n: int, b: int, c: int, wrong_both: int = 0) -> tuple[list[int], list[int]]:
    """Reference/candidate outcomes with b reference-only and c candidate-only correct items."""
    ref = [1] * b + [0] * c + [0] * wrong_both + [1] * (n - b - c - wrong_both)
    cand = [0] * b + [1] * c + [0] * wrong_both + [1] * (n - b - c - wrong_both)
    return ref, cand


def test_known_values_of_spec_section_7():
    assert mcnemar_exact_p(8, 0) == pytest.approx(0.0078, abs=1e-4)
    assert mcnemar_exact_p(7, 1) == pytest.approx(0.070, abs=1e-3)
    ref, cand = binary_pair(200, 4, 4)
    p = paired_delta(np.array(ref, float), np.array(cand, float), 0.95, 10000, 0)
    assert p.delta == 0 and p.se == pytest.approx(0.0141, abs=1e-4)
    assert 1.96 * p.se == pytest.approx(0.028, abs=5e-4)  # two-sided 95% CI about +/-0.028
    assert p.normal_lower == pytest.approx(-0.023, abs=5e-4)
    assert items_to_decide(p.sd, 0.02, 0.95) == pytest.approx(620, abs=5)  # ~620 questions at 80% power


def run_gate(capsys, *args) -> tuple[int, dict]:
    code = gate([*map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {"error": out.err})


def test_pass_fail_inconclusive(tmp_path, capsys):
    cases = {"pass": binary_pair(1000, 3, 3), "fail": binary_pair(200, 30, 2), "inconclusive": binary_pair(200, 4, 4)}
    verdicts = {}
    for name, (ref, cand) in cases.items():
        r = bundle(tmp_path / name / "ref", "gsm8k", ref)
        c = bundle(tmp_path / name / "cand", "gsm8k", cand)
        code, result = run_gate(capsys, "accuracy", "--candidate", c, "--reference", r, "--benchmarks", "gsm8k",
                                "--margin", "gsm8k=0.02")
        verdicts[name] = (code, result["verdict"], result["benchmarks"][0])
    assert verdicts["pass"][:2] == (0, "PASS")
    assert verdicts["fail"][:2] == (1, "FAIL") and verdicts["fail"][2]["mcnemar_p"] < 1e-5
    code, verdict, bench = verdicts["inconclusive"]
    assert (code, verdict) == (1, "INCONCLUSIVE")
    assert bench["discordant_ref_only"] == 4 and bench["discordant_cand_only"] == 4
    assert 500 < bench["items_to_decide"] < 700


def test_margin_override_and_floor(tmp_path, capsys):
    ref, cand = binary_pair(200, 4, 4)
    r, c = bundle(tmp_path / "r", "gsm8k", ref), bundle(tmp_path / "c", "gsm8k", cand)
    code, result = run_gate(capsys, "accuracy", "--candidate", c, "--reference", r, "--margin", "gsm8k=0.05",
                            "--benchmarks", "gsm8k")
    assert code == 0 and result["verdict"] == "PASS"
    ref, cand = binary_pair(200, 0, 0, wrong_both=60)  # identical, but both at 0.70 < floor 0.80
    r, c = bundle(tmp_path / "r2", "gsm8k", ref), bundle(tmp_path / "c2", "gsm8k", cand)
    code, result = run_gate(capsys, "accuracy", "--candidate", c, "--reference", r, "--benchmarks", "gsm8k")
    assert code == 1 and "below the floor" in result["benchmarks"][0]["rule"]


def test_mismatched_bundles_are_refused(tmp_path, capsys):
    ref, cand = binary_pair(50, 1, 1)
    r = bundle(tmp_path / "r", "gsm8k", ref)
    code, out = run_gate(capsys, "accuracy", "--candidate", bundle(tmp_path / "c", "gsm8k", cand[:40]), "--reference", r)
    assert code == 2 and "item sets differ" in out["error"] and "('gsm8k', '40'" in out["error"]
    assert "only in the reference" in out["error"]
    code, out = run_gate(capsys, "accuracy", "--candidate", bundle(tmp_path / "d", "gsm8k", cand, doc="x"),
                         "--reference", r)
    assert code == 2 and "different documents" in out["error"]


def test_repeats_are_averaged_per_item_and_reported_per_seed(tmp_path):
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 2, size=(198, 2))
    cand = ref.copy()
    cand[:10, 1] = 1 - cand[:10, 1]
    result = accuracy_gate(bundle(tmp_path / "c", "gpqa_diamond", cand, repeats=2),
                           bundle(tmp_path / "r", "gpqa_diamond", ref, repeats=2), load_policy())
    bench = result["benchmarks"][0]
    assert bench["n_items"] == 198 and bench["repeats"] == 2 and bench["mcnemar_p"] is None
    assert bench["delta"] == pytest.approx((cand.mean(axis=1) - ref.mean(axis=1)).mean())
    assert set(bench["per_stratum"]) == {"0", "1"}  # one entry per seed (repeat)


def test_tau2_macro_is_the_mean_of_domain_deltas(tmp_path):
    domains = ["airline"] * 10 + ["retail"] * 40 + ["telecom"] * 50
    ref = [1] * 100
    cand = [0] * 5 + [1] * 5 + [1] * 40 + [0] * 10 + [1] * 40  # airline -0.5, retail 0, telecom -0.2
    result = accuracy_gate(bundle(tmp_path / "c", "tau2", cand, domains=domains),
                           bundle(tmp_path / "r", "tau2", ref, domains=domains), load_policy())
    bench = result["benchmarks"][0]
    assert bench["delta"] == pytest.approx((-0.5 + 0 - 0.2) / 3)  # not the pooled -0.15
    assert bench["per_stratum"]["airline"]["delta"] == pytest.approx(-0.5)
    assert bench["candidate"]["score"] == pytest.approx((0.5 + 1.0 + 0.8) / 3)  # the macro, not the pooled 0.85
    assert bench["required"] and result["verdict"] == "FAIL"  # tau2 is one of the three published numbers
    assert result["not_compared"] == ["gpqa_diamond", "gsm8k"]  # and a verdict needs the other two as well


def test_noise_floor_from_a_reference_rerun(tmp_path, capsys):
    ref, cand = binary_pair(300, 6, 6)
    rerun, _ = binary_pair(300, 0, 0)
    rerun = list(ref)
    for i in range(20, 30):  # the reference disagrees with itself on 10 items
        rerun[i] = 1 - rerun[i]
    code, result = run_gate(capsys, "accuracy", "--candidate", bundle(tmp_path / "c", "gsm8k", cand),
                            "--reference", bundle(tmp_path / "r", "gsm8k", ref),
                            "--reference-rerun", bundle(tmp_path / "rr", "gsm8k", rerun), "--benchmarks", "gsm8k")
    noise = result["benchmarks"][0]["noise"]
    assert noise["reference_self_discordant"] == 10 and noise["candidate_discordant"] == 12
    assert noise["within_noise"]


def test_deterministic(tmp_path):
    ref, cand = binary_pair(200, 9, 3)
    args = (bundle(tmp_path / "c", "gsm8k", cand), bundle(tmp_path / "r", "gsm8k", ref), load_policy())
    assert accuracy_gate(*args) == accuracy_gate(*args)


def test_release_writes_reports_and_blocks_on_structure(glm_ckpt, tmp_path, capsys):
    ckpt = tmp_path / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), ckpt, show_progress=False)
    ref, cand = binary_pair(1000, 3, 3)
    r, c = bundle(tmp_path / "r", "gsm8k", ref), evaluated(bundle(tmp_path / "c", "gsm8k", cand), ckpt)
    policy = gsm8k_policy(tmp_path / "policy.yaml")
    code, report = run_gate(capsys, "release", ckpt, "--candidate", c, "--reference", r, "--policy", policy)
    assert code == 0 and report["verdict"] == "RELEASE"
    text = (c / "report.md").read_text()
    assert "# Release gate: RELEASE" in text and "| gsm8k | flexible-extract | 1000 x 1 |" in text
    assert json.loads((c / "report.json").read_text())["accuracy"]["verdict"] == "PASS"
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"]
                                                if not e.startswith("model.decoder.")]
    (ckpt / "config.json").write_text(json.dumps(config))
    # config.json is part of the checkpoint's identity: this is another checkpoint, as if evaluated again
    code, report = run_gate(capsys, "release", ckpt, "--candidate", evaluated(c, ckpt), "--reference", r, "--policy",
                            policy, "--overwrite")
    assert code == 1 and report["verdict"] == "BLOCK"
    assert "model.decoder.mlp.shared_experts.gate_up_proj" in (c / "report.md").read_text()


def test_unpaired_comparison_against_the_published_table_is_labelled_weaker(tmp_path, capsys):
    ref, cand = binary_pair(200, 4, 2)
    table = Path(__file__).resolve().parents[2] / "manifests" / "references" / "glm-5.2-fp8-published.yaml"
    code, result = run_gate(capsys, "accuracy", "--candidate", bundle(tmp_path / "c", "gsm8k", cand),
                            "--reference", bundle(tmp_path / "r", "gsm8k", ref), "--reference-table", table)
    (row,) = result["unpaired"]
    assert row["benchmark"] == "gsm8k" and row["kind"].startswith("UNPAIRED (weaker")
    assert row["reference"] == 0.965 and row["delta"] == pytest.approx(row["candidate"] - 0.965)
    assert row["ci95"][0] < row["delta"] < row["ci95"][1]


def test_a_benchmark_named_with_benchmarks_decides_even_if_the_policy_makes_it_optional(tmp_path, capsys):
    """`gate accuracy --benchmarks arith --margin arith=0.02`: arith is not in the release policy, yet a FAIL must
    not exit 0 (without a margin it is refused: no hidden default margin)."""
    ref, cand = binary_pair(200, 60, 0)
    bundle(tmp_path / "ref", "arith", ref)
    bundle(tmp_path / "cand", "arith", cand)
    code, result = run_gate(capsys, "accuracy", "--candidate", tmp_path / "cand", "--reference", tmp_path / "ref",
                            "--benchmarks", "arith", "--margin", "arith=0.02")
    assert result["benchmarks"][0]["verdict"] == "FAIL" and result["verdict"] == "FAIL" and code == 1


def test_the_release_verdict_reads_the_structure_check_as_its_typed_report(glm_ckpt, tmp_path):
    """``gate checkpoint``'s report crosses into the release verdict as ``quant.verify.Report`` (read by its
    fields, so a renamed field fails here, not as a KeyError in a user's release), and report.json holds its dict."""
    import shutil

    from evals.judge.gate import release_report
    from quant.verify import Report, verify

    passed = {"verdict": "PASS", "scope": None, "blocking": []}
    loads = verify(glm_ckpt)
    assert isinstance(loads, Report) and loads.ok
    assert release_report(glm_ckpt, loads, passed)["verdict"] == "RELEASE"
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(glm_ckpt, broken)
    (broken / "tokenizer.json").unlink()  # a layout finding: no engine can tokenize a prompt
    report = verify(broken)
    blocked = release_report(broken, report, passed)
    assert blocked["verdict"] == "BLOCK" and blocked["structure"] == report.to_dict()
    assert blocked["reasons"] == [f"structure: {e} would not load it correctly (1 problem(s))" for e in report.engines]
