"""Reading compressed-tensors and ModelOpt checkpoints from config and headers (quant.third_party)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quant.checkpoint import Checkpoint
from quant.quark_config import format_kind
from quant.third_party import CT, LABELS, MODELOPT, UnsupportedScheme, parse, read_modules, scheme_label
from quant.verify import UnreadableCheckpoint, verify
from tests.quant.family_checkpoints import write_shards
from tests.quant.third_party_checkpoints import fp8_ct, int4_ct, modelopt_config, nvfp4_ct, quantized, write_third_party

ST_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.int8: "I8", torch.float32: "F32",
             torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}

NVFP4_CT = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ["lm_head", "re:.*mlp\\.gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                      "dynamic": "local"}}}}


FLOATS = ("BF16", "F16", "F32")


def table(scheme, out, inner):
    return {row.suffix: (row.dtypes, row.shape) for row in scheme.tensors(out, inner)}


@pytest.mark.parametrize("spec, label", [
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "nvfp4"),
    ({"num_bits": 4, "type": "float", "group_size": 32, "format": "mxfp4-pack-quantized"}, "mxfp4"),
    ({"num_bits": 4, "type": "int", "group_size": 128}, "int4"),
    ({"num_bits": 4, "type": "int", "group_size": -1}, "int4"),
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, "int8"),
    ({"num_bits": 8, "type": "float"}, "fp8"),
    ({"num_bits": 8, "type": "float", "strategy": "channel"}, "fp8-channel"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, "fp8-block"),
])
def test_compressed_tensors_labels(spec, label):
    assert scheme_label(CT, spec) == label in LABELS


@pytest.mark.parametrize("algo, label", [("FP8", "fp8"), ("fp8", "fp8"), ("NVFP4", "nvfp4"),
                                         ("FP8_PER_CHANNEL_PER_TOKEN", "fp8-channel"), ("FP8_PB_WO", "fp8-block")])
def test_modelopt_labels(algo, label):
    assert scheme_label(MODELOPT, algo) == label


@pytest.mark.parametrize("fmt, spec, named", [
    (MODELOPT, "W4A8_AWQ", "W4A8_AWQ"),
    (CT, {"num_bits": 2, "type": "int", "group_size": 64}, "2-bit"),
    (CT, {"num_bits": 8, "type": "float", "group_size": 64}, "'group'"),
    (CT, {"num_bits": 4, "type": "int", "group_size": 128, "format": "marlin-24"}, "marlin-24"),
])
def test_schemes_not_read_are_refused_by_name(fmt, spec, named):
    with pytest.raises(UnsupportedScheme, match=named) as info:
        scheme_label(fmt, spec)
    assert info.value.exit_code == 2


def test_nvfp4_tensors_from_the_logical_shape():
    scheme = parse(CT, NVFP4_CT).schemes[0]
    assert table(scheme, 64, 128) == {"weight_packed": (("U8",), (64, 64)), "weight_scale": (("F8_E4M3",), (64, 8)),
                                      "weight_global_scale": (FLOATS, None), "input_global_scale": (FLOATS, None)}
    modelopt = parse(MODELOPT, {"producer": {"name": "modelopt"},
                                "quantization": {"quant_algo": "NVFP4", "group_size": 16}}).schemes[0]
    assert table(modelopt, 64, 128) == {"weight": (("U8",), (64, 64)), "weight_scale": (("F8_E4M3",), (64, 8)),
                                        "weight_scale_2": (FLOATS, None), "input_scale": (FLOATS, None)}


def test_pack_quantized_int4_asymmetric_tensors():
    config = {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "group_size": 128, "symmetric": False}}}}
    scheme = parse(CT, config).schemes[0]
    assert table(scheme, 256, 512) == {"weight_packed": (("I32",), (256, 64)),
                                       "weight_scale": (("BF16", "F16", "F32"), (256, 4)),
                                       "weight_shape": (("I64", "I32"), (2,)),
                                       "weight_zero_point": (("I32",), (32, 4))}
    assert scheme.logical_shape((256, 64)) == (256, 512)


def test_fp8_block_and_channel_scales():
    block = parse(CT, {"format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}).schemes[0]
    assert table(block, 300, 256)["weight_scale"] == (("BF16", "F16", "F32"), (3, 2))
    channel = parse(MODELOPT, {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}).schemes[0]
    assert table(channel, 300, 256) == {"weight": (("F8_E4M3",), (300, 256)), "weight_scale": (FLOATS, (300,))}


def test_compressed_tensors_matching_ignore_then_exact_regex_class():
    config = dict(NVFP4_CT, config_groups={
        **NVFP4_CT["config_groups"],
        "attn": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "float"}}})
    parsed = parse(CT, config)
    assert parsed.resolve("model.layers.1.mlp.gate") is None
    assert parsed.resolve("lm_head") is None
    assert parsed.resolve("model.layers.1.self_attn.q_proj").label == "fp8"  # a re: target before the class name
    assert parsed.resolve("model.layers.1.mlp.experts.0.up_proj").label == "nvfp4"
    assert parsed.resolve("model.layers.1.mlp.experts.0.up_proj", cls="Embedding") is None


def test_modelopt_exclude_wildcards_and_mixed_precision():
    plain = parse(MODELOPT, {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "exclude_modules": ["lm_head", "*.mlp.gate"]}})
    assert plain.resolve("model.layers.1.mlp.gate") is None
    assert plain.resolve("model.layers.1.mlp.experts.0.up_proj").label == "fp8"
    mixed = parse(MODELOPT, {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
        "model.layers.1.mlp.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16}}}})
    assert mixed.resolve("model.layers.0.self_attn.q_proj").label == "fp8"
    assert mixed.resolve("model.layers.1.mlp.experts.0.up_proj").label == "nvfp4"
    assert mixed.resolve("model.layers.1.self_attn.q_proj") is None


# --- the tensor table against compressed-tensors' own compressors ---------------------------------------

CT_SCHEMES = {
    "nvfp4": nvfp4_ct(),
    "int4-group-asym": int4_ct(symmetric=False),
    "int4-group": int4_ct(),
    "fp8-channel": fp8_ct("channel"),
    "fp8-block": fp8_ct("block"),
    "int8-channel": {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
    "fp8-tensor-static": {"format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
    "mxfp4": {"format": "mxfp4-pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}},
}


@pytest.mark.parametrize("name", CT_SCHEMES)
def test_tensor_table_is_what_compressed_tensors_writes(name):
    """Every tensor the library's compressor (and its scale initialisation) writes for a [96, 128] Linear,
    named, typed and shaped as ``Scheme.tensors`` says, and nothing else."""
    scheme = parse(CT, CT_SCHEMES[name]).schemes[0]
    weight = (torch.randn(96, 128, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    written = {suffix: (ST_DTYPES[t.dtype], tuple(t.shape)) for suffix, t in quantized(scheme, weight).items()}
    rows = scheme.tensors(96, 128)
    assert set(written) == {row.suffix for row in rows}
    for row in rows:
        dtype, shape = written[row.suffix]
        assert row.problem(dtype, shape) is None, (row.suffix, dtype, shape)
    assert scheme.logical_shape(written[scheme.weight][1]) == (96, 128)


# --- checkpoints read from their headers ----------------------------------------------------------------

QWEN_MODULES, QWEN_QUANTIZED = 52, 48  # 3 layers of 4 attention + 4 experts x 3; routers and lm_head ignored


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("third_party")
    return {
        "ct-nvfp4": write_third_party(root / "ct-nvfp4", "qwen3_moe", nvfp4_ct()),
        "ct-int4": write_third_party(root / "ct-int4", "qwen3_moe", int4_ct(symmetric=False)),
        "ct-fp8-block": write_third_party(root / "ct-fp8-block", "qwen3_moe", fp8_ct("block")),
        "mo-nvfp4-hf-only": write_third_party(root / "mo-nvfp4", "qwen3_moe", modelopt_config("NVFP4"),
                                              hf_quant_config_only=True),
        "mo-fp8": write_third_party(root / "mo-fp8", "qwen3_moe",
                                    {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head",
                                                                                                 "*.mlp.gate"]}),
    }


def modules_of(folder) -> dict:
    checkpoint = Checkpoint.open(folder)
    qconfig = checkpoint.quantization_config
    return read_modules(checkpoint.tensors(), parse(format_kind(qconfig), qconfig))


@pytest.mark.parametrize("name, label", [("ct-nvfp4", "nvfp4"), ("ct-int4", "int4"), ("ct-fp8-block", "fp8-block"),
                                         ("mo-nvfp4-hf-only", "nvfp4"), ("mo-fp8", "fp8")])
def test_each_module_read_with_its_scheme(checkpoints, name, label):
    modules, problems = modules_of(checkpoints[name])
    assert problems == []
    assert len(modules) == QWEN_QUANTIZED
    assert {m.label for m in modules.values()} == {label}
    assert modules["model.layers.1.mlp.experts.3.down_proj"].shape == (64, 32)  # [hidden, moe_intermediate]
    assert modules["model.layers.0.self_attn.q_proj"].shape == (64, 64)


@pytest.mark.parametrize("name", ["ct-nvfp4", "ct-int4", "mo-nvfp4-hf-only", "mo-fp8"])
def test_gate_checkpoint_reads_them(checkpoints, name, capsys):
    """A compressed-tensors or ModelOpt checkpoint is checked, not refused as something to dequantize; an
    hf_quant_config.json-only ModelOpt export is read as ModelOpt (not 'U8 weights but no quantization_config')."""
    report = verify(checkpoints[name], "vllm==0.34.0")
    assert (report.modules_checked, report.modules_quantized) == (QWEN_MODULES, QWEN_QUANTIZED)
    assert [f for f in report.findings if f.check in ("layout", "config")] == []


def test_newcomer_errors_in_real_processes(checkpoints):
    for name in ("ct-nvfp4", "mo-nvfp4-hf-only"):
        done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(checkpoints[name]), "--engine",
                               "vllm==0.34.0", "--json"], capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode in (0, 1), done.stderr  # checked: pass or findings, never refused
        assert "nothing to dequantize" not in done.stdout + done.stderr
        assert "no quantization_config" not in done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["modules_quantized"] == QWEN_QUANTIZED


def test_quantization_config_precedence(tmp_path, checkpoints):
    """config.json's quantization_config wins over hf_quant_config.json (which is then not even read: the
    engines read it only without one); an older compressed-tensors export's compression_config is read too."""
    folder = tmp_path / "c"
    shutil.copytree(checkpoints["mo-fp8"], folder)
    (folder / "hf_quant_config.json").write_text("not json")
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.quantization_config["quant_algo"] == "FP8"
    config = json.loads((folder / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hf_quant_config.json").unlink()
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.quantization_config["quant_algo"] == "FP8"
    assert checkpoint.quantization_config_source.endswith("config.json compression_config")


def edited(source, dst, change) -> Path:
    """A copy of checkpoint ``source`` whose tensors ``change`` edits (a dict of name -> tensor)."""
    shutil.copytree(source, dst)
    tensors = {}
    for file in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    change(tensors)
    write_shards(tensors, dst)
    return dst


EXPERT = "model.layers.1.mlp.experts.2.up_proj"


@pytest.mark.parametrize("name, change, tensor, why", [
    ("ct-nvfp4", lambda t: t.pop(f"{EXPERT}.weight_global_scale"), f"{EXPERT}.weight_global_scale", "missing"),
    ("ct-nvfp4", lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"].float()}),
     f"{EXPERT}.weight_scale", "F32[32, 4], expected F8_E4M3[32, 4]"),
    ("ct-int4", lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"][:, :1].contiguous()}),
     f"{EXPERT}.weight_scale", "BF16[32, 1], expected BF16/F16/F32[32, 2]"),
    ("ct-int4", lambda t: t.pop(f"{EXPERT}.weight_zero_point"), f"{EXPERT}.weight_zero_point", "missing"),
    ("mo-nvfp4-hf-only", lambda t: t.update({f"{EXPERT}.weight_scale_2": torch.ones(2)}),
     f"{EXPERT}.weight_scale_2", "F32[2], expected BF16/F16/F32[] or [1]"),
    ("mo-fp8", lambda t: t.update({f"{EXPERT}.weight": t[f"{EXPERT}.weight"].to(torch.int8)}), f"{EXPERT}.weight",
     "I8[32, 64] with weight_scale F32[]: no scheme of the config stores a weight so"),
])
def test_layout_findings_name_the_tensor(tmp_path, checkpoints, name, change, tensor, why):
    folder = edited(checkpoints[name], tmp_path / "bad", change)
    report = verify(folder, "vllm==0.34.0")
    layout = [f for f in report.findings if f.check == "layout"]
    assert [f.module for f in layout] == [tensor], layout
    assert why in layout[0].why


def test_an_activation_scale_missing_is_left_to_deep(tmp_path, checkpoints):
    folder = edited(checkpoints["mo-fp8"], tmp_path / "no-input", lambda t: t.pop(f"{EXPERT}.input_scale"))
    assert [f for f in verify(folder, "vllm==0.34.0").findings if f.check == "layout"] == []


def test_mixed_groups_read_per_module(tmp_path):
    config = nvfp4_ct(scheme_targets=["re:.*mlp\\.experts.*"])
    config["config_groups"]["attention"] = {"targets": ["re:.*self_attn.*"], "format": "float-quantized",
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    config["format"] = "mixed-precision"
    folder = write_third_party(tmp_path / "mixed", "qwen3_moe", config)
    modules, problems = modules_of(folder)
    assert problems == []
    assert modules["model.layers.0.self_attn.o_proj"].label == "fp8-channel"
    assert modules[EXPERT].label == "nvfp4"


@pytest.mark.parametrize("edit, named", [
    (lambda q: q["config_groups"]["group_0"].update(format="sparse-24-bitmask"), "'sparse-24-bitmask'"),
    (lambda q: q.update(format="marlin-24") or q["config_groups"]["group_0"].pop("format"), "'marlin-24'"),
    (lambda q: q.update(sparsity_config={"format": "sparse-bitmask", "targets": ["Linear"]}), "'sparse-bitmask'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "2-bit"),
    (lambda q: q.update(config_groups="all"), "config_groups"),
])
def test_configs_not_read_are_refused_in_one_line(tmp_path, checkpoints, edit, named):
    folder = tmp_path / "refused"
    shutil.copytree(checkpoints["ct-nvfp4"], folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "config.json" in lines[0], lines


def test_a_method_no_checker_reads_is_named_as_such(tmp_path, checkpoints):
    folder = tmp_path / "gptq"
    shutil.copytree(checkpoints["ct-int4"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnreadableCheckpoint, match="quant_method 'gptq' is not a format gate checkpoint reads") as info:
        verify(folder, "vllm==0.34.0")
    assert info.value.exit_code == 2


def test_modelopt_flat_config_reads_ignore_first():
    flat = parse(MODELOPT, {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                            "exclude_modules": ["model.layers.0.self_attn.q_proj"]})
    assert flat.resolve("lm_head") is None
    assert flat.resolve("model.layers.0.self_attn.q_proj").label == "fp8"
    nested = parse(MODELOPT, {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "exclude_modules": ["model.layers.0.self_attn.q_proj"]}})
    assert nested.resolve("model.layers.0.self_attn.q_proj") is None


MODELOPT_ALGOS = ["NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8"]


@pytest.mark.parametrize("algo", MODELOPT_ALGOS)
def test_tensor_table_is_what_modelopt_exports(algo):
    """Every tensor nvidia-modelopt 0.47.0's own export functions make for a [384, 256] Linear
    (third_party_checkpoints: torch/export/quant_utils.py to_quantized_weight and its QTensor classes), as
    ``Scheme.tensors`` says; the per-tensor scales are scalars ([])."""
    scheme = parse(MODELOPT, {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16}).schemes[0]
    weight = torch.randn(384, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    written = {suffix: (ST_DTYPES[t.dtype], tuple(t.shape)) for suffix, t in quantized(scheme, weight).items()}
    rows = scheme.tensors(384, 256)
    assert set(written) == {row.suffix for row in rows}
    for row in rows:
        assert row.problem(*written[row.suffix]) is None, (row.suffix, written[row.suffix])


@pytest.mark.parametrize("content, named", [
    ("{not json", "hf_quant_config.json"),
    (json.dumps({"producer": {"name": "someone-else"}, "quantization": {"bits": 4}}),
     "hf_quant_config.json: quant_method None is not a format gate checkpoint reads"),
    (json.dumps({"quantization": {"quant_algo": "W4AFP8"}}), "ModelOpt quant_algo 'W4AFP8' is not read"),
    (json.dumps({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A8_AWQ"}}),
     "hf_quant_config.json: ModelOpt quant_algo 'W4A8_AWQ' is not read"),
])
def test_a_bad_hf_quant_config_is_one_line(tmp_path, checkpoints, content, named):
    folder = tmp_path / "hf"
    shutil.copytree(checkpoints["mo-nvfp4-hf-only"], folder)
    (folder / "hf_quant_config.json").write_text(content)
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder)], capture_output=True,
                          text=True, timeout=120, check=False)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and named in lines[0], lines


def test_modelopt_layout_without_producer_is_modelopt(tmp_path, checkpoints):
    """sglang reads {"quantization": {"quant_algo": ...}} as ModelOpt whoever wrote it; so does the checker."""
    folder = tmp_path / "anon"
    shutil.copytree(checkpoints["mo-nvfp4-hf-only"], folder)
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                               "exclude_modules": ["lm_head",
                                                                                                   "*.mlp.gate"]}}))
    modules, problems = modules_of(folder)
    assert problems == [] and {m.label for m in modules.values()} == {"nvfp4"} and len(modules) == QWEN_QUANTIZED


def test_a_target_in_two_groups_is_the_later_groups():
    """compressed-tensors maps each target to one scheme, the later group's (apply_quantization_config)."""
    config = {"format": "mixed-precision", "config_groups": {
        "first": {"targets": ["Linear"], "format": "pack-quantized",
                  "weights": {"num_bits": 4, "type": "int", "group_size": 32}},
        "second": {"targets": ["Linear"], "format": "float-quantized", "weights": {"num_bits": 8, "type": "float"}}}}
    assert parse(CT, config).resolve("model.layers.0.mlp.experts.0.up_proj").label == "fp8"


NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate",
         "model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.1.down_proj",
         "model.layers.1.mlp.experts.0.up_proj", "model.layers.1.mlp.shared_expert.down_proj", "lm_head"]
RESOLVE_CONFIGS = {
    "nvfp4": nvfp4_ct(),
    "exact-ignore": nvfp4_ct(ignore=["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.experts.0.up_proj"]),
    "regex-and-class": dict(nvfp4_ct(scheme_targets=["re:.*experts.*"]), config_groups={
        **nvfp4_ct(scheme_targets=["re:.*experts.*"])["config_groups"],
        "rest": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        "named": {"targets": ["model.layers.0.self_attn.o_proj"], "weights": {"num_bits": 4, "type": "int",
                                                                               "group_size": 32}}}),
}


@pytest.mark.parametrize("name", RESOLVE_CONFIGS)
def test_resolve_is_what_compressed_tensors_applies(name):
    """Config.resolve against compressed-tensors 0.20.1's own apply_quantization_config on a model of
    Linears named as the checkpoint names them."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = torch.nn.Module()
    for dotted in NAMES:
        parent = model
        for part in dotted.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(dotted.rsplit(".", 1)[-1], torch.nn.Linear(64, 64, bias=False))
    config = RESOLVE_CONFIGS[name]
    library = QuantizationConfig.model_validate({k: v for k, v in config.items() if k != "quant_method"})
    apply_quantization_config(model, library)
    parsed = parse(CT, config)
    for dotted in NAMES:
        scheme = getattr(model.get_submodule(dotted), "quantization_scheme", None)
        want = scheme_label(CT, scheme.weights.model_dump()) if scheme is not None else None
        got = parsed.resolve(dotted)
        assert (got.label if got else None) == want, dotted
