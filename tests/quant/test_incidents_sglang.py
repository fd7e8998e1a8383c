"""The public sglang load incidents of 2025-2026, each rebuilt from headers as a tiny checkpoint with
the names, expert counts and exclude lists its report gives, and replayed on the releases it hit
(exit 1 naming the mechanism and the failing release range) and on the releases that fixed it (exit 0).
The rules come from the family folders' sglang.yaml, read in every release 0.5.9 .. 0.5.23.
"""

from __future__ import annotations

import json
import shutil

import pytest

from quant.recipe import load_recipe
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_fusion import fusion_failing, run_gate, write_planned


def failing(report) -> list[str]:
    return [e for e, r in report["engines"].items() if r["findings"]]


@pytest.fixture(scope="module")
def kimi384(tmp_path_factory):
    """quantgate's default MXFP4 conversion of a Kimi-K2.5 layout (384 routed experts, one shared
    expert kept bf16, as amd/Kimi-K2.5-MXFP4 stores it): layer 0 dense, layer 1 MoE."""
    root = tmp_path_factory.mktemp("kimi384")
    write_family_checkpoint(root / "bf16", "kimi_k25", num_hidden_layers=2, n_routed_experts=384)
    write_planned(root / "bf16", root / "default", load_recipe())
    return root


KIMI_FUSED = ["0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17"]


@pytest.mark.parametrize("release", KIMI_FUSED)
def test_kimi_bf16_shared_expert_fused_as_expert_384(kimi384, capsys, release):
    """sglang 0.5.13-0.5.17 take 384 experts under quark into shared-expert fusion without reading the
    exclude list: the bf16 shared expert is loaded into the MXFP4 expert slot 384."""
    code, text = run_gate(capsys, kimi384 / "default", "--engine", f"sglang=={release}")
    assert code == 1, text
    assert "[fusion] language_model.model.layers.1.mlp.experts" in text
    assert "as expert 384 (deepseek_v2.py: determine_num_fused_shared_experts" in text
    assert "the bf16 shared expert (language_model.model.layers.1.mlp.shared_experts." in text
    assert "fix: serve with sglang 0.5.9..0.5.12 or sglang >= 0.5.18, or start sglang with " \
           "--disable-shared-experts-fusion" in text


@pytest.mark.parametrize("release", ["0.5.9", "0.5.10.post1", "0.5.12", "0.5.18", "0.5.19", "0.5.20", "0.5.23"])
def test_kimi_loads_where_384_experts_do_not_fuse_or_the_exclude_list_vetoes(kimi384, capsys, release):
    """Before 0.5.13 the 384-expert allow-list is absent; from 0.5.18 the excluded shared expert vetoes
    fusion (kimi_k25.py: shared_experts_fusion_disable_reason -> QuarkConfig.can_fuse_shared_expert)."""
    code, text = run_gate(capsys, kimi384 / "default", "--engine", f"sglang=={release}")
    assert code == 0, text


def test_kimi_default_run_names_the_failing_range(kimi384, capsys):
    code, report = run_gate(capsys, kimi384 / "default", "--engine", "sglang", "--json")
    assert code == 1
    assert fusion_failing(report) == failing(report)
    assert [e.split(" ", 1)[1] for e in failing(report)] == ["0.5.13..0.5.14", "0.5.15", "0.5.16..0.5.17"]
    reasons = {e: r["shared_expert_fusion"]["why"] for e, r in report["engines"].items()}
    assert "not a fused configuration" in reasons["sglang 0.5.11..0.5.12"]  # 384 experts: not on the allow-list
    assert "can_fuse_shared_expert" in reasons["sglang 0.5.18"]  # the exclude list vetoes


def test_kimi_exclude_list_of_checkpoint_names_only_is_not_read_before_0_5_11(kimi384, tmp_path, capsys):
    """sglang 0.5.9 / 0.5.10 build Kimi's text model without the language_model prefix under Quark:
    an exclude list that names the modules only as the checkpoint does (language_model.model.layers.*)
    matches nothing there, so the bf16 modules meet MXFP4 parameters. quantgate's writer lists both."""
    config = json.loads((kimi384 / "default" / "config.json").read_text())
    qconfig = config["quantization_config"]
    assert "model.layers.1.mlp.shared_experts.gate_proj" in qconfig["exclude"]  # the writer's second name
    qconfig["exclude"] = [e for e in qconfig["exclude"] if not e.startswith("model.")]
    shutil.copytree(kimi384 / "default", tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    code, report = run_gate(capsys, tmp_path / "ck", "--engine", "sglang", "--json")
    assert code == 1
    assert [e.split(" ", 1)[1] for e in failing(report)][:2] == ["0.5.9", "0.5.10"]
    assert any("model.layers.0.self_attn.kv_b_proj" in f["module"] for f in report["engines"]["sglang 0.5.9"]["findings"])
    assert not report["engines"]["sglang 0.5.11..0.5.12"]["findings"]
