"""The Python API: the commands' jobs called in-process, typed results, errors raised (never SystemExit)."""

from __future__ import annotations

import json

import pytest

import quantgate
from quant.errors import QuantgateError
from tests.evals.test_gate import binary_pair, bundle


def test_plan_convert_check_in_process(glm_ckpt, tmp_path):
    planned = quantgate.plan(glm_ckpt, shared_experts="bf16")
    assert planned.summary()["tensors_quantized"] > 0
    done = quantgate.convert(planned, tmp_path / "mxfp4")
    manifest = json.loads((tmp_path / "mxfp4" / "conversion_manifest.json").read_text())
    assert json.loads(json.dumps(done.manifest)) == manifest and done.bytes_out == manifest["summary"]["bytes_out"] < done.bytes_in
    report = quantgate.check(done.output, "vllm")
    assert report.ok and report.modules_quantized > 0
    decoded = quantgate.convert(quantgate.plan(done.output, "bf16"), tmp_path / "bf16")
    assert quantgate.check(decoded.output, "vllm").modules_quantized == 0


def test_mistakes_raise_instead_of_exiting(glm_ckpt, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(Exception, match="is not empty") as raised:
        quantgate.convert(quantgate.plan(glm_ckpt), tmp_path / "full")
    assert not isinstance(raised.value, SystemExit)
    with pytest.raises(QuantgateError) as bad:
        quantgate.check(tmp_path / "nothing-here")
    assert bad.value.exit_code == 2


@pytest.mark.parametrize("options", [{"limit": 0}, {"limit": -5}, {"max_gen_toks": 0}, {"concurrency": 0},
                                     {"request_timeout": 0}, {"request_timeout": float("nan")}, {"seeds": [0, 0]}])
def test_evaluate_refuses_degenerate_numbers_before_running(options, tmp_path):
    """The API gets the same refusals as `evals run`'s flags (exit code 2), and writes nothing."""
    with pytest.raises(QuantgateError) as bad:
        quantgate.evaluate(tmp_path / "run", tmp_path / "no-model", ["gsm8k"], **options)
    assert bad.value.exit_code == 2 and next(iter(options)) in str(bad.value)
    assert not (tmp_path / "run").exists()


def test_gate_verdict_is_typed(tmp_path):
    ref, cand = binary_pair(1000, 0, 0)
    bundle(tmp_path / "ref", "gsm8k", ref)
    bundle(tmp_path / "cand", "gsm8k", cand)
    verdict = quantgate.gate(tmp_path / "cand", tmp_path / "ref", benchmarks=["gsm8k"])
    assert verdict.verdict in {"PASS", "INCONCLUSIVE"} and verdict.benchmarks[0]["benchmark"] == "gsm8k"
    assert verdict.exit_code == (0 if verdict.passed else 1)
    worse = binary_pair(1000, 80, 0)[1]
    bundle(tmp_path / "worse", "gsm8k", worse)
    failed = quantgate.gate(tmp_path / "worse", tmp_path / "ref", benchmarks=["gsm8k"])
    assert failed.verdict == "FAIL" and failed.exit_code == 1 and not failed.passed
