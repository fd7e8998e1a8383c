"""The release window, kept mechanically: which engine releases each rule file's rules hold for.

Every rule cites the wheel file and the functions it was read in (``"<file>: <Class.method>, <function> (...)"``).
This module turns each cite into (file, symbol) pairs, hashes each symbol's source in every release of the window
(``ast.unparse`` of its definition, docstrings dropped: formatting and comments do not count), and writes the
hashes beside the rule file as its lock (``<engine>.lock.yaml``). From the lock, ``quant.engines.rules.
release_states`` tells each release apart: **read** (the rule file lists it), **carried** (not read, but every
symbol the nearest read release's rule set cites hashes identical: that release's rules hold, proven),
**needs reading** (a cited symbol changed: the rules and symbols are named) or **not built** (the release does
not register the family's model class: sglang's ``EntryClass`` in ``sglang/srt/models/``, vLLM's
``vllm/model_executor/models/registry.py``).

    python -m quant.engines.window report [--engine E] [--family F] [--json | --markdown | --symbols]
    python -m quant.engines.window lock [RULE_FILE ...]   # rewrite locks from the wheels (downloads missing ones)
    python -m quant.engines.window check                  # exit 1 naming each stale lock (CI)
    python -m quant.engines.window refresh                # new registry releases -> releases.yaml, locks, report

How a cite is read: text in parentheses or backticks is commentary; a ``path.py:`` starts the citations of that
file (a relative path resolves against the previous file's folder or its parents, then against the engine's
package, then as the one file of the wheel ending so); the first name of each comma- or semicolon-separated item
must resolve in the release the rule set was read in (else the cite is refused, naming it), later code-like
names count where they resolve. A name resolves to a top-level definition, ``Class.member`` to a member of the
class or of its bases (``self.member`` assignments included), a bare method name to that method in the file's
classes, and an imported name to its definition in the wheel. A file cited with no name (``"x.py: no draft
class"``) is hashed whole: a claim about what a file lacks holds only while the file is unchanged.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from quant.engines import rules
from quant.engines.rules import ENGINES, RuleFileError
from quant.errors import QuantgateError

PACKAGES = {"sglang": ("sglang/srt/", "sglang/"), "vllm": ("vllm/model_executor/", "vllm/")}
MODEL_DIRS = ("sglang/srt/models/", "vllm/model_executor/models/", "vllm/models/")
WHOLE_FILE = "*"  # the symbol of a file cited with no name
ABSENT = "absent"


def wheel_cache() -> Path:
    return Path(os.environ.get("QUANTGATE_WHEELS", Path.home() / ".cache" / "quantgate-wheels"))


class CiteError(RuleFileError):
    """A cite that names a file or symbol its release does not have (exit code 2)."""


def wheel(engine: str, release: str, download: bool = True) -> Path:
    """The cached wheel of ``engine==release`` (``pip download --no-deps`` once when ``download``)."""
    folder = wheel_cache() / f"{engine}-{release}"
    found = sorted(folder.glob("*.whl"))
    if found or not download:
        if not found:
            raise RuleFileError(f"{engine}=={release}: no wheel in {folder}; run python -m quant.engines.window lock")
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), f"{engine}=={release}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    found = sorted(folder.glob("*.whl"))
    if done.returncode or not found:
        raise RuleFileError(f"pip download {engine}=={release} failed: {done.stderr.strip()[-300:]}")
    return found[0]


_TREES: dict[tuple[str, int, int], ast.Module] = {}
IMPORT_DEPTH = 4  # imports followed from a cited file to the definition of a name it imports


class Wheel:
    """One release's sources, read from its wheel (never imported)."""

    def __init__(self, engine: str, release: str, path: Path):
        self.engine, self.release, self.path = engine, release, path
        self.zip = zipfile.ZipFile(path)
        self.files = frozenset(n for n in self.zip.namelist() if n.endswith(".py"))

    def source(self, path: str) -> str:
        return self.zip.read(path).decode("utf-8-sig")

    def tree(self, path: str) -> ast.Module:
        """The file's syntax tree without docstrings (shared by the releases whose file is byte-identical)."""
        info = self.zip.getinfo(path)
        key = (path, info.CRC, info.file_size)
        if key not in _TREES:
            _TREES[key] = _strip_docstrings(ast.parse(self.source(path)))
        return _TREES[key]

    def resolve_file(self, written: str, previous: list[str], hint: str = "") -> str | None:
        """The wheel file a cite's ``written`` path means (None when there is none): as written, under the
        previous file's folder or its parents, under the engine's package, else the one file ending so (the
        nearest to the files cited before, then the one naming ``hint``, the family)."""
        if written in self.files:
            return written
        bases = [str(p) + "/" for p in PurePosixPath(previous[-1]).parents if str(p) != "."] if previous else []
        for base in bases + list(PACKAGES[self.engine]):
            if base + written in self.files:
                return base + written
        ending = sorted(f for f in self.files if f.endswith("/" + written))
        if len(ending) > 1 and previous:
            shared = {f: max(len(os.path.commonpath([f, p])) for p in previous) for f in ending}
            ending = [f for f in ending if shared[f] == max(shared.values())]
        if len(ending) > 1 and hint:
            ending = [f for f in ending if hint in f] or ending
        if len(ending) > 1:  # the model files are what cites name most
            ending = [f for f in ending if any(f.startswith(d) for d in MODEL_DIRS)] or ending
        return ending[0] if len(ending) == 1 else None

    @functools.cached_property
    def top_level_index(self) -> dict[str, list[str]]:
        """Each name a file of the wheel defines at top level (class, def, assignment) -> those files."""
        index: dict[str, list[str]] = {}
        pattern = re.compile(r"^(?:class|def|async def)\s+(\w+)|^(\w+)\s*(?::[^=]*)?=", re.MULTILINE)
        for path in sorted(self.files):
            for m in pattern.finditer(self.zip.read(path).decode(errors="replace")):
                index.setdefault(m.group(1) or m.group(2), []).append(path)
        return index


def _strip_docstrings(tree: ast.Module) -> ast.Module:
    """Drop the docstrings of the module and of every class and function (their text decides nothing)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        body = node.body if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
            else None
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack += [n for n in getattr(node, field, None) or [] if isinstance(n, ast.AST)]
    return tree


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
        else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _imported(tree: ast.Module, path: str, name: str) -> tuple[str, str] | None:
    """Where ``name``, imported at the top of module ``path``, is defined: (module file, name there)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    parts = PurePosixPath(path).parent.parts[:len(PurePosixPath(path).parent.parts) - node.level + 1] \
                        if node.level else ()
                    module = "/".join([*parts, *(node.module or "").split(".")]).strip("/")
                    return module, alias.name
    return None


def _module_file(wheel_: Wheel, module: str) -> str | None:
    for candidate in (module + ".py", module + "/__init__.py"):
        if candidate in wheel_.files:
            return candidate
    return None


def _find(wheel_: Wheel, path: str, name: str, depth: int = 0) -> tuple[str, ast.stmt] | None:
    """The top-level definition of ``name`` in ``path``, following imports within the wheel."""
    tree = wheel_.tree(path)
    node = next((n for n in tree.body if _defines(n, name)), None)
    if node is not None:
        return path, node
    origin = _imported(tree, path, name) if depth < IMPORT_DEPTH else None
    target = origin and _module_file(wheel_, origin[0])
    return _find(wheel_, target, origin[1], depth + 1) if target else None


def _member(wheel_: Wheel, path: str, cls: ast.ClassDef, name: str, depth: int = 0) -> list[ast.AST]:
    """``cls``'s member ``name``: defined in its body, assigned as ``self.name`` in its methods, or a base's."""
    own = [n for n in cls.body if _defines(n, name)]
    if own:
        return own
    assigning = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) and t.value.id == "self"
        for a in ast.walk(f) if isinstance(a, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))]
    if assigning or depth > 6:
        return assigning
    for base in cls.bases:
        found = _find(wheel_, path, base.id) if isinstance(base, ast.Name) else None
        members = _member(wheel_, found[0], found[1], name, depth + 1) \
            if found and isinstance(found[1], ast.ClassDef) else []
        if members:
            return members
    return []


def symbol_nodes(wheel_: Wheel, path: str, symbol: str, local: bool = False) -> list[ast.AST]:
    """The definitions ``symbol`` names in ``path`` of this release (empty when it names nothing)."""
    if symbol == WHOLE_FILE:
        return [wheel_.tree(path)]
    head, _, rest = symbol.partition(".")
    if head.startswith("*"):  # "*MultiTokenPredictorLayer.__init__": every class of the file whose name ends so
        return [n for c in wheel_.tree(path).body if isinstance(c, ast.ClassDef) and c.name.endswith(head[1:])
                for n in (symbol_nodes(wheel_, path, c.name + "." + rest) if rest else [c])]
    found = _find(wheel_, path, head, depth=IMPORT_DEPTH if local else 0)
    if found is None:  # a bare method name: that method wherever the file's classes define it
        if rest:
            return []
        return [m for c in wheel_.tree(path).body if isinstance(c, ast.ClassDef) for m in c.body if _defines(m, head)]
    where, node = found
    for part in rest.split(".") if rest else []:
        if not isinstance(node, ast.ClassDef):
            return []
        members = _member(wheel_, where, node, part)
        if not members:
            return []
        if len(members) > 1 or not isinstance(members[0], ast.ClassDef):
            return members if part == rest.split(".")[-1] else []
        node = members[0]
    return [node]


def source_hash(nodes: list[ast.AST]) -> str:
    if not nodes:
        return ABSENT
    text = "\n".join(ast.unparse(n) for n in nodes)  # the trees are read without docstrings
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- reading a cite -------------------------------------------------------------------------------------------

PATH = r"(?:[\w.]+/)*\w+\.py"
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
VERSIONS = re.compile(r"\s+\d+(?:\.\d+)+(?:\s*-\s*\d+(?:\.\d+)+)?(?=\s*:)")  # "x.py 0.5.21-0.5.23:"


def _commentary_removed(text: str) -> str:
    """The cite without its parenthesised and backticked commentary; a parenthesis right after a path that
    holds only paths (``nvidia/mtp.py (amd/mtp.py, ...)``: the other platform's copies) joins them to it."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(rf"({PATH})\s*\(((?:\s*{PATH}\s*(?:,|and)?)+)\)", r"\1 and \2", text)
    text = VERSIONS.sub("", text)
    out, depth = [], 0
    for ch in text:
        depth += ch in "([{"
        if depth == 0:
            out.append(ch)
        depth = max(0, depth - (ch in ")]}"))
    return "".join(out)


def _code_like(token: str) -> bool:
    """A name that reads as code: snake_case, a dotted member, or a CamelCase class (``DeepseekV2MoE``, not
    ``ROCm`` or ``CUDA``)."""
    return "_" in token or "." in token or re.search(r"[a-z][A-Z]|[A-Z][a-z]+[A-Z]", token) is not None


def _class_like(token: str) -> bool:
    return re.search(r"[a-z0-9][A-Z]", token.split(".")[0]) is not None and token[0].isupper()


@dataclass(frozen=True)
class CitedFiles:
    written: tuple[str, ...]  # the paths as the cite writes them (``a.py and b.py:``: both)
    required: tuple[str, ...]  # names that must resolve: the first after the colon, each Class / Class.member
    optional: tuple[str, ...]  # other code-like names (attributes, locals in prose), counted where they resolve


def parse_cite(cite: str) -> tuple[list[CitedFiles], list[str]]:
    """The file groups a cite cites (paths ending in ``:``) with their names, and every path it mentions in
    order (relative paths resolve against the one before)."""
    text = _commentary_removed(cite)
    paths = list(re.finditer(PATH, text))
    groups, group = [], []
    for i, mark in enumerate(paths):
        group.append(mark.group(0))
        after = text[mark.end():paths[i + 1].start() if i + 1 < len(paths) else len(text)]
        if re.fullmatch(r"\s*(?:,|and|,\s*and)\s*(?:\w+'s\s+)?", after):
            continue  # "a.py and b.py": one group
        if after.lstrip().startswith(":"):
            body = after.lstrip()[1:]
            required, optional = [], []
            leading = True  # the names listed right after the colon must resolve; names in prose after need not
            for k, item in enumerate(re.split(r"[,;]", body)):
                tokens = NAME.findall(item)
                listing = re.fullmatch(r"\s*(?:and\s+)?\*?[\w.]+(?:\s*(?:/|and)\s*\*?[\w.]+)*\s*\.?\s*", item)
                for j, token in enumerate(tokens):
                    member = k == 0 and j == 0 and _class_like(token) and "." in token  # "Class.method via ..."
                    lower_path = "." in token and not _class_like(token)  # "attn.qkv": a module path in prose
                    if _code_like(token) and (leading and listing and not lower_path or member):
                        required.append(("*" if item.strip().startswith("*" + token) else "") + token)
                    elif _code_like(token):
                        optional.append(token)
                leading = leading and bool(listing)
            groups.append(CitedFiles(tuple(group), tuple(dict.fromkeys(required)), tuple(dict.fromkeys(optional))))
        group = []
    return groups, [m.group(0) for m in paths]


def resolve_cite(wheel_: Wheel, cite: str, where: str, hint: str = "") -> list[str]:
    """The ``file:symbol`` keys a cite names in this release; a file or required name it lacks is refused.
    A name found in none of the cite's files resolves where the wheel defines it, when one file does."""
    groups, mentioned = parse_cite(cite)
    if not groups:
        raise CiteError(f"{where}: the cite names no wheel file (write \"<path in the wheel>.py: <symbol>\")")
    cited = {w for g in groups for w in g.written}
    resolved: dict[str, str] = {}
    previous: list[str] = []
    for written in mentioned:
        path = wheel_.resolve_file(written, previous, hint)
        if path is None and written in cited:
            raise CiteError(f"{where}: cite names {written}, which {wheel_.engine} {wheel_.release} does not "
                            "have; fix the cite's path (relative paths resolve against the previous file's folder)")
        if path is not None:
            resolved.setdefault(written, path)
            previous.append(path)
    keys = []
    for group in groups:
        files = [resolved[w] for w in group.written]
        others = [p for p in dict.fromkeys(resolved.values()) if p not in files]
        found = []
        for name in group.required:
            where_found = [p for p in files if symbol_nodes(wheel_, p, name)] or \
                [p for p in others if symbol_nodes(wheel_, p, name)][:1]
            anywhere = wheel_.top_level_index.get(name.split(".")[0], []) if not where_found else []
            if not where_found and len(anywhere) == 1 and symbol_nodes(wheel_, anywhere[0], name):
                where_found = anywhere
            if not where_found:
                raise CiteError(f"{where}: cite names {name} in {' and '.join(files)}, which {wheel_.engine} "
                                f"{wheel_.release} does not define; fix the cite (Class.method, function, "
                                "Class.attribute or CONSTANT after \"<file>.py:\")")
            found += [f"{p}:{name}" for p in where_found]
        for name in group.optional:  # a name in prose counts where the cited file itself defines it
            found += [f"{p}:{name}" for p in files if symbol_nodes(wheel_, p, name, local=True)]
        keys += found or [f"{p}:{WHOLE_FILE}" for p in files]
    return list(dict.fromkeys(keys))


# --- the model registry -----------------------------------------------------------------------------------------

def registered(wheel_: Wheel) -> frozenset[str]:
    """The model classes the release registers: sglang's ``EntryClass`` of each ``sglang/srt/models/`` file,
    vLLM's architecture keys in ``vllm/model_executor/models/registry.py``."""
    names: set[str] = set()
    if wheel_.engine == "sglang":
        for path in sorted(f for f in wheel_.files if f.startswith("sglang/srt/models/")):
            entry = re.search(r"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)", wheel_.source(path), re.MULTILINE)
            names |= set(re.findall(r"\w+", entry.group(1))) if entry else set()
    else:
        tree = wheel_.tree("vllm/model_executor/models/registry.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return frozenset(names)


# --- locks --------------------------------------------------------------------------------------------------------

def rule_file_names() -> list[str]:
    return [name for engine in ENGINES for name in rules._class_files(engine)]


def lock_path(name: str) -> Path:
    path = rules.rules_path(name)
    return path.with_name(path.stem + ".lock.yaml")


def _first_read(name: str, first: str, last: str) -> str:
    """The release a rule set's cites are resolved in: the first release read in its span."""
    file = rules.rule_file(name)
    from packaging.version import Version
    read = [v for v in file.checked if Version(first) <= Version(v) <= Version(last)]
    if not read:
        raise RuleFileError(f"{rules.rules_path(name)}: rule set {first}..{last} covers no release in checked")
    return read[0]


def _ranges(engine: str, per_release: dict[str, str]) -> dict[str, str]:
    """Consecutive window releases with one value, as ``first..last`` (or one release) -> value."""
    out: dict[str, str] = {}
    run: list[str] = []
    releases = [r for r in rules.window(engine) if r in per_release]

    def close():
        if run:
            out[run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}"] = per_release[run[0]]

    for release in releases:
        if run and per_release[release] != per_release[run[-1]]:
            close()
            run = []
        run.append(release)
    close()
    return out


class Wheels:
    """The wheels of a run, opened once each."""

    def __init__(self, download: bool = True):
        self.download = download
        self._open: dict[tuple[str, str], Wheel] = {}

    def __call__(self, engine: str, release: str) -> Wheel:
        key = (engine, release)
        if key not in self._open:
            self._open[key] = Wheel(engine, release, wheel(engine, release, self.download))
        return self._open[key]


def cited_symbols(name: str, wheels: Wheels) -> list[dict]:
    """Each rule set of a rule file with the ``file:symbol`` keys of each rule's cite, resolved in the first
    release read of the set that states the cite (a later set that keeps the rule keeps its keys)."""
    engine, _, family = name.partition(".")
    stated: dict[tuple[str, str], list[str]] = {}
    sets = []
    for rule_set in rules._rule_sets(name):
        read_in = _first_read(name, rule_set.first, rule_set.last)
        where = f"{rules.rules_path(name)}: rule set {rule_set.first}..{rule_set.last}"
        for rule, cite in rule_set.cites.items():
            if (rule, cite) not in stated:
                stated[rule, cite] = resolve_cite(wheels(engine, read_in), cite, f"{where}: {rule}", family)
        sets.append({"versions": [rule_set.first, rule_set.last],
                     "rules": {rule: stated[rule, cite] for rule, cite in sorted(rule_set.cites.items())}})
    return sets


def release_hashes(whl: Wheel, keys: list[str]) -> dict[str, str]:
    """Each ``file:symbol`` key's source hash in this release (``absent`` when it lacks the file or symbol)."""
    out = {}
    for key in keys:
        path, _, symbol = key.rpartition(":")
        out[key] = source_hash(symbol_nodes(whl, path, symbol)) if path in whl.files else ABSENT
    return out


def stale_locks() -> list[str]:
    """One line per rule file whose lock is missing or was computed for other cites or another window."""
    return [f"{lock_path(name)}: does not match {rules.rules_path(name)} (its cites, spans or the window); "
            f"regenerate it: {rules.lock_command(name)}" for name in rule_file_names() if rules.lock_stale(name)]


def compute_lock(name: str, wheels: Wheels) -> dict:
    """A rule file's lock: each rule set's cited symbols, each symbol's hash per window release, and the
    releases registering each model class."""
    engine = name.split(".", 1)[0]
    file = rules.rule_file(name)
    sets = cited_symbols(name, wheels)
    keys = sorted({k for s in sets for keys in s["rules"].values() for k in keys})
    hashes: dict[str, dict[str, str]] = {k: {} for k in keys}
    classes: dict[str, dict[str, str]] = {c: {} for c in file.model_classes}
    for release in rules.window(engine):
        whl = wheels(engine, release)
        for key, value in release_hashes(whl, keys).items():
            hashes[key][release] = value
        built = _registered(whl)
        for c, per_release in classes.items():
            per_release[release] = "built" if c in built else "not built"
    return {"rule_file": str(rules.shown_path(name)),
            "cites": rules.cites_digest(name),
            "rule_sets": sets,
            "hashes": {k: _ranges(engine, v) for k, v in hashes.items()},
            "model_classes": {c: _ranges(engine, v) for c, v in classes.items()}}


_REGISTERED: dict[Path, frozenset[str]] = {}


def _registered(whl: Wheel) -> frozenset[str]:
    if whl.path not in _REGISTERED:
        _REGISTERED[whl.path] = registered(whl)
    return _REGISTERED[whl.path]


LOCK_HEADER = """\
# Written by `python -m quant.engines.window lock {file}` from the wheels of every release in
# manifests/engines/releases.yaml; do not edit (a test fails when it no longer matches the rule file's cites).
# rule_sets: the wheel symbols each rule's cite names (file:Class.member; `*` a whole file), resolved in the
# set's first read release. hashes: per symbol, the releases (first..last of the window) whose source of it
# (ast.unparse, docstrings dropped) hashes the same; `absent`: the release lacks it. model_classes: which
# releases register each class. quant.engines.rules.release_states reads this file.
"""


class _PlainDumper(yaml.SafeDumper):
    """Every value written out (quantgate's YAML reader refuses aliases)."""

    def ignore_aliases(self, data) -> bool:
        return True


def write_lock(name: str, wheels: Wheels) -> Path:
    lock = compute_lock(name, wheels)
    path = lock_path(name)
    text = LOCK_HEADER.format(file=lock["rule_file"]) + yaml.dump(lock, Dumper=_PlainDumper, sort_keys=False, width=120)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# --- report ---------------------------------------------------------------------------------------------------

def report_rows(engine: str | None = None, family: str | None = None) -> list[dict]:
    """Per rule file (and the family reading it), per window release: its state."""
    from quant.layout import known_families
    rows = []
    for fam in known_families():
        if family and fam.name != family:
            continue
        for eng in ENGINES:
            if engine and eng != engine or eng not in fam.engine_class:
                continue
            try:
                states = rules.release_states(eng, fam)
                name = rules.rules_file(eng, fam)
            except rules.UnknownEngine as exc:
                rows.append({"family": fam.name, "engine": eng, "error": str(exc)})
                continue
            rows.append({"family": fam.name, "engine": eng, "rule_file": str(rules.rules_path(name)),
                         "releases": [s.as_dict() for s in states.values()]})
    return rows


def _describe(state: dict, symbols: bool) -> str:
    if state["state"] == "carried":
        return f"carried from {state['follows']} (identical cited source)"
    if state["state"] == "needs reading":
        if not state["follows"]:
            return "needs reading: " + "; ".join(state["changed"])
        rules_ = dict.fromkeys(c.split(": ", 1)[0] for c in state["changed"])
        what = "; ".join(state["changed"]) if symbols else ", ".join(rules_)
        return f"needs reading (changed since {state['follows']}: {what})"
    return state["state"]


def print_report(rows: list[dict], symbols: bool = False) -> None:
    """Per family and engine, consecutive releases in one state as one line."""
    for row in rows:
        print(f"{row['family']} / {row['engine']}: " + (row.get("error") or row["rule_file"]))
        run: list[dict] = []
        for state in [*row.get("releases", []), None]:
            line = state and _describe(state, symbols)
            if run and (state is None or line != _describe(run[0], symbols)):
                span = run[0]["release"] + (f"..{run[-1]['release']}" if len(run) > 1 else "")
                print(f"  {span:<28} {_describe(run[0], symbols)}")
                run = []
            if state is not None:
                run.append(state)


def registry_releases(engine: str) -> list[str]:
    """Every final release of ``engine`` on the package registry (``pip index versions``), oldest first."""
    from packaging.version import Version
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", engine], capture_output=True,
                          text=True, timeout=300, check=False)
    found = re.search(r"Available versions: (.*)", done.stdout)
    if done.returncode or not found:
        raise RuleFileError(f"pip index versions {engine} failed: {done.stderr.strip()[-300:]}")
    return sorted({v.strip() for v in found.group(1).split(",") if not Version(v.strip()).is_prerelease}, key=Version)


def _spans(releases: list[dict], state: str) -> str:
    """The releases in ``state`` as ranges of consecutive window releases (``0.5.9-0.5.12.post1, 0.5.20``)."""
    out, run = [], []
    for entry in [*releases, None]:
        if entry is not None and entry["state"] == state:
            run.append(entry["release"])
            continue
        if run:
            out.append(run[0] + (f"-{run[-1]}" if len(run) > 1 else ""))
            run = []
    return ", ".join(out) or "-"


def print_table(rows: list[dict]) -> None:
    """The window as one Markdown table: family x engine x release ranges per state."""
    print("| family | engine | read | carried over (identical cited source) | needs reading | not built |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['family']} | {row['engine']} | refused: {row['error']} | | | |")
            continue
        cells = [_spans(row["releases"], s) for s in ("read", "carried", "needs reading", "not built")]
        print(f"| {row['family']} | {row['engine']} | " + " | ".join(cells) + " |")


def refresh(wheels: Wheels | None) -> list[str]:
    """Add the registry's releases from the window's first on that it does not list (a new ``.postN`` of an
    older release included) to ``releases.yaml``, downloading their wheels; returns them. ``wheels`` None:
    only name them (a dry run)."""
    from packaging.version import Version
    added, lines = [], {}
    for engine in ENGINES:
        listed = rules.window(engine)
        new = [v for v in registry_releases(engine) if Version(v) >= Version(listed[0]) and v not in listed]
        added += [f"{engine}=={v}" for v in new]
        lines[engine] = sorted([*listed, *new], key=Version)
        for release in new if wheels else []:
            wheels(engine, release)
    if added and wheels:
        path = rules.manifests_root() / "engines" / "releases.yaml"
        text = path.read_text()
        for engine, releases in lines.items():
            listing = textwrap.fill(", ".join(releases), 110, initial_indent=f"{engine}: [",
                                    subsequent_indent=" " * (len(engine) + 3)) + "]"
            text = re.sub(rf"(?m)^{engine}: \[[^\]]*\]", lambda m, listing=listing: listing, text)
        path.write_text(text)
        rules.clear_caches()
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quant.engines.window", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="each rule file's releases: read / carried from X / needs reading / not built")
    rep.add_argument("--engine", choices=ENGINES)
    rep.add_argument("--family")
    rep.add_argument("--json", action="store_true")
    rep.add_argument("--symbols", action="store_true", help="name the changed symbols, not only their rules")
    rep.add_argument("--markdown", action="store_true", help="one table: family x engine x release ranges")
    lk = sub.add_parser("lock", help="rewrite the locks (all rule files, or the ones named) from the wheels")
    lk.add_argument("files", nargs="*", help="rule files (path, or name: sglang, vllm.kimi_k25)")
    sub.add_parser("check", help="exit 1 naming each lock that no longer matches its rule file")
    rf = sub.add_parser("refresh", help="append new registry releases to releases.yaml, relock, report")
    rf.add_argument("--json", action="store_true")
    rf.add_argument("--dry-run", action="store_true", help="only name the registry releases the window lacks")
    args = parser.parse_args(argv)
    try:
        if args.command == "lock":
            names = [_name_of(f) for f in args.files] or rule_file_names()
            wheels = Wheels()
            for name in names:
                print(f"wrote {write_lock(name, wheels)}")
            return 0
        if args.command == "check":
            stale = stale_locks()
            print("\n".join(stale) or "every lock matches its rule file")
            return 1 if stale else 0
        if args.command == "refresh":
            if args.dry_run:
                print("\n".join(refresh(None)) or "the window lists every registry release")
                return 0
            wheels = Wheels()
            added = refresh(wheels)
            for name in rule_file_names():
                write_lock(name, wheels)
            rules.clear_caches()
            rows = report_rows()
            if args.json:
                print(json.dumps({"added": added, "files": rows}, indent=1))
            else:
                print("new releases: " + (", ".join(added) or "none"))
                print_report(rows)
            return 0
        if args.family:
            rules.family_named(args.family)
        rows = report_rows(args.engine, args.family)
        if args.json:
            print(json.dumps(rows, indent=1))
        elif args.markdown:
            print_table(rows)
        else:
            print_report(rows, args.symbols)
        return 0
    except QuantgateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _name_of(written: str) -> str:
    """A rule file's name (``sglang``, ``vllm.kimi_k25``) from its path or name."""
    if written in rule_file_names():
        return written
    path = Path(written).resolve()
    for name in rule_file_names():
        if rules.rules_path(name).resolve() == path:
            return name
    raise RuleFileError(f"{written}: not a rule file; name one of {', '.join(rule_file_names())} or its path")


if __name__ == "__main__":
    sys.exit(main())
