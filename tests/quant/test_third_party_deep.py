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

from quant.engines import Finding
from quant.third_party_scales import MISSING, SCALE_USES, Cite
from quant.verify import verify
from tests.quant.engine_sources import WheelUnavailable, class_def, method_def, parsed, wheel
from tests.quant.family_checkpoints import write_shards

ROOT = Path(__file__).resolve().parents[2]
EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}"
ONE_E4M3 = 0x38  # 1.0 in float8_e4m3fn: a valid block scale

CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                      "symmetric": True, "dynamic": "local"}}}}
MODELOPT_NVFP4 = {"producer": {"name": "modelopt", "version": "0.47.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate", "*shared_experts*",
                                                       "model.layers.0.*", "*eh_proj"]}}
# the tensors each format stores beside a module (quant.third_party.Scheme.tensors), their names per format
NAMES = {"compressed-tensors": ("weight_packed", "weight_global_scale", "input_global_scale"),
         "modelopt": ("weight", "weight_scale_2", "input_scale")}


def nvfp4_checkpoint(src: Path, dst: Path, fmt: str, edit=None) -> Path:
    """``src`` (bf16) with its routed experts stored NVFP4 in ``fmt``'s names: packed E2M1 codes, an E4M3
    scale of 1.0 per 16 values and global / activation scales of 1.0 (valid values: this test is about the
    scales, not the codes). ``edit(tensors)`` changes the tensors before they are written."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    weight, global_scale, input_scale = NAMES[fmt]
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        out, inner = tensors.pop(name).shape
        tensors[f"{module}.{weight}"] = torch.randint(0, 256, (out, inner // 2), dtype=torch.uint8,
                                                      generator=generator)
        tensors[f"{module}.weight_scale"] = torch.full((out, inner // 16), ONE_E4M3, dtype=torch.uint8).view(
            torch.float8_e4m3fn)
        tensors[f"{module}.{global_scale}"] = torch.ones((1,) if fmt == "compressed-tensors" else (),
                                                         dtype=torch.float32)
        tensors[f"{module}.{input_scale}"] = torch.ones((1,) if fmt == "compressed-tensors" else (),
                                                        dtype=torch.float32)
    if edit:
        edit(tensors)
    write_shards(tensors, dst)
    config = json.loads((src / "config.json").read_text())
    if fmt == "compressed-tensors":
        config["quantization_config"] = CT_NVFP4
    else:  # a ModelOpt export as NVIDIA publishes them: its config in hf_quant_config.json
        config["quantization_config"] = {"quant_method": "modelopt", **MODELOPT_NVFP4["quantization"]}
        (dst / "hf_quant_config.json").write_text(json.dumps(MODELOPT_NVFP4))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def values_findings(folder: Path) -> list[Finding]:
    return [f for f in verify(folder, "vllm==0.34.0", deep=True).findings if f.check == "values"]


def set_value(name: str, value: float, index=0):
    def edit(tensors):
        tensor = tensors[name]
        flat = tensor.view(torch.uint8).view(-1) if tensor.dtype == torch.float8_e4m3fn else tensor.view(-1)
        flat[index] = value
    return edit


@pytest.fixture(scope="module")
def bf16(dsv3_ckpt):
    return dsv3_ckpt


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_clean_scales_give_no_finding(bf16, tmp_path, fmt):
    assert values_findings(nvfp4_checkpoint(bf16, tmp_path / fmt, fmt)) == []


@pytest.mark.parametrize("fmt, suffix, value, kind", [
    ("compressed-tensors", "weight_global_scale", 0.0, "zero"),
    ("compressed-tensors", "input_global_scale", float("inf"), "Inf"),
    ("modelopt", "input_scale", 0.0, "zero"),
    ("modelopt", "weight_scale_2", float("nan"), "NaN"),
    ("modelopt", "input_scale", -1.0, "negative"),
])
def test_a_bad_global_or_input_scale_is_named_with_the_engines_mechanism(bf16, tmp_path, fmt, suffix, value, kind):
    tensor = f"{EXPERT.format(layer=2, expert=3, proj='down_proj')}.{suffix}"
    found = values_findings(nvfp4_checkpoint(bf16, tmp_path / fmt, fmt, set_value(tensor, value)))
    assert [f.module for f in found] == [tensor]
    assert f"1 {kind} of 1 value(s)" in found[0].why
    assert str(SCALE_USES[suffix].cites[0]) in found[0].why  # the engine function that inverts or multiplies it


def test_a_nan_or_zero_block_scale_is_named_at_its_element(bf16, tmp_path):
    tensor = f"{EXPERT.format(layer=3, expert=0, proj='up_proj')}.weight_scale"

    def edit(tensors):
        codes = tensors[tensor].view(torch.uint8)
        codes[1, 2] = 0x7F  # e4m3's NaN
        codes[3, 0] = codes[3, 1] = 0x00
    found = values_findings(nvfp4_checkpoint(bf16, tmp_path / "ct", "compressed-tensors", edit))
    assert [f.module for f in found] == [tensor]
    assert "1 NaN, 2 zero of" in found[0].why and "the first NaN at [1, 2]" in found[0].why


def test_scale_values_are_read_only_with_deep(bf16, tmp_path):
    tensor = f"{EXPERT.format(layer=3, expert=1, proj='gate_proj')}.input_scale"
    folder = nvfp4_checkpoint(bf16, tmp_path / "mo", "modelopt", set_value(tensor, 0.0))
    assert not [f for f in verify(folder, "vllm==0.34.0").findings if f.module == tensor]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_experts_without_their_static_activation_scale(bf16, tmp_path, fmt):
    """Experts calibration never reached have no input scale on disk (what ModelOpt exports for an input
    never calibrated): one finding for the layer's experts, naming them and the engines' allocation."""
    suffix = NAMES[fmt][2]
    gone = [f"{EXPERT.format(layer=2, expert=e, proj=p)}.{suffix}" for e in (1, 2) for p in ("gate_proj", "up_proj")]

    def edit(tensors):
        for name in gone:
            del tensors[name]
    found = values_findings(nvfp4_checkpoint(bf16, tmp_path / fmt, fmt, edit))
    assert [f.module for f in found] == ["model.layers.2.mlp.experts"]
    assert f"4 nvfp4 module(s) whose scheme has a static activation scale store no {suffix}" in found[0].why
    assert gone[0] in found[0].why and str(MISSING[suffix].cites[0]) in found[0].why


def test_weight_only_nvfp4_needs_no_activation_scale(bf16, tmp_path):
    """W4A16 (no input_activations) stores no activation scale: nothing is missing."""
    config = json.loads(json.dumps(CT_NVFP4))
    del config["config_groups"]["group_0"]["input_activations"]

    def edit(tensors):
        for name in [n for n in tensors if n.endswith(".input_global_scale")]:
            del tensors[name]
    folder = nvfp4_checkpoint(bf16, tmp_path / "w4a16", "compressed-tensors", edit)
    full = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(full, quantization_config=config)))
    assert values_findings(folder) == []


def test_gate_checkpoint_deep_in_a_real_process(bf16, tmp_path):
    """The CLI: exit 1, the tensor and the mechanism in the JSON report."""
    tensor = f"{EXPERT.format(layer=2, expert=0, proj='down_proj')}.input_scale"
    folder = nvfp4_checkpoint(bf16, tmp_path / "mo", "modelopt", set_value(tensor, 0.0))
    run = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), "--engine", "vllm==0.34.0",
                          "--deep", "--json"], check=False, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1, run.stderr
    findings = [f for engine in json.loads(run.stdout)["engines"].values() for f in engine["findings"]]
    assert [f for f in findings if f["module"] == tensor and "1.0 / a13_scale" in f["why"]]


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
