"""A family is one folder: an existing family's folder copied under a new name (new family, model
type and engine model class) into a root listed in QUANTGATE_FAMILIES is read by every command, run
as real processes, with no edit to the package: its own tiny.py builds its checkpoint, ``quantize
--help`` lists it, the planner and the converter take the checkpoint, ``gate checkpoint`` replays its
own rule files, ``gate kernels`` reads its MoE, and the contract test runs every check on it. Without
the root the same checkpoint is refused as no known family, so the folder did it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quant.cli import build_parser
from quant.engines.rules import ENGINES, rule_sets
from quant.layout import FAMILIES_ENV, FAMILY_FILE, family_dirs, family_named
from tests.quant.family_checkpoints import write_family_checkpoint

# Mixtral needs no new kind of layout or rule: its copy is "a new MoE release built like Mixtral"
SOURCE, NEW, NEW_CLASS = "mixtral", "mixtral_copy", "MixtralCopyForCausalLM"
AITER = Path(__file__).parent / "quant" / "data" / "aiter_configs"  # aiter's tuned tables, as test_kernels reads


def copy_family(root: Path) -> Path:
    """``SOURCE``'s folder as ``root/NEW``: the manifest names the new family, model type and engine
    classes; its rule files list the new class (so they, not the original's, are what is replayed)
    and key their per-family values by the new family."""
    folder = root / NEW
    shutil.copytree(family_dirs()[SOURCE], folder)
    manifest = yaml.safe_load((folder / FAMILY_FILE).read_text())
    manifest.update(family=NEW, model_types=[NEW], engine_classes={e: NEW_CLASS for e in manifest["engine_classes"]})
    (folder / FAMILY_FILE).write_text(yaml.safe_dump(manifest, sort_keys=False))
    for engine in manifest["engine_classes"]:
        # values keyed by family (draft_exclude: {mixtral: none}) are keyed by the new one
        rules = yaml.safe_load((folder / f"{engine}.yaml").read_text().replace(f"{{{SOURCE}: ", f"{{{NEW}: "))
        rules["model_classes"] = [NEW_CLASS]
        (folder / f"{engine}.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    notes = (folder / "NOTES.md").read_text()  # the new family's notes start as the original's
    (folder / "NOTES.md").write_text(notes.replace(f"# {SOURCE}: ", f"# {NEW}: ", 1))
    return folder


def new_family_checkpoint(dst: Path, root: Path) -> Path:
    """A tiny checkpoint of the copied family, built by the folder's own tiny.py (config.json names the
    new model type), its architecture the new class (what a release of the new family would say)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAMILIES_ENV, str(root))
        src = write_family_checkpoint(dst, NEW)
    config = json.loads((src / "config.json").read_text())
    assert config["model_type"] == NEW
    config["architectures"] = [NEW_CLASS]
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return src


def run(*command, root: Path | None) -> subprocess.CompletedProcess:
    """``python -m <command>`` in its own process, with ``root`` as the only QUANTGATE_FAMILIES root."""
    env = {k: v for k, v in os.environ.items() if k != FAMILIES_ENV}
    if root is not None:
        env[FAMILIES_ENV] = str(root)
    return subprocess.run([sys.executable, "-m", *map(str, command)], capture_output=True, text=True, timeout=300,
                          env=env, check=False)


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """(the root holding the copied folder, a bf16 checkpoint of the new family, its MXFP4 conversion)."""
    base = tmp_path_factory.mktemp("family_folder")
    root = base / "families"
    root.mkdir()
    copy_family(root)
    src = new_family_checkpoint(base / "bf16", root)
    converted = run("quant.cli", "--to", "mxfp4", "-q", "--json", src, base / "mxfp4", root=root)
    assert converted.returncode == 0, converted.stderr
    return root, src, base / "mxfp4"


def test_quantize_help_lists_every_family_from_its_folder():
    """The help's family list is read from the folders (it was hand-written and omitted two families)."""
    text = build_parser().format_help()
    for family in map(family_named, family_dirs()):
        assert f"  {family.name} " in text and family.title and family.title in text, family.name


def test_quantize_help_still_prints_with_a_broken_family_root(tmp_path):
    """A misspelt family manifest in a listed root: the help prints, naming the file and the key."""
    (tmp_path / "typo").mkdir()
    (tmp_path / "typo" / FAMILY_FILE).write_text("family: typo\nmodel_typ: [typo]\nroles: []\n")
    shown = run("quant.cli", "--help", root=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert f"(not listed: {tmp_path / 'typo' / FAMILY_FILE}: " in shown.stdout and "'model_types'" in shown.stdout


def test_quantize_help_lists_the_copied_family(copied):
    root, _, _ = copied
    shown = run("quant.cli", "--help", root=root)
    assert shown.returncode == 0, shown.stderr
    assert f"  {NEW} " in shown.stdout and f"model_type {NEW})" in shown.stdout
    assert f"  {NEW} " not in run("quant.cli", "--help", root=None).stdout


def test_the_planner_and_converter_read_the_copied_family(copied):
    root, src, converted = copied
    planned = run("quant.cli", "--to", "mxfp4", "--dry-run", "--json", src, converted.parent / "plan", root=root)
    assert planned.returncode == 0, planned.stderr
    summary = json.loads(planned.stdout)
    assert summary["family"] == NEW and summary["by_role"]["routed_expert"]["quantize"] == 36, summary
    manifest = json.loads((converted / "conversion_manifest.json").read_text())
    assert manifest["family"] == NEW
    unknown = run("quant.cli", "--to", "mxfp4", "--dry-run", src, converted.parent / "plan", root=None)
    assert unknown.returncode == 2 and f"model_type {NEW!r}: no model family" in unknown.stderr, unknown.stderr


def test_gate_checkpoint_replays_the_copied_family_rules(copied):
    root, _, converted = copied
    checked = run("evals.cli", "checkpoint", converted, "--json", root=root)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    report = json.loads(checked.stdout)
    original = {r.id for engine in ENGINES for r in rule_sets(engine, "mixtral")}  # the copy's files are mixtral's
    assert report["ok"] and set(report["engines"]) == original, report["engines"]
    unknown = run("evals.cli", "checkpoint", converted, root=None)
    assert unknown.returncode == 2 and f"model_type {NEW!r}: no model family" in unknown.stderr, unknown.stderr


def test_gate_kernels_reads_the_copied_family(copied):
    """The MoE shape from the copy's own manifest (its experts key) and fusion from its own rule files."""
    root, _, converted = copied
    command = ("evals.cli", "kernels", converted, "--gpu", "mi355x", "--tp", "1", "--aiter-configs", AITER, "--json")
    looked_up = run(*command, root=root)
    assert looked_up.returncode in (0, 1), looked_up.stderr  # a verdict (tiny shapes are untuned), not a refusal
    shape = json.loads(looked_up.stdout)["shape"]
    assert (shape["experts"], shape["inter_dim"]) == (4, 32), shape
    assert rule_sets("sglang", "mixtral")[-1].id in shape["fusion_reason"], shape
    unknown = run(*command, root=None)
    assert unknown.returncode == 2 and f"model_type {NEW!r}: no model family" in unknown.stderr, unknown.stderr


def test_the_contract_test_checks_the_copied_family(copied):
    """The contract test's families are the discovered ones: with the root listed, every check runs on
    the copy too (convert, decode, both engines' newest releases, local evaluation where transformers
    builds the model, the full-size plan from the folder's full_size file, the folder's builder and notes)."""
    root, _, _ = copied
    contract = Path(__file__).with_name("test_family_contract.py")
    out = run("pytest", "-q", "-p", "no:cacheprovider", contract, "-k", NEW, root=root)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 6 and "failed" not in out.stdout, out.stdout[-2000:]
