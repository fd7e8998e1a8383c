"""sglang's shared-expert fusion on a per-layer (mixed) Quark checkpoint: the release compares the routed and
shared experts' specs only at the layers it probes (quark.py: QuarkConfig.can_fuse_shared_expert, layer 0 from
0.5.14), so a layer further down whose shared expert sits at another rung than its routed experts still fuses,
and the shared expert meets FusedMoE slots of the routed rung. Headers-only GLM-5 checkpoints with 256 routed
experts (the fused configuration), written as the converter lays out a mixed recipe with a sensitivity file."""

from __future__ import annotations

import json

import pytest

from evals.cli import main as gate
from quant.example import tiny_config
from quant.recipe import load_recipe
from quant.rungs import RUNGS
from quant.static_scales import load_measured_inputs
from tests.conftest import write_sparse_checkpoint
from tests.quant.test_fusion import write_planned
from tests.quant.test_mixed_convert import linear_modules, write_sidecar

SHARED_AT = """\
name: layer2-experts-fp8
format: mxfp4
rules:
  - {role: routed_expert, layers: [2], action: quantize, format: fp8}
  - {role: shared_expert, layers: [2], action: quantize, format: %s}
  - {role: routed_expert, action: quantize}
  - {role: shared_expert, action: quantize}
"""


@pytest.fixture(scope="module")
def glm256(tmp_path_factory):
    """GLM-5 layout, 256 routed experts: layer 0 dense (the layer the releases probe), layers 1 and 2 MoE."""
    root = tmp_path_factory.mktemp("glm256-mixed")
    write_sparse_checkpoint(root / "bf16", tiny_config("glm_moe_dsa", num_hidden_layers=3, n_routed_experts=256),
                            shards=2)
    return root


def mixed(root, shared_rung: str, name: str, edit_qconfig=None):
    recipe = root / f"{name}.yaml"
    recipe.write_text(SHARED_AT % shared_rung)
    sidecar = write_sidecar(root / f"{name}.json", linear_modules(root / "bf16"))
    write_planned(root / "bf16", root / name, load_recipe(recipe), edit_qconfig,
                  calibration=load_measured_inputs(sidecar))
    return root / name


def gate_json(capsys, folder) -> tuple[int, dict]:
    """The exit code and the one sglang 0.5.23 engine entry of ``gate checkpoint --json``."""
    code = gate(["checkpoint", str(folder), "--engine", "sglang==0.5.23", "--json"])
    (engine,) = json.loads(capsys.readouterr().out)["engines"].values()
    return code, engine


def test_a_shared_expert_at_another_rung_than_its_layers_routed_experts_is_a_fusion_clash(glm256, capsys):
    code, report = gate_json(capsys, mixed(glm256, "mxfp4", "clash"))
    fusion = [f for f in report["findings"] if f["check"] == "fusion"]
    assert code == 1 and len(fusion) == 1, report["findings"]
    what = fusion[0]["why"] + " " + fusion[0]["fix"]
    assert fusion[0]["module"] == "model.layers.2.mlp.experts"
    assert "mxfp4 shared expert" in what and "fp8 expert slots" in what and "can_fuse_shared_expert" in what
    assert "--disable-shared-experts-fusion" in what and "routed rung (fp8)" in what


def test_a_shared_expert_at_its_layers_routed_rung_fuses_and_loads(glm256, capsys):
    code, report = gate_json(capsys, mixed(glm256, "fp8", "same"))
    assert code == 0, report["findings"]
    assert all(f["check"] != "fusion" for f in report["findings"])


def test_a_probe_layer_whose_specs_differ_vetoes_fusion(glm256, capsys):
    def probe_differs(qconfig):  # layer 0's routed experts at FP8, its shared expert at the global MXFP4
        qconfig["layer_quant_config"]["model.layers.0.mlp.experts*"] = RUNGS["fp8"].spec()
    folder = mixed(glm256, "mxfp4", "veto", probe_differs)
    code, report = gate_json(capsys, folder)
    assert all(f["check"] != "fusion" for f in report["findings"]), report["findings"]
    decision = report["shared_expert_fusion"]
    assert not decision["fused"] and "can_fuse_shared_expert" in decision["why"], decision
