"""vLLM's per-layer Quark schemes (``quant.engines.quark_layers_vllm`` with
``manifests/engines/quark_layers.vllm.yaml``) against every release's own code.

The differential tests run each release's ``QuarkConfig`` from its wheel (tests/quant/quark_vllm_wheel.py:
from_config, get_quant_method, _find_matched_config, the scheme predicates, QuarkMoEMethod.get_moe_method and
the OCP MX constructors) on a grid of per-layer configs and modules beside ``decide`` under the rules of the
span covering that release: the same spec matched, the same rung built with the class the rule names, or the
same error. Every release of the window runs.
"""

from __future__ import annotations

import copy

import pytest

from quant.engines import quark_layers_vllm as qv
from quant.engines.format_rules import format_spans
from quant.engines.rules import RuleSet, window
from quant.formats.constants import ScaleRule
from quant.quark_config import quantization_config
from quant.rungs import RUNGS, rung_of_spec
from tests.quant.quark_vllm_wheel import WheelUnavailable, build, matched

KIND = "quark-layers"
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
WINDOW = window("vllm")
W4A4, W4A8, W8A8 = (RUNGS[r].spec() for r in ("mxfp4", "mxfp4_fp8", "fp8"))


def qconfig(layers: dict, global_rung: str = "mxfp4", by_type: dict | None = None) -> dict:
    """A Quark config as quantgate writes it, with ``layer_quant_config`` ``layers`` (key -> rung name)."""
    config = quantization_config([], ScaleRule.EVEN, weight_only=False)
    config["global_quant_config"] = RUNGS[global_rung].spec()
    config["layer_quant_config"] = {key: RUNGS[rung].spec() for key, rung in layers.items()}
    config["layer_type_quant_config"] = {key: RUNGS[rung].spec() for key, rung in (by_type or {}).items()}
    return config


def rule_set(release: str) -> RuleSet:
    span = next(s for s in format_spans(KIND, "vllm") if s.covers(release))
    return RuleSet("vllm", span.first, span.last, {qv.KEY: span.values, "quark_fused": PACKED},
                   {f"{qv.KEY}.{k}": v for k, v in span.cites.items()}, release=release)


def _skip_unavailable(fn, *args):
    try:
        return fn(*args)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain vllm=={args[0]}: {exc}")


def same(release: str, config: dict, module: str, moe: bool) -> None:
    """``decide`` and the release's own code agree on ``module``: the spec matched, the class or the error."""
    kind = "moe" if moe else "linear"
    rules = rule_set(release)
    ours = qv.decide(module, moe=moe, draft=False, qconfig=copy.deepcopy(config), rules=rules)
    theirs = _skip_unavailable(build, release, config, module, kind, PACKED)
    where = f"vllm {release}, {module}: theirs {theirs}, ours {ours}"
    spec = _skip_unavailable(matched, release, config, module, kind, PACKED)
    if spec[0] == "config":
        assert ours.scheme == rung_of_spec(spec[1]), where + f" (matched {rung_of_spec(spec[1])})"
    if theirs[0] == "raises":
        assert ours.raises is not None and theirs[2].startswith(ours.raises), where
    else:
        assert theirs[0] == "scheme" and ours.raises is None and ours.scheme is not None, where
        table = rules.values[qv.KEY]["moe_built" if moe else "linear_built"]
        assert table[ours.scheme]["builds"] == theirs[1], where


LINEARS = ["model.layers.1.self_attn.o_proj", "model.layers.11.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj",
           "model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.down_proj", "model.layers.3.mlp.shared_experts.down_proj"]
MOES = ["model.layers.1.mlp.experts", "model.layers.11.mlp.experts", "model.layers.3.mlp.experts"]
CONFIGS = [
    qconfig({}),  # global only
    qconfig({}, "fp8"),
    qconfig({}, "mxfp4_fp8"),
    qconfig({"*.layers.1.*": "fp8"}),  # fnmatch: layer 1's modules, not layer 11's
    qconfig({"model.layers.1.mlp.experts.*": "fp8"}),  # matches the experts' projections, never the FusedMoE
    qconfig({"model.layers.1.mlp.experts*": "fp8"}),  # matches the FusedMoE
    qconfig({"model.layers.1.mlp.experts.0.gate_proj": "fp8"}),  # no '*': contains the FusedMoE's name
    qconfig({"model.layers.1.self_attn.o_proj": "mxfp4_fp8"}),  # exact, not layer 11 (1.self vs 11.self)
    qconfig({"model.layers.1.self_attn.o_proj_and_more": "fp8"}),  # containment, not equality
    qconfig({"model.layers.1": "fp8"}),  # a prefix contains no longer name
    qconfig({"*experts*": "fp8", "model.layers.1.*": "mxfp4_fp8"}),  # the first matching key wins
    qconfig({"model.layers.1.*": "mxfp4_fp8", "*experts*": "fp8"}),
    qconfig({"*.gate_proj": "fp8"}),  # one shard of gate_up_proj: the shards disagree
    qconfig({"*.gate_proj": "fp8", "*.up_proj": "fp8"}),
    qconfig({"*.q_proj": "fp8", "*.k_proj": "fp8", "*.v_proj": "mxfp4_fp8"}),
    qconfig({"*.q_proj": "mxfp4", "*.k_proj": "mxfp4"}),  # v_proj by the global: the same spec
    qconfig({"model.layers.3.*": "fp8"}),  # the MTP layer's modules by name
    qconfig({"*": "mxfp4_fp8"}),
    qconfig({"*": "fp8", "*experts": "mxfp4"}),
    qconfig({}, "mxfp4", {"RowParallelLinear": "fp8", "FusedMoE": "fp8", "RoutedExperts": "fp8"}),  # never matched
]


@pytest.mark.parametrize("release", WINDOW)
def test_linear_built_match_each_release(release):
    for config in CONFIGS:
        for module in LINEARS:
            same(release, config, module, moe=False)


@pytest.mark.parametrize("release", WINDOW)
def test_moe_built_match_each_release(release):
    for config in CONFIGS:
        for module in MOES:
            same(release, config, module, moe=True)


def test_rules_cover_the_window():
    from quant.engines.format_rules import unread
    assert unread(KIND, "vllm") == []


def test_a_spec_of_no_rung_is_not_judged():
    config = qconfig({})
    config["layer_quant_config"] = {"*": {**W4A4, "weight": {**W4A4["weight"], "dtype": "int8"}}}
    decision = qv.decide("model.layers.1.self_attn.o_proj", moe=False, draft=False, qconfig=config,
                         rules=rule_set("0.33.0"))
    assert decision.unread and decision.scheme is None


def test_w4a8_builds_from_0_18_for_linear_and_0_17_for_experts():
    config = qconfig({"*": "mxfp4_fp8"})
    linear = {r: qv.decide("model.layers.1.self_attn.o_proj", moe=False, draft=False, qconfig=config,
                           rules=rule_set(r)) for r in ("0.16.0", "0.17.1", "0.18.0", "0.33.0", "0.34.0")}
    assert [d.raises is None for d in linear.values()] == [False, False, True, True, True]
    moe = {r: qv.decide("model.layers.1.mlp.experts", moe=True, draft=True, qconfig=config, rules=rule_set(r))
           for r in ("0.16.0", "0.17.0", "0.33.0")}
    assert [d.raises is None for d in moe.values()] == [False, True, True]
    assert "MTP draft" in moe["0.33.0"].why and moe["0.33.0"].scheme == "mxfp4_fp8"
