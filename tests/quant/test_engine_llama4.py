"""Differential tests for Llama-4 (``llama4``, Llama4ForConditionalGeneration): each release read
(``manifests/families/llama4/{sglang,vllm}.yaml``) decides with its own code beside ``quant.engines``:
Quark's ``should_ignore_layer`` and FP8's ``is_layer_skipped`` on the checkpoint's module names (text
model under language_model.model.layers, vision tower, projector) fed the packed-modules mapping read
from the same wheel; the MoE layer selection (sglang ``Llama4DecoderLayer._is_moe_layer``, vLLM's
``is_moe_layer`` expression) on generated configs; which modules are built with the quant config, read
from the constructors; and the loaders' own expert name mapping run on the converter's per-expert output
(sglang ``Llama4ForConditionalGeneration.load_weights``, vLLM ``Llama4Model.load_moe_expert_weights``).
"""

from __future__ import annotations

import ast
import random
import types
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file

from quant.cli import main as quantize
from quant.engines import ENGINES, Module, ReplayContext, replay, rule_sets
from quant.engines.config import moe_layers_built
from quant.engines.rules import releases_read, select, window
from quant.formats.codecs import get_codec
from quant.formats.constants import ScaleRule
from tests.quant.engine_sources import (
    attribute_builds,
    class_constant,
    class_def,
    method_def,
    methods,
    packed_mapping,
    source,
)
from tests.quant.family_checkpoints import write_family_checkpoint
from tests.quant.test_engine_sources import (
    engine_wheel,
    fp8_disagreements,
    _fp8_engine,
    quark_disagreements,
    _quark_engine,
)

TOP = {"sglang": "sglang/srt/models/mllama4.py", "vllm": "vllm/model_executor/models/mllama4.py"}
TEXT = {"sglang": "sglang/srt/models/llama4.py", "vllm": "vllm/model_executor/models/llama4.py"}
CLASS = "Llama4ForConditionalGeneration"
CASES = [(r, v) for e in ENGINES for r in rule_sets(e, "llama4")
         for v in sorted(releases_read(e, "llama4"), key=Version) if r.covers(releases_read(e, "llama4")[v])]
IDS = [f"{r.engine} {v}" for r, v in CASES]


def wheel_mapping(whl, engine: str, kind: str) -> dict[str, list[str]]:
    """The packed_modules_mapping the quant config holds once the model is built. sglang: the top
    class's literal (the loader reads the architecture's class), plus the loader's Quark additions;
    vLLM: Llama4ForCausalLM's literal, which SupportsQuant puts on the config (update)."""
    if engine == "sglang":
        return packed_mapping(whl, TOP["sglang"], CLASS, engine, kind)
    return packed_mapping(whl, TEXT["vllm"], "Llama4ForCausalLM", engine, kind)


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_packed_mapping_is_the_one_the_wheel_leaves(rules, release):
    whl = engine_wheel(rules, release)
    assert wheel_mapping(whl, rules.engine, "quark") == rules["quark_fused"]
    assert wheel_mapping(whl, rules.engine, "fp8") == rules["fp8_skip"]["fused"]
    if rules.engine == "sglang":  # the text model (a LlamaForCausalLM) does not replace it
        for path in (TEXT["sglang"], "sglang/srt/models/llama.py"):
            assert "update_packed_modules_mapping" not in source(whl, path)
    else:
        # the top class has the same dict (configure_quant_config), and neither class renames the
        # exclude list: LlamaForCausalLM's mapper has stacked names only, which get_rename_mapper drops
        assert class_constant(class_def(whl, TOP["vllm"], CLASS), "packed_modules_mapping") == rules["quark_fused"]
        assert "hf_to_vllm_mapper" not in source(whl, TOP["vllm"]) + source(whl, TEXT["vllm"])
        llama = class_def(whl, "vllm/model_executor/models/llama.py", "LlamaModel")
        mapper = next((s for s in llama.body
                       if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "hf_to_vllm_mapper"),
                      None)  # none before 0.25.0: nothing renames the exclude list either
        if mapper is not None:
            assert [k.arg for k in mapper.value.keywords] == ["orig_to_new_stacked"]
            assert "orig_to_new_stacked={}" in source(whl, "vllm/model_executor/models/utils.py")


LAYERS = ["language_model.model.layers.0.", "language_model.model.layers.1."]
LEAVES = ["self_attn.qkv_proj", "self_attn.o_proj", "feed_forward.gate_up_proj", "feed_forward.down_proj",
          "feed_forward.shared_expert.gate_up_proj", "feed_forward.shared_expert.down_proj", "feed_forward.experts",
          "feed_forward.router"]
SHARDS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "feed_forward.gate_proj", "feed_forward.up_proj",
          "feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj", "feed_forward.experts.0.gate_proj",
          "feed_forward.experts.3.down_proj"]
VISION = ["vision_model.model.layers.0.mlp.fc1", "vision_model.model.layers.0.mlp.fc2",
          "vision_model.model.layers.0.self_attn.qkv_proj", "vision_model.model.layers.0.self_attn.o_proj",
          "vision_model.patch_embedding.linear", "vision_model.vision_adapter.mlp.fc1", "vision_model.vision_adapter.mlp.fc2",
          "multi_modal_projector.linear_1"]
MODULES = [p + m for p in LAYERS for m in LEAVES] + VISION
ENTRIES = [p + m for p in LAYERS for m in LEAVES + SHARDS] + VISION + \
    ["vision_model.model.layers.0.self_attn.q_proj", "re:.*vision_model.*", "re:.*shared_expert.*", "re:.*experts.*",
     "re:.*self_attn.*", "language_model.lm_head", "feed_forward.router"]


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quark_exclude_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _quark_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "quark")
    rng = random.Random(f"llama4{rules.id}{release}")
    disagree, seen = quark_disagreements(engine, rules, fused, MODULES, ENTRIES, rng, draws=200, most=20, names=5)
    assert not disagree, disagree[:3]
    assert seen > 30


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fp8_skip_decisions_equal_the_engines(rules, release):
    whl = engine_wheel(rules, release)
    engine = _fp8_engine(rules, whl)
    fused = wheel_mapping(whl, rules.engine, "fp8")
    entries = [e for e in ENTRIES if not e.startswith("re:")] + [e.removeprefix("language_model.") for e in ENTRIES[:12]]
    rng = random.Random(f"llama4-fp8{rules.id}{release}")
    skip = rules["fp8_skip"]
    disagree, seen = fp8_disagreements(engine, skip, fused, MODULES, entries, rng, draws=150, most=14, names=4)
    assert not disagree, disagree[:3]
    assert seen > 20


def _quant_config_of(fn: ast.FunctionDef, attr: str) -> str | None:
    """The quant_config keyword ``self.<attr> = Call(...)`` is built with in ``fn`` (None: not passed)."""
    builds = attribute_builds(fn, attr)
    assert builds, attr
    return builds[0].keywords.get("quant_config")


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_which_modules_get_the_quant_config_is_the_constructors(rules, release):
    """The router, the vision attention, the vision MLPs and the projector: built without a quant
    config exactly where the rules list their role as unquantized."""
    whl = engine_wheel(rules, release)
    unquantized = set(rules["unquantized_roles"])
    moe = method_def(class_def(whl, TEXT[rules.engine], "Llama4MoE"), "__init__")
    top = method_def(class_def(whl, TOP[rules.engine], CLASS), "__init__")
    if rules.engine == "sglang":
        assert (_quant_config_of(moe, "router") == "None") == ("router" in unquantized)
        layer = method_def(class_def(whl, TOP["sglang"], "Llama4VisionEncoderLayer"), "__init__")
        assert (_quant_config_of(layer, "self_attn") == "None") == ("vision_attention" in unquantized)
        assert _quant_config_of(layer, "mlp") == "quant_config"
        for leaf in ("fc1", "fc2"):
            assert _quant_config_of(method_def(class_def(whl, TOP["sglang"], "Llama4VisionMLP"), "__init__"), leaf) == \
                "quant_config"
        # the vision tower gets the Quark config unless config.quantization_config's "ignore" (a
        # compressed-tensors key; Quark writes "exclude") names both towers
        text = ast.unparse(top).replace('"', "'")
        governed = _quant_config_of(top, "vision_model") == "vision_quant_config" and \
            "vision_quant_config = quant_config" in text and ".get('ignore', {})" in text
        assert governed == ("vision" not in unquantized)
        projector = attribute_builds(top, "multi_modal_projector")
        assert projector[0].call == "Llama4MultiModalProjector" and "quant_config" not in projector[0].keywords
        assert "Llama4MultiModalProjector" in source(whl, TOP["sglang"]).split("from sglang", 1)[0]  # transformers' class
        assert "projector" in unquantized
        # no shared-expert fusion hook in either class (layers/moe/utils.py: nothing fused)
        hooks = [method_def(class_def(whl, path, cls), "shared_experts_fusion_disable_reason")
                 for path, cls in ((TOP["sglang"], CLASS), (TEXT["sglang"], "Llama4ForCausalLM"))]
        assert (hooks == [None, None]) == (rules["shared_experts_fusion"] is None)
    else:
        # GateLinear without quant_config, or (<= 0.30.0) ReplicatedLinear(quant_config=None)
        assert (attribute_builds(moe, "router")[0].call in ("GateLinear", "ReplicatedLinear") and
                _quant_config_of(moe, "router") in (None, "None")) == ("router" in unquantized)
        never = _quant_config_of(top, "vision_model") == "None" and _quant_config_of(top, "multi_modal_projector") == "None"
        assert never == ({"vision", "vision_attention", "projector"} <= unquantized)
    assert "lm_head" in unquantized
    # the router has no bias in either class: no e_score_correction_bias is ever created
    assert ("e_score_correction_bias" in source(whl, TEXT[rules.engine])) == (rules["router"]["bias_when"] != "never")
    assert "bias=False" in ast.unparse(moe).split("self.router = ", 1)[1].split("\n", 1)[0] or rules.engine == "vllm"


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_fused_modules_are_the_ones_the_classes_build(rules, release):
    """qkv_proj (Llama4Attention: QKVParallelLinear) and gate_up_proj (llama.py LlamaMLP:
    MergedColumnParallelLinear, the dense layers and the shared expert), nothing else."""
    whl = engine_wheel(rules, release)
    llama = "sglang/srt/models/llama.py" if rules.engine == "sglang" else "vllm/model_executor/models/llama.py"
    attention = ast.unparse(method_def(class_def(whl, TEXT[rules.engine], "Llama4Attention"), "__init__"))
    mlp = ast.unparse(method_def(class_def(whl, llama, "LlamaMLP"), "__init__"))
    built = {name for name, text, call in (("qkv_proj", attention, "QKVParallelLinear"),
                                            ("gate_up_proj", mlp, "MergedColumnParallelLinear"))
             if f"self.{name} = {call}(" in text}
    assert built == set(rules["built_fused"])
    assert all(shards == {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}[name]
               for name, shards in rules["built_fused"].items())


def _sglang_is_moe(whl):
    holder = methods(whl, TEXT["sglang"], "Llama4DecoderLayer", ["_is_moe_layer"])["cls"]
    return lambda config, layer: holder._is_moe_layer(types.SimpleNamespace(config=config), layer)


def _vllm_is_moe(whl):
    init = method_def(class_def(whl, TEXT["vllm"], "Llama4DecoderLayer"), "__init__")
    expr = next(s.value for s in ast.walk(init) if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "is_moe_layer")
    code = compile(ast.Expression(expr), "vllm Llama4DecoderLayer.__init__", "eval")
    return lambda config, layer: eval(code, {"config": config, "self": types.SimpleNamespace(layer_idx=layer)})


@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_moe_layer_selection_is_the_engines(rules, release):
    """interleave_moe_layer_step as each release reads it, 0 included (sglang: every layer when there
    are experts; vLLM: none); config.moe_layers (transformers') is not read by either."""
    is_moe = (_sglang_is_moe if rules.engine == "sglang" else _vllm_is_moe)(engine_wheel(rules, release))
    rng = random.Random(f"llama4-moe{rules.id}{release}")
    disagree = []
    for _ in range(200):
        config = {"num_hidden_layers": rng.randint(1, 9), "interleave_moe_layer_step": rng.choice([0, 0, 1, 2, 3, 4]),
                  "num_local_experts": rng.choice([0, 4, 16, 128]), "moe_layers": rng.choice([None, [0], [1, 3]])}
        theirs = {i for i in range(config["num_hidden_layers"]) if is_moe(types.SimpleNamespace(**config), i)}
        if theirs != moe_layers_built(rules, config):
            disagree.append((config, theirs, moe_layers_built(rules, config)))
    assert not disagree, disagree[:3]


@pytest.fixture(scope="module")
def per_expert_output(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The routed-expert tensors of a tiny Llama-4's MXFP4 conversion (what the loaders read)."""
    root = tmp_path_factory.mktemp("llama4")
    src = write_family_checkpoint(root / "bf16", "llama4", num_hidden_layers=4)
    assert quantize(["-q", "--to", "mxfp4", str(src), str(root / "mxfp4")]) == 0
    tensors = {}
    for file in Path(root / "mxfp4").glob("*.safetensors"):
        tensors.update({n: t for n, t in load_file(str(file)).items() if ".experts." in n})
    return tensors


class Param:
    """A parameter whose weight_loader records what the engine's loader hands it."""

    def __init__(self, calls: list, name: str):
        self.weight_loader = lambda param, weight, *args, **kwargs: calls.append((name, kwargs, tuple(weight.shape)))


class Params(dict):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __missing__(self, key):
        self[key] = Param(self.calls, key)
        return self[key]


def _expected(tensors) -> list[tuple[str, str, int, str]]:
    """(layer prefix, parameter leaf, expert, shard) each stored expert tensor must land in."""
    out = []
    shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for name in tensors:
        experts, expert, proj, leaf = name.rsplit(".", 3)
        out.append((experts, ("w2_" if proj == "down_proj" else "w13_") + leaf, int(expert), shard[proj]))
    return sorted(out)


@pytest.mark.parametrize(("rules", "release"), [c for c in CASES if c[0].engine == "sglang"],
                         ids=[i for i in IDS if i.startswith("sglang")])
def test_sglang_loads_each_stored_expert_into_its_slot(rules, release, per_expert_output):
    """sglang's own Llama4ForConditionalGeneration.load_weights (the per-expert path,
    FusedMoE.make_expert_params_mapping) on the converter's output names: every expert's weight and
    scale goes to w13_/w2_ of its layer's FusedMoE with its expert id and shard."""
    whl = engine_wheel(rules, release)
    mapping = methods(whl, "sglang/srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE", ["make_expert_params_mapping"])
    names = ["load_weights", "_should_skip_weight", "_transform_weight_name", "permute_qk_weight_for_rotary",
             "_handle_scale_remapping", "_handle_stacked_params", "_handle_expert_weights", "_handle_other_expert_params",
             "_transform_expert_name", "_handle_expert_scale_params", "_handle_expert_weight_params",
             "_handle_default_weight"]
    loader = methods(whl, TOP["sglang"], CLASS, names, {
        "FusedMoE": mapping["cls"], "torch": torch, "_is_cpu": False, "Iterable": object, "Tuple": tuple, "Set": set,
        "maybe_remap_kv_scale_name": lambda name, params: name, "default_weight_loader": None})
    calls: list = []
    params = Params(calls)  # load_weights copies it (dict(self.named_parameters())): the slots it may use
    for experts, leaf, _, _ in _expected(per_expert_output):
        params[f"{experts}.{leaf}"]
    model = loader["cls"]()
    model.has_vision, model.config = True, types.SimpleNamespace(text_config=types.SimpleNamespace(num_local_experts=4))
    model.named_parameters = lambda: params.items()
    loader["cls"].load_weights(model, list(per_expert_output.items()))
    got = sorted((name.rsplit(".", 1)[0], name.rsplit(".", 1)[1], kw["expert_id"], kw["shard_id"]) for name, kw, _ in calls)
    assert got == _expected(per_expert_output)


def test_vllm_loads_each_stored_expert_into_its_slot(per_expert_output):
    """vLLM's own Llama4Model.load_moe_expert_weights with its per-expert mapping
    (RoutedExperts.build_expert_params_mapping, as fused_moe_make_expert_params_mapping builds it):
    every stored expert tensor lands in its FusedMoE's w13_/w2_ slot, expert id and shard."""
    rules, release = max((c for c in CASES if c[0].engine == "vllm"), key=lambda c: Version(c[1]))  # the newest read
    whl = engine_wheel(rules, release)
    eplb = methods(whl, "vllm/distributed/eplb/eplb_state.py", "EplbState", ["build_initial_global_physical_to_logical_map"])
    routed = methods(whl, "vllm/model_executor/layers/fused_moe/routed_experts.py", "RoutedExperts",
                     ["build_expert_params_mapping"], {"EplbState": eplb["cls"]})
    wrapper = ast.unparse(method_def(class_def(whl, "vllm/model_executor/layers/fused_moe/routed_experts.py",
                                               "RoutedExperts"), "make_expert_params_mapping"))
    assert "RoutedExperts.build_expert_params_mapping(" in wrapper
    mapping = routed["cls"].build_expert_params_mapping("gate_proj", "down_proj", "up_proj", 4)
    load = methods(whl, TEXT["vllm"], "Llama4Model", ["load_moe_expert_weights"],
                   {"is_pp_missing_parameter": lambda name, model: False, "torch": torch})["cls"]
    calls: list = []
    params = Params(calls)
    for name, tensor in per_expert_output.items():
        assert load.load_moe_expert_weights(types.SimpleNamespace(), name, tensor, params, set(), mapping, fused=False)
    got = sorted((name.rsplit(".", 1)[0].removesuffix(".routed_experts"), name.rsplit(".", 1)[1], kw["expert_id"],
                  kw["shard_id"]) for name, kw, _ in calls)
    assert got == _expected(per_expert_output)


def test_every_required_release_is_read_and_has_one_rule_set():
    for engine in ENGINES:  # every release of the window
        required = window(engine)
        read = releases_read(engine, "llama4")
        assert set(required) <= set(read), (engine, sorted(read))
        for release in required:
            assert len(select(f"{engine}=={release}", "llama4")) == 1


HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "hidden_size": 64}  # the tiny text config's


def _stored_qk(fmt: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """q_proj and k_proj as quantgate stores them in ``fmt`` (weight, scales), from random bf16."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for leaf, heads in (("q_proj", HEADS["num_attention_heads"]), ("k_proj", HEADS["num_key_value_heads"])):
        w = torch.randn(heads * HEADS["head_dim"], HEADS["hidden_size"], generator=gen).to(torch.bfloat16)
        out[leaf] = get_codec(fmt).quantize(w)
    return out


def _loader_takes(rules, release, fmt: str) -> bool:
    """Whether the release's own permute_qk_weight_for_rotary (sglang: Llama4ForConditionalGeneration,
    vLLM: Llama4ForCausalLM) takes the stored q_proj/k_proj and permutes each weight's scales with it."""
    whl = engine_wheel(rules, release)
    cls, path = ("Llama4ForConditionalGeneration", TOP["sglang"]) if rules.engine == "sglang" else \
        ("Llama4ForCausalLM", TEXT["vllm"])
    permute = methods(whl, path, cls, ["permute_qk_weight_for_rotary"],
                      {"torch": torch, "_is_cpu": False, "Tuple": tuple})["cls"].permute_qk_weight_for_rotary
    config = types.SimpleNamespace(**HEADS)
    model = types.SimpleNamespace(config=config, language_model=types.SimpleNamespace(config=config))
    prefix = "language_model.model.layers.0.self_attn."
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    for leaf, (weight, scales) in _stored_qk(fmt).items():
        try:
            permute(model, prefix + leaf + ".weight", weight)
        except RuntimeError:  # the view does not fit the stored shape
            return False
        _, permuted = permute(model, f"{prefix}{leaf}.{scale_name}", scales)
        if fmt != "fp8" and torch.equal(permuted, scales):  # per-row MX scales must follow their rows
            return False
    return True


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize(("rules", "release"), CASES, ids=IDS)
def test_quantized_q_and_k_load_where_the_engines_rotary_permute_takes_them(rules, release, fmt):
    """Both loaders permute q_proj/k_proj rows for rotary at load: sglang by the config's head sizes
    (an MXFP4 weight packed [out, in/2] does not fit the view), vLLM by the tensor's own shape with its
    per-row scales alike. The replay fails a quantized attention exactly where the release's own
    function does not take it (FP8 128 x 128 blocks: the rows stay in their block at head_dim 128)."""
    prefix = "language_model.model.layers.0.self_attn."
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}
    modules = {prefix + leaf: Module(True, shape, "attention") for leaf, shape in shapes.items()}
    kind = "fp8" if fmt == "fp8" else "quark"
    qconfig = get_codec(fmt).quantization_config([], ScaleRule.EVEN, False)
    findings = [f for f in replay(ReplayContext(rules, modules, qconfig, "llama4", 2, kind, fmt.upper()))
                if "permute it for rotary" in f.why]
    assert (not findings) == _loader_takes(rules, release, fmt), findings
