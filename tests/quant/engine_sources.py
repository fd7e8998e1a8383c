"""Load single functions from released sglang / vLLM wheels, without importing the packages.

The wheels come from the package registry (``pip download --no-deps``) into a cache folder
(``$QUANTGATE_WHEELS`` or ``~/.cache/quantgate-wheels``). From a wheel's source file we take only
the named functions and classes (``ast``), and run them in a namespace holding the few names they
use: the engines' own code decides, nothing of it is rewritten here.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import logging
import os
import re
import sys
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType, SimpleNamespace
from typing import Any, Dict, List, Literal, Optional, Union  # noqa: UP035 (names the engines' annotations use)


class WheelUnavailable(RuntimeError):
    pass


def wheel(package: str, version: str) -> Path:
    """The cached wheel of ``package==version``, downloaded once from the registry (the window tool's
    downloader: one cache, one place that runs pip)."""
    from quant.engines.rules import RuleFileError
    from quant.engines.window import wheel as window_wheel

    try:
        return window_wheel(package, version)
    except RuleFileError as exc:
        raise WheelUnavailable(str(exc)) from None


@functools.cache
def source(whl: Path, path: str) -> str:
    with zipfile.ZipFile(whl) as z:
        return z.read(path).decode()


@functools.cache
def source_files(whl: Path) -> frozenset[str]:
    """The paths a wheel holds (a model file that a release does not have yet is absent)."""
    with zipfile.ZipFile(whl) as z:
        return frozenset(z.namelist())


@functools.cache
def parsed(whl: Path, path: str) -> ast.Module:
    """The parsed source (cached: the model files run to thousands of lines and many tests read them)."""
    return ast.parse(source(whl, path))


def _base_namespace() -> dict:
    import regex

    return {"re": re, "regex": regex, "copy": copy, "Iterable": Iterable, "Mapping": Mapping,
            "MappingProxyType": MappingProxyType, "Optional": Optional, "Any": Any, "Dict": Dict, "List": List,  # noqa: UP006
            "Literal": Literal, "Union": Union, "dataclass": dataclass, "field": field,
            "logger": logging.getLogger("engine-source"), "__name__": __name__}


def load(whl: Path, path: str, names: Iterable[str], extra: dict | None = None,
         namespace: dict | None = None) -> dict:
    """Execute the top-level functions, classes and assignments called ``names`` of ``path``."""
    tree = parsed(whl, path)
    wanted = set(names)
    nodes = []
    for node in tree.body:
        targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + \
            ([node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else [])
        if wanted & set(targets):
            nodes.append(node)
    missing = wanted - {n.name if hasattr(n, "name") else None for n in nodes} - {
        t.id for n in nodes for t in getattr(n, "targets", []) if isinstance(t, ast.Name)} - {
        n.target.id for n in nodes if isinstance(n, ast.AnnAssign)}
    if missing:
        raise LookupError(f"{path} in {whl.name} has no {sorted(missing)}")
    ns = namespace if namespace is not None else _base_namespace()
    ns.update(extra or {})
    exec(compile(ast.Module(body=nodes, type_ignores=[]), f"{whl.name}/{path}", "exec"), ns)  # noqa: S102 (the engine's own code)
    return ns


def methods(whl: Path, path: str, cls: str, names: Iterable[str], extra: dict | None = None) -> dict:
    """The methods (and class attributes) ``names`` of class ``cls`` in ``path``, as plain functions."""
    tree = parsed(whl, path)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    wanted = set(names)
    body = [n for n in node.body if (getattr(n, "name", None) in wanted) or any(
        isinstance(t, ast.Name) and t.id in wanted for t in getattr(n, "targets", []))]
    ns = _base_namespace()
    ns.update(extra or {})
    holder = ast.ClassDef(name=cls, bases=[], keywords=[], body=body or [ast.Pass()], decorator_list=[])
    code = compile(ast.fix_missing_locations(ast.Module(body=[holder], type_ignores=[])), f"{whl.name}/{path}", "exec")
    exec(code, ns)  # noqa: S102 (the engine's own code)
    return {"cls": ns[cls], "ns": ns}


def fake_quant_config(name: str, exclude: list[str]) -> SimpleNamespace:
    """What ``_resolve_nextn_quant_config`` reads of a QuarkConfig: its name, exclude list and dict."""
    return SimpleNamespace(get_name=lambda: name, exclude_layers=list(exclude),
                           quant_config={"exclude": list(exclude), "layer_quant_config": {}})


def class_def(whl: Path, path: str, cls: str) -> ast.ClassDef | None:
    """The top-level class ``cls`` of ``path`` (None when the release has no such class)."""
    tree = parsed(whl, path)
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)


def method_def(node: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def sglang_quark_loader_additions(whl: Path) -> dict:
    """The entries sglang's loader adds to a model's packed_modules_mapping when the quant config is
    Quark (``model_loader/loader.py``: ``_get_quantization_config``), read from the wheel."""
    added: dict = {}
    loader = parsed(whl, "sglang/srt/model_loader/loader.py")
    fn = next(n for n in loader.body if isinstance(n, ast.FunctionDef) and n.name == "_get_quantization_config")
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.If) and "'quark'" in ast.unparse(stmt.test).replace('"', "'"):
            for call in ast.walk(stmt):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "packed_modules_mapping.update":
                    added.update(ast.literal_eval(call.args[0]))
    return added


def packed_mapping(whl: Path, path: str, cls: str, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping a quant config holds once class ``cls`` of ``path`` is built: the
    class's literal (vLLM: handed over by model_loader/utils.py configure_quant_config), plus, in sglang
    with Quark, the loader's additions, which update the class's dict before __init__ hands it over."""
    mapping = dict(class_constant(class_def(whl, path, cls), "packed_modules_mapping") or {})
    if engine == "sglang" and kind == "quark":
        mapping.update(sglang_quark_loader_additions(whl))
    return {k: list(v) for k, v in mapping.items()}


def class_constant(node: ast.ClassDef, name: str):
    """A class attribute assigned a literal in the class body (None when absent)."""
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return ast.literal_eval(stmt.value)
    return None


@dataclass
class Built:
    """One ``self.<attr> = Call(...)`` in a constructor, with the ``if`` tests it sits under."""
    call: str
    keywords: dict[str, str]
    under: list[str]


def attribute_builds(fn: ast.FunctionDef, attr: str) -> list[Built]:
    """Every ``self.<attr> = <call>(...)`` in ``fn``: the call's name, its keywords (as source text)
    and the enclosing ``if`` tests (an ``else`` branch as ``not (<test>)``)."""
    found: list[Built] = []

    def visit(body, under):
        for stmt in body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and any(
                    isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                    and t.value.id == "self" for t in stmt.targets):
                call = stmt.value
                found.append(Built(ast.unparse(call.func), {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg},
                                   list(under)))
            if isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                visit(stmt.body, [*under, test])
                visit(stmt.orelse, [*under, f"not ({test})"])
            elif isinstance(stmt, (ast.With, ast.For, ast.Try)):
                visit(stmt.body, under)
    visit(fn.body, [])
    return found


@contextlib.contextmanager
def served_modules(mapping: dict[str, dict]):
    """Serve stub modules (``{import path: attributes}``, and their parent packages) under the engines'
    import paths while a wheel's function imports from them; whatever was there before comes back."""
    names = {".".join(name.split(".")[:i]) for name in mapping for i in range(1, len(name.split(".")) + 1)}
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = ModuleType(n)
    for name, attrs in mapping.items():
        sys.modules[name].__dict__.update(attrs)
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


def config_reads(tree: ast.Module, functions: Iterable[str]) -> set[str]:
    """The config keys the module-level ``functions`` read (``config.X``, ``getattr/hasattr(config, "X")``)."""
    reads = set()
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in functions):
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "config":
                reads.add(node.attr)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and \
                    ast.unparse(node.args[0]) == "config":
                reads.add(ast.literal_eval(node.args[1]))
    return reads


def free_names(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads from its module (what a stub namespace has to provide)."""
    import builtins

    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    read = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names}
    return read - bound - set(dir(builtins))


def window_sample(engine: str, family: str = "glm_moe_dsa", carried: int = 2) -> list[str]:
    """The releases a differential test runs the wheels of: every read release, and ``carried`` of the releases
    carried over by identical cited source, a different pair each day (printed, so a failure names them);
    ``QUANTGATE_WINDOW=all`` runs every read and carried release (the scheduled / manual mode)."""
    import datetime
    import random

    from quant.engines.rules import release_states

    states = release_states(engine, family)
    read = [r for r, s in states.items() if s.state == "read"]
    others = [r for r, s in states.items() if s.state == "carried"]
    if os.environ.get("QUANTGATE_WINDOW") != "all":
        others = sorted(random.Random(datetime.date.today().toordinal()).sample(others, min(carried, len(others))),
                        key=list(states).index)
    print(f"{engine} releases for {family}: read {', '.join(read)}; carried, sampled: {', '.join(others) or 'none'}")
    return sorted(read + others, key=list(states).index)
