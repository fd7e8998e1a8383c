"""The sensitivity pass (quant.sensitivity) and its calibration data (quant.calibration), on the built-in example.

The pass builds one decoder layer at a time; its statistics are checked against the whole model run by
transformers itself, and its refusals through the real command in a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant.calibration import CalibrationError, evaluation_hashes, load_calibration
from quant.example import tiny_config, write_checkpoint, write_example
from quant.formats.constants import ScaleRule
from quant.rungs import FP8_MAX
from quant.formats import fp8_tensor
from quant.sensitivity import (MEASURED, SensitivityError, load_sensitivity, measure, mxfp4_weight_qdq, run,
                               weight_qdq)

ARITH_TEST = Path(__file__).resolve().parents[2] / "evals" / "benchmarks" / "data" / "arith" / "test.jsonl"
ITEMS = 8


def sensitivity_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "quant.sensitivity", *map(str, args)]


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    return write_example(tmp_path_factory.mktemp("example") / "bf16")


@pytest.fixture(scope="module")
def sidecar(example, tmp_path_factory) -> Path:
    """The pass over the example, through the real command, calibrated on arith's train split."""
    out = tmp_path_factory.mktemp("sens") / "sensitivity.json"
    done = subprocess.run(sensitivity_cmd(example, "--calibration", "arith", "--items", ITEMS, "--out", out,
                                          "--device", "cpu"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"written {out}" in done.stdout
    return out


def test_calibration_from_a_benchmark_is_its_train_split_hashed():
    cal = load_calibration("arith", 10)
    assert cal.source == "arith:train" and len(cal.prompts) == len(cal.item_sha256) == 10
    assert cal.prompts[0].startswith("Question: ") and "####" in cal.prompts[0]  # question and its worked answer
    assert not set(cal.item_sha256) & set(evaluation_hashes())
    assert load_calibration("arith:train", 10) == cal


def test_calibration_from_a_prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "The sum of 2 and 3 is 5."}\n\n{"question": "What is 7 times 6?"}\n')
    cal = load_calibration(str(path))
    assert cal.prompts == ("The sum of 2 and 3 is 5.", "Question: What is 7 times 6?\nAnswer:")
    assert cal.source == str(path) and len(set(cal.item_sha256)) == 2


def test_calibration_overlapping_test_items_is_refused_by_the_command(example, tmp_path):
    """Evaluation items (arith's test split), differing only in case and spacing, are caught by hash: exit 2,
    one line naming the file and how many, and no sidecar written."""
    tests = [json.loads(line)["question"] for line in ARITH_TEST.read_text().splitlines()[:2]]
    path = tmp_path / "prompts.jsonl"
    rows = [{"question": "  " + tests[0].upper()}, {"text": "A prompt of my own."},
            {"question": tests[1].replace(" ", "  ")}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sens.json"
    done = subprocess.run(sensitivity_cmd(example, "--calibration", path, "--out", out), capture_output=True, text=True)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert f"{path}: 2 of 3 calibration items are test items of arith" in done.stderr and "line 1, 3" in done.stderr
    assert not out.exists() and not list(tmp_path.glob("sens.json*"))


@pytest.mark.parametrize("data, says", [
    ("arith:test", "only a benchmark's train split calibrates"),
    ("no-such-file.jsonl", "no such file and not a benchmark name"),
    ("BAD", "line 2: no 'question' or 'text' string"),
])
def test_unusable_calibration_data_is_refused(tmp_path, data, says):
    if data == "BAD":
        data = tmp_path / "bad.jsonl"
        data.write_text('{"text": "fine"}\n{"prompt": "wrong field"}\n')
    with pytest.raises(CalibrationError, match=says):
        load_calibration(str(data))


def test_the_sidecar_on_the_example(sidecar, example):
    sens = load_sensitivity(sidecar)
    assert sens.kind == "quantgate-sensitivity" and sens.rungs == list(MEASURED)
    assert sens.calibration["source"] == "arith:train" and sens.calibration["items"] == ITEMS
    assert len(sens.calibration["item_sha256"]) == ITEMS and sens.calibration["tokens"] > ITEMS
    units = {(u.layer, u.role) for u in sens.units}
    assert {(0, "attention"), (0, "dense_mlp"), (1, "routed_expert"), (1, "shared_expert"),
            (2, "attention"), (2, "routed_expert")} <= units
    assert not any(u.layer == 3 or u.mtp for u in sens.units)  # the MTP layer: transformers builds none
    for u in sens.units:
        assert set(u.error) == set(MEASURED) and set(u.bytes) == {*MEASURED, "bf16"}
        assert u.bytes["mxfp4"] < u.bytes["mxfp4_fp8"] < u.bytes["fp8"] < u.bytes["bf16"]
    # the activation side dominates: W4A8 loses less than W4A4 on the same weights, W8A8 least
    for role in ("attention", "dense_mlp", "routed_expert", "shared_expert"):
        for u in (u for u in sens.units if u.role == role):
            assert u.error["mxfp4"] > u.error["mxfp4_fp8"] > u.error["fp8"] > 0, u
    # the routed experts of a layer: 4 experts x 3 projections, 64 x 128 or 128 x 64 each
    experts = sens.unit(1, "routed_expert")
    assert experts.bytes["bf16"] == 12 * 64 * 128 * 2 and experts.bytes["mxfp4"] == 12 * (64 * 128 // 2 + 64 * 4)
    assert set(sens.expert_tokens) == {"1", "2"}
    assert all(sum(counts) == 2 * sens.calibration["tokens"] for counts in sens.expert_tokens.values())  # top-2
    assert sens.tokens["model.layers.0.self_attn.o_proj"] == sens.calibration["tokens"]
    assert sens.tokens["model.layers.1.mlp.experts.2.down_proj"] == sens.expert_tokens["1"][2]
    assert all(f"model.layers.{layer}.mlp.experts.{e}.{p}" in sens.amax for layer in (1, 2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj"))  # every expert named, routed to or not
    assert sens.input_scale("model.layers.1.mlp.experts.0.gate_proj") == pytest.approx(
        sens.amax["model.layers.1.mlp.experts.0.gate_proj"] / FP8_MAX, rel=2 ** -8)  # a bf16 scale, as Quark
    assert len(sens.seconds_per_layer) == 3 and sens.peak_rss_bytes > 0
    assert sens.source["path"] == str(example)


def test_statistics_equal_the_whole_model_run_by_transformers(sidecar, example):
    """Layer by layer, batched and right-padded, the pass sees what the whole model sees prompt by prompt: every
    Linear's input amax and every expert's routed tokens as transformers' own forward computes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sens = load_sensitivity(sidecar)
    model = AutoModelForCausalLM.from_pretrained(example, dtype=torch.bfloat16, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(example)
    amax, routed = {}, {}

    def linear_hook(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().amax().float().item())
        return hook

    def experts_hook(layer):
        def hook(module, args):
            routed[layer] = routed.get(layer, 0) + torch.bincount(args[1].flatten(), minlength=module.num_experts)
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name in sens.amax:
            module.register_forward_pre_hook(linear_hook(name))
        elif name.endswith("mlp.experts"):
            module.register_forward_pre_hook(experts_hook(name.split(".")[2]))
    with torch.no_grad():
        for prompt in load_calibration("arith", ITEMS).prompts:
            model(**tokenizer(prompt, return_tensors="pt"))
    assert len(amax) > 20
    assert amax == {name: sens.amax[name] for name in amax}
    # Routing is a top-k over bf16 scores: a near tie may fall either way when another process splits the
    # router's matmul over other threads, so a handful of the ~900 routed tokens per layer may move
    assert set(routed) == set(sens.expert_tokens)
    for layer, counts in routed.items():
        assert sum(counts.tolist()) == sum(sens.expert_tokens[layer])
        assert max(abs(a - b) for a, b in zip(counts.tolist(), sens.expert_tokens[layer])) <= 4, layer


def test_unit_error_is_the_rungs_quantization_of_that_unit_alone(example):
    """One unit's error, recomputed by hand: the dense MLP of layer 0 at W8A8 (FP8 per-tensor weights, static
    FP8 activations from the measured amax) in transformers' own model, against bf16, at layer 0's output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cal = load_calibration("arith", 2)
    sens = measure(example, cal)
    model = AutoModelForCausalLM.from_pretrained(example, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(example)
    outputs = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                  else out))
    inputs = [tokenizer(p, return_tensors="pt") for p in cal.prompts]
    with torch.no_grad():
        for x in inputs:
            model(**x)
        reference, outputs[:] = list(outputs), []
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(model.model.layers[0].mlp, proj)
            linear.weight.data = fp8_tensor.quantize_dequantize(linear.weight.data)
            input_scale = fp8_tensor.scale_of(sens["amax"][f"model.layers.0.mlp.{proj}"])
            linear.register_forward_pre_hook(lambda m, a, s=input_scale: (fp8_tensor.fp8_static_qdq(a[0], s),))
        for x in inputs:
            model(**x)
    diff = sum(((o - r).float() ** 2).sum() for o, r in zip(outputs, reference))
    norm = sum((r.float() ** 2).sum() for r in reference)
    unit = next(u for u in sens["units"] if (u["layer"], u["role"]) == (0, "dense_mlp"))
    assert unit["error"]["fp8"] == pytest.approx((diff / norm).sqrt().item(), rel=1e-6)


def test_weight_rungs_decode_as_stored():
    """MXFP4 weights as the codec stores and decodes them; FP8 per tensor: one scale, e4m3 values."""
    from quant.formats.codecs import CODECS

    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    codec = CODECS["mxfp4"]
    for rule in ScaleRule:
        assert torch.equal(mxfp4_weight_qdq(weight, rule), codec.decode(*codec.quantize(weight, rule)))
    scale = fp8_tensor.weight_scale(weight)
    assert torch.equal(weight_qdq(weight, "fp8", ScaleRule.EVEN),
                       fp8_tensor.dequantize(fp8_tensor.quantize(weight, scale), scale))


def test_a_never_routed_expert_is_named_deepseek_v3(tmp_path):
    """DeepSeek-V3's layout (no DSA indexer, nothing passed between layers), an expert the router's bias keeps
    from every token: its projections are in the sidecar with 0 tokens, and it is named as never routed."""
    config = tiny_config("deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1)
    bias = torch.tensor([0.0, 0.0, 0.0, -100.0])
    src = write_checkpoint(tmp_path / "bf16", config,
                           overrides={"model.layers.1.mlp.gate.e_score_correction_bias": bias})
    out = tmp_path / "sens.json"
    done = subprocess.run(sensitivity_cmd(src, "--calibration", "arith", "--items", 2, "--max-tokens", 32,
                                          "--out", out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "layer 1: experts rarely or never routed: 3 (0 tokens)" in done.stdout
    sens = load_sensitivity(out)
    assert sens.expert_tokens["1"][3] == 0 and sens.rare_experts["1"] == [3]
    assert sens.tokens["model.layers.1.mlp.experts.3.down_proj"] == 0
    assert sens.amax["model.layers.1.mlp.experts.3.gate_proj"] == 0.0
    assert {u.role for u in sens.units if u.layer == 1} == {"attention", "routed_expert", "shared_expert"}


def test_a_block_fp8_source_is_decoded_and_an_mxfp4_one_refused(example, tmp_path):
    """A block-FP8 source is measured on its decoded weights; other quantized sources are refused by name."""
    for fmt in ("fp8", "mxfp4"):
        done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", fmt, str(example), str(tmp_path / fmt)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    sens = measure(tmp_path / "fp8", load_calibration("arith", 1), max_tokens=16)
    assert {(u["layer"], u["role"]) for u in sens["units"]} >= {(0, "dense_mlp"), (2, "routed_expert")}
    assert sens["tokens"]["model.layers.0.mlp.down_proj"] == 16
    with pytest.raises(SensitivityError, match="reads a bf16 or block-FP8 source; decode this one first"):
        measure(tmp_path / "mxfp4", load_calibration("arith", 1))


def test_a_sidecar_that_is_not_one_is_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"kind": "something-else"}')
    with pytest.raises(SensitivityError, match="not a sensitivity file"):
        load_sensitivity(path)
    path.write_text('{"kind": "quantgate-sensitivity", "version": 1, "units": []}')
    with pytest.raises(SensitivityError, match="not a valid sensitivity file"):
        load_sensitivity(path)


def test_one_decoder_layer_is_resident_at_a_time(example):
    """After each layer is measured no decoder layer holds real memory: the model's skeleton is on the meta
    device, and the layer built for the measurement is freed before the next is read."""
    import gc

    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    def real_layers() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is GlmMoeDsaDecoderLayer
                and any(p.device.type != "meta" for p in o.parameters())}

    before = real_layers()  # a whole model an earlier test in this process still holds is not the pass's
    resident = []
    measure(example, load_calibration("arith", 1), max_tokens=8,
            progress=lambda layer, seconds: resident.append(len(real_layers() - before)))
    assert resident == [0, 0, 0]


def test_a_missing_source_is_one_line_exit_2(tmp_path):
    done = subprocess.run(sensitivity_cmd(tmp_path / "nothing", "--calibration", "arith", "--out", tmp_path / "s.json"),
                          capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'nothing'}: no such folder" in done.stderr and not (tmp_path / "s.json").exists()


def test_a_missing_output_folder_is_refused_before_the_pass(example, tmp_path):
    with pytest.raises(SensitivityError, match="does not exist"):
        run(example, "arith", tmp_path / "missing" / "s.json", items=1)


def test_the_ladder_measures_with_its_start_recipes_scale_rule(example, tmp_path):
    """quantize --ladder from a floor-rule recipe measures the MXFP4 weights the conversion will store (floor)."""
    floor = Path(__file__).resolve().parents[1] / "benchmarks" / "mxfp4-all-linear-floor.yaml"
    out = tmp_path / "sens.json"
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "--ladder", "--recipe", str(floor),
                           "--calibration", "arith", "--calibration-items", "1", "--sensitivity", str(out),
                           "--dry-run", str(example), str(tmp_path / "dst")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert load_sensitivity(out).scale_rule == "floor"
