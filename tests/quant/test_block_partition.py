"""Block FP8 under tensor / expert parallelism (``quant.engines.block_partition``).

The differential tests run each release's own check (sglang ``Fp8LinearMethod.validate_block_quant_shapes``
and the FusedMoE check of ``Fp8MoEMethod``; vLLM ``validate_fp8_block_shape`` with
``ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch``, the FusedMoE check with
``refine_fp8_moe_block_shape``) on a grid of partitions beside the rule data. By default each rule span's
first and last release; ``QUANTGATE_WINDOW=all`` runs every release of the window. The acceptance
cases convert tiny checkpoints at the sizes that decide the partitions (Qwen3.6-35B-A3B, MiniMax-M2,
Qwen3-30B-A3B) with the real ``quantize --to fp8`` and check them with the real ``gate checkpoint``.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version

from quant.engines.block_partition import block_rules, misfits, parts
from quant.engines.replay import Module
from quant.engines.rule_kinds import BlockMoe
from quant.engines.rules import window
from tests.quant.engine_sources import WheelUnavailable, methods, parsed, served_modules, wheel
from tests.quant.engine_sources import load as load_source
from tests.quant.family_checkpoints import write_family_checkpoint

BLOCK = (128, 128)
TPS = (1, 2, 4, 8, 16)
SIZES = (192, 256, 384, 512, 768, 1024, 1536, 2048)  # sizes whose partitions fit, refine or raise across TPS
MOE_BLOCKS = ((128, 128), (64, 128))  # square as quantize writes it; non-square tells block_n's check from block_k's


def _releases(engine: str) -> list[tuple[object, str]]:
    """(rule span, release) pairs to run: every release of the window with QUANTGATE_WINDOW=all, else each
    span's first and last."""
    every = os.environ.get("QUANTGATE_WINDOW") == "all"
    return [(rules, v) for rules in block_rules(engine) for v in window(engine)
            if Version(rules.first) <= Version(v) <= Version(rules.last)
            and (every or v in (rules.first, rules.last))]


def _wheel(engine: str, release: str):
    try:
        return wheel(engine, release)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain {engine}=={release} from the package registry: {exc}")


def _raises(call) -> bool:
    try:
        call()
    except ValueError as exc:
        assert "divisible" in str(exc) or "Block-aligned" in str(exc)
        return True
    return False


def _ours(rules, modules: dict[str, Module], tp: int, text: dict | None = None, ep: int = 1,
          platform: str = "cuda", block: tuple[int, int] = BLOCK) -> bool:
    return bool(misfits(rules, parts(modules), text or {}, block, tp, ep, platform))


def _linear_cases():
    """(kind, modules, text, engine arguments per tp): a row, a plain column, a merged column and a qkv."""
    for size in SIZES:
        yield "row", {"l.mlp.down_proj": Module(True, (256, size), "dense_mlp")}, {}, size
        yield "column", {"l.self_attn.q_b_proj": Module(True, (size, 256), "attention")}, {}, size
        merged = {f"l.mlp.{p}_proj": Module(True, (size, 256), "shared_expert") for p in ("gate", "up")}
        yield "merged", merged, {}, size
        for kv_heads in (1, 2, 4, 8):
            yield "qkv", {"l.self_attn.q_proj": Module(True, (4096, 256), "attention"),
                          "l.self_attn.k_proj": Module(True, (kv_heads * size // 8, 256), "attention"),
                          "l.self_attn.v_proj": Module(True, (kv_heads * size // 8, 256), "attention")}, \
                {"num_key_value_heads": kv_heads}, (kv_heads, size // 8)


def _partitions(kind: str, size, tp: int) -> dict:
    """The arguments the engines' Linear classes give their quant method at ``tp`` (linear.py)."""
    if kind == "row":
        return {"input_size": size, "input_size_per_partition": size // tp, "output_size": 256,
                "output_partition_sizes": [256]}
    if kind == "column":
        return {"input_size": 256, "input_size_per_partition": 256, "output_size": size,
                "output_partition_sizes": [size // tp]}
    if kind == "merged":
        return {"input_size": 256, "input_size_per_partition": 256, "output_size": 2 * size,
                "output_partition_sizes": [size // tp, size // tp]}
    kv_heads, head = size  # QKVParallelLinear: one KV head per rank when TP exceeds them
    per_rank = max(1, kv_heads // tp)
    q = 4096 // tp
    return {"input_size": 256, "input_size_per_partition": 256, "output_size": (q + 2 * per_rank * head) * tp,
            "output_partition_sizes": [q, per_rank * head, per_rank * head]}


def _vllm_linear(whl):
    utils = load_source(whl, "vllm/model_executor/layers/quantization/utils/fp8_utils.py", ["validate_fp8_block_shape"])
    allow = methods(whl, "vllm/model_executor/layers/linear.py", "ColumnParallelLinear",
                    ["_maybe_allow_fp8_block_shape_mismatch"])["cls"]._maybe_allow_fp8_block_shape_mismatch

    def check(kind: str, tp: int, args: dict):
        layer = types.SimpleNamespace(tp_size=tp, prefix="l", output_partition_sizes=args["output_partition_sizes"],
                                      quant_config=types.SimpleNamespace(weight_block_size=list(BLOCK)))
        if kind != "row":  # only ColumnParallelLinear and its merged subclasses allow a mismatch
            allow(layer)
        with served_modules({"vllm.distributed": {"get_tensor_model_parallel_world_size": lambda: tp}}):
            utils["validate_fp8_block_shape"](layer, args["input_size"], args["output_size"],
                                              args["input_size_per_partition"], args["output_partition_sizes"],
                                              list(BLOCK))
    return check


def _sglang_linear(whl):
    path = "sglang/srt/layers/quantization/fp8.py"
    tps = [1]
    extra = {"get_tensor_model_parallel_world_size": lambda: tps[0], "print_warning_once": print,
             "get_parallel": lambda: types.SimpleNamespace(tp_size=tps[0]), "LinearBase": object}
    holder = methods(whl, path, "Fp8LinearMethod", ["validate_block_quant_shapes"], extra=extra)["cls"]
    fn = holder.__dict__["validate_block_quant_shapes"]
    fn = getattr(fn, "__func__", fn)
    quant_config = types.SimpleNamespace(weight_block_size=list(BLOCK))
    own = {"self": types.SimpleNamespace(quant_config=quant_config), "quant_config": quant_config}

    def check(kind: str, tp: int, args: dict):
        tps[0] = tp
        given = {**own, "layer": types.SimpleNamespace(tp_group=types.SimpleNamespace(world_size=tp))}
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        fn(**{n: given[n] for n in names if n in given}, **args,
           output_size_per_partition=sum(args["output_partition_sizes"]))
    return check


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_linear_partitions_match_each_release(engine):
    """Every Linear kind at every TP: the rule data raises exactly where the release's own check does."""
    for rules, release in _releases(engine):
        check = (_sglang_linear if engine == "sglang" else _vllm_linear)(_wheel(engine, release))
        for kind, modules, text, size in _linear_cases():
            for tp in TPS:
                args = _partitions(kind, size, tp)
                if kind == "row" and size % tp or kind == "column" and size % tp or kind == "merged" and size % tp:
                    continue  # the engines' divide() asserts first: no block check is reached
                theirs = _raises(lambda: check(kind, tp, args))  # noqa: B023 (called at once)
                assert _ours(rules, modules, tp, text) == theirs, (release, kind, size, tp, args)


def _if_block_quant(whl, path: str, cls: str, method: str) -> ast.Module:
    """The ``if ...block_quant:`` statement of ``cls.method`` (its FusedMoE block check), as a module to run."""
    node = next(n for n in parsed(whl, path).body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if getattr(n, "name", None) == method)
    check = next(s for s in fn.body if isinstance(s, ast.If) and "block_quant" in ast.unparse(s.test))
    return ast.fix_missing_locations(ast.Module(body=[check], type_ignores=[]))


def _has(whl, path: str, cls: str | None, name: str) -> bool:
    body = parsed(whl, path).body
    if cls:
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        body = found.body if found else []
    return any(getattr(n, "name", None) == name for n in body)


def _sglang_moe(whl):
    path = "sglang/srt/layers/quantization/fp8.py"
    method = "create_fp8_moe_weight_" if _has(whl, path, "Fp8MoEMethod", "create_fp8_moe_weight_") else "create_weights"
    code = compile(_if_block_quant(whl, path, "Fp8MoEMethod", method), whl.name, "exec")
    utils = "sglang/srt/layers/moe/utils.py"
    padding = load_source(whl, utils, ["AITER_PADDING_SIZE", "TRITON_PADDING_SIZE", "get_moe_padding_size"],
                          extra={"os": os}) if _has(whl, utils, None, "get_moe_padding_size") else {}

    def check(intermediate: int, hidden: int, tp: int, aiter: bool, block: tuple[int, int]):
        quant_config = types.SimpleNamespace(weight_block_size=list(block))
        ns = {"block_quant": True, "quant_config": quant_config, "intermediate_size_per_partition": intermediate,
              "tp_size": tp, "_use_aiter": aiter, "get_moe_padding_size": padding.get("get_moe_padding_size"),
              "self": types.SimpleNamespace(block_quant=True, quant_config=quant_config)}
        exec(code, ns)  # noqa: S102 (the release's own check)
    return check


def _vllm_moe(whl):
    path = "vllm/model_executor/layers/quantization/fp8.py"
    code = compile(_if_block_quant(whl, path, "Fp8MoEMethod", "create_weights"), whl.name, "exec")
    oracle = "vllm/model_executor/layers/fused_moe/oracle/fp8.py"
    utils = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
    refine = load_source(whl, oracle, ["refine_fp8_moe_block_shape"], extra={"math": math}).get(
        "refine_fp8_moe_block_shape") if _has(whl, oracle, None, "refine_fp8_moe_block_shape") else None
    validate = load_source(whl, utils, ["validate_fp8_block_shape_moe"])["validate_fp8_block_shape_moe"] \
        if _has(whl, utils, None, "validate_fp8_block_shape_moe") else None

    def check(intermediate: int, hidden: int, tp: int, aiter: bool, block: tuple[int, int]):
        config = types.SimpleNamespace(intermediate_size_per_partition=intermediate, tp_size=tp, hidden_dim=hidden)
        refined = refine(config, list(block)) if refine else None  # moe_backend auto: refine where it can
        scale_refine = None if refined is None else (block[0] // refined[0], block[1] // refined[1])
        own = types.SimpleNamespace(block_quant=True, weight_block_size=list(block), weight_scale_refine=scale_refine,
                                    moe_block_shape=refined or list(block))
        with served_modules({"vllm.distributed": {"get_tensor_model_parallel_world_size": lambda: tp}}):
            ns = {"self": own, "layer": types.SimpleNamespace(), "intermediate_size_per_partition": intermediate,
                  "get_tensor_model_parallel_world_size": lambda: tp, "validate_fp8_block_shape_moe": validate}
            exec(code, ns)  # noqa: S102 (the release's own check)
    return check


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_moe_partitions_match_each_release(engine):
    """The FusedMoE at every TP, on CUDA and (sglang: aiter) ROCm: the rule data raises where the release does."""
    for rules, release in _releases(engine):
        check = (_sglang_moe if engine == "sglang" else _vllm_moe)(_wheel(engine, release))
        for intermediate in SIZES:
            for hidden in (256, 2048, 3072):
                experts = {f"l.mlp.experts.0.{p}_proj": Module(True, (intermediate, hidden), "routed_expert")
                           for p in ("gate", "up")}
                for tp, platform, block in ((t, p, b) for t in TPS for p in ("cuda", "rocm") for b in MOE_BLOCKS):
                    aiter = platform == "rocm" and engine == "sglang"
                    theirs = _raises(lambda: check(intermediate // tp, hidden, tp, aiter, block))  # noqa: B023
                    assert _ours(rules, experts, tp, platform=platform, block=block) == theirs, \
                        (release, intermediate, hidden, tp, platform, block)


def test_fused_experts_are_one_fused_moe():
    """A fused gate_up_proj [2I, H] (a release's own fused experts) is the FusedMoE of intermediate I."""
    fused = {"l.mlp.experts.gate_up_proj": Module(True, (2 * 768, 2048), "routed_expert")}
    assert [(p.module, p.kind, p.sizes) for p in parts(fused)] == [("l.mlp.experts", "moe", (768, 2048))]


def test_every_window_release_is_covered_once():
    """Each registry release of the window follows exactly one block rule span (none unread)."""
    for engine in ("sglang", "vllm"):
        for release in window(engine):
            spans = [r for r in block_rules(engine) if Version(r.first) <= Version(release) <= Version(r.last)]
            assert len(spans) == 1, (engine, release, spans)


def test_a_release_no_span_covers_is_named_not_guessed(monkeypatch):
    """A registry release added to the window after the rule files were read: stated TP fails naming it."""
    import quant.engines.block_partition as bp
    from quant.engines.rules import RuleSet
    from quant.engines.serving import serving

    monkeypatch.setattr(bp, "window", lambda e: (*window(e), "0.35.0") if e == "vllm" else window(e))
    experts = {"l.mlp.experts.0.gate_proj": Module(True, (768, 2048), "routed_expert")}
    rule_set = RuleSet("vllm", "0.33.0", "0.35.0", {}, {})
    found = bp.block_findings(rule_set, experts, {}, {"quant_method": "fp8", "weight_block_size": [128, 128]},
                              serving(tp=4, check_tp=True))
    assert [f.module for f in found] == ["quantization_config.weight_block_size"] and "vllm 0.35.0" in found[0].why
    assert bp.tp_summary(experts, {}, {"quant_method": "fp8", "weight_block_size": [128, 128]})[-1] == \
        "vllm 0.35.0: block FP8 partition checks not read"


def test_rule_values_are_checked():
    with pytest.raises(ValueError, match="refine_min"):
        BlockMoe(misfit="refine")
    with pytest.raises(ValueError, match="refine_min"):
        BlockMoe(misfit="raise", refine_min=32)


def test_expert_parallel_keeps_the_intermediate_whole():
    """EP over every rank: each expert's intermediate stays whole, so a TP misfit loads."""
    sglang = block_rules("sglang")[-1]
    experts = {"l.mlp.experts.0.gate_proj": Module(True, (768, 2048), "routed_expert")}
    assert _ours(sglang, experts, 4) and not _ours(sglang, experts, 4, ep=4)


# --- acceptance: real conversions and real gate checkpoint processes ---------------------------------

CASES = {  # the sizes that decide the partitions, hidden size cut to 256 (no check reads more of it than its gcd)
    "qwen3_6": ("qwen3_5_moe", {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128}),
    "minimax_m2": ("minimax_m2", {"intermediate_size": 1536, "num_attention_heads": 48, "num_key_value_heads": 8,
                                  "head_dim": 128}),
    "qwen3_30b": ("qwen3_moe", {"moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
                                "head_dim": 128}),
}


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each case converted by ``quantize --to fp8`` (a real process), with its human output."""
    out = {}
    for name, (family, sizes) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        src = write_family_checkpoint(root / "bf16", family, num_hidden_layers=2, hidden_size=256, **sizes)
        done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "fp8", str(src), str(root / "fp8")],
                              capture_output=True, text=True, check=True)
        out[name] = (root / "fp8", done.stdout)
    return out


def gate(folder, *args) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(folder), *args],
                          capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def test_qwen3_6_fp8_does_not_load_in_vllm_at_tp8(fp8):
    """quantgate's own --to fp8 of a Qwen3.6-35B-A3B-shaped model: the shared expert's down_proj (512 / 8 =
    64 per rank) raises in vLLM 0.33.0 at TP 8; TP 4 loads; quantize said so, with the way out."""
    folder, said = fp8["qwen3_6"]
    code, out, _ = gate(folder, "--engine", "vllm==0.33.0", "--tp", "8")
    assert code == 1, out
    assert "mlp.shared_expert.down_proj" in out and "512/8 = 64 is not divisible by block_k 128" in out
    assert "serve at TP 1, 2, 4" in out and "--shared-experts bf16" in out
    assert gate(folder, "--engine", "vllm==0.33.0", "--tp", "4")[0] == 0
    assert "warning     block FP8 128x128 at TP 8 (rocm) does not load in sglang 0.5.9-0.5.23, vllm " \
           "0.16.0-0.34.0" in said and "--shared-experts bf16" in said
    assert "vllm 0.29.0-0.34.0 (rocm): block FP8 128x128 loads at TP 1, 2, 4; not at TP 8" in said


def test_qwen3_6_unstated_tp_reports_the_sizes_without_failing(fp8):
    """Without --tp nothing is assumed: the report lists the TP sizes each release span loads at."""
    code, out, _ = gate(fp8["qwen3_6"][0], "--engine", "vllm==0.33.0")
    assert code == 0, out
    assert "block FP8 by TP size (--tp not stated, so not checked: pass --tp N)" in out
    assert "vllm 0.29.0-0.34.0 (rocm): block FP8 128x128 loads at TP 1, 2, 4; not at TP 8" in out


def test_minimax_m2_fp8_at_tp8_on_sglang_cuda(fp8):
    """MiniMax-M2.x FP8: each expert's intermediate 1536 / 8 = 192 per rank raises in sglang 0.5.23 on CUDA;
    aiter on ROCm pads it; TP 4 (384) loads."""
    folder = fp8["minimax_m2"][0]
    code, out, _ = gate(folder, "--engine", "sglang==0.5.23", "--platform", "cuda", "--tp", "8")
    assert code == 1 and "FusedMoE intermediate partition 1536/8 = 192 is not divisible by block_n 128" in out, out
    assert gate(folder, "--engine", "sglang==0.5.23", "--platform", "cuda", "--tp", "4")[0] == 0
    assert gate(folder, "--engine", "sglang==0.5.23", "--tp", "8")[0] == 0  # ROCm: aiter pads the FusedMoE


def test_qwen3_30b_fp8_at_tp4_on_sglang_cuda(fp8):
    """Qwen3-30B-A3B FP8: 768 / 4 = 192 per rank raises in sglang 0.5.23 on CUDA; TP 2 and EP 4 load, and
    vLLM 0.33.0 refines the block to 64 at TP 4."""
    folder = fp8["qwen3_30b"][0]
    code, out, _ = gate(folder, "--engine", "sglang==0.5.23", "--platform", "cuda", "--tp", "4")
    assert code == 1 and "768/4 = 192" in out, out
    assert gate(folder, "--engine", "sglang==0.5.23", "--platform", "cuda", "--tp", "2")[0] == 0
    assert gate(folder, "--engine", "sglang==0.5.23", "--platform", "cuda", "--tp", "4", "--ep", "4")[0] == 0
    assert gate(folder, "--engine", "vllm==0.33.0", "--platform", "cuda", "--tp", "4")[0] == 0


@pytest.mark.parametrize(("args", "says"), [(("--tp", "0"), "--tp 0: a parallel size is at least 1"),
                                            (("--tp", "3"), "num_attention_heads 16, which TP 3 does not divide")])
def test_bad_tp_is_one_line(fp8, args, says):
    code, out, err = gate(fp8["qwen3_6"][0], *args)
    assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert out == ""
