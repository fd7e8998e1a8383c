"""sglang's compressed-tensors config, run from a release's wheel: ``CompressedTensorsConfig`` (its
``from_config`` and ``get_quant_method`` with every method they call) and the matching helpers of
``compressed_tensors/utils.py``, executed as the release wrote them, never imported from an installed sglang.

What the engine imports around them is served small: the ``compressed_tensors`` library itself (the one the test
extra installs: its QuantizationArgs validates each config group as in the engine), the layer classes
``get_quant_method`` tells apart by ``isinstance`` (sglang's own class names, which the target matching reads),
and each scheme class as a record of its name and arguments (its ``get_min_capability`` read from the release's
scheme file; the WNA16 MoE's own constructor runs first, as it refuses configs). The GPU is a Blackwell
(capability 10.0) on CUDA with the default MoE runner backend: where NVFP4 runs natively, so a scheme sglang
builds there is the scheme the checkpoint states.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import functools
import logging
import re
import types
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, cast

from tests.quant.engine_sources import parsed, served_modules, source_files, wheel

CT_PATH = "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
UTILS_PATH = "sglang/srt/layers/quantization/compressed_tensors/utils.py"
SCHEMES = "sglang/srt/layers/quantization/compressed_tensors/schemes/"
CAPABILITY = (10, 0)

# sglang's layer classes by the leaf of the module name (layers/linear.py; vocab_parallel_embedding.py)
LINEAR_CLASSES = {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
                  "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear"}


class Built(NamedTuple):
    """What the release builds for one module: a scheme class (None: unquantized), its arguments, or the
    message of what it raises."""
    scheme: str | None
    args: dict
    raises: str | None = None


@functools.cache
def library() -> dict:
    """The compressed_tensors names the engine imports."""
    from compressed_tensors.config import (
        CompressionFormat,
        SparsityCompressionConfig,
        SparsityStructure,
    )
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )
    return {"CompressionFormat": CompressionFormat, "SparsityCompressionConfig": SparsityCompressionConfig,
            "SparsityStructure": SparsityStructure, "QuantizationArgs": QuantizationArgs,
            "QuantizationStrategy": QuantizationStrategy, "QuantizationType": QuantizationType}


class _Logger(logging.Logger):
    def info_once(self, *args, **kwargs):
        pass

    warning_once = info_once


class _Backend:
    """The default --moe-runner-backend (auto) and FP4 GEMM backend: every ``is_X`` but ``is_auto`` false."""

    def __getattr__(self, name):
        return (lambda: name == "is_auto") if name.startswith("is_") else super().__getattribute__(name)


def _scheme_class(name: str, capability: int | None):
    def init(self, *args, **kwargs):
        self.args = kwargs
        self.positional = args
    return type(name, (), {"__init__": init, "get_min_capability": classmethod(lambda cls: capability)})


def _min_capability(whl: Path, name: str) -> int | None:
    """The constant a scheme class's ``get_min_capability`` returns in this release."""
    for path in (p for p in source_files(whl) if p.startswith(SCHEMES) and p.endswith(".py")):
        for node in parsed(whl, path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                for fn in (n for n in node.body if getattr(n, "name", None) == "get_min_capability"):
                    returned = next((n.value for n in ast.walk(fn) if isinstance(n, ast.Return)), None)
                    return returned.value if isinstance(returned, ast.Constant) else None
    return None


def _wna16_bits(whl: Path) -> list[int]:
    """WNA16_SUPPORTED_BITS: the keys of the release's WNA16_SUPPORTED_TYPES_MAP."""
    tree = parsed(whl, SCHEMES + "compressed_tensors_wNa16.py")
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "WNA16_SUPPORTED_TYPES_MAP" for t in n.targets))
    return [ast.literal_eval(k) for k in node.value.keys]


def _compiled(whl: Path, path: str, keep) -> types.CodeType:
    """The top-level nodes of ``path`` that ``keep`` selects, each class without its bases (the engine's
    base classes hold no decision), compiled with the file's postponed annotations."""
    body = []
    for node in parsed(whl, path).body:
        if keep(node):
            if isinstance(node, ast.ClassDef) and node.name != "DeviceCapability":
                node = ast.ClassDef(node.name, [], [], node.body, [], type_params=[])
            body.append(node)
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    return compile(module, f"{whl.name}/{path}", "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)


def _names(node) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}


class Release:
    """One sglang release's compressed-tensors config, ready to build modules."""

    def __init__(self, version: str):
        self.version = version
        self.whl = wheel("sglang", version)
        lib = library()
        from pydantic import BaseModel

        self.layer = {name: type(name, (self.linear_base,), {}) for name in
                      ("QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear")}
        utils = {"re": re, "Iterable": Any, "List": list, "Mapping": Any, "Optional": Optional,
                 "MappingProxyType": types.MappingProxyType, "Module": object, **lib}
        code = _compiled(self.whl, UTILS_PATH, lambda n: isinstance(n, (ast.FunctionDef, ast.Assign)))
        exec(code, utils)  # noqa: S102 (the release's own code)
        imported = self._schemes()
        ns = {**lib, **utils, **imported, "torch": self._torch(), "BaseModel": BaseModel, "logger": _Logger("ct"),
              "Any": Any, "Dict": dict, "List": list, "Optional": Optional, "Tuple": tuple, "cast": cast,
              "NamedTuple": NamedTuple, "Literal": Literal, "suppress": contextlib.suppress,
              "get_moe_runner_backend": _Backend, "get_fp4_gemm_runner_backend": _Backend,
              "get_platform": lambda: types.SimpleNamespace(is_sm100=CAPABILITY[0] == 10),
              "_is_cuda": True, "_is_npu": False, "_is_hip": False, "_is_xpu": False,
              "Fp8LinearMethod": _scheme_class("Fp8LinearMethod", None),
              "UnquantizedLinearMethod": lambda *a: None, "UnquantizedFusedMoEMethod": lambda *a: None,
              "CompressedTensorsLinearMethod": lambda config: "scheme",
              "CompressedTensorsFusedMoEMethod": lambda config: "scheme",
              "CompressedTensorsKVCacheMethod": types.SimpleNamespace(is_supported_scheme=lambda s: True),
              "__name__": "sglang_ct"}
        wanted = {"CompressedTensorsConfig", "DeviceCapability", "SPARSITY_CONFIG_NAME", "QUANTIZATION_SCHEME_MAP_TYPE"}
        code = _compiled(self.whl, CT_PATH, lambda n: bool(_names(n) & wanted))
        exec(code, ns)  # noqa: S102 (the release's own code)
        self.config_class = ns["CompressedTensorsConfig"]
        self.classes = {"FusedMoE": type("FusedMoE", (), {}), "ParallelLMHead": type("ParallelLMHead", (), {}),
                        "RadixAttention": type("RadixAttention", (), {})}

    linear_base = type("LinearBase", (), {})

    @staticmethod
    def _torch():
        cuda = types.SimpleNamespace(get_device_capability=lambda *a: CAPABILITY)
        return types.SimpleNamespace(cuda=cuda, nn=types.SimpleNamespace(Module=object), float16="float16",
                                     bfloat16="bfloat16", dtype=object)

    def _schemes(self) -> dict:
        """The names compressed_tensors.py imports from its schemes package, as recording classes."""
        tree = parsed(self.whl, CT_PATH)
        names = [a.name for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").endswith(
            "compressed_tensors.schemes") for a in n.names]
        out = {name: _scheme_class(name, _min_capability(self.whl, name)) for name in names}
        out["WNA16_SUPPORTED_BITS"] = _wna16_bits(self.whl)
        out["CompressedTensorsWNA16MoE"] = self._checked("CompressedTensorsWNA16MoE", out)
        return out

    def _checked(self, name: str, names: dict):
        """A scheme class whose constructor refuses configs (the WNA16 MoE: the top-level format, its bits,
        until 0.5.14 the Linear target's args): its own ``__init__`` runs before the arguments are recorded."""
        path = SCHEMES + "compressed_tensors_wNa16_moe.py"
        ns = {**library(), **names, "__name__": "sglang_ct_schemes"}
        code = _compiled(self.whl, path, lambda n: isinstance(n, ast.ClassDef) and n.name == name)
        exec(code, ns)  # noqa: S102 (the release's own code)
        real, record = ns[name], _scheme_class(name, _min_capability(self.whl, name))

        def init(obj, *args, **kwargs):
            real.__init__(obj, *args, **kwargs)
            record.__init__(obj, *args, **kwargs)
        return type(name, (), {"__init__": init, "get_min_capability": record.get_min_capability})

    def build(self, qconfig: dict, prefix: str, kind: str) -> Built:
        """What ``get_quant_method`` builds for module ``prefix`` of ``kind`` (linear, moe, lm_head)."""
        leaf = prefix.rsplit(".", 1)[-1]
        cls = {"moe": self.classes["FusedMoE"], "lm_head": self.classes["ParallelLMHead"]}.get(kind) or \
            self.layer[LINEAR_CLASSES.get(leaf, "ReplicatedLinear")]
        layer = cls()
        mxfp4 = type("Mxfp4MoEMethod", (), {"__init__": lambda self, prefix: None})
        stubs = {"sglang.srt.layers.linear": {"LinearBase": self.linear_base},
                 "sglang.srt.layers.moe.fused_moe_triton": {"FusedMoE": self.classes["FusedMoE"]},
                 "sglang.srt.layers.vocab_parallel_embedding": {"ParallelLMHead": self.classes["ParallelLMHead"]},
                 "sglang.srt.layers.radix_attention": {"RadixAttention": self.classes["RadixAttention"]},
                 "sglang.srt.layers.quantization.mxfp4": {"Mxfp4MoEMethod": mxfp4},
                 "sglang.srt.layers.quantization.fp8": {"Fp8Config": lambda **kw: kw}}
        try:
            with served_modules(stubs):
                config = self.config_class.from_config(dict(qconfig))
                method = config.get_quant_method(layer, prefix)
        except Exception as exc:  # noqa: BLE001 (what the release raises is the outcome)
            return Built(None, {}, f"{type(exc).__name__}: {exc}")
        if method is None:
            return Built(None, {})
        if isinstance(method, mxfp4):
            return Built("Mxfp4MoEMethod", {})
        if method == "scheme":
            return Built(type(layer.scheme).__name__, {**layer.scheme.args, "positional": layer.scheme.positional})
        return Built(type(method).__name__, {})
