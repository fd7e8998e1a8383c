"""``gate kernels``: GLM-5-sized MoE shapes looked up in tables written in aiter's exact layout.

data/aiter_configs/model_configs/a8w8_blockscale_tuned_fmoe_glm5.2.csv is ROCm/aiter's published
GLM-5.2 FP8 table verbatim (aiter/configs/model_configs/, commit 49bcfdc9b6d2: gfx950, cu_num 256,
model_dim 6144, inter_dim 512 = 2048 / TP4, expert 257, topk 9, per_1x128, tokens 1..32768);
data/aiter_configs/tuned_fmoe.csv holds two rows of aiter's legacy main table (no gfx column,
commit 027a5956546f). FP4_ROWS below are rows of aiter's glm5_fp4_tuned_fmoe.csv (commit 01ff06ed7fc8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.cli import main as gate
from quant import kernels
from quant.convert import convert
from quant.engines.serving import serving
from quant.example import glm5_config
from quant.layout import family_for
from quant.plan import make_plan
from quant.quark_config import fp8_config
from quant.recipe import load_recipe
from tests.conftest import write_sparse_checkpoint
from tests.evals.test_gate import binary_pair, bundle, evaluated, gsm8k_policy

AITER = Path(__file__).parent / "data" / "aiter_configs"
HEADER = ("gfx,cu_num,token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,q_type,use_g1u1,"
          "doweight_stage1,block_m,ksplit,us1,kernelName1,err1,us2,kernelName2,err2,us,run_1stage,xbf16,flat,tflops,"
          "bw,_tag")
FP4 = "ActivationType.Silu,torch.bfloat16,torch.float4_e2m1fn_x2,torch.float4_e2m1fn_x2,QuantType.per_1x32,1,0"
FP4_ROWS = [
    f"gfx950,256,1,6144,512,257,9,{FP4},32,0,11.5491,flydsl_moe1_afp4_wfp4_bf16_t32x32x256_w4_kw4_fp4,1.0%,7.3233,"
    "flydsl_moe2_layout_afp4_wfp4_bf16_t32x128x128_atomic_sbm32,1.3%,18.8724,0,0,0,9.0,128514.38,",
    f"gfx950,256,2,6144,512,257,9,{FP4},16,0,28.7583,flydsl_mxmoe_g1_a4w4_16x256x256_f16in_nt,0.012391,0.0,"
    "flydsl_moe2_layout_afp4_wfp4_bf16_t16x128x256_atomic_sbm16,0.012391,28.7583,0,0,0,0.0,0.0,",
]


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> dict[str, Path]:
    """GLM-5 at real MoE dims (one MoE layer + MTP), planned with quantgate's own recipes."""
    config = glm5_config()
    config.update(num_hidden_layers=4, mlp_layer_types=config["mlp_layer_types"][:4],
                  layer_types=config["layer_types"][:4], indexer_types=config["indexer_types"][:4])
    root = tmp_path_factory.mktemp("glm5")
    write_sparse_checkpoint(root / "bf16", config, shards=4)
    out = {"bf16": root / "bf16"}
    for name, recipe in (("mxfp4", load_recipe()), ("fp8", load_recipe(to="fp8"))):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(make_plan(root / "bf16", recipe).output_config()))
        out[name] = root / name
    shared = json.loads((out["mxfp4"] / "config.json").read_text())  # shared experts MXFP4 too
    shared["quantization_config"]["exclude"] = [e for e in shared["quantization_config"]["exclude"]
                                                if "shared_experts" not in e]
    (root / "mxfp4-shared").mkdir()
    (root / "mxfp4-shared" / "config.json").write_text(json.dumps(shared))
    out["mxfp4-shared"] = root / "mxfp4-shared"
    return out


def tables(tmp_path: Path, files: dict[str, list[str]]) -> Path:
    """An aiter/configs folder: {name: csv lines}; names with a '/' go under model_configs."""
    for name, lines in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    return tmp_path


def run(capsys, *args) -> tuple[int, dict, str]:
    code = gate(["kernels", *map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {}), out.err


def test_token_padding_replays_aiter_get_padded_m():
    assert [kernels.padded_m(m) for m in (1, 2, 3, 17, 1000, 32767, 32768, 131071, 131072, 10**6)] == \
        [1, 2, 4, 32, 1024, 32768, 32768, 32768, 131072, 131072]
    spans = kernels.buckets(200000)
    assert spans[:3] == [(1, 1, 1), (2, 2, 2), (4, 3, 4)]
    assert spans[-2:] == [(32768, 16385, 131071), (131072, 131072, 200000)]
    assert all(b[1] == a[2] + 1 for a, b in zip(spans, spans[1:]))  # every batch size lands in one bucket


def test_fp8_tp4_finds_every_row_of_aiters_glm52_table(glm5, capsys):
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", AITER)
    shape = report["shape"]
    assert (shape["model_dim"], shape["inter_dim"], shape["experts"], shape["topk"]) == (6144, 512, 257, 9)
    assert shape["q_type"] == "QuantType.per_1x128" and shape["q_dtype_w"] == "torch.float8_e4m3fn"
    assert code == 0 and report["ok"]
    assert [b["bucket"] for b in report["buckets"]] == [2 ** i for i in range(16)]
    lines = {int(b["source"].rsplit(":", 1)[1]) for b in report["buckets"]}
    assert lines == set(range(2, 18))  # each of the 16 published rows, once
    assert report["buckets"][-1]["kernel1"] == "_ZN5aiter46fmoe_bf16_blockscaleFp8_g1u1_vs_ps_silu_64x256E"


def test_mxfp4_with_bf16_shared_expert_finds_nothing_and_says_so(glm5, tmp_path, capsys):
    untuned = tmp_path / "untuned.csv"
    code = gate(["kernels", str(glm5["mxfp4"]), "--gpu", "mi355x", "--tp", "4", "--aiter-configs", str(AITER),
                 "--untuned-out", str(untuned)])
    text = capsys.readouterr().out
    assert code == 1
    assert "experts 256, topk 8" in text and "not fused" in text and "shared_experts" in text
    assert "aiter: 0/16 token buckets tuned" in text and "gemm_moe_tune.py" in text
    rows = untuned.read_text().splitlines()
    assert rows[0] == ",".join(kernels.UNTUNED_COLUMNS) and len(rows) == 17
    assert rows[1] == ("1,6144,512,256,8,ActivationType.Silu,torch.bfloat16,torch.float4_e2m1fn_x2,"
                       "torch.float4_e2m1fn_x2,QuantType.per_1x32,1,0")


def test_shared_expert_fusion_on_and_off(glm5, tmp_path, capsys):
    configs = tables(tmp_path, {"model_configs/glm5_fp4_tuned_fmoe.csv": [HEADER, *FP4_ROWS]})
    code, report, _ = run(capsys, glm5["mxfp4-shared"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs)
    assert (report["shape"]["experts"], report["shape"]["topk"], report["shape"]["fused_shared"]) == (257, 9, 1)
    assert [b["tuned"] for b in report["buckets"][:3]] == [True, True, False] and code == 1
    code, report, _ = run(capsys, glm5["mxfp4-shared"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs,
                          "--disable-shared-experts-fusion")
    assert (report["shape"]["experts"], report["shape"]["topk"]) == (256, 8)
    assert not any(b["tuned"] for b in report["buckets"])
    # FP8 (no Quark exclude rule) fuses; a non-GLM/DeepSeek architecture never does
    config = json.loads((glm5["fp8"] / "config.json").read_text())
    family, setup = family_for(config), serving(gpu="mi355x", tp=4)
    rules = kernels.sglang_rules(family, "all")
    fused, _ = kernels.shared_fusion(config, family, rules, setup)
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    assert (fused, kernels.shared_fusion(config, family, rules, setup)[0]) == (1, 0)


def test_tp8_and_ep_shapes(glm5, tmp_path, capsys):
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "8", "--aiter-configs", AITER)
    assert (report["shape"]["inter_dim"], report["shape"]["experts"]) == (256, 257)
    assert code == 1 and not any(b["tuned"] for b in report["buckets"])  # the published table is TP4 only
    gpu = kernels.load_gpus()["mi355x"]
    config = json.loads((glm5["fp8"] / "config.json").read_text())
    shape = kernels.derive_shape(config, gpu, serving(gpu="mi355x", tp=8, ep=8))
    assert (shape.inter_dim, shape.experts, shape.topk) == (2048, 33, 9)  # 256/8 routed + the shared one
    assert kernels.aiter_key(shape, gpu, 64)[:7] == ("gfx950", 256, 64, 6144, 2048, 33, 8)  # topk -= is_ep
    shape = kernels.derive_shape(config, gpu, serving(gpu="mi355x", tp=8, ep=2))
    assert (shape.inter_dim, shape.experts) == (512, 129)  # moe_tp = tp // ep = 4
    row = ("gfx950,256,64,6144,2048,33,8,ActivationType.Silu,torch.bfloat16,torch.float8_e4m3fn,torch.float8_e4m3fn,"
           "QuantType.per_1x128,1,0,64,0,1.0,kernel_ep_a,0.0%,1.0,kernel_ep_b,0.0%,2.0,0,0,0,1.0,1.0,")
    configs = tables(tmp_path, {"tuned_fmoe.csv": [HEADER, row]})
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "8", "--ep", "8", "--aiter-configs",
                          configs, "--max-tokens", "64")
    assert report["buckets"][-1]["kernel1"] == "kernel_ep_a" and sum(b["tuned"] for b in report["buckets"]) == 1
    code, _, err = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "8", "--ep", "3", "--aiter-configs", AITER)
    assert code == 2 and "EP to divide TP" in err


def test_mi300x_keys_on_gfx942_and_fnuz_and_backfills_legacy_tables(glm5, tmp_path, capsys):
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi300x", "--tp", "4", "--aiter-configs", AITER)
    assert report["shape"]["q_dtype_a"] == "torch.float8_e4m3fnuz" and code == 1  # the gfx950 rows do not apply
    legacy = HEADER.replace("gfx,", "").replace(",flat", "")
    row = ("304,1,6144,512,257,9,ActivationType.Silu,torch.bfloat16,torch.float8_e4m3fnuz,torch.float8_e4m3fnuz,"
           "QuantType.per_1x128,1,0,16,0,1.0,legacy_k1,0.0%,1.0,legacy_k2,0.0%,2.0,0,0,1.0,1.0,")
    configs = tables(tmp_path, {"tuned_fmoe.csv": [legacy, row]})
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi300x", "--tp", "4", "--aiter-configs", configs,
                          "--max-tokens", "1")
    assert code == 0 and report["buckets"][0]["kernel1"] == "legacy_k1"  # cu_num 304 -> gfx942


def test_lookup_fallbacks_act_type_tiers_and_flydsl_tags(glm5, tmp_path, capsys):
    gelu = FP4_ROWS[0].replace("gfx950,256,1,", "gfx950,256,2048,").replace("ActivationType.Silu", "ActivationType.Gelu")
    ck = gelu.replace(",2048,", ",4096,").replace("flydsl_moe1", "moe_ck2stages_gemm1")
    tier = FP4_ROWS[1].replace("gfx950,256,2,", "gfx950,256,32768,")
    tagged = FP4_ROWS[0].replace("gfx950,256,1,", "gfx950,256,8,").rstrip(",") + ",flydsl_fallback"
    configs = tables(tmp_path, {"tuned_fmoe.csv": [HEADER, gelu, ck, tier, tagged]})
    code, report, _ = run(capsys, glm5["mxfp4-shared"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs,
                          "--max-tokens", "200000")
    by_bucket = {b["bucket"]: b for b in report["buckets"]}
    assert by_bucket[2048]["tuned"] and by_bucket[2048]["match"] == "act_type ignored"
    assert not by_bucket[4096]["tuned"]  # a ck2stages row never matches another activation
    assert by_bucket[131072]["match"] == "exact, from the 32768 tier" and by_bucket[32768]["tuned"]
    assert not by_bucket[8]["tuned"]  # flydsl_fallback rows are set aside


# get_padded_M and nextPow2 of the aiter release on PyPI (amd-aiter 0.1.7.post2.dev18, aiter/fused_moe.py)
OLD_AITER_FUSED_MOE = """import torch  # never executed: only the pure functions are taken
import aiter


def nextPow2(n):
    if n <= 0:
        return 1
    return 1 << (n - 1).bit_length()


def get_padded_M(M):
    padded_m = M
    if M >= 1 and M <= 16:
        padded_m = 16
    elif M < 1024:
        padded_m = nextPow2(padded_m)
    else:
        padded_m = 1024
    return padded_m
"""


def test_buckets_come_from_the_aiter_release_beside_the_tables(glm5, tmp_path, capsys):
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "fused_moe.py").write_text(OLD_AITER_FUSED_MOE)
    configs = tables(tmp_path / "aiter" / "configs",
                     {"model_configs/glm_tuned_fmoe.csv": (AITER / "model_configs" /
                                                           "a8w8_blockscale_tuned_fmoe_glm5.2.csv").read_text().split()})
    code, report, _ = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs)
    assert [(b["bucket"], *b["tokens"]) for b in report["buckets"]][::3] == \
        [(16, 1, 16), (128, 65, 128), (1024, 513, 32768)]
    assert code == 0 and report["padding"].endswith("fused_moe.py get_padded_M")
    rules = kernels.aiter_source(configs)
    shape = kernels.derive_shape(json.loads((glm5["fp8"] / "config.json").read_text()), kernels.load_gpus()["mi355x"],
                                 serving(gpu="mi355x", tp=8, ep=8))
    assert kernels.aiter_key(shape, kernels.load_gpus()["mi355x"], 16, rules.ep_strips_topk)[6] == 9  # no EP strip


@pytest.mark.parametrize("lines, message", [
    ([HEADER, FP4_ROWS[0].replace(",1,6144,", ",one,6144,", 1)], ":2: column token is 'one', not an integer"),
    ([HEADER, FP4_ROWS[0], FP4_ROWS[1].rsplit(",", 3)[0]], ":3: 26 fields, the header has 29"),
    (["gfx,cu_num,token,model_dim", "gfx950,256,1,6144"], ":1: header lacks"),
    ([], ":1: empty file"),
])
def test_malformed_tables_name_file_and_line(glm5, tmp_path, capsys, lines, message):
    configs = tables(tmp_path, {"model_configs/bad_tuned_fmoe.csv": lines})
    code, _, err = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs)
    assert code == 2 and "bad_tuned_fmoe.csv" + message in err and "Traceback" not in err


def test_duplicate_shapes_across_merged_files_are_refused(glm5, tmp_path, capsys):
    configs = tables(tmp_path, {"tuned_fmoe.csv": [HEADER, FP4_ROWS[0]],
                                "model_configs/x_tuned_fmoe.csv": [HEADER, FP4_ROWS[1], FP4_ROWS[0]]})
    code, _, err = run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", configs)
    assert code == 2 and "x_tuned_fmoe.csv:3: the same shape as" in err and "tuned_fmoe.csv:2" in err


def test_triton_config_names_present_or_default(glm5, tmp_path, capsys):
    sglang = tmp_path / "sglang"
    folder = sglang / "srt/layers/moe/moe_runner/triton_utils/configs/triton_3_4_0"
    folder.mkdir(parents=True)
    name = "E=257,N=512,device_name=AMD_Instinct_MI355X,dtype=fp8_w8a8,block_shape=[128, 128].json"
    (folder / name).write_text("{}")
    vllm = tmp_path / "vllm"
    (vllm / "model_executor/layers/fused_moe/configs").mkdir(parents=True)
    args = (glm5["fp8"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", AITER, "--sglang-root", sglang,
            "--vllm-root", vllm)
    code, report, _ = run(capsys, *args)
    assert code == 0 and report["triton"]["sglang"]["status"] == "tuned"
    assert report["triton"]["vllm"]["status"] == "default"
    assert report["triton"]["vllm"]["names"][0] == \
        "E=256,N=512,device_name=AMD_Instinct_MI355X,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert run(capsys, *args, "--backend", "both")[0] == 1
    code, report, _ = run(capsys, glm5["mxfp4"], "--gpu", "mi355x", "--tp", "4", "--aiter-configs", AITER,
                          "--sglang-root", sglang)
    assert report["triton"]["sglang"]["status"] == "n/a"


def test_bad_configs_exit_2(glm5, tmp_path, capsys):
    assert "config.json: missing" in run(capsys, tmp_path, "--gpu", "mi355x", "--tp", "4", "--aiter-configs", AITER)[2]
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128}))
    code, _, err = run(capsys, dense, "--gpu", "mi355x", "--tp", "1", "--aiter-configs", AITER)
    assert code == 2 and "model_type None: no model family" in err  # the family says where the MoE is
    (dense / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64,
                                                   "intermediate_size": 128}))
    code, _, err = run(capsys, dense, "--gpu", "mi355x", "--tp", "1", "--aiter-configs", AITER)
    assert code == 2 and "none of num_local_experts (mixtral): not a MoE model" in err
    config = json.loads((glm5["fp8"] / "config.json").read_text())
    config["quantization_config"] = fp8_config([]) | {"weight_block_size": None}
    (dense / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, dense, "--gpu", "mi355x", "--tp", "4", "--aiter-configs", AITER)
    assert code == 2 and "no MoE kernel table is known" in err
    assert run(capsys, glm5["fp8"], "--gpu", "mi355x", "--tp", "3", "--aiter-configs", AITER)[0] == 2


def test_release_reports_kernels_as_a_warning_unless_the_policy_blocks(glm_ckpt, tmp_path, capsys):
    ckpt = tmp_path / "mxfp4"
    convert(make_plan(glm_ckpt, load_recipe()), ckpt, show_progress=False)
    ref, cand = binary_pair(1000, 3, 3)
    r, c = bundle(tmp_path / "r", "gsm8k", ref), evaluated(bundle(tmp_path / "c", "gsm8k", cand), ckpt)
    policy = gsm8k_policy(tmp_path / "policy.yaml")  # the bundles hold GSM8K only
    args = ["release", str(ckpt), "--candidate", str(c), "--reference", str(r), "--gpu", "mi355x", "--tp", "1",
            "--aiter-configs", str(AITER)]
    assert gate([*args, "--policy", str(policy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "RELEASE" and not report["kernels"]["ok"] and not report["kernels"]["blocking"]
    assert "## MoE kernels (warning)" in (c / "report.md").read_text()
    (tmp_path / "blocking.yaml").write_text(policy.read_text() + "kernels: {blocking: true}\n")
    assert gate([*args, "--policy", str(tmp_path / "blocking.yaml"), "--overwrite"]) == 1  # another policy
    out = capsys.readouterr().out
    assert "aiter token buckets tuned; untuned:" in out and "(BLOCKING)" in out and "release verdict: BLOCK" in out
