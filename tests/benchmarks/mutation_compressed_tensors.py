"""Mutation check of the compressed-tensors engine rules: each single change to the rule data
(manifests/engines/compressed_tensors.vllm.yaml) or to quant/engines/compressed_tensors.py must make a
differential test of tests/quant/test_compressed_tensors_engines.py fail (those run the releases' own code).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_compressed_tensors.py [--json]

One process: a data mutation changes the loaded rule file (checked against its schema again), a code
mutation swaps a function's code for one compiled from the changed source; nothing on disk changes.
Prints one row per mutation (killed or SURVIVED) and the score; exit 1 under 90%.
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

import quant.engines.compressed_tensors as ct
from quant.engines import format_rules
from quant.engines.rules import window

TESTS = ["tests/quant/test_compressed_tensors_engines.py"]


def data(engine, first, rule, key, value, why, fmt="compressed-tensors"):
    """Set ``rule``'s ``key`` (None: the whole value) in the rule set starting at ``first`` of format ``fmt``'s
    rule file (another format's script passes its own)."""
    return {"kind": "data", "engine": engine, "first": first, "rule": rule, "key": key, "value": value, "why": why,
            "format": fmt}


def versions(engine, index, span, why, fmt="compressed-tensors"):
    return {"kind": "versions", "engine": engine, "index": index, "span": span, "why": why, "format": fmt}


def code(function, old, new, why, module=ct):
    """Replace ``old`` by ``new`` in ``function`` of ``module`` (the format's rules module)."""
    return {"kind": "code", "function": function, "old": old, "new": new, "why": why, "module": module}


ALL = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W4A8", "W4AFP8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16",
       "NVFP4", "MXFP4A16", "MXFP4", "MXFP4XFP8", "MXFP8A16", "MXFP8", "FP8A16", "FP8A16_CHANNEL", "FP8A16_BLOCK"]
BUILT_MOE = [p for p in ALL if not p.startswith("FP8A16")]

MUTATIONS = [
    data("vllm", "0.16.0", "attention_groups", None, "kept", "attention-only groups kept"),
    data("vllm", "0.30.0", "actorder_refused", "orders", [], "0.30.0 reads actorder group"),
    data("vllm", "0.16.0", "actorder_refused", "orders", ["group"], "0.16.0 refuses actorder group"),
    data("vllm", "0.16.0", "ignore_match", "fused_first", "any", "0.16.0 honours a pattern on the fused name"),
    data("vllm", "0.30.0", "ignore_match", "fused_first", "exact", "0.30.0 asks the shards unless listed exactly"),
    data("vllm", "0.16.0", "ignore_match", "fnmatch", True, "ignore entries as shell patterns"),
    data("vllm", "0.16.0", "ignore_match", "mixed_shards_error", "Found mixed shards in {module}.",
         "the mixed-shard message reworded"),
    data("vllm", "0.16.0", "target_match", "unmatched", "unquantized", "0.16.0 builds an unmatched Linear bf16"),
    data("vllm", "0.21.0", "target_match", "unmatched", "raise", "0.21.0 raises on an unmatched Linear"),
    data("vllm", "0.16.0", "target_match", "unmatched_error", "No target for {module}.",
         "the unmatched message reworded"),
    data("vllm", "0.27.0", "target_match", "order", ["name", "class", "fused"], "0.27.0 matches the class first"),
    data("vllm", "0.16.0", "target_match", "order", ["name", "fused", "class"], "0.16.0 matches the shards first"),
    data("vllm", "0.16.0", "moe_match", "class_name", "RoutedExperts", "0.16.0's FusedMoE named RoutedExperts"),
    data("vllm", "0.24.0", "moe_match", "class_name", "FusedMoE", "0.24.0's experts still a FusedMoE"),
    data("vllm", "0.32.0", "moe_match", "expert_leaves", "fixed", "0.32.0 asks gate_proj/up_proj/down_proj"),
    data("vllm", "0.16.0", "moe_match", "expert_leaves", "checkpoint", "0.16.0 asks the checkpoint's names"),
    data("vllm", "0.16.0", "moe_match", "mixed_error", "MoE projections differ", "the MoE message reworded"),
    data("vllm", "0.16.0", "lm_head", None, "scheme", "0.16.0 quantizes lm_head"),
    data("vllm", "0.20.0", "lm_head", None, "unquantized", "0.20.0 keeps lm_head bf16"),
    data("vllm", "0.16.0", "linear_schemes", None, ALL, "0.16.0 builds MXFP8 Linear"),
    data("vllm", "0.20.0", "linear_schemes", None, [p for p in ALL if p != "NVFP4"], "no NVFP4 Linear from 0.20.0"),
    data("vllm", "0.16.0", "moe_schemes", None, BUILT_MOE, "0.16.0 builds MXFP8 FusedMoE"),
    data("vllm", "0.20.0", "moe_schemes", None, [p for p in BUILT_MOE if p != "W4A16"],
         "no W4A16 FusedMoE from 0.20.0"),
    data("vllm", "0.20.0", "moe_schemes", None, ALL, "weight-only FP8 experts built from 0.20.0"),
    versions("vllm", 1, ["0.19.1", "0.20.2"], "0.19.1 quantizes lm_head"),
    versions("vllm", 2, ["0.20.2", "0.23.0"], "0.20.2 builds an unmatched Linear bf16"),
    versions("vllm", 4, ["0.26.0", "0.29.0"], "0.26.0 matches the shards first"),
    versions("vllm", 6, ["0.33.0", "0.34.0"], "0.32.0 asks the fixed names"),
    code("_hit", "re.match(target[3:], value)", "re.search(target[3:], value)", "re: patterns searched"),
    code("_hit", "re.match(target[3:], value)", "re.fullmatch(target[3:], value)", "re: patterns matched whole"),
    code("_hit", "target.lower() in value.lower()", "target in value", "class names case-sensitive"),
    code("_hit", "target.lower() in value.lower()", "target.lower() == value.lower()", "class names exact"),
    code("ignored", "if leaf in fused and not", "if False and not", "fused modules asked by their own name"),
    code("ignored", "len({h is not None for h in hits}) > 1", "False", "mixed shards never raise"),
    code("ignored", "name.replace(leaf, shard)", "name.replace(leaf, fused[leaf][0])", "shards asked as the first"),
    code("_fused_target", "if all(found) else None", "if any(found) else None", "some shards suffice"),
    code("_fused_target", "if name.endswith(k)", "if name.split('.')[-1] == k", "fused key by leaf"),
    code("engine_config", 'if rule["attention_groups"] == "dropped" and', "if False and",
         "attention groups never dropped"),
    data("vllm", "0.16.0", "weightless_group", None, "skipped", "a group without weights skipped"),
    code("engine_config", 'if rule["weightless_group"] == "raise":', "if False:", "a group without weights skipped"),
    code("engine_config", 'is_path = "." in entry and not entry.startswith("re:")', 'is_path = "." in entry',
         "the mapper renames patterns"),
    code("engine_config", 'or qconfig.get("format")', "", "the global format ignored"),
    code("_scheme_dict", "if not targets:", "if False:", "an empty target map matched"),
    code("_decide_moe", 'if "Linear" in targets and cls not in targets:', "if False:",
         "a Linear target does not stand for the FusedMoE"),
    code("_decide_moe", "if any(g != groups[-1] for g in groups):", "if False:", "MoE projections never compared"),
    code("_decide_moe", "for leaf in leaves]", "for leaf in leaves[:2]]", "down_proj not asked"),
    code("decide", 'if rule["lm_head"] == "unquantized":', "if False:", "lm_head always matched"),
    code("decide", 'module.rsplit(".", 1)[-1] == "lm_head"', "False", "lm_head matched as a Linear"),
    code("linear_class", '"qkv_proj": "QKVParallelLinear", ', "", "qkv_proj's class unknown"),
    code("_same", "(preset[5] is None or args[5] == preset[5])", "True", "group sizes never compared"),
    code("_args", 'args.get("symmetric", True) is not False', "True", "asymmetric read as symmetric"),
]


@contextlib.contextmanager
def mutated(m: dict):
    original_load = format_rules.load
    saved_code = None
    if m["kind"] in ("data", "versions"):
        def load(path, schema, *args, **kwargs):
            file = original_load(path, schema, *args, **kwargs)
            if file.engine != m["engine"] or file.format != m["format"]:
                return file
            raw = file.model_dump(exclude_unset=True)
            if m["kind"] == "versions":  # the neighbouring sets give up or take the releases moved
                sets, releases = raw["rule_sets"], list(window(m["engine"]))
                sets[m["index"]]["versions"] = m["span"]
                if m["index"] > 0:
                    sets[m["index"] - 1]["versions"][1] = releases[releases.index(m["span"][0]) - 1]
                if m["index"] + 1 < len(sets):
                    sets[m["index"] + 1]["versions"][0] = releases[releases.index(m["span"][1]) + 1]
            else:
                entry = next(e for e in raw["rule_sets"] if e["versions"][0] == m["first"])
                stated = entry["rules"].setdefault(m["rule"], {"value": None, "cite": "mutated"})
                if m["key"] is None:
                    stated["value"] = m["value"]
                else:  # a set that does not state the rule: the one carried into it, changed
                    if stated["value"] is None:
                        stated["value"] = dict(_carried(file, m["first"], m["rule"]))
                    stated["value"][m["key"]] = m["value"]
            return format_rules.FormatFile.model_validate(raw)
        format_rules.load = load
    else:
        module = m["module"]
        fn = getattr(module, m["function"])
        source = textwrap.dedent(inspect.getsource(fn))
        assert m["old"] in source, m
        namespace = dict(vars(module))
        exec(compile(source.replace(m["old"], m["new"]), module.__file__, "exec"), namespace)  # noqa: S102
        saved_code, fn.__code__ = fn.__code__, namespace[m["function"]].__code__
    format_rules.clear_caches()
    try:
        yield
    finally:
        format_rules.load = original_load
        if saved_code is not None:
            getattr(m["module"], m["function"]).__code__ = saved_code
        format_rules.clear_caches()


def _carried(file, first: str, rule: str) -> dict:
    """The value of ``rule`` in force at the set starting at ``first`` (stated there or before)."""
    value = None
    for entry in file.rule_sets:
        if rule in entry.rules:
            value = entry.rules[rule]["value"]
        if entry.versions[0] == first:
            return value
    raise LookupError(first)


def killed(m: dict, tests: list[str] = TESTS) -> bool:
    with mutated(m), contextlib.redirect_stdout(io.StringIO()):
        return pytest.main(["-q", "-x", "-p", "no:cacheprovider", *tests]) != 0


def main(mutations: list[dict] = MUTATIONS, tests: list[str] = TESTS, doc: str = __doc__) -> int:
    """Run each of ``mutations`` against ``tests`` (sglang's script passes its own)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [(m, killed(m, tests)) for m in mutations]
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
