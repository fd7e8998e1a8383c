"""Mutation check of vLLM's ModelOpt rules: each single change to the rule data (manifests/engines/modelopt.vllm.yaml)
or to quant/engines/modelopt.py must make a differential test of tests/quant/test_modelopt_engines.py fail (those
run the releases' own functions).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_modelopt.py [--json]

One process: a data mutation changes the loaded rule file (checked against its schema again; a rule may be stated
in a set that did not state it), a code mutation swaps a function's code for one compiled from the changed source;
nothing on disk changes. Prints one row per mutation (killed or SURVIVED) and the score. Runs every window release
(QUANTGATE_WINDOW=all): a span boundary moved by one release is only seen in the release it moves.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import json
import os
import sys
import textwrap

import pytest

import quant.engines.format_rules as fr
import quant.engines.modelopt as mo

TESTS = ["tests/quant/test_modelopt_engines.py"]
ALL_FP8 = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8-channel", "FP8_PB_WO": "fp8-block"}


def data(first, rule, change, why):
    """``change(value) -> value`` on the rule as the set starting at ``first`` states (or inherits) it."""
    return {"kind": "data", "first": first, "rule": rule, "change": change, "why": why}


def versions(spans, why):
    """Move a span boundary: ``spans`` maps a rule set's index to its new [first, last] (coverage stays whole)."""
    return {"kind": "versions", "spans": spans, "why": why}


def code(function, old, new, why):
    return {"kind": "code", "function": function, "old": old, "new": new, "why": why}


def _with(key, value):
    return lambda d: {**d, key: value}


def _without(key):
    return lambda d: {k: v for k, v in d.items() if k != key} if isinstance(d, dict) else [v for v in d if v != key]


def _mixed(**changes):
    return lambda m: {**m, **changes}


MUTATIONS = [
    data("0.16.0", "algos", _with("W4A16_NVFP4", "nvfp4"), "W4A16_NVFP4 accepted in 0.16.0"),
    data("0.21.0", "algos", _without("W4A16_NVFP4"), "W4A16_NVFP4 refused in 0.21.0"),
    data("0.17.0", "algos", _without("MIXED_PRECISION"), "MIXED_PRECISION refused in 0.17.0"),
    data("0.16.0", "algos", _with("FP8_PB_WO", "fp8"), "FP8_PB_WO labelled per-tensor"),
    data("0.16.0", "algos", _with("W4A8_AWQ", "int4"), "W4A8_AWQ accepted"),
    data("0.16.0", "moe_schemes", _with("MXFP8", "mxfp8"), "MXFP8 MoE built in 0.16.0"),
    data("0.18.0", "moe_schemes", _without("MXFP8"), "MXFP8 MoE raising in 0.18.0"),
    data("0.16.0", "moe_schemes", _with("FP8_PB_WO", "fp8-block"), "FP8_PB_WO experts block-scaled"),
    data("0.21.0", "moe_schemes", _without("W4A16_NVFP4"), "W4A16_NVFP4 MoE raising"),
    data("0.33.0", "producer_algos", _without("MIXED_PRECISION"), "convertor refuses MIXED_PRECISION in 0.33.0"),
    data("0.17.0", "producer_algos", lambda v: [*v, "MIXED_PRECISION"], "convertor maps MIXED_PRECISION in 0.17.0"),
    data("0.16.0", "producer_algos", lambda v: None, "no convertor check"),
    data("0.21.0", "producer_algos", lambda v: [*v, "W4A16_NVFP4"], "convertor maps W4A16_NVFP4"),
    data("0.16.0", "nested_required", lambda v: {**v, "NVFP4": ["kv_cache_quant_algo", "exclude_modules"]},
         "NVFP4 needs no group_size"),
    data("0.16.0", "nested_required", _without("MXFP8"), "MXFP8 needs no fields"),
    data("0.16.0", "nested_required", lambda v: {**v, "FP8": ["exclude_modules"]}, "FP8 needs exclude_modules"),
    data("0.16.0", "flat_exclude_keys", lambda v: ["ignore", "exclude_modules"], "0.16.0 reads exclude_modules"),
    data("0.33.0", "flat_exclude_keys", lambda v: ["ignore"], "0.33.0 reads ignore only"),
    data("0.33.0", "flat_exclude_keys", lambda v: ["exclude_modules", "ignore"], "exclude_modules before ignore"),
    data("0.16.0", "star_split", lambda v: False, "no path* split"),
    data("0.16.0", "class_mapper", lambda v: False, "class mapper not applied"),
    data("0.16.0", "match", lambda v: ["exact", "fnmatch"], "no substring test"),
    data("0.16.0", "match", lambda v: ["exact", "substring"], "no fnmatch test"),
    data("0.16.0", "match", lambda v: ["substring", "fnmatch"], "no exact test"),
    data("0.16.0", "match", lambda v: ["substring", "exact", "fnmatch"], "substring before exact"),
    data("0.24.0", "fused_first", lambda v: False, "0.24.0 asks the shards of a listed fused name"),
    data("0.16.0", "fused_first", lambda v: True, "0.16.0 honours a listed fused name"),
    data("0.23.0", "lm_head", lambda v: False, "0.23.0 lm_head unquantized"),
    data("0.16.0", "lm_head", lambda v: True, "0.16.0 lm_head quantized"),
    data("0.23.0", "unquantized_markers", _without("vit_large_projector"), "no vit_large_projector marker"),
    data("0.16.0", "unquantized_markers", lambda v: [*v, "vit_large_projector"], "0.16.0 vit_large_projector"),
    data("0.16.0", "unquantized_markers", _without("vision_model"), "no vision_model marker"),
    data("0.17.0", "mixed", _mixed(candidates=True), "0.17.0 prefix candidates"),
    data("0.22.0", "mixed", _mixed(candidates=False), "0.22.0 no prefix candidates"),
    data("0.17.0", "mixed", _mixed(lookup=["direct", "children"]), "no packed lookup"),
    data("0.17.0", "mixed", _mixed(lookup=["direct", "packed"]), "no children lookup"),
    data("0.23.0", "mixed", lambda m: {**m, "lookup": ["direct", "packed", "children"]}, "no experts_parent lookup"),
    data("0.22.0", "mixed", lambda m: {**m, "lookup": [*m["lookup"], "experts_parent"]}, "0.22.0 experts_parent"),
    data("0.25.0", "mixed", lambda m: {**m, "lookup": m["lookup"][:-1]}, "no shards fallback"),
    data("0.23.0", "mixed", lambda m: {**m, "lookup": [*m["lookup"], "shards"]}, "0.23.0 shards fallback"),
    data("0.17.0", "mixed", lambda m: {**m, "linear": {**m["linear"], "W4A16_NVFP4": "nvfp4"}},
         "0.17.0 mixed builds W4A16_NVFP4"),
    data("0.29.0", "mixed", lambda m: {**m, "linear": _without("FP8_PB_WO")(m["linear"])}, "0.29.0 no PB_WO Linear"),
    data("0.30.0", "mixed", lambda m: {**m, "linear": _without("FP8_PER_CHANNEL_PER_TOKEN")(m["linear"])},
         "0.30.0 no PcPt Linear"),
    data("0.30.0", "mixed", lambda m: {**m, "moe": {**m["moe"], "FP8_PB_WO": "fp8"}}, "0.30.0 PB_WO MoE per-tensor"),
    data("0.25.0", "mixed", lambda m: {**m, "moe": _without("MXFP8")(m["moe"])}, "0.25.0 no MXFP8 MoE"),
    data("0.17.0", "mixed", lambda m: {**m, "linear": {**ALL_FP8, "NVFP4": "nvfp4"}}, "0.17.0 every FP8 Linear"),
    versions({1: ["0.17.0", "0.18.0"], 2: ["0.18.1", "0.20.2"]}, "0.18.0 keeps MXFP8 MoE raising"),
    versions({3: ["0.21.0", "0.22.0"], 4: ["0.22.1", "0.22.1"]}, "0.22.0 keeps 0.21.0's mixed lookup"),
    versions({4: ["0.22.0", "0.23.0"], 5: ["0.24.0", "0.24.0"], 6: ["0.25.0", "0.25.0"], 7: ["0.25.1", "0.28.0"]},
             "0.23.0 keeps 0.22.x's get_quant_method (0.24.0 and 0.25.0 shifted by one)"),
    versions({7: ["0.25.0", "0.27.1"], 8: ["0.28.0", "0.29.0"]}, "0.28.0 builds PB_WO mixed Linear"),
    versions({10: ["0.32.0", "0.33.0"], 11: ["0.34.0", "0.34.0"]}, "0.33.0 reads ignore only"),
    code("decide", 'if moe and algo != MIXED and algo not in values["moe_schemes"]:', "if False:",
         "no MoE refusal"),
    code("excluded_by", "e != module and e in module", "e != module and module.endswith(e)", "suffix, not substring"),
    code("excluded_by", "fnmatch(module, e)", "fnmatch(module, e + '*')", "wildcard widened"),
    code("exclude_entries", 'e[-1] == "*" and e[-2] != "."', 'e[-1] == "*"', "path.* split too"),
    code("exclude_entries", "if mapper is None:", "if False:", "star split without a class mapper"),
    code("exclude_list", 'return inner.get("exclude_modules", [])', 'return inner.get("exclude_modules")',
         "nested exclude_modules required"),
    code("_nested", 'if "quantization" in qconfig else None', "if isinstance(inner, dict) else None",
         "a non-dict quantization read as flat"),
    code("_int_like", "int(value) is not None", "False", "group_size must be an int"),
    code("config_error", "kv_cache is not None and not isinstance(kv_cache, str)", "False",
         "kv_cache_quant_algo unchecked"),
    code("_candidates", 'if name.endswith(".lm_head"):', "if False:", "no lm_head candidate"),
    code("mixed_algo", "if len(found) > 1:", "if False:", "disagreeing shards not refused"),
    code("mixed_algo", 'module.rsplit(".experts", 1)[0] + "."', 'module + "."', "experts_parent as children"),
    code("decide", "if algo == MIXED:", "if algo == MIXED and not moe:", "mixed FusedMoE with the config's algo"),
]


@contextlib.contextmanager
def mutated(m: dict):
    original_validate = fr.validate
    original_load = fr.load
    saved_code = None
    if m["kind"] == "versions":
        def load(path, schema, *args, **kwargs):
            file = original_load(path, schema, *args, **kwargs)
            if file.format != "modelopt" or file.engine != "vllm":
                return file
            raw = file.model_dump(exclude_unset=True)
            for index, span in m["spans"].items():
                raw["rule_sets"][index]["versions"] = span
            return schema.model_validate(raw)
        fr.load = load
    elif m["kind"] == "data":
        fr.validate = _data_validate(m, original_validate)
    else:
        fn = getattr(mo, m["function"])
        source = textwrap.dedent(inspect.getsource(fn))
        assert m["old"] in source, m
        namespace = dict(vars(mo))
        exec(compile(source.replace(m["old"], m["new"]), mo.__file__, "exec"), namespace)  # noqa: S102
        saved_code, fn.__code__ = fn.__code__, namespace[m["function"]].__code__
    fr.clear_caches()
    try:
        yield
    finally:
        fr.validate = original_validate
        fr.load = original_load
        if saved_code is not None:
            getattr(mo, m["function"]).__code__ = saved_code
        fr.clear_caches()


def _data_validate(m: dict, original):
    """``format_rules.validate`` that changes rule ``m["rule"]`` in the set whose releases start at ``m["first"]``
    (the sets are validated oldest first; the value carried into that set is the one changed)."""
    spans = [e.versions[0] for e in original_load_spans()]
    carried: dict = {}
    calls = {"n": 0}

    def validate(data, schema, *args, **kwargs):
        if schema is not mo.RULES:
            return original(data, schema, *args, **kwargs)
        first = spans[calls["n"] % len(spans)]
        calls["n"] += 1
        stated = copy.deepcopy(data)
        for rule, entry in stated.items():
            carried[rule] = entry
        if first == m["first"]:
            entry = copy.deepcopy(stated.get(m["rule"]) or carried[m["rule"]])
            entry["value"] = m["change"](entry["value"])
            stated[m["rule"]] = entry
        return original(stated, schema, *args, **kwargs)
    return validate


def original_load_spans():
    from quant.engines.format_rules import FormatFile, rules_path
    from quant.engines.rules import RuleFileError
    from quant.schema import load

    return load(rules_path("modelopt", "vllm"), FormatFile, "format rule file", RuleFileError, "").rule_sets


def killed(m: dict) -> bool:
    with mutated(m), contextlib.redirect_stdout(io.StringIO()):
        return pytest.main(["-q", "-x", "-p", "no:cacheprovider", *TESTS]) != 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["QUANTGATE_WINDOW"] = "all"
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
