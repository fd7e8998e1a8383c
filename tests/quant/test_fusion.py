"""sglang's shared-expert fusion and the loaders' dequantize paths, on the incidents' checkpoints.

Fusion needs 256 (or, for Quark, 384) routed experts and one shared expert, so these checkpoints
are headers only (holes on disk) at tiny widths: what quantgate writes for the recipe, planned
from a sparse bf16 source. The rules come from manifests/engines/sglang.yaml;
tests/quant/test_engine_sources.py runs the releases' own fusion functions beside them.
"""

from __future__ import annotations

import json

import pytest

from evals.cli import main as gate
from quant.engines import Module, ReplayContext, replay, rule_sets
from quant.engines.serving import serving
from quant.example import tiny_config
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from quant.safetensors_io import encode_header
from tests.conftest import write_sparse_checkpoint


def write_planned(src, dst, recipe, edit_qconfig=None, calibration=None):
    """quantgate's output for ``recipe`` as headers over holes (the converter's exact layout); ``calibration``:
    a sensitivity file's measurements, for a mixed recipe's static input scales."""
    plan = make_plan(src, recipe, calibration=calibration)
    dst.mkdir()
    for shard in plan.shards:
        header, _ = encode_header(shard.entries)
        with open(dst / shard.file, "wb") as f:
            f.write(header)
            f.truncate(shard.output_size)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(s.output_size for s in plan.shards)}, "weight_map": plan.weight_map()}))
    config = plan.output_config()
    if edit_qconfig:
        edit_qconfig(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.json").write_text("{}")
    return plan


@pytest.fixture(scope="module")
def glm256(tmp_path_factory):
    """GLM-5 layout with 256 routed experts: layer 0 dense, layer 1 MoE, MTP layer 2."""
    root = tmp_path_factory.mktemp("glm256")
    write_sparse_checkpoint(root / "bf16", tiny_config("glm_moe_dsa", num_hidden_layers=2, n_routed_experts=256),
                            shards=2)
    return root


@pytest.fixture(scope="module")
def default_recipe(glm256):
    plan = write_planned(glm256 / "bf16", glm256 / "default", load_recipe())
    return glm256 / "default", plan


@pytest.fixture(scope="module")
def draft_case(glm256):
    write_planned(glm256 / "bf16", glm256 / "draft", with_overrides(load_recipe(), shared_experts="mxfp4",
                                                                      mtp_experts="bf16"))
    return glm256 / "draft"


def run_gate(capsys, *args):
    code = gate(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in args else out.out + out.err)


def fusion_failing(report) -> list[str]:
    return [e for e, r in report["engines"].items() if any(f["check"] == "fusion" for f in r["findings"])]


def test_default_recipe_fails_on_0_5_16_and_0_5_17_names_fusion_and_both_ways_out(default_recipe, capsys):
    ck, _ = default_recipe
    for release in ("0.5.16", "0.5.17"):
        code, text = run_gate(capsys, ck, "--engine", f"sglang=={release}")
        assert code == 1, text
        assert f"sglang {release} (rules of 0.5.16..0.5.17): 1 problem(s)" in text
        assert "[fusion] model.layers.1.mlp.experts" in text and "fuses the main model's shared expert" in text
        assert "the bf16 shared expert (model.layers.1.mlp.shared_experts.gate_proj) meets the FusedMoE's MXFP4" in text
        assert "fix: serve with sglang >= 0.5.18, or start sglang with --disable-shared-experts-fusion" in text
    for release in ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"):
        assert run_gate(capsys, ck, "--engine", f"sglang=={release}")[0] == 0, release
    code, report = run_gate(capsys, ck, "--json")
    assert code == 1
    # 0.5.9-0.5.15 fuse the draft's bf16 shared expert too (its class still fuses); 0.5.16's GLM
    # draft class never does.
    assert fusion_failing(report) == ["sglang 0.5.9", "sglang 0.5.10", "sglang 0.5.11..0.5.12",
                                      "sglang 0.5.13..0.5.14", "sglang 0.5.15", "sglang 0.5.16..0.5.17"]
    assert [f["module"] for f in report["engines"]["sglang 0.5.15"]["findings"]] == \
        ["model.layers.1.mlp.experts", "model.decoder.mlp.experts"]
    assert [f["module"] for f in report["engines"]["sglang 0.5.16..0.5.17"]["findings"]] == \
        ["model.layers.1.mlp.experts"]
    assert all(r["ok"] for e, r in report["engines"].items() if e.startswith("vllm"))


def test_the_serving_setup_decides(default_recipe, capsys):
    ck, _ = default_recipe
    at = ("--engine", "sglang==0.5.17")
    assert run_gate(capsys, ck, *at, "--disable-shared-experts-fusion")[0] == 0
    assert run_gate(capsys, ck, *at, "--gpu-arch", "gfx90a")[0] == 0  # below gfx942: no fusion
    assert run_gate(capsys, ck, *at, "--gpu-arch", "gfx942", "--ep", "8")[0] == 1  # ROCm fuses under EP too
    assert run_gate(capsys, ck, *at, "--platform", "cuda")[0] == 1
    assert run_gate(capsys, ck, *at, "--platform", "cuda", "--ep", "8")[0] == 0  # CUDA: not under EP
    assert run_gate(capsys, ck, *at, "--platform", "cuda", "--gpu-arch", "sm75")[0] == 0
    assert run_gate(capsys, ck, *at, "--tp", "2", "--pp", "2")[0] == 1  # a TP dividing the tiny model's 2 heads
    code, report = run_gate(capsys, ck, *at, "--json")
    loads = {(c["gpu_arch"], c["ep"], c["disable_shared_experts_fusion"]): c["loads"]
             for c in report["engines"]["sglang 0.5.17 (rules of 0.5.16..0.5.17)"]["loads_under"]}
    assert report["serving"] == {"platform": "rocm", "gpu_arch": "gfx950", "tp": 8, "pp": 1, "ep": 1,
                                 "disable_shared_experts_fusion": False, "gpu": "mi355x", "speculative": True,
                                 "check_tp": False}
    assert not loads[("gfx950", 1, False)] and loads[("gfx950", 1, True)] and loads[("sm90", 8, False)]
    assert not loads[("sm80", 1, False)] and loads[("sm75", 1, False)] and not loads[("gfx942", 8, False)]
    code, text = run_gate(capsys, ck, *at)
    assert "fails on  rocm gfx950 (ep 1, ep 8); rocm gfx942 (ep 1, ep 8); cuda sm100 (ep 1)" in text
    code, text = run_gate(capsys, ck, "--platform", "cuda", "--gpu-arch", "gfx950")
    assert code == 2 and "--gpu-arch 'gfx950' is not a cuda GPU" in text
    assert run_gate(capsys, ck, "--ep", "0")[0] == 2


def test_the_planner_warns_instead_of_refusing(default_recipe):
    _, plan = default_recipe
    warning = next(w for w in plan.warnings if w.startswith("shared-expert fusion"))
    assert "sglang 0.5.9-0.5.17 fold the shared expert" in warning
    assert "Ways out: serve sglang 0.5.18-0.5.23; start sglang with --disable-shared-experts-fusion, or store each " \
           "MoE layer's shared and routed experts in one dtype (--shared-experts, --mtp-experts)" in warning
    assert not any("disables sglang's shared-expert fusion" in w for w in plan.warnings)
    assert "on ROCm gfx942+, CUDA sm80+ (TP, fusion on" in warning  # DeepseekV2's determine_num_fused_shared_experts


@pytest.mark.parametrize("family,gpus", [("glm4_moe", "ROCm gfx942+, CUDA sm80+"), ("minimax_m3", "ROCm gfx950+, CUDA sm80+")])
def test_the_fusion_warning_names_the_gpus_of_the_familys_own_class(family, gpus, tmp_path):
    """Each class decides fusion by its own rule: MiniMax-M3's fuses on ROCm only from gfx950
    (minimax_m3_vl.py: _is_gfx95_supported), GLM-4.5's from gfx942 (glm4_moe.py)."""
    from tests.quant.family_checkpoints import write_family_checkpoint

    plan = make_plan(write_family_checkpoint(tmp_path / "bf16", family), load_recipe())
    warning = next(w for w in plan.warnings if w.startswith("shared-expert fusion"))
    assert f"on {gpus} (TP, fusion on" in warning, warning


def test_draft_with_mxfp4_shared_and_bf16_routed_experts(draft_case, capsys):
    """The draft's routed experts are excluded (bf16 FusedMoE); its MXFP4 shared expert is fused
    into it where the draft class fuses: 0.5.9-0.5.15 and 0.5.22+ (fused_shared_experts_architecture)."""
    code, report = run_gate(capsys, draft_case, "--engine", "sglang", "--json")
    assert code == 1
    assert fusion_failing(report) == ["sglang 0.5.9", "sglang 0.5.10", "sglang 0.5.11..0.5.12",
                                      "sglang 0.5.13..0.5.14", "sglang 0.5.15", "sglang 0.5.22..0.5.23"]
    finding = report["engines"]["sglang 0.5.22..0.5.23"]["findings"][0]
    assert finding["module"] == "model.decoder.mlp.experts" and "the MTP draft's shared expert" in finding["why"]
    assert "the MXFP4 shared expert (model.layers.2.mlp.shared_experts.gate_proj) meets the FusedMoE's bf16" in \
        finding["why"]
    assert finding["fix"].startswith("serve with sglang 0.5.16..0.5.21, or start sglang with "
                                     "--disable-shared-experts-fusion")
    for release, code in (("0.5.15", 1), ("0.5.15.post1", 1), ("0.5.16", 0), ("0.5.21", 0), ("0.5.23", 1)):
        assert run_gate(capsys, draft_case, "--engine", f"sglang=={release}")[0] == code, release


def test_post_releases_name_the_rules_they_follow(draft_case, capsys):
    code, text = run_gate(capsys, draft_case, "--engine", "sglang==0.5.10.post1", "--disable-shared-experts-fusion")
    assert code == 0 and "sglang 0.5.10.post1 (rules of 0.5.10): OK" in text
    code, text = run_gate(capsys, draft_case, "--engine", "sglang==0.5.16.post1")
    assert code == 2 and "sglang 0.5.16.post1 is not a registry release in the window" in text


def test_kimi_k2_384_experts_with_a_regex_shared_expert_exclude(tmp_path, capsys):
    """sglang #25740: Kimi-K2.5-MXFP4 (DeepseekV3ForCausalLM, 384 experts) with the shared experts
    excluded by ``re:.*shared_experts.*`` fails in _load_w13 once fusion takes 384-expert Quark
    checkpoints (0.5.13); from 0.5.18 the entry vetoes fusion."""
    write_sparse_checkpoint(tmp_path / "bf16", tiny_config("deepseek_v3", num_hidden_layers=2, n_routed_experts=384),
                            shards=2)

    def regex(q):
        q["exclude"] = [e for e in q["exclude"] if "shared_experts" not in e] + ["re:.*shared_experts.*"]

    write_planned(tmp_path / "bf16", tmp_path / "kimi", load_recipe(), regex)
    code, report = run_gate(capsys, tmp_path / "kimi", "--engine", "sglang", "--json")
    assert code == 1
    assert fusion_failing(report) == ["sglang 0.5.13..0.5.14", "sglang 0.5.15", "sglang 0.5.16..0.5.17"]
    assert "RuntimeError" not in json.dumps(report["engines"]["sglang 0.5.18"])


def _indexer_case(quantized: bool) -> dict[str, Module]:
    prefix = "model.layers.0.self_attn.indexer."
    return {prefix + "wk": Module(quantized, (128, 256), "indexer"),
            prefix + "weights_proj": Module(False, (32, 256), "indexer"),
            prefix + "wq_b": Module(False, (4096, 256), "indexer")}


@pytest.mark.parametrize("rules", [r for e in ("sglang", "vllm") for r in rule_sets(e)], ids=lambda r: r.id)
def test_indexer_wk_where_the_loaders_dequantize_it(rules):
    """An FP8 block wk loads where wk is built bf16 and the loader dequantizes it (sglang 0.5.15+ on
    CUDA: _load_fused_indexer_wk; vLLM 0.20.0+: _try_load_fp8_indexer_wk); an MXFP4 wk does not (vLLM before
    0.20.0 builds wk with the quant config: both load)."""
    fp8 = {"quant_method": "fp8", "modules_to_not_convert": [
        "model.layers.0.self_attn.indexer.weights_proj", "model.layers.0.self_attn.indexer.wq_b"]}
    quark = {"quant_method": "quark", "exclude": list(fp8["modules_to_not_convert"])}
    cuda, rocm = serving("cuda"), serving("rocm")
    config = {"indexer_rope_interleave": True}
    modules = _indexer_case(True)
    for setup in (cuda, rocm):
        assert replay(ReplayContext(rules, modules, fp8, "glm_moe_dsa", 1, "fp8", "FP8", config, setup)) == [], setup
    vllm_bf16 = rules.engine == "vllm" and rules["indexer"]["wk"] == "bf16"  # on every platform
    wk_bf16_on_cuda = vllm_bf16 or rules["indexer"]["wk_fused_bf16_on_cuda"]

    def on(config, setup):
        return replay(ReplayContext(rules, modules, quark, "glm_moe_dsa", 1, "quark", "MXFP4", config, setup))

    on_cuda = [f.module for f in on(config, cuda)]
    assert on_cuda == (["model.layers.0.self_attn.indexer.wk"] if wk_bf16_on_cuda else [])
    on_rocm = [f.module for f in on(config, rocm)]
    assert on_rocm == (["model.layers.0.self_attn.indexer.wk"] if vllm_bf16 else [])
    # is_neox_style (indexer_rope_interleave false) keeps wk separate and quantized on CUDA too
    neox = on({"indexer_rope_interleave": False}, cuda)
    assert bool(neox) == vllm_bf16
    unset = on({}, cuda)  # getattr(..., False)
    assert bool(unset) == vllm_bf16


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_release_read_has_exactly_one_rule_set(engine):
    from quant.engines import select
    from quant.engines.rules import releases_read

    for release in releases_read(engine):
        assert len(select(f"{engine}=={release}")) == 1, release
