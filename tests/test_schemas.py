"""Every YAML input is read by one loader against a strict schema: a misspelt key or an unknown
name is refused by the real command, exit 2, in one line naming the file, the key and the nearest
valid name, and nothing is written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quant.layout import family_named, manifests_root
from tests.evals.test_gate import binary_pair, bundle
from tests.evals.test_hostile_evals import as_process
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_hostile import one_line_error


def refused(command: list, *needles: str, env: dict | None = None, cwd: Path | None = None) -> None:
    """``command`` (a module and its arguments) run in its own process: exit 2, one line holding ``needles``."""
    out = subprocess.run([sys.executable, "-m", *map(str, command)], capture_output=True, text=True, timeout=120,
                         check=False, env=env, cwd=cwd)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    one_line_error(out.stderr, *needles)


def test_a_misspelt_recipe_role_is_refused(glm_ckpt, tmp_path):
    """A rule for ``routed_experts`` matched no tensor: the plan quantized nothing and exited 0."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("format: mxfp4\nrules:\n  - {role: routed_experts, action: quantize}\n")
    refused(["quant.cli", "--to", "mxfp4", "--recipe", recipe, glm_ckpt, tmp_path / "dst"],
            str(recipe), "rules.0.role: unknown role 'routed_experts'", "did you mean 'routed_expert'?")
    assert not (tmp_path / "dst").exists()


def test_a_misspelt_recipe_key_is_refused(glm_ckpt, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("format: mxfp4\nactivation: none\nrules:\n  - {role: routed_expert, action: quantize}\n")
    refused(["quant.cli", "--to", "mxfp4", "--dry-run", "--recipe", recipe, glm_ckpt, tmp_path / "dst"],
            str(recipe), "unknown key 'activation'", "did you mean 'activations'?")


def test_a_recipe_may_name_the_roles_of_a_family_manifest_given_by_hand(glm_ckpt, tmp_path):
    """A role only a hand-given manifest defines is valid for that run (and unknown without it)."""
    manifest = yaml.safe_load(family_named("glm_moe_dsa").path.read_text())
    manifest["roles"].insert(0, {"role": "final_norm", "pattern": r"^model\.norm\.weight$", "linear": False})
    (tmp_path / "family.yaml").write_text(yaml.safe_dump(manifest))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("format: mxfp4\nrules:\n  - {role: final_norm, action: keep}\n")
    planned = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "--dry-run", "--recipe", str(recipe),
                              "--family-manifest", str(tmp_path / "family.yaml"), str(glm_ckpt), str(tmp_path / "dst")],
                             capture_output=True, text=True, timeout=120, check=False)
    assert planned.returncode == 0, planned.stderr
    refused(["quant.cli", "--to", "mxfp4", "--dry-run", "--recipe", recipe, glm_ckpt, tmp_path / "dst"],
            "rules.0.role: unknown role 'final_norm'")


def test_a_misspelt_family_manifest_key_is_refused(tmp_path):
    """``mtp_prefx`` made ``--mtp-experts bf16`` a silent no-op on a family whose draft sits under a prefix."""
    src = write_family_checkpoint(tmp_path / "src", "qwen3_next")
    manifest = yaml.safe_load(family_named("qwen3_next").path.read_text())
    manifest["mtp_prefx"] = manifest.pop("mtp_prefix")
    (tmp_path / "family.yaml").write_text(yaml.safe_dump(manifest))
    refused(["quant.cli", "--to", "mxfp4", "--mtp-experts", "bf16", "--family-manifest", tmp_path / "family.yaml",
             src, tmp_path / "dst"], str(tmp_path / "family.yaml"), "unknown key 'mtp_prefx'",
            "did you mean 'mtp_prefix'?")
    assert not (tmp_path / "dst").exists()


def test_a_misspelt_gate_policy_key_is_refused(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("confidence: 0.95\nbenchmarks:\n  gsm8k: {margn: 0.02}\n")
    refused(["evals.cli", "plan", "--policy", policy, "--items", "gsm8k=3", "--out", tmp_path / "plan.yaml"],
            str(policy), "benchmarks.gsm8k: unknown key 'margn'", "did you mean 'margin'?")
    assert not (tmp_path / "plan.yaml").exists()


def test_a_misspelt_reference_table_key_is_refused(tmp_path):
    ref, cand = binary_pair(50, 1, 1)
    table = tmp_path / "table.yaml"
    table.write_text("model: M\nbenchmarks:\n  gsm8k: {score: 0.9, protocl: 5-shot}\n")
    refused(["evals.cli", "accuracy", "--candidate", bundle(tmp_path / "c", "gsm8k", cand), "--reference",
             bundle(tmp_path / "r", "gsm8k", ref), "--margin", "gsm8k=0.05", "--reference-table", table],
            str(table), "benchmarks.gsm8k: unknown key 'protocl'", "did you mean 'protocol'?")


@pytest.mark.parametrize("table, old, new, says", [
    ("gpus.yaml", "cu_num: 256", "cu_nmu: 256", ("gpus.mi355x: unknown key 'cu_nmu'", "did you mean 'cu_num'?")),
    ("gpus.yaml", "loads_under: [gfx950", "load_under: [gfx950",
     ("archs.rocm: unknown key 'load_under'", "did you mean 'loads_under'?")),
    ("formats.yaml", "needs_fp4: false", "need_fp4: false",
     ("formats.fp8-block: unknown key 'need_fp4'", "did you mean 'needs_fp4'?")),
])
def test_a_misspelt_kernel_table_key_is_refused(table, old, new, says, glm_ckpt, tmp_path):
    """The kernel tables ship with the package: a copy of its manifests, first on the path (and the
    working folder, which ``python -m`` puts first), stands in for it."""
    shutil.copytree(manifests_root(), tmp_path / "manifests")
    path = tmp_path / "manifests" / "kernels" / table
    path.write_text(path.read_text().replace(old, new, 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[1])])}
    refused(["evals.cli", "kernels", "--gpu", "mi355x", "--tp", "8", glm_ckpt], str(path), *says, env=env,
            cwd=tmp_path)


def test_a_misspelt_plan_key_is_refused(glm_ckpt, tmp_path):
    plan = tmp_path / "plan.yaml"
    assert as_process("main", "plan", "--policy", "arith-example", "--items", "arith=3", "--out", plan).returncode < 2
    plan.write_text(plan.read_text().replace("seeds:", "sedes:"))
    out = as_process("evals_main", "run", "--benchmarks", "arith", "--model", glm_ckpt, "--out", tmp_path / "out",
                     "--plan", plan)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    one_line_error(out.stderr, str(plan), "benchmarks.arith: unknown key 'sedes'", "did you mean 'seeds'?")
    assert not (tmp_path / "out").exists()
