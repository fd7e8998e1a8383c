"""One serving setup for the commands that judge a checkpoint: ``gate checkpoint``, ``gate kernels``
and ``gate release`` take the same setup flags, record the setup in their reports, and give the same
answer on the same checkpoint and setup: whether sglang folds the shared expert into the routed
FusedMoE is decided once, by the rules read for the checkpoint's family and the release asked for.

The checkpoints are the families' tiny releases (tests/quant/family_checkpoints.py) converted by
``quantize --to mxfp4`` (routed experts MXFP4, the shared expert kept bf16 by the exclude list) and
``--to fp8``: GLM-4.5 (sglang's Glm4Moe class fuses the shared expert whatever the exclude list says,
so the bf16 shared expert meets MXFP4 slots), Qwen3-Next (a shared expert under ``shared_expert``,
sized by ``shared_expert_intermediate_size``: fused in FP8, where no exclude list vetoes it), Mixtral
(experts counted by ``num_local_experts``, no shared expert) and Kimi-K2.5 (the language model's config
under ``text_config``; 4 routed experts is not a configuration the DeepSeek class fuses).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.cli import main as gate
from quant.cli import main as quantize
from tests.evals.test_gate import binary_pair, bundle, evaluated, gsm8k_policy
from tests.quant.family_checkpoints import write_family_checkpoint

AITER = Path(__file__).parents[1] / "quant" / "data" / "aiter_configs"
RELEASE = "sglang==0.5.23"
# TP 8 is the default; stated (--tp 8), it would also check the block-FP8 partitions and the heads per rank,
# which the tiny models (2 heads, 64 wide) cannot meet: tests/quant/test_block_partition.py checks those
SETUP = ["--engine", RELEASE, "--gpu", "mi355x"]
# (family, format) -> (shared experts fused into the FusedMoE by sglang 0.5.23 on MI355X, TP 8; it loads)
EXPECT = {("glm4_moe", "mxfp4"): (1, False), ("qwen3_next", "mxfp4"): (0, True), ("mixtral", "mxfp4"): (0, True),
          ("kimi_k25", "mxfp4"): (0, True), ("glm4_moe", "fp8"): (1, True), ("qwen3_next", "fp8"): (1, True),
          ("mixtral", "fp8"): (0, True), ("kimi_k25", "fp8"): (0, True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, to in EXPECT:
        src = root / family / "bf16"
        if not src.exists():
            write_family_checkpoint(src, family)
        assert quantize(["--to", to, str(src), str(root / family / to)]) == 0
        out[family, to] = root / family / to
    return out


def run(capsys, *args) -> tuple[int, dict]:
    code = gate([*map(str, args), "--json"])
    out = capsys.readouterr()
    assert code in (0, 1), out.err
    return code, json.loads(out.out)


def release(capsys, tmp_path: Path, checkpoint: Path, *setup) -> tuple[int, dict]:
    """``gate release`` with identical accuracy bundles (nothing but the checkpoint can block)."""
    ref, cand = binary_pair(1000, 3, 3)
    r = bundle(tmp_path / "r", "gsm8k", ref)
    c = evaluated(bundle(tmp_path / "c", "gsm8k", cand), checkpoint)
    return run(capsys, "release", checkpoint, "--candidate", c, "--reference", r, "--policy",
               gsm8k_policy(tmp_path / "policy.yaml"), "--aiter-configs", AITER, *setup)


@pytest.mark.parametrize("case", sorted(EXPECT), ids="-".join)
def test_the_three_commands_agree(case, checkpoints, tmp_path, capsys):
    ckpt = checkpoints[case]
    fused, loads = EXPECT[case]
    code, structure = run(capsys, "checkpoint", ckpt, *SETUP)
    assert (code == 0) == loads == structure["ok"]
    decision = structure["engines"]["sglang 0.5.23 (rules of 0.5.21..0.5.23)"]["shared_expert_fusion"]
    assert decision["fused"] == bool(fused)

    _, kern = run(capsys, "kernels", ckpt, *SETUP, "--aiter-configs", AITER)
    assert kern["shape"]["fused_shared"] == fused and kern["shape"]["fusion_reason"] == decision["why"]
    assert kern["serving"] == structure["serving"] and kern["engine"] == "sglang 0.5.23 (rules of 0.5.21..0.5.23)"

    code, report = release(capsys, tmp_path, ckpt, *SETUP)
    assert report["structure"] == structure and (report["verdict"] == "RELEASE") == loads == (code == 0)
    assert report["kernels"]["shape"] == kern["shape"] and report["kernels"]["serving"] == structure["serving"]


def test_disable_shared_experts_fusion_is_one_setup_for_all_three(checkpoints, tmp_path, capsys):
    """GLM-4.5 with a bf16 shared expert loads only when sglang is started without fusion: the
    release judges that setup when it is told it, as gate checkpoint and gate kernels do."""
    ckpt, off = checkpoints["glm4_moe", "mxfp4"], [*SETUP, "--disable-shared-experts-fusion"]
    code, structure = run(capsys, "checkpoint", ckpt, *off)
    assert code == 0 and structure["serving"]["disable_shared_experts_fusion"]
    _, kern = run(capsys, "kernels", ckpt, *off, "--aiter-configs", AITER)
    assert kern["shape"]["fused_shared"] == 0 and "--disable-shared-experts-fusion" in kern["shape"]["fusion_reason"]
    code, report = release(capsys, tmp_path / "off", ckpt, *off)
    assert code == 0 and report["verdict"] == "RELEASE" and report["structure"] == structure
    md = (tmp_path / "off" / "c" / "report.md").read_text()
    assert "- serving setup: rocm gfx950 (mi355x), tp 8, --disable-shared-experts-fusion" in md
    code, report = release(capsys, tmp_path / "on", ckpt, *SETUP)
    assert code == 1 and report["verdict"] == "BLOCK" and not report["structure"]["ok"]


def test_the_setup_is_written_in_each_text_report(checkpoints, capsys):
    ckpt = checkpoints["mixtral", "mxfp4"]
    for command in (["checkpoint"], ["kernels", "--aiter-configs", str(AITER)]):
        gate([command[0], str(ckpt), *SETUP, "--ep", "2", *command[1:]])
        assert "serving     rocm gfx950 (mi355x), tp 8, ep 2" in capsys.readouterr().out, command


def test_a_setup_that_contradicts_itself_is_refused_alike(checkpoints, capsys):
    """The setup is read by one function: each command refuses the same contradiction in one line."""
    ckpt = checkpoints["mixtral", "mxfp4"]
    for command in (["checkpoint"], ["kernels", "--aiter-configs", str(AITER)]):
        assert gate([command[0], str(ckpt), "--gpu", "mi300x", "--gpu-arch", "gfx950", *command[1:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--gpu mi300x is ROCm gfx942; --platform rocm --gpu-arch gfx950" in err
    assert gate(["kernels", str(ckpt), "--platform", "cuda", "--aiter-configs", str(AITER)]) == 2
    assert "cuda sm90 names no GPU model: aiter keys its tables on the CU count" in capsys.readouterr().err
