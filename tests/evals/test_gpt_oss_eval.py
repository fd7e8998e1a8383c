"""gpt-oss (``gpt_oss``) evaluated locally: its bf16 derivative runs the emulation's experts loop
(transposed [E, H, 2I] experts with biases, as GptOssExperts stores them) exactly as transformers'
own eager GptOssExperts does, and ``evals run --model`` scores it; its MXFP4 conversion (gpt-oss's
own quant_method mxfp4 layout, which names no activation scheme) is refused in one line, exit 2."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.bundle import read_bundle
from evals.emulation import load_model
from tests.evals.test_run import data_dir, run_cli  # noqa: F401  (data_dir is a fixture)
from tests.quant.test_gpt_oss import tiny_gpt_oss

TOKENS = torch.randint(3, 380, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_eval")
    tiny_gpt_oss(root)
    return root


def test_bf16_emulation_is_transformers_eager(gpt_oss):
    ours, record = load_model(gpt_oss / "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(gpt_oss / "bf16", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        assert record is None and torch.equal(ours(TOKENS).logits, theirs(TOKENS).logits)
        # not vacuous: the expert biases take part (zeroing them changes the logits)
        theirs.model.layers[0].mlp.experts.down_proj_bias.zero_()
        assert not torch.equal(ours(TOKENS).logits, theirs(TOKENS).logits)


def test_evals_run_on_the_bf16_model(gpt_oss, data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert run_cli("--out", out, "--model", gpt_oss / "bf16", "--benchmarks", "gsm8k", "--data-dir", data_dir,
                   "--limit", 1, "--max-gen-toks", 2) == 0
    run, rows = read_bundle(out)
    assert rows and run["local"]["emulation"] is None and run["local"]["dtype"] == "bfloat16"


def test_evals_run_refuses_the_mxfp4_conversion(gpt_oss, data_dir, tmp_path, capfd):  # noqa: F811
    code = run_cli("--out", tmp_path / "run", "--model", gpt_oss / "mxfp4", "--benchmarks", "gsm8k", "--data-dir",
                   data_dir, "--limit", 1, "--max-gen-toks", 2)
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("evals: error:")]  # (the data loader's progress aside)
    assert code == 2 and len(said) == 1, err
    assert "quant_method 'mxfp4'" in said[0] and "--base-url" in said[0] and "Traceback" not in err
