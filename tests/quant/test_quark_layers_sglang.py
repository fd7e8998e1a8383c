"""sglang's per-layer Quark schemes (``manifests/engines/quark_layers.sglang.yaml``, replayed by
``quant.engines.quark_layers_sglang``) against each release's own code.

The differential tests run a release's ``QuarkConfig.get_quant_method`` and ``can_fuse_shared_expert`` from its
wheel (``tests/quant/sglang_quark_source.py``) on a grid of per-layer configs (the ladder's rungs W4A4, W4A8,
W8A8 and specs no rung is: block FP8, dynamic FP8, MXFP4 without e8m0 scales, quantized outputs; keys as the
ladder writes them, ``...experts*``, and as a reader might: ``...experts.*``, one key per expert and projection,
agreeing or not, skipping experts, pinning other projections; fused shards that disagree; layer types; keys
the class's weight-name mapper renames) and engine modules (attention and MLP Linears, fused and not, the router,
FusedMoEs, a shared expert, the MTP draft's block), beside ``decide`` under the rule span covering the release:
the rung built (or none) and whether it raises agree on every cell. By default each rule span's first and last
release; ``QUANTGATE_WINDOW=all`` runs every release of the window.
"""

from __future__ import annotations

import os

import pytest

from quant.engines.format_rules import format_spans
from quant.engines.quark_layers_sglang import KEY, SCHEMES, DraftKeys, decide, linear_class, shared_fusion_reason
from quant.engines.rules import RuleSet, window
from quant.rungs import RUNGS, fp8_tensor_spec
from tests.quant.engine_sources import WheelUnavailable

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
MAPPER = {"style": "sglang", "substr": {"model.language_model.": "model."}}  # a VL class's text layers
DRAFT_MAPPER = {"style": "sglang", "substr": {"model.layers.2": "model.decoder"}}  # the NextN class's
EXPERTS = 4
LEAVES = ("gate_proj", "up_proj", "down_proj")

W4A4, W4A8, W8A8 = (RUNGS[r].spec() for r in ("mxfp4", "mxfp4_fp8", "fp8"))
_DYNAMIC_FP8 = {**fp8_tensor_spec(), "is_dynamic": True, "qscheme": "per_token"}
SPECS = {
    "w4a4": W4A4, "w4a8": W4A8, "w8a8": W8A8,
    "w8a8_channel_dynamic": {**W8A8, "weight": {**W8A8["weight"], "qscheme": "per_channel"},
                             "input_tensors": _DYNAMIC_FP8},
    "block_fp8": {**W8A8, "weight": {**W8A8["weight"], "qscheme": "per_block", "block_size": [128, 128]},
                  "input_tensors": {**fp8_tensor_spec(), "is_dynamic": True, "qscheme": "per_group"}},
    "w4a8_dynamic": {**W4A8, "input_tensors": _DYNAMIC_FP8},
    "w4a4_no_e8m0": {**W4A4, "weight": {**W4A4["weight"], "scale_format": None}},
    "w8a8_outputs": {**W8A8, "output_tensors": fp8_tensor_spec()},
    "w4a8_fn": {**W4A8, "input_tensors": {**W4A8["input_tensors"], "dtype": "fp8_e4m3fn"}},
    "w4a4_static": {**W4A4, "input_tensors": {**W4A4["input_tensors"], "is_dynamic": False}},
    "w4a8_dynamic_tensor": {**W4A8, "input_tensors": {**W4A8["input_tensors"], "is_dynamic": True}},
}
_BLOCK = SPECS["block_fp8"]
SPECS.update({
    "block_fp8_no_size": {**_BLOCK, "weight": {**_BLOCK["weight"], "block_size": None}},
    "block_fp8_outputs": {**_BLOCK, "output_tensors": fp8_tensor_spec()},
})

# (module, sglang class) as get_quant_method is asked
MODULES = [("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
           ("model.layers.0.self_attn.o_proj", "RowParallelLinear"),
           ("model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear"),
           ("model.layers.0.mlp.down_proj", "RowParallelLinear"),
           ("model.layers.1.mlp.gate", "ReplicatedLinear"),
           ("model.layers.1.mlp.experts", "FusedMoE"), ("model.layers.0.mlp.experts", "FusedMoE"),
           ("model.layers.1.mlp.shared_expert.gate_up_proj", "MergedColumnParallelLinear"),
           ("model.decoder.mlp.experts", "FusedMoE"), ("model.decoder.self_attn.o_proj", "RowParallelLinear")]


def _quark(layers: dict, glob: dict = W4A4, types: dict | None = None) -> dict:
    return {"quant_method": "quark", "global_quant_config": glob, "layer_quant_config": layers,
            "layer_type_quant_config": types or {}, "exclude": ["lm_head"],
            "export": {"kv_cache_group": [], "pack_method": "reorder"}}


def _per_expert(layer: int, spec_of, experts=range(EXPERTS), leaves=LEAVES, prefix="model.layers") -> dict:
    return {f"{prefix}.{layer}.mlp.experts.{e}.{leaf}": spec_of(e) for e in experts for leaf in leaves}


def _configs():
    """(id, quantization_config, whether the class's weight-name mapper is MAPPER) of the grid."""
    for name, spec in SPECS.items():
        yield f"experts*/{name}", _quark({"model.layers.1.mlp.experts*": spec}), False
        yield f"experts.*/{name}", _quark({"model.layers.1.mlp.experts.*": spec}), False
        yield f"attention/{name}", _quark({"*self_attn*": spec}), False
        yield f"global/{name}", _quark({"model.layers.1.mlp.experts*": W4A4}, glob=spec), False
        yield f"per_expert/{name}", _quark(_per_expert(1, lambda e, s=spec: s)), False
        types = {"FusedMoE": spec, "RowParallelLinear": spec}
        yield f"type/{name}", _quark({"*self_attn.o_proj": W4A4}, types=types), False
    yield "per_expert_mixed", _quark(_per_expert(1, lambda e: W8A8 if e == 0 else W4A4)), False
    yield "per_expert_gap", _quark(_per_expert(1, lambda e: W8A8, experts=(0, 2))), False
    yield "per_expert_from_1", _quark(_per_expert(1, lambda e: W8A8, experts=(1, 2))), False
    differ = {**_per_expert(1, lambda e: W8A8, experts=(0,)), **_per_expert(1, lambda e: W8A8, experts=(1,),
                                                                          leaves=LEAVES[:1])}
    yield "per_expert_projections_differ", _quark(differ), False
    yield "per_expert_bad_suffix", _quark({"model.layers.1.mlp.experts.w1": W8A8}), False
    yield "per_expert_and_pattern", _quark({"*mlp.experts": W4A8, **_per_expert(1, lambda e: W8A8)}), False
    yield "per_expert_one_projection", _quark(_per_expert(1, lambda e: W8A8, leaves=("down_proj",))), False
    yield "shards_differ", _quark({"model.layers.0.self_attn.q_proj": W8A8}), False
    yield "shards_agree", _quark({"model.layers.0.self_attn.[qkv]_proj": W8A8}), False
    yield "shared_expert", _quark({"*shared_expert*": W8A8}), False
    yield "shared_experts", _quark({"*mlp.shared_experts.*": W8A8}), False
    yield "shared_down_fp8", _quark({"*shared_expert.down_proj": W8A8}), False
    yield "linear_dot_star", _quark({"model.layers.0.self_attn.o_proj.*": W8A8}), False
    yield "shards_lists_reordered", _quark({  # deep_compare reads lists as sets
        "*q_proj": {**_BLOCK, "weight": {**_BLOCK["weight"], "block_size": [128, 64]}},
        "*[kv]_proj": {**_BLOCK, "weight": {**_BLOCK["weight"], "block_size": [64, 128]}}}), False
    yield "type_only", _quark({}, types={"FusedMoE": W8A8}), False
    yield "layer0_per_expert_mixed", _quark(_per_expert(0, lambda e: W8A8 if e == 0 else W4A4)), False
    yield "layer0_experts_fp8", _quark({"model.layers.0.mlp.experts*": W8A8}), False
    yield "mapped_keys", _quark({"model.language_model.layers.1.mlp.experts*": W8A8,
                                 "model.language_model.layers.0.self_attn*": W8A8}), True
    yield "mapped_per_expert", _quark(_per_expert(1, lambda e: W8A8, prefix="model.language_model.layers")), True
    yield "draft_layer", _quark({"model.layers.2.mlp.experts*": W8A8, "model.layers.2.self_attn*": W8A8}), False
    yield "draft_per_expert", _quark(_per_expert(2, lambda e: W8A8)), False
    yield "draft_decoder_key", _quark({"model.decoder.mlp.experts*": W8A8}), False


def _releases() -> list[tuple[object, str]]:
    every = os.environ.get("QUANTGATE_WINDOW") == "all"
    spans = format_spans("quark-layers", "sglang")
    return [(span, v) for span in spans for v in window("sglang") if span.covers(v)
            and (every or v in (span.first, span.last) or v == [r for r in window("sglang") if span.covers(r)][-1])]


def _rules(span, mapper: dict | None) -> RuleSet:
    return RuleSet("sglang", span.first, span.last, {KEY: span.values, "quark_fused": PACKED, "exclude_mapper": mapper},
                   {f"{KEY}.{rule}": cite for rule, cite in span.cites.items()})


@pytest.fixture(scope="module")
def sglang_releases():
    from tests.quant.sglang_quark_source import Release

    out = []
    for span, version in _releases():
        try:
            out.append((span, Release(version)))
        except WheelUnavailable as exc:
            pytest.skip(f"cannot obtain sglang=={version} from the registry: {exc}")
    return out


def _theirs(built) -> tuple[str, str | None]:
    return ("raises", None) if built.raises else ("builds", SCHEMES[built.scheme].label if built.scheme else None)


def test_decide_matches_each_release(sglang_releases):
    """Every config of the grid, every module: decide builds the rung the release builds, or raises where it does."""
    from tests.quant.sglang_quark_source import Mapper

    wrong, cells = [], 0
    for span, release in sglang_releases:
        for cid, qconfig, mapped in _configs():
            rules = _rules(span, MAPPER if mapped else None)
            for module, cls in MODULES:
                draft = module.startswith("model.decoder.")
                mapper = DRAFT_MAPPER if draft else MAPPER if mapped else None
                built = release.build(qconfig, PACKED, module, cls, Mapper(mapper["substr"]) if mapper else None)
                decision = decide(module, moe=cls == "FusedMoE", draft=draft, qconfig=qconfig, rules=rules,
                                  draft_keys=DraftKeys(DRAFT_MAPPER))
                ours = ("raises", None) if decision.raises else ("builds", decision.scheme)
                cells += 1
                if ours != _theirs(built):
                    wrong.append(f"{release.version} {cid} {module}: sglang {_theirs(built)} {built}, decide {ours} "
                                 f"({decision.why})")
    assert cells > 1000
    assert not wrong, f"{len(wrong)} cells differ:\n" + "\n".join(wrong[:40])


def test_shared_fusion_matches_each_release(sglang_releases):
    """can_fuse_shared_expert's spec comparison: fusion refused where the release refuses it."""
    wrong = []
    for span, release in sglang_releases:
        rules = _rules(span, None)
        for cid, qconfig, mapped in _configs():
            theirs = release.can_fuse(qconfig, PACKED)
            ours = shared_fusion_reason(qconfig, rules)
            if (theirs is not False) != (ours is None):
                wrong.append(f"{release.version} {cid}: sglang can_fuse {theirs}, ours {ours!r}")
    assert not wrong, "\n".join(wrong[:40])


def test_spans_cover_the_window_and_name_their_functions():
    """Each window release in one span; every rule stated from the first span on and cited to quark.py."""
    spans = format_spans("quark-layers", "sglang")
    assert [v for v in window("sglang") if sum(s.covers(v) for s in spans) != 1] == []
    assert set(spans[0].values) == set(spans[-1].values)
    for rule, cite in spans[-1].cites.items():
        assert cite.startswith("sglang/srt/layers/quantization/quark/quark.py: QuarkConfig."), rule


@pytest.mark.parametrize("release, moe_w4a8", [("0.5.14", False), ("0.5.15", True), ("0.5.23", True)])
def test_w4a8_builds_experts_from_0_5_15_and_never_a_linear(release, moe_w4a8):
    """QuarkW4A8MXFp4MoE from 0.5.15; a W4A8 Linear raises in every release (no Linear scheme takes it)."""
    span = next(s for s in format_spans("quark-layers", "sglang") if s.covers(release))
    rules = _rules(span, None)
    qconfig = _quark({"*mlp.experts*": W4A8, "*self_attn*": W4A8})
    experts = decide("model.layers.1.mlp.experts", moe=True, draft=False, qconfig=qconfig, rules=rules)
    assert (experts.scheme, experts.raises is None) == (("mxfp4_fp8", True) if moe_w4a8 else (None, False)), experts
    attention = decide("model.layers.0.self_attn.o_proj", moe=False, draft=False, qconfig=qconfig, rules=rules)
    assert attention.raises and "No quark compatible scheme" in attention.raises, attention


@pytest.mark.parametrize("release, raises", [("0.5.20", False), ("0.5.21", True)])
def test_experts_of_one_layer_with_two_specs_raise_from_0_5_21(release, raises):
    """Per-expert keys: before 0.5.21 they match nothing (the FusedMoE takes the global W4A4); from 0.5.21 they
    resolve it, and two specs among one layer's experts raise."""
    span = next(s for s in format_spans("quark-layers", "sglang") if s.covers(release))
    qconfig = _quark(_per_expert(1, lambda e: W8A8 if e == 0 else W4A4))
    decision = decide("model.layers.1.mlp.experts", moe=True, draft=False, qconfig=qconfig, rules=_rules(span, None))
    if raises:
        assert "different quantization configurations among the experts" in decision.raises, decision
    else:
        assert (decision.scheme, decision.raises) == ("mxfp4", None), decision


def test_linear_class_names_are_sglangs():
    assert [linear_class(m) for m, _ in MODULES[:5]] == [c for _, c in MODULES[:5]]


def _with_layer_specs(src, dst, layer_quant_config: dict, input_scaled: str):
    """A copy of the MXFP4 checkpoint ``src`` whose config gives modules their own specs, the modules starting
    with ``input_scaled`` stored W4A8 (their MXFP4 tensors and a static FP8 input scale)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from quant.rungs import INPUT_SCALE

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    weights = index["weight_map"]
    by_file: dict = {}
    for name, file in list(weights.items()):
        if name.startswith(input_scaled) and name.endswith(".weight_scale"):
            by_file.setdefault(file, []).append(name[:-len(".weight_scale")])
    for file, modules in by_file.items():
        tensors = load_file(str(dst / file))
        for module in modules:
            tensors[module + INPUT_SCALE] = torch.tensor([0.01], dtype=torch.float32)
            weights[module + INPUT_SCALE] = file
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(t.nbytes for file in set(weights.values())
                                          for t in load_file(str(dst / file)).values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"] = layer_quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def mixed_checkpoints(glm_ckpt, tmp_path_factory):
    import subprocess
    import sys

    from quant.layout import manifests_root

    root = tmp_path_factory.mktemp("quark_layers_sglang")
    recipe = manifests_root() / "recipes" / "mxfp4-all-linear.yaml"  # every decoder Linear W4A4
    done = subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", "--recipe", str(recipe),
                           str(glm_ckpt), str(root / "mx")], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    experts = "model.layers.1.mlp.experts."
    return {
        "layer key": _with_layer_specs(root / "mx", root / "layer", {"model.layers.1.mlp.experts*": W4A8}, experts),
        "per expert": _with_layer_specs(root / "mx", root / "per_expert", _per_expert(1, lambda e: W4A8), experts),
        "experts disagree": _with_layer_specs(root / "mx", root / "disagree",
                                              _per_expert(1, lambda e: W8A8 if e == 0 else W4A8), experts),
        "attention": _with_layer_specs(root / "mx", root / "attention", {"model.layers.1.self_attn.o_proj": W4A8},
                                       "model.layers.1.self_attn.o_proj"),
    }


@pytest.mark.parametrize("checkpoint, release, said", [
    ("layer key", "0.5.14", "Unsupported FusedMoe scheme"), ("layer key", "0.5.15", None),
    ("layer key", "0.5.23", None),
    ("per expert", "0.5.20", "builds this FusedMoE as mxfp4"), ("per expert", "0.5.21", None),
    ("experts disagree", "0.5.23", "different quantization configurations among the experts"),
    ("attention", "0.5.23", "No quark compatible scheme was found"),
])
def test_gate_checkpoint_replays_each_release(mixed_checkpoints, release, checkpoint, said):
    """gate checkpoint in a real process on an all-Linear W4A4 conversion given per-layer W4A8 specs: layer 1's experts
    load from 0.5.15 (asked by a ...experts* key) or 0.5.21 (one key per expert); experts of one layer with two
    specs, and a W4A8 Linear, raise."""
    from tests.quant.test_compressed_tensors_engines import gate

    code, out = gate(mixed_checkpoints[checkpoint], "--engine", f"sglang=={release}")
    if said is None:
        assert code == 0, out
    else:
        assert code == 1 and said in out, out


def _quantize(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "quant.cli", "--to", "mxfp4", "-q", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_a_hand_written_mixed_recipe_converts_and_loads(glm_ckpt, tmp_path):
    """One layer's experts FP8, the rest MXFP4 (quantize in a real process, the releases' rules cut where the
    per-layer rules change): gate checkpoint says sglang's oldest and newest releases load it."""
    from tests.quant.test_compressed_tensors_engines import gate
    from tests.quant.test_mixed_convert import LAYER1_FP8, linear_modules, write_sidecar

    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(LAYER1_FP8)
    sidecar = write_sidecar(tmp_path / "sensitivity.json", linear_modules(glm_ckpt))
    done = _quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    for release in ("0.5.9", "0.5.23"):
        code, out = gate(tmp_path / "out", "--engine", f"sglang=={release}")
        assert code == 0 and "loads correctly" in out, out


def test_quantize_serve_refuses_w4a8_experts_for_a_release_without_the_scheme(glm_ckpt, tmp_path):
    """quantize --serve sglang==0.5.14 replays that release's per-layer rules: no W4A8 MoE scheme, refused in one
    line (exit 2, nothing written); 0.5.15 builds it."""
    from tests.quant.test_mixed_convert import linear_modules, write_sidecar

    recipe = tmp_path / "w4a8.yaml"
    recipe.write_text("name: w4a8\nformat: mxfp4\nrules:\n  - {role: routed_expert, layers: [1], action: quantize, "
                      "format: mxfp4_fp8}\n  - {role: routed_expert, action: quantize}\n")
    sidecar = write_sidecar(tmp_path / "sensitivity.json", linear_modules(glm_ckpt))
    refused = _quantize("--recipe", recipe, "--sensitivity", sidecar, "--serve", "sglang==0.5.14", glm_ckpt,
                        tmp_path / "old")
    assert refused.returncode == 2 and "Unsupported FusedMoe scheme" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "old").exists()
    done = _quantize("--recipe", recipe, "--sensitivity", sidecar, "--serve", "sglang==0.5.15", glm_ckpt,
                     tmp_path / "new")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("release", ["0.5.16", "0.5.23"])
def test_glm_draft_renames_its_layers_keys_as_the_release_does(release):
    """GlmMoeDsaForCausalLMNextN._resolve_nextn_quant_config's renaming (its own _map_mtp_ckpt_name, run from the
    wheel) beside the replay's: keys under model.layers.{N} name the draft's model.decoder / model.* modules."""
    from quant.engines.quark_layers_sglang import _glm_remapped
    from tests.quant.engine_sources import methods, wheel

    glm = methods(wheel("sglang", release), "sglang/srt/models/glm4_moe.py", "GlmMoeDsaForCausalLMNextN",
                  ["_map_mtp_ckpt_name", "_NEXTN_SPEC_WEIGHT_NAMES"])["cls"]
    keys = ["model.layers.3.mlp.experts*", "model.layers.3.self_attn.o_proj", "model.layers.3.eh_proj",
            "model.layers.3.shared_head.norm", "model.layers.30.mlp.experts*", "model.layers.1.mlp.experts*"]
    theirs = [glm._map_mtp_ckpt_name(k, "model.layers.3") if k.startswith("model.layers.3.") else k for k in keys]
    assert [_glm_remapped(k, "model.layers.3") for k in keys] == theirs


def test_the_draft_asks_the_keys_its_class_renames():
    """The GLM draft (glm_remap from 0.5.16) finds its layer's key under model.decoder in every release; the
    DeepSeek-V3 draft's mapper renames only model.layers.61 (a 4-layer model's draft layer keeps the global spec),
    and only from 0.5.21, when the keys are mapped."""
    from quant.engines.quark_layers_sglang import draft_keys

    for release, family, layers, built in [("0.5.16", "glm_moe_dsa", 3, "fp8"), ("0.5.23", "glm_moe_dsa", 3, "fp8"),
                                           ("0.5.15", "glm_moe_dsa", 3, "mxfp4"),
                                           ("0.5.20", "deepseek_v3", 61, "mxfp4"), ("0.5.21", "deepseek_v3", 61, "fp8"),
                                           ("0.5.23", "deepseek_v3", 3, "mxfp4")]:
        span = next(s for s in format_spans("quark-layers", "sglang") if s.covers(release))
        rules = _rules(span, None)
        how = {"glm_moe_dsa": "glm_remap" if release >= "0.5.16" else "mapper_61", "deepseek_v3": "mapper_61"}
        rules = RuleSet(rules.engine, rules.first, rules.last, {**rules.values, "draft_exclude": how}, rules.cites)
        qconfig = _quark({f"model.layers.{layers}.mlp.experts*": W8A8})  # the draft layer's experts W8A8
        decision = decide("model.decoder.mlp.experts", moe=True, draft=True, qconfig=qconfig, rules=rules,
                          draft_keys=draft_keys(rules, family, layers))
        assert decision.scheme == built, (release, family, decision)


def test_a_draft_key_without_its_model_decoder_alias_loads_where_the_glm_draft_renames_it(glm_ckpt, tmp_path):
    """The MTP layer's experts at W8A8, converted (quantize writes the key and its model.decoder.* alias), then the
    alias dropped: gate checkpoint in a real process flags sglang 0.5.15 (the draft asks model.decoder.mlp.experts,
    which no key names: the global W4A4) and loads in 0.5.16 (GLM's draft renames model.layers.3.* itself)."""
    import json

    from tests.quant.test_compressed_tensors_engines import gate
    from tests.quant.test_mixed_convert import linear_modules, write_sidecar

    recipe = tmp_path / "mtp.yaml"
    recipe.write_text("name: mtp\nformat: mxfp4\nrules:\n  - {role: routed_expert, layers: [3], action: quantize, "
                      "format: fp8}\n  - {role: routed_expert, action: quantize}\n")
    sidecar = write_sidecar(tmp_path / "sensitivity.json", linear_modules(glm_ckpt))
    out = tmp_path / "out"
    done = _quantize("--recipe", recipe, "--sensitivity", sidecar, glm_ckpt, out)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    keys = config["quantization_config"]["layer_quant_config"]
    assert set(keys) == {"model.layers.3.mlp.experts*", "model.decoder.mlp.experts*"}
    del keys["model.decoder.mlp.experts*"]
    (out / "config.json").write_text(json.dumps(config))
    code, said = gate(out, "--engine", "sglang==0.5.15")
    assert code == 1 and "model.decoder.mlp.experts" in said and "builds this FusedMoE as mxfp4" in said, said
    code, said = gate(out, "--engine", "sglang==0.5.16")
    assert code == 0, said
