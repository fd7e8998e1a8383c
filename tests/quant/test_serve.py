"""quantize's output loads where the user serves it: the plan replays every engine release read for
the family on the planned checkpoint, names the releases that fail as ranges of the release window
with the ways out, and ``--serve ENGINE==X`` refuses (exit 2, nothing written) what X would not load.

The fusion cases need 256 routed experts and one shared expert (sglang's shared-expert fusion), so
their sources are headers over holes at tiny widths (as tests/quant/test_fusion.py builds them).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from quant.checkpoint import Checkpoint
from quant.example import tiny_config
from quant.layout import family_named
from quant.plan import make_plan
from quant.recipe import load_recipe, with_overrides
from quant.release_check import ServeError, not_answered, parse_serve, release_ranges
from tests.conftest import quantize_cmd, write_sparse_checkpoint, write_sparse_shards
from tests.quant.family_checkpoints import write_family_checkpoint

GLM = family_named("glm_moe_dsa")


@pytest.fixture(scope="module")
def glm256(tmp_path_factory):
    """GLM-5 layout with 256 routed experts: layer 0 dense, layer 1 MoE, MTP layer 2."""
    src = tmp_path_factory.mktemp("serve") / "bf16"
    write_sparse_checkpoint(src, tiny_config("glm_moe_dsa", num_hidden_layers=2, n_routed_experts=256), shards=2)
    (src / "tokenizer.json").write_text("{}")
    return src


def quantize(*args) -> subprocess.CompletedProcess:
    return subprocess.run(quantize_cmd(*args), capture_output=True, text=True, check=False, timeout=120)


def test_release_ranges_follow_the_window():
    """Consecutive releases of the window, .postN included, are one range; a gap splits it."""
    assert release_ranges("sglang", ["0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
                                     "0.5.17"]) == ["0.5.13-0.5.17"]
    assert release_ranges("sglang", ["0.5.9", "0.5.10", "0.5.12", "0.5.23"]) == ["0.5.9-0.5.10", "0.5.12", "0.5.23"]
    assert release_ranges("vllm", ["0.34.0", "0.33.0"]) == ["0.33.0-0.34.0"]


def test_the_default_plan_names_the_releases_that_fail(glm256):
    """The bf16 shared expert of the default recipe is fused into the MXFP4 experts by sglang
    0.5.9-0.5.17 (every .post between them too): named as that range, with the releases that load,
    and the releases not read for the family named as unknown rather than counted as loading."""
    plan = make_plan(glm256, load_recipe())
    sglang = plan.summary()["releases"]["sglang"]
    assert (sglang["loads"], sglang["fails"]) == (["0.5.18-0.5.23"], ["0.5.9-0.5.17"])
    warning = next(w for w in plan.warnings if w.startswith("shared-expert fusion"))
    assert "sglang 0.5.9-0.5.17 fold the shared expert" in warning
    unread = not_answered("vllm", GLM)
    for state, rest in unread.items():
        assert plan.summary()["releases"]["vllm"][state.replace(" ", "_")] == release_ranges("vllm", rest)
    said = [w for w in plan.warnings if w.startswith("not replayed for family glm_moe_dsa's classes: ")]
    assert bool(said) == bool(unread or not_answered("sglang", GLM))
    for state, rest in unread.items():
        assert f"vllm {', '.join(release_ranges('vllm', rest))} ({state})" in said[0]


def test_the_shared_expert_quantized_loads_in_every_release(glm256):
    plan = make_plan(glm256, with_overrides(load_recipe(), shared_experts="mxfp4"))
    assert plan.summary()["releases"]["sglang"]["fails"] == []
    assert not any("would not load" in w or w.startswith("shared-expert fusion") for w in plan.warnings)


def test_serve_refuses_a_release_that_would_not_load_and_writes_nothing(glm256, tmp_path):
    """A real process: --serve sglang==0.5.17 (and the .post of a failing release) is one line, exit 2,
    naming the release, the module and the ways out, and DST is not created."""
    for release in ("0.5.17", "0.5.13.post1"):
        done = quantize(glm256, tmp_path / "out", "--serve", f"sglang=={release}")
        assert done.returncode == 2, done.stderr
        line, = done.stderr.strip().splitlines()
        assert line.startswith(f"quantize: error: --serve sglang=={release}: sglang {release} would not load this "
                               "output: model.layers.1.mlp.experts: sglang fuses the main model's shared expert")
        assert "Ways out: serve sglang 0.5.18-0.5.23; start sglang with --disable-shared-experts-fusion, or store " \
               "each MoE layer's shared and routed experts in one dtype (--shared-experts, --mtp-experts)" in line
        assert not (tmp_path / "out").exists()


def test_serve_passes_a_release_that_loads(glm256, tmp_path):
    done = quantize(glm256, tmp_path / "out", "--serve", "sglang==0.5.18", "--serve", "sglang==0.5.23",
                    "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    releases = json.loads(done.stdout)["releases"]
    assert releases["sglang"]["serve"] == ["0.5.18", "0.5.23"] and releases["sglang"]["fails"] == ["0.5.9-0.5.17"]
    done = quantize(glm256, tmp_path / "out", "--serve", "sglang==0.5.18", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "releases    sglang (served: 0.5.18): loads 0.5.18-0.5.23; fails 0.5.9-0.5.17" in done.stdout


def test_serve_names_serving_without_the_draft_where_only_the_draft_fails(glm256):
    """The draft's routed experts bf16 beside an MXFP4 shared expert: sglang 0.5.22-0.5.23 fuse the
    draft's shared expert (its class's fused_shared_experts_architecture), the main model loads; serving
    without the MTP draft is a way out, and 0.5.16-0.5.21 load it."""
    recipe = with_overrides(load_recipe(), shared_experts="mxfp4", mtp_experts="bf16")
    with pytest.raises(ServeError) as refused:
        make_plan(glm256, recipe, serve=(("sglang", "0.5.23"),))
    message = str(refused.value)
    assert message.startswith("--serve sglang==0.5.23: sglang 0.5.23 would not load this output: "
                              "model.decoder.mlp.experts: sglang fuses the MTP draft's shared expert")
    assert "Ways out: serve sglang 0.5.16-0.5.21; serve without the MTP draft (no speculative decoding: only the " \
           "draft's modules fail); start sglang with --disable-shared-experts-fusion, or store the MTP draft's " \
           "shared and routed experts" in message
    assert make_plan(glm256, recipe, serve=(("sglang", "0.5.21"),)).summary()["releases"]["sglang"]["serve"] == \
        ["0.5.21"]


def test_the_newest_release_failing_is_still_refused(glm256):
    """What the newest release read would not load is the recipe's fault (no newer release serves it)."""
    from quant.recipe import Recipe, Rule
    from quant.serving import NamingError

    recipe = Recipe("indexer", "mxfp4", load_recipe().scale_rule, False, (Rule("indexer", "quantize"),))
    with pytest.raises(NamingError, match="of the newest releases read refuse: sglang 0.5.22..0.5.23: .*builds "
                                          "weights_proj unquantized"):
        make_plan(glm256, recipe)
    with pytest.raises(ServeError, match=r"^--serve sglang==0\.5\.20: sglang 0\.5\.20 would not load this output"):
        make_plan(glm256, recipe, serve=(("sglang", "0.5.20"),))


@pytest.mark.parametrize("spec,said", [
    ("sglang==0.5.99", "--serve sglang==0.5.99: sglang 0.5.99 is not a registry release in the window quantgate "
                       "reads (sglang 0.5.9 to "),
    ("tgi==1.0", "--serve tgi==1.0: unknown engine 'tgi'; name one of sglang, vllm"),
    ("vllm", "--serve vllm: name the release you serve, e.g. --serve vllm=="),
    ("sglang==abc", "--serve sglang==abc: 'abc' is not a version"),
    ("sglang==0.5.8", "--serve sglang==0.5.8: sglang 0.5.8 is not a registry release in the window"),
])
def test_bad_serve_is_one_line(spec, said, glm256, tmp_path):
    with pytest.raises(ServeError) as refused:
        parse_serve(spec)
    assert str(refused.value).startswith(said)
    done = quantize(glm256, tmp_path / "out", "--serve", spec)
    assert done.returncode == 2 and done.stderr.startswith(f"quantize: error: {said}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_serve_refuses_a_release_not_replayed_for_the_family(glm256, tmp_path):
    """A release that needs reading (or does not build the class) cannot be vouched for: exit 2."""
    unread = [(engine, release) for engine in ("vllm", "sglang") for rest in not_answered(engine, GLM).values()
              for release in rest]
    if not unread:
        pytest.skip("every release of the window is read or carried for glm_moe_dsa's classes")
    engine, release = unread[0]
    done = quantize(glm256, tmp_path / "out", "--serve", f"{engine}=={release}")
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert done.stderr.startswith(f"quantize: error: --serve {engine}=={release}: {engine} {release} "), done.stderr
    assert "family glm_moe_dsa" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_serve_with_a_decode_is_refused(glm256, tmp_path):
    done = quantize(glm256, tmp_path / "out", "--serve", "sglang==0.5.23", "--to", "bf16")
    assert done.returncode == 2 and "--serve checks a quantized output" in done.stderr


def test_the_api_takes_the_releases_served(glm256):
    import quantgate

    assert quantgate.plan(glm256, serve=("sglang==0.5.18",)).summary()["releases"]["sglang"]["serve"] == ["0.5.18"]
    with pytest.raises(ServeError, match=r"^--serve sglang==0\.5\.16: sglang 0\.5\.16 would not load"):
        quantgate.plan(glm256, serve=("sglang==0.5.16",))


def with_experts(family: str, dst, experts: int, **overrides):
    """``family``'s tiny checkpoint with ``experts`` routed experts per MoE layer, as headers over holes
    (the tiny builders write 4; sglang's shared-expert fusion needs the release's count)."""
    tiny = write_family_checkpoint(dst.with_name(dst.name + "-tiny"), family, **overrides)
    checkpoint = Checkpoint.open(tiny)
    entries = []
    for header in checkpoint.headers.values():
        for info in sorted(header.tensors.values(), key=lambda t: t.begin):
            expert = re.search(r"\.experts\.(\d+)\.", info.name)
            if expert is None:
                entries.append((info.name, info.dtype, tuple(info.shape)))
            elif expert.group(1) == "0":
                entries += [(info.name.replace(".experts.0.", f".experts.{e}.", 1), info.dtype, tuple(info.shape))
                            for e in range(experts)]
    config = checkpoint.config
    config.get("text_config", config)["n_routed_experts"] = experts
    write_sparse_shards(dst, config, [entries[:len(entries) // 2], entries[len(entries) // 2:]])
    for tokenizer in tiny.glob("tokenizer*"):
        shutil.copy(tokenizer, dst / tokenizer.name)
    return dst


@pytest.fixture(scope="module")
def kimi384(tmp_path_factory):
    """Kimi-K2.5 as released: 384 routed experts and one shared expert (the Quark allow-list of sglang's fusion)."""
    return with_experts("kimi_k25", tmp_path_factory.mktemp("kimi") / "bf16", 384, num_hidden_layers=2)


def test_kimi_default_names_the_releases_that_fuse_its_bf16_shared_expert(kimi384, tmp_path):
    """quantgate's Kimi-K2.5 MXFP4 default keeps the shared expert bf16: sglang 0.5.13-0.5.17 fuse it as
    expert 384 under Quark without reading the exclude list and cannot load it. The plan warns naming
    that range and the ways out; --serve sglang==0.5.15 refuses, --serve sglang==0.5.18 passes."""
    plan = make_plan(kimi384, load_recipe())
    assert "0.5.13-0.5.17" in plan.summary()["releases"]["sglang"]["fails"]
    warning = next(w for w in plan.warnings if w.startswith("shared-expert fusion"))
    assert "sglang 0.5.13-0.5.17 fold the shared expert" in warning
    assert "Ways out: serve sglang 0.5.9-0.5.12.post1, 0.5.18-0.5.23; start sglang with --disable-shared-experts-" \
           "fusion, or store each MoE layer's shared and routed experts in one dtype (--shared-experts, " \
           "--mtp-experts)" in warning
    done = quantize(kimi384, tmp_path / "out", "--serve", "sglang==0.5.15")
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert "--serve sglang==0.5.15: sglang 0.5.15 would not load this output: " in done.stderr
    assert "as expert 384" in done.stderr and "--disable-shared-experts-fusion" in done.stderr
    assert quantize(kimi384, tmp_path / "out", "--serve", "sglang==0.5.18", "--dry-run").returncode == 0
    assert make_plan(kimi384, with_overrides(load_recipe(), shared_experts="mxfp4")).summary()["releases"][
        "sglang"]["fails"] == []


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp("qwen35") / "bf16", "qwen3_5_moe")


def test_qwen35_default_names_the_releases_that_build_its_draft_bf16(qwen35, tmp_path):
    """quantgate's Qwen3.5 MXFP4 default quantizes the MTP layer's routed experts and lists the draft's
    other modules (mtp.*) in exclude: sglang 0.5.12-0.5.20 then build the whole draft bf16, which cannot
    hold MXFP4 experts. The plan warns naming that range and the ways out; --serve sglang==0.5.16
    refuses in one line and writes nothing; the ways out it names (--mtp-experts bf16, a release that
    loads) pass."""
    plan = make_plan(qwen35, load_recipe())
    assert "0.5.12-0.5.20" in plan.summary()["releases"]["sglang"]["fails"]
    warning = next(w for w in plan.warnings if w.startswith(
        "sglang 0.5.12-0.5.20 would not load this output: mtp.layers.0.mlp.experts: sglang builds the whole MTP draft "
        "bf16"))
    assert "Ways out: serve sglang 0.5.11, 0.5.21-0.5.23; serve without the MTP draft" in warning
    assert "--mtp-experts bf16" in warning
    done = quantize(qwen35, tmp_path / "out", "--serve", "sglang==0.5.16")
    assert done.returncode == 2 and not (tmp_path / "out").exists() and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("quantize: error: --serve sglang==0.5.16: sglang 0.5.16 would not load this output: "
                                  "mtp.layers.0.mlp.experts: sglang builds the whole MTP draft bf16"), done.stderr
    for way_out in (("--mtp-experts", "bf16", "--serve", "sglang==0.5.16"), ("--serve", "sglang==0.5.21")):
        assert quantize(qwen35, tmp_path / "out", *way_out, "--dry-run").returncode == 0, way_out


def test_minimax_m3_exclude_names_the_index_value_shard_some_releases_fuse(tmp_path, capsys):
    """sglang 0.5.17-0.5.19 check MiniMax-M3's index_qkv_proj as index_q_proj, index_k_proj and
    index_v_proj, which the release does not store: an exclude list naming the two stored ones makes them
    raise 'different quantization schemes'. quantize also lists index_v_proj (no module has that name in
    the other releases), so its output loads in 0.5.17-0.5.20; without that entry 0.5.18 fails."""
    from evals.cli import main as gate
    from tests.quant.test_fusion import write_planned

    src = write_family_checkpoint(tmp_path / "bf16", "minimax_m3")
    plan = write_planned(src, tmp_path / "ours", load_recipe())
    assert "language_model.model.layers.1.self_attn.index_v_proj" in plan.exclude
    assert plan.summary()["releases"]["sglang"]["loads"][0] == "0.5.17-0.5.20"
    assert gate(["checkpoint", str(tmp_path / "ours"), "--engine", "sglang==0.5.18"]) == 0

    def drop(qconfig):
        qconfig["exclude"] = [e for e in qconfig["exclude"] if not e.endswith(("index_v_proj", "index_qkv_proj"))]

    write_planned(src, tmp_path / "without", load_recipe(), drop)
    capsys.readouterr()
    assert gate(["checkpoint", str(tmp_path / "without"), "--engine", "sglang==0.5.18"]) == 1
    assert "different quantization schemes" in capsys.readouterr().out


def test_serve_refuses_block_fp8_that_does_not_load_at_the_default_tp(tmp_path):
    """quantgate's --to fp8 of a Qwen3.6-35B-A3B-shaped model (shared expert intermediate 512): at the
    default TP 8 each rank's 64 columns of the shared expert's down_proj are not a whole 128 block, which
    vLLM 0.33.0 raises on; --serve vllm==0.33.0 refuses it with the way out, and the recipe that keeps the
    shared experts bf16 passes."""
    src = write_family_checkpoint(tmp_path / "bf16", "qwen3_5_moe", num_hidden_layers=2, hidden_size=256,
                                  moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                  num_attention_heads=16, num_key_value_heads=2, head_dim=128)
    done = quantize(src, tmp_path / "fp8", "--to", "fp8", "--serve", "vllm==0.33.0")
    assert done.returncode == 2 and not (tmp_path / "fp8").exists() and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("quantize: error: --serve vllm==0.33.0: vllm 0.33.0 would not load this output: "), \
        done.stderr
    assert "mlp.shared_expert.down_proj: block FP8 128x128 at TP 8" in done.stderr
    assert "Ways out: serve at TP 1, 2, 4, or quantize with --shared-experts bf16" in done.stderr
    done = quantize(src, tmp_path / "fp8", "--to", "fp8", "--serve", "vllm==0.33.0", "--shared-experts", "bf16",
                    "--dry-run")
    assert done.returncode == 0, done.stderr
