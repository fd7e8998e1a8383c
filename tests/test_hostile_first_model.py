"""A newcomer's first model of their own, fourth campaign: a folder without a tokenizer (what a
model's ``save_pretrained`` writes), and an evaluation that leaves nothing in ``$TMPDIR``.

``evals run --model`` refuses a tokenizer-less folder in one line before anything is written
(it counted every prompt as 0 tokens, then lm-eval failed mid-run, exit 3, leaving tasks/ and
units/; on Mixtral a traceback, exit 1); ``quantize`` converts one but says so first, as
``gate checkpoint`` does, from the same check (``quant.checkpoint.tokenizer_problem``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evals.cli import evals_main
from evals.cli import main as gate_main
from quant.checkpoint import TOKENIZER_FILES
from quant.cli import main as quantize_main
from tests.quant.family_checkpoints import write_family_checkpoint

TOKENIZER_LESS = ("qwen3_moe", "mixtral")


def without_tokenizer(folder: Path) -> Path:
    """``folder`` as a model's ``save_pretrained`` leaves it: weights and config, no tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *TOKENIZER_FILES):
        (folder / name).unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first_model")
    return {family: without_tokenizer(write_family_checkpoint(root / family, family)) for family in TOKENIZER_LESS}


@pytest.mark.parametrize("family", TOKENIZER_LESS)
@pytest.mark.parametrize("resume", [False, True])
def test_evals_run_refuses_a_folder_without_tokenizer(saved, family, resume, tmp_path, capsys):
    out = tmp_path / "run"
    code = evals_main(["run", "--benchmarks", "gsm8k", "--limit", "1", "--model", str(saved[family]),
                       "--out", str(out), *(["--resume"] if resume else [])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(saved[family]) in lines[0], err
    assert "no tokenizer file" in lines[0] and "tokenizer.json and tokenizer_config.json" in lines[0]
    assert not out.exists()  # no tasks/, no units/, no lock


@pytest.mark.parametrize("to", ["mxfp4", "bf16"])
def test_quantize_says_a_source_has_no_tokenizer(saved, to, tmp_path, capsys):
    """Converted (the weights are sound and the tokenizer can follow) but said first, in the plan a
    --dry-run shows too, naming the folder and what to copy in; ``gate checkpoint`` names it on the output."""
    src = saved["qwen3_moe"]
    if to == "bf16":  # a quantized checkpoint without its tokenizer, decoded back
        assert quantize_main(["--to", "mxfp4", "-q", str(src), str(tmp_path / "mxfp4")]) == 0
        capsys.readouterr()
        src = tmp_path / "mxfp4"
    for dry_run in (True, False):
        out = tmp_path / "out"
        assert quantize_main(["--to", to, "-q", *(["--dry-run"] if dry_run else []), str(src), str(out)]) == 0
        said = capsys.readouterr()
        warnings = [line for line in said.out.splitlines() if "no tokenizer file" in line]
        assert len(warnings) == 1 and "Traceback" not in said.err, said
        assert warnings[0].startswith(f"warning     {src}: ")
        assert "tokenizer.json and tokenizer_config.json" in warnings[0]
        assert out.exists() != dry_run
    assert gate_main(["checkpoint", str(out)]) == 1
    report = capsys.readouterr().out
    assert "[layout] tokenizer" in report and "tokenizer.json and tokenizer_config.json" in report, report


def test_a_source_with_its_tokenizer_converts_without_the_warning(glm_ckpt, capsys):
    assert quantize_main(["--to", "mxfp4", "--dry-run", str(glm_ckpt), "unused"]) == 0
    assert "tokenizer" not in capsys.readouterr().out


def test_a_local_evaluation_leaves_nothing_in_tmpdir(tmp_path):
    """torch made $TMPDIR/torchinductor_<user> as lm-eval loaded torch._dynamo: now under the user's
    cache folder (XDG_CACHE_HOME here), nothing in $TMPDIR or in the installed package."""
    model = write_family_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    home, cache, tmpdir = (tmp_path / name for name in ("home", "cache", "tmpdir"))
    for folder in (home, cache, tmpdir):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(cache), TMPDIR=str(tmpdir))
    argv = ["run", "--benchmarks", "gsm8k", "--limit", "1", "--max-gen-toks", "1", "--model", str(model),
            "--out", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-c", f"import sys; from evals.cli import evals_main; "
                           f"sys.exit(evals_main({argv!r}))"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not list(tmpdir.iterdir())
    assert (cache / "quantgate" / "torchinductor").is_dir()


# ---- SRC and DST swapped: never a suggestion to overwrite the source --------------------------------

def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def converted(glm_ckpt, tmp_path_factory) -> Path:
    """A finished conversion of the tiny GLM-5 checkpoint (quantize's output, with its manifest)."""
    out = tmp_path_factory.mktemp("swapped") / "mxfp4"
    assert quantize_main(["--to", "mxfp4", "-q", str(glm_ckpt), str(out)]) == 0
    return out


@pytest.mark.parametrize("src, dst, to, says", [
    ("missing", "source", "mxfp4", "SRC and DST look swapped: {src} does not exist"),
    ("converted", "source", "mxfp4", "SRC and DST look swapped: {src} is quantize's output"),
    ("missing", "converted", "bf16", "SRC and DST look swapped: {src} does not exist"),  # decoding it was meant
    ("other", "source", "mxfp4", "if it is, SRC and DST are swapped"),
])
@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]])
def test_swapped_src_and_dst_never_suggest_overwriting_the_source(glm_ckpt, converted, tmp_path, capsys, src, dst, to,
                                                                  says, flags):
    """quantize SRC DST given as DST SRC: the source folder is not empty, and the refusal said "pass
    --overwrite to replace a previous conversion there" about the user's source. Now one line says
    what looks swapped, with any flag, and the folder is left as it was."""
    folders = {"missing": tmp_path / "new", "source": Path(shutil.copytree(glm_ckpt, tmp_path / "source")),
               "converted": Path(shutil.copytree(converted, tmp_path / "converted")), "other": glm_ckpt}
    before = tree(folders[dst])
    code = quantize_main(["--to", to, "-q", *flags, str(folders[src]), str(folders[dst])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"output folder {folders[dst]} holds a checkpoint" in lines[0], err
    assert says.format(src=folders[src]) in lines[0] and "--overwrite" not in lines[0], lines[0]
    assert tree(folders[dst]) == before and not (tmp_path / "new").exists()


# ---- the README's word on a release without --policy -------------------------------------------------

def test_a_release_of_the_example_without_its_policy_is_refused_as_the_readme_says(converted, tmp_path, capsys):
    """The README said such a release is "BLOCKed as not compared" (exit 1); it is refused, exit 2, in
    one line naming the shipped policy that names arith, and writes no report."""
    from tests.evals.test_gate import binary_pair, bundle, evaluated

    ref, cand = binary_pair(250, 2, 3)
    reference = bundle(tmp_path / "ref", "arith", ref)
    candidate = evaluated(bundle(tmp_path / "cand", "arith", cand), converted)
    before = tree(candidate)
    code = gate_main(["release", str(converted), "--candidate", str(candidate), "--reference", str(reference)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "names no margin for it" in lines[0] and "--policy arith-example" in lines[0], err
    assert tree(candidate) == before
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "BLOCKed as not compared" not in readme
    assert "without it the comparison is refused, exit 2, naming `--policy arith-example`" in readme
