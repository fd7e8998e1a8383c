"""Mutation builders shared by tests/benchmarks/mutation_engines.py and the per-family mutation modules beside
this file: a family folder added under manifests/families/ puts its rule mutations in ``<family>.py`` here
(``MUTATIONS``, and ``TESTS``: the test files that must kill them), so families added at the same time
never edit one list."""

from __future__ import annotations


def data(engine, first, rule, path, value, why):
    """Set ``rule``'s value at ``path`` (keys) in the rule set starting at ``first`` of the rule file
    ``engine`` (``sglang``, ``vllm``: the DeepSeek-V2 class; ``sglang.glm4_moe`` ...: another class)."""
    return {"kind": "data", "engine": engine, "first": first, "rule": rule, "path": path, "value": value, "why": why}


def top(engine, key, value, why):
    """Replace a top-level manifest entry (checked, post_releases) or a set's versions."""
    return {"kind": "top", "engine": engine, "key": key, "value": value, "why": why}


def code(module, old, new, why):
    return {"kind": "code", "module": module, "old": old, "new": new, "why": why}
