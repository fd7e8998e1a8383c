"""Every family folder through the same checks: the families are the discovered ones
(``quant.layout.family_names()``: the package's folders and every root in ``QUANTGATE_FAMILIES``), so a
family added as a folder is checked by adding the folder. Each folder's own ``tiny.py`` builds a tiny
checkpoint named as the release stores it; it must be read as its family, convert (``quantize --to
mxfp4``), decode back to the release's layout (``--to bf16``), load in each engine's newest release read
for its model class (``gate checkpoint``), with the replay's exclude decisions on that conversion equal
to the release wheel's own function's (the wheels come from tests/quant/engine_sources.py; without the
registry those cases skip, saying why), evaluate locally where transformers builds the model, and plan
at full size from its folder's ``full_size.*`` (``quantize --dry-run`` on sparse files)."""

from __future__ import annotations

import functools
import json
import re
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors import safe_open

import manifests
from evals.cli import main as gate
from evals.emulation import EmulationRefused, load_model
from quant.cli import main as quantize
from quant.engines import ENGINES, Exclude, excluded
from quant.engines.replay import Module, ReplayContext, engine_modules
from quant.engines.rules import releases_read, select
from quant.layout import family_dirs, family_for, family_names
from tests.benchmarks.family_full_size import family_layouts, write_sparse
from tests.quant.family_checkpoints import serve_args, write_family_checkpoint
from tests.quant.test_engine_families import class_mapping
from tests.quant.test_engine_sources import _outcome, _quark_engine, engine_wheel

FAMILIES = family_names()


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = write_family_checkpoint(root / "bf16", family)
    assert quantize(["--to", "mxfp4", "-q", *serve_args(family), str(src), str(root / "mxfp4")]) == 0
    return family, src, root / "mxfp4"


def stored(folder) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape), read from the shards' headers."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                piece = f.get_slice(name)
                out[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    return out


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_the_folders_tiny_checkpoint_is_read_as_its_family(converted):
    family, src, _ = converted
    assert family_for(config_of(src)).name == family


def test_convert_stores_the_routed_experts_quantized(converted):
    family, _, out = converted
    config = config_of(out)
    roles = family_for(config)
    layers = roles.text_config(config)[roles.num_layers_key]
    # the packed weights (their scales are U8 too); gpt-oss writes its release's own <fused>_blocks
    packed = [n for n, (dtype, _) in stored(out).items() if dtype == "U8" and n.endswith((".weight", "_blocks"))]
    assert packed and "quantization_config" in config
    # every packed weight is a routed expert's (the rest of the model stays as the recipe keeps it)
    assert {roles.classify(n, layers).role for n in packed} == {"routed_expert"}, family


def test_decode_gives_back_the_releases_names_and_shapes(converted, tmp_path):
    family, src, out = converted
    assert quantize(["--to", "bf16", "-q", str(out), str(tmp_path / "bf16")]) == 0
    before, after = stored(src), stored(tmp_path / "bf16")
    assert {n: s for n, (_, s) in after.items()} == {n: s for n, (_, s) in before.items()}, family
    assert "quantization_config" not in config_of(tmp_path / "bf16")


def newest_releases(family: str) -> list[str]:
    """``<engine>==<release>`` for each engine's newest release read for the family's model classes (only the
    engines the family's tiny.py serves, where it names some: serve_args)."""
    served = set(serve_args(family)[1::2])
    return [f"{engine}=={max(releases_read(engine, family), key=Version)}" for engine in ENGINES
            if releases_read(engine, family) and (not served or any(s.startswith(engine + "==") for s in served))]


def test_the_conversion_loads_in_each_engines_newest_release(converted, capsys):
    """The replay of each engine's rules, with the shared expert left unfused (a routed-only MXFP4
    checkpoint cannot be fused into the MXFP4 experts: tests/quant/test_families.py)."""
    family, _, out = converted
    releases = newest_releases(family)
    assert releases, f"no engine release has been read for family {family}"
    for release in releases:
        code = gate(["checkpoint", str(out), "--engine", release, "--disable-shared-experts-fusion"])
        text = capsys.readouterr()
        assert code == 0 and "verdict: loads correctly" in text.out, (family, release, text.out + text.err)


MODELS = ("sglang/srt/models/", "vllm/model_executor/models/", "vllm/models/")  # where the engines' model classes live


@functools.cache
def class_files(whl: Path, cls: str) -> tuple[str, ...]:
    """The wheel's model source files defining the top-level class ``cls``."""
    with zipfile.ZipFile(whl) as z:
        return tuple(n for n in z.namelist() if n.startswith(MODELS) and n.endswith(".py")
                     and re.search(rf"^class {cls}\(", z.read(n).decode(errors="replace"), re.MULTILINE))


def linear_modules(folder, family) -> tuple[dict[str, Module], int]:
    """The checkpoint's Linear modules as the replay reads them (quantized on disk or not, role)."""
    config = config_of(folder)
    layers = family.text_config(config)[family.num_layers_key]
    modules = {}
    for name, (dtype, shape) in stored(folder).items():
        role = family.classify(name, layers)
        if role.linear and name.endswith(".weight") and len(shape) == 2:
            modules[name.removesuffix(".weight")] = Module(dtype == "U8", shape, role.role)
    return modules, layers


@pytest.mark.parametrize("engine", ENGINES)
def test_the_replays_exclude_decisions_are_the_wheels(converted, engine):
    """On the conversion's own exclude list and modules, the replay of the engine's newest release read
    for the family decides every module the exclude list governs as that release's own
    ``should_ignore_layer`` does, fed the packed-modules mapping read from the same wheel's model class."""
    family, _, out = converted
    qconfig = config_of(out)["quantization_config"]
    if qconfig.get("quant_method") != "quark":
        pytest.skip(f"{family}: the conversion is the release's own {qconfig.get('quant_method')} layout, "
                    "which no exclude list governs")
    release = max(releases_read(engine, family), key=Version)
    rules = select(f"{engine}=={release}", family)[0]
    whl = engine_wheel(rules, release)
    found = class_files(whl, rules.model_class)
    if len(found) != 1:
        pytest.skip(f"{family}: {engine} {release} defines {rules.model_class} in {len(found)} files {found} "
                    "(per platform): its own tests/quant/test_engine_*.py read it")
    try:
        fused = class_mapping(whl, engine, found[0], rules.model_class, "quark")
    except ValueError as exc:  # a mapping built at run time, not a literal
        pytest.skip(f"{family}: {rules.model_class}.packed_modules_mapping is not a literal ({exc})")
    decide = _quark_engine(rules, whl)
    fam = family_for(config_of(out))
    modules, layers = linear_modules(out, fam)
    context = ReplayContext(rules, modules, qconfig, family, layers, "quark", "MXFP4", fam.text_config(config_of(out)))
    governed = {name: m for name, m in engine_modules(context).items() if m.build == "governed"}
    exclude = qconfig["exclude"]
    disagree = [(name, mine, theirs) for name, m in governed.items()
                if (mine := _outcome(excluded, name, Exclude(exclude), rules, "quark", m.moe))
                != (theirs := _outcome(decide, name, exclude, fused, m.moe))]
    assert governed and not disagree, (family, rules.id, disagree[:3])


def test_local_evaluation_where_transformers_builds_the_model(converted):
    family, _, out = converted
    try:
        model, emulation = load_model(out)
    except EmulationRefused as exc:
        pytest.skip(f"{family}: {exc}")
    assert emulation is not None, family
    tokens = torch.randint(3, 380, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(tokens).logits).all(), family


@pytest.mark.parametrize("family", FAMILIES)
def test_the_full_size_layout_plans(family, tmp_path, capsys):
    found = family_layouts(family)
    assert found, f"{family}: its folder has no full_size.yaml or full_size.py (the published sizes)"
    for name, build in found.items():
        config, entries = build()
        src = tmp_path / name
        write_sparse(src, config, entries)
        code = quantize(["--to", "mxfp4", "--dry-run", "-q", "--json", *serve_args(family), str(src),
                         str(tmp_path / f"{name}-out")])
        text = capsys.readouterr()
        assert code == 0, (name, text.err)
        assert family_for(config).name == family


@pytest.mark.parametrize("family", FAMILIES)
def test_the_folder_holds_its_builder_and_notes(family):
    folder = family_dirs()[family]
    assert (folder / "tiny.py").is_file(), f"{folder}: no tiny.py (the tests' tiny-checkpoint builder)"
    notes = folder / "NOTES.md"
    assert notes.is_file() and notes.read_text().startswith(f"# {family}: "), f"{folder}: no NOTES.md for {family}"


def test_every_file_of_the_family_folders_ships_in_the_package():
    """pyproject's package-data patterns for manifests cover every file the folders hold (a
    non-editable install would drop the rest: a builder, a full-size config, the notes)."""
    root = Path(manifests.__file__).parent
    patterns = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in patterns["manifests"] for p in root.glob(pattern)}
    held = {p for p in (root / "families").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert held and not held - shipped, sorted(str(p.relative_to(root)) for p in held - shipped)
