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
from tests.quant.quark_vllm_wheel import ListMapper, WheelUnavailable, build, matched

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


def rule_set(release: str, mapper: dict | None = None) -> RuleSet:
    span = next(s for s in format_spans(KIND, "vllm") if s.covers(release))
    return RuleSet("vllm", span.first, span.last, {qv.KEY: span.values, "quark_fused": PACKED,
                                                   "exclude_mapper": mapper},
                   {f"{qv.KEY}.{k}": v for k, v in span.cites.items()}, release=release)


def _skip_unavailable(fn, *args):
    try:
        return fn(*args)
    except WheelUnavailable as exc:
        pytest.skip(f"cannot obtain vllm=={args[0]}: {exc}")


def same(release: str, config: dict, module: str, moe: bool, mapper: dict | None = None) -> None:
    """``decide`` and the release's own code agree on ``module``: the spec matched, the class or the error
    (``mapper``: the class's weight-name mapper, our ``exclude_mapper``)."""
    kind = "moe" if moe else "linear"
    rules = rule_set(release, mapper)
    wheel_mapper = ListMapper(**{k: mapper[k] for k in ("substr", "prefix", "suffix") if k in mapper}) \
        if mapper else None
    members = tuple(f"{module}.{e}.{leaf}" for e in range(2) for leaf in ("gate_proj", "up_proj", "down_proj")) \
        if moe else ()
    ours = qv.decide(module, moe=moe, draft=False, qconfig=copy.deepcopy(config), rules=rules, members=members)
    theirs = _skip_unavailable(build, release, config, module, kind, PACKED, wheel_mapper)
    where = f"vllm {release}, {module}: theirs {theirs}, ours {ours}"
    spec = _skip_unavailable(matched, release, config, module, kind, PACKED, wheel_mapper)
    if spec[0] == "config":
        assert ours.scheme == rung_of_spec(spec[1]), where + f" (matched {rung_of_spec(spec[1])})"
    if theirs[0] == "raises":
        assert ours.raises is not None and theirs[2].startswith(ours.raises), where
    else:
        assert theirs[0] == "scheme" and ours.raises is None and ours.scheme is not None, where
        table = rules.values[qv.KEY]["moe_built" if moe else "linear_built"]
        assert table[ours.scheme]["builds"] == theirs[1], where


LINEARS = ["model.layers.1.self_attn.o_proj", "model.layers.11.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj",
           "model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.down_proj",
           "model.layers.3.mlp.shared_experts.down_proj"]
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


# a multimodal class's mapper (its text model under language_model.), a mapper dropping layer 2's names
MAPPERS = [{"kinds": ["quark"], "style": "vllm", "prefix": {"model.": "language_model.model."}},
           {"kinds": ["quark"], "style": "vllm", "substr": {"layers.2.": None}}]
MAPPED = [qconfig({"model.layers.1.mlp.experts*": "fp8", "model.layers.1.self_attn.o_proj": "mxfp4_fp8"}),
          qconfig({"model.layers.2.mlp.experts*": "fp8", "*": "mxfp4_fp8"})]


@pytest.mark.parametrize("release", ["0.16.0", "0.29.0", "0.33.0", "0.34.0"])
def test_keys_renamed_by_the_class_mapper_match_each_release(release):
    for mapper in MAPPERS:
        prefix = "language_model.model." if "prefix" in mapper else "model."
        for config in MAPPED:
            for module in ("layers.1.self_attn.o_proj", "layers.2.self_attn.o_proj"):
                same(release, config, prefix + module, moe=False, mapper=mapper)
            for module in ("layers.1.mlp.experts", "layers.2.mlp.experts"):
                same(release, config, prefix + module, moe=True, mapper=mapper)


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


# ---- gate checkpoint on a mixed checkpoint (per-layer Quark config), vLLM's releases

def _rewrite(folder, edit) -> None:
    """Apply ``edit(tensors) -> changed`` to every shard, then the index as the shards now are."""
    import json

    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        if edit(tensors):
            save_file(tensors, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        loaded = {s.name: load_file(s) for s in sorted(folder.glob("*.safetensors"))}
        data["weight_map"] = {n: s for s, ts in loaded.items() for n in ts}
        data["metadata"]["total_size"] = sum(t.numel() * t.element_size() for ts in loaded.values()
                                             for t in ts.values())
        index.write_text(json.dumps(data))


def _set_layer_config(folder, layers: dict) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"] = {k: RUNGS[r].spec() for k, r in layers.items()}
    (folder / "config.json").write_text(json.dumps(config))


def _mixed(tensors) -> bool:
    """Layer 1's routed experts W8A8 (FP8 weights, one F32 weight_scale, a static input_scale), layer 2's W4A8
    (their MXFP4 tensors and an input_scale): the tensors each rung stores (quant.rungs)."""
    import torch

    changed = False
    for name in [n for n in tensors if ".mlp.experts." in n and n.endswith(".weight")]:
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.1."):
            rows, packed = tensors[name].shape
            tensors[name] = torch.zeros(rows, packed * 2, dtype=torch.float8_e4m3fn)
            tensors[module + ".weight_scale"] = torch.tensor(1.0)
            tensors[module + ".input_scale"] = torch.tensor(0.01)
            changed = True
        elif name.startswith("model.layers.2."):
            tensors[module + ".input_scale"] = torch.tensor(0.01)
            changed = True
    return changed


MIXED_KEYS = {"model.layers.1.mlp.experts*": "fp8", "model.layers.2.mlp.experts*": "mxfp4_fp8"}


@pytest.fixture(scope="module")
def mixed(glm_ckpt, tmp_path_factory):
    """quantize's default output (routed experts MXFP4 W4A4) with layer 1's experts W8A8 and layer 2's W4A8."""
    from quant.convert import convert
    from quant.plan import make_plan
    from quant.recipe import load_recipe

    dst = tmp_path_factory.mktemp("mixed") / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), dst, show_progress=False)
    _rewrite(dst, _mixed)
    _set_layer_config(dst, MIXED_KEYS)
    return dst


def _gate(capsys, folder, engine: str) -> tuple[int, dict]:
    import json

    from evals.cli import main as gate

    code = gate(["checkpoint", str(folder), "--engine", engine, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _problems(report: dict) -> list[str]:
    return [f"[{f['check']}] {f['module']}: {f['why']}" for r in report["engines"].values() for f in r["findings"]]


def test_mixed_checkpoint_loads_in_vllm_0_33_and_0_34(mixed, capsys):
    for release in ("0.33.0", "0.34.0", "0.18.0"):
        code, report = _gate(capsys, mixed, f"vllm=={release}")
        assert code == 0 and report["ok"], _problems(report)


def test_w4a8_experts_are_flagged_where_vllm_raises(mixed, capsys):
    code, report = _gate(capsys, mixed, "vllm==0.16.0")
    problems = _problems(report)
    assert code == 1 and len(problems) == 1, problems
    assert "model.layers.2.mlp.experts" in problems[0] and "Unsupported FusedMoe scheme" in problems[0]


def test_an_expert_key_vllm_never_asks_is_named(mixed, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(mixed, tmp_path / "star")
    _set_layer_config(folder, {"model.layers.1.mlp.experts.*": "fp8", "model.layers.2.mlp.experts*": "mxfp4_fp8"})
    code, report = _gate(capsys, folder, "vllm==0.33.0")
    problems = _problems(report)
    assert code == 1, problems
    assert any("[config] layer_quant_config['model.layers.1.mlp.experts.*']: matches no module" in p for p in problems)
    assert any("fp8 on disk, but vllm builds this FusedMoE as mxfp4" in p for p in problems), problems


def test_an_exact_expert_key_selects_the_whole_fused_moe(mixed, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(mixed, tmp_path / "exact")
    _set_layer_config(folder, {"model.layers.1.mlp.experts.0.gate_proj": "fp8",
                               "model.layers.2.mlp.experts*": "mxfp4_fp8"})
    code, report = _gate(capsys, folder, "vllm==0.33.0")
    assert code == 0, _problems(report)


def test_rung_tensors_are_layout_checked(mixed, tmp_path, capsys):
    import shutil

    import torch

    expert = "model.layers.1.mlp.experts.0.gate_proj"

    def edited(name, edit):
        folder = shutil.copytree(mixed, tmp_path / name)
        _rewrite(folder, edit)
        return _gate(capsys, folder, "vllm==0.33.0")

    def one_element(tensors):  # [1] instead of []: one value all the same
        if expert + ".input_scale" in tensors:
            tensors[expert + ".input_scale"] = torch.ones(1)
            tensors[expert + ".weight_scale"] = torch.ones(1)
            return True
        return False

    code, report = edited("one", one_element)
    assert code == 0, _problems(report)

    def vector(tensors):
        if expert + ".input_scale" in tensors:
            tensors[expert + ".input_scale"] = torch.ones(4)
            return True
        return False

    code, report = edited("vector", vector)
    assert code == 1 and any(f"[layout] {expert}.input_scale: F32[4]: a per-tensor scale" in p
                             for p in _problems(report)), _problems(report)

    def dropped(tensors):
        return tensors.pop(expert + ".input_scale", None) is not None

    code, report = edited("dropped", dropped)
    assert code == 1 and any(f"[layout] {expert}: holds .weight F8_E4M3, .weight_scale F32: no rung's" in p
                             for p in _problems(report)), _problems(report)


MTP_AND_ATTENTION = """\
name: mtp-w4a8-attention-fp8
format: mxfp4
rules:
  - {role: routed_expert, layers: [3], action: quantize, format: mxfp4_fp8}
  - {role: attention, layers: [1], action: quantize, format: fp8}
  - {role: routed_expert, action: quantize}
"""


def test_converted_mixed_checkpoint_with_draft_aliases_loads(glm_ckpt, tmp_path):
    """quantize's own mixed output (real processes): the MTP layer's experts W4A8 under both its name and
    sglang's draft alias (model.decoder.mlp.experts*, a key vLLM never asks and is not faulted for), layer 1's
    attention W8A8 (its fused_qkv_a_proj's shards one spec): vLLM 0.33.0 and 0.34.0 load it."""
    import json
    import subprocess
    import sys

    from tests.quant.test_mixed_convert import write_sidecar

    weights = json.loads((glm_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    sidecar = write_sidecar(tmp_path / "sensitivity.json", sorted(n[:-7] for n in weights if n.endswith(".weight")))
    (tmp_path / "recipe.yaml").write_text(MTP_AND_ATTENTION)
    dst = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", "--recipe",
                           tmp_path / "recipe.yaml", "--sensitivity", sidecar, glm_ckpt, dst],
                          capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    keys = json.loads((dst / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    assert "model.decoder.mlp.experts*" in keys and "model.layers.3.mlp.experts*" in keys
    for release in ("0.33.0", "0.34.0"):
        gate = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", dst, "--engine", f"vllm=={release}",
                               "--json"], capture_output=True, text=True, timeout=300, check=False)
        report = json.loads(gate.stdout)
        assert gate.returncode == 0 and report["ok"], _problems(report)
