"""Fused 3-D expert tensors (``fused_experts`` in a family manifest, ``quant.fused``): one tensor
holding every routed expert of a layer is planned per expert and projection from its header,
read in chunks and written as the per-expert weights the engines' loaders map.

The oracle is the per-expert path itself: Qwen3-MoE's release stores its experts per expert, so
the same tiny checkpoint re-stored with fused experts (in each axis order and gate/up layout a
manifest can describe) must convert to the same bytes, tensor by tensor, as the release does; and
one expert's projection is checked against Quark's own exporter on that 2-D matrix.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from quant.cli import main as quantize
from quant.layout import manifests_root
from quant.source import SourceGuard
from tests.conftest import load_tensors
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_mxfp4 import quark_single_tensor

LAYOUTS = {  # name -> (axes, split) of the fused gate_up_proj (down_proj shares the axes)
    "qwen3_5": (["experts", "out", "in"], "halves"),  # [E, 2I, H]
    "llama4": (["experts", "in", "out"], "halves"),  # [E, H, 2I]
    "interleaved": (["experts", "in", "out"], "interleaved"),  # gate, up alternating along 2I
    "rows_interleaved": (["experts", "out", "in"], "interleaved"),
}
_EXPERT = "model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


def fused_manifest(dst: Path, axes: list[str], split: str, pattern_prefix: str = "") -> Path:
    """Qwen3-MoE's manifest with its experts declared fused in the given layout (in the layers
    ``pattern_prefix`` names, if given)."""
    data = yaml.safe_load((manifests_root() / "families" / "qwen3_moe" / "family.yaml").read_text())
    data["fused_experts"] = {"experts_key": "num_local_experts", "writes": "per_expert", "tensors": [
        {"pattern": pattern_prefix + r"\.mlp\.experts\.gate_up_proj$", "axes": list(axes), "split": split,
         "projections": ["gate_proj", "up_proj"], "out": "moe_intermediate_size", "in": "hidden_size"},
        {"pattern": pattern_prefix + r"\.mlp\.experts\.down_proj$", "axes": list(axes), "projections": ["down_proj"],
         "out": "hidden_size", "in": "moe_intermediate_size"}]}
    path = dst / "qwen3_moe_fused.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fuse(matrices: list[torch.Tensor], axes: list[str], split: str) -> torch.Tensor:
    """Stack per-expert [out, in] projections (one list per expert: gate, up or down) as a release would."""
    per_expert = []
    for projections in matrices:
        if split == "halves" or len(projections) == 1:
            stacked = torch.cat(projections, 0)  # [P * out, in]
        else:
            stacked = torch.stack(projections, 1).reshape(-1, projections[0].shape[1])  # rows alternate
        per_expert.append(stacked if axes[1] == "out" else stacked.T)
    return torch.stack(per_expert).contiguous()


def write_fused(src: Path, dst: Path, axes: list[str], split: str, layers: list[int] | None = None) -> Path:
    """``src`` (per-expert) re-stored with each layer's experts (or those of ``layers``) in two fused
    tensors, each in the shard of its first expert's weight."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    experts = config["num_local_experts"]
    for layer in range(config["num_hidden_layers"]) if layers is None else layers:
        take = lambda e, proj: tensors.pop(_EXPERT.format(layer=layer, e=e, proj=proj))  # noqa: E731
        prefix = f"model.layers.{layer}.mlp.experts."
        file = weight_map[_EXPERT.format(layer=layer, e=0, proj="gate_proj")]
        tensors[prefix + "gate_up_proj"] = fuse([[take(e, "gate_proj"), take(e, "up_proj")] for e in range(experts)],
                                                axes, split)
        tensors[prefix + "down_proj"] = fuse([[take(e, "down_proj")] for e in range(experts)], axes, split)
        weight_map[prefix + "gate_up_proj"] = weight_map[prefix + "down_proj"] = file
    weight_map = {n: f for n, f in weight_map.items() if n in tensors}
    for file in sorted(set(weight_map.values())):
        save_file({n: tensors[n] for n, f in weight_map.items() if f == file}, str(dst / file), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    """The Qwen3-MoE release layout (every expert 2-D) and its conversions, the oracle."""
    root = tmp_path_factory.mktemp("per_expert")
    src = write_family_checkpoint(root / "bf16", "qwen3_moe")
    for to in ("mxfp4", "fp8"):
        assert quantize(["-q", "--to", to, str(src), str(root / to)]) == 0
    return root


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("to", ["mxfp4", "fp8"])
def test_fused_converts_to_the_per_expert_bytes(per_expert, tmp_path, layout, to):
    axes, split = LAYOUTS[layout]
    src = write_fused(per_expert / "bf16", tmp_path / "fused", axes, split)
    manifest = fused_manifest(tmp_path, axes, split)
    assert quantize(["-q", "--to", to, "--family-manifest", str(manifest), str(src), str(tmp_path / to)]) == 0
    ours, oracle = load_tensors(tmp_path / to), load_tensors(per_expert / to)
    assert sorted(ours) == sorted(oracle)
    assert ours == oracle
    config = json.loads((tmp_path / to / "config.json").read_text())
    assert config["quantization_config"] == json.loads((per_expert / to / "config.json").read_text())["quantization_config"]


def test_pread_gather_without_a_lease(per_expert, tmp_path, monkeypatch):
    """A source that cannot be leased is read with pread, never mapped: the gathers too."""
    monkeypatch.setattr(SourceGuard, "mapped", property(lambda self: False))
    axes, split = LAYOUTS["interleaved"]
    src = write_fused(per_expert / "bf16", tmp_path / "fused", axes, split)
    manifest = fused_manifest(tmp_path, axes, split)
    assert quantize(["-q", "--workers", "1", "--to", "mxfp4", "--family-manifest", str(manifest), str(src),
                     str(tmp_path / "out")]) == 0
    assert load_tensors(tmp_path / "out") == load_tensors(per_expert / "mxfp4")


def test_an_expert_matches_quark(per_expert, tmp_path):
    """Quark 0.13's exporter on one expert's gate and down matrices gives the bytes the fused path wrote."""
    axes, split = LAYOUTS["llama4"]
    src = write_fused(per_expert / "bf16", tmp_path / "fused", axes, split)
    assert quantize(["-q", "--to", "mxfp4", "--family-manifest", str(fused_manifest(tmp_path, axes, split)),
                     str(src), str(tmp_path / "out")]) == 0
    source = {}
    for file in (per_expert / "bf16").glob("*.safetensors"):
        source.update(load_file(str(file)))
    out = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        out.update(load_file(str(file)))
    for proj in ("gate_proj", "down_proj"):
        name = _EXPERT.format(layer=1, e=3, proj=proj)
        (tmp_path / proj).mkdir()
        packed, scales = quark_single_tensor(tmp_path / proj, source[name], "even")
        assert torch.equal(out[name], packed) and torch.equal(out[name + "_scale"], scales)


def test_a_fused_shape_the_config_does_not_give_is_refused(per_expert, tmp_path, capsys):
    axes, split = LAYOUTS["qwen3_5"]
    src = write_fused(per_expert / "bf16", tmp_path / "fused", axes, split)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    code = quantize(["-q", "--to", "mxfp4", "--family-manifest", str(fused_manifest(tmp_path, axes, split)),
                     str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert re.search(r"tensor model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj BF16", err)
    assert "moe_intermediate_size=16" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_fused_experts_the_manifest_does_not_describe_are_refused(per_expert, tmp_path, capsys):
    """Without fused_experts (or in a layout it cannot name) a fused tensor is refused, not guessed."""
    axes, split = LAYOUTS["qwen3_5"]
    src = write_fused(per_expert / "bf16", tmp_path / "fused", axes, split)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(tmp_path / "out")]) == 2
    assert "match no role" in capsys.readouterr().err
    bad = fused_manifest(tmp_path, ["in", "experts", "out"], split)
    assert quantize(["-q", "--to", "mxfp4", "--family-manifest", str(bad), str(src), str(tmp_path / "out2")]) == 2
    assert "not a layout quantgate reads" in capsys.readouterr().err
