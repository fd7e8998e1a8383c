"""vLLM's Quark quantization layer run from a release's wheel, for the per-layer differential tests.

``build(release, qconfig, module, kind, packed)`` runs the release's own ``QuarkConfig`` (``from_config``,
``get_quant_method`` and everything it calls in quark.py: ``_find_matched_config``, the scheme predicates,
``get_scheme`` / ``get_scheme_cls``), quark/utils.py, quantization/utils/ocp_mx_utils.py (the OCP MX keys and
dtype maps) and quark_moe.py's ``QuarkMoEMethod.get_moe_method`` (and ``get_moe_method_target``), executed from
the wheel's source, plus the real constructor of ``QuarkOCP_MX_MoEMethod`` (it refuses static or dynamic FP8
activations by release). What they import from the rest of vLLM is served as named stand-ins (tests/quant/
ct_vllm_wheel.py): the layer classes so ``isinstance`` dispatches as in the engine, each other scheme / method
class as a class that records its name, each QuantKey constant as a distinct object. The GPU is a CUDA sm90 one
(H100 / H200): no native MX support, so MX MoE runs emulated or through the non-OSS method, as the code picks.

Returns ``("unquantized", None)``, ``("scheme", <class name>)`` or ``("raises", <exception type>, <message>)``;
``matched(release, qconfig, module, packed)`` is ``_find_matched_config`` alone (the config dict or the raise).
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import functools
from enum import Enum
from functools import cache
from typing import Any, NamedTuple, cast

from tests.quant.ct_vllm_wheel import (
    Mapper,
    _class,
    _Logger,
    _Platform,
    _text,
    _top,
    stand,
    vllm_stand_ins,
)
from tests.quant.engine_sources import WheelUnavailable, parsed, source_files, wheel

QUARK = "vllm/model_executor/layers/quantization/quark/"
OCP_MX = "vllm/model_executor/layers/quantization/utils/ocp_mx_utils.py"
CONFIG_UTILS = "vllm/model_executor/layers/quantization/utils/config_utils.py"
CONFIG_SKIPPED = {"get_linear_method", "get_supported_act_dtypes", "get_min_capability", "get_name",
                  "get_config_filenames", "get_cache_scale", "get_cache_scale_mapper", "maybe_update_config"}


class Key:
    """A QuantKey constant (``kFp8StaticTensorSym`` ...): distinct, compared by identity, named."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Key(f"{self.name}.{attr}")


class _Anything:
    """A value nothing of the outcome depends on (backends, vllm config, aiter ops): any attribute, call or
    item is another one; false so no native backend is taken."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *a, **k):
        return _Anything()

    def __getitem__(self, item):
        return _Anything()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter((_Anything(), _Anything()))


class _Cuda(_Platform):
    """CUDA sm90: no native MX (OCP microscaling) support."""

    @staticmethod
    def supports_mx() -> bool:
        return False

    @staticmethod
    def fp8_dtype():
        import torch
        return torch.float8_e4m3fn


def _is_key(name: str) -> bool:
    return len(name) > 1 and name[0] == "k" and name[1].isupper()


@cache
def release_layer(release: str):
    """The wheel's QuarkConfig and the layer classes it dispatches on, for ``release``."""
    import torch

    whl = wheel("vllm", release)
    files = source_files(whl)
    layers = {n: stand(n) for n in ("LinearBase", "Attention")}
    layers["FusedMoE"] = stand("FusedMoE")
    layers["RoutedExperts"] = stand("RoutedExperts")
    if "RoutedExperts: TypeAlias = FusedMoE" in _text(whl, "vllm/model_executor/layers/fused_moe/__init__.py"):
        layers["RoutedExperts"] = layers["FusedMoE"]
    ns: dict[str, Any] = {
        "__name__": "vllm.model_executor.layers.quantization.quark.quark",
        "__package__": "vllm.model_executor.layers.quantization.quark",
        "fnmatch": fnmatch, "torch": torch, "Any": Any, "cast": cast, "NamedTuple": NamedTuple,
        "logger": _Logger(), "Enum": Enum, "current_platform": _Cuda(), "partial": functools.partial,
        "rocm_aiter_ops": _Anything(), "get_current_vllm_config": _Anything(), **layers,
    }
    from collections.abc import Iterable, Mapping
    from types import MappingProxyType

    import regex
    ns.update(re=regex, Iterable=Iterable, Mapping=Mapping, MappingProxyType=MappingProxyType)
    nodes: list[ast.stmt] = []
    if CONFIG_UTILS in files and "def find_matching_patterns" in _text(whl, CONFIG_UTILS):
        nodes += _top(whl, CONFIG_UTILS, {"find_matching_patterns", "is_equal_or_regex_match"})
    if OCP_MX in files:
        nodes += _module_body(whl, OCP_MX)
    nodes += _module_body(whl, QUARK + "utils.py")
    nodes += _top(whl, QUARK + "quark.py", {"QuantKeyMatch"})
    nodes.append(_class(whl, QUARK + "quark.py", "QuarkConfig", lambda n: n not in CONFIG_SKIPPED))
    nodes.append(_class(whl, QUARK + "quark_moe.py", "QuarkMoEMethod",
                        lambda n: n in ("get_moe_method", "get_moe_method_target")))
    nodes[-1].bases = [ast.Name("_MoEBase", ast.Load())]  # a method class: what the stand-ins derive from
    ocp_moe = _class(whl, QUARK + "quark_moe.py", "QuarkOCP_MX_MoEMethod", lambda n: n == "__init__")
    ocp_moe.bases = [ast.Name("QuarkMoEMethod", ast.Load())]
    nodes.append(ocp_moe)
    nodes += [n for n in _module_body(whl, QUARK + "schemes/quark_ocp_mx.py")  # its own key maps (0.27.0-0.29.0)
              if isinstance(n, (ast.Assign, ast.AnnAssign))]
    ocp_linear = _class(whl, QUARK + "schemes/quark_ocp_mx.py", "QuarkOCP_MX", lambda n: n == "__init__")
    ocp_linear.bases = [ast.Name("_SchemeBase", ast.Load())]
    nodes.append(ocp_linear)
    module = ast.Module(body=nodes, type_ignores=[])
    defined = {n.name for n in nodes if hasattr(n, "name")} | {
        t.id for n in nodes for t in getattr(n, "targets", []) if isinstance(t, ast.Name)} | {
        n.target.id for n in nodes if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    needed = {n.id for n in ast.walk(module) if isinstance(n, ast.Name)}  # every name the code reads
    import builtins
    for name in sorted(needed - set(ns) - defined - set(dir(builtins))):
        ns[name] = Key(name) if _is_key(name) else stand(name)
    ns["_MoEBase"] = stand("FusedMoEMethodBase")
    ns["_SchemeBase"] = stand("QuarkScheme")
    for name in ("select_mxfp4_moe_backend", "backend_to_kernel_cls", "Mxfp4MoeBackend",
                 "mxfp4_round_up_hidden_size_and_intermediate_size"):
        ns[name] = _Anything()
    with vllm_stand_ins():
        code = compile(ast.fix_missing_locations(module), f"{whl.name}/{QUARK}quark.py", "exec")
        exec(code, ns)  # noqa: S102 (the engine's own code)
    for name in [n for n in ns if n.startswith("Quark") and n.endswith("MoEMethod") and n not in defined]:
        ns[name] = type(name, (ns["QuarkMoEMethod"],), {})  # issubclass(method_cls, QuarkMoEMethod) holds
    return ns, layers


def _module_body(whl, path: str) -> list[ast.stmt]:
    """A module's top-level functions, classes and assignments (its imports and logger left out)."""
    return [node for node in parsed(whl, path).body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AnnAssign))
            or isinstance(node, ast.Assign) and not _logger_assign(node)]


def _logger_assign(node: ast.Assign) -> bool:
    return any(isinstance(t, ast.Name) and t.id == "logger" for t in node.targets)


def _config(release: str, qconfig: dict, packed: dict | None, mapper: ListMapper | None = None):
    ns, layers = release_layer(release)
    config = ns["QuarkConfig"].from_config(copy.deepcopy(qconfig))
    config.packed_modules_mapping = dict(packed or {})
    if mapper is not None:
        config.apply_vllm_mapper(mapper)
    return ns, layers, config


def _layer(layers: dict, ns: dict, kind: str):
    if kind == "linear":
        return stand("RowParallelLinear", layers["LinearBase"])()
    cls = layers["RoutedExperts"] if "RoutedExperts" in _names(ns) else layers["FusedMoE"]
    layer = cls()
    layer.moe_config = _Anything()
    return layer


class ListMapper(Mapper):
    """vLLM's WeightsMapper as QuarkConfig.apply_vllm_mapper uses it (models/utils.py apply_list, apply_dict:
    each name or key through ``_map_name``, None dropping it)."""

    def apply_list(self, values: list[str]) -> list[str]:
        return [out for name in values if (out := self._map_name(name)) is not None]

    def apply_dict(self, values: dict) -> dict:
        return {out: value for name, value in values.items() if (out := self._map_name(name)) is not None}


def build(release: str, qconfig: dict, module: str, kind: str, packed: dict | None = None,
          mapper: ListMapper | None = None):
    """What ``release`` builds for engine module ``module`` (``kind``: linear | moe) of a checkpoint of ``qconfig``."""
    try:
        ns, layers, config = _config(release, qconfig, packed, mapper)
        layer = _layer(layers, ns, kind)
        with vllm_stand_ins():
            method = config.get_quant_method(layer, module)
    except WheelUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 (the release's own error is the outcome)
        return ("raises", type(exc).__name__, str(exc))
    if method is None or type(method).__name__.startswith("Unquantized"):
        return ("unquantized", None)
    scheme = getattr(layer, "scheme", None)
    built = scheme if scheme is not None and kind == "linear" else method
    return ("scheme", type(built).__name__)


def matched(release: str, qconfig: dict, module: str, kind: str, packed: dict | None = None,
            mapper: ListMapper | None = None):
    """The release's ``_find_matched_config`` for ``module``: ``("config", dict)`` or ``("raises", type, message)``."""
    try:
        ns, layers, config = _config(release, qconfig, packed, mapper)
        layer = _layer(layers, ns, kind)
        return ("config", config._find_matched_config(module, layer))
    except WheelUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        return ("raises", type(exc).__name__, str(exc))


def _names(ns) -> frozenset[str]:
    return frozenset(ns["QuarkConfig"].get_quant_method.__code__.co_names) | frozenset(
        getattr(ns["QuarkConfig"], "get_quant_method_target", ns["QuarkConfig"].get_quant_method).__code__.co_names)


__all__ = ["ListMapper", "WheelUnavailable", "build", "matched", "release_layer"]
