"""A verdict bound to its artifacts, on the built-in example's real checkpoints and real `evals run` bundles:
the released checkpoint must be the one the candidate run evaluated, the two arms must be two, and the
report names what judged it (issue 37, item 1)."""

from __future__ import annotations

import json
import shutil

import pytest

from evals.cli import build_parser, main as gate_main
from quant.hashing import sha256_of
from tests.benchmarks.trained_example_gate import POLICY, build, evaluate

LIMIT, GEN_TOKS = 6, 40  # a few items: the binding does not depend on the verdict


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("binding")
    models = build(root, ("bf16", "mxfp4", "fp8"))
    evaluate({arm: models[arm] for arm in ("mxfp4", "fp8")}, root / "runs", LIMIT, GEN_TOKS)
    return root, models, root / "runs"


def gate(capsys, *args) -> tuple[int, str, str]:
    code = gate_main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(code: int, err: str, *says: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for s in says:
        assert s in err, (s, err)


def manifest_sha(model) -> str:
    return sha256_of(model / "conversion_manifest.json")


def test_a_checkpoint_the_candidate_run_did_not_evaluate_is_refused_naming_both_hashes(example, capsys, tmp_path):
    root, models, runs = example
    for wrong in ("fp8", "bf16"):  # issue 37: both said RELEASE (exit 0) for the MXFP4 run's numbers
        code, _, err = gate(capsys, "release", models[wrong], "--candidate", runs / "mxfp4", "--reference",
                            runs / "fp8", "--policy", POLICY, "--report-dir", tmp_path / wrong)
        refused(code, err, manifest_sha(models["mxfp4"]),
                manifest_sha(models["fp8"]) if wrong == "fp8" else "has no conversion_manifest.json")
        assert not (tmp_path / wrong).exists()  # nothing written for a refused release


def test_the_release_report_and_page_name_policy_tool_date_recipe_and_both_checkpoints(example, capsys, tmp_path):
    root, models, runs = example
    code, out, err = gate(capsys, "release", models["mxfp4"], "--candidate", runs / "mxfp4", "--reference",
                          runs / "fp8", "--policy", POLICY, "--report-dir", tmp_path, "--plots", tmp_path / "page")
    assert code in (0, 1), err
    prov = json.loads((tmp_path / "report.json").read_text())["provenance"]
    assert prov["policy"] == {"path": str(POLICY), "sha256": sha256_of(POLICY), "margin_overrides": {}}
    assert prov["tool"]["name"] == "quantgate" and prov["tool"]["version"]
    assert prov["date"].startswith("20") and prov["date"].endswith("+00:00")
    assert prov["recipe"] == "mxfp4-w4a4-experts"
    assert prov["candidate_checkpoint_sha256"] == manifest_sha(models["mxfp4"]) and prov["checkpoint_verified"]
    assert prov["reference_checkpoint_sha256"] == manifest_sha(models["fp8"])
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "page" / "report.html").read_text()
    for text in (md, page, out):
        for needle in (str(POLICY), sha256_of(POLICY), prov["date"], "mxfp4-w4a4-experts",
                       manifest_sha(models["mxfp4"]), manifest_sha(models["fp8"]), f"quantgate {prov['tool']['version']}"):
            assert needle in text, needle


def test_a_run_compared_with_itself_or_its_checkpoint_is_refused(example, capsys, tmp_path):
    root, models, runs = example
    copy = tmp_path / "mxfp4-copy"
    shutil.copytree(runs / "mxfp4", copy)
    rerun = tmp_path / "mxfp4-rerun"  # another run of the same checkpoint (its own run.json)
    shutil.copytree(runs / "mxfp4", rerun)
    run = json.loads((rerun / "run.json").read_text())
    (rerun / "run.json").write_text(json.dumps({**run, "created_unix": run["created_unix"] + 1}))
    for cand, ref, says in ((runs / "fp8", runs / "fp8", "the same run"), (copy, runs / "mxfp4", "copies of one run"),
                            (rerun, runs / "mxfp4", "evaluated the same checkpoint")):
        code, _, err = gate(capsys, "accuracy", "--candidate", cand, "--reference", ref, "--policy", POLICY)
        refused(code, err, says)
        code, _, err = gate(capsys, "release", models["mxfp4"], "--candidate", cand, "--reference", ref,
                            "--policy", POLICY, "--report-dir", tmp_path / "reports")
        refused(code, err)
    refused(code, err, "evaluated the same checkpoint", manifest_sha(models["mxfp4"]))
    assert not (tmp_path / "reports").exists()


def test_a_run_that_recorded_no_checkpoint_is_refused_unless_released_unverified(example, capsys, tmp_path):
    root, models, runs = example
    served = tmp_path / "served"  # as `evals run --base-url` records a run without --checkpoint
    shutil.copytree(runs / "mxfp4", served)
    run = json.loads((served / "run.json").read_text())
    del run["checkpoint_manifest_sha256"]
    (served / "run.json").write_text(json.dumps(run))
    args = ("release", models["mxfp4"], "--candidate", served, "--reference", runs / "fp8", "--policy", POLICY)
    code, _, err = gate(capsys, *args)
    refused(code, err, "records no checkpoint_manifest_sha256", f"--checkpoint {models['mxfp4']}",
            "--unverified-checkpoint")
    code, out, err = gate(capsys, *args, "--unverified-checkpoint")
    assert code in (0, 1), err
    assert "UNVERIFIED" in (served / "report.md").read_text() and "UNVERIFIED" in out
    assert json.loads((served / "report.json").read_text())["provenance"]["checkpoint_verified"] is False
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "--unverified-checkpoint" in sub.choices["release"].format_help()  # the choice is documented
