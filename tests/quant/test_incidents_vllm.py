"""vLLM load incidents rebuilt as tiny checkpoints, caught from headers on the releases they happened in
and passing on the releases that fixed them (the rule data: manifests/engines/vllm.yaml)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from evals.cli import main as gate
from quant.convert import convert
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides

BEFORE_CHECK_CHILDREN = ["vllm 0.16.0", "vllm 0.17.0..0.19.1", "vllm 0.20.0..0.23.0", "vllm 0.24.0..0.25.1"]


@pytest.fixture(scope="module")
def per_expert_mtp_excludes(glm_ckpt, tmp_path_factory):
    """GLM-5 MXFP4 with the MTP layer's experts kept bf16 and excluded per expert only
    (model.layers.3.mlp.experts.N.down_proj ...: no model.layers.3.mlp.experts entry), as AMD's
    GLM-5.x MXFP4 exports list them."""
    dst = tmp_path_factory.mktemp("incident") / "mtp_per_expert"
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), mtp_experts="bf16")), dst, show_progress=False)
    config = json.loads((dst / "config.json").read_text())
    qconfig = config["quantization_config"]
    qconfig["exclude"] = [e for e in qconfig["exclude"] if not e.endswith("mlp.experts")]
    assert any(e.startswith("model.layers.3.mlp.experts.") for e in qconfig["exclude"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def run(capsys, *args) -> tuple[int, str]:
    code = gate(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("release", ["0.16.0", "0.19.1", "0.23.0", "0.25.1"])
def test_per_expert_mtp_excludes_crash_before_check_children(per_expert_mtp_excludes, release, capsys):
    # quark/utils.py should_ignore_layer asks only the aggregate model.layers.3.mlp.experts, which no
    # entry names: the FusedMoE is built MXFP4 and the bf16 experts do not fit it
    code, out = run(capsys, per_expert_mtp_excludes, "--engine", f"vllm=={release}", "--json")
    assert code == 1, out
    (result,) = json.loads(out)["engines"].values()
    assert [(f["module"], f["why"].split(":")[0]) for f in result["findings"]] == \
        [("model.layers.3.mlp.experts", "bf16 experts meet an MXFP4 FusedMoE")]


@pytest.mark.parametrize("release", ["0.26.0", "0.29.0", "0.33.0", "0.34.0"])
def test_per_expert_mtp_excludes_load_from_0_26_0(per_expert_mtp_excludes, release, capsys):
    # check_children: an entry starting with '<experts>.' excludes the routed experts
    code, out = run(capsys, per_expert_mtp_excludes, "--engine", f"vllm=={release}")
    assert code == 0, out


def test_default_run_names_the_failing_vllm_releases(per_expert_mtp_excludes):
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(per_expert_mtp_excludes), "--json",
                           "--engine", "vllm"], capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert sorted(e for e, r in report["engines"].items() if not r["ok"]) == BEFORE_CHECK_CHILDREN
    assert all(r["ok"] for e, r in report["engines"].items() if e not in BEFORE_CHECK_CHILDREN)


def test_the_aggregate_entry_is_the_way_out(per_expert_mtp_excludes, tmp_path, capsys):
    fixed = tmp_path / "fixed"
    shutil.copytree(per_expert_mtp_excludes, fixed)
    config = json.loads((fixed / "config.json").read_text())
    config["quantization_config"]["exclude"].append("model.layers.3.mlp.experts")
    (fixed / "config.json").write_text(json.dumps(config))
    assert run(capsys, fixed, "--engine", "vllm==0.16.0")[0] == 0


@pytest.fixture(scope="module")
def weight_only(glm_ckpt, tmp_path_factory):
    dst = tmp_path_factory.mktemp("w4a16") / "mxfp4_w4a16"
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), weight_only=True)), dst, show_progress=False)
    return dst


def test_mx_weight_only_needs_0_17_0(weight_only, capsys):
    # 0.16.0's QuarkConfig._is_ocp_mx asks OCP MX of the weight and the input_tensors (W4A4 only);
    # 0.17.0's _is_w_ocp_mx_a_x asks it of the weight alone
    code, out = run(capsys, weight_only, "--engine", "vllm==0.16.0", "--json")
    (result,) = json.loads(out)["engines"].values()
    assert code == 1 and [f["module"] for f in result["findings"]] == ["global_quant_config.input_tensors"], out
    assert run(capsys, weight_only, "--engine", "vllm==0.17.0")[0] == 0
