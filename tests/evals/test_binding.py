"""A verdict bound to its artifacts, on the built-in example's real checkpoints and real `evals run` bundles:
the released checkpoint must be the one the candidate run evaluated, the two arms must be two, and the
report names what judged it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evals.checkpoint_identity import identity
from evals.cli import build_parser
from evals.cli import main as gate_main
from evals.errors import BadInput
from evals.judge import dashboard
from quant.hashing import sha256_of
from tests.benchmarks.trained_example_gate import POLICY, build, evaluate

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "dashboard.ipynb"
RELEASE_POLICY = NOTEBOOK.parents[1] / "manifests" / "gates" / "release.yaml"
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
    """The checkpoint's identity, as `evals run` records it (its shards' sha256s, not the manifest's bytes)."""
    return identity(model).sha256


def test_a_checkpoint_the_candidate_run_did_not_evaluate_is_refused_naming_both_hashes(example, capsys, tmp_path):
    _, models, runs = example
    for wrong in ("fp8", "bf16"):  # both once said RELEASE (exit 0) for the MXFP4 run's numbers
        code, _, err = gate(capsys, "release", models[wrong], "--candidate", runs / "mxfp4", "--reference",
                            runs / "fp8", "--policy", POLICY, "--report-dir", tmp_path / wrong)
        refused(code, err, manifest_sha(models["mxfp4"]),
                manifest_sha(models["fp8"]) if wrong == "fp8" else "has no conversion_manifest.json")
        assert not (tmp_path / wrong).exists()  # nothing written for a refused release


def test_the_release_report_and_page_name_policy_tool_date_recipe_and_both_checkpoints(example, capsys, tmp_path):
    _, models, runs = example
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
    _, models, runs = example
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
    _, models, runs = example
    served = tmp_path / "served"  # as `evals run --base-url` records a run without --checkpoint
    shutil.copytree(runs / "mxfp4", served)
    run = json.loads((served / "run.json").read_text())
    del run["checkpoint_sha256"]
    (served / "run.json").write_text(json.dumps(run))
    args = ("release", models["mxfp4"], "--candidate", served, "--reference", runs / "fp8", "--policy", POLICY)
    code, _, err = gate(capsys, *args)
    refused(code, err, "records no checkpoint_sha256", f"--checkpoint {models['mxfp4']}",
            "--unverified-checkpoint")
    code, out, err = gate(capsys, *args, "--unverified-checkpoint")
    assert code in (0, 1), err
    assert "UNVERIFIED" in (served / "report.md").read_text() and "UNVERIFIED" in out
    assert json.loads((served / "report.json").read_text())["provenance"]["checkpoint_verified"] is False
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "--unverified-checkpoint" in sub.choices["release"].format_help()  # the choice is documented


def _copy_runs(runs, tmp_path):
    """The example's two runs in a folder of this test's (gate release writes its report beside the candidate)."""
    for arm in ("mxfp4", "fp8"):
        shutil.copytree(runs / arm, tmp_path / arm)
    return tmp_path / "mxfp4", tmp_path / "fp8"


def _notebook(tmp_path, **parameters) -> str:
    """The dashboard notebook executed headless (papermill) from the repository root: its printed text."""
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), parameters={k: str(v) for k, v in parameters.items()},
                               kernel_name="python3", cwd=str(NOTEBOOK.parents[1]), progress_bar=False)
    outputs = [o for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    text = [o.get("text") or o.get("data", {}).get("text/plain", "") for o in outputs]  # printed, and tables shown
    return "".join(t if isinstance(t, str) else "".join(t) for t in text)


def test_the_notebook_shows_the_release_reports_verdict_and_refuses_another_policy(example, capsys, tmp_path):
    _, models, runs = example
    cand, ref = _copy_runs(runs, tmp_path)
    text = _notebook(tmp_path, candidate=cand, reference=ref, policy=POLICY)  # before any release report
    code, out, _ = gate(capsys, "accuracy", "--candidate", cand, "--reference", ref, "--policy", POLICY, "--json")
    verdict = json.loads(out)["verdict"]
    assert f"verdict: {verdict}" in text and "no gate release report" in text and str(POLICY) in text
    code, _, err = gate(capsys, "release", models["mxfp4"], "--candidate", cand, "--reference", ref, "--policy", POLICY)
    assert code in (0, 1), err
    saved = json.loads((cand / "report.json").read_text())
    text = _notebook(tmp_path, candidate=cand, reference=ref, policy=POLICY)
    assert f"verdict: {saved['verdict']}" in text and str(cand / "report.json") in text
    assert saved["provenance"]["date"] in text and saved["provenance"]["candidate_checkpoint_sha256"] in text
    with pytest.raises(BadInput, match="judged under the policy"):  # the notebook's load, under another policy
        dashboard.load(cand, ref, policy=RELEASE_POLICY)


def test_a_bound_a_hair_from_the_margin_prints_the_digits_that_tell_them_apart(example, capsys, tmp_path):
    """The table, the rule, report.md and the page never print a bound and the margin as the same number."""
    _, models, runs = example
    cand, ref = _copy_runs(runs, tmp_path)
    code, out, _ = gate(capsys, "accuracy", "--candidate", cand, "--reference", ref, "--policy", POLICY, "--json")
    lower = json.loads(out)["benchmarks"][0]["lower"]
    hair = round(-lower, 4) + (0.00003 if round(-lower, 4) < -lower else -0.00003)  # 4 decimals alike, 5 not
    for margin, says in ((hair, format(lower, "+.5f")), (-lower, "at the margin")):
        code, out, err = gate(capsys, "release", models["mxfp4"], "--candidate", cand, "--reference", ref, "--policy",
                              POLICY, "--margin", f"arith={margin!r}", "--plots", tmp_path / "page", "--overwrite")
        assert code in (0, 1), err
        md, page = (cand / "report.md").read_text(), (tmp_path / "page" / "report.html").read_text()
        for text in (out, md, page):
            assert says in text, (says, text[:3000])
        if says == "at the margin":
            assert json.loads((cand / "report.json").read_text())["accuracy"]["verdict"] != "PASS"  # a tie is no pass
            assert "at the margin" in _notebook(tmp_path, candidate=cand, reference=ref)  # its table, from the report


# ---- forged releases: a checkpoint is its shards, each hashed against the manifest --------------------------

CLI = "import sys; {prelude}from evals.cli import {main}; sys.exit({main}(sys.argv[1:]))"


def process(*args, main: str = "main", prelude: str = "", capsys=None) -> subprocess.CompletedProcess:
    """``gate`` (main) or ``evals`` (evals_main) as its own process, as a user runs it; with ``capsys``, the
    same command in this process (the variants of a case, where a process each would only cost time)."""
    if capsys is not None:
        from evals import cli

        capsys.readouterr()
        code = getattr(cli, main)([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return subprocess.run([sys.executable, "-c", CLI.format(main=main, prelude=prelude), *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)


def quantize(*args) -> None:
    done = subprocess.run([sys.executable, "-m", "quant.cli", "-q", *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr


def one_line(done: subprocess.CompletedProcess, *says: str) -> None:
    refused(done.returncode, done.stderr, *says)


def tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (a file's sha256, a link's target): what a refusal must leave as it was."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): f"link:{os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
            else sha256_of(p) for p in sorted(folder.rglob("*"))}


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def flip_last_byte(path: Path) -> None:
    """The shard changed after the manifest was written, its size the same (only its hash tells)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def damaged(example):
    """Another conversion of the same source: other recipe (every Linear) and scale rule (floor)."""
    from tests.benchmarks.trained_example_gate import DAMAGING_RECIPE

    root, models, _ = example
    out = root / "example" / "damaged"
    quantize("--to", "mxfp4", "--recipe", DAMAGING_RECIPE, models["bf16"], out)
    return out


def release(models, runs, checkpoint, *more, cand=None, ref=None, capsys=None) -> subprocess.CompletedProcess:
    return process("release", checkpoint, "--candidate", cand or runs / "mxfp4", "--reference", ref or runs / "fp8",
                   "--policy", POLICY, *more, capsys=capsys)


def test_a_copy_whose_shards_changed_after_its_manifest_is_refused(example, tmp_path, capsys):
    _, models, runs = example
    forged = tmp_path / "forged"
    shutil.copytree(models["mxfp4"], forged)
    for shard in shards(forged)[:5]:  # 5 of 7 shards, each the size the manifest records
        flip_last_byte(shard)
    done = release(models, runs, forged, "--report-dir", tmp_path / "report")
    one_line(done, str(shards(forged)[0]), "sha256", "conversion_manifest.json records")
    assert not (tmp_path / "report").exists()  # nothing written
    # --fast hashes nothing: the report and the terminal say the shards were not verified
    done = release(models, runs, forged, "--fast", "--report-dir", tmp_path / "fast", capsys=capsys)
    assert done.returncode in (0, 1), done.stderr
    md = (tmp_path / "fast" / "report.md").read_text()
    saved = json.loads((tmp_path / "fast" / "report.json").read_text())
    assert "shards NOT verified" in md and "shards NOT verified" in done.stdout
    assert saved["provenance"]["shards_verified"] is False
    # ... but still their names and sizes: a shard of another size is refused even then
    with shards(forged)[6].open("ab") as f:
        f.write(b"\0")
    one_line(release(models, runs, forged, "--fast", "--report-dir", tmp_path / "fast2", capsys=capsys),
             str(shards(forged)[6]), "bytes")
    assert not (tmp_path / "fast2").exists()


def test_another_conversion_under_the_evaluated_manifest_is_refused(example, damaged, tmp_path, capsys):
    _, models, runs = example
    manifest = models["mxfp4"] / "conversion_manifest.json"
    copied, linked, shard_link = tmp_path / "copied", tmp_path / "linked", tmp_path / "shard-link"
    for folder in (copied, linked):
        shutil.copytree(damaged, folder)
        (folder / "conversion_manifest.json").unlink()
    shutil.copy(manifest, copied / "conversion_manifest.json")
    (linked / "conversion_manifest.json").symlink_to(manifest)  # from outside the folder
    shutil.copytree(models["mxfp4"], shard_link)
    shards(shard_link)[2].unlink()
    (shard_link / shards(models["mxfp4"])[2].name).symlink_to(shards(models["mxfp4"])[2])
    for fast in ((), ("--fast",)):
        for forged, says in ((copied, "conversion_manifest.json records"), (linked, "symbolic link"),
                             (shard_link, "symbolic link")):
            before = tree(tmp_path)
            first = not fast and forged == copied  # one as its own process, the variants in this one
            done = release(models, runs, forged, *fast, "--report-dir", tmp_path / "report",
                           capsys=None if first else capsys)
            one_line(done, str(forged), says)
            assert tree(tmp_path) == before


def test_two_byte_identical_conversions_are_one_checkpoint(example, tmp_path, capsys):
    _, models, runs = example
    again = tmp_path / "again"  # the same source, recipe and tool: the same shards, another manifest (timings)
    quantize("--to", "mxfp4", models["bf16"], again)
    assert sha256_of(again / "conversion_manifest.json") != sha256_of(models["mxfp4"] / "conversion_manifest.json")
    assert manifest_sha(again) == manifest_sha(models["mxfp4"])
    # released against the run of the other conversion: the checkpoint that run evaluated
    done = release(models, runs, again, "--report-dir", tmp_path / "report", capsys=capsys)
    assert done.returncode in (0, 1), done.stderr
    assert json.loads((tmp_path / "report" / "report.json").read_text())["provenance"]["candidate_checkpoint_sha256"] \
        == manifest_sha(models["mxfp4"])
    # a run of one against a run of the other compares the checkpoint with itself: refused
    done = process("run", "--benchmarks", "arith", "--model", again, "--out", tmp_path / "run", "--limit", LIMIT,
                   "--max-gen-toks", GEN_TOKS, main="evals_main", capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checkpoint_sha256"] == manifest_sha(again)
    done = process("accuracy", "--candidate", tmp_path / "run", "--reference", runs / "mxfp4", "--policy", POLICY)
    one_line(done, "evaluated the same checkpoint", manifest_sha(again))
    done = release(models, runs, again, "--report-dir", tmp_path / "report2", cand=tmp_path / "run",
                   ref=runs / "mxfp4", capsys=capsys)
    one_line(done, "evaluated the same checkpoint")
    assert not (tmp_path / "report2").exists()


def test_a_resumed_run_refuses_a_checkpoint_whose_shards_changed(example, tmp_path):
    _, models, _ = example
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    shutil.copytree(models["mxfp4"], ckpt)
    args = ("run", "--benchmarks", "arith", "--model", ckpt, "--out", out, "--limit", LIMIT, "--max-gen-toks",
            GEN_TOKS, "--seeds", "0,1")
    done = process(*args, main="evals_main")
    assert done.returncode == 0, done.stderr
    # as a run killed during repeat 1 leaves it: repeat 0's unit finished, no run.json
    for name in ("run.json", "samples.jsonl", "units/arith-r1.json", "units/arith-r1.jsonl"):
        (out / name).unlink(missing_ok=True)
    assert (out / "units" / "arith-r0.jsonl").is_file()
    for shard in shards(ckpt)[:5]:  # swapped under the same manifest
        flip_last_byte(shard)
    before = tree(out)
    done = process(*args, "--resume", main="evals_main")
    one_line(done, str(shards(ckpt)[0]), "sha256")
    assert tree(out) == before  # repeat 1 never ran on other weights


def test_a_release_prints_where_it_wrote_and_never_replaces_another_release_or_leaves_its_page(example, tmp_path,
                                                                                             capsys):
    _, models, runs = example
    cand, ref = _copy_runs(runs, tmp_path)
    page = tmp_path / "page"
    done = release(models, runs, models["mxfp4"], "--plots", page, cand=cand, ref=ref)
    assert done.returncode in (0, 1), done.stderr
    assert f"report: {cand / 'report.md'} and {cand / 'report.json'}" in done.stdout
    assert f"page: {page / 'report.html'}" in done.stdout
    first = tree(tmp_path)
    # another policy (a --margin override), another checkpoint and run: refused, nothing written
    for more, says in ((("--margin", "arith=0.5", "--plots", page), "policy"),
                       (("--report-dir", cand, "--plots", page), "checkpoint")):
        if says == "checkpoint":
            done = release(models, runs, models["fp8"], *more, cand=ref, ref=cand, capsys=capsys)
        else:
            done = release(models, runs, models["mxfp4"], *more, cand=cand, ref=ref, capsys=capsys)
        one_line(done, str(cand / "report.json"), "another release", says, "--overwrite")
        assert tree(tmp_path) == first
    # the same release without its page would leave the page with the old verdict: refused
    one_line(release(models, runs, models["mxfp4"], cand=cand, ref=ref, capsys=capsys), str(page / "report.html"),
             f"--plots {page}")
    assert tree(tmp_path) == first
    # --overwrite replaces the report and its page together
    done = release(models, runs, models["mxfp4"], "--margin", "arith=0.5", "--plots", page, "--overwrite", "--json",
                   cand=cand, ref=ref, capsys=capsys)
    assert done.returncode in (0, 1), done.stderr
    written = json.loads(done.stdout)["written"]
    assert str(cand / "report.json") in written and str(page / "report.html") in written
    saved = json.loads((cand / "report.json").read_text())
    assert saved["provenance"]["policy"]["margin_overrides"] == {"arith": 0.5}
    assert f"<div class='word'>{saved['verdict']}</div>" in (page / "report.html").read_text()
    assert "arith=0.5" in (page / "report.html").read_text() and "arith=0.5" in (cand / "report.md").read_text()


def test_a_release_refused_for_a_missing_extra_writes_nothing(example, tmp_path):
    _, models, runs = example
    done = process("release", models["mxfp4"], "--candidate", runs / "mxfp4", "--reference", runs / "fp8", "--policy",
                   POLICY, "--report-dir", tmp_path / "report", "--plots", tmp_path / "page",
                   prelude="sys.modules['matplotlib'] = None; ")  # as on a core install
    one_line(done, "pip install 'quantgate[evals]'")
    assert not (tmp_path / "report").exists() and not (tmp_path / "page").exists()


def test_two_runs_recorded_before_checkpoints_were_identified_by_shards_are_still_one_checkpoint(example, capsys,
                                                                                                  tmp_path):
    _, _, runs = example
    for i, name in enumerate(("old-a", "old-b")):  # run.json as an older quantgate wrote it: the manifest's sha256
        shutil.copytree(runs / "mxfp4", tmp_path / name)
        run = json.loads((tmp_path / name / "run.json").read_text())
        del run["checkpoint_sha256"]
        run |= {"checkpoint_manifest_sha256": "ab" * 32, "created_unix": run["created_unix"] + i}
        (tmp_path / name / "run.json").write_text(json.dumps(run))
    code, _, err = gate(capsys, "accuracy", "--candidate", tmp_path / "old-a", "--reference", tmp_path / "old-b",
                        "--policy", POLICY)
    refused(code, err, "evaluated the same checkpoint", "checkpoint_manifest_sha256")
