"""Mutation check of vLLM's per-layer Quark rules: each single change to the rule data
(manifests/engines/quark_layers.vllm.yaml) or to quant/engines/quark_layers_vllm.py must make a differential
test of tests/quant/test_quark_layers_vllm.py fail (those run the releases' own code).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_quark_layers_vllm.py [--json]

One process, the harness of mutation_compressed_tensors.py: a data mutation changes the loaded rule file
(checked against its schema again), a code mutation swaps a function's code for one compiled from the changed
source; nothing on disk changes. Prints one row per mutation (killed or SURVIVED) and the score; exit 1 under 90%.
"""

from __future__ import annotations

import sys

import quant.engines.quark_layers_vllm as qv
from tests.benchmarks.mutation_compressed_tensors import code as _code
from tests.benchmarks.mutation_compressed_tensors import data as _data
from tests.benchmarks.mutation_compressed_tensors import main
from tests.benchmarks.mutation_compressed_tensors import versions as _versions

TESTS = ["tests/quant/test_quark_layers_vllm.py"]
BUILDS_W4A8 = {"builds": "QuarkW4A8_MXFP4_FP8"}
REFUSED = {"raises": "No quark compatible scheme was found."}


def data(engine, first, rule, key, value, why):
    return _data(engine, first, rule, key, value, why, fmt="quark-layers")


def versions(engine, index, span, why):
    return _versions(engine, index, span, why, fmt="quark-layers")


def code(function, old, new, why):
    return _code(function, old, new, why, module=qv)


def built(first, table, rung, value, why):
    """Set rung ``rung`` of ``table`` (linear_built / moe_built) in the rule set starting at ``first``."""
    return data("vllm", first, table, rung, value, why)


MUTATIONS = [
    data("vllm", "0.16.0", "name_match", "plain", "exact", "0.16.0 matches a key without '*' only exactly"),
    data("vllm", "0.29.0", "name_match", "plain", "exact", "0.29.0 matches a key without '*' only exactly"),
    data("vllm", "0.16.0", "layer_type", None, "class_name", "layer_type_quant_config keyed by class name"),
    data("vllm", "0.16.0", "mixed_shards_error", None, "Shards differ in {module}.", "the shards message reworded"),
    data("vllm", "0.16.0", "moe_asked", None, "experts", "the FusedMoE asked per expert"),
    built("0.16.0", "linear_built", "mxfp4_fp8", BUILDS_W4A8, "0.16.0 builds a W4A8 Linear"),
    built("0.17.0", "linear_built", "mxfp4_fp8", {"builds": "QuarkOCP_MX"}, "0.17.0 builds a W4A8 Linear"),
    built("0.18.0", "linear_built", "mxfp4_fp8", REFUSED, "0.18.0 refuses a W4A8 Linear"),
    built("0.30.0", "linear_built", "mxfp4_fp8", REFUSED, "0.30.0 refuses a W4A8 Linear"),
    built("0.16.0", "linear_built", "mxfp4_fp8", {"raises": "No scheme."}, "0.16.0's refusal reworded"),
    built("0.16.0", "linear_built", "fp8", {"builds": "QuarkOCP_MX"}, "FP8 Linear built as OCP MX"),
    built("0.30.0", "linear_built", "mxfp4", {"builds": "QuarkW4A8_MXFP4_FP8"}, "W4A4 Linear built as W4A8"),
    built("0.16.0", "moe_built", "mxfp4_fp8", {"builds": "QuarkOCP_MX_MoEMethod"}, "0.16.0 builds W4A8 experts"),
    built("0.17.0", "moe_built", "mxfp4_fp8", {"raises": "Unsupported FusedMoe scheme"}, "0.17.0 refuses W4A8 experts"),
    built("0.30.0", "moe_built", "mxfp4_fp8", {"raises": "Unsupported FusedMoe scheme"}, "0.30.0 refuses W4A8 experts"),
    built("0.30.0", "moe_built", "fp8", {"raises": "Unsupported FusedMoe scheme"}, "0.30.0 refuses FP8 experts"),
    built("0.16.0", "moe_built", "mxfp4", {"builds": "QuarkW8A8Fp8MoEMethod"}, "W4A4 experts built as FP8"),
    versions("vllm", 2, ["0.17.1", "0.28.0"], "0.17.1 builds a W4A8 Linear"),
    versions("vllm", 2, ["0.19.0", "0.28.0"], "0.18.x refuse a W4A8 Linear"),
    versions("vllm", 0, ["0.16.0", "0.17.0"], "0.17.0 refuses W4A8 experts"),
    code("key_matches", "return name in key if", "return key in name if", "containment reversed"),
    code("key_matches", "return fnmatchcase(name, key)", "return name.startswith(key.rstrip('*'))",
         "patterns read as prefixes"),
    code("layer_spec", 'for key, spec in (qconfig.get("layer_quant_config") or {}).items():',
         'for key, spec in reversed(list((qconfig.get("layer_quant_config") or {}).items())):',
         "the last matching key wins"),
    code("layer_spec", 'return qconfig.get("global_quant_config"), ', 'return RUNGS["mxfp4"].spec(), ',
         "the global spec taken as W4A4"),
    code("matched_spec", "if any(spec != asked[0][0] for spec, _ in asked):", "if False:",
         "mixed shards never raise"),
    code("matched_spec", "name.replace(leaf, shard)", "name", "shards asked by the fused name"),
    code("decide", "fused = {} if moe else", "fused = {} if True else", "fused modules never expanded"),
    code("decide", "if rung is None:", "if False:", "a spec of no rung judged"),
    code("decide", 'if built.get("builds"):', "if True:", "nothing refused"),
    code("mapped_key", "return mapped_entry(key, mapper)", "return key", "keys never renamed by the class mapper"),
    code("asked_name", 'if role == "routed_expert" and ".experts." in module:', "if False:",
         "experts asked per expert for the unmatched keys"),
    code("unmatched_keys", "or not any(key_matches(name, held, rule[\"name_match\"]) for name in asked)]", "or False]",
         "no key ever unmatched"),
]


if __name__ == "__main__":
    sys.exit(main(MUTATIONS, TESTS, __doc__))
