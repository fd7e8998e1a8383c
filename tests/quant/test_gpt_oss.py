"""gpt-oss bf16 derivatives (``gpt_oss``) end to end on a tiny random checkpoint named and laid out as
transformers stores it (GptOssExperts: ``gate_up_proj`` [E, H, 2I], gate and up interleaved; biases beside):
``quantize --to mxfp4`` writes gpt-oss's own MXFP4 layout (``quant.blocks``), which
- holds, per expert, exactly Quark 0.13's MXFP4 of that expert's matrix ``gate_up_proj[e].T`` /
  ``down_proj[e].T`` (blocks of 32 along each projection's input dimension);
- transformers' own decoder (integrations/mxfp4.py ``convert_moe_packed_tensors``, what it runs to
  dequantize gpt-oss) turns back into each expert's gate, up and down within MXFP4 error;
- keeps every other tensor (biases, sinks, attention, router) byte for byte, with gpt-oss's config;
- ``gate checkpoint`` replays as loading in sglang 0.5.21-0.5.23 and vLLM 0.33.0.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals.cli import main as gate
from quant.cli import main as quantize
from quant.formats import mxfp4
from quant.layout import family_named
from tests.conftest import load_tensors
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_mxfp4 import quark_single_tensor

EXPERTS = "model.layers.{layer}.mlp.experts."


def _randomize_biases(folder, seed: int = 1) -> None:
    """transformers initialises the expert and attention biases to zero: give them values, so that a
    bias lost or moved is seen."""
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in tensors:
            if name.endswith("_bias") or name.endswith(".bias") or name.endswith(".sinks"):
                tensors[name] = (torch.randn(tensors[name].shape, generator=gen) * 0.1).to(torch.bfloat16)
        save_file(tensors, str(file), metadata={"format": "pt"})


def tiny_gpt_oss(root):
    """A tiny gpt-oss bf16 checkpoint (random biases) in ``root/bf16`` and its MXFP4 conversion in ``root/mxfp4``."""
    src = write_family_checkpoint(root / "bf16", "gpt_oss", num_hidden_layers=2)
    _randomize_biases(src)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(root / "mxfp4")]) == 0
    return src, root / "mxfp4"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def _all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_only_the_routed_experts_become_blocks(converted):
    src, out = converted
    source, stored = load_tensors(src), load_tensors(out)
    fused = {n for n in source if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert len(fused) == 4
    assert set(stored) == (set(source) - fused) | {n + s for n in fused for s in ("_blocks", "_scales")}
    for name in set(source) - fused:  # biases, sinks, attention, router, norms, embeddings: as they were
        assert stored[name] == source[name], name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
    assert config["quantization_config"] == family_named("gpt_oss").fused_experts.blocks_config


def test_blocks_are_quarks_mxfp4_of_each_experts_matrix(converted, tmp_path):
    """Every expert equals quantgate's Quark-exact codec on gate_up_proj[e].T / down_proj[e].T; one
    expert of each projection is checked against Quark 0.13's exporter itself."""
    src, out = converted
    source, stored = _all(src), _all(out)
    for layer in (0, 1):
        for proj in ("gate_up_proj", "down_proj"):
            name = EXPERTS.format(layer=layer) + proj
            blocks, scales = stored[name + "_blocks"], stored[name + "_scales"]
            experts, rows, groups, _ = blocks.shape
            for e in range(experts):
                matrix = source[name][e].T.contiguous()  # [out, in]: blocks along the input dimension
                packed, scale = mxfp4.quantize(matrix)
                assert torch.equal(blocks[e].reshape(rows, groups * 16), packed), (name, e)
                assert torch.equal(scales[e], scale), (name, e)
    for proj in ("gate_up_proj", "down_proj"):
        name = EXPERTS.format(layer=1) + proj
        (tmp_path / proj).mkdir()
        packed, scale = quark_single_tensor(tmp_path / proj, source[name][3].T.contiguous(), "even")
        rows, groups = scale.shape
        assert torch.equal(stored[name + "_blocks"][3].reshape(rows, groups * 16), packed)
        assert torch.equal(stored[name + "_scales"][3], scale)


def test_transformers_dequantize_gives_gate_up_and_down_back(converted):
    """transformers' convert_moe_packed_tensors on the blocks: [E, in, out] again, equal to the exact
    MXFP4 values, and each expert's gate (even columns), up (odd) and down within MXFP4 error."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, out = converted
    source, stored = _all(src), _all(out)
    for layer in (0, 1):
        for proj in ("gate_up_proj", "down_proj"):
            name = EXPERTS.format(layer=layer) + proj
            blocks, scales = stored[name + "_blocks"], stored[name + "_scales"]
            decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert decoded.shape == source[name].shape
            exact = torch.stack([mxfp4.dequantize(b.reshape(b.shape[0], -1), s, torch.float32).T
                                 for b, s in zip(blocks, scales)])
            assert torch.equal(decoded, exact)
            reference = source[name].float()
            parts = {"gate": (slice(None), slice(None), slice(0, None, 2)),
                     "up": (slice(None), slice(None), slice(1, None, 2))} if proj == "gate_up_proj" else \
                {"down": (slice(None),)}
            for part, where in parts.items():
                for e in range(reference.shape[0]):
                    ref, got = reference[where][e], decoded[where][e]
                    rel = float((got - ref).norm() / ref.norm())
                    assert 0 < rel < 0.2, (name, part, e, rel)  # MXFP4 (E2M1, E8M0 per 32): ~0.1 on Gaussians


@pytest.mark.parametrize("engine", ["sglang==0.5.23", "sglang==0.5.21", "vllm"])
def test_gate_checkpoint_says_it_loads(converted, engine, capsys):
    _, out = converted
    code = gate(["checkpoint", str(out), "--engine", engine, "--deep"])
    text = capsys.readouterr().out
    assert code == 0 and "verdict: loads correctly" in text, text
    assert "15 Linear modules checked" in text  # 2 layers x (q, k, v, o, router, 2 fused experts) + lm_head


def test_a_layer_whose_experts_stayed_bf16_does_not_load(converted, tmp_path, capsys):
    """The native config makes every FusedMoE MXFP4: bf16 experts in one layer (the blocks swapped for
    the source's fused tensor) are named for both engines."""
    src, out = converted
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    source = _all(src)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = EXPERTS.format(layer=1) + "down_proj"
    file = index["weight_map"].pop(name + "_blocks")
    index["weight_map"].pop(name + "_scales")
    tensors = {n: t for n, t in load_file(str(broken / file)).items() if n not in (name + "_blocks", name + "_scales")}
    tensors[name] = source[name]
    index["weight_map"][name] = file
    save_file(tensors, str(broken / file), metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in _all(broken).values())
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    for engine in ("sglang==0.5.23", "vllm"):
        code = gate(["checkpoint", str(broken), "--engine", engine])
        text = capsys.readouterr().out
        assert code == 1 and "1 problem(s)" in text and "[engine] model.layers.1.mlp.experts" in text, text
        assert "partly MXFP4, partly bf16" in text and "down_proj" in text, text


@pytest.mark.parametrize("to", ["fp8", "mxfp6_e2m3"])
def test_a_format_gpt_oss_loaders_do_not_take_is_refused(converted, tmp_path, to, capsys):
    src, _ = converted
    code = quantize(["-q", "--to", to, str(src), str(tmp_path / to)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "gate_up_proj" in err or "down_proj" in err
    assert "--to mxfp4" in err and "_load_weights_other" in err
    assert not (tmp_path / to).exists() or not any((tmp_path / to).iterdir())


def _edit_tensor(folder, name: str, edit) -> None:
    """Rewrite one tensor of a checkpoint in place (its shard re-saved, the index kept)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    path = folder / index["weight_map"][name]
    tensors = load_file(str(path))
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, str(path), metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in _all(folder).values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_deep_decodes_the_blocks(converted, tmp_path, capsys):
    """--deep reads every expert's blocks with its scales: an E8M0 0xFF (NaN) scale is named; the
    header-only check cannot see it. A scale tensor of the wrong shape is named without --deep."""
    import shutil

    _, out = converted
    bad = tmp_path / "nan_scale"
    shutil.copytree(out, bad)
    name = EXPERTS.format(layer=1) + "gate_up_proj_scales"

    def poison(t):
        t[2, 5, 1] = 0xFF
        return t
    _edit_tensor(bad, name, poison)
    assert gate(["checkpoint", str(bad), "--engine", "vllm"]) == 0
    capsys.readouterr()
    assert gate(["checkpoint", str(bad), "--engine", "vllm", "--deep"]) == 1
    text = capsys.readouterr().out
    assert name in text and "0xFF" in text, text
    assert quantize(["-q", "--to", "bf16", str(bad), str(tmp_path / "back")]) != 0  # the decoder refuses it too
    assert name in capsys.readouterr().err

    short = tmp_path / "short_scales"
    shutil.copytree(out, short)
    _edit_tensor(short, name, lambda t: t[:, :, :1].contiguous())
    assert gate(["checkpoint", str(short), "--engine", "sglang==0.5.22"]) == 1
    text = capsys.readouterr().out
    assert EXPERTS.format(layer=1) + "gate_up_proj_blocks" in text and "its scales are U8[4, 192, 1]" in text, text


def test_to_bf16_gives_the_release_layout_back(converted, tmp_path):
    """--to bf16 writes the fused [E, in, out] tensors (gate and up interleaved) again: every other
    tensor bit for bit, the experts exactly what transformers' own dequantize makes of the blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, out = converted
    assert quantize(["-q", "--to", "bf16", str(out), str(tmp_path / "bf16")]) == 0
    source, back = load_tensors(src), load_tensors(tmp_path / "bf16")
    assert {n: v[:2] for n, v in back.items()} == {n: v[:2] for n, v in source.items()}  # names, dtypes, shapes
    stored, decoded = _all(out), _all(tmp_path / "bf16")
    for name in source:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            oracle = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"], dtype=torch.bfloat16)
            assert torch.equal(decoded[name], oracle), name
        else:
            assert back[name] == source[name], name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config or config["quantization_config"] is None


def test_bad_input_is_one_line(converted, tmp_path, capsys):
    """A fused tensor the config does not describe, and a blocks tensor without its scales: one line
    naming the tensor, exit 2, nothing written."""
    import shutil

    src, out = converted
    bad = tmp_path / "bf16"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    assert quantize(["-q", "--to", "mxfp4", str(bad), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mlp.experts." in err and "intermediate_size=64" in err, err

    blocks = tmp_path / "mxfp4"
    shutil.copytree(out, blocks)
    index = json.loads((blocks / "model.safetensors.index.json").read_text())
    name = EXPERTS.format(layer=0) + "down_proj_scales"
    file = index["weight_map"].pop(name)
    save_file({n: t for n, t in load_file(str(blocks / file)).items() if n != name}, str(blocks / file),
              metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in _all(blocks).values())
    (blocks / "model.safetensors.index.json").write_text(json.dumps(index))
    assert quantize(["-q", "--to", "bf16", str(blocks), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "down_proj_blocks" in err and "down_proj_scales" in err, err
    assert gate(["checkpoint", str(blocks), "--engine", "vllm"]) == 1
    assert "without scales" in capsys.readouterr().out
