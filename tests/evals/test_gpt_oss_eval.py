"""gpt-oss (``gpt_oss``) evaluated locally: its bf16 derivative runs the emulation's experts loop
(transposed [E, H, 2I] experts with biases, as GptOssExperts stores them) exactly as transformers'
own eager GptOssExperts does, and ``evals run --model`` scores it. Its MXFP4 conversion (gpt-oss's
own quant_method mxfp4 layout, which names no activation scheme, the engines' backends choosing bf16
or MXFP8 activations) is evaluated as W4A16 only with ``--activations bf16``: its logits equal
transformers' on the conversion decoded by ``quantize --to bf16``; without the flag it is refused in
one line, exit 2, naming what the engines do."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.bundle import read_bundle
from evals.cli import evals_main
from evals.emulation import load_model
from quant.cli import main as quantize
from tests.evals.test_run import data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_gpt_oss import tiny_gpt_oss

TOKENS = torch.randint(3, 380, (2, 16), generator=torch.Generator().manual_seed(0))
GSM8K = ["--benchmarks", "gsm8k", "--limit", 1, "--max-gen-toks", 2]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_eval")
    tiny_gpt_oss(root)
    assert quantize(["-q", "--to", "bf16", str(root / "mxfp4"), str(root / "decoded")]) == 0
    return root


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("evals: error:")]  # (the data loader's progress aside)


def test_bf16_emulation_is_transformers_eager(gpt_oss):
    ours, record = load_model(gpt_oss / "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(gpt_oss / "bf16", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        assert record is None and torch.equal(ours(TOKENS).logits, theirs(TOKENS).logits)
        # not vacuous: the expert biases take part (zeroing them changes the logits)
        theirs.model.layers[0].mlp.experts.down_proj_bias.zero_()
        assert not torch.equal(ours(TOKENS).logits, theirs(TOKENS).logits)


def test_w4a16_emulation_of_the_mxfp4_conversion_is_transformers_on_its_bf16_decode(gpt_oss):
    ours, record = load_model(gpt_oss / "mxfp4", dtype=torch.float32, activations="bf16")
    decoded = AutoModelForCausalLM.from_pretrained(gpt_oss / "decoded", dtype=torch.float32,
                                                   experts_implementation="eager").eval()
    assert (record["scheme"], record["source"], record["activations"]) == ("W4A16", "mxfp4", None)
    assert record["activations_from"] == "--activations bf16"
    assert record["modules"]["experts_blocks"] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                                   for p in ("down_proj", "gate_up_proj")]
    ours_sd, theirs_sd = ours.state_dict(), decoded.state_dict()
    assert ours_sd.keys() == theirs_sd.keys() and all(torch.equal(ours_sd[k], theirs_sd[k]) for k in theirs_sd)
    assert torch.equal(logits(ours), logits(decoded))
    source = AutoModelForCausalLM.from_pretrained(gpt_oss / "bf16", dtype=torch.float32).eval()
    assert not torch.allclose(logits(ours), logits(source), rtol=1e-3, atol=1e-4)  # the MXFP4 weights really load


def test_evals_run_on_the_bf16_model(gpt_oss, data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", gpt_oss / "bf16", "--data-dir", data_dir, *GSM8K) == 0
    run, rows = read_bundle(out)
    assert rows and run["local"]["emulation"] is None and run["local"]["dtype"] == "bfloat16"


def test_evals_run_with_bf16_activations_on_the_mxfp4_conversion(gpt_oss, data_dir, tmp_path, capfd):  # noqa: F811
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", gpt_oss / "mxfp4", "--activations", "bf16", "--data-dir", data_dir,
                   *GSM8K) == 0
    run, rows = read_bundle(out)
    emulation = run["local"]["emulation"]
    assert rows and (emulation["scheme"], emulation["activations_from"]) == ("W4A16", "--activations bf16")
    assert "Traceback" not in capfd.readouterr().err


def test_evals_run_refuses_the_mxfp4_conversion_without_activations(gpt_oss, data_dir, tmp_path, capfd):  # noqa: F811
    out = tmp_path / "run"
    code = run_cli("--out", out, "--model", gpt_oss / "mxfp4", "--data-dir", data_dir, *GSM8K)
    err = capfd.readouterr().err
    said = errors(err)
    assert code == 2 and len(said) == 1 and "Traceback" not in err, err
    for part in ("quant_method 'mxfp4'", "vLLM 0.33.0 runs bf16 activations on every GPU",
                 "sglang 0.5.23 runs MXFP8 activations on SM100/SM120", "bf16 on SM90", "ROCm",
                 "--activations bf16", "--base-url"):
        assert part in said[0], part
    assert not (out / "run.json").exists()


def test_activations_bf16_is_refused_where_the_checkpoint_declares_its_activations(data_dir, tmp_path, capfd):  # noqa: F811
    """A Quark MXFP4 conversion says W4A4 in its config: that is what is evaluated, not overridden."""
    src = write_family_checkpoint(tmp_path / "bf16", "mixtral", num_hidden_layers=2)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(tmp_path / "mxfp4")]) == 0
    capfd.readouterr()
    out = tmp_path / "run"
    code = run_cli("--out", out, "--model", tmp_path / "mxfp4", "--activations", "bf16", "--data-dir", data_dir,
                   *GSM8K)
    said = errors(capfd.readouterr().err)
    assert code == 2 and len(said) == 1 and "--activations bf16: the checkpoint's config declares" in said[0], said
    assert "W4A4" in said[0] and not (out / "run.json").exists()
    code = run_cli("--out", out, "--model", "served", "--base-url", "http://127.0.0.1:9", "--activations", "bf16",
                   "--data-dir", data_dir, *GSM8K)
    said = errors(capfd.readouterr().err)
    assert code == 2 and len(said) == 1 and "--activations" in said[0] and "apply to a local checkpoint" in said[0]


def test_help_names_the_activations_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        evals_main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and "--activations {bf16}" in text
    assert "quant_method mxfp4" in text and "W4A16" in text and "MXFP8 activations on SM100/SM120" in text
