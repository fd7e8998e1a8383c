"""The public sglang load incidents of 2025-2026, each rebuilt from headers as a tiny checkpoint with
the names, expert counts and exclude lists its report gives, and replayed on the releases it hit
(exit 1 naming the mechanism and the failing release range) and on the releases that fixed it (exit 0).
The rules come from the family folders' sglang.yaml, read in every release 0.5.9 .. 0.5.23.
"""

from __future__ import annotations

import json
import shutil

import pytest

from quant.recipe import load_recipe, with_overrides
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
    findings = report["engines"]["sglang 0.5.9"]["findings"]
    assert any("model.layers.0.self_attn.kv_b_proj" in f["module"] for f in findings)
    assert not report["engines"]["sglang 0.5.11..0.5.12"]["findings"]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """Qwen3.5 MoE (Gated DeltaNet + full attention, a shared expert of the routed experts' size, one MTP
    layer): quantgate's default MXFP4 (the MTP experts MXFP4 beside the draft's other mtp.* modules listed
    in exclude) and the way out, --mtp-experts bf16 (the whole draft bf16, every mtp.* module listed)."""
    root = tmp_path_factory.mktemp("qwen35")
    write_family_checkpoint(root / "bf16", "qwen3_5_moe", num_hidden_layers=4)
    write_planned(root / "bf16", root / "default", load_recipe())
    write_planned(root / "bf16", root / "draft_bf16", with_overrides(load_recipe(), mtp_experts="bf16"))
    return root


def whole_draft_bf16(report, engine: str) -> bool:
    return any("builds the whole MTP draft bf16" in f["why"] for f in report["engines"][engine]["findings"])


def unloaded_slot(report, engine: str) -> bool:
    return any("is never loaded into the slot" in f["why"] for f in report["engines"][engine]["findings"])


def test_qwen35_default_mxfp4_draft_experts_meet_a_bf16_draft(qwen35, capsys):
    """sglang 0.5.12-0.5.20 drop the draft's Quark config when any mtp.* entry is listed (qwen3_5_mtp.py:
    _mtp_quant_config): the whole draft is built bf16 and quantgate's default MXFP4 draft experts cannot load.
    0.5.11 keeps the config; from 0.5.21 only an entry naming the draft's mlp.experts drops it."""
    code, report = run_gate(capsys, qwen35 / "default", "--engine", "sglang", "--json")
    assert code == 1
    hit = [e for e in report["engines"] if whole_draft_bf16(report, e)]
    assert [e.split(" ", 1)[1] for e in hit] == ["0.5.12..0.5.13", "0.5.14..0.5.15", "0.5.16..0.5.17", "0.5.18",
                                                  "0.5.19..0.5.20"]
    assert not report["engines"]["sglang 0.5.21..0.5.23"]["findings"]
    assert not report["engines"]["sglang 0.5.11"]["findings"]


@pytest.mark.parametrize("release", ["0.5.12.post1", "0.5.15.post1", "0.5.19"])
def test_qwen35_default_names_the_way_out(qwen35, capsys, release):
    code, text = run_gate(capsys, qwen35 / "default", "--engine", f"sglang=={release}")
    assert code == 1, text
    assert "[engine] mtp.layers.0.mlp.experts" in text and "qwen3_5_mtp.py: Qwen3_5ForCausalLMMTP.__init__" in text
    assert ("fix: keep the draft's experts bf16 too (quantize --mtp-experts bf16), "
            "or serve without the MTP draft") in text


def test_qwen35_draft_fused_without_the_shared_expert_remap_loads_wrong(qwen35, capsys):
    """sglang 0.5.18 decides fusion per runner: the bf16 draft (no quant config to veto) fuses on ROCm with aiter
    while the main model's excluded shared expert keeps the main model unfused, and the draft's loader has no
    mlp.shared_expert -> mlp.experts.N remap (added in 0.5.19): the slot is never loaded. 0.5.14-0.5.17 turn
    fusion off server-wide when the main model cannot fuse; 0.5.12-0.5.13 decide per block, like 0.5.18; in
    0.5.11 the draft keeps the Quark config, whose main-model shared-expert entries veto its blocks too."""
    code, report = run_gate(capsys, qwen35 / "draft_bf16", "--engine", "sglang", "--json")
    assert code == 1
    assert [e.split(" ", 1)[1] for e in report["engines"] if unloaded_slot(report, e)] == \
        ["0.5.12..0.5.13", "0.5.18"]
    assert [e for e in report["engines"] if report["engines"][e]["findings"]] == \
        [e for e in report["engines"] if unloaded_slot(report, e)]
    code, text = run_gate(capsys, qwen35 / "draft_bf16", "--engine", "sglang==0.5.18")
    assert code == 1
    assert ("fuses the MTP draft's shared expert into its FusedMoE as expert 4 "
            "(qwen3_5.py: can_fuse_shared_expert") in text
    assert "fix: serve with sglang 0.5.11 or sglang 0.5.14..0.5.17 or sglang >= 0.5.19, or start sglang with " \
           "--disable-shared-experts-fusion, or serve without the MTP draft" in text
    for setup in (["--disable-shared-experts-fusion"], ["--platform", "cuda"]):
        code, text = run_gate(capsys, qwen35 / "draft_bf16", "--engine", "sglang==0.5.18", *setup)
        assert code == 0, text


@pytest.fixture(scope="module")
def minimax_m3(tmp_path_factory):
    """A MiniMax-M3 MXFP4 export as the incident's: the attention stays bf16, so the exclude list names the
    lightning indexer's index_q_proj and index_k_proj; the release stores no index_v_proj, and the list does
    not name it (quantize's own list also names index_v_proj and index_qkv_proj: tests/quant/test_serve.py)."""
    root = tmp_path_factory.mktemp("minimax_m3")
    write_family_checkpoint(root / "bf16", "minimax_m3", num_hidden_layers=3)

    def stored_shards_only(qconfig):
        qconfig["exclude"] = [e for e in qconfig["exclude"] if not e.endswith(("index_v_proj", "index_qkv_proj"))]

    write_planned(root / "bf16", root / "default", load_recipe(), stored_shards_only)
    return root


@pytest.mark.parametrize("release", ["0.5.17", "0.5.18", "0.5.19"])
def test_minimax_m3_index_qkv_proj_different_quantization_schemes(minimax_m3, capsys, release):
    """sglang 0.5.17-0.5.19 map index_qkv_proj to index_q_proj, index_k_proj and index_v_proj: with the first two
    excluded and no index_v_proj to list, Quark's should_ignore_layer raises for the fused module."""
    code, text = run_gate(capsys, minimax_m3 / "default", "--engine", f"sglang=={release}")
    assert code == 1, text
    assert "[engine] language_model.model.layers.1.self_attn.index_qkv_proj" in text
    assert "different quantization schemes for ['index_q_proj', 'index_k_proj', 'index_v_proj']" in text


def test_minimax_m3_index_qkv_proj_loads_from_0_5_20(minimax_m3, capsys):
    code, report = run_gate(capsys, minimax_m3 / "default", "--engine", "sglang", "--json")
    bad = [e for e, r in report["engines"].items()
           if any("index_qkv_proj" in f["module"] for f in r["findings"])]
    assert [e.split(" ", 1)[1] for e in bad] == ["0.5.17", "0.5.18..0.5.19"]
    for release in ("0.5.20", "0.5.23"):
        code, text = run_gate(capsys, minimax_m3 / "default", "--engine", f"sglang=={release}")
        assert "index_qkv_proj" not in text, text
