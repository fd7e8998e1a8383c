"""vLLM's compressed-tensors quantization layer run from a release's wheel, for the differential tests.

``WheelConfig(release, qconfig, packed, mapper)`` is the release's own ``CompressedTensorsConfig``: its
``from_config`` (with ``__init__``), ``apply_vllm_mapper``, ``get_quant_method``, ``get_scheme``,
``get_scheme_dict``, ``_get_scheme_from_parts`` and predicates, ``_add_fused_moe_to_target_scheme_map``, the
utils.py matchers (and quantization/utils/config_utils.py's from 0.30.0) and
``CompressedTensorsMoEMethod.get_moe_method``, executed from the wheel's source. What they import from the
rest of vLLM is served as named stand-ins: the layer classes (LinearBase, ParallelLMHead, FusedMoE or
RoutedExperts) so ``isinstance`` dispatches as in the engine, and every scheme / method class as a class
that records its name, so ``build`` returns what the engine would construct: ``("unquantized", None)``,
``("scheme", <class name>, <the weights args it matched>)`` or ``("raises", <exception type>, <message>)``.
The GPU is a CUDA sm90 one (H100 / H200): ``_check_scheme_supported`` compares with capability 90.
compressed-tensors' own ``QuantizationArgs`` (the library, installed for the tests) validates the args.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types
from functools import cache
from typing import Any, Literal, cast

from tests.quant.engine_sources import (
    WheelUnavailable,
    free_names,
    parsed,
    source_files,
    wheel,
)

CT_DIR = "vllm/model_executor/layers/quantization/compressed_tensors/"
CONFIG_UTILS = "vllm/model_executor/layers/quantization/utils/config_utils.py"
CAPABILITY = 90
CONFIG_METHODS_SKIPPED = {"get_linear_method", "get_supported_act_dtypes", "get_min_capability", "get_name",
                          "get_config_filenames", "has_blocked_weights",
                          "get_cache_scale", "is_mixed_precision"}


class Stand:
    """A vLLM class the functions construct: it keeps what it was given."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    @classmethod
    def get_min_capability(cls) -> int:
        return 0


def stand(name: str, base: type = Stand) -> type:
    return type(name, (base,), {})


class _Logger:
    def __getattr__(self, name):
        return lambda *a, **k: None


class _StandModule(types.ModuleType):
    """A vLLM module imported inside a function (``from .compressed_tensors_moe_wna16 import X``): every
    name it is asked for is a stand-in class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = stand(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def vllm_stand_ins():
    """vLLM's modules as stand-ins while a wheel function imports from them; sys.modules as it was after."""
    before = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(before)


def _top(whl, path: str, names: set[str] | None = None) -> list[ast.stmt]:
    """Top-level functions / classes / assignments of ``path`` (all, or those named)."""
    out = []
    for node in parsed(whl, path).body:
        named = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if named and (names is None or set(named) & names):
            out.append(node)
    return out


def _class(whl, path: str, cls: str, keep=lambda name: True) -> ast.ClassDef:
    node = next(n for n in parsed(whl, path).body if isinstance(n, ast.ClassDef) and n.name == cls)
    body = [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or keep(n.name)]
    return ast.ClassDef(name=cls, bases=[], keywords=[], body=body, decorator_list=[], type_params=[])


class _Platform:
    @staticmethod
    def get_device_capability():
        return types.SimpleNamespace(to_int=lambda: CAPABILITY, major=CAPABILITY // 10, minor=CAPABILITY % 10)

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


@cache
def release_layer(release: str):
    """The wheel's CompressedTensorsConfig (a class) and the layer classes it dispatches on, for ``release``."""
    import regex
    import torch
    from compressed_tensors.config import (
        CompressionFormat,
        SparsityCompressionConfig,
        SparsityStructure,
    )
    from compressed_tensors.quantization import (
        ActivationOrdering,
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )

    whl = wheel("vllm", release)
    files = source_files(whl)
    ct = CT_DIR + "compressed_tensors.py"
    moe = CT_DIR + ("compressed_tensors_moe/compressed_tensors_moe.py"
                    if CT_DIR + "compressed_tensors_moe/compressed_tensors_moe.py" in files
                    else "compressed_tensors_moe.py")
    layers = {n: stand(n) for n in ("LinearBase", "Attention", "VocabParallelEmbedding")}
    layers["ParallelLMHead"] = stand("ParallelLMHead", layers["VocabParallelEmbedding"])
    layers["FusedMoE"] = stand("FusedMoE")
    layers["RoutedExperts"] = stand("RoutedExperts")
    if "RoutedExperts: TypeAlias = FusedMoE" in _text(whl, "vllm/model_executor/layers/fused_moe/__init__.py"):
        layers["RoutedExperts"] = layers["FusedMoE"]  # 0.22.0, 0.23.0: an alias of FusedMoE
    ns: dict[str, Any] = {
        "__name__": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
        "__package__": "vllm.model_executor.layers.quantization.compressed_tensors",
        "re": regex, "torch": torch, "Any": Any, "Literal": Literal, "cast": cast, "logger": _Logger(),
        "suppress": contextlib.suppress, "partial": functools.partial,
        "QuantizationArgs": QuantizationArgs, "QuantizationStrategy": QuantizationStrategy,
        "QuantizationType": QuantizationType, "CompressionFormat": CompressionFormat,
        "ActivationOrdering": ActivationOrdering, "SparsityCompressionConfig": SparsityCompressionConfig,
        "SparsityStructure": SparsityStructure, "current_platform": _Platform(),
        "check_moe_marlin_supports_layer": lambda *a, **k: True,
        "get_linear_transform_schemes": lambda *a, **k: (None, None),
        "get_current_vllm_config": lambda: types.SimpleNamespace(
            lora_config=None, kernel_config=types.SimpleNamespace(moe_backend="auto")),
        "get_current_vllm_config_or_none": lambda: None,
        "QUANTIZATION_SCHEME_MAP_TYPE": dict, "SPARSITY_CONFIG_NAME": "sparsity_config",
        "WNA16_SUPPORTED_BITS": _wna16_bits(whl), **layers,
    }
    from collections.abc import Iterable, Mapping
    from types import MappingProxyType
    ns.update(Iterable=Iterable, Mapping=Mapping, MappingProxyType=MappingProxyType, Module=torch.nn.Module)
    nodes = []
    if CONFIG_UTILS in files and "def find_matching_patterns" in _text(whl, CONFIG_UTILS):
        nodes += _top(whl, CONFIG_UTILS, {"find_matching_patterns", "is_equal_or_regex_match"})
    nodes += _top(whl, CT_DIR + "utils.py", {"is_activation_quantization_format", "should_ignore_layer",
                                             "check_equal_or_regex_match", "find_matched_target", "_find_first_match",
                                             "_is_equal_or_regex_match", "_match_fused_layer"})
    nodes.append(_class(whl, ct, "CompressedTensorsConfig", lambda n: n not in CONFIG_METHODS_SKIPPED))
    nodes.append(_class(whl, moe, "CompressedTensorsMoEMethod", lambda n: n == "get_moe_method"))
    module = ast.Module(body=nodes, type_ignores=[])
    needed = set()
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef):
            needed |= free_names(node)
    for name in sorted(needed - set(ns) - {n.name for n in nodes if hasattr(n, "name")}):
        ns[name] = stand(name)  # the scheme / method classes, UnquantizedLinearMethod, ...
    with vllm_stand_ins():
        code = compile(ast.fix_missing_locations(module), f"{whl.name}/{ct}", "exec")
        exec(code, ns)  # noqa: S102 (the engine's own code)
    return ns, layers


def _text(whl, path: str) -> str:
    from tests.quant.engine_sources import source
    try:
        return source(whl, path)
    except KeyError:
        return ""


def _wna16_bits(whl) -> list[int]:
    """schemes/compressed_tensors_wNa16.py WNA16_SUPPORTED_BITS (the keys of its types map)."""
    text = _text(whl, CT_DIR + "schemes/compressed_tensors_wNa16.py")
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "WNA16_SUPPORTED_TYPES_MAP":
            return [k.value for k in node.value.keys]
    raise LookupError("WNA16_SUPPORTED_TYPES_MAP")


class Mapper:
    """vLLM's WeightsMapper as far as apply_vllm_mapper uses it (``_map_name``: substrings, prefixes,
    suffixes, in order, None dropping the name), for a class mapper given as our ``exclude_mapper``."""

    def __init__(self, substr=None, prefix=None, suffix=None):
        self.subs, self.prefix, self.suffix = substr or {}, prefix or {}, suffix or {}

    def _map_name(self, key: str):
        for old, new in self.subs.items():
            if old in key:
                if new is None:
                    return None
                key = key.replace(old, new, 1)
        for old, new in self.prefix.items():
            if key.startswith(old):
                if new is None:
                    return None
                key = key.replace(old, new, 1)
        for old, new in self.suffix.items():
            if key.endswith(old):
                if new is None:
                    return None
                key = new.join(key.rsplit(old, 1))
        return key


def build(release: str, qconfig: dict, module: str, kind: str, packed: dict | None = None,
          mapper: Mapper | None = None, layer_class: str = "", ckpt_leaves=("gate_proj", "up_proj", "down_proj")):
    """What ``release`` builds for ``module`` (``kind``: linear | lm_head | moe) of a checkpoint of ``qconfig``."""
    import copy

    ns, layers = release_layer(release)
    config_cls = ns["CompressedTensorsConfig"]
    try:
        config = config_cls.from_config(copy.deepcopy(qconfig))
        config.packed_modules_mapping = dict(packed or {})
        if mapper is not None:
            config.apply_vllm_mapper(mapper)
        if kind == "linear":
            layer = stand(layer_class or "ColumnParallelLinear", layers["LinearBase"])()
        elif kind == "lm_head":
            layer = layers["ParallelLMHead"]()
        else:
            cls = layers["RoutedExperts"] if "RoutedExperts" in _names(ns) else layers["FusedMoE"]
            layer = cls()
            layer.moe_config = None
            layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = ckpt_leaves
        with vllm_stand_ins():
            method = config.get_quant_method(layer, module)
    except Exception as exc:  # noqa: BLE001 (the release's own error is the outcome)
        return ("raises", type(exc).__name__, str(exc))
    if method is None or type(method).__name__.startswith("Unquantized"):
        return ("unquantized", None)
    scheme = getattr(layer, "scheme", None)
    built = type(scheme if scheme is not None else method).__name__
    return ("scheme", built)


def _names(ns) -> frozenset[str]:
    return frozenset(ns["CompressedTensorsConfig"].get_quant_method.__code__.co_names)


__all__ = ["Mapper", "WheelUnavailable", "build", "release_layer"]
