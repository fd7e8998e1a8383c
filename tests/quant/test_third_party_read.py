"""Reading compressed-tensors and ModelOpt checkpoints from config and headers (quant.third_party)."""

from __future__ import annotations

import pytest

from quant.third_party import CT, LABELS, MODELOPT, UnsupportedScheme, parse, scheme_label

NVFP4_CT = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ["lm_head", "re:.*mlp\\.gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                      "dynamic": "local"}}}}


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
                                      "weight_global_scale": (("F32",), None),
                                      "input_global_scale": (("F32",), None)}
    modelopt = parse(MODELOPT, {"producer": {"name": "modelopt"},
                                "quantization": {"quant_algo": "NVFP4", "group_size": 16}}).schemes[0]
    assert table(modelopt, 64, 128) == {"weight": (("U8",), (64, 64)), "weight_scale": (("F8_E4M3",), (64, 8)),
                                        "weight_scale_2": (("F32",), None), "input_scale": (("F32",), None)}


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
    assert table(channel, 300, 256) == {"weight": (("F8_E4M3",), (300, 256)), "weight_scale": (("F32",), (300,))}


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
