"""Local evaluation as served and fast: bf16 compute by default (recorded), batched greedy
generation whose answers do not depend on the batch size."""

from __future__ import annotations

import json

import pytest
import torch

from evals.bundle import read_bundle
from evals.cli import main as gate
from evals.emulation import load_model
from quant.cli import main as quantize
from tests.evals.test_run import data_dir, run_cli  # noqa: F401  (data_dir is a fixture)

# Prompts of different lengths, so a batch is left-padded; GSM8K's format, written here.
PROMPTS = [
    "Question: Tom has 3 apples and gets 5 more. How many now?\nAnswer:",
    "Question: 7 boxes hold 12 pens each. How many pens?\nAnswer:",
    "Question: A train runs 60 miles an hour for 3 hours, stops, then runs 2 more hours. How far?\nAnswer:",
    "Question: 45 - 17?\nAnswer:",
    "Question: Mia saves 5 dollars a week for 11 weeks and spends 20. How much is left?\nAnswer:",
    "Question: 9 times 8?\nAnswer:",
]


@pytest.fixture(scope="module")
def mxfp4(dsv3_ckpt, tmp_path_factory):
    """DeepSeek-V3 layout. (The random GLM-5 test model's DSA indexer keeps 8 keys by score, and its
    many exact ties, ReLU zeros, break by position, which left padding shifts; the built-in example's
    index_topk covers its whole context, as GLM-5's 2048 covers GSM8K prompts.)"""
    out = tmp_path_factory.mktemp("local") / "mxfp4"
    assert quantize(["--to", "mxfp4", "-q", str(dsv3_ckpt), str(out)]) == 0
    return out


def generations(model, tokenizer: str, batch_size: int, max_gen_toks: int = 12) -> list[str]:
    """lm-eval's own HFLM.generate_until, as ``evals run`` drives it, at ``batch_size``."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    kwargs = {"until": ["Question:"], "max_gen_toks": max_gen_toks, "do_sample": False}
    requests = [Instance(request_type="generate_until", doc={}, arguments=(p, kwargs), idx=i)
                for i, p in enumerate(PROMPTS)]
    return lm.generate_until(requests, disable_tqdm=True)


def test_batched_greedy_generation_equals_one_at_a_time(mxfp4):
    """The emulated MXFP4 checkpoint in bf16: left padding (attention mask, position ids from it)
    and batched MoE routing leave every answer as generated alone."""
    model, record = load_model(mxfp4)
    assert next(model.parameters()).dtype == torch.bfloat16 and record["rounding"] == "half_even"
    alone = generations(model, str(mxfp4), batch_size=1)
    batched = generations(model, str(mxfp4), batch_size=len(PROMPTS))
    assert len(set(alone)) > 1 and all(alone)  # real, different answers: the comparison can fail
    assert batched == alone


def test_local_runs_compute_in_bf16_by_default_and_record_it(dsv3_ckpt, mxfp4, data_dir, tmp_path):  # noqa: F811
    common = ["--benchmarks", "gsm8k", "--data-dir", data_dir, "--limit", 2, "--max-gen-toks", 4]
    assert run_cli("--out", tmp_path / "bf16", "--model", dsv3_ckpt, *common) == 0
    assert run_cli("--out", tmp_path / "mxfp4", "--model", mxfp4, "--batch-size", 2, *common) == 0
    for name, batch in (("bf16", 32), ("mxfp4", 2)):
        run, _ = read_bundle(tmp_path / name)
        local = run["local"]
        assert (local["dtype"], local["batch_size"], local["threads"]) == ("bfloat16", batch, 1)
        assert local["dtype_from"].startswith("default") and run["benchmarks"]["gsm8k"]["settings"]["local_dtype"] == "bfloat16"
    emulation = read_bundle(tmp_path / "mxfp4")[0]["local"]["emulation"]
    assert (emulation["scheme"], emulation["rounding"]) == ("W4A4", "half_even")
    assert gate(["accuracy", "--candidate", str(tmp_path / "mxfp4"), "--reference", str(tmp_path / "bf16")]) in (0, 1)

    assert run_cli("--out", tmp_path / "fp32", "--model", mxfp4, "--dtype", "float32", *common) == 0
    fp32 = json.loads((tmp_path / "fp32" / "run.json").read_text())["local"]
    assert (fp32["dtype"], fp32["dtype_from"]) == ("float32", "--dtype")
    # a float32 run measures something else: never paired with a bf16 one
    assert gate(["accuracy", "--candidate", str(tmp_path / "fp32"), "--reference", str(tmp_path / "bf16")]) == 2


def test_batching_flags_are_for_local_checkpoints(data_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "refused"
    assert run_cli("--out", out, "--model", "m", "--base-url", "http://127.0.0.1:9", "--batch-size", 4,
                   "--benchmarks", "gsm8k") == 2
    assert "--batch-size" in capsys.readouterr().err and not out.exists()
