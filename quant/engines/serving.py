"""How the engine is started, as far as loading depends on it: platform, GPU, parallelism, and the
shared-expert fusion switch. The default is the product's target: sglang on MI355X (ROCm gfx950),
tensor parallel over 8 GPUs, fusion left on.

In the releases read, the GPU and the expert-parallel size change what loads (shared-expert fusion,
the CUDA indexer); TP and PP sizes are recorded in the report but change no loading decision for a
Quark checkpoint (sglang's fusion reads moe_ep_size only; quark.py: can_fuse_shared_expert reads the
exclude list, which every pipeline stage gets whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from quant.errors import QuantgateError

# torch.cuda.get_device_capability() per GPU arch, what the engines compare (ROCm reports the gfx
# number: gfx942 -> (9, 4), the MI300 family; gfx950 -> (9, 5), MI350/MI355X).
CAPABILITY = {
    "rocm": {"gfx90a": (9, 0), "gfx942": (9, 4), "gfx950": (9, 5)},
    "cuda": {"sm75": (7, 5), "sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0),
             "sm120": (12, 0)},
}
DEFAULT_ARCH = {"rocm": "gfx950", "cuda": "sm90"}


class BadServing(QuantgateError, ValueError):
    """Serving conditions that do not describe a real launch (exit code 2)."""


@dataclass(frozen=True)
class Serving:
    platform: str = "rocm"
    gpu_arch: str = "gfx950"
    tp: int = 8
    pp: int = 1
    ep: int = 1
    disable_shared_experts_fusion: bool = False

    @property
    def capability(self) -> tuple[int, int]:
        return CAPABILITY[self.platform][self.gpu_arch]

    def label(self) -> str:
        parts = [f"{self.platform} {self.gpu_arch}", f"tp {self.tp}"]
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"ep {self.ep}"] if self.ep > 1 else []
        parts += ["--disable-shared-experts-fusion"] if self.disable_shared_experts_fusion else []
        return ", ".join(parts)


def serving(platform: str = "rocm", gpu_arch: str | None = None, tp: int = 8, pp: int = 1, ep: int = 1,
            disable_shared_experts_fusion: bool = False) -> Serving:
    """Checked conditions; a GPU arch of another platform or a parallel size below 1 is refused."""
    if platform not in CAPABILITY:
        raise BadServing(f"--platform {platform!r}: use one of {', '.join(CAPABILITY)}")
    arch = gpu_arch or DEFAULT_ARCH[platform]
    if arch not in CAPABILITY[platform]:
        raise BadServing(f"--gpu-arch {arch!r} is not a {platform} GPU known here; use one of "
                         f"{', '.join(CAPABILITY[platform])}")
    for flag, size in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if size < 1:
            raise BadServing(f"{flag} {size}: a parallel size is at least 1")
    return Serving(platform, arch, tp, pp, ep, disable_shared_experts_fusion)


DEFAULT = Serving()
