"""The precision ladder's choice (quant.ladder): lifting the most erring units up the rungs until a budget holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quant.ladder import (
    Budget,
    LadderError,
    choose,
    default_error_budget,
    describe,
    ladder_recipe,
    manifest_line,
    record,
    start_rung,
    units_of,
)
from quant.hashing import sha256_of
from quant.layout import manifests_root
from quant.recipe import load_recipe

ALL_LINEAR = manifests_root() / "recipes" / "mxfp4-all-linear.yaml"


def unit(layer: int, role: str, w4a4: float, w4a8: float, w8a8: float, size: int = 100) -> dict:
    """A sidecar unit: its errors per rung, and bytes as the rungs store them (MXFP4 ~4.25 bits, FP8 8, bf16 16)."""
    return {"layer": layer, "role": role, "mtp": False, "error": {"mxfp4": w4a4, "mxfp4_fp8": w4a8, "fp8": w8a8},
            "bytes": {"mxfp4": size * 17 // 32, "mxfp4_fp8": size * 17 // 32 + 4, "fp8": size + 4, "bf16": 2 * size}}


SIDECAR = {"kind": "quantgate-sensitivity", "version": 1,
           "calibration": {"source": "arith:train", "items": 64, "tokens": 4100, "item_sha256": ["ab"] * 64},
           "units": [unit(0, "attention", 0.30, 0.12, 0.02), unit(0, "dense_mlp", 0.05, 0.03, 0.01),
                     unit(1, "attention", 0.20, 0.09, 0.03), unit(1, "routed_expert", 0.08, 0.04, 0.01, 400),
                     unit(1, "shared_expert", 0.02, 0.01, 0.005), unit(2, "routed_expert", 0.15, 0.06, 0.02, 400)],
           "seconds": 1.5, "peak_rss_bytes": 1000}


@pytest.fixture()
def units():
    return units_of(SIDECAR)


@pytest.fixture()
def start():
    return load_recipe(ALL_LINEAR)


def rungs(choices) -> dict[tuple[int, str], str]:
    return {(c.unit.layer, c.unit.role): c.rung for c in choices}


def test_error_budget_lifts_each_unit_to_the_cheapest_rung_under_it(units, start):
    chosen = rungs(choose(units, start, Budget(error=0.1)))
    assert chosen == {(0, "attention"): "fp8", (0, "dense_mlp"): "mxfp4", (1, "attention"): "mxfp4_fp8",
                      (1, "routed_expert"): "mxfp4", (1, "shared_expert"): "mxfp4",
                      (2, "routed_expert"): "mxfp4_fp8"}


def test_default_budget_is_the_worst_w8a8_unit(units, start):
    assert default_error_budget(units) == 0.03
    chosen = choose(units, start, Budget(error=default_error_budget(units)))
    assert max(c.error for c in chosen) <= 0.03
    assert rungs(chosen)[(1, "shared_expert")] == "mxfp4"  # already under it at W4A4


def test_a_rung_the_served_releases_do_not_build_is_skipped(units, start):
    def no_w4a8_moe(role: str, rung: str) -> bool:
        return not (role == "routed_expert" and rung == "mxfp4_fp8")

    def no_w4a4_attention(role: str, rung: str) -> bool:
        return not (role == "attention" and rung == "mxfp4")

    chosen = rungs(choose(units, start, Budget(error=0.1), no_w4a8_moe))
    assert chosen[(2, "routed_expert")] == "fp8"  # W4A8 would do, but is not built: the next rung up
    assert chosen[(1, "attention")] == "mxfp4_fp8"
    assert rungs(choose(units, start, Budget(error=1.0), no_w4a4_attention))[(1, "attention")] == "mxfp4_fp8"


def test_byte_budget_is_spent_on_the_most_sensitive_units_first(units, start):
    base = sum(u.bytes["mxfp4"] for u in units)
    chosen = choose(units, start, Budget(bytes=base + 100))  # W4A8 costs 4 bytes a unit; one W8A8 lift fits
    assert sum(c.nbytes for c in chosen) <= base + 100
    assert rungs(chosen)[(0, "attention")] == "fp8"  # the worst unit, lifted first
    assert all(c.rung in ("mxfp4_fp8", "fp8") for c in chosen)
    with pytest.raises(LadderError, match="start recipe's units alone take"):
        choose(units, start, Budget(bytes=base - 1))


def test_an_error_budget_the_byte_budget_cannot_pay_for_is_refused_naming_the_units(units, start):
    base = sum(u.bytes["mxfp4"] for u in units)
    with pytest.raises(LadderError, match=r"error budget 0\.05 cannot hold: .*layer 0 attention at W4A8 \(0\.12\)"):
        choose(units, start, Budget(error=0.05, bytes=base + 30))


def test_units_the_start_recipe_keeps_stay_kept(units, tmp_path):
    recipe = tmp_path / "experts.yaml"
    recipe.write_text("format: mxfp4\nrules:\n  - {role: routed_expert, action: quantize}\n")
    chosen = rungs(choose(units, load_recipe(recipe), Budget(error=0.1)))
    assert chosen[(0, "attention")] == chosen[(1, "shared_expert")] == "bf16"
    assert chosen[(2, "routed_expert")] == "mxfp4_fp8"


def test_the_choice_is_a_mixed_recipe_that_gives_each_unit_its_rung(units, start):
    chosen = choose(units, start, Budget(error=0.1))
    recipe = ladder_recipe(start, chosen)
    assert recipe.mixed and recipe.name == "mxfp4-all-linear+ladder"
    assert {start_rung(recipe, c.unit) for c in chosen if c.rung == "mxfp4_fp8"} == {"mxfp4_fp8"}
    assert all(start_rung(recipe, c.unit) == c.rung for c in chosen)
    ladder_rules = [r for r in recipe.rules if r.layers is not None]
    assert [(r.role, r.layers, r.format) for r in ladder_rules] == [
        ("attention", (0,), "fp8"), ("attention", (1,), "mxfp4_fp8"), ("routed_expert", (2,), "mxfp4_fp8")]


def test_the_manifest_record_and_its_line(units, start):
    budget = Budget(error=0.1)
    chosen = choose(units, start, budget)
    rec = record(chosen, budget, default_budget=False, sidecar=SIDECAR,
                 sidecar_file={"path": "sensitivity.json", "sha256": "00"}, skipped={})
    assert "item_sha256" not in rec["sensitivity"]["calibration"]  # hashes stay in the sidecar
    assert rec["bytes"]["start"] < rec["bytes"]["chosen"] < rec["bytes"]["fp8"]
    assert rec["max_error"] == {"start": 0.30, "chosen": 0.09}
    line = describe(rec)
    assert line.startswith("6 units: 3 W4A4, 2 W4A8, 1 W8A8; largest layer error 0.09 (start 0.3; budget error <= 0.1)")
    assert "calibrated on arith:train (64 items, 4100 tokens)" in line


@pytest.mark.parametrize("broken, said", [
    ({"units": []}, "no measured units"),
    ({"units": [{"layer": 1, "role": "attention"}]}, r"units\[0\] is not a measured unit"),
    ({"units": [{**unit(1, "attention", 0.1, 0.1, 0.1), "error": {"mxfp4": 0.1}}]},
     r"units\[0\] \(layer 1 attention\) has no measurement for mxfp4_fp8, fp8"),
])
def test_a_sidecar_without_the_measurements_is_refused_naming_the_unit(broken, said):
    with pytest.raises(LadderError, match=said):
        units_of(broken, "s.json")


def test_gate_release_shows_the_ladder_line_from_the_manifest(units, start):
    from evals.judge.binding import lines, provenance

    budget = Budget(error=0.1)
    rec = record(choose(units, start, budget), budget, default_budget=True, sidecar=SIDECAR,
                 sidecar_file={"path": "sensitivity.json", "sha256": "00"}, skipped={})
    line = manifest_line({"ladder": rec})
    assert line == describe(rec) and "(the worst W8A8 unit's)" in line
    bound = {"sha256": None, "verified": False, "shards_verified": False, "shards": 0, "recipe": "r+ladder",
             "ladder": line}
    assert ("ladder", line) in lines(provenance(bound, {}, None))
    assert "ladder" not in dict(lines(provenance({**bound, "ladder": None}, {}, None)))
    assert manifest_line({"recipe": {}}) is None
    assert manifest_line({"ladder": {"units": 3}}).startswith("recorded, but not in the form")


def quantize(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


@pytest.mark.parametrize("args, said", [
    (["--calibration", "arith"], "--calibration is an option of the precision ladder: add --ladder"),
    (["--error-budget", "0.1"], "--error-budget is an option of the precision ladder: add --ladder"),
    (["--ladder"], "--ladder needs what to measure with: --calibration DATA"),
    (["--ladder", "--sensitivity", "missing.json"], "--ladder needs what to measure with"),
    (["--ladder", "--calibration", "arith", "--resume"], "--ladder --resume: a resumed conversion keeps its plan"),
    (["--ladder", "--calibration", "arith", "--error-budget", "nan"], "'nan' is not a relative error"),
    (["--ladder", "--calibration", "arith", "--byte-budget", "12XB"], "'12XB' is not a byte count"),
])
def test_ladder_options_that_do_not_fit_are_refused_in_one_line_writing_nothing(glm_ckpt, tmp_path, args, said):
    out = quantize(glm_ckpt, tmp_path / "out", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()


def test_only_an_mxfp4_checkpoint_is_laddered(glm_ckpt, tmp_path):
    out = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp6_e2m3", "--ladder", "--calibration", "arith",
                          str(glm_ckpt), str(tmp_path / "out")], capture_output=True, text=True)
    assert out.returncode == 2 and "only an mxfp4 checkpoint mixes rungs per layer; use --to mxfp4" in out.stderr
    assert not (tmp_path / "out").exists()


# --- quantize --ladder end to end, on a sidecar written for the test (the pass itself: test_sensitivity.py) -------

# per (layer, role) the relative errors at W4A4, W4A8, W8A8: layer 0's attention and layer 2's routed experts
# matter, the rest does not
ERRORS = {(0, "attention"): (0.30, 0.12, 0.02), (1, "attention"): (0.02, 0.01, 0.005),
          (2, "attention"): (0.03, 0.02, 0.01), (0, "dense_mlp"): (0.05, 0.03, 0.01),
          (1, "routed_expert"): (0.04, 0.03, 0.01), (2, "routed_expert"): (0.15, 0.06, 0.02),
          (1, "shared_expert"): (0.02, 0.01, 0.005), (2, "shared_expert"): (0.02, 0.01, 0.005)}


def write_sidecar(src: Path, path: Path, errors=ERRORS, source: str = "arith:train") -> Path:
    """A sensitivity sidecar for ``src`` with ``errors``, the unit bytes the pass computes, and an input amax
    for every Linear, in the pass's own schema (``write_sensitivity`` validates it)."""
    from quant.plan import make_plan
    from quant.sensitivity import unit_bytes, write_sensitivity

    plan = make_plan(src, load_recipe(ALL_LINEAR))
    shapes: dict[tuple[int, str], list] = {}
    for t in plan.tensors:
        layer = plan.family.layer_index(t.source.name)
        if (layer, t.role) in errors and not t.mtp:
            shapes.setdefault((layer, t.role), []).extend(shape for _, shape in t.linear_modules())
    units = [{"layer": layer, "role": role, "mtp": False, "error": dict(zip(("mxfp4", "mxfp4_fp8", "fp8"), e)),
              "bytes": unit_bytes(shapes[layer, role])} for (layer, role), e in sorted(errors.items())]
    modules = [m for m in plan.modules() if ".layers.3." not in m]
    write_sensitivity(path, {
        "kind": "quantgate-sensitivity", "version": 1,
        "source": {"path": str(src), "config_sha256": sha256_of(src / "config.json")},
        "calibration": {"source": source, "items": 8, "tokens": 512, "item_sha256": ["0" * 64] * 8},
        "rungs": ["mxfp4", "mxfp4_fp8", "fp8"], "units": units,
        "amax": {m: 2.0 for m in modules}, "tokens": {m: 512 for m in modules}, "expert_tokens": {},
        "seconds": 1.0, "peak_rss_bytes": 1, "seconds_per_layer": [0.3, 0.3, 0.4]})
    return path


SERVE = ("--serve", "sglang==0.5.23", "--serve", "vllm==0.33.0", "--serve", "vllm==0.34.0")


def test_the_ladder_converts_its_choice_records_it_and_the_served_releases_load_it(glm_ckpt, tmp_path):
    sidecar = write_sidecar(glm_ckpt, tmp_path / "sens.json")
    dst = tmp_path / "ladder"
    out = quantize("--ladder", "--calibration", "arith", "--sensitivity", sidecar, "--error-budget", "0.1", *SERVE,
                   glm_ckpt, dst)
    assert out.returncode == 0, out.stderr
    assert "ladder      8 units: 6 W4A4, 1 W4A8, 1 W8A8; largest layer error 0.06" in out.stdout
    manifest = json.loads((dst / "conversion_manifest.json").read_text())
    ladder = manifest["ladder"]
    chosen = {(u["layer"], u["role"]): u["rung"] for u in ladder["units"]}
    # sglang builds no W4A8 Linear (only W4A8 experts): layer 0's attention, which W4A8 would do for, goes to W8A8
    assert "sglang 0.5.23 would not load" in ladder["rungs_skipped"]["attention"]["mxfp4_fp8"]
    assert "routed_expert" not in ladder["rungs_skipped"]
    assert chosen[0, "attention"] == "fp8" and chosen[2, "routed_expert"] == "mxfp4_fp8"
    assert chosen[0, "dense_mlp"] == "mxfp4"
    assert ladder["sensitivity"]["path"] == str(sidecar) and not (dst / "sensitivity.json").exists()
    assert ladder["bytes"]["start"] < ladder["bytes"]["chosen"] < ladder["bytes"]["fp8"]
    assert manifest["recipe"]["name"] == "mxfp4-all-linear+ladder"
    assert {"role": "attention", "layers": [0], "format": "fp8"}.items() <= manifest["recipe"]["rules"][0].items()
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["layer_quant_config"]["model.layers.2.mlp.experts*"]["input_tensors"]["dtype"] == "fp8_e4m3"
    for release in ("sglang==0.5.23", "vllm==0.33.0", "vllm==0.34.0"):
        checked = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(dst), "--engine", release],
                                 capture_output=True, text=True)
        assert checked.returncode == 0, (release, checked.stdout[-2000:], checked.stderr)


@pytest.mark.parametrize("case, said", [
    ("another source", "measured on"),
    ("other calibration", "calibrated on arith:train, not --calibration gsm8k"),
    ("budget", "--byte-budget 1: the start recipe's units alone take"),
])
def test_a_sidecar_or_budget_that_does_not_fit_is_refused_writing_nothing(glm_ckpt, dsv3_ckpt, tmp_path, case, said):
    sidecar = write_sidecar(glm_ckpt, tmp_path / "sens.json")
    src, extra = glm_ckpt, ["--calibration", "arith"]
    if case == "another source":
        src = dsv3_ckpt
    if case == "other calibration":
        extra = ["--calibration", "gsm8k"]
    if case == "budget":
        extra += ["--error-budget", "0.01", "--byte-budget", "1"]
    out = quantize("--ladder", "--sensitivity", sidecar, *extra, src, tmp_path / "out")
    assert out.returncode == 2, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_ladder_measures_with_its_own_pass_and_keeps_the_sidecar_in_the_checkpoint(glm_ckpt, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"Tom has {n} apples and buys {n + 3} more."}) + "\n"
                               for n in range(4)))
    dst = tmp_path / "ladder"
    out = quantize("--ladder", "--calibration", prompts, "--calibration-items", "2", "--error-budget", "0.5", *SERVE,
                   glm_ckpt, dst)
    assert out.returncode == 0, out.stderr
    ladder = json.loads((dst / "conversion_manifest.json").read_text())["ladder"]
    assert ladder["sensitivity"]["path"] == "sensitivity.json"
    assert ladder["sensitivity"]["calibration"]["source"] == str(prompts)
    assert ladder["sensitivity"]["calibration"]["items"] == 2
    assert sha256_of(dst / "sensitivity.json") == ladder["sensitivity"]["sha256"]


def test_calibration_data_holding_evaluation_items_is_refused_before_anything_is_measured(glm_ckpt, tmp_path):
    test_item = json.loads((Path(__file__).resolve().parents[2] / "evals" / "benchmarks" / "data" / "arith" /
                            "test.jsonl").read_text().splitlines()[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "How many legs do 3 cats have?"}) + "\n"
                       + json.dumps({"question": test_item["question"].upper()}) + "\n")
    out = quantize("--ladder", "--calibration", prompts, glm_ckpt, tmp_path / "out")
    assert out.returncode == 2 and "1 of 2 calibration items are test items of arith" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()
