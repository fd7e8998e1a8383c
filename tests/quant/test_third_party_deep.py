"""``gate checkpoint --deep`` on compressed-tensors and ModelOpt NVFP4 checkpoints: NaN / Inf / zero /
negative scales and missing static activation scales, each named with what the engines do with it
(``quant.third_party_scales``); every cited mechanism is found in the cited releases' wheels."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quant.checkpoint import Checkpoint
from quant.engines import Finding
from quant.third_party_scales import MISSING, SCALE_USES, Cite
from quant.verify import verify
from tests.quant.engine_sources import WheelUnavailable, class_def, method_def, parsed, wheel
from tests.quant.family_checkpoints import write_shards
from tests.quant.third_party_checkpoints import modelopt_config, nvfp4_ct, write_third_party

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "qwen3_moe"
EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}"
# per format: its quantization config (ModelOpt's as an hf_quant_config.json alone) and its scale names
FORMATS = {"compressed-tensors": (nvfp4_ct(), False, "weight_global_scale", "input_global_scale"),
           "modelopt": (modelopt_config("NVFP4"), True, "weight_scale_2", "input_scale")}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-MoE stored NVFP4 by each producer's own code (tests/quant/third_party_checkpoints.py)."""
    root = tmp_path_factory.mktemp("nvfp4")
    return {fmt: write_third_party(root / fmt, FAMILY, qconfig, hf_quant_config_only=alone)
            for fmt, (qconfig, alone, _, _) in FORMATS.items()}


def edited(written: dict[str, Path], fmt: str, dst: Path, edit) -> Path:
    """A copy of ``fmt``'s checkpoint whose tensors ``edit(tensors)`` changed."""
    shutil.copytree(written[fmt], dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(written[fmt].glob("*.safetensors")):
        tensors.update(load_file(shard))
    edit(tensors)
    write_shards(tensors, dst)
    return dst


def values_findings(folder: Path) -> list[Finding]:
    return [f for f in verify(folder, "vllm==0.34.0", deep=True).findings if f.check == "values"]


def set_value(name: str, value: float, index: int = 0):
    def edit(tensors):
        tensor = tensors[name]
        flat = tensor.view(torch.uint8).view(-1) if tensor.dtype == torch.float8_e4m3fn else tensor.view(-1)
        flat[index] = value
    return edit


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_producers_scales_give_no_finding(written, fmt):
    """compressed-tensors' and ModelOpt's own scales: finite and positive, as their code writes them."""
    assert values_findings(written[fmt]) == []


@pytest.mark.parametrize("fmt, which, value, kind", [
    ("compressed-tensors", 2, 0.0, "zero"),
    ("compressed-tensors", 3, float("inf"), "Inf"),
    ("modelopt", 3, 0.0, "zero"),
    ("modelopt", 2, float("nan"), "NaN"),
    ("modelopt", 3, -1.0, "negative"),
])
def test_a_bad_global_or_input_scale_is_named_with_the_engines_mechanism(written, tmp_path, fmt, which, value, kind):
    suffix = FORMATS[fmt][which]
    tensor = f"{EXPERT.format(layer=1, expert=3, proj='down_proj')}.{suffix}"
    found = values_findings(edited(written, fmt, tmp_path / fmt, set_value(tensor, value)))
    assert [f.module for f in found] == [tensor]
    assert f"1 {kind} of 1 value(s)" in found[0].why
    assert str(SCALE_USES[suffix].cites[0]) in found[0].why  # the engine function that inverts or multiplies it


def test_a_nan_or_zero_block_scale_is_named_at_its_element(written, tmp_path):
    tensor = f"{EXPERT.format(layer=2, expert=0, proj='up_proj')}.weight_scale"

    def edit(tensors):
        codes = tensors[tensor].view(torch.uint8)
        codes[1, 2] = 0x7F  # e4m3's NaN
        codes[3, 0] = codes[3, 1] = 0x00
    found = values_findings(edited(written, "compressed-tensors", tmp_path / "ct", edit))
    assert [f.module for f in found] == [tensor]
    assert "1 NaN, 2 zero of" in found[0].why and "the first NaN at [1, 2]" in found[0].why


def test_scale_values_are_read_only_with_deep(written, tmp_path):
    tensor = f"{EXPERT.format(layer=2, expert=1, proj='gate_proj')}.input_scale"
    folder = edited(written, "modelopt", tmp_path / "mo", set_value(tensor, 0.0))
    assert not [f for f in verify(folder, "vllm==0.34.0").findings if f.module == tensor]


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_without_their_static_activation_scale(written, tmp_path, fmt):
    """Experts calibration never reached have no input scale on disk (what ModelOpt exports for an input
    never calibrated): one finding for the layer's experts, naming them and the engines' allocation."""
    suffix = FORMATS[fmt][3]
    gone = [f"{EXPERT.format(layer=1, expert=e, proj=p)}.{suffix}" for e in (1, 2) for p in ("gate_proj", "up_proj")]

    def edit(tensors):
        for name in gone:
            del tensors[name]
    found = values_findings(edited(written, fmt, tmp_path / fmt, edit))
    assert [f.module for f in found] == ["model.layers.1.mlp.experts"]
    assert f"4 nvfp4 module(s) whose scheme has a static activation scale store no {suffix}" in found[0].why
    assert gone[0] in found[0].why and str(MISSING[suffix].cites[0]) in found[0].why


def test_weight_only_nvfp4_needs_no_activation_scale(tmp_path):
    """W4A16 (no input_activations) stores no activation scale: nothing is missing."""
    folder = write_third_party(tmp_path / "w4a16", FAMILY, nvfp4_ct(static_input=False))
    assert not [name for name in Checkpoint.open(folder).tensors() if name.endswith("input_global_scale")]
    assert values_findings(folder) == []


def gate_deep(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine", "vllm==0.34.0",
                           "--deep", "--json"], check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_gate_checkpoint_deep_in_a_real_process(written, tmp_path):
    """The CLI: the ModelOpt export as written passes --deep (exit 0); with one expert's input scale zero it
    fails (exit 1), the tensor and the mechanism in the JSON report."""
    assert gate_deep(written["modelopt"]).returncode == 0
    tensor = f"{EXPERT.format(layer=1, expert=0, proj='down_proj')}.input_scale"
    run = gate_deep(edited(written, "modelopt", tmp_path / "mo", set_value(tensor, 0.0)))
    assert run.returncode == 1, run.stderr
    findings = [f for engine in json.loads(run.stdout)["engines"].values() for f in engine["findings"]]
    assert [f["module"] for f in findings] == [tensor] and "1.0 / a13_scale" in findings[0]["why"]


def _releases(cite: Cite) -> list[str]:
    """The cite's first and last release, every release of its span with QUANTGATE_WINDOW=all."""
    from quant.engines.rules import window

    span = [r for r in window(cite.engine) if _key(cite.first) <= _key(r) <= _key(cite.last)]
    return span if os.environ.get("QUANTGATE_WINDOW") == "all" else sorted({span[0], span[-1]}, key=_key)


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(p.removeprefix("post")) for p in release.split("."))


CITES = sorted({c for use in [*SCALE_USES.values(), *MISSING.values()] for c in use.cites}, key=str)


@pytest.mark.parametrize("cite", CITES, ids=str)
def test_each_cited_mechanism_is_in_its_releases(cite):
    """Each quoted expression is in the cited function of the cited file in the span's releases."""
    for release in _releases(cite):
        try:
            whl = wheel(cite.engine, release)
        except WheelUnavailable as exc:
            pytest.skip(str(exc))
        owner, _, name = cite.function.rpartition(".")
        tree = parsed(whl, cite.path)
        node = method_def(class_def(whl, cite.path, owner), name) if owner else next(
            n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        assert node is not None, f"{cite.engine} {release}: no {cite.function} in {cite.path}"
        assert cite.code in ast.unparse(node), f"{cite.engine} {release} {cite.function}: no {cite.code!r}"
