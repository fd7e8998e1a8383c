"""Mutation check of sglang's per-layer Quark rules: each single change to the rule data
(manifests/engines/quark_layers.sglang.yaml) or to the code of quant/engines/quark_layers_sglang.py must make
tests/quant/test_quark_layers_sglang.py fail (it runs the releases' own code). The mutation machinery is
mutation_compressed_tensors.py's.

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_quark_layers_sglang.py [--json]

Prints one row per mutation (killed or SURVIVED) and the score; exit 1 under 90%.
Not listed, as no config tells it apart: shared_fusion_reason comparing an empty layer_quant_config (both probes
then reach the same spec unless layer_type_quant_config names the probe's stub class, Module); the order of
the scheme lists (their predicates are disjoint but for block FP8, whose place is a mutation here).
"""

from __future__ import annotations

import sys

import quant.engines.quark_layers_sglang as qls
from tests.benchmarks.mutation_compressed_tensors import code as _code
from tests.benchmarks.mutation_compressed_tensors import data as _data
from tests.benchmarks.mutation_compressed_tensors import main
from tests.benchmarks.mutation_compressed_tensors import versions as _versions

# the differential and rule tests (the real-process ones take minutes per mutation)
TESTS = ["tests/quant/test_quark_layers_sglang.py", "-k",
         "not gate_checkpoint and not hand_written and not serve_refuses and not alias"]
FUSION_0_5_14 = {"compares": True, "bases": ["model.layers.0", "model.language_model.layers.0"],
                 "leaves": ["gate_proj", "up_proj", "gate_up_proj", "down_proj"], "shared": "shared_expert"}


def data(first, rule, key, value, why):
    return _data("sglang", first, rule, key, value, why, fmt="quark-layers")


def versions(index, span, why):
    return _versions("sglang", index, span, why, fmt="quark-layers")


def code(function, old, new, why):
    return _code(function, old, new, why, module=qls)


MUTATIONS = [
    data("0.5.9", "keys_mapped", None, True, "0.5.9 maps the layer_quant_config keys"),
    data("0.5.21", "keys_mapped", None, False, "0.5.21 keeps the keys as written"),
    data("0.5.9", "expert_entries", None, True, "0.5.9 resolves a FusedMoE from per-expert keys"),
    data("0.5.21", "expert_entries", None, False, "0.5.21 ignores per-expert keys"),
    data("0.5.9", "linear_schemes", None, ["QuarkW4A4MXFP4"], "0.5.9 builds no FP8 Linear"),
    data("0.5.9", "linear_schemes", None, ["QuarkW4A4MXFP4", "QuarkW4A8MXFp4MoE", "QuarkW8A8Fp8"],
         "a W4A8 Linear built"),
    data("0.5.9", "moe_schemes", None, ["QuarkW4A4MXFp4MoE", "QuarkW4A8MXFp4MoE", "QuarkW8A8FP8MoE"],
         "0.5.9 builds W4A8 experts"),
    data("0.5.9", "moe_schemes", None, ["QuarkW4A4MXFp4MoE"], "0.5.9 builds no FP8 experts"),
    data("0.5.15", "moe_schemes", None, ["QuarkW4A4MXFp4MoE", "QuarkW8A8FP8MoE"], "0.5.15 builds no W4A8 experts"),
    data("0.5.15", "moe_schemes", None, ["Fp8MoEMethod", "QuarkW4A4MXFp4MoE", "QuarkW4A8MXFp4MoE",
                                         "QuarkW8A8FP8MoE"], "block FP8 experts before 0.5.21"),
    data("0.5.21", "linear_schemes", None, ["QuarkW4A4MXFP4", "QuarkW8A8Fp8"], "0.5.21 builds no block FP8 Linear"),
    data("0.5.21", "moe_schemes", None, ["QuarkW4A4MXFp4MoE", "QuarkW4A8MXFp4MoE", "QuarkW8A8FP8MoE"],
         "0.5.21 builds no block FP8 experts"),
    data("0.5.9", "shared_fusion", None, FUSION_0_5_14, "0.5.9 compares the shared expert's spec"),
    data("0.5.14", "shared_fusion", "compares", False, "0.5.14 compares no specs"),
    data("0.5.14", "shared_fusion", "shared", "by_config", "0.5.14 reads shared_experts"),
    data("0.5.14", "shared_fusion", "bases", ["model.layers.0", "model.language_model.layers.0", "model.decoder"],
         "0.5.14 probes the draft block"),
    data("0.5.14", "shared_fusion", "leaves", ["gate_up_proj"], "0.5.14 probes the fused name only"),
    data("0.5.22", "shared_fusion", "shared", "shared_expert", "0.5.22 probes shared_expert only"),
    data("0.5.22", "shared_fusion", "bases", ["model.layers.0", "model.language_model.layers.0"],
         "0.5.22 probes no draft block"),
    versions(2, ["0.5.15.post1", "0.5.20"], "0.5.15 builds no W4A8 experts"),
    versions(3, ["0.5.22", "0.5.22"], "0.5.21 reads no per-expert keys"),
    versions(4, ["0.5.23", "0.5.23"], "0.5.22 probes no draft block"),
    code("_is_mx_fp4", 'inputs.get("is_dynamic") is not False', "True", "static MXFP4 activations taken"),
    code("_is_mx_fp4", 'and spec.get("scale_format") == "e8m0"', "", "MX scales of any format"),
    code("_is_mx_w4a8", 'inputs.get("dtype") in ("fp8_e4m3", "fp8_e4m3fn")', 'inputs.get("dtype") == "fp8_e4m3"',
         "fp8_e4m3fn activations refused"),
    code("_is_mx_w4a8", 'not inputs.get("is_dynamic")', "True", "dynamic FP8 activations taken for W4A8"),
    code("_is_fp8_w8a8", '("per_tensor", "per_channel")', '("per_tensor",)', "per-channel FP8 weights refused"),
    code("_is_fp8_w8a8", 'bool(inputs.get("is_dynamic")) or ', "", "dynamic FP8 activations refused"),
    code("_is_block_fp8", 'isinstance(block, list) and len(block) == 2', "True", "block FP8 without a block size"),
    code("_is_block_fp8", 'not spec.get("output_tensors") and ', "", "block FP8 with quantized outputs"),
    code("matched", "if not all(_same(spec, found[0][0]) for spec, _ in found):", "if False:",
         "fused shards never compared"),
    code("matched", "if fnmatchcase(name, pattern):", 'if name.startswith(pattern.rstrip("*")):',
         "keys matched as prefixes"),
    code("matched", "if cls in types:", "if False:", "layer_type_quant_config unread"),
    code("matched", 'if rule.get("expert_entries") and name.endswith(".experts"):',
         'if rule.get("expert_entries"):', "any module resolved from keys under it"),
    code("_expert_entries", "missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))", "missing = []",
         "skipped experts accepted"),
    code("_expert_entries", "if any(p != first for p in by_expert.values()):", "if False:",
         "different projections per expert accepted"),
    code("_expert_entries", "if not all(_same(spec, specs[0]) for spec in specs):", "if False:",
         "experts with two specs accepted"),
    code("_built", 'if spec.get("output_tensors") or spec.get("bias"):', "if False:", "quantized outputs built"),
    code("_built", 'if SCHEMES[name].takes(spec) and name.startswith("Fp8"):', "if False:", "block FP8 never first"),
    code("held_config", 'if rule.get("keys_mapped") and mapper:', "if False:", "keys never mapped"),
    code("decide", "renamed = (draft_keys or DraftKeys()) if draft else", "renamed =",
         "the draft's keys renamed as the main model's"),
    code("draft_keys", 'if how == "glm_remap":', "if False:", "the GLM draft renames no keys"),
    code("draft_keys", 'if how.startswith("mapper_61"):', "if False:", "DeepSeek-V3's draft mapper not applied"),
    code("_glm_remapped", '"model" if any(part in key for part in _NEXTN_SPEC) else ', "",
         "the draft's own modules renamed into its block"),
    code("_glm_remapped", "if not key.startswith(prefix + \".\"):", "if not key.startswith(prefix):",
         "model.layers.30 renamed as the draft layer 3"),
    code("held_config", "if remap:", "if False:", "the remap never applied"),
    code("_same", "return set(map(repr, a)) == set(map(repr, b))", "return a == b", "lists compared in order"),
    code("shared_fusion_reason", 'return f"the probe raises: {exc}"', "return None", "a raising probe fuses"),
    code("linear_class", '"qkv_proj": "QKVParallelLinear", ', "", "qkv_proj's class unknown"),
]


if __name__ == "__main__":
    sys.exit(main(MUTATIONS, TESTS, __doc__))
