"""Mutation check of the block-FP8 partition rules: each single change to the rule data
(manifests/engines/block_fp8.{sglang,vllm}.yaml) or to quant/engines/block_partition.py must make a
differential test of tests/quant/test_block_partition.py fail (those run the releases' own checks).

    PYTHONPATH=. nice -n 10 python tests/benchmarks/mutation_block_fp8.py [--json]

One process: a data mutation changes the loaded rule file (checked against its schema again), a code
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

import quant.engines.block_partition as bp
from quant.engines.rule_kinds import BlockFp8File

TESTS = ["tests/quant/test_block_partition.py", "-k",
         "partitions_match or covered or expert_parallel or fused_experts or not_guessed"]


def data(engine, first, rule, key, value, why):
    return {"kind": "data", "engine": engine, "first": first, "rule": rule, "key": key, "value": value, "why": why}


def versions(engine, index, span, why):
    return {"kind": "versions", "engine": engine, "index": index, "span": span, "why": why}


def code(function, old, new, why):
    return {"kind": "code", "function": function, "old": old, "new": new, "why": why}


MUTATIONS = [
    data("vllm", "0.16.0", "linear", "merged_mismatch_allowed", False, "vLLM raises on a merged misfit"),
    data("sglang", "0.5.9", "linear", "merged_mismatch_allowed", True, "sglang lets a merged misfit through"),
    data("sglang", "0.5.11", "moe", "rocm_pads", None, "aiter never pads"),
    data("sglang", "0.5.11", "moe", "rocm_pads", 64, "aiter pads to 64"),
    data("sglang", "0.5.9", "moe", "rocm_pads", 128, "0.5.9 pads with aiter"),
    data("vllm", "0.29.0", "moe", "refine_min", 64, "refinement needs 64"),
    data("vllm", "0.29.0", "moe", "refine_min", 16, "refinement down to 16"),
    data("vllm", "0.16.0", "moe", "misfit", "refine", "0.16.0 refines (refine_min 32)"),
    versions("vllm", 0, ["0.16.0", "0.29.0"], "0.29.0 does not refine"),
    versions("vllm", 1, ["0.28.0", "0.34.0"], "0.28.0 refines"),
    versions("sglang", 0, ["0.5.9", "0.5.11"], "0.5.11 never pads"),
    versions("sglang", 1, ["0.5.10.post1", "0.5.23"], "0.5.10.post1 pads"),
    code("misfits", "if tp > 1 and part.sizes[0] % (tp * block_k):", "if part.sizes[0] % (tp * block_k):",
         "row checked at TP 1"),
    code("misfits", "if tp == 1 and part.merged is None:", "if tp == 1:", "merged not checked at TP 1"),
    code("misfits", "0 < kv_heads < tp", "0 < kv_heads < 0", "KV heads never replicated"),
    code("misfits", "if bad and not (part.merged and", "if bad and not (", "every column misfit allowed"),
    code("_moe_misfit", "(tp == 1 or intermediate % (ranks * block_k) == 0)", "True", "down_proj's block_k unchecked"),
    code("_moe_misfit", 'platform == "rocm" and ', "", "padding on CUDA too"),
    code("_moe_misfit", "refined >= rule[\"refine_min\"]", "refined > rule[\"refine_min\"]", "refine needs more"),
    code("_moe_misfit", "ranks = max(1, tp // ep)", "ranks = tp", "EP ignored"),
    code("parts", "(out // 2, inner) if", "(out, inner) if", "fused gate_up read as one projection"),
]


@contextlib.contextmanager
def mutated(m: dict):
    original_load = bp.load
    saved_code = None
    if m["kind"] in ("data", "versions"):
        def load(path, schema, *args, **kwargs):
            file = original_load(path, schema, *args, **kwargs)
            if file.engine != m["engine"]:
                return file
            raw = file.model_dump(exclude_unset=True)
            if m["kind"] == "versions":
                raw["rule_sets"][m["index"]]["versions"] = m["span"]
            else:
                entry = next(e for e in raw["rule_sets"] if e["versions"][0] == m["first"])
                value = entry["rules"][m["rule"]]["value"]  # each mutation targets a set that states the rule
                value[m["key"]] = m["value"]
                if m["key"] == "misfit" and m["value"] == "refine":
                    value["refine_min"] = 32
            return BlockFp8File.model_validate(raw)
        bp.load = load
    else:
        fn = getattr(bp, m["function"])
        source = textwrap.dedent(inspect.getsource(fn))
        assert m["old"] in source, m
        namespace = dict(vars(bp))
        exec(compile(source.replace(m["old"], m["new"]), bp.__file__, "exec"), namespace)  # noqa: S102
        saved_code, fn.__code__ = fn.__code__, namespace[m["function"]].__code__
    bp.block_rules.cache_clear()
    try:
        yield
    finally:
        bp.load = original_load
        if saved_code is not None:
            getattr(bp, m["function"]).__code__ = saved_code
        bp.block_rules.cache_clear()


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
