"""How the engine is started, as far as loading and kernels depend on it: the engine release,
platform, GPU, parallelism, and the shared-expert fusion switch. The default is the product's target:
sglang on MI355X (ROCm gfx950), tensor parallel over 8 GPUs, fusion left on.

Every command that judges a checkpoint (``gate checkpoint``, ``gate kernels``, ``gate release``)
takes the same setup flags (``add_arguments``), read once into one ``Serving`` (``from_args``) that
each report records, so the three answer for the same setup. The GPU facts are one table,
``manifests/kernels/gpus.yaml``: the archs and capabilities the engines compare, and the GPU models
aiter keys its kernel tables on.

In the releases read, the GPU and the expert-parallel size change what loads (shared-expert fusion,
the CUDA indexer), and so do TP and EP for block-quantized FP8 weights: each rank's partition of a
Linear or FusedMoE must be whole blocks (``quant.engines.block_partition``). Those checks apply where
``--tp`` is stated (``check_tp``); without it the report says at which TP sizes the checkpoint loads.
TP and EP also size the kernels' MoE shape; the PP size changes no loading decision for a Quark
checkpoint (quark.py: can_fuse_shared_expert reads the exclude list, which every pipeline stage gets whole).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cache

from pydantic import Field, model_validator

from quant.errors import QuantgateError
from quant.layout import manifests_root
from quant.schema import Schema, load


class BadServing(QuantgateError, ValueError):
    """Serving conditions that do not describe a real launch (exit code 2)."""


# The product's target, what a command means when the setup names no GPU, and the arch a platform
# means when no arch is named; the facts about each are in the GPU table.
DEFAULT_GPU = "mi355x"
DEFAULT_ARCH = {"rocm": "gfx950", "cuda": "sm90"}


class PlatformArchs(Schema):
    capability: dict[str, list[int]]  # arch -> torch.cuda.get_device_capability(), oldest first
    loads_under: list[str]  # the archs gate checkpoint lists loading on, newest first

    @model_validator(mode="after")
    def _known(self):
        if bad := next((a for a, cap in self.capability.items() if len(cap) != 2), None):
            raise ValueError(f"capability.{bad}: give [major, minor]")
        if bad := next((a for a in self.loads_under if a not in self.capability), None):
            raise ValueError(f"loads_under: {bad!r} is not an arch of capability")
        return self


class GpuEntry(Schema):
    """One GPU model of ``manifests/kernels/gpus.yaml`` (what each key means: the file's header)."""
    gfx: str
    cu_num: int = Field(ge=1)
    fp8: str
    fp4: bool
    device_names: list[str]


class GpuTable(Schema):
    archs: dict[str, PlatformArchs]
    gpus: dict[str, GpuEntry]

    @model_validator(mode="after")
    def _known(self):
        if bad := next((p for p, arch in DEFAULT_ARCH.items()
                        if p not in self.archs or arch not in self.archs[p].capability), None):
            raise ValueError(f"archs.{bad}: has no {DEFAULT_ARCH[bad]}, the arch --platform {bad} means by default")
        if bad := next((g for g, e in self.gpus.items() if e.gfx not in self.archs["rocm"].capability), None):
            raise ValueError(f"gpus.{bad}.gfx is not an arch of archs.rocm")
        if DEFAULT_GPU not in self.gpus:
            raise ValueError(f"gpus: has no {DEFAULT_GPU}, the GPU meant when none is named")
        return self


@cache
def gpu_table() -> GpuTable:
    """``manifests/kernels/gpus.yaml``, read when first needed (a broken table is one line, exit 2)."""
    return load(manifests_root() / "kernels" / "gpus.yaml", GpuTable, "GPU table", BadServing,
                "restore it from the quantgate package")


def capabilities() -> dict[str, dict[str, tuple[int, int]]]:
    """torch.cuda.get_device_capability() per platform and GPU arch, what the engines compare, oldest first."""
    return {p: {arch: tuple(cap) for arch, cap in a.capability.items()} for p, a in gpu_table().archs.items()}


def loads_under_archs() -> dict[str, list[str]]:
    """Per platform, the archs gate checkpoint lists loading on (newest first)."""
    return {p: list(a.loads_under) for p, a in gpu_table().archs.items()}


@dataclass(frozen=True)
class Serving:
    platform: str = "rocm"
    gpu_arch: str = DEFAULT_ARCH["rocm"]
    tp: int = 8
    pp: int = 1
    ep: int = 1
    disable_shared_experts_fusion: bool = False
    gpu: str | None = DEFAULT_GPU  # the GPU model (--gpu), where one is named: aiter keys on its CU count
    # started with the checkpoint's MTP layers as the speculative draft, as the families' published serving
    # commands start it; without the draft the engine never builds it, so the draft's findings do not apply
    speculative: bool = True
    check_tp: bool = False  # --tp was stated: block-FP8 partitions and the attention heads are checked at it

    @property
    def capability(self) -> tuple[int, int]:
        return capabilities()[self.platform][self.gpu_arch]

    def label(self) -> str:
        parts = [f"{self.platform} {self.gpu_arch}" + (f" ({self.gpu})" if self.gpu else ""), f"tp {self.tp}"]
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"ep {self.ep}"] if self.ep > 1 else []
        parts += ["--disable-shared-experts-fusion"] if self.disable_shared_experts_fusion else []
        parts += [] if self.speculative else ["no MTP draft"]
        return ", ".join(parts)


def serving(platform: str | None = None, gpu_arch: str | None = None, tp: int = 8, pp: int = 1, ep: int = 1,
            disable_shared_experts_fusion: bool = False, gpu: str | None = None, speculative: bool = True,
            check_tp: bool = False) -> Serving:
    """Checked conditions. A GPU model sets its platform and arch (naming nothing means the default
    GPU); a GPU arch of another platform or of another GPU, or a parallel size below 1, is refused."""
    table, known = gpu_table(), capabilities()
    if gpu is not None and gpu not in table.gpus:
        raise BadServing(f"--gpu {gpu!r}: use one of {', '.join(table.gpus)} (manifests/kernels/gpus.yaml)")
    if gpu is None and platform is None and gpu_arch is None:
        gpu = DEFAULT_GPU
    if gpu is not None:
        arch = table.gpus[gpu].gfx
        if platform not in (None, "rocm") or gpu_arch not in (None, arch):
            raise BadServing(f"--gpu {gpu} is ROCm {arch}; --platform {platform or 'rocm'} --gpu-arch "
                             f"{gpu_arch or arch} says otherwise: give the GPU or the arch")
        platform, gpu_arch = "rocm", arch
    platform = platform or "rocm"
    if platform not in known:
        raise BadServing(f"--platform {platform!r}: use one of {', '.join(known)}")
    arch = gpu_arch or DEFAULT_ARCH[platform]
    if arch not in known[platform]:
        raise BadServing(f"--gpu-arch {arch!r} is not a {platform} GPU known here; use one of "
                         f"{', '.join(known[platform])}")
    for flag, size in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if size < 1:
            raise BadServing(f"{flag} {size}: a parallel size is at least 1")
    return Serving(platform, arch, tp, pp, ep, disable_shared_experts_fusion, gpu, speculative, check_tp)


DEFAULT = Serving()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The setup flags, the same for every command that judges a checkpoint."""
    table, known = gpu_table(), capabilities()
    group = parser.add_argument_group("serving setup (how the engine is started; default: sglang on "
                                      f"{DEFAULT_GPU.upper()}, TP 8, fusion on)")
    group.add_argument("--engine", default="all", metavar="ENGINE[==VERSION]",
                       help="all (default), sglang, vllm, or one release such as sglang==0.5.23; gate kernels "
                            "takes the shared-expert fusion of the newest sglang release selected")
    group.add_argument("--gpu", choices=list(table.gpus),
                       help=f"GPU model (default {DEFAULT_GPU}): sets --platform rocm and its --gpu-arch; "
                            "gate kernels keys aiter's tables on its CU count")
    group.add_argument("--platform", choices=sorted(known), help="rocm (default) or cuda")
    group.add_argument("--gpu-arch", metavar="ARCH", help="; ".join(
        f"{p}: {', '.join(archs)} (default {DEFAULT_ARCH[p]})" for p, archs in known.items()))
    group.add_argument("--tp", type=int, help="tensor-parallel size (default 8); stated, block-FP8 weights' per-rank "
                       "partitions and the attention heads are checked at it")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1: TP only)")
    group.add_argument("--disable-shared-experts-fusion", action="store_true",
                       help="sglang is started with --disable-shared-experts-fusion")
    group.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                       help="the engine is started with the checkpoint's MTP layers as the speculative draft "
                            "(default, as the families' published serving commands run it); --no-speculative: "
                            "served without the draft, whose findings are then reported apart and do not fail")


def from_args(args: argparse.Namespace) -> Serving:
    return serving(args.platform, args.gpu_arch, 8 if args.tp is None else args.tp, args.pp, args.ep,
                   args.disable_shared_experts_fusion, args.gpu, args.speculative, check_tp=args.tp is not None)
