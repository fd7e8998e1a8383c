"""Static FP8 activation scales for the W4A8 / W8A8 rungs (``quant.rungs``): ``<module>.input_scale`` =
amax / 448 (``fp8_tensor.scale_of``: in bf16, as Quark computes and stores it), from the input amax a
sensitivity pass measured on calibration data (its sidecar's ``amax`` and ``tokens``, per checkpoint Linear).

A FusedMoE serves one input scale for its experts' gate/up projections and one for their down projections:
both engines collapse the per-expert scales to their max when loading (vLLM 0.33.0 quark_moe.py
QuarkW8A8Fp8MoEMethod.process_weights_after_loading and QuarkOCP_MX_MoEMethod's w_mxfp4_a_fp8 path;
sglang 0.5.23 quark_w8a8_fp8_moe.py QuarkW8A8FP8MoE.process_weights_after_loading and
quark_w4a8_mxfp4_moe.py QuarkW4A8MXFp4MoE: ``w13_input_scale.max()``). So every expert is written the layer's
max: what is served is then what is stored, and an expert few tokens reached borrows the measured range of
the others instead of a scale from a handful of values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from quant.errors import QuantgateError
from quant.hashing import sha256_of
from quant.formats.codecs import get_codec
from quant.safe_files import parse_json, read_regular

# A scale set from fewer calibration tokens than this is named in a warning: its amax may be far from the range
# served traffic reaches (clipped activations), and more calibration data fixes it.
MIN_SCALE_TOKENS = 32
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<proj>[A-Za-z0-9_]+)$")
DOWN_PROJECTIONS = ("down_proj", "w2")  # the FusedMoE's second input (w2_input_scale); the rest feed w13


class StaticScaleError(QuantgateError, ValueError):
    """A static-scale rung asked without the measurement it needs; the message names the module and the fix."""


@dataclass(frozen=True)
class MeasuredInputs:
    """What a conversion reads from a sensitivity sidecar: per checkpoint Linear, its input's absolute max and
    how many calibration tokens reached it."""
    path: Path
    sha256: str
    source: str  # the calibration data the pass read (a prompt file or a benchmark's train split)
    amax: dict[str, float]
    tokens: dict[str, int]


def load_measured_inputs(path: Path) -> MeasuredInputs:
    """The sidecar at ``path`` (``quant.sensitivity``'s JSON), refused naming the file where it is not one."""
    fix = "pass the file a sensitivity pass wrote (quantize --ladder --calibration DATA, python -m quant.sensitivity)"
    try:
        raw = read_regular(path, error=StaticScaleError)
    except OSError as exc:
        raise StaticScaleError(f"--sensitivity {path}: {exc.strerror}; {fix}") from None
    data = parse_json(raw, str(path), StaticScaleError, fix)
    if not isinstance(data, dict) or data.get("kind") != "quantgate-sensitivity":
        raise StaticScaleError(f"{path}: not a quantgate sensitivity file (kind is not quantgate-sensitivity); {fix}")
    amax, tokens = data.get("amax"), data.get("tokens", {})
    if not isinstance(amax, dict) or not isinstance(tokens, dict) or \
            not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in amax.values()) or \
            not all(isinstance(v, int) and v >= 0 for v in tokens.values()):
        raise StaticScaleError(f"{path}: amax / tokens must map module names to finite non-negative numbers; {fix}")
    calibration = data.get("calibration")
    source = calibration.get("source", "") if isinstance(calibration, dict) else ""
    return MeasuredInputs(path, sha256_of(raw), str(source), {k: float(v) for k, v in amax.items()}, dict(tokens))


def scale_group(module: str) -> str:
    """The name of the scale a module is served with: a routed expert's projection shares its FusedMoE's
    (``model.layers.1.mlp.experts.*.gate_up`` / ``...*.down``); any other module has its own."""
    match = _EXPERT.match(module)
    if not match:
        return module
    return f"{match['layer']}.*.{'down' if match['proj'] in DOWN_PROJECTIONS else 'gate_up'}"


def input_scales(modules: list[str], calibration: MeasuredInputs | None) -> tuple[dict[str, float], dict, list[str]]:
    """For the modules stored with a static input scale: the value each is written (``scale_of`` the amax of
    its scale group), a record per group (amax, tokens, scale) and warnings naming groups calibrated on fewer
    than ``MIN_SCALE_TOKENS`` tokens. Refused (exit 2) naming the module: no sidecar, a module it did not
    measure, or a group no token reached (a zero scale would divide activations by zero)."""
    if not modules:
        return {}, {}, []
    fix = ("measure it: quantize --ladder --calibration DATA, or python -m quant.sensitivity SRC --calibration DATA "
           "--out FILE, then --sensitivity FILE")
    if calibration is None:
        raise StaticScaleError(f"{modules[0]}: its rung (W4A8 / W8A8) stores a static FP8 input scale, measured on "
                               f"calibration data, and no --sensitivity file was given; {fix}")
    groups: dict[str, list[str]] = {}
    for module in modules:
        if module not in calibration.amax:
            raise StaticScaleError(f"{calibration.path}: no input amax for {module}, whose rung needs a static FP8 "
                                   f"input scale (the file measured another checkpoint?); {fix}")
        groups.setdefault(scale_group(module), []).append(module)
    scales, record, warnings = {}, {}, []
    for group, members in sorted(groups.items()):
        amax = max(calibration.amax[m] for m in members)
        tokens = sum(calibration.tokens.get(m, 0) for m in members)
        if amax == 0:
            raise StaticScaleError(f"{calibration.path}: {group}: no calibration token reached it (input amax 0), so "
                                   "it has no static scale; calibrate on more data, or keep it at a rung with dynamic "
                                   "activations (mxfp4) or bf16")
        scale = get_codec("fp8_tensor").scale_of(amax)  # amax / 448 as Quark stores it (bf16)
        if tokens < MIN_SCALE_TOKENS:
            warnings.append(f"{group}: static input scale from {tokens} calibration token(s) (fewer than "
                            f"{MIN_SCALE_TOKENS}); served activations may exceed its range and clip: calibrate on more "
                            "data")
        record[group] = {"amax": amax, "tokens": tokens, "scale": scale}
        scales.update((m, scale) for m in members)
    return scales, record, warnings
