"""Mutation check of sglang's compressed-tensors rules: each single change to the rule data
(manifests/engines/compressed_tensors.sglang.yaml) or to the code of quant/engines/compressed_tensors.py that
only sglang's rules reach must make tests/quant/test_compressed_tensors_sglang.py fail (it runs the releases'
own code). The mutation machinery is mutation_compressed_tensors.py's (vLLM's rules).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_compressed_tensors_sglang.py [--json]

Prints one row per mutation (killed or SURVIVED) and the score; exit 1 under 90%.
Score when written: 46/47. The survivor (WNA16 Linears from any activation format, stated at 0.5.9) is
equivalent there: until 0.5.15 an unpacked integer weight-only group refuses the whole config first.
"""

from __future__ import annotations

import sys

from tests.benchmarks.mutation_compressed_tensors import code, data, main, versions

TESTS = ["tests/quant/test_compressed_tensors_sglang.py"]
ACTIVATION_FORMATS = ["naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized"]

MUTATIONS = [
    data("sglang", "0.5.9", "ignore_match", "plain", "exact", "0.5.9 matches plain ignore entries exactly"),
    data("sglang", "0.5.9", "ignore_match", "plain", "suffix", "0.5.9 matches plain entries as dotted suffixes"),
    data("sglang", "0.5.17", "ignore_match", "plain", "contains", "0.5.17 still matches substrings"),
    data("sglang", "0.5.17", "ignore_match", "plain", "exact", "0.5.17 matches plain entries exactly"),
    data("sglang", "0.5.9", "ignore_match", "fused_first", "any", "0.5.9 honours any entry on a fused name"),
    data("sglang", "0.5.9", "group_format", None, True, "0.5.9 reads each group's format"),
    data("sglang", "0.5.17", "group_format", None, False, "0.5.17 reads the top-level format only"),
    data("sglang", "0.5.9", "activation_formats", None, [*ACTIVATION_FORMATS, "pack-quantized"],
         "0.5.9 reads pack-quantized activations"),
    data("sglang", "0.5.16", "activation_formats", None, ACTIVATION_FORMATS, "0.5.16 drops pack-quantized activations"),
    data("sglang", "0.5.9", "activation_formats", None, None, "0.5.9 reads every format's activations"),
    data("sglang", "0.5.9", "lm_head", None, "by_name", "0.5.9 quantizes a named lm_head"),
    data("sglang", "0.5.19", "lm_head", None, "unquantized", "0.5.19 keeps lm_head bf16"),
    data("sglang", "0.5.19", "lm_head", None, "scheme", "0.5.19 matches lm_head like a Linear"),
    data("sglang", "0.5.9", "mxfp4_moe", None, "before_ignore", "0.5.9 builds MXFP4 experts before ignore"),
    data("sglang", "0.5.17", "mxfp4_moe", None, "scheme", "0.5.17 asks ignore for MXFP4 experts"),
    data("sglang", "0.5.9", "wna16_moe", "args", "matched", "0.5.9 hands the WNA16 experts their own args"),
    data("sglang", "0.5.15", "wna16_moe", "args", "linear_target", "0.5.15 still reads the Linear target"),
    data("sglang", "0.5.9", "wna16_moe", "formats", ["pack-quantized", "mixed-precision", "naive-quantized"],
         "WNA16 experts built under a mixed-precision or unpacked format"),
    data("sglang", "0.5.19", "wna16_moe", "presets", ["W4A16", "W4A16_ASYM", "W8A16", "MXFP4A16", "MXFP8A16",
                                                       "FP8A16_CHANNEL"], "0.5.19 checks INT4 experts' format"),
    data("sglang", "0.5.13", "moe_schemes", None, ["W4A16", "W4A16_ASYM", "W8A16", "FP8A16_CHANNEL", "FP8",
                                                   "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4", "MXFP4A16", "MXFP8A16"],
         "0.5.13 builds asymmetric experts"),
    data("sglang", "0.5.9", "linear_formats", None, None, "a Linear built from any format"),
    data("sglang", "0.5.9", "linear_formats", None, {"*": [*ACTIVATION_FORMATS, "pack-quantized"]},
         "WNA16 Linears from any activation format"),
    data("sglang", "0.5.9", "weightless_group", None, "skipped", "a group without weights skipped"),
    data("sglang", "0.5.9", "target_match", "unmatched", "unquantized", "an unmatched Linear built bf16"),
    data("sglang", "0.5.9", "linear_schemes", None, ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8A16", "FP8",
                                                     "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4"],
         "0.5.9 builds asymmetric WNA16 Linears"),
    data("sglang", "0.5.22", "linear_schemes", None, ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8A16",
                                                      "FP8A16_CHANNEL", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4"],
         "0.5.22 refuses weight-only NVFP4 Linears"),
    data("sglang", "0.5.9", "moe_schemes", None, ["W4A16", "W8A16", "W8A8", "FP8A16_CHANNEL", "FP8", "FP8_DYNAMIC",
                                                  "FP8_BLOCK", "NVFP4", "MXFP4A16", "MXFP8A16"],
         "0.5.9 builds W8A8 int8 experts"),
    data("sglang", "0.5.16", "moe_schemes", None, ["W4A16", "W4A16_ASYM", "W8A16", "W4AFP8", "FP8A16_CHANNEL", "FP8",
                                                   "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4", "MXFP4A16", "MXFP8A16"],
         "0.5.16 refuses W4A8 experts"),
    data("sglang", "0.5.22", "moe_schemes", None, ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W4A8", "W4AFP8", "FP8",
                                                   "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "NVFP4"],
         "0.5.22 builds W8A8 int8 experts"),
    versions("sglang", 1, ["0.5.12.post1", "0.5.13.post1"], "0.5.12.post1 takes asymmetric WNA16"),
    versions("sglang", 3, ["0.5.14", "0.5.15.post1"], "0.5.14 hands the WNA16 experts their own args"),
    versions("sglang", 5, ["0.5.16", "0.5.18"], "0.5.16 matches dotted suffixes"),
    versions("sglang", 6, ["0.5.20", "0.5.21"], "0.5.19 keeps lm_head bf16"),
    versions("sglang", 7, ["0.5.21", "0.5.23"], "0.5.21 builds weight-only NVFP4"),
    code("_hit", 'if plain == "suffix" and value.endswith("." + target):',
         'if plain == "suffix" and value.endswith(target):', "a suffix without its dot"),
    code("_hit", 'if contains or plain == "contains":', "if contains:", "substring entries matched exactly"),
    code("engine_config", 'rule.get("group_format", True) and group.get("format")', 'group.get("format")',
         "each group's format always read"),
    code("engine_config", "if read is None or fmt in read", "if True", "every format's activations read"),
    code("_built", "if formats is not None and group.get(\"format\") not in formats:", "if False:",
         "a Linear built from any format"),
    code("_built", 'and group.get("top_format") not in wna16["formats"]', "and False",
         "the WNA16 experts' format unchecked"),
    code("_decide_moe", 'wna16["args"] == "linear_target" and', "False and", "the Linear target never read"),
    code("_lm_head_by_name", "target = None if skip else", "target = None if False else", "lm_head's ignore unasked"),
    code("_lm_head_by_name", '(group["weights"] or {}).get("block_structure")', "False", "block lm_head built"),
    code("_mxfp4_experts", 'if "mxfp4" in (top_format or ""):', "if False:", "MXFP4 not read from the format"),
    code("_mxfp4_experts", 'for key in ("FusedMoE", "Linear") if key in targets', "for key in ()",
         "MXFP4 not read from the Linear target"),
    code("_decide_moe", 'if rule.get("mxfp4_moe") == "before_ignore" and', "if False and",
         "MXFP4 experts asked through ignore"),
    code("decide", 'if rule["lm_head"] == "by_name":', "if False:", "lm_head by name matched like a Linear"),
]


if __name__ == "__main__":
    sys.exit(main(MUTATIONS, TESTS, __doc__))
