"""Llama-4 (``llama4``) end to end on a tiny checkpoint named as the release stores it: routed experts
fused (``feed_forward.experts.gate_up_proj`` [E, H, 2I], gate|up halves; ``down_proj`` [E, I, H]) in
every second layer (interleave_moe_layer_step 2), dense MLPs between, a shared expert, a vision tower
and projector. ``--to mxfp4`` writes each expert's projection as the 2-D weight Quark's exporter
writes for that matrix; ``--to bf16`` puts them back into the release's fused tensors; a fused tensor
the config does not describe, and an MoE layer step the engines read differently from the stored
layers, are named. (Only routed experts MXFP4, FP8 / MXFP6 and both engines' replays:
tests/quant/test_families.py; the engines' own functions: tests/quant/test_engine_llama4.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evals.cli import main as gate
from quant.cli import main as quantize
from quant.formats import mxfp4
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_mxfp4 import quark_single_tensor

LAYER = "language_model.model.layers.{layer}.feed_forward.experts"
MOE_LAYERS, EXPERTS, INTER = (1, 3), 4, 32  # the tiny config: 4 layers, MoE at 1 and 3


def _all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def matrices(source: dict[str, torch.Tensor], layer: int, e: int) -> dict[str, torch.Tensor]:
    """Expert e's [out, in] projections, cut from the release's fused tensors as transformers uses them
    (gate_up.chunk(2, dim=-1) of hidden @ gate_up_proj[e]; hidden @ down_proj[e])."""
    gate_up = source[LAYER.format(layer=layer) + ".gate_up_proj"][e]  # [H, 2I]
    down = source[LAYER.format(layer=layer) + ".down_proj"][e]  # [I, H]
    return {"gate_proj": gate_up[:, :INTER].T.contiguous(), "up_proj": gate_up[:, INTER:].T.contiguous(),
            "down_proj": down.T.contiguous()}


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    src = write_family_checkpoint(root / "bf16", "llama4", num_hidden_layers=4)
    for to in ("mxfp4", "fp8"):
        assert quantize(["-q", "--to", to, str(src), str(root / to)]) == 0
        assert quantize(["-q", "--to", "bf16", str(root / to), str(root / f"{to}-bf16")]) == 0
    return root


def test_each_expert_is_quarks_export_of_its_matrix(llama4, tmp_path):
    """Every expert's gate, up and down decode within MXFP4 error of its matrix in the fused source,
    and (for one expert of each MoE layer) are byte for byte Quark 0.13's export of that 2-D matrix."""
    source, out = _all(llama4 / "bf16"), _all(llama4 / "mxfp4")
    assert not any(n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n and n.count(".") == 6 for n in out)
    for layer in MOE_LAYERS:
        for e in range(EXPERTS):
            for proj, matrix in matrices(source, layer, e).items():
                name = f"{LAYER.format(layer=layer)}.{e}.{proj}.weight"
                decoded = mxfp4.dequantize(out[name], out[name + "_scale"], torch.float32)
                ref = matrix.float()
                assert decoded.shape == ref.shape
                assert ((decoded - ref).pow(2).mean() / ref.pow(2).mean()).sqrt() < 0.2, name
                if e == layer:  # experts 1 and 3: Quark on the same matrix
                    (tmp_path / name).mkdir()
                    packed, scales = quark_single_tensor(tmp_path / name, matrix, "even")
                    assert torch.equal(out[name], packed) and torch.equal(out[name + "_scale"], scales), name


@pytest.mark.parametrize("to", ["mxfp4", "fp8"])
def test_bf16_gives_the_release_fused_layout_back(llama4, to):
    """--to bf16 of the conversion: the release's names, shapes and dtypes; every kept tensor bit for
    bit; each fused tensor the stored experts decoded, stacked [E, H, 2I] / [E, I, H] again."""
    source, out, back = _all(llama4 / "bf16"), _all(llama4 / to), _all(llama4 / f"{to}-bf16")
    assert {n: (t.dtype, t.shape) for n, t in back.items()} == {n: (t.dtype, t.shape) for n, t in source.items()}
    kept = [n for n, t in source.items() if n in out and out[n].dtype == t.dtype]
    assert len(kept) > len(source) // 2
    for name in kept:
        assert torch.equal(back[name], source[name]), name
    for layer in MOE_LAYERS:
        for e in range(EXPERTS):
            got = matrices(back, layer, e)
            for proj, matrix in matrices(source, layer, e).items():
                stored = f"{LAYER.format(layer=layer)}.{e}.{proj}.weight"
                if to == "mxfp4":
                    want = mxfp4.dequantize(out[stored], out[stored + "_scale"], torch.float32).to(torch.bfloat16)
                    assert torch.equal(got[proj], want), stored
                err = ((got[proj].float() - matrix.float()).pow(2).mean() / matrix.float().pow(2).mean()).sqrt()
                assert err < (0.2 if to == "mxfp4" else 0.05), stored


def test_a_fused_shape_the_config_does_not_give_is_one_line(llama4, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(llama4 / "bf16", src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 16
    (src / "config.json").write_text(json.dumps(config))
    code = quantize(["-q", "--to", "mxfp4", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "language_model.model.layers.1.feed_forward.experts." in err and "intermediate_size=16" in err


def _gate(capsys, folder, engine) -> tuple[int, str]:
    code = gate(["checkpoint", str(folder), "--engine", engine])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_moe_layer_step_is_checked_against_the_stored_experts(tmp_path, capsys):
    """A checkpoint with experts in every layer (Scout: step 1) whose config says step 0 loads in
    sglang (0: every layer MoE) and not in vLLM (0: none); step 2 fails both, naming the layers."""
    src = write_family_checkpoint(tmp_path / "bf16", "llama4", num_hidden_layers=2, interleave_moe_layer_step=1)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    for engine in ("sglang==0.5.23", "vllm"):
        assert _gate(capsys, tmp_path / "mxfp4", engine)[0] == 0
    config["text_config"]["interleave_moe_layer_step"] = 0
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    code, text = _gate(capsys, tmp_path / "mxfp4", "sglang==0.5.21")
    assert code == 0, text
    code, text = _gate(capsys, tmp_path / "mxfp4", "vllm")
    assert code == 1 and "builds MoE layers none from interleave_moe_layer_step 0" in text and "layers 0, 1" in text
    config["text_config"]["interleave_moe_layer_step"] = 2
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    for engine in ("sglang==0.5.22", "vllm"):
        code, text = _gate(capsys, tmp_path / "mxfp4", engine)
        assert code == 1 and "builds MoE layers 1 from interleave_moe_layer_step 2" in text, text
    # quantize warns the same on a source whose config and layers disagree
    bad = json.loads((src / "config.json").read_text())
    bad["text_config"]["interleave_moe_layer_step"] = 0
    (src / "config.json").write_text(json.dumps(bad))
    capsys.readouterr()
    assert quantize(["--to", "mxfp4", "--dry-run", str(src), str(tmp_path / "dry")]) == 0
    out = capsys.readouterr().out
    # every vLLM release of the window warns (named by rule-set span, from 0.16.0), no sglang release
    assert "vllm 0.16.0" in out and "builds MoE layers none" in out and "sglang" not in out.split("builds MoE")[0][-60:]


def test_a_recipe_quantizing_attention_to_mxfp4_is_refused_naming_sglangs_rotary_permute(llama4, tmp_path, capsys):
    """sglang's Llama-4 loader reshapes q_proj/k_proj by the config's head sizes
    (mllama4.py: permute_qk_weight_for_rotary): quantize refuses the all-linear MXFP4 recipe, nothing
    written; FP8 blocks keep their shape and load (the checkpoint of the fixture's --to fp8)."""
    recipe = Path(__file__).parents[1] / "benchmarks" / "mxfp4-all-linear-floor.yaml"
    code = quantize(["-q", "--to", "mxfp4", "--recipe", str(recipe), str(llama4 / "bf16"), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    assert "self_attn.k_proj as [heads, head_dim/2, 2, hidden]" in err and "permute it for rotary" in err and "sglang" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
