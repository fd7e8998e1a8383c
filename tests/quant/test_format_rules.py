"""The third-party formats' rule files (quant.engines.format_rules): every window release covered once,
family rule sets cut where a format's loading changes, a broken file refused in one line."""

from __future__ import annotations

import pytest
from packaging.version import Version

from quant.engines import format_rules
from quant.engines.rules import ENGINES, RuleFileError, rule_sets, window

WRITTEN = [(kind, engine) for kind in format_rules.FORMAT_MODULES for engine in ENGINES
           if format_rules.rules_path(kind, engine).is_file()]


@pytest.fixture
def fresh_rules():
    format_rules.clear_caches()
    yield
    format_rules.clear_caches()


@pytest.mark.parametrize("kind, engine", WRITTEN)
def test_every_window_release_is_read(kind, engine):
    spans = format_rules.format_spans(kind, engine)
    assert spans and format_rules.unread(kind, engine) == []
    assert set(spans[0].values) == set(spans[-1].values)  # the first set states every rule the file ever states


def test_a_family_rule_set_is_cut_where_the_format_changes():
    kind, engine = "compressed-tensors", "vllm"
    spans = format_rules.format_spans(kind, engine)
    family = next(r for r in rule_sets(engine, "glm_moe_dsa")
                  if sum(r.covers(s.first) for s in spans) >= 1 and any(
                      Version(r.first) < Version(s.first) <= Version(r.last) for s in spans))
    inside = [v for v in window(engine) if family.covers(v)]
    cuts = {v: format_rules.cut(family, kind, v) for v in inside}
    assert len({c.id for c in cuts.values()}) > 1  # two format spans inside one family set: two rule sets
    for release, cut in cuts.items():
        span = next(s for s in spans if s.covers(release))
        assert cut.covers(release) and cut.values[format_rules.key(kind)] == span.values
        assert all(span.covers(v) for v in inside if cut.covers(v))  # a cut never mixes two format spans
        assert {k: v for k, v in cut.values.items() if k != "compressed_tensors"} == family.values
    assert cuts[inside[0]] is format_rules.cut(family, kind, inside[0])  # one object per cut (the replay's memo)


def _write(tmp_path, monkeypatch, text: str):
    path = tmp_path / "compressed_tensors.vllm.yaml"
    path.write_text(text)
    monkeypatch.setattr(format_rules, "rules_path", lambda kind, engine: path)
    return path


def test_a_window_release_without_rules_is_unread_not_refused(tmp_path, monkeypatch, fresh_rules):
    real = format_rules.rules_path("compressed-tensors", "vllm").read_text()
    last = window("vllm")[-1]
    _write(tmp_path, monkeypatch, real.replace(f", {last}]", f", {window('vllm')[-2]}]"))
    assert format_rules.unread("compressed-tensors", "vllm") == [last]
    family = next(r for r in rule_sets("vllm", "glm_moe_dsa") if r.covers(last))
    assert format_rules.cut(family, "compressed-tensors", last).values["compressed_tensors"] is None


@pytest.mark.parametrize("edit, said", [
    (lambda text: text.replace("format: compressed-tensors", "format: modelopt"), "says format 'modelopt'"),
    (lambda text: text.replace("ignore_match:", "ignore_matcher:", 1), "ignore_matcher"),
    (lambda text: text + "  - versions: [0.34.0, 0.34.0]\n    rules: {}\n", "more than one rule set"),
])
def test_a_broken_rule_file_is_refused_in_one_line(tmp_path, monkeypatch, fresh_rules, edit, said):
    real = format_rules.rules_path("compressed-tensors", "vllm").read_text()
    path = _write(tmp_path, monkeypatch, edit(real))
    with pytest.raises(RuleFileError) as exc:
        format_rules.format_spans("compressed-tensors", "vllm")
    assert str(path) in str(exc.value) and said in str(exc.value) and "\n" not in str(exc.value)


# --- the replay of a real checkpoint through the format rules ---------------------------------------------

@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    from tests.quant.third_party_checkpoints import nvfp4_ct, write_third_party

    root = tmp_path_factory.mktemp("format_rules")
    stored_bf16 = lambda module: None if module.startswith("model.layers.1.mlp.experts.") else config.resolve(module)
    from quant.third_party import CT, parse
    config = parse(CT, nvfp4_ct())
    return {"well-formed": write_third_party(root / "ok", "qwen3_moe", nvfp4_ct()),
            "layer 1 experts bf16": write_third_party(root / "bf16", "qwen3_moe", nvfp4_ct(), stored=stored_bf16)}


def test_a_well_formed_checkpoint_loads_in_every_release(nvfp4):
    from quant.verify import verify

    report = verify(nvfp4["well-formed"], "all")
    assert report.ok and report.modules_quantized == 48 and all(r.state == "read" for r in report.releases)


def test_each_release_answers_with_its_format_rules(nvfp4):
    """Layer 1's experts stored bf16 but not in ignore: every release builds that FusedMoE NVFP4 (the expert-0
    probe is not ignored) and says so with its own format rules' reason."""
    from quant.verify import verify

    report = verify(nvfp4["layer 1 experts bf16"], "all")
    for result in report.releases:
        found = [f for f in report.findings if f.engine == result.rules]
        assert [f.module for f in found] == ["model.layers.1.mlp.experts"], result
        assert "bf16 on disk" in found[0].why and "as nvfp4" in found[0].why


def test_a_release_whose_format_loading_was_not_read_is_named(nvfp4, tmp_path, monkeypatch, fresh_rules):
    from quant.verify import verify

    monkeypatch.setattr(format_rules, "rules_path", lambda kind, engine: tmp_path / "absent.yaml")
    report = verify(nvfp4["well-formed"], "vllm==0.34.0")
    assert not report.ok and all("was not read" in f.why for f in report.findings)


def test_a_scheme_whose_loading_was_not_read_is_unknown_not_an_error(tmp_path):
    """sglang 0.5.23 builds ModelOpt MXFP8 with its own Fp8Config, which was not read: every module is named
    as unknown (exit 1: a release not vouched for), never as an error the release raises."""
    from quant.verify import verify
    from tests.quant.third_party_checkpoints import modelopt_config, write_third_party

    report = verify(write_third_party(tmp_path / "mxfp8", "qwen3_moe", modelopt_config("MXFP8")), "sglang==0.5.23")
    assert report.findings and all("was not read for sglang 0.5.23: whether this" in f.why and "raises" not in f.why
                                   for f in report.findings)


def test_vllm_asks_a_fused_moe_by_the_class_checkpoint_names_from_0_32_0(tmp_path):
    """Mixtral stores its experts as w1 / w3 / w2; an ignore list naming layer 1's experts so (stored bf16) is
    asked as gate_proj / up_proj / down_proj up to 0.31.0, which it never names (the FusedMoE is built NVFP4),
    and by the class's own names from 0.32.0 (models/mixtral.py: FusedMoE(ckpt_names=("w1", "w2", "w3")))."""
    from quant.verify import verify
    from tests.quant.third_party_checkpoints import nvfp4_ct, write_third_party

    experts = [f"model.layers.1.block_sparse_moe.experts.{e}.{leaf}" for e in range(8) for leaf in ("w1", "w2", "w3")]
    folder = write_third_party(tmp_path / "mixtral", "mixtral", nvfp4_ct(ignore=["lm_head", "re:.*gate$", *experts]))
    old = verify(folder, "vllm==0.31.0")
    assert [(f.module, "bf16 on disk" in f.why) for f in old.findings] == [
        ("model.layers.1.block_sparse_moe.experts", True)]
    assert verify(folder, "vllm==0.32.0").ok and verify(folder, "vllm==0.34.0").ok
