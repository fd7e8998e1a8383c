"""aiter's ``get_padded_M`` read from a release's ``fused_moe.py`` without running that file.

``gate kernels --aiter-configs DIR`` takes the padding rule from ``DIR/../fused_moe.py``, a file
from anyone's checkout: executing any of it (a module-level ``_PADDED_M_TIERS = <expr>``, a default
argument, a decorator) would run their code. So constants and default arguments are read with
``ast.literal_eval`` only, and the bodies of ``get_padded_M`` and the helpers it calls
(``nextPow2``) are interpreted here over a small whitelist: assignments, ``if``/``elif``/``else``,
``for`` over a literal tuple, ``return``, integer arithmetic and comparisons, ``min``/``max``/``len``
and ``int.bit_length()``. Anything else (an import, an attribute, a ``while``, a call to anything
not defined in the file) is refused naming the line: the rule then cannot be read, and the error
says to drop the file or use the built-in replay.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

from quant.errors import QuantgateError

MAX_INT = 1 << 64  # a batch size or a tier; a bigger value is not a padding rule (and stops 1 << 10**9)
MAX_STEPS = 100_000  # statements executed per call: a rule is a few dozen
MAX_DEPTH = 16  # calls nested (get_padded_M -> nextPow2 is 2)
FUNCTIONS = ("nextPow2", "get_padded_M")
CONSTANTS = ("_PADDED_M_TIERS",)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitOr: operator.or_, ast.BitAnd: operator.and_}
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
_BUILTINS = {"min": min, "max": max, "len": len, "int": int, "abs": abs}


class RuleError(QuantgateError, ValueError):
    """The file's padding rule uses something this reader does not interpret."""


class _Return(Exception):
    def __init__(self, value):
        self.value = value


def _checked(value):
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise RuleError(f"a value beyond 2**64 ({value.bit_length()} bits)")
    return value


class PureFunction:
    """One whitelisted function of the file, callable like the original."""

    def __init__(self, node: ast.FunctionDef, module: "PaddingRule"):
        self.node, self.module = node, module
        args = node.args
        if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or node.decorator_list:
            raise RuleError(f"line {node.lineno}: {node.name} has decorators or */** arguments")
        self.params = [a.arg for a in args.args]
        # defaults: literals, or one of the file's constants (read with literal_eval as well)
        self.defaults = [module.constant(d) for d in args.defaults]

    def __call__(self, *values):
        if len(values) > len(self.params) or len(values) < len(self.params) - len(self.defaults):
            raise RuleError(f"{self.node.name} called with {len(values)} arguments")
        scope = dict(zip(self.params, [*values, *self.defaults[len(values) - len(self.params):]]))
        if self.module.depth >= MAX_DEPTH:
            raise RuleError(f"line {self.node.lineno}: calls nested deeper than {MAX_DEPTH} ({self.node.name})")
        self.module.depth += 1
        self.steps = 0
        try:
            self._block(self.node.body, scope)
        except _Return as done:
            return done.value
        finally:
            self.module.depth -= 1
        return None

    def _block(self, body: list[ast.stmt], scope: dict) -> None:
        for stmt in body:
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise RuleError(f"line {stmt.lineno}: {self.node.name} runs more than {MAX_STEPS} steps")
            self._stmt(stmt, scope)

    def _stmt(self, stmt: ast.stmt, scope: dict) -> None:
        if isinstance(stmt, ast.Return):
            raise _Return(self._expr(stmt.value, scope) if stmt.value else None)
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            value = self._expr(stmt.value, scope)
            for target in stmt.targets:
                scope[target.id] = value
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and type(stmt.op) in _BINARY:
            scope[stmt.target.id] = _checked(_BINARY[type(stmt.op)](self._name(stmt.target.id, scope, stmt),
                                                                    self._expr(stmt.value, scope)))
        elif isinstance(stmt, ast.If):
            self._block(stmt.body if self._expr(stmt.test, scope) else stmt.orelse, scope)
        elif isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and not stmt.orelse:
            items = self._expr(stmt.iter, scope)
            if not isinstance(items, tuple):
                raise RuleError(f"line {stmt.lineno}: for over {type(items).__name__}, not a literal tuple")
            for item in items:
                scope[stmt.target.id] = item
                self._block(stmt.body, scope)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):  # a docstring
            pass
        elif not isinstance(stmt, ast.Pass):
            raise RuleError(f"line {stmt.lineno}: {type(stmt).__name__} statement in {self.node.name}")

    def _name(self, name: str, scope: dict, node: ast.AST):
        if name in scope:
            return scope[name]
        if name in self.module.functions:
            return self.module.functions[name]
        if name in _BUILTINS:
            return _BUILTINS[name]
        return self.module.constant(node)

    def _expr(self, node: ast.expr, scope: dict):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            return self._name(node.id, scope, node)
        if isinstance(node, ast.Tuple | ast.List):
            return tuple(self._expr(e, scope) for e in node.elts)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._expr(node.left, scope), self._expr(node.right, scope)
            if isinstance(node.op, ast.LShift) and isinstance(right, int) and right > 64:
                raise RuleError(f"line {node.lineno}: a shift by {right} bits")
            return _checked(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.Not):
            value = self._expr(node.operand, scope)
            return -value if isinstance(node.op, ast.USub) else not value
        if isinstance(node, ast.BoolOp):
            value = None
            for part in node.values:
                value = self._expr(part, scope)
                if bool(value) == isinstance(node.op, ast.Or):
                    break
            return value
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = self._expr(node.left, scope)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._expr(right_node, scope)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self._expr(node.body if self._expr(node.test, scope) else node.orelse, scope)
        if isinstance(node, ast.Subscript):
            return self._expr(node.value, scope)[self._expr(node.slice, scope)]
        if isinstance(node, ast.Call) and not node.keywords:
            args = [self._expr(a, scope) for a in node.args]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "bit_length" and not args:
                value = self._expr(node.func.value, scope)
                if isinstance(value, int):
                    return value.bit_length()
            elif isinstance(node.func, ast.Name):
                function = self._name(node.func.id, scope, node.func)
                if isinstance(function, PureFunction) or function in _BUILTINS.values():
                    return _checked(function(*args))
        raise RuleError(f"line {node.lineno}: {ast.unparse(node)[:60]!r} is not something this reader interprets")


class PaddingRule:
    """The file's ``get_padded_M``, interpreted; ``constant`` reads a module-level constant."""

    def __init__(self, source: str):
        tree = ast.parse(source)
        self.depth = 0  # calls in progress
        self.constants: dict[str, object] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in CONSTANTS for t in node.targets):
                try:
                    value = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    raise RuleError(f"line {node.lineno}: _PADDED_M_TIERS is not a literal") from None
                for target in node.targets:
                    self.constants[target.id] = value
        self.functions: dict[str, PureFunction] = {}
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
        for node in defs:
            self.functions[node.name] = PureFunction(node, self)
        if "get_padded_M" not in self.functions:
            raise RuleError("no get_padded_M")
        self.get_padded_M = self.functions["get_padded_M"]

    def constant(self, node: ast.expr):
        """A literal, or the name of a module-level constant: never an expression to run."""
        if isinstance(node, ast.Name):
            if node.id not in self.constants:
                raise RuleError(f"line {node.lineno}: {node.id} is not a constant this reader knows")
            return self.constants[node.id]
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise RuleError(f"line {node.lineno}: default {ast.unparse(node)[:60]!r} is not a literal") from None

    def __call__(self, m: int) -> int:
        value = self.get_padded_M(m)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RuleError(f"get_padded_M({m}) gave {value!r}, not an integer")
        return value


def read_rule(path: Path, source: str) -> PaddingRule:
    """``path``'s padding rule (``source`` is its text); ``RuleError`` names the line it cannot read."""
    try:
        return PaddingRule(source)
    except SyntaxError as exc:
        raise RuleError(f"{path}:{exc.lineno}: not Python ({exc.msg})") from None
    except RuleError as exc:
        raise RuleError(f"{path}: {exc}") from None
