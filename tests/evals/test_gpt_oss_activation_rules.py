"""What the engines do with the activations of gpt-oss's own MXFP4 checkpoint (quant_method mxfp4, no
activation scheme in its config), run from the wheels' own code (tests/quant/engine_sources.py): the
rules ``evals.emulation.GPT_OSS_ACTIVATIONS`` states, and why ``evals run`` evaluates it only with
``--activations bf16``. The platform queries are fakes (the GPU an engine runs on), each named below."""

from __future__ import annotations

import ast
import enum
from types import SimpleNamespace

import pytest

from evals.emulation import GPT_OSS_ACTIVATIONS
from tests.quant import engine_sources

ORACLE = "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py"
OVERRIDES = "sglang/srt/arg_groups/model_overrides/gpt_oss.py"
TRTLLM = "sglang/srt/layers/moe/moe_runner/flashinfer_trtllm.py"


def call_args(whl, path: str, cls: str, method: str, callee: str) -> list[list[ast.expr]]:
    node = engine_sources.class_def(whl, path, cls)
    fn = engine_sources.method_def(node, method)
    return [c.args + c.keywords for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == callee]


@pytest.fixture(scope="module")
def vllm():
    return engine_sources.wheel("vllm", "0.33.0")


@pytest.fixture(scope="module")
def sglang():
    return engine_sources.wheel("sglang", "0.5.23")


@pytest.mark.parametrize("sm120", [False, True])
def test_vllm_picks_only_bf16_activation_backends_for_gpt_oss(vllm, sm120):
    """vLLM 0.33.0: GptOssMxfp4MoEMethod asks select_mxfp4_moe_backend(moe) with no activation key;
    the auto path filters _get_priority_backends_for_gpt_oss() by that None key. Fakes:
    ``current_platform`` (CUDA, SM120 or not) and ``prioritize_humming`` as the identity (it only
    moves Humming ahead of Marlin, quantization/utils/humming/priority.py), keys as sentinels."""
    [asked] = call_args(vllm, "vllm/model_executor/layers/quantization/mxfp4.py", "GptOssMxfp4MoEMethod",
                        "__init__", "select_mxfp4_moe_backend")
    assert len(asked) == 1  # moe alone: activation_key None
    keys = {k: SimpleNamespace(name=k) for k in ("kFp8Dynamic128Sym", "kFp8StaticTensorSym", "kMxfp4Dynamic",
                                                  "kMxfp8Dynamic")}
    platform = SimpleNamespace(is_cuda=lambda: True, is_device_capability_family=lambda family: sm120 and family == 120)
    ns = engine_sources.load(vllm, ORACLE, ["Mxfp4MoeBackend", "_get_priority_backends_for_gpt_oss",
                                            "_filter_by_activation", "_backend_activation_key"],
                             {"Enum": enum.Enum, "current_platform": platform, "prioritize_humming": lambda k: k,
                              "QuantKey": object, **keys})
    priority = ns["_get_priority_backends_for_gpt_oss"]()
    chosen = ns["_filter_by_activation"](priority, None)
    key = ns["_backend_activation_key"]
    assert chosen and all(key(b) is None for b in chosen)
    quantized = [b.name for b in priority if key(b) is not None]  # not vacuous: the list holds MXFP8/FP8 ones
    assert {"FLASHINFER_TRTLLM_MXFP4_MXFP8", "AITER_MXFP4_FP8"} <= set(quantized)
    assert not set(quantized) & {b.name for b in chosen}


class Platform(SimpleNamespace):
    """sglang's get_platform(): the flags _gpt_oss_overrides reads, all False unless given."""

    def __getattr__(self, name):
        return False


@pytest.mark.parametrize("gpu,backend", [("is_sm100", "flashinfer_mxfp4"), ("is_sm120", "flashinfer_mxfp4"),
                                         ("is_sm90", "triton_kernel"), ("is_hip", "auto")])
def test_sglang_moe_runner_backend_for_gpt_oss_mxfp4(sglang, gpu, backend):
    """sglang 0.5.23 _gpt_oss_overrides, moe_runner_backend auto, ep_size 1, no --quantization. Fakes:
    get_platform (the GPU), SGLANG_USE_AITER on, triton_kernels installed, a driver below 595."""
    ns = engine_sources.load(sglang, OVERRIDES, ["_gpt_oss_overrides"], {
        "_register_for": lambda name: (lambda f: f), "resolving_view": lambda a: a,
        "is_attention_backend_not_set": lambda cfg: False, "get_platform": lambda: Platform(**{gpu: True}),
        "envs": SimpleNamespace(SGLANG_USE_AITER=SimpleNamespace(get=lambda: True)), "use_mlx": lambda: False,
        "is_cpu": lambda: False, "is_mps": lambda: False, "is_triton_kernels_available": lambda: True,
        "get_nvidia_driver_version": lambda: (580,)})
    args = SimpleNamespace(moe_runner_backend="auto", ep_size=1, quantization=None, dtype="auto")
    overrides = ns["_gpt_oss_overrides"](args, SimpleNamespace(quantization_config={"quant_method": "mxfp4"}))
    assert overrides["moe_runner_backend"] == backend and overrides["dtype"] == "bfloat16"


def test_sglang_flashinfer_mxfp4_runs_mxfp8_activations_by_default(sglang):
    """The SM100 trtllm-gen path: precision "default" (the flag's default, arg_groups/fields/exec_.py)
    prepares MXFP8 activations; only "bf16", asked for, keeps them bf16."""
    fields = engine_sources.source(sglang, "sglang/srt/arg_groups/fields/exec_.py")
    assert '"Choose the computation precision of flashinfer mxfp4 moe. "' in fields
    assert fields.split("flashinfer_mxfp4_moe_precision:", 1)[1].split("\n    ] = ", 1)[1].startswith('"default"')
    fn = next(n for n in engine_sources.parsed(sglang, TRTLLM).body
              if getattr(n, "name", None) == "_fused_experts_flashinfer_mxfp4_sm100_trtllm_gen")
    branches = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                ast.unparse(node.test.left) == "quant_info.flashinfer_mxfp4_moe_precision":
            calls = {getattr(c.func, "id", None) for c in ast.walk(ast.Module(body=node.body, type_ignores=[]))
                     if isinstance(c, ast.Call)}
            branches[node.test.comparators[0].value] = calls
    assert "_prepare_flashinfer_mxfp8_activations" in branches["default"]
    assert "_prepare_flashinfer_mxfp8_activations" not in branches["bf16"]


def test_the_refusal_states_these_rules():
    sglang = ("sglang 0.5.23 runs MXFP8 activations on SM100/SM120 (flashinfer_mxfp4), bf16 on SM90 (triton_kernel) "
              "and aiter's choice on ROCm")
    for part in ("vLLM 0.33.0 runs bf16 activations on every GPU", sglang):
        assert part in GPT_OSS_ACTIVATIONS
