"""``--to bf16`` of a fused family puts its experts back into the release's fused tensors.

The Qwen3-MoE release re-stored fused (``test_fused_experts``: each axis order and gate/up layout a
manifest can describe) converts to MXFP4, FP8 and MXFP6; decoding that conversion with the fused
manifest must give the fused checkpoint's own tensor names, shapes and dtypes, every tensor the
recipe kept bit for bit, and each fused tensor equal to the per-expert release's decode (exact:
the same stored bytes decoded) stacked in the release's layout by hand (``fuse``), so within the
format's error of the source.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.cli import main as quantize
from quant.source import SourceGuard
from tests.quant.test_fused_experts import LAYOUTS, _EXPERT, fuse, fused_manifest, per_expert, write_fused  # noqa: F401

BOUNDS = {"mxfp4": 0.2, "fp8": 0.05, "mxfp6_e2m3": 0.06}  # relative RMS error of an expert against the source


def _all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _fused_oracle(decoded_per_expert: dict, config: dict, axes, split) -> dict[str, torch.Tensor]:
    """The per-expert release's decode, stacked as the fused release stores it."""
    fused = {}
    for layer in range(config["num_hidden_layers"]):
        get = lambda e, proj: decoded_per_expert[_EXPERT.format(layer=layer, e=e, proj=proj)]  # noqa: E731
        experts = range(config["num_local_experts"])
        prefix = f"model.layers.{layer}.mlp.experts."
        fused[prefix + "gate_up_proj"] = fuse([[get(e, "gate_proj"), get(e, "up_proj")] for e in experts], axes, split)
        fused[prefix + "down_proj"] = fuse([[get(e, "down_proj")] for e in experts], axes, split)
    return fused


@pytest.fixture(scope="module")
def decoded(per_expert):
    """The per-expert release's conversions decoded --to bf16 (per-expert names): the oracle's values."""
    for to in ("mxfp4", "fp8", "mxfp6_e2m3"):
        if not (per_expert / to).exists():
            assert quantize(["-q", "--to", to, str(per_expert / "bf16"), str(per_expert / to)]) == 0
        assert quantize(["-q", "--to", "bf16", str(per_expert / to), str(per_expert / f"{to}-bf16")]) == 0
    return per_expert


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("to", ["mxfp4", "fp8", "mxfp6_e2m3"])
def test_bf16_writes_the_fused_tensors_back(decoded, tmp_path, layout, to):
    axes, split = LAYOUTS[layout]
    src = write_fused(decoded / "bf16", tmp_path / "fused", axes, split)
    manifest = fused_manifest(tmp_path, axes, split)
    assert quantize(["-q", "--to", to, "--family-manifest", str(manifest), str(src), str(tmp_path / to)]) == 0
    assert quantize(["-q", "--to", "bf16", "--family-manifest", str(manifest), str(tmp_path / to),
                     str(tmp_path / "back")]) == 0
    source, back = _all(src), _all(tmp_path / "back")
    assert {n: (t.dtype, t.shape) for n, t in back.items()} == {n: (t.dtype, t.shape) for n, t in source.items()}
    config = json.loads((src / "config.json").read_text())
    per_expert_decode = _all(decoded / f"{to}-bf16")
    oracle = _fused_oracle(per_expert_decode, config, axes, split)
    kept = {n for n, t in _all(tmp_path / to).items() if t.dtype == torch.bfloat16}
    assert kept and len(oracle) == 2 * config["num_hidden_layers"]
    for name, tensor in back.items():
        if name in oracle:  # an expert tensor: the stored bytes decoded, in the release's layout
            assert torch.equal(tensor, oracle[name]), name
            err = (tensor.float() - source[name].float()).norm() / source[name].float().norm()
            assert 0 < err < BOUNDS[to], (name, float(err))
        else:  # decoded as the per-expert release's is; and what the recipe kept, exactly
            assert torch.equal(tensor, per_expert_decode[name]), name
            assert name not in kept or torch.equal(tensor, source[name]), name
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_a_layer_the_release_stores_per_expert_stays_per_expert(decoded, tmp_path):
    """Only what the manifest's pattern names is fused back (Qwen3.5's MTP layer is stored per
    expert): layer 0 fused in the source, layers 1-2 per expert, and so in the decode."""
    axes, split = LAYOUTS["llama4"]
    src = write_fused(decoded / "bf16", tmp_path / "fused", axes, split, layers=[0])
    manifest = fused_manifest(tmp_path, axes, split, pattern_prefix=r"^model\.layers\.0")
    assert quantize(["-q", "--to", "mxfp4", "--family-manifest", str(manifest), str(src), str(tmp_path / "q")]) == 0
    assert quantize(["-q", "--to", "bf16", "--family-manifest", str(manifest), str(tmp_path / "q"),
                     str(tmp_path / "back")]) == 0
    back, source = _all(tmp_path / "back"), _all(src)
    assert sorted(back) == sorted(source)
    assert "model.layers.0.mlp.experts.gate_up_proj" in back and _EXPERT.format(layer=1, e=0, proj="up_proj") in back
    per_expert_decode = _all(decoded / "mxfp4-bf16")
    assert torch.equal(back[_EXPERT.format(layer=2, e=3, proj="down_proj")],
                       per_expert_decode[_EXPERT.format(layer=2, e=3, proj="down_proj")])


def _edit_shard(folder, name: str, edit) -> None:
    """Rewrite the shard of ``folder`` that holds ``name`` after ``edit(tensors)``; the index loses the
    tensors ``edit`` removed."""
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = folder / weight_map[name]
    tensors = load_file(str(shard))
    before = set(tensors)
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    for removed in before - set(tensors):
        weight_map.pop(removed)
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_expert_kept_bf16_is_copied_into_the_fused_tensor(decoded, tmp_path):
    """A checkpoint with one expert's projection stored bf16 (the rest MXFP4): that block of the fused
    tensor is the bf16 weight bit for bit; read without a lease (pread), never mapped."""
    axes, split = LAYOUTS["interleaved"]
    src = write_fused(decoded / "bf16", tmp_path / "fused", axes, split)
    manifest = fused_manifest(tmp_path, axes, split)
    assert quantize(["-q", "--to", "mxfp4", "--family-manifest", str(manifest), str(src), str(tmp_path / "q")]) == 0
    kept = _EXPERT.format(layer=1, e=2, proj="up_proj")

    def keep_bf16(tensors):
        del tensors[kept + "_scale"]
        tensors[kept] = _all(decoded / "bf16")[kept]
    _edit_shard(tmp_path / "q", kept, keep_bf16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SourceGuard, "mapped", property(lambda self: False))
        assert quantize(["-q", "--workers", "1", "--to", "bf16", "--family-manifest", str(manifest),
                         str(tmp_path / "q"), str(tmp_path / "back")]) == 0
    intermediate = json.loads((src / "config.json").read_text())["moe_intermediate_size"]
    up = _all(tmp_path / "back")["model.layers.1.mlp.experts.gate_up_proj"][2]  # [H, 2I], gate/up alternating
    assert up.shape[1] == 2 * intermediate
    assert torch.equal(up[:, 1::2].T, _all(decoded / "bf16")[kept])
    gate = _EXPERT.format(layer=1, e=2, proj="gate_proj")
    assert torch.equal(up[:, 0::2].T, _all(decoded / "mxfp4-bf16")[gate])


def test_a_missing_expert_is_refused_in_one_line(decoded, tmp_path, capsys):
    axes, split = LAYOUTS["qwen3_5"]
    src = write_fused(decoded / "bf16", tmp_path / "fused", axes, split)
    manifest = fused_manifest(tmp_path, axes, split)
    assert quantize(["-q", "--to", "mxfp4", "--family-manifest", str(manifest), str(src), str(tmp_path / "q")]) == 0
    gone = _EXPERT.format(layer=0, e=3, proj="down_proj")

    def drop(tensors):
        del tensors[gone], tensors[gone + "_scale"]
    _edit_shard(tmp_path / "q", gone, drop)
    capsys.readouterr()
    assert quantize(["-q", "--to", "bf16", "--family-manifest", str(manifest), str(tmp_path / "q"),
                     str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"no tensor {gone}" in err
    assert re.search(r"model\.layers\.0\.mlp\.experts\.down_proj BF16\[4, \d+, \d+\]", err)
    assert not (tmp_path / "back").exists() or not any((tmp_path / "back").iterdir())


def test_a_fused_tensor_without_a_name_to_write_back_is_refused(tmp_path):
    """A pattern that does not end in \\.NAME$ must give the fused tensor's name (--to bf16 writes it)."""
    import yaml

    from quant.layout import UnknownFamilyError, load_family

    path = fused_manifest(tmp_path, *LAYOUTS["qwen3_5"])
    data = yaml.safe_load(path.read_text())
    data["fused_experts"]["tensors"][0]["pattern"] = r"experts\.gate_up_proj"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UnknownFamilyError, match=r"give the fused tensor's last name component as name:"):
        load_family(path)
    data["fused_experts"]["tensors"][0]["name"] = "gate_up_proj"
    path.write_text(yaml.safe_dump(data))
    assert load_family(path).fused_experts.tensors[0].name == "gate_up_proj"
