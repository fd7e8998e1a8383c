"""``gate checkpoint``: the engines' loading rules replayed on real checkpoints, and ``--to bf16``."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals.cli import main as gate
from quant.cli import main as quantize
from quant.convert import convert
from quant.example import glm5_config
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from quant.safetensors_io import encode_header
from tests.conftest import quark_convert, write_sparse_checkpoint


def run_gate(capsys, *args) -> tuple[int, dict | str]:
    code = gate(["checkpoint", *map(str, args)])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in args else out.out + out.err)


def problems(report: dict, engine: str) -> list[str]:
    return [f"{f['module']}: {f['why']}" for f in report["engines"][engine]["findings"]]


@pytest.fixture(scope="module")
def ours(glm_ckpt, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ours") / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), dst, show_progress=False)
    return dst


def edited_copy(src, dst, edit_config=None):
    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_quantgate_output_loads_in_both_engines(ours, capsys):
    code, report = run_gate(capsys, ours, "--json", "--deep")
    assert code == 0 and report["ok"]
    assert report["engines"]["sglang"]["ok"] and report["engines"]["vllm"]["ok"]
    code, text = run_gate(capsys, ours)
    assert code == 0 and "sglang: OK" in text and "vllm: OK" in text


def test_quarks_own_export_of_the_seed_fails_for_sglang_on_mtp_names(glm_ckpt, tmp_path, capsys):
    """The outage: Quark's glm_moe_dsa template plus `*shared_experts*`, as the seed ran it."""
    from quark.torch import LLMTemplate

    excludes = LLMTemplate.get("glm_moe_dsa").exclude_layers_name + ["*shared_experts*"]
    quark_convert(glm_ckpt, tmp_path / "quark", excludes)
    code, report = run_gate(capsys, tmp_path / "quark", "--json")
    assert code == 1
    sglang = problems(report, "sglang")
    assert any(p.startswith("model.decoder.mlp.shared_experts.gate_proj: bf16 weight [32, 64] (a shard of "
                            "model.decoder.mlp.shared_experts.gate_up_proj) meets an MXFP4 slot") for p in sglang)
    assert any(p.startswith("model.decoder.self_attn.q_b_proj: bf16 weight") for p in sglang)
    assert not any("model.layers.3" in p for p in sglang)  # vLLM's names are the ones Quark wrote
    vllm = problems(report, "vllm")
    assert vllm == ["model.layers.3.eh_proj: vllm builds eh_proj as a plain bf16 Linear; a U8 eh_proj cannot load"]


def test_glob_excludes_match_nothing(ours, tmp_path, capsys):
    def globify(q):
        q["exclude"] = [e for e in q["exclude"] if "shared_experts" not in e] + ["*shared_experts*"]

    code, report = run_gate(capsys, edited_copy(ours, tmp_path / "ck", globify), "--json")
    assert code == 1
    assert "*shared_experts*: glob entry: the engines match exclude entries exactly (or by re: regex), so it " \
           "matches nothing" in problems(report, "sglang")
    assert any(p.startswith("model.layers.1.mlp.shared_experts.down_proj: bf16 weight") for p in problems(report, "vllm"))


def test_re_entries_are_honoured(ours, tmp_path, capsys):
    def regex(q):
        q["exclude"] = [e for e in q["exclude"] if "shared_experts" not in e] + ["re:.*shared_experts\\."]

    code, report = run_gate(capsys, edited_copy(ours, tmp_path / "ck", regex), "--json")
    assert code == 0, report


def test_missing_scale(ours, tmp_path, capsys):
    ck = edited_copy(ours, tmp_path / "ck")
    name = "model.layers.1.mlp.experts.0.up_proj.weight_scale"
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    code, report = run_gate(capsys, ck, "--json")
    assert code == 1
    assert "model.layers.1.mlp.experts.0.up_proj.weight: U8 weight without weight_scale: the engines load it " \
           "silently as garbage" in problems(report, "sglang")


def test_per_expert_excludes_fail_in_sglang_only(glm_ckpt, tmp_path, capsys):
    dst = tmp_path / "mtp_bf16"
    convert(make_plan(glm_ckpt, with_overrides(load_recipe(), mtp_experts="bf16")), dst, show_progress=False)
    assert run_gate(capsys, dst)[0] == 0

    def drop_aggregates(q):
        q["exclude"] = [e for e in q["exclude"] if not e.endswith("mlp.experts")]

    code, report = run_gate(capsys, edited_copy(dst, tmp_path / "ck", drop_aggregates), "--json")
    assert code == 1
    assert [p.split(":")[0] for p in problems(report, "sglang")] == ["model.decoder.mlp.experts"]
    assert "RuntimeError: The size of tensor a (32) must match the size of tensor b (64)" in problems(report, "sglang")[0]
    assert report["engines"]["vllm"]["ok"]  # vLLM's check_children matches the per-expert entries


def test_partially_quantized_expert_layer(ours, tmp_path, capsys):
    ck = edited_copy(ours, tmp_path / "ck")
    name = "model.layers.2.mlp.experts.1.down_proj.weight"
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / index["weight_map"].pop(name + "_scale")
    tensors = load_file(str(shard))
    del tensors[name + "_scale"]
    tensors[name] = torch.zeros(64, 32, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    code, report = run_gate(capsys, ck, "--json")
    assert code == 1
    assert any(p.startswith("model.layers.2.mlp.experts: routed experts of one layer are partly MXFP4")
               for p in problems(report, "vllm"))


def test_truncated_shard_is_unreadable(ours, tmp_path, capsys):
    ck = edited_copy(ours, tmp_path / "ck")
    shard = ck / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    code, text = run_gate(capsys, ck)
    assert code == 2 and "model-00002-of-00003.safetensors: truncated" in text


def test_not_a_checkpoint(tmp_path, capsys):
    code, text = run_gate(capsys, tmp_path)
    assert code == 2 and "config.json: missing" in text


def test_deep_finds_unwritten_scales(ours, tmp_path, capsys):
    ck = edited_copy(ours, tmp_path / "ck")
    name = "model.layers.1.mlp.experts.3.gate_proj.weight_scale"
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][5:9] = 0  # as a hole in a sparse, never-written file would read
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert run_gate(capsys, ck)[0] == 0  # headers alone cannot see it
    code, report = run_gate(capsys, ck, "--deep", "--json")
    assert code == 1 and f"{name}: 4 all-zero scale rows (never written?)" in problems(report, "vllm")


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit):
        gate(["checkpoint", "--help"])
    text = capsys.readouterr().out
    assert "exit codes: 0" in text and "2 the input is unreadable" in text and "--deep" in text


def test_headers_only_on_a_full_size_sparse_mxfp4_layout(tmp_path, capsys):
    src = tmp_path / "bf16"
    write_sparse_checkpoint(src, glm5_config(), shards=282)
    plan = make_plan(src, load_recipe())
    dst = tmp_path / "mxfp4"
    dst.mkdir()
    for shard in plan.shards:  # the converter's exact output layout, as holes
        header, _ = encode_header(shard.entries)
        with open(dst / shard.file, "wb") as f:
            f.write(header)
            f.truncate(shard.output_size)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(s.output_size for s in plan.shards)}, "weight_map": plan.weight_map()}))
    (dst / "config.json").write_text(json.dumps(plan.output_config()))
    (dst / "tokenizer.json").write_text("{}")
    started = time.time()
    code, report = run_gate(capsys, dst, "--json")
    assert code == 0, report["engines"]
    assert report["modules_checked"] > 58368 and time.time() - started < 30


def test_dequantized_checkpoint_loads_in_transformers_close_to_bf16(glm_ckpt, ours, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert quantize(["--to", "bf16", "-q", str(ours), str(tmp_path / "deq")]) == 0
    config = json.loads((tmp_path / "deq" / "config.json").read_text())
    assert "quantization_config" not in config
    deq = load_file(str(tmp_path / "deq" / "model-00001-of-00003.safetensors"))
    assert all(t.dtype != torch.uint8 for t in deq.values()) and not any(n.endswith("_scale") for n in deq)

    # The decoded weights carry exactly the error the conversion manifest measured (measured: a decode
    # bug such as swapped nibbles or a scale off by one puts it at 1.0-1.4 instead of ~0.11).
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    original = load_file(str(glm_ckpt / "model-00001-of-00003.safetensors"))[name].float()
    error = ((deq[name].float() - original).norm() / original.norm()).item()
    manifest = json.loads((ours / "conversion_manifest.json").read_text())
    measured = next(r["quantized"][name]["rel_rms_error"] for r in manifest["shards"] if name in r["quantized"])
    assert error == pytest.approx(measured, abs=0.02) and 0.08 < error < 0.15

    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    logits = {}
    for label, path in (("bf16", glm_ckpt), ("mxfp4", tmp_path / "deq")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[label] = model(ids).logits
    diff = ((logits["mxfp4"] - logits["bf16"]).norm() / logits["bf16"].norm()).item()
    # ~11% error on every routed-expert weight of a random 3-layer model moves the logits by about
    # as much (measured: 0.118); the model loads and runs on the decoded weights.
    assert 0.02 < diff < 0.25, diff
