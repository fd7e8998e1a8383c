"""The built-in example, the generator's fidelity to transformers, and the CLI's outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quant.cli import build_parser, main
from quant.convert import MANIFEST_NAME, sha256_file
from quant.example import tensor_shapes, tiny_config


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
def test_generator_matches_transformers_names_and_shapes(family):
    """Everything but the MTP layer (which transformers does not build) matches transformers' model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_config(family)
    model_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    theirs = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    # transformers 5 fuses experts in memory and splits them again on save; compare per-expert names.
    ours = {name: shape for name, (shape, _) in tensor_shapes(config).items()
            if not name.startswith(f"model.layers.{config['num_hidden_layers']}.")}
    fused = {n for n in theirs if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert {n for n in ours if ".experts." not in n} == {n for n in theirs if n not in fused}
    for name in theirs.keys() - fused:
        assert ours[name] == theirs[name], name
    for name in fused:  # [experts, 2 * inter, hidden] / [experts, hidden, inter]
        layer = name.rsplit(".", 1)[0]
        gate, down = ours[f"{layer}.0.gate_proj.weight"], ours[f"{layer}.0.down_proj.weight"]
        expected = (config["n_routed_experts"], 2 * gate[0], gate[1]) if name.endswith("gate_up_proj") \
            else (config["n_routed_experts"], *down)
        assert theirs[name] == expected, name
        assert len([n for n in ours if n.startswith(layer + ".")]) == 3 * config["n_routed_experts"]


def test_readme_example_command(tmp_path):
    out = subprocess.run(["quantize", "--to", "mxfp4", "--example", str(tmp_path / "ex")],
                         capture_output=True, text=True, check=True)
    assert "done" in out.stdout and "36 tensors quantized" in out.stdout
    dst = tmp_path / "ex" / "mxfp4"
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    for record in manifest["shards"]:  # provenance is true: hashes and sizes of the files on disk
        assert record["sha256"] == sha256_file(dst / record["file"])
        assert record["source_sha256"] == sha256_file(tmp_path / "ex" / "bf16" / record["file"])
        assert record["size"] == (dst / record["file"]).stat().st_size
    errors = [e["rel_rms_error"] for r in manifest["shards"] for e in r["quantized"].values()]
    assert len(errors) == 36 and all(0.05 < e < 0.2 for e in errors)  # MXFP4 on Gaussian weights: ~10%
    assert manifest["recipe"]["name"] == "mxfp4-w4a4-experts" and manifest["version"]


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
    assert "exit codes" in text and "model.decoder" in text


def test_dry_run_json_and_human(glm_ckpt, tmp_path, capsys):
    assert main(["--to", "mxfp4", "--dry-run", "--json", str(glm_ckpt), str(tmp_path / "o")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tensors_quantized"] == 36 and plan["family"] == "glm_moe_dsa"
    assert "model.decoder.mlp.shared_experts.gate_proj" in plan["draft_aliases"]
    assert plan["by_role"]["routed_expert"] == {"quantize": 36, "keep": 0}
    assert main(["--to", "mxfp4", "--dry-run", str(glm_ckpt), str(tmp_path / "o")]) == 0
    human = capsys.readouterr().out
    assert "36 to MXFP4" in human and "MTP draft's model.decoder" in human
    assert not (tmp_path / "o").exists()


def test_weight_only_warns_about_sglang(glm_ckpt, tmp_path, capsys):
    assert main(["--to", "mxfp4", "--weight-only", "--dry-run", str(glm_ckpt), str(tmp_path / "o")]) == 0
    assert "sglang's Quark loader needs W4A4" in capsys.readouterr().out


def test_json_run_output(glm_ckpt, tmp_path, capsys):
    assert main(["--to", "mxfp4", "--json", str(glm_ckpt), str(tmp_path / "o")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["manifest"]["summary"]["tensors_quantized"] == 36
    assert result["plan"]["exclude_count"] == len(
        json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["exclude"])


def test_module_entry_point(glm_ckpt, tmp_path):
    out = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "--dry-run", str(glm_ckpt),
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert out.returncode == 0 and "recipe" in out.stdout


def test_help_and_dry_run_load_neither_torch_nor_numba(glm_ckpt):
    """The CLIs start in a blink: --help, and a dry run (headers only), import no numeric stack."""
    code = ("import sys, contextlib, io\n"
            "import evals.cli, quant.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert quant.cli.main(['--to', 'mxfp4', '--dry-run', {str(glm_ckpt)!r}, '/nonexistent/out']) == 0\n"
            "print(sorted(m for m in ('torch', 'numba', 'numpy', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_converting_bf16_to_mxfp4_loads_no_torch(glm_ckpt, tmp_path):
    """The fast path is numpy and numba only: torch (~1.5 s and ~300 MB per process) stays unloaded."""
    code = ("import sys\n"
            "import quant.cli\n"
            f"assert quant.cli.main(['--to', 'mxfp4', '-q', {str(glm_ckpt)!r}, {str(tmp_path / 'out')!r}]) == 0\n"
            "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['numba']"
