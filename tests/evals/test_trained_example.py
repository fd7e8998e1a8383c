"""The trained example: its data, its two layouts, and the gate seeing real quantization damage on it."""

from __future__ import annotations

import json

import torch

from evals.benchmarks.arith_make import make_rows
from evals.data import BUNDLED_DATA_DIR, check_gsm8k_file, dataset_for
from quant.cli import main as quantize
from quant.example import trained_config, write_example


def test_shipped_arith_data_is_the_generators_output():
    rows = make_rows()
    for split in ("train", "test"):
        path = BUNDLED_DATA_DIR / "arith" / f"{split}.jsonl"
        assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[split])
        check_gsm8k_file(path)  # GSM8K's format: question, answer ending "#### N"
    assert len(rows["test"]) >= 200
    assert not {r["question"] for r in rows["test"]} & {r["question"] for r in rows["train"]}
    assert dataset_for("arith").entry["files"].keys() == {"train.jsonl", "test.jsonl"}  # hashes checked


def _logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_glm5_and_deepseek_v3_layouts_compute_the_same(tmp_path):
    """Same weights, and the GLM-5 indexer's top-k covers the whole context: transformers' two models agree."""
    glm, dsv3 = write_example(tmp_path / "glm"), write_example(tmp_path / "dsv3", "deepseek_v3")
    assert trained_config("glm_moe_dsa")["index_topk"] >= trained_config("glm_moe_dsa")["max_position_embeddings"]
    ids = torch.randint(3, trained_config()["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    a, b = _logits(glm, ids), _logits(dsv3, ids)
    assert a.abs().max() > 1 and torch.allclose(a, b, atol=1e-4, rtol=0)


def test_training_forward_is_transformers_forward(tmp_path):
    """The training script's own DeepSeek-V3 forward (written for speed) computes what transformers does."""
    from quant.example import TRAINED_DIR
    from quant.example_train import load_trained

    config = trained_config("deepseek_v3")
    model = load_trained(TRAINED_DIR, config)
    ids = torch.randint(3, config["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    theirs = _logits(write_example(tmp_path / "dsv3", "deepseek_v3"), ids)
    assert torch.allclose(ours, theirs, atol=1e-2, rtol=0)  # fp32 rounding, different op order: < 4e-3 seen
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_trained_example_needs_its_own_sizes(tmp_path, capsys):
    assert quantize(["--to", "mxfp4", "--example", str(tmp_path / "ex"), "--example-mla", "real"]) == 2
    assert "--example-weights random" in capsys.readouterr().err
    assert not (tmp_path / "ex").exists()


CI_ITEMS = 40  # enough for the damaging conversion's loss to FAIL (README: the 200-item figures)
CI_GEN_TOKS = 40  # the longest answer is 29 tokens with EOS; a damaged model's ramble is cut here, in every arm


def test_gate_sees_real_damage(tmp_path):
    """On the trained example: FP8 vs bf16 and default MXFP4 vs FP8 measured; a damaging conversion FAILs."""
    from tests.benchmarks.trained_example_gate import build, evaluate, summary

    runs = tmp_path / "runs"
    evaluate(build(tmp_path), runs, limit=CI_ITEMS, max_gen_toks=CI_GEN_TOKS)
    result = summary(runs)
    print(json.dumps(result, indent=2))  # the measured deltas, in the test log
    arms, verdicts = result["arms"], {(c["candidate"], c["reference"]): c for c in result["comparisons"]}
    assert all(a["n"] == CI_ITEMS for a in arms.values())
    assert arms["bf16"]["accuracy"] >= 0.8  # the shipped weights know their benchmark (0.952 on all 250 items)
    assert arms["damaged"]["accuracy"] < arms["fp8"]["accuracy"] < 1
    damaged = verdicts[("damaged", "fp8")]
    assert (damaged["verdict"], damaged["exit"]) == ("FAIL", 1)
    assert verdicts[("mxfp4", "fp8")]["verdict"] != "FAIL"
    assert verdicts[("fp8", "bf16")]["verdict"] != "FAIL"
