"""sglang's Quark config, run from a release's wheel: every method of ``QuarkConfig``
(``sglang/srt/layers/quantization/quark/quark.py``) but its constructor, with the module's constants and the
matching helpers of ``quark/utils.py``, executed as the release wrote them, never imported from an installed
sglang.

What the engine imports around them is served small: the layer classes ``get_quant_method`` tells apart by
``isinstance`` (sglang's class names, which ``layer_type_quant_config`` is asked with), each scheme and quant
method as a record of its class name (a scheme's ``get_min_capability`` read from the release's scheme file),
and the device: capability 9.5 (MI355, gfx950: sglang's Quark MXFP4 target), launched without
``--enforce-shared-experts-fusion``. The instance holds what the constructor sets for a prequantized checkpoint.
"""

from __future__ import annotations

import __future__

import ast
import fnmatch
import functools
import logging
import types
from typing import Any, NamedTuple, Optional, cast

from tests.quant.engine_sources import _base_namespace, parsed, source_files, wheel

QUARK = "sglang/srt/layers/quantization/quark/quark.py"
UTILS = "sglang/srt/layers/quantization/quark/utils.py"
SCHEMES = "sglang/srt/layers/quantization/quark/schemes/"
SCHEME_FILES = {"QuarkW4A4MXFP4": "quark_w4a4_mxfp4.py", "QuarkW8A8Fp8": "quark_w8a8_fp8.py",
                "QuarkW4A4MXFp4MoE": "quark_w4a4_mxfp4_moe.py", "QuarkW4A8MXFp4MoE": "quark_w4a8_mxfp4_moe.py",
                "QuarkW8A8FP8MoE": "quark_w8a8_fp8_moe.py"}
CAPABILITY = (9, 5)
LINEAR_CLASSES = ("QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
                  "ReplicatedLinear")


class Built(NamedTuple):
    """What the release builds for one module: the scheme or quant method class (None: unquantized), or the
    message of what it raises."""
    scheme: str | None
    raises: str | None = None


class _Logger(logging.Logger):
    def info_once(self, *args, **kwargs):
        pass

    warning_once = info_once


class _Method:
    """A quant method or scheme the release constructs: only its class name is kept."""

    def __init__(self, *args, **kwargs):
        self.args = kwargs


def _record(name: str, capability: int | None = None):
    attrs = {"get_min_capability": classmethod(lambda cls: capability)} if capability is not None else {}
    return type(name, (_Method,), attrs)


def _min_capability(whl, name: str) -> int:
    """A scheme class's ``get_min_capability`` as its file returns it (a literal)."""
    tree = parsed(whl, SCHEMES + SCHEME_FILES[name])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_min_capability")
    return ast.literal_eval(fn.body[-1].value)


class LinearBase:
    pass


class RadixAttention:
    pass


class FusedMoE:
    pass


def layer(class_name: str):
    """A module of sglang class ``class_name`` (a Linear class, FusedMoE, or a bare torch Module)."""
    base = FusedMoE if class_name == "FusedMoE" else LinearBase if class_name in LINEAR_CLASSES else object
    return type(class_name, (base,), {})()


class Release:
    """One release's QuarkConfig, built for a checkpoint's quantization_config."""

    def __init__(self, version: str):
        self.version = version
        self.whl = wheel("sglang", version)
        ns = _base_namespace()
        utils = parsed(self.whl, UTILS)
        self._exec([n for n in utils.body if isinstance(n, ast.FunctionDef)], ns)
        quark = parsed(self.whl, QUARK)
        constants = [n for n in quark.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                     any(isinstance(t, ast.Name) and t.id.startswith("_") for t in
                         (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        have = source_files(self.whl)
        schemes = {name: _record(name, _min_capability(self.whl, name)) for name, file in SCHEME_FILES.items()
                   if SCHEMES + file in have}
        ns.update(schemes)
        ns.update({"fnmatch": fnmatch, "cast": cast, "Optional": Optional, "Any": Any, "torch": _torch(),
                   "logger": _Logger("sglang-quark"), "LinearBase": LinearBase, "RadixAttention": RadixAttention,
                   "UnquantizedLinearMethod": _record("UnquantizedLinearMethod"),
                   "QuarkLinearMethod": _record("QuarkLinearMethod"),
                   "QuarkFusedMoEMethod": _record("QuarkFusedMoEMethod"),
                   "QuarkKVCacheMethod": _record("QuarkKVCacheMethod"), "Fp8Config": _record("Fp8Config"),
                   "Fp8LinearMethod": _record("Fp8LinearMethod"), "Fp8MoEMethod": _record("Fp8MoEMethod"),
                   "get_device_capability": lambda *a, **k: CAPABILITY, "is_hip": lambda: True,
                   "is_gfx95_supported": lambda: True,
                   "envs": types.SimpleNamespace(SGLANG_USE_AITER=types.SimpleNamespace(get=lambda: True)),
                   "get_exec": lambda: types.SimpleNamespace(
                       moe=types.SimpleNamespace(enforce_shared_experts_fusion=False))})
        self._exec(constants, ns)
        node = next(n for n in quark.body if isinstance(n, ast.ClassDef) and n.name == "QuarkConfig")
        body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
        holder = ast.ClassDef(name="QuarkConfig", bases=[], keywords=[], body=body, decorator_list=[])
        self._exec([holder], ns)
        self.cls = ns["QuarkConfig"]
        self.ns = ns

    def _exec(self, nodes: list, ns: dict) -> None:
        code = compile(ast.fix_missing_locations(ast.Module(body=nodes, type_ignores=[])), f"{self.whl.name}",
                       "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, ns)  # noqa: S102 (the engine's own code)

    def config(self, qconfig: dict, packed: dict[str, list[str]], mapper=None, num_hidden_layers: int = 2):
        """The QuarkConfig a prequantized checkpoint's ``qconfig`` builds (``__init__``'s attributes), its
        weight-name mapper applied where the release has ``apply_weight_name_mapper`` (``mapper``: an object
        with ``apply_list`` / ``apply_dict``)."""
        import copy

        config = object.__new__(self.cls)
        config.quant_config = {**copy.deepcopy(qconfig), "packed_modules_mapping": packed}
        config.packed_modules_mapping = packed
        config.exclude_layers = list(qconfig.get("exclude") or [])
        config.kv_cache_group, config.kv_cache_config, config.pack_method = [], None, "reorder"
        config.is_prequantized, config.online_scheme = True, None
        config.dequantization_config = config.excluded_fp8_config = None
        config.num_hidden_layers, config.num_nextn_predict_layers = num_hidden_layers, 0
        config.model_type = "qwen3_moe"
        config._online_quantized_layers = config._quantized_layers = set()
        if mapper is not None and hasattr(config, "apply_weight_name_mapper"):
            config.apply_weight_name_mapper(mapper)
        return config

    def build(self, qconfig: dict, packed: dict, module: str, class_name: str, mapper=None) -> Built:
        """``get_quant_method`` for ``module`` built as ``class_name``: the scheme (``layer.scheme``) or the
        quant method it returns, or what it raises."""
        with _served():
            config = self.config(qconfig, packed, mapper)
            built = layer(class_name)
            try:
                method = config.get_quant_method(built, module)
            except (ValueError, NotImplementedError, RuntimeError) as exc:
                return Built(None, f"{type(exc).__name__}: {exc}")
        scheme = getattr(built, "scheme", None)
        if scheme is not None:
            return Built(type(scheme).__name__)
        return Built(None if method is None or type(method).__name__ == "UnquantizedLinearMethod"
                     else type(method).__name__)

    def can_fuse(self, qconfig: dict, packed: dict) -> bool | None:
        """``can_fuse_shared_expert`` (None: the release's QuarkConfig has none)."""
        with _served():
            config = self.config(qconfig, packed)
            if not hasattr(config, "can_fuse_shared_expert"):
                return None
            return config.can_fuse_shared_expert()


@functools.cache
def _torch():
    import torch

    return torch


def _served():
    from tests.quant.engine_sources import served_modules

    return served_modules({"sglang.srt.layers.moe.fused_moe_triton.layer": {"FusedMoE": FusedMoE}})


class Mapper:
    """sglang's WeightsMapper (models/utils.py) for a substring mapper: ``apply_list`` / ``apply_dict`` as
    QuarkConfig.apply_weight_name_mapper calls them, each name through the longest matching substring."""

    def __init__(self, substr: dict[str, str | None]):
        self.substr = substr

    def _map(self, name: str) -> str | None:
        for old, new in sorted(self.substr.items(), key=lambda item: -len(item[0])):
            if old in name:
                return None if new is None else name.replace(old, new, 1)
        return name

    def apply_list(self, values):
        return [m for v in values if (m := self._map(v)) is not None]

    def apply_dict(self, values):
        return {m: v for k, v in values.items() if (m := self._map(k)) is not None}
