"""Each supported MoE family end to end on a tiny checkpoint named as its Hugging Face release stores
it (``tests/quant/family_checkpoints.py``: transformers' own modeling class, saved): ``quantize --to
mxfp4`` / ``--to fp8`` convert it, only routed experts become MXFP4, ``gate checkpoint`` replays the
rules read for the family's model classes (and refuses a release not read for them), and a layout
that is not the release's is refused naming the tensors."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from evals.cli import main as gate
from quant.cli import main as quantize
from quant.engines.rules import release_states
from quant.layout import family_for
from tests.quant.family_checkpoints import built_families, tiny_builder, write_family_checkpoint

# gpt-oss writes its release's own MXFP4 layout (no Quark exclude list) and refuses --to fp8:
# tests/quant/test_gpt_oss.py. MiMo-V2-Flash's MXFP4 experts do not load in sglang 0.5.21-0.5.23, so quantize
# refuses them there: tests/quant/test_engine_mimo_v2_flash.py
FAMILIES = sorted(set(built_families()) - {"gpt_oss", "mimo_v2_flash"})
# Per family: exclude entries the engines need beyond the checkpoint's own names, and whether
# sglang 0.5.23 on the default setup (MI355X, TP 8, fusion on) loads the routed-only MXFP4 output.
EXPECT = {
    # sglang's Quark mapping for Glm4MoeForCausalLM has no qkv_proj; the draft is model.decoder.*
    "glm4_moe": {"aliases": ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
                             "model.decoder.self_attn.qkv_proj"], "sglang_default_loads": False},
    # dots.note: sglang builds the text model under thinker.language_model (no mapper for the exclude list)
    # and the draft under model.heads.0, fusing q_a_proj, kv_a_proj_with_mqa and g_proj; vLLM's mapper renames
    # every model.* entry, so its draft (model.layers.3.*) is reached by re: entries only
    "dots3_note": {"aliases": ["thinker.language_model.model.layers.1.self_attn.fused_qkv_a_g_proj_with_mqa",
                               "thinker.language_model.model.layers.1.mlp.shared_experts.gate_up_proj",
                               "model.heads.0.decoder.self_attn.fused_qkv_a_g_proj_with_mqa", "model.heads.0.eh_proj",
                               "model.layers.1.self_attn.fused_qkv_a_proj", r"re:model\.layers\.3\.eh_proj$"],
                   "sglang_default_loads": True},
    # vLLM builds the router with the quant config: it must be listed
    "qwen3_moe": {"aliases": ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate"],
                  "sglang_default_loads": True},
    # K-EXAONE: sglang has no qkv_proj in its Quark mapping; the draft under vLLM's mtp.* (mtp.fc built with the
    # quant config) and sglang's model.layers.0.* (main layer 0's names); the shared expert is never fused
    "exaone_moe": {"aliases": ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                               "model.layers.1.mlp.shared_experts.gate_up_proj", "mtp.layers.0.self_attn.qkv_proj",
                               "mtp.layers.0.mlp.gate_up_proj", "mtp.fc"], "sglang_default_loads": True},
    # sglang builds Mixtral's layers under layers.N (no model.), and has no qkv_proj shards mapping
    "mixtral": {"aliases": ["layers.0.self_attn.qkv_proj", "layers.2.self_attn.o_proj", "model.layers.0.self_attn.q_proj"],
                "sglang_default_loads": True},
    # Hunyuan-V4: the MLA a-projections and the MLP gate_up_proj by their fused names (sglang's and vLLM's), the
    # MTP layer model.mtp_layers.0.* also under the drafts' own names (sglang model.decoder.* / model.eh_proj, vLLM
    # model.layers.3.*); neither engine fuses the shared expert (sglang: its SwiGLU limit is routed-only)
    "hy_v4": {"aliases": ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa",
                          "model.layers.0.self_attn.fused_qkv_a_proj",
                          "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.0.mlp.gate_up_proj",
                          "model.decoder.self_attn.fused_qkv_a_proj_with_mqa", "model.eh_proj",
                          "model.layers.3.self_attn.linear_gate", "model.layers.3.mlp.shared_experts.gate_up_proj"],
              "sglang_default_loads": True},
    # vLLM builds MiniMax-M2's MoE block under mlp.* (its router: model.layers.N.mlp.gate)
    "minimax_m2": {"aliases": ["model.layers.0.mlp.gate", "model.layers.0.block_sparse_moe.gate",
                               "model.layers.0.self_attn.qkv_proj"], "sglang_default_loads": True},
    # vLLM looks the MLA's fused_qkv_a_proj up by its fused name (no mapping); the draft is self_attn.* / mlps.* /
    # eh_proj in sglang (built without a prefix) and model.layers.{2 * num_layers}.* in vLLM
    "longcat_flash": {"aliases": ["model.layers.0.self_attn.1.fused_qkv_a_proj", "model.layers.0.mlps.1.gate_up_proj",
                                  "model.layers.0.mlp.router.classifier", "self_attn.fused_qkv_a_proj_with_mqa",
                                  "mlps.gate_up_proj", "eh_proj", "model.layers.6.self_attn.fused_qkv_a_proj",
                                  "model.layers.6.mlp.gate_up_proj"], "sglang_default_loads": True},
    # sglang's DeepSeek text model replaces the Quark mapping (no gate_up_proj); vLLM names the
    # projector linear_1/2 and builds the vision tower with the quant config
    "kimi_k25": {"aliases": ["language_model.model.layers.0.mlp.gate_up_proj",
                             "language_model.model.layers.1.mlp.shared_experts.gate_up_proj", "mm_projector.linear_1",
                             "vision_tower.encoder.blocks.0.wqkv"], "sglang_default_loads": True},
    # sglang builds the vision MLPs with the Quark config (the vision attention and projector without);
    # the dense and shared-expert gate_up_proj and qkv_proj are listed by their fused names too
    "llama4": {"aliases": ["vision_model.model.layers.0.mlp.fc1", "vision_model.patch_embedding.linear",
                           "vision_model.vision_adapter.mlp.fc2", "language_model.model.layers.0.feed_forward.gate_up_proj",
                           "language_model.model.layers.1.feed_forward.shared_expert.gate_up_proj",
                           "language_model.model.layers.1.feed_forward.router"], "sglang_default_loads": True},
    # sglang builds MiniMax-M3's MoE block as mlp.* and its indexer as index_qkv_proj; vLLM renames the
    # projector and patch merger under vision_tower and the tower's mlp.fc1 to fc1. sglang fuses the
    # shared expert on MI355X whatever the exclude list says (as for GLM-4.5); vLLM's MTP draft is
    # model.layers.0.* (eh_proj with the quant config)
    "minimax_m3": {"aliases": ["language_model.model.layers.1.mlp.shared_experts.gate_up_proj",
                               "language_model.model.layers.1.self_attn.index_qkv_proj",
                               "language_model.model.layers.1.mlp.gate", "vision_tower.multi_modal_projector.linear_1",
                               "vision_tower.patch_merge_mlp.linear_2", "vision_tower.vision_model.encoder.layers.0.fc1",
                               "model.layers.0.eh_proj", "model.layers.0.self_attn.qkv_proj"],
                   "sglang_default_loads": False, "fused_moe": "language_model.model.layers.1.mlp.experts"},
    # the MTP draft under both engines' names (vLLM mtp.*, sglang model.layers.0.*: main layer 0's),
    # vLLM's draft fc; sglang does not fuse the excluded shared expert (quark.py: can_fuse_shared_expert)
    # Qwen3.5 MoE: the Gated DeltaNet projections by their packed names, the vision tower (vLLM builds it
    # with the quant config), the draft under mtp.* in both engines with vLLM's quantizable mtp.fc; sglang
    # fuses the shared expert only on ROCm with aiter, and not when it is excluded
    "qwen3_5_moe": {"aliases": ["model.language_model.layers.0.linear_attn.in_proj_qkvz",
                                "model.language_model.layers.0.linear_attn.in_proj_ba",
                                "model.language_model.layers.1.self_attn.qkv_proj",
                                "model.language_model.layers.0.mlp.shared_expert.gate_up_proj",
                                "model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1",
                                "mtp.layers.0.self_attn.qkv_proj", "mtp.fc"], "sglang_default_loads": True},
    # Qwen4-Exp: Qwen3.5's packed names, the PLE's key/value projections by vLLM's packed kv_proj, the
    # draft under mtp.* in both engines with sglang's top-level fc_embedding / fc_hidden; sglang fuses the
    # shared expert only on ROCm with aiter, and not when it is excluded
    "qwen4_exp": {"aliases": ["model.language_model.layers.0.linear_attn.in_proj_qkvz",
                              "model.language_model.layers.1.self_attn.qkv_proj",
                              "model.language_model.layers.0.ple.kv_proj", "mtp.layers.0.self_attn.qkv_proj",
                              "mtp.layers.0.mlp.shared_expert.gate_up_proj", "fc_embedding", "fc_hidden"],
                  "sglang_default_loads": True,
                  # vLLM 0.32.0-0.33.0 do not shift a Quark list's draft entries to the draft's layers (NOTES.md)
                  "vllm_args": ["--no-speculative"]},
    # DeepSeek-V4: sglang builds layers.N.attn/ffn as model.layers.N.self_attn/mlp (wq_a + wkv fused as
    # wqkv_a, the shared expert's w1/w3 as gate_up_proj), vLLM keeps attn/ffn and fuses fused_wqa_wkv;
    # the compressors and the indexer's weights_proj are built bf16 by both (listed anyway); sglang fuses
    # the shared expert only with --enforce-shared-experts-fusion
    "deepseek_v4": {"aliases": ["model.layers.1.self_attn.wqkv_a", "model.layers.1.mlp.shared_experts.gate_up_proj",
                                "model.layers.1.attn.fused_wqa_wkv", "model.layers.1.ffn.shared_experts.gate_up_proj",
                                "model.layers.1.ffn.shared_experts.down_proj", "model.layers.0.mlp.gate",
                                "model.layers.1.attn.indexer.wq_b", "lm_head"], "sglang_default_loads": True},
    # Step-3.7-Flash: sglang builds the text model under language_model.model.* (the MoE block under mlp.*, the
    # shared expert share_expert.*) and maps qkv_proj to no shards; vLLM builds the shared expert under moe.* and
    # the vision tower with the quant config (its mlp.c_fc renamed fc1); neither fuses the shared expert
    "step3p7": {"aliases": ["language_model.model.layers.0.self_attn.qkv_proj",
                            "language_model.model.layers.1.share_expert.gate_up_proj",
                            "language_model.model.layers.1.moe.share_expert.gate_up_proj",
                            "language_model.model.layers.0.self_attn.g_proj",
                            "vision_model.transformer.resblocks.0.mlp.fc1",
                            "vit_large_projector", "language_model.lm_head"], "sglang_default_loads": True},
    # GLM-5.3-Flash: the KDA q/k/v and MLA a-projections by their fused names, the draft under sglang's
    # model.decoder.* / model.eh_proj and vLLM's model.layers.3.*, the stored fused vision qkv also by the
    # shards sglang 0.5.20 looks up under its built name; sglang fuses the shared expert on CUDA only
    "glm5_next": {"aliases": ["model.language_model.layers.0.self_attn.qkv_proj",
                              "model.language_model.layers.1.self_attn.fused_qkv_a_proj_with_mqa",
                              "model.language_model.layers.1.mlp.shared_experts.gate_up_proj",
                              "model.decoder.self_attn.fused_qkv_a_proj_with_mqa", "model.eh_proj",
                              "model.layers.3.eh_proj", "visual.blocks.0.attn.q_proj"], "sglang_default_loads": True},
    "qwen3_next": {"aliases": ["model.layers.1.self_attn.qkv_proj", "mtp.layers.0.self_attn.qkv_proj",
                               "model.layers.0.self_attn.qkv_proj", "mtp.fc",
                               "model.layers.0.mlp.shared_expert.gate_up_proj"], "sglang_default_loads": True},
}


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = write_family_checkpoint(root / "bf16", family)
    outputs = {}
    for to in ("mxfp4", "fp8"):
        assert quantize(["--to", to, str(src), str(root / to)]) == 0
        outputs[to] = root / to
    return family, src, outputs


def dtypes(folder) -> dict[str, str]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({name: str(f.get_slice(name).get_dtype()) for name in f.keys()})  # noqa: SIM118
    return out


def run_gate(capsys, *args) -> tuple[int, str]:
    code = gate(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_mxfp4_quantizes_routed_experts_only(converted):
    family, src, outputs = converted
    config = json.loads((src / "config.json").read_text())
    roles = family_for(config)
    stored = dtypes(outputs["mxfp4"])
    packed = {n.removesuffix(".weight") for n, d in stored.items() if d == "U8" and n.endswith(".weight")}
    routed = {n.removesuffix(".weight") for n in stored if n.endswith(".weight")
              and roles.classify(n, roles.text_config(config)[roles.num_layers_key]).role == "routed_expert"}
    assert routed and packed == routed
    exclude = json.loads((outputs["mxfp4"] / "config.json").read_text())["quantization_config"]["exclude"]
    # every unquantized fused module is listed by its fused name too, in the draft's names as well
    assert set(EXPECT[family]["aliases"]) <= set(exclude)


def test_fp8_converts_and_loads_in_both_engines(converted, capsys):
    family, _, outputs = converted
    stored = dtypes(outputs["fp8"])
    assert any(d == "F8_E4M3" for d in stored.values())
    for engine in ("sglang==0.5.23", "sglang==0.5.21", "vllm"):
        code, text = run_gate(capsys, outputs["fp8"], "--engine", engine)
        assert code == 0 and "verdict: loads correctly" in text, text


def test_mxfp4_gate_is_the_engines_fusion_answer(converted, capsys):
    """glm4_moe, minimax_m3: sglang 0.5.21-0.5.23 fuse GLM-4.5's (MiniMax-M3's) shared expert on MI355X whatever the exclude list
    says (glm4_moe.py: shared_experts_fusion_disable_reason): the bf16 shared expert cannot load into
    the MXFP4 FusedMoE, so the default setup fails and --disable-shared-experts-fusion loads. Families
    without a shared expert load on the default setup. vLLM loads both."""
    family, _, outputs = converted
    code, text = run_gate(capsys, outputs["mxfp4"], "--engine", "sglang==0.5.23")
    if EXPECT[family]["sglang_default_loads"]:
        assert code == 0 and "verdict: loads correctly" in text, text
    else:
        fused_moe = EXPECT[family].get("fused_moe", "model.layers.1.mlp.experts")
        assert code == 1 and f"[fusion] {fused_moe}" in text and "--disable-shared-experts-fusion" in text
    code, text = run_gate(capsys, outputs["mxfp4"], "--engine", "sglang==0.5.23", "--disable-shared-experts-fusion")
    assert code == 0 and "verdict: loads correctly" in text, text
    code, text = run_gate(capsys, outputs["mxfp4"], "--engine", "vllm", *EXPECT[family].get("vllm_args", ()))
    assert code == 0 and "verdict: loads correctly" in text, text


def test_qwen3_router_must_be_excluded_for_vllm(tmp_path, capsys):
    """vLLM builds Qwen3-MoE's router (GateLinear) with the quant config: without its exclude entry the
    bf16 router meets an MXFP4 slot; sglang builds it without quant config and does not care."""
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_moe")
    assert quantize(["--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.endswith(".mlp.gate")]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 1 and "model.layers.1.mlp.gate" in text and "meets an MXFP4 slot" in text, text
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "sglang==0.5.22")
    assert code == 0, text


def test_qwen3_dense_layers_load_in_vllm_only(tmp_path, capsys):
    """mlp_only_layers: vLLM builds those layers dense; sglang 0.5.21-0.5.23 build every layer MoE and
    skip the dense weights (silently wrong): quantize warns, gate checkpoint fails sglang only."""
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_moe", mlp_only_layers=[0])
    assert quantize(["--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    assert "builds every layer MoE" in capsys.readouterr().out
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "sglang==0.5.23")
    assert code == 1 and "mlp_only_layers" in text and "serve with vLLM" in text
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 0, text


def test_a_release_not_read_for_the_family_is_refused(converted, capsys):
    """A window release neither read nor carried for the family's class is refused in one line naming the
    family; a family read over the whole window is asked for a release before it (refused as off the window)."""
    family, _, outputs = converted
    unread = next((v for v, s in release_states("sglang", family).items() if s.state not in ("read", "carried")), None)
    code, text = run_gate(capsys, outputs["mxfp4"], "--engine", f"sglang=={unread or '0.5.8'}")
    assert code == 2 and (family in text if unread else "not a registry release in the window" in text), text
    assert len(text.strip().splitlines()) == 1 and "Traceback" not in text


def test_a_state_dict_layout_names_the_tensors_matching_no_role(tmp_path, capsys):
    """transformers' in-memory layout (fused 3-D experts) is not the release's: refused, naming them."""
    import torch
    from safetensors.torch import save_file

    build = tiny_builder("glm4_moe").build
    config, model_class = build(3)
    save_file({k: v.contiguous() for k, v in model_class(config).to(torch.bfloat16).state_dict().items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [model_class.__name__]}))
    code = quantize(["--to", "mxfp4", "--dry-run", str(tmp_path), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "match no role of family glm4_moe" in err and "model.layers.1.mlp.experts.gate_up_proj" in err


def test_an_unknown_model_type_names_the_families_and_how_to_add_one(tmp_path, capsys):
    write_family_checkpoint(tmp_path / "src", "glm4_moe", num_hidden_layers=2)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "model_type": "step5_moe"}))
    code = quantize(["--to", "mxfp4", "--dry-run", str(tmp_path / "src"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "'step5_moe'" in err
    for known in ("glm4_moe", "glm_moe_dsa", "deepseek_v3"):
        assert known in err
    assert "engine_classes" in err and "QUANTGATE_FAMILIES" in err and "sglang.yaml, vllm.yaml" in err


def test_mixtral_needs_the_layers_names_in_sglang(tmp_path, capsys):
    """Without the layers.N.* entries (the names sglang's MixtralModel builds its layers under), sglang
    builds the attention MXFP4 over bf16 weights; vLLM, which looks up model.layers.N.*, still loads."""
    src = write_family_checkpoint(tmp_path / "bf16", "mixtral")
    assert quantize(["--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.startswith("layers.")]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "sglang==0.5.21")
    assert code == 1 and "layers.0.self_attn.qkv_proj" in text and "meets an MXFP4 slot" in text, text
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 0, text


def _kimi_without(tmp_path, drop) -> object:
    src = write_family_checkpoint(tmp_path / "bf16", "kimi_k25")
    assert quantize(["--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not drop(e)]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    return tmp_path / "mxfp4"


def test_kimi_needs_the_fused_gate_up_names_in_sglang(tmp_path, capsys):
    """Without the gate_up_proj entries, sglang (whose DeepSeek text model replaced the Quark mapping
    with its own, without gate_up_proj) builds the shared experts and the dense MLP MXFP4 over bf16
    weights; vLLM, which maps gate_up_proj to its shards, still loads."""
    out = _kimi_without(tmp_path, lambda e: e.endswith(".gate_up_proj"))
    for release in ("sglang==0.5.21", "sglang==0.5.23"):
        code, text = run_gate(capsys, out, "--engine", release)
        assert code == 1 and "language_model.model.layers.1.mlp.shared_experts.gate_up_proj" in text, text
        assert "language_model.model.layers.0.mlp.gate_up_proj" in text, text
    code, text = run_gate(capsys, out, "--engine", "vllm")
    assert code == 0, text


def test_kimi_vision_tower_must_be_excluded_for_vllm(tmp_path, capsys):
    """Without the vision tower's and projector's entries, vLLM (which builds them with the Quark
    config, projector renamed linear_1/2) builds them MXFP4 over bf16 weights; sglang never quantizes them."""
    out = _kimi_without(tmp_path, lambda e: e.startswith(("vision_tower.", "mm_projector.")))
    code, text = run_gate(capsys, out, "--engine", "vllm")
    assert code == 1 and "vision_tower.encoder.blocks.0.wqkv" in text and "mm_projector.linear_1" in text, text
    code, text = run_gate(capsys, out, "--engine", "sglang==0.5.23")
    assert code == 0, text


@pytest.mark.parametrize(("edit", "expect"), [
    ({"scoring_func": None}, "config.scoring_func as an attribute"),
    ({"use_routing_bias": False}, "config.use_routing_bias is False"),
    ({"num_mtp_modules": 0}, "num_mtp_modules"),
], ids=["no-scoring_func", "bias-off", "mtp-count"])
def test_minimax_config_keys_the_engines_read(tmp_path, capsys, edit, expect):
    """MiniMax-M2's config.json keys beyond transformers' class: scoring_func (read as an attribute by
    both engines), use_routing_bias (whether the router bias exists), num_mtp_modules (the MTP modules
    the engines skip); a config that drops or contradicts one is refused by both engines."""
    src = write_family_checkpoint(tmp_path / "bf16", "minimax_m2")
    assert quantize(["--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config.update({k: v for k, v in edit.items() if v is not None})
    for key in [k for k, v in edit.items() if v is None]:
        del config[key]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    for engine in ("sglang==0.5.22", "vllm"):
        code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", engine)
        assert code == 1 and expect in text, text


def test_mxfp6_and_back_to_bf16(converted, tmp_path):
    """--to mxfp6_e2m3 converts every family; --to bf16 decodes the MXFP4 output back to the source's
    names, shapes and dtypes (routed experts decoded, the rest copied)."""
    _, src, outputs = converted
    assert quantize(["--to", "mxfp6_e2m3", "-q", str(src), str(tmp_path / "mxfp6")]) == 0
    assert any(d == "U8" for d in dtypes(tmp_path / "mxfp6").values())
    assert quantize(["--to", "bf16", "-q", str(outputs["mxfp4"]), str(tmp_path / "back")]) == 0
    back, source = dtypes(tmp_path / "back"), dtypes(src)
    assert back == source
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def _qwen3_next_without(tmp_path, drop, **edit) -> object:
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_next")
    assert quantize(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not drop(e)]
    config.update({k: v for k, v in edit.items() if v is not None})
    for key in [k for k, v in edit.items() if v is None]:
        del config[key]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    return tmp_path / "mxfp4"


def test_qwen3_next_draft_needs_each_engines_names(tmp_path, capsys):
    """sglang builds the mtp.* draft as model.layers.0.* (qwen3_next_mtp.py) and never looks up
    mtp.*; vLLM builds it under mtp.*, fc with the quant config. Without the model.layers.0.self_attn
    entries sglang builds the draft's attention MXFP4 over bf16 weights; without mtp.fc vLLM does the
    same to the fc; each other engine still loads."""
    out = _qwen3_next_without(tmp_path, lambda e: e.startswith("model.layers.0.self_attn.") or e == "mtp.fc")
    code, text = run_gate(capsys, out, "--engine", "sglang==0.5.23")
    assert code == 1 and "model.layers.0.self_attn.qkv_proj" in text and "meets an MXFP4 slot" in text, text
    assert "mtp.fc" not in text
    code, text = run_gate(capsys, out, "--engine", "vllm")
    assert code == 1 and "mtp.fc" in text and "self_attn" not in text, text


def test_qwen3_next_draft_experts_kept_otherwise_than_layer_0_are_refused(tmp_path, capsys):
    """--mtp-experts bf16 with MXFP4 main experts: sglang's draft experts are main layer 0's names in
    one exclude list, so no list loads both: refused before writing, exit 2, naming both."""
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_next")
    capsys.readouterr()  # transformers' save progress
    code = quantize(["--to", "mxfp4", "--mtp-experts", "bf16", "--dry-run", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "mtp.layers.0.mlp.experts." in err and "model.layers.0.mlp.experts." in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("edit", "fails", "expect"), [
    ({"full_attention_interval": None}, "sglang==0.5.22", "config.full_attention_interval is None"),
    ({"layer_types": ["full_attention", "linear_attention", "linear_attention"]}, "vllm",
     "model.layers.0"),
], ids=["no-interval", "layer_types-contradict"])
def test_qwen3_next_layer_kinds_each_engine_computes(tmp_path, capsys, edit, fails, expect):
    """sglang builds each layer linear or full attention from full_attention_interval (an attribute:
    a config.json without it fails), vLLM from layer_types: a config whose kinds are not the
    checkpoint's layers fails the engine that reads it, and only that one."""
    out = _qwen3_next_without(tmp_path, lambda e: False, **edit)
    for engine in ("sglang==0.5.22", "vllm"):
        code, text = run_gate(capsys, out, "--engine", engine)
        if engine == fails:
            assert code == 1 and expect in text, text
        else:
            assert code == 0, text


def test_a_nested_text_config_declaring_a_billion_layers_is_refused_in_one_line(tmp_path, capsys):
    """The counts under text_config are checked like the top level's (quantize reads its layers there)."""
    src = write_family_checkpoint(tmp_path / "bf16", "kimi_k25", num_hidden_layers=2)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 10**9
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = quantize(["--to", "mxfp4", "--dry-run", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"text_config.num_hidden_layers is {10**9}" in err and len(err.strip().splitlines()) == 1, err


def test_qwen3_5_vision_tower_and_draft_fc_must_be_excluded_for_vllm(tmp_path, capsys):
    """vLLM builds Qwen3.5's vision tower and the draft's mtp.fc with the Quark config (qwen3_5.py,
    qwen3_5_mtp.py): without their entries it builds them MXFP4 over bf16 weights; sglang builds the
    tower without quant config and the fc as a plain nn.Linear, and still loads."""
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_5_moe")
    assert quantize(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not (e.startswith("model.visual.") or e == "mtp.fc")]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 1 and "model.visual.blocks.0.attn.qkv" in text and "mtp.fc" in text, text
    for engine in ("sglang==0.5.23", "sglang==0.5.21"):
        code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", engine)
        assert code == 0, text


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4_own")
    src = write_family_checkpoint(root / "bf16", "deepseek_v4")
    for to in ("mxfp4", "fp8"):
        assert quantize(["--to", to, str(src), str(root / to)]) == 0
    return src, {to: root / to for to in ("mxfp4", "fp8")}


def test_deepseek_v4_checkpoint_named_exclude_loads_from_sglang_0_5_22_only(deepseek_v4, capsys, tmp_path):
    """sglang 0.5.22 and 0.5.23 rename a Quark checkpoint's exclude list with DeepSeek-V4's
    _QUARK_CKPT_TO_SGLANG_MAPPER (layers.N.attn. -> model.layers.N.self_attn.); 0.5.21 has no mapper and
    matches the list as written, so entries in the checkpoint's names only keep nothing bf16 there.
    vLLM renames them with the class's hf_to_vllm_mapper (layers. -> model.layers.)."""
    import shutil

    _, outputs = deepseek_v4
    folder = shutil.copytree(outputs["mxfp4"], tmp_path / "ckpt_names")
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    qc["exclude"] = [e for e in qc["exclude"] if not e.startswith("model.") and e != "lm_head"]
    (folder / "config.json").write_text(json.dumps(config))
    code, text = run_gate(capsys, folder, "--engine", "sglang==0.5.21")
    assert code == 1 and "model.layers.0.self_attn.wqkv_a" in text and "meets an MXFP4 slot" in text, text
    for engine in ("sglang==0.5.22", "sglang==0.5.23", "vllm"):
        code, text = run_gate(capsys, folder, "--engine", engine)
        assert code == 0 and "verdict: loads correctly" in text, (engine, text)


def test_deepseek_v4_fp8_names_its_expert_dtype_and_bf16_drops_it(deepseek_v4, tmp_path):
    """vLLM's DeepseekV4FP8Config gives a deepseek_v4 FP8 checkpoint's routed experts Mxfp4MoEMethod
    unless config.expert_dtype is "fp8" (models/deepseek_v4/quant_config.py): --to fp8 writes it,
    --to mxfp4 does not, --to bf16 of the FP8 conversion drops it again; the hyper-connection tensors
    and the hash table are copied as stored."""
    src, outputs = deepseek_v4
    assert json.loads((outputs["fp8"] / "config.json").read_text())["expert_dtype"] == "fp8"
    assert "expert_dtype" not in json.loads((outputs["mxfp4"] / "config.json").read_text())
    assert quantize(["--to", "bf16", str(outputs["fp8"]), str(tmp_path / "bf16")]) == 0
    assert "expert_dtype" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    source, fp8 = dtypes(src), dtypes(outputs["fp8"])
    kept = [n for n in source if ".hc_" in n or n.startswith("hc_") or n.endswith("tid2eid")]
    assert kept and all(fp8[n] == source[n] for n in kept)



def _fp8_with_bf16_wo_a(src, fp8, folder):
    """A copy of DeepSeek-V4's FP8 conversion with each decoder layer's attn.wo_a put back to the
    source's bf16 (its weight_scale_inv dropped) and listed in modules_to_not_convert, as a recipe
    keeping wo_a bf16 would write it."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(fp8, folder)
    source = {}
    for file in src.glob("*.safetensors"):
        source.update(load_file(file))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    kept, total = [], 0
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if n.startswith("layers.") and ".attn.wo_a." in n]:
            del tensors[name]
            index["weight_map"].pop(name)
            if name.endswith(".weight"):
                tensors[name] = source[name]
                index["weight_map"][name] = file.name
                kept.append(name.removesuffix(".weight"))
        save_file(tensors, str(file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index["metadata"]["total_size"] = total
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    qc["modules_to_not_convert"] += kept + [k.replace("layers.", "model.layers.", 1).replace(".attn.", ".self_attn.")
                                            for k in kept]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "conversion_manifest.json").unlink()
    return folder, kept


def test_deepseek_v4_fp8_with_bf16_wo_a_fails_sglang_only(deepseek_v4, capsys, tmp_path):
    """sglang 0.5.21-0.5.23 build DeepSeek-V4's wo_a with the FP8 config under 128x128 blocks whatever
    modules_to_not_convert says (models/deepseek_v4.py MqaAttentionBase.__init__, wo_a_fp8_gemm_enabled):
    an FP8 conversion keeping wo_a bf16 fails there (load_weights' ValueError), and gate checkpoint names
    wo_a; vLLM builds wo_a governed by the list and loads it."""
    src, outputs = deepseek_v4
    folder, kept = _fp8_with_bf16_wo_a(src, outputs["fp8"], tmp_path / "bf16_wo_a")
    assert kept == sorted(kept) and len(kept) == 3  # layers 0..2
    for engine in ("sglang==0.5.21", "sglang==0.5.22", "sglang==0.5.23"):
        code, text = run_gate(capsys, folder, "--engine", engine)
        assert code == 1, (engine, text)
        assert "model.layers.0.self_attn.wo_a" in text and "SGLANG_OPT_FP8_WO_A_GEMM" in text, (engine, text)
        assert "self_attn.wo_b" not in text and "[layout]" not in text, text
    code, text = run_gate(capsys, folder, "--engine", "vllm")
    assert code == 0 and "verdict: loads correctly" in text, text


def test_deepseek_v4_fp8_recipe_keeping_attention_bf16_is_refused(deepseek_v4, tmp_path, capsys):
    """quantize refuses an FP8 recipe that keeps DeepSeek-V4's attention bf16: sglang builds wo_a FP8
    regardless (the replay of every release runs on the plan); the message names wo_a and the way out."""
    src, _ = deepseek_v4
    recipe = tmp_path / "fp8-no-attention.yaml"
    recipe.write_text("name: fp8-no-attention\nformat: fp8\nrules:\n  - {role: attention, action: keep}\n"
                      "  - {role: shared_expert, action: quantize}\n  - {role: routed_expert, action: quantize}\n")
    code = quantize(["--to", "fp8", "--recipe", str(recipe), str(src), str(tmp_path / "out")])
    text = capsys.readouterr().err
    assert code != 0 and not (tmp_path / "out").exists(), text
    assert "self_attn.wo_a" in text and "SGLANG_OPT_FP8_WO_A_GEMM" in text and "Traceback" not in text, text


def test_minimax_m3_vllm_draft_needs_its_own_names(tmp_path, capsys):
    """vLLM's MiniMaxM3MTP draft (--speculative-config method mtp) builds language_model.model.mtp.layers.0.*
    as model.layers.0.* and matches the exclude list against those names (nvidia/mtp.py, amd/mtp.py:
    _map_checkpoint_name; the target's quant config, no mapper of its own). quantize writes each MTP
    module's bf16 entry in both names; with the stored names only (quantgate's list before the draft was
    replayed) vLLM builds the draft's attention, shared expert and eh_proj MXFP4 over bf16 weights, the
    Wafer write-up's failure. sglang builds no draft from them: its verdict does not change."""
    src = write_family_checkpoint(tmp_path / "bf16", "minimax_m3")
    assert quantize(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    assert {"model.layers.0.eh_proj", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
            "model.layers.0.block_sparse_moe.shared_experts.gate_up_proj"} <= set(exclude)
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 0 and "verdict: loads correctly" in text, text
    _, sglang_before = run_gate(capsys, tmp_path / "mxfp4", "--engine", "sglang==0.5.23")
    config["quantization_config"]["exclude"] = [e for e in exclude if not e.startswith("model.layers.")]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    code, text = run_gate(capsys, tmp_path / "mxfp4", "--engine", "vllm")
    assert code == 1 and "meets an MXFP4 slot" in text, text
    for name in ("model.layers.0.eh_proj", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                 "model.layers.0.block_sparse_moe.shared_experts.gate_up_proj",
                 "model.layers.0.block_sparse_moe.shared_experts.down_proj"):
        assert f"PROBLEM  [engine] {name}\n" in text, (name, text)
    assert "language_model.model.layers" not in text
    assert run_gate(capsys, tmp_path / "mxfp4", "--engine", "sglang==0.5.23")[1] == sglang_before
