"""Will the serving engine run this checkpoint's MoE on a tuned kernel? From config.json alone.

The engines pick their fused-MoE kernel from tables keyed by the MoE shape; a shape nobody tuned
runs on a default heuristic, silently and slower. This module derives the shapes sglang and vLLM
will request for a checkpoint on a GPU under TP/EP, and looks them up the way the engines do.

aiter (the ROCm kernel library; ROCm/aiter, aiter/fused_moe.py at the main branch of 2026, the
version with gfx-keyed tables and ``_PADDED_M_TIERS``):
- ``_fused_moe_impl`` calls ``get_2stage_cfgs(get_padded_M(M), model_dim, inter_dim, E, topk, dtype,
  q_dtype_a, q_dtype_w, quant_type, isG1U1, activation, doweight_stage1, ..., is_ep)``: M (tokens in
  the batch) is padded to the next power of two below 32768, to 32768 up to 131071, and to 131072
  beyond (``get_padded_M``); E is ``w1.shape[0]``, the experts on this rank; inter_dim the
  intermediate size per rank; under EP (an expert mask) one is taken off topk (``topk -= is_ep``).
- ``get_2stage_cfgs`` keys rows on (gfx, cu_num, token, model_dim, inter_dim, expert, topk, act_type,
  dtype, q_dtype_a, q_dtype_w, q_type, use_g1u1, doweight_stage1); tables without a gfx column get
  it from cu_num (``chip_info.gfx_from_cu_num``); rows tagged ``flydsl_fallback`` are set aside;
  the first of duplicate rows wins. A miss is retried with act_type ignored (only rows whose
  kernelName1 is not a ``moe_ck2stages`` kernel), then, for the 131072 tier, at the 32768 tier;
  still nothing: "[fused_moe] using 2stage default", aiter's heuristic kernels.
- The table is ``aiter/configs/tuned_fmoe.csv`` merged with ``aiter/configs/model_configs/
  *tuned_fmoe*.csv`` (not ``untuned``), or the ':'-separated files of ``AITER_CONFIG_FMOE``
  (aiter/jit/core.py, ``AITER_CONFIG.get_config_file`` / ``update_config_files``, commit
  024344700df3). Merging refuses duplicate shapes across files (RuntimeError at the first MoE call).

sglang 0.5.23: FusedMoE holds ``n_routed/ep + fused_shared`` experts per rank with intermediate
``moe_intermediate_size / (tp / ep)`` (layers/moe/fused_moe_triton/layer.py; moe_tp_size = tp // ep,
model_runner_components/moe_ep_setup.py); the shared expert is fused as one more expert (topk + 1)
when ``DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason`` (models/deepseek_v2.py) finds no
reason not to - a Quark checkpoint whose exclude list names a target-layer shared expert (a bf16
shared expert next to MXFP4 routed experts) cannot fuse (quark.py ``shared_expert_excluded_from_quant``
/ ``can_fuse_shared_expert``), nor can ``--disable-shared-experts-fusion``; decided by the rule
``gate checkpoint`` replays, for the checkpoint's family and the newest sglang release ``--engine``
selects (``quant.engines.fusion.main_model_fusion``; other classes decide by their own rules). Its
Triton configs are ``E=..,N=..,device_name=..[,dtype=..][,block_shape=[128, 128]].json`` with E and N from w2's shape
(``get_config_file_name``, ``try_get_optimal_moe_config``), searched under
``configs/triton_<version>/``; vLLM 0.33.0 spells block_shape without the space and searches
``fused_moe/configs/`` (layers/fused_moe/fused_moe.py ``get_config_file_name``, ``get_moe_configs``).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from quant.aiter_padding import RuleError, read_rule
from quant.checkpoint import read_json_object
from quant.engines.fusion import main_model_fusion
from quant.engines.replay import exclude_entries
from quant.engines.rules import RuleSet, select
from quant.engines.serving import Serving, from_args, gpu_table
from quant.errors import CheckpointError, QuantgateError
from quant.layout import Family, UnknownFamilyError, family_for, manifests_root
from quant.outputs import write_atomic
from quant.quark_config import config_kind
from quant.safe_files import read_regular
from quant.schema import Model, Schema, load

# aiter/fused_moe.py
PADDED_M_TIERS = (32768, 131072)
ACT_TYPE_IGNORED = "__ignore__"
KEY_COLUMNS = ("gfx", "cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype",
               "q_dtype_a", "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1")
INT_COLUMNS = {"cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "use_g1u1", "doweight_stage1"}
# aiter/configs/untuned_fmoe.csv's header: the tuner's input, and (with cu_num, gfx, _tag) the merge's dedup key.
UNTUNED_COLUMNS = ("token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
                   "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1")
AITER_TUNE = ("python3 {aiter}/csrc/ck_gemm_moe_2stages_codegen/gemm_moe_tune.py -i {untuned} "
              "-o aiter/configs/model_configs/<model>_tuned_fmoe.csv   (or serve once with AITER_ONLINE_TUNE=1)")
INTER_KEYS = ("moe_intermediate_size", "intermediate_size")  # the routed experts' width, the first present
TRITON_TUNE = {"sglang": "sglang benchmark/kernels/fused_moe_triton (tuning_fused_moe_triton.py --tune)",
               "vllm": "vllm benchmarks/kernels/benchmark_moe.py --tune"}


SOURCE_BYTES = 4 << 20  # aiter's fused_moe.py is ~100 kB
TABLE_BYTES = 64 << 20  # aiter's tuned_fmoe tables are a few MB


class KernelInputError(QuantgateError, ValueError):
    """The config or a table is unusable; the message names the file (and line) and the fix."""


def nextpow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_m(m: int) -> int:
    """aiter's ``get_padded_M``: the token count a batch of ``m`` tokens is looked up as."""
    if m < PADDED_M_TIERS[0]:
        return nextpow2(m)
    return max(t for t in PADDED_M_TIERS if m >= t)


def buckets(max_tokens: int, pad=None) -> list[tuple[int, int, int]]:
    """(bucket, first M, last M) for every batch size 1..max_tokens under the padding ``pad``."""
    pad = pad or padded_m
    out: list[tuple[int, int, int]] = []
    for m in range(1, max_tokens + 1):
        b = pad(m)
        if out and out[-1][0] == b:
            out[-1] = (b, out[-1][1], m)
        else:
            out.append((b, m, m))
    return out


@dataclass
class AiterSource:
    """The aiter release's own rules, read from its fused_moe.py when one is found beside the tables."""
    where: str
    pad: object  # M -> token looked up
    ep_strips_topk: bool


def aiter_source(configs: Path | None) -> AiterSource:
    """get_padded_M (with nextPow2, _PADDED_M_TIERS) taken from ``configs/../fused_moe.py`` (the
    --aiter-configs checkout's, else the installed aiter's) without importing aiter, which needs a
    GPU, and without running any of that file (``quant.aiter_padding`` interprets the rule);
    releases pad differently (PyPI amd-aiter 0.1.7: 16, powers of two, 1024 cap). Without that
    file: the replay above (aiter main, 2026)."""
    path = configs.parent / "fused_moe.py" if configs else None
    if path is None or not path.is_file():
        return AiterSource("built-in replay of aiter main (2026) get_padded_M", padded_m, True)
    try:
        source = read_regular(path, SOURCE_BYTES, KernelInputError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KernelInputError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}): not aiter's fused_moe.py") \
            from None
    try:
        rule = read_rule(path, source)
    except RuleError as exc:
        raise KernelInputError(f"{exc}: not an aiter fused_moe.py this check can read; remove it from beside the "
                               "tables to use the built-in rule") from None

    def pad(m: int) -> int:
        try:
            return rule(m)
        except (RuleError, ArithmeticError, TypeError, IndexError, KeyError) as exc:
            raise KernelInputError(f"{path}: get_padded_M({m}) cannot be read ({exc}); remove the file from beside "
                                   "the tables to use the built-in rule") from None

    return AiterSource(f"{path} get_padded_M", pad, "topk -= int(is_ep)" in source)


@dataclass(frozen=True)
class Gpu:
    name: str
    gfx: str
    cu_num: int
    fp8: str
    fp4: bool
    device_names: tuple[str, ...]


class TritonKey(Schema):
    """The dtype and block-shape parts of a Triton fused-MoE config file's name."""
    dtype: str | None
    block_shape: list[int] | None


class FormatEntry(Schema):
    """One checkpoint format of ``manifests/kernels/formats.yaml``: the MoE kernel keys it gives."""
    q_type: str
    q_dtype_a: str  # ``fp8``: the GPU's own FP8 dtype (``quant.engines.serving.GpuEntry.fp8``)
    q_dtype_w: str
    needs_fp4: bool
    triton: TritonKey | None  # None: the engine has no Triton path for it


class FormatsFile(Schema):
    formats: dict[str, FormatEntry]
    activations: dict[str, str]  # config.json hidden_act -> aiter ActivationType


def _table(name: str, schema: type[Model]) -> Model:
    """A kernel table shipped under ``manifests/kernels/``, read by the one YAML loader."""
    return load(manifests_root() / "kernels" / name, schema, "kernel table", KernelInputError,
                "restore it from the quantgate package")


def load_gpus() -> dict[str, Gpu]:
    return {k: Gpu(k, v.gfx, v.cu_num, v.fp8, v.fp4, tuple(v.device_names)) for k, v in gpu_table().gpus.items()}


def _formats() -> FormatsFile:
    return _table("formats.yaml", FormatsFile)


@dataclass
class MoeShape:
    """What one rank's FusedMoE asks the kernels for."""
    format: str
    model_dim: int
    inter_dim: int
    experts: int  # per rank, fused shared expert included
    topk: int  # routed + fused shared, as the engine passes it
    fused_shared: int
    fusion_reason: str  # why the shared expert is (not) fused
    act_type: str
    dtype: str
    q_dtype_a: str
    q_dtype_w: str
    q_type: str
    triton: dict | None
    tp: int
    ep: int
    notes: list[str] = field(default_factory=list)


def checkpoint_format(qconfig: dict | None) -> str:
    if not qconfig:
        return "bf16"
    method = config_kind(qconfig)
    if method == "quark":
        glob = qconfig.get("global_quant_config") or {}
        weight = (glob.get("weight") or {}).get("dtype")
        if weight != "fp4":
            raise KernelInputError(f"Quark weight dtype {weight!r}: only fp4 (MXFP4) MoE kernels are known here")
        return "mxfp4-w4a4" if (glob.get("input_tensors") or {}).get("dtype") == "fp4" else "mxfp4-w4a16"
    if method == "fp8" and list(qconfig.get("weight_block_size") or []) == [128, 128]:
        return "fp8-block"
    raise KernelInputError(f"quantization_config {qconfig.get('quant_method')!r} (weight_block_size "
                           f"{qconfig.get('weight_block_size')}): no MoE kernel table is known for it")


def sglang_rules(family: Family, engine: str) -> RuleSet | None:
    """The sglang rule set whose fusion decision sizes the MoE: the newest sglang release ``engine``
    selects (as ``gate checkpoint --engine`` does) for the family's model class; None without one."""
    chosen = [r for r in select(engine, family) if r.engine == "sglang"]
    return chosen[-1] if chosen else None


def shared_fusion(config: dict, family: Family, rules: RuleSet | None, setup: Serving) -> tuple[int, str]:
    """How many shared experts sglang folds into the routed FusedMoE (as expert ``n_routed``), decided
    by the rule ``gate checkpoint`` replays for the same release and setup (``quant.engines.fusion``)."""
    if rules is None:
        return 0, "not fused: no sglang release selected (vLLM keeps the shared expert out of the FusedMoE)"
    qconfig = config.get("quantization_config") or {}
    kind = config_kind(qconfig)
    entries = exclude_entries(qconfig, rules, kind, setup) if kind else []
    return main_model_fusion(rules, family, config, kind, entries, setup, qconfig)


def _require(config: dict, key: str, path: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise KernelInputError(f"{path}: {key} is {value!r}; this is not a MoE config sglang builds a FusedMoE for")
    return value


def derive_shape(config: dict, gpu: Gpu, setup: Serving, engine: str = "all",
                 path: Path = Path("config.json")) -> MoeShape:
    """The per-rank MoE shape sglang builds for this config on ``gpu`` under the setup's TP/EP, read
    through the checkpoint's family (its text config, its routed-experts key, its shared expert)."""
    try:
        family = family_for(config)
    except UnknownFamilyError as exc:
        raise KernelInputError(f"{path}: {exc}") from None
    text = family.text_config(config)
    hidden = _require(text, "hidden_size", path)
    # families without dense layers keep the experts' width in intermediate_size (Mixtral, MiniMax-M2)
    inter = _require(text, next((k for k in INTER_KEYS if k in text), INTER_KEYS[0]), path)
    experts_key = next((k for k in family.experts_keys if k in text), None)
    if experts_key is None:
        raise KernelInputError(f"{path}: none of {', '.join(family.experts_keys) or 'the routed-expert keys'} "
                               f"({family.name}): not a MoE model")
    routed = _require(text, experts_key, path)
    topk = _require(text, "num_experts_per_tok", path)
    tp, ep = setup.tp, setup.ep
    if tp % ep:
        raise KernelInputError(f"--tp {tp} --ep {ep}: sglang needs EP to divide TP (moe_tp_size = tp // ep)")
    moe_tp = tp // ep
    if inter % moe_tp or routed % ep:
        raise KernelInputError(f"{path}: {family.name} expert width {inter} / moe_tp {moe_tp} or {experts_key} "
                               f"{routed} / EP {ep} is not whole: sglang refuses this split")
    fmt = checkpoint_format(config.get("quantization_config"))
    spec = _formats()
    fmt_spec = spec.formats[fmt]
    act = text.get("hidden_act", "silu")
    fused, reason = shared_fusion(config, family, sglang_rules(family, engine), setup)
    resolve = lambda d: gpu.fp8 if d == "fp8" else d  # noqa: E731
    dtype = "torch.float16" if str(text.get("torch_dtype") or text.get("dtype")) == "float16" else "torch.bfloat16"
    shape = MoeShape(fmt, hidden, inter // moe_tp, routed // ep + fused, topk + fused, fused, reason,
                     spec.activations.get(act, "ActivationType.Gelu"), dtype,
                     resolve(fmt_spec.q_dtype_a), resolve(fmt_spec.q_dtype_w), fmt_spec.q_type,
                     fmt_spec.triton and fmt_spec.triton.model_dump(), tp, ep)
    if fmt_spec.needs_fp4 and not gpu.fp4:
        shape.notes.append(f"{gpu.name} ({gpu.gfx}) has no MXFP4 MoE kernels: aiter's per_1x32 fp4x2 path is gfx950")
    if fmt == "mxfp4-w4a16":
        shape.notes.append("W4A16: sglang refuses it (Quark MXFP4 needs an fp4 input_tensors spec); aiter would "
                           "quantize activations to fp4x2 anyway for a Silu MoE")
    return shape


# --- aiter tables -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    source: str  # file:line
    key: tuple
    values: dict


def _parse_int(text: str, where: str, column: str) -> int:
    text = text.strip()
    if text in ("True", "False"):
        return int(text == "True")
    try:
        number = float(text) if len(text) <= 40 else math.nan  # no table number has more digits
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise KernelInputError(f"{where}: column {column} is {text[:40]!r}, not an integer")
    if number != int(number):
        raise KernelInputError(f"{where}: column {column} is {text!r}, not an integer")
    return int(number)


def read_table(path: Path) -> list[Row]:
    """One aiter tuned-fMoE CSV, validated; rows keep their file:line."""
    try:
        text = read_regular(path, TABLE_BYTES, KernelInputError).decode("utf-8")
    except OSError as exc:
        raise KernelInputError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise KernelInputError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}); aiter's tables are plain "
                               "ASCII CSV") from None
    try:
        return _rows(path, csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:  # e.g. a field over csv's 128 kB limit
        raise KernelInputError(f"{path}: not a CSV this check can read ({exc}); aiter's tables have short fields") \
            from None


def _rows(path: Path, reader) -> list[Row]:
    header = next(reader, None)
    if not header:
        raise KernelInputError(f"{path}:1: empty file, expected aiter's header (cu_num,token,model_dim,...)")
    header = [h.strip() for h in header]
    missing = [c for c in KEY_COLUMNS[1:] + ("kernelName1", "kernelName2") if c not in header]
    if missing:
        raise KernelInputError(f"{path}:1: header lacks {missing}: not an aiter tuned_fmoe table")
    rows = []
    for fields in reader:
        where = f"{path}:{reader.line_num}"
        if not any(f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise KernelInputError(f"{where}: {len(fields)} fields, the header has {len(header)}")
        record = dict(zip(header, (f.strip() for f in fields)))
        for column in INT_COLUMNS:
            record[column] = _parse_int(record[column], where, column)
        if not record.get("gfx") or record["gfx"] in ("0", "nan", "None"):
            record["gfx"] = _gfx_of_cu_num().get(record["cu_num"], "")  # "" = the live GPU's arch
        rows.append(Row(where, tuple(record[c] for c in KEY_COLUMNS), record))
    return rows


@cache
def _gfx_of_cu_num() -> dict[int, str]:
    """aiter's chip_info._LEGACY_CU_NUM_TO_GFX, read from the GPU table (each CU count is one arch)."""
    return {gpu.cu_num: gpu.gfx for gpu in load_gpus().values()}


def installed_aiter_configs() -> Path | None:
    spec = importlib.util.find_spec("aiter")
    origin = spec and (spec.submodule_search_locations or [None])[0]
    return Path(origin) / "configs" if origin and (Path(origin) / "configs").is_dir() else None


def find_tables(aiter_configs: Path | None) -> tuple[list[Path], str]:
    """The files aiter merges, and where they were found (aiter/jit/core.py get_config_file)."""
    env = os.environ.get("AITER_CONFIG_FMOE")
    if aiter_configs is None and env:
        return [Path(p) for p in env.split(os.pathsep) if p], "AITER_CONFIG_FMOE"
    if aiter_configs is None:
        aiter_configs, where = installed_aiter_configs(), "installed aiter"
        if aiter_configs is None:
            raise KernelInputError("no aiter tables: install aiter (PyPI: amd-aiter) or pass --aiter-configs DIR "
                                   "(the aiter/configs folder of an aiter checkout)")
    else:
        where = "--aiter-configs"
    if not aiter_configs.is_dir():
        raise KernelInputError(f"{aiter_configs}: not a folder (expected aiter/configs with tuned_fmoe.csv)")
    files = [aiter_configs / "tuned_fmoe.csv"] if (aiter_configs / "tuned_fmoe.csv").exists() else []
    files += sorted(p for p in (aiter_configs / "model_configs").glob("*tuned_fmoe*.csv")
                    if p.is_file() and "untuned" not in p.name)
    if not files:
        raise KernelInputError(f"{aiter_configs}: no tuned_fmoe.csv and no model_configs/*tuned_fmoe*.csv")
    return files, f"{where} {aiter_configs}"


@dataclass
class AiterTables:
    primary: dict
    fallback: dict
    files: list[str]


def load_tables(files: list[Path]) -> AiterTables:
    rows = [row for path in files for row in read_table(path)]
    if len(files) > 1:  # update_config_files: duplicate shapes across the merged files stop aiter
        seen: dict[tuple, str] = {}
        for row in rows:
            dedup = tuple(row.values[c] for c in UNTUNED_COLUMNS + ("cu_num", "gfx")) + (row.values.get("_tag", ""),)
            if dedup in seen:
                raise KernelInputError(f"{row.source}: the same shape as {seen[dedup]}: aiter refuses to merge "
                                       "duplicate shapes (RuntimeError); keep one of the two rows")
            seen[dedup] = row.source
    primary: dict = {}
    fallback: dict = {}
    for row in rows:
        if row.values.get("_tag") == "flydsl_fallback":
            continue
        primary.setdefault(row.key, row)
        if "moe_ck2stages" not in row.values.get("kernelName1", ""):
            fallback.setdefault(row.key[:7] + (ACT_TYPE_IGNORED,) + row.key[8:], row)
    return AiterTables(primary, fallback, [str(f) for f in files])


def aiter_key(shape: MoeShape, gpu: Gpu, token: int, ep_strips_topk: bool = True) -> tuple:
    topk = shape.topk - (1 if shape.ep > 1 and ep_strips_topk else 0)  # get_2stage_cfgs: topk -= int(is_ep)
    return (gpu.gfx, gpu.cu_num, token, shape.model_dim, shape.inter_dim, shape.experts, topk, shape.act_type,
            shape.dtype, shape.q_dtype_a, shape.q_dtype_w, shape.q_type, 1, 0)


def lookup(tables: AiterTables, key: tuple) -> tuple[Row | None, str]:
    """get_2stage_cfgs's _lookup_cfg; an empty gfx in a row means "whatever GPU runs it"."""
    def get(k):
        ignore_act = k[:7] + (ACT_TYPE_IGNORED,) + k[8:]
        for candidate in (k, ("",) + k[1:]):
            if candidate in tables.primary:
                return tables.primary[candidate], "exact"
        for candidate in (ignore_act, ("",) + ignore_act[1:]):
            if candidate in tables.fallback:
                return tables.fallback[candidate], "act_type ignored"
        return None, ""

    row, how = get(key)
    token = key[2]
    if row is None and token > PADDED_M_TIERS[0] and token in PADDED_M_TIERS:
        for tier in reversed(PADDED_M_TIERS[:PADDED_M_TIERS.index(token)]):
            row, how = get(key[:2] + (tier,) + key[3:])
            if row is not None:
                return row, f"{how}, from the {tier} tier"
    return row, how


# --- Triton configs ---------------------------------------------------------------------------

def triton_names(engine: str, shape: MoeShape, gpu: Gpu) -> list[str]:
    """Candidate file names (one per device-name spelling): get_config_file_name of each engine."""
    dtype = shape.triton["dtype"]
    block = shape.triton["block_shape"]
    # vLLM's Triton path does not fuse the shared expert
    experts = shape.experts if engine == "sglang" else shape.experts - shape.fused_shared
    block_part = f",block_shape={block}" if block else ""
    if engine == "vllm":
        block_part = block_part.replace(" ", "")
    dtype_part = f",dtype={dtype}" if dtype else ""
    return [f"E={experts},N={shape.inter_dim},device_name={d}{dtype_part}{block_part}.json" for d in gpu.device_names]


def engine_config_dirs(engine: str, root: Path | None) -> list[Path] | None:
    """Where the engine looks for Triton configs; None when the engine is not installed."""
    if root is None:
        spec = importlib.util.find_spec(engine)
        locations = spec.submodule_search_locations if spec else None
        if not locations:
            return None
        root = Path(locations[0])
    if engine == "sglang":
        base = Path(os.environ.get("SGLANG_MOE_CONFIG_DIR", root / "srt/layers/moe/moe_runner/triton_utils"))
        return sorted((base / "configs").glob("triton_*"), reverse=True)
    dirs = [Path(os.environ["VLLM_TUNED_CONFIG_FOLDER"])] if os.environ.get("VLLM_TUNED_CONFIG_FOLDER") else []
    return dirs + [root / "model_executor/layers/fused_moe/configs"]


# --- the check --------------------------------------------------------------------------------

@dataclass
class KernelReport:
    checkpoint: str
    gpu: dict
    shape: dict
    tables: list[str]
    padding: str  # whose get_padded_M made the buckets
    buckets: list[dict]  # token range, bucket, tuned?, kernels, source
    triton: dict  # engine -> {status, names, found}
    backend: str
    untuned_rows: list[str]
    aiter_topk: int  # topk as aiter keys its tables (one less under EP: get_2stage_cfgs' `topk -= is_ep`)
    serving: dict  # the setup judged (quant.engines.serving.Serving), as gate checkpoint records it
    engine: str  # the sglang rule set whose shared-expert fusion sized the MoE ("none": no sglang release)

    @property
    def fallbacks(self) -> list[dict]:
        return [b for b in self.buckets if not b["tuned"]]

    @property
    def triton_missing(self) -> list[str]:
        return [e for e, t in self.triton.items() if t["status"] == "default"]

    @property
    def ok(self) -> bool:
        aiter_ok = self.backend == "triton" or not self.fallbacks
        triton_ok = self.backend == "aiter" or not self.triton_missing
        return aiter_ok and triton_ok

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def read_config(checkpoint: Path) -> dict:
    """The config.json of a checkpoint folder (or that file itself)."""
    path = checkpoint / "config.json" if checkpoint.is_dir() else checkpoint
    try:
        return read_json_object(path, "config.json")
    except CheckpointError as exc:
        raise KernelInputError(str(exc)) from None


def check(checkpoint: Path, setup: Serving, engine: str = "all", aiter_configs: Path | None = None,
          max_tokens: int = 32768, backend: str = "aiter",
          engine_roots: dict[str, Path] | None = None) -> KernelReport:
    gpus = load_gpus()
    if setup.gpu is None:
        raise KernelInputError(f"{setup.platform} {setup.gpu_arch} names no GPU model: aiter keys its tables on the "
                               f"CU count; give --gpu ({', '.join(gpus)})")
    if max_tokens < 1:
        raise KernelInputError(f"--max-tokens {max_tokens}: must be at least 1")
    gpu = gpus[setup.gpu]
    config = read_config(checkpoint)
    shape = derive_shape(config, gpu, setup, engine, checkpoint)
    files, where = find_tables(aiter_configs)
    tables = load_tables(files)
    rules = aiter_source(aiter_configs or installed_aiter_configs())  # the aiter that will read the tables
    results, untuned = [], []
    for bucket, first, last in buckets(max_tokens, rules.pad):
        key = aiter_key(shape, gpu, bucket, rules.ep_strips_topk)
        row, how = lookup(tables, key)
        entry = {"tokens": [first, last], "bucket": bucket, "tuned": row is not None}
        if row is None:
            untuned.append(",".join(str(v) for v in (bucket,) + key[3:]))
        else:
            entry.update({"kernel1": row.values["kernelName1"], "kernel2": row.values["kernelName2"],
                          "block_m": row.values.get("block_m"), "source": row.source, "match": how})
        results.append(entry)
    triton = {}
    for name in ("sglang", "vllm"):
        if shape.triton is None:
            triton[name] = {"status": "n/a", "why": "no Triton path for this format (aiter only)"}
            continue
        names = triton_names(name, shape, gpu)
        dirs = engine_config_dirs(name, (engine_roots or {}).get(name))
        if dirs is None:
            triton[name] = {"status": "unknown", "names": names, "why": f"{name} is not installed here"}
            continue
        found = [str(d / n) for d in dirs for n in names if (d / n).is_file()]
        triton[name] = {"status": "tuned" if found else "default", "names": names, "found": found[:1],
                        "searched": [str(d) for d in dirs]}
    sglang = sglang_rules(family_for(config), engine)
    return KernelReport(str(checkpoint), asdict(gpu), asdict(shape), [where] + tables.files, rules.where, results,
                        triton, backend, untuned, aiter_key(shape, gpu, 1, rules.ep_strips_topk)[6], asdict(setup),
                        sglang.id if sglang else "none")


def write_untuned(rows: list[str], path: Path) -> None:
    """The missing shapes in aiter's untuned_fmoe.csv layout (the tuner's -i input), written atomically."""
    write_atomic(path, ",".join(UNTUNED_COLUMNS) + "\n" + "".join(r + "\n" for r in rows))


def _aiter_topk(report: KernelReport) -> str:
    if report.aiter_topk == report.shape["topk"]:
        return ""
    return f" (aiter's tables and the untuned rows key it as {report.aiter_topk}: `topk -= is_ep` under EP)"


def human(report: KernelReport) -> str:
    s, g = report.shape, report.gpu
    lines = [f"kernels  {report.checkpoint}  on {g['name']} ({g['gfx']}, {g['cu_num']} CUs)  TP{s['tp']} EP{s['ep']}",
             f"serving     {Serving(**report.serving).label()}; shared-expert fusion as {report.engine}",
             f"MoE per rank: model_dim {s['model_dim']}, inter_dim {s['inter_dim']}, experts {s['experts']}, "
             f"topk {s['topk']}{_aiter_topk(report)}  ({s['format']}: {s['q_type']}, a {s['q_dtype_a']}, w {s['q_dtype_w']}, "
             f"{s['act_type']})",
             f"shared expert: {s['fusion_reason']}"]
    lines += [f"note: {n}" for n in s["notes"]]
    lines.append(f"aiter tables ({report.tables[0]}): {len(report.tables) - 1} file(s); buckets: {report.padding}")
    for b in report.buckets:
        tokens = f"{b['tokens'][0]}-{b['tokens'][1]}" if b["tokens"][0] != b["tokens"][1] else str(b["tokens"][0])
        kernels_used = f"{b['kernel1']} + {b['kernel2']}" if b.get("kernel2") else f"{b.get('kernel1')} (1-stage)"
        state = (f"tuned    {kernels_used} ({Path(b['source']).name}"
                 f"{'; ' + b['match'] if b['match'] != 'exact' else ''})" if b["tuned"] else "FALLBACK aiter's default "
                 "heuristic (no tuned row)")
        lines.append(f"  M {tokens:>13} -> token {b['bucket']:>6}  {state}")
    tuned = len(report.buckets) - len(report.fallbacks)
    lines.append(f"aiter: {tuned}/{len(report.buckets)} token buckets tuned")
    for engine, t in report.triton.items():
        detail = t.get("found", [None])[0] if t["status"] == "tuned" else t.get("why") or f"none of {t['names']}"
        lines.append(f"triton ({engine}): {t['status']}  {detail}")
    if report.fallbacks:
        lines.append(f"fix: tune the shape (token,model_dim,inter_dim,expert,topk,... = "
                     f"{report.untuned_rows[0].split(',', 1)[1]}) for tokens "
                     f"{', '.join(str(b['bucket']) for b in report.fallbacks)}: write the rows with --untuned-out "
                     f"untuned.csv, then " + AITER_TUNE.format(aiter="<aiter checkout>", untuned="untuned.csv"))
        if "exclude list" in s["fusion_reason"]:
            lines.append(f"hint: with the shared expert quantized too, sglang fuses it (experts {s['experts'] + 1}, "
                         f"topk {s['topk'] + 1}), the shape aiter's published MXFP4 tables are keyed on: check it")
    for engine in report.triton_missing:
        lines.append(f"fix ({engine} Triton): {TRITON_TUNE[engine]}")
    verdict = "all tuned" if report.ok else "FALLBACK: " + "; ".join(
        ([f"aiter untuned for {len(report.fallbacks)} token bucket(s)"] if report.fallbacks and report.backend != "triton"
         else []) + ([f"{e} Triton default config" for e in report.triton_missing] if report.backend != "aiter" else []))
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


# --- command line (``gate kernels``; ``gate release --gpu``) -----------------------------------

HELP = """\
Derive, from config.json alone, the fused-MoE shape sglang requests per rank (model_dim, inter_dim
under TP/EP, experts per rank with the shared expert fused or not, topk, act/weight dtypes and
q_type from the quantization_config), read through the checkpoint's family (its text config, its
routed-experts key, its shared expert); whether the shared expert is fused is the decision gate
checkpoint replays for the same setup and the newest sglang release --engine selects. Then look it
up in aiter's tuned tables exactly as aiter does, for every token bucket a batch of 1..--max-tokens
tokens maps to; and name the Triton fused-MoE config files sglang and vLLM would read (present, or
the default config).

example: gate kernels /ckpt/GLM-5-mxfp4 --gpu mi355x --tp 4 --aiter-configs ~/aiter/aiter/configs
         gate kernels /ckpt/GLM-4.5-mxfp4 --engine sglang==0.5.23 --disable-shared-experts-fusion
The serving setup flags (default: MI355X, TP 8, fusion on) are gate checkpoint's and gate release's.

exit codes: 0 every bucket tuned; 1 some fall back to a default kernel (named, with the shape and
the command that tunes it); 2 bad input (config, table: file and line)"""


def add_arguments(parser, release: bool = False) -> None:
    """The kernel check's own flags; the serving setup's (GPU, TP, EP, engine, fusion) are
    ``quant.engines.serving.add_arguments``, shared with gate checkpoint and gate release."""
    if not release:
        parser.add_argument("dir", type=Path, help="checkpoint folder (only config.json is read) or a config.json")
    parser.add_argument("--aiter-configs", type=Path, metavar="DIR",
                        help="aiter/configs folder to read (default: AITER_CONFIG_FMOE, else the installed aiter)")
    if release:
        return
    parser.add_argument("--max-tokens", type=int, default=32768,
                        help="largest batch (tokens per MoE call) to cover; default 32768 (chunked prefill size)")
    parser.add_argument("--backend", choices=["aiter", "triton", "both"], default="aiter",
                        help="which engine kernel path decides the exit code (aiter: the ROCm default, and the "
                             "only path for MXFP4); Triton configs are reported either way")
    parser.add_argument("--sglang-root", type=Path, metavar="DIR", help="sglang package folder (default: installed)")
    parser.add_argument("--vllm-root", type=Path, metavar="DIR", help="vllm package folder (default: installed)")
    parser.add_argument("--untuned-out", type=Path, metavar="FILE",
                        help="write the untuned shapes as aiter's untuned_fmoe.csv (the tuner's input)")
    parser.add_argument("--json", action="store_true", help="machine-readable report on stdout")


def run_cli(args) -> int:
    import sys

    try:
        report = check(args.dir, from_args(args), args.engine, args.aiter_configs, args.max_tokens,
                       args.backend, {"sglang": args.sglang_root, "vllm": args.vllm_root})
    except KernelInputError as exc:
        print(f"gate: error: {exc}", file=sys.stderr)
        return 2
    if args.untuned_out and report.untuned_rows:
        write_untuned(report.untuned_rows, args.untuned_out)
    print(json.dumps(report.to_dict(), indent=2) if args.json else human(report))
    return 0 if report.ok else 1


def release_check(args, policy: dict, setup: Serving) -> dict | None:
    """The kernel check inside ``gate release`` (run when --gpu names the GPU), for the release's
    serving setup: warning-level unless the policy's kernels.blocking."""
    if not args.gpu:
        return None
    blocking = bool((policy.get("kernels") or {}).get("blocking", False))
    try:
        report = check(args.checkpoint, setup, args.engine, args.aiter_configs)
    except KernelInputError as exc:
        return {"ok": False, "blocking": blocking, "error": str(exc), "summary": f"kernel check failed: {exc}"}
    tuned = len(report.buckets) - len(report.fallbacks)
    summary = (f"MoE kernels on {setup.gpu} TP{setup.tp} EP{setup.ep}: {tuned}/{len(report.buckets)} aiter token "
               f"buckets tuned" + ("" if report.ok else f"; untuned: "
                                   f"{', '.join(str(b['bucket']) for b in report.fallbacks)}"))
    return {**report.to_dict(), "blocking": blocking, "summary": summary, "text": human(report)}
