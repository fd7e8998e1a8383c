"""Mutation check of sglang's ModelOpt rules: each single change to the rule data
(manifests/engines/modelopt.sglang.yaml) or to the code that replays it (quant/engines/modelopt.py's sglang
parts, quant/engines/match.py's is_layer_skipped) must make a test of tests/quant/test_modelopt_sglang.py fail
(those run the releases' own functions).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_modelopt_sglang.py [--json]

One process: a data mutation changes the loaded rule file (validated against its schema again), a code
mutation swaps a function's code for one compiled from the changed source; nothing on disk changes.
Prints one row per mutation (killed or SURVIVED) and the score.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import sys
import textwrap

import pytest

import quant.engines.format_rules as fr
import quant.engines.modelopt as mo
from quant.engines import match

TESTS = ["tests/quant/test_modelopt_sglang.py"]


def data(first, rule, path, value, why):
    """Set ``rule``'s value (at ``path`` inside it, a list of keys) in the span starting at ``first``."""
    return {"kind": "data", "first": first, "rule": rule, "path": path, "value": value, "why": why}


def versions(spans, why):
    """Move span boundaries: ``spans`` maps a rule set's index to its new [first, last]."""
    return {"kind": "versions", "spans": spans, "why": why}


def code(module, function, old, new, why):
    return {"kind": "code", "module": module, "function": function, "old": old, "new": new, "why": why}


FALLBACK = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
MUTATIONS = [
    data("0.5.9", "dispatch", ["modelopt"], "parsed", "0.5.9 parses a flat modelopt config by quant_algo"),
    data("0.5.10", "dispatch", ["modelopt"], "fp8", "0.5.10 builds a flat modelopt config with the FP8 config"),
    data("0.5.18", "dispatch", ["takes", "fp8"], ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"], "0.5.18 takes FP8 per channel"),
    data("0.5.18", "dispatch", ["parsed", "FP8_PB_WO"], "fp8", "0.5.18 parses FP8_PB_WO as FP8"),
    data("0.5.9", "dispatch", ["parsed", "MXFP8"], "Fp8Config (mxfp8)", "0.5.9 builds MXFP8 natively"),
    data("0.5.19", "dispatch", ["takes", "fp4"], ["NVFP4", "NVFP4_AWQ"], "0.5.19 refuses W4A16_NVFP4"),
    data("0.5.17", "dispatch", ["takes", "fp4"], ["NVFP4"], "0.5.17 refuses NVFP4_AWQ"),
    data("0.5.23", "dispatch", ["flat_exclude_keys", "fp4"], ["ignore"], "0.5.23 reads ignore only"),
    data("0.5.23", "dispatch", ["flat_exclude_keys", "fp8"], ["ignore", "exclude_modules"],
         "0.5.23's FP8 config reads exclude_modules"),
    data("0.5.9", "skipped", ["match"], "module_path", "0.5.9 matches module paths"),
    data("0.5.9", "skipped", ["experts"], "or", "0.5.9 ors the experts test"),
    data("0.5.11", "skipped", ["strip_dots"], True, "0.5.11 strips trailing dots"),
    data("0.5.11", "skipped", ["fallback_fused"], {}, "0.5.11 has no fallback shards"),
    data("0.5.13", "skipped", ["strip_dots"], False, "0.5.13 keeps trailing dots"),
    data("0.5.13", "skipped", ["fallback_fused"], {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
         "0.5.13 falls back for qkv only"),
    data("0.5.9", "lm_head", [], True, "0.5.9 quantizes lm_head"),
    data("0.5.15", "lm_head", [], False, "0.5.15 leaves lm_head unquantized"),
    data("0.5.9", "match", [], ["glob"], "is_layer_skipped not asked"),
    data("0.5.9", "match", [], ["skipped"], "is_layer_excluded not asked"),
    data("0.5.9", "algos", ["FP8_PB_WO"], "fp8-block", "FP8_PB_WO built block-wise"),
    data("0.5.9", "moe_schemes", ["NVFP4"], "fp8", "NVFP4 experts built FP8"),
    data("0.5.9", "mapper_strips_language_model", [], False, "language_model. entries kept as written only"),
    data("0.5.9", "bf16_drafts", [], ["DeepseekV2ForCausalLM", "Glm5NextForConditionalGeneration",
                                      "Qwen3_5MoeForConditionalGeneration", "Qwen4ExpForConditionalGeneration"],
         "GLM-4.5's NextN keeps the FP4 config"),
    data("0.5.9", "bf16_drafts", [], ["DeepseekV2ForCausalLM", "Glm4MoeForCausalLM",
                                      "Glm5NextForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                      "Qwen4ExpForConditionalGeneration", "Qwen3NextForCausalLM"],
         "Qwen3-Next's MTP drops the FP4 config"),
    versions({3: ["0.5.13", "0.5.15"], 4: ["0.5.15.post1", "0.5.16"]}, "0.5.15 does not take lm_head"),
    versions({6: ["0.5.18", "0.5.19"], 7: ["0.5.20", "0.5.22"]}, "0.5.19 refuses W4A16_NVFP4"),
    code(mo, "glob_hit", "pattern.fullmatch(n) or ", "", "the whole name is not matched"),
    code(mo, "glob_hit", " or any(pattern.fullmatch(part) for part in n.split(\".\"))", "", "no dotted parts"),
    code(mo, "glob_hit", "pattern.fullmatch(n)", "pattern.match(n)", "an entry matches a name's start"),
    code(mo, "glob_hit", "[module, module.removeprefix(\"language_model.\")] if", "[module] if",
         "language_model. not stripped"),
    code(mo, "glob_hit", "if tail in MLA_FUSED and", "if False and", "MLA shard entries ignored"),
    code(mo, "excluded_by", "step == \"skipped\" and not moe and", "step == \"skipped\" and",
         "a FusedMoE asked is_layer_skipped"),
    code(mo, "sglang_config", "    if method in (\"modelopt_fp8\", \"modelopt_fp4\"):", "    if False:",
         "a named config parsed by quant_algo"),
    code(mo, "sglang_config", "(\"fp8\" if method == \"modelopt\" else None)", "None",
         "an unparsed flat modelopt config not built"),
    code(mo, "sglang_refused", "if algo not in dispatch[\"takes\"][config]:", "if False:", "from_config takes all"),
    code(mo, "decide", "if draft and rules.model_class in", "if False and rules.model_class in",
         "drafts keep the FP4 config"),
    code(match, "_module_path_match", "if strip_dots:", "if True:", "trailing dots always stripped"),
]


def _set(raw: dict, m: dict) -> None:
    if m["kind"] == "versions":
        for index, span in m["spans"].items():
            raw["rule_sets"][index]["versions"] = span
        return
    entry = next(e for e in raw["rule_sets"] if e["versions"][0] == m["first"])
    if not m["path"]:
        entry["rules"][m["rule"]]["value"] = m["value"]
        return
    target = entry["rules"][m["rule"]]["value"]
    for key in m["path"][:-1]:
        target = target[key]
    target[m["path"][-1]] = m["value"]


@contextlib.contextmanager
def mutated(m: dict):
    original_load = fr.load
    saved = None
    if m["kind"] in ("data", "versions"):
        def load(path, schema, *args, **kwargs):
            file = original_load(path, schema, *args, **kwargs)
            if (file.format, file.engine) != ("modelopt", "sglang"):
                return file
            raw = file.model_dump(exclude_unset=True)
            _set(raw, m)
            return fr.FormatFile.model_validate(raw)
        fr.load = load
    else:
        fn = getattr(m["module"], m["function"])
        source = textwrap.dedent(inspect.getsource(fn))
        assert m["old"] in source, m["why"]
        namespace = dict(vars(m["module"]))
        exec(compile(source.replace(m["old"], m["new"]), m["module"].__file__, "exec"), namespace)  # noqa: S102
        saved, fn.__code__ = fn.__code__, namespace[m["function"]].__code__
    fr.clear_caches()
    try:
        yield
    finally:
        fr.load = original_load
        if saved is not None:
            getattr(m["module"], m["function"]).__code__ = saved
        fr.clear_caches()


def killed(m: dict) -> bool:
    with mutated(m), contextlib.redirect_stdout(io.StringIO()):
        return pytest.main(["-q", "-x", "-p", "no:cacheprovider", *TESTS]) != 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [(m, killed(m)) for m in MUTATIONS]
    score = sum(k for _, k in rows) / len(rows)
    if args.json:
        print(json.dumps({"score": score, "rows": [{"why": m["why"], "killed": k} for m, k in rows]}, indent=2))
    else:
        for m, k in rows:
            print(f"{'killed  ' if k else 'SURVIVED'}  {m['why']}")
        print(f"score {sum(k for _, k in rows)}/{len(rows)} = {score:.0%}")
    return 0 if score >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
