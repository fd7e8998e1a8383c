"""Structural checks of a finished checkpoint against its config and the engines' loading rules.

Headers and config only (seconds on 1.5 TB); ``deep`` also reads tensor data. Every finding
names the module or tensor, why it fails and what to do.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from quant import blocks
from quant.checkpoint import INDEX_NAME, TOKENIZER_FIX, Checkpoint, config_int, tokenizer_problem
from quant.engines import Finding, Module, ReplayContext, UnknownEngine, quark_layers, replay
from quant.engines.block_partition import block_findings, check_heads, tp_summary
from quant.engines.config import layer_kind_findings, model_findings, quark_findings, router_tensors
from quant.engines.format_rules import cut
from quant.engines.fusion import main_model_fusion
from quant.engines.replay import exclude_entries, is_draft, loads_under
from quant.engines.serving import DEFAULT, Serving
from quant.errors import CheckpointError, QuantgateError
from quant.formats.codecs import Codec, codec_for_config, get_codec
from quant.formats.constants import BLOCK
from quant.layout import UnknownFamilyError, family_for, weight_named
from quant.quark_config import CONFIG_KINDS, THIRD_PARTY, config_kind, format_kind
from quant.release_check import named
from quant.release_results import REPLAYED, ReleaseResult, check_spec, moe_shape, targets
from quant.rungs import INPUT_SCALE, SCALAR_DTYPES, stored_rung
from quant.safe_files import open_regular_fd
from quant.safetensors_io import DTYPE_BYTES, TensorInfo
from quant.structure import declared_counts, expert_id_findings, structure_findings
from quant.third_party import OnDisk, UnsupportedScheme, parse, read_modules
from quant.third_party_scales import missing_scale_findings, scale_findings, scale_suffix

FLOAT_DTYPES = ("BF16", "F16", "F32")
GLOB_CHARS = set("*?[")


class UnreadableCheckpoint(QuantgateError, ValueError):
    """Not a checkpoint, or one that cannot be read (exit code 2)."""


@dataclass
class Report:
    checkpoint: str
    engines: list[str]
    findings: list[Finding] = field(default_factory=list)
    modules_checked: int = 0
    modules_quantized: int = 0  # 0: a plain (e.g. bf16) checkpoint; it loads, but nothing was quantized
    serving: Serving = DEFAULT
    conditions: dict[str, list[tuple[Serving, bool]]] = field(default_factory=dict)  # rule set id -> loads per condition
    # sglang rule set id -> whether it folds the main model's shared expert into the routed FusedMoE, and why
    fusion: dict[str, dict] = field(default_factory=dict)
    # block FP8: per engine release span, the TP sizes it loads at (quant.engines.block_partition.tp_summary)
    block_fp8_tp: list[str] = field(default_factory=list)

    releases: list[ReleaseResult] = field(default_factory=list)  # every release asked for, oldest first per engine
    # the MTP draft's findings (what the same release does not find without the draft): among ``findings``
    # when served with the draft (serving.speculative), apart otherwise
    draft_findings: list[Finding] = field(default_factory=list)
    moe: dict[str, dict] = field(default_factory=dict)  # rule set id -> the MoE shape it runs (release_results)
    has_draft: bool = False  # the checkpoint holds MTP layers (a speculative draft)
    family: str = ""  # the family the checkpoint was read as (its rules are its model classes')

    @property
    def ok(self) -> bool:
        return not self.findings

    def for_engine(self, engine: str) -> list[Finding]:
        return [f for f in self.findings if f.engine in (None, engine)]

    def replayed(self, engine: str) -> list[ReleaseResult]:
        return [r for r in self.releases if r.engine == engine and r.state in REPLAYED]

    def not_read(self, engine: str) -> list[ReleaseResult]:
        return [r for r in self.releases if r.engine == engine and r.state not in REPLAYED]

    def groups(self, engine: str) -> list[tuple[list[ReleaseResult], list[Finding]]]:
        """The replayed releases of ``engine`` grouped by what their rule sets find (the findings of
        every release, engine None, apart), in the order first met."""
        grouped: dict[tuple, tuple[list[ReleaseResult], list[Finding]]] = {}
        for result in self.replayed(engine):
            own = [f for f in self.findings if f.engine == result.rules]
            key = tuple((f.check, f.module, f.why, f.fix) for f in own)
            grouped.setdefault(key, ([], own))[0].append(result)
        return list(grouped.values())

    def failing(self) -> list[str]:
        """Per engine, the release ranges that fail ('sglang 0.5.13-0.5.17')."""
        out = []
        for engine in dict.fromkeys(r.engine for r in self.releases):
            bad = [r.release for results, found in self.groups(engine) if found for r in results]
            out += [named(engine, bad)] if bad else []
        return out

    @property
    def verdict(self) -> str:
        if not self.ok:
            every = any(f.engine is None for f in self.findings)
            return "would NOT load correctly" + ("" if every else f" ({'; '.join(self.failing())})")
        unread = [f"{named(e, [r.release for r in rs])} ({', '.join(dict.fromkeys(r.state for r in rs))})"
                  for e in dict.fromkeys(r.engine for r in self.releases) if (rs := self.not_read(e))]
        if unread:  # a release not replayed is not vouched for
            return f"loads correctly in every release read; not read: {'; '.join(unread)}"
        return "loads correctly"

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "family": self.family, "ok": self.ok, "verdict": self.verdict,
                "modules_checked": self.modules_checked, "modules_quantized": self.modules_quantized,
                "serving": asdict(self.serving), "block_fp8_tp": self.block_fp8_tp,
                "engines": {e: {"ok": not self.for_engine(e), "findings": [asdict(f) for f in self.for_engine(e)],
                                "draft_findings": [asdict(f) for f in self.draft_findings if f.engine == e],
                                "loads_under": [{**asdict(s), "loads": ok} for s, ok in self.conditions.get(e, [])],
                                **({"shared_expert_fusion": self.fusion[e]} if e in self.fusion else {}),
                                **({"moe": self.moe[e]} if e in self.moe else {})}
                            for e in self.engines},
                "releases": {engine: [{**asdict(r), "ok": r.rules is not None and not self.for_engine(r.rules)}
                                      for r in self.releases if r.engine == engine]
                             for engine in dict.fromkeys(r.engine for r in self.releases)}}


def _layout_findings(checkpoint: Checkpoint, fmt: Codec | None) -> list[Finding]:
    findings = []
    tensors = checkpoint.tensors()
    suffix = fmt.scale_suffix if fmt else "_scale"
    for name, info in sorted(tensors.items()):
        if not name.endswith(".weight"):
            continue
        scale = tensors.get(name + suffix)
        if fmt and info.dtype == fmt.weight_dtype:
            # a stacked expert tensor [E, out, in] (fused_experts writes: stacked): each expert's matrix as one
            stacked = info.shape[:1] if len(info.shape) == 3 else ()
            if problem := fmt.stored_shape_problem(info.shape[len(stacked):]):
                findings.append(Finding("layout", None, name, f"{info.dtype}{list(info.shape)}: {problem}",
                                        "re-export the checkpoint; the engines cannot load this weight"))
                continue
            _, scale_dtype, scale_shape = fmt.outputs(name, fmt.logical_shape(info.shape[len(stacked):]))[1]
            expected = (None, scale_dtype, (*stacked, *scale_shape))
            if scale is None:
                findings.append(Finding("layout", None, name, f"{info.dtype} weight without weight{suffix}: the engines "
                                        "load it silently as garbage", "re-export the checkpoint; the scale is missing"))
            elif scale.dtype != expected[1] or scale.shape != tuple(expected[2]):
                findings.append(Finding("layout", None, name + suffix,
                                        f"scale {scale.dtype}{list(scale.shape)} does not fit the {fmt.name} weight "
                                        f"{info.dtype}{list(info.shape)}: expected {expected[1]}{list(expected[2])}",
                                        "re-export the checkpoint"))
        elif info.dtype in FLOAT_DTYPES and scale is not None:
            findings.append(Finding("layout", None, name, f"{info.dtype} weight has a weight_scale",
                                    "drop the stray scale or re-export"))
    missing, unlisted = checkpoint.index_problems()
    findings += [Finding("layout", None, p.name, p.why, p.fix) for p in missing + unlisted]
    if checkpoint.index is not None:
        metadata = checkpoint.index.get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        file_bytes = sum(h.file_size for h in checkpoint.headers.values())
        data_bytes = sum(t.nbytes for t in tensors.values())
        if total is not None and total not in (file_bytes, data_bytes):
            findings.append(Finding("layout", None, INDEX_NAME, f"total_size {total} matches neither the tensor bytes "
                                    f"({data_bytes}) nor the shard sizes ({file_bytes})", "regenerate the index"))
    if why := tokenizer_problem(checkpoint.folder):
        findings.append(Finding("layout", None, "tokenizer", f"{why}; the engines cannot start without one",
                                TOKENIZER_FIX))
    return findings


def _rung_findings(tensors) -> list[Finding]:
    """A per-layer Quark checkpoint's FP8 weights and static activation scales (``quant.rungs``): each module
    holding one must store a whole rung (an FP8 weight with one weight_scale and an input_scale, or an
    MXFP4 weight with its scales and an input_scale), each per-tensor scale one float value (Quark 0.13 writes
    bf16 for a bf16 model; the engines copy any float into their float32 parameters)."""
    findings = []
    modules = {n.removesuffix(".weight") for n, i in tensors.items() if n.endswith(".weight") and i.dtype == "F8_E4M3"}
    modules |= {n.removesuffix(INPUT_SCALE) for n in tensors if n.endswith(INPUT_SCALE)}
    for module in sorted(modules):
        if stored_rung(tensors, module) in ("", "bf16"):  # bf16: a kept weight with a stray input_scale
            held = ", ".join(f"{n.removeprefix(module)} {tensors[n].dtype}" for n in sorted(tensors)
                             if n.startswith(module + ".") and n.count(".") == module.count(".") + 1)
            findings.append(Finding("layout", None, module, f"holds {held}: no rung's tensors (W4A8: U8 weight, U8 "
                                    "weight_scale, BF16 input_scale; W8A8: F8_E4M3 weight, BF16 weight_scale, "
                                    "BF16 input_scale; F32 scales load too)",
                                    "re-export the module with all of its rung's tensors"))
            continue
        scalars = [module + INPUT_SCALE] + ([module + ".weight_scale"] if tensors[module + ".weight"].dtype ==
                                            "F8_E4M3" else [])
        for name in scalars:
            info = tensors[name]
            if info.dtype not in SCALAR_DTYPES or math.prod(info.shape) != 1:
                findings.append(Finding("layout", None, name, f"{info.dtype}{list(info.shape)}: a per-tensor scale "
                                        f"is one {'/'.join(SCALAR_DTYPES)} value (the engines load it into a "
                                        "one-element float32 parameter)",
                                        "re-export the checkpoint"))
    return findings


def _missing_layers(tensors, num_hidden_layers: int, prefix: str = "model.layers") -> list[Finding]:
    """Decoder layers the config declares but no shard holds (a dropped shard, an index cut short);
    routed experts: ``quant.structure``."""
    findings, layers = [], {}
    for name in tensors:
        if m := re.match(re.escape(prefix) + r"\.(\d+)\.", name):
            layers[int(m.group(1))] = True
    absent, n_absent = _first_absent(num_hidden_layers, layers)
    if absent:
        shown = ", ".join(map(str, absent)) + (f" and {n_absent - len(absent)} more" if n_absent > len(absent) else "")
        findings.append(Finding("layout", None, f"{prefix}.{absent[0]}",
                                f"config.json declares {num_hidden_layers} layers but layers {shown} have no tensor "
                                "in the checkpoint", "re-copy the missing shards (or fix the index that omits them)"))
    return findings


def _first_absent(declared: int, present, shown: int = 8) -> tuple[list[int], int]:
    """The first ``shown`` of ``0..declared-1`` not in ``present``, and how many are absent in all:
    work and memory follow what is on disk, not what the config declares (10**9 layers is a line)."""
    first: list[int] = []
    index = 0
    while len(first) < shown and index < declared:
        if index not in present:
            first.append(index)
        index += 1
    return first, declared - sum(1 for i in set(present) if 0 <= i < declared)


def _exclude_list(qconfig: dict) -> tuple[list[str] | None, list[Finding]]:
    """The exclude entries the engines can use, and findings for the ones they would choke on.

    ``None`` when the list itself is malformed: replaying it would only add misleading findings."""
    exclude = qconfig.get("exclude")
    if exclude is None:
        return [], []
    if not isinstance(exclude, list):
        return None, [Finding("config", None, "quantization_config.exclude",
                              f"must be a list of module names; it is the {type(exclude).__name__} {exclude!r:.60}",
                              'write "exclude": ["model.layers.0.self_attn.q_proj", ...] (quantize writes it)')]
    usable, findings = [], []
    for entry in exclude:
        if not isinstance(entry, str):
            findings.append(Finding("config", None, repr(entry), "exclude entries must be strings", "fix the entry"))
            continue
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                findings.append(Finding("config", None, entry, f"not a valid regular expression ({exc}): the engines "
                                        "raise re.error while loading", "fix the pattern after 're:'"))
                continue
        usable.append(entry)
    return usable, findings


def _config_findings(qconfig: dict | None, has_u8: bool) -> list[Finding]:
    if qconfig is None:
        return [Finding("config", None, "quantization_config", "U8 weights but no quantization_config",
                        "re-export the checkpoint")] if has_u8 else []
    findings = []
    if config_kind(qconfig) != "quark":
        return findings  # not a Quark checkpoint: nothing more to check here
    for key in ("layer_quant_config", "layer_type_quant_config"):
        if not isinstance(qconfig.get(key), dict):
            findings.append(Finding("config", None, f"quantization_config.{key}",
                                    "must be a dict: vLLM iterates it unguarded", f'write "{key}": {{}}'))
    for entry in qconfig.get("exclude") if isinstance(qconfig.get("exclude"), list) else []:
        if isinstance(entry, str) and not entry.startswith("re:") and GLOB_CHARS & set(entry):
            findings.append(Finding("config", None, entry, "glob entry: the engines match exclude entries exactly "
                                    "(or by re: regex), so it matches nothing",
                                    "replace it with the exact module names (quantize writes them)"))
    return findings


# --deep reads a tensor this many bytes at a time (its bf16 decode too), so its memory is a few of
# these whatever a tensor's size; a quantized weight's scales, 1/16 of its bytes at most, are read whole
DEEP_CHUNK_BYTES = 16 << 20


class _TensorReader:
    """Tensor bytes of a checkpoint's shards by ``pread``, a bounded piece at a time: never mapped or
    loaded whole, and a shard cut short since its header was read is an error naming it."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint, self.fds = checkpoint, {}
        self.where = {name: file for file, header in checkpoint.headers.items() for name in header.tensors}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds.values():
            os.close(fd)

    def read(self, info: TensorInfo, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of tensor ``info`` from ``offset`` into it."""
        file = self.where[info.name]
        if file not in self.fds:
            self.fds[file] = open_regular_fd(self.checkpoint.path(file), UnreadableCheckpoint)
        data = os.pread(self.fds[file], nbytes, info.begin + offset)
        while len(data) < nbytes and (more := os.pread(self.fds[file], nbytes - len(data), info.begin + offset
                                                         + len(data))):
            data += more
        if len(data) < nbytes:
            raise UnreadableCheckpoint(f"{self.checkpoint.path(file)}: ends inside tensor {info.name}, shorter than "
                                       "its header says (changed while checked?); rerun gate checkpoint")
        return data

    def rows(self, info: TensorInfo, rows: int, step: int):
        """(first row, uint8 ``[count, bytes a row]``) of ``info`` seen as ``rows`` rows, ``step`` rows at a time."""
        row_bytes = info.nbytes // rows if rows else 0
        for start in range(0, rows, step):
            count = min(step, rows - start)
            data = self.read(info, start * row_bytes, count * row_bytes)
            yield start, np.frombuffer(data, np.uint8).reshape(count, row_bytes)

    def whole(self, info: TensorInfo, rows: int):
        """``info`` as uint8 ``[rows, bytes a row]`` (a scale tensor: small beside its weight)."""
        return np.frombuffer(self.read(info, 0, info.nbytes), np.uint8).reshape(rows, -1)

    def step(self, row_bytes: int, multiple: int = 1) -> int:
        """Rows a chunk holds: whole multiples of ``multiple``, about ``DEEP_CHUNK_BYTES`` of ``row_bytes`` rows."""
        return max(multiple, DEEP_CHUNK_BYTES // max(row_bytes, 1) // multiple * multiple)


def _decode_findings(fmt: Codec, reader: _TensorReader, weight: TensorInfo, scale: TensorInfo, rows: int,
                     cols: int) -> list[Finding]:
    """What the decoder would refuse in one quantized weight (``rows`` x ``cols`` values): a scale or
    code the format forbids, or a value decoding to NaN/Inf (``shard._decoded_rows`` runs the same
    checks), decoded a chunk of rows at a time."""
    from quant.source import first_non_finite

    fix = "re-export the checkpoint (the engines would serve NaN, Inf or sign-flipped weights)"
    multiple = fmt.row_multiple
    scales = reader.whole(scale, -(-rows // multiple))
    if problem := fmt.scale_problem(scales):
        return [Finding("values", None, scale.name, problem, fix)]
    for start, codes in reader.rows(weight, rows, reader.step(cols * 2, multiple)):  # bounded by the bf16 decoded
        if problem := fmt.code_problem(codes, start):
            return [Finding("values", None, weight.name, problem, fix)]
        first = start // multiple
        out = fmt.decode_bytes(codes, scales[first:first + -(-codes.shape[0] // multiple)])
        if (bad := first_non_finite(out.data, "BF16")) is not None:
            return [Finding("values", None, weight.name, f"decodes to NaN/Inf at row {start + bad // cols}, column "
                            f"{bad % cols}: its scale is too large for bf16", fix)]
    return []


def _deep_findings(checkpoint: Checkpoint, fmt: Codec | None, third_party: dict[str, OnDisk] | None = None) \
        -> list[Finding]:
    """``third_party``: a compressed-tensors or ModelOpt checkpoint's quantized modules (``read_modules``),
    whose scales are checked as the engines use them (``quant.third_party_scales``)."""
    from quant.source import first_non_finite

    findings = []
    tensors = checkpoint.tensors()
    with _TensorReader(checkpoint) as reader:
        for header in checkpoint.headers.values():
            for name, info in header.tensors.items():
                if fmt and info.dtype == fmt.weight_dtype and name.endswith(".weight"):
                    scale = tensors.get(name + fmt.scale_suffix)
                    if scale is None or fmt.stored_shape_problem(info.shape) or \
                            (scale.dtype, scale.shape) != fmt.outputs(name, fmt.logical_shape(info.shape))[1][1:]:
                        continue  # the layout findings name it; there is nothing to decode it with
                    rows, cols = fmt.logical_shape(info.shape)
                    findings += _decode_findings(fmt, reader, info, scale, rows, cols)
                elif name.endswith(".weight_scale") and info.dtype == "U8" and len(info.shape) == 2:  # MX scales
                    nan, zero_rows = False, 0
                    for _, chunk in reader.rows(info, info.shape[0], reader.step(info.shape[1])):
                        nan = nan or bool((chunk == 255).any())
                        zero_rows += int((chunk == 0).all(axis=-1).sum())
                    if (fmt is None or fmt.scale_dtype != "U8") and nan:
                        findings.append(Finding("values", None, name, "scale byte 255 (E8M0 NaN)", "re-export"))
                    if zero_rows:
                        findings.append(Finding("layout", None, name, f"{zero_rows} all-zero scale rows (never "
                                                "written?)", "re-export this shard"))
                elif third_party is not None and scale_suffix(name):  # its own finding says what the engines make of it
                    findings += scale_findings(info, reader.read)
                elif info.dtype in FLOAT_DTYPES:  # element by element: a chunk needs no whole rows
                    item = DTYPE_BYTES[info.dtype]
                    elements = info.nbytes // item
                    if any(first_non_finite(chunk.data, info.dtype) is not None
                           for _, chunk in reader.rows(info, elements, reader.step(item))):
                        findings.append(Finding("layout", None, name, "NaN/Inf values", "fix the source and re-export"))
    return findings + (missing_scale_findings(tensors, third_party) if third_party is not None else [])


def _malformed_qconfig(qconfig) -> list[Finding]:
    """A quantization_config whose shape the engines cannot read (checked before anything reads into it)."""
    if qconfig is None:
        return []
    key, part = "quantization_config", qconfig
    for child in ("global_quant_config", "weight", None):
        if not isinstance(part, dict):
            return [Finding("config", None, key, f"must be an object, not a {type(part).__name__}: the engines cannot "
                            "read it", "re-export the checkpoint (quantize writes Quark's quantization_config)")]
        if child:
            key, part = f"{key}.{child}", part.get(child) or {}
    return []


def verify(folder: Path, engine: str = "all", deep: bool = False, serving: Serving = DEFAULT) -> Report:
    """Check ``folder`` for every engine release ``engine`` selects (``all``, ``sglang``,
    ``sglang==0.5.23``, ``vllm`` ...) served as ``serving``; findings are reported per release's rule
    set, and for each sglang release the GPUs and switches under which it loads."""
    try:
        check_spec(engine)  # an unknown engine or release is refused before the checkpoint is read
    except UnknownEngine as exc:
        raise UnreadableCheckpoint(str(exc)) from None
    try:
        checkpoint = Checkpoint.open(folder)
        family = family_for(checkpoint.config)
        num_hidden_layers = config_int(family.text_config(checkpoint.config), family.num_layers_key,
                                       checkpoint.config_path)
        declared = declared_counts(checkpoint, family)  # before anything is sized from config.json's counts
        asked = targets(engine, family)  # each release asked for, with the rules read for this family's class
    except (CheckpointError, UnknownFamilyError, UnknownEngine) as exc:
        raise UnreadableCheckpoint(str(exc)) from None
    config = checkpoint.config
    text = family.text_config(config)  # what the engines' text model reads (config.json itself unless nested)
    check_heads(text, serving, checkpoint.config_path)
    qconfig = checkpoint.quantization_config  # config.json's, or hf_quant_config.json where a ModelOpt export has it
    malformed = _malformed_qconfig(qconfig)
    third_party = None if malformed else format_kind(qconfig)  # compressed-tensors, modelopt: schemes per module
    try:
        read_as = parse(third_party, qconfig) if third_party else None
    except UnsupportedScheme as exc:
        raise UnreadableCheckpoint(f"{checkpoint.quantization_config_source}: {exc}") from None
    # a Quark config with per-layer schemes (the ladder's mixed checkpoints): each module's rung is read from its
    # tensors, and each release's per-layer matching has its own rule file (quant.engines.quark_layers)
    layered = not malformed and config_kind(qconfig) == "quark" and quark_layers.per_layer(qconfig)
    # each release replayed with its own format rules: a family rule set cut where they change
    if third_party or layered:
        cut_kind = third_party or quark_layers.KIND
        try:
            asked = [replace(t, rules=cut(t.rules, cut_kind, t.state.release)) if t.rules else t for t in asked]
        except UnknownEngine as exc:  # a format rule file that breaks its schema
            raise UnreadableCheckpoint(str(exc)) from None
    rule_sets = list({t.rules.id: t.rules for t in asked if t.rules}.values())  # each replayed once
    report = Report(str(folder), [r.id for r in rule_sets], serving=serving, family=family.name)
    report.findings += malformed
    native = config_kind(qconfig) == "mxfp4"  # a release's own MXFP4 (gpt-oss)
    try:
        fmt = get_codec("mxfp4") if native else codec_for_config(config) \
            if qconfig and not malformed and not third_party else None
    except ValueError as exc:
        if config_kind(qconfig) is None:  # a method no checker reads: say so, not what the decoder would say
            raise UnreadableCheckpoint(f"{checkpoint.quantization_config_source}: quant_method "
                                       f"{qconfig.get('quant_method')!r} is not a format gate checkpoint reads "
                                       f"({', '.join(CONFIG_KINDS + THIRD_PARTY)}); it cannot be checked") from None
        raise UnreadableCheckpoint(f"{checkpoint.config_path}: {exc}") from None
    tensors = checkpoint.tensors()
    # a third-party checkpoint's quantized modules, each with the scheme its tensors show
    stored, stored_problems = read_modules(tensors, read_as) if read_as else ({}, [])
    modules: dict[str, Module] = {}
    mtp_layers: set[int] = set()
    moe_layers: set[int] = set()  # the decoder layers holding routed experts
    kind_roles = {role for _, role in family.layer_kinds}
    roles_by_layer: dict[int, set[str]] = {}  # decoder layer -> its attention roles (hybrid families)
    for name, info in tensors.items():
        name = weight_named(name)  # compressed-tensors' packed weight is the module's weight
        role = family.classify(name, num_hidden_layers)
        if role.mtp:
            mtp_layers.add(role.layer)
        elif role.role == "routed_expert" and role.layer is not None:
            moe_layers.add(role.layer)
        if role.role in kind_roles and role.layer is not None and not role.mtp:
            roles_by_layer.setdefault(role.layer, set()).add(role.role)
        if family.fused_experts and (fused := _fused_module(name, info, family, num_hidden_layers, fmt)):
            modules[fused[0]] = fused[1]
        elif role.linear and name.endswith(".weight") and (on_disk := stored.get(name.removesuffix(".weight"))):
            modules[name.removesuffix(".weight")] = Module(bool(on_disk.label), on_disk.shape, role.role,
                                                           on_disk.label)
        elif role.linear and name.endswith(".weight") and layered and (rung := stored_rung(tensors, name[:-7])):
            quantized = rung != "bf16"
            shape = fmt.logical_shape(info.shape) if info.dtype == fmt.weight_dtype else tuple(info.shape)
            modules[name.removesuffix(".weight")] = Module(quantized, shape, role.role, rung if quantized else "")
        elif role.linear and name.endswith(".weight") and len(info.shape) == 2:
            quantized = fmt is not None and info.dtype == fmt.weight_dtype
            shape = fmt.logical_shape(info.shape) if quantized else tuple(info.shape)
            modules[name.removesuffix(".weight")] = Module(quantized, shape, role.role)
    report.modules_checked = len(modules)
    report.modules_quantized = sum(m.quantized for m in modules.values())
    if not modules:
        report.findings.append(Finding("layout", None, "checkpoint", f"no Linear module of family {family.name} "
                                       "found: nothing the engines would load was checked",
                                       "check that the shards and index are the model's"))
    report.findings += _missing_layers(tensors, num_hidden_layers, family.layers_prefix)
    report.findings += structure_findings(checkpoint, family, declared)
    report.findings += _layout_findings(checkpoint, fmt)
    report.findings += [Finding("layout", None, tensor, why, fix) for tensor, why, fix in stored_problems]
    report.findings += _rung_findings(tensors) if layered else []
    if family.fused_experts:
        report.findings += _blocks_findings(tensors, family, text)
    has_quantized = any(i.dtype in ("U8", "F8_E4M3") for i in tensors.values())
    # A quantization_config the engines cannot even read: its one finding says it all.
    report.findings += [] if malformed else _config_findings(qconfig, has_quantized)
    exclude, exclude_findings = (None, []) if malformed else _exclude_list(qconfig or {})
    report.findings += exclude_findings
    kind = None if malformed else config_kind(qconfig) or third_party
    routers = router_tensors(tensors, family, num_hidden_layers)
    # the quantization_config as the engines match it; None where they cannot read its exclude list
    usable = None if malformed or (kind == "quark" and exclude is None) else \
        dict(qconfig, exclude=exclude) if kind == "quark" else qconfig or {}
    replayable = kind in ("fp8", "mxfp4", *THIRD_PARTY) or (kind == "quark" and exclude is not None)

    namings = quark_layers.Namings({m: module.role for m, module in modules.items()}, num_hidden_layers,
                                   family.name) if layered else None

    def rules_findings(rules, modules: dict[str, Module], mtp_layers: set[int], text: dict):
        """What one rule set finds for these modules and MTP layers, and the replay's context (None: the
        modules were not replayed)."""
        findings = model_findings(rules, text, routers, num_hidden_layers, mtp_layers, family.mtp_layers_key,
                                  moe_layers, family.mtp_layers_default)
        findings += layer_kind_findings(rules, text, family, roles_by_layer, num_hidden_layers)
        if kind == "quark":
            findings += quark_findings(rules, qconfig)
        if layered:
            findings += quark_layers.key_findings(rules, qconfig, namings)
        ctx = None
        if kind == "mxfp4" and not rules.values.get("mxfp4_native"):
            findings.append(Finding("config", rules.id, "quantization_config.quant_method",
                                    f"quant_method mxfp4 (gpt-oss's own MXFP4 layout): {rules.engine}'s "
                                    f"{rules.model_class} was not read to load it", "convert the bf16 release "
                                    "with quantize (it writes the Quark layout this class loads)"))
        elif replayable:
            ctx = ReplayContext(rules, modules, usable, family.name, num_hidden_layers, kind, _format_label(fmt),
                                text, serving)
            findings += replay(ctx)
        elif not kind and not malformed and any(m.quantized for m in modules.values()):
            findings.append(Finding("config", rules.id, "quantization_config",
                                    "quantized weights without a Quark or FP8 quantization_config", "re-export"))
        return findings, ctx

    for rules in rule_sets:
        findings, ctx = rules_findings(rules, modules, mtp_layers, text)
        draft = {m for m in modules if is_draft(m, rules, num_hidden_layers)}
        report.has_draft = report.has_draft or bool(draft or mtp_layers)
        # the draft's findings: what the same release does not find without the draft (none where nothing is found)
        if (draft or mtp_layers) and (findings or not serving.speculative):
            main = rules_findings(rules, {m: i for m, i in modules.items() if m not in draft}, set(),
                                  {**text, family.mtp_layers_key: 0})
            without = set(main[0])
            report.draft_findings += [f for f in findings if f not in without]
            if not serving.speculative:  # served without the draft: the engine never builds it
                findings, ctx = main
        report.findings += findings
        if ctx is not None and rules.engine == "sglang":
            report.conditions[rules.id] = loads_under(ctx)
        fused = 0
        if rules.engine == "sglang" and usable is not None:
            entries = exclude_entries(usable, rules, kind, serving) if kind else []
            fused, why = main_model_fusion(rules, family, config, kind, entries, serving, usable)
            report.fusion[rules.id] = {"fused": bool(fused), "why": why}
        built = modules if serving.speculative else {m: i for m, i in modules.items() if m not in draft}
        report.findings += block_findings(rules, built, text, usable, serving, shared_fused=bool(fused))
        if shape := moe_shape(text, family, fused):
            report.moe[rules.id] = shape
    report.releases = [t.result() for t in asked]
    if kind == "fp8":  # where the newest release replayed fuses the shared expert, it is in the FusedMoE
        newest = {r.engine: r.id for r in rule_sets}  # rule sets oldest first: the last one per engine
        fusing = tuple(e for e, rule_set in newest.items() if report.fusion.get(rule_set, {}).get("fused"))
        report.block_fp8_tp = tp_summary(modules, text, usable, sorted({r.engine for r in rule_sets}), serving.ep,
                                         serving.platform, fusing)
    if deep:
        report.findings += _deep_findings(checkpoint, fmt, stored if read_as else None)
        report.findings += expert_id_findings(checkpoint, family, declared)
        if native and family.fused_experts:
            report.findings += _deep_blocks_findings(checkpoint, fmt)
    return report


def _fused_module(name: str, info, family, num_hidden_layers: int, fmt: Codec | None) -> tuple[str, Module] | None:
    """A fused expert tensor as the module the engines build from it (its FusedMoE's parts): bf16
    ``[E, in, out]`` / ``[E, out, in]`` as the release stores it, its MXFP4 ``*_blocks``
    (``quant.blocks``), or stacked in ``fmt`` (``writes: stacked``); the module is named by the fused
    tensor, shaped one expert's [out, in]."""
    stored = blocks.fused_name(name)
    spec = family.fused_experts.match(stored or name)
    if spec is None or family.classify(stored or name, num_hidden_layers).role != "routed_expert":
        return None
    if stored is not None and info.dtype == "U8" and len(info.shape) == 4:
        return stored, Module(True, (info.shape[1], info.shape[2] * BLOCK), "routed_expert")
    if stored is None and fmt is not None and info.dtype == fmt.weight_dtype and len(info.shape) == 3:
        return name, Module(True, fmt.logical_shape(info.shape[1:]), "routed_expert")
    if stored is None and info.dtype in FLOAT_DTYPES and len(info.shape) == 3:
        out, inner = (info.shape[1], info.shape[2]) if spec.axes[1] == "out" else (info.shape[2], info.shape[1])
        return name, Module(False, (out, inner), "routed_expert")
    return None


def _blocks_findings(tensors, family, text: dict) -> list[Finding]:
    """Each ``*_blocks`` tensor against the layout the engines read for config.json's sizes."""
    findings = []
    fused = family.fused_experts
    for name, info in sorted(tensors.items()):
        stored = blocks.fused_name(name)
        spec = fused.match(stored) if stored else None
        if spec is None:
            continue
        try:
            sizes = [int(text[k]) for k in (fused.experts_key, spec.out_key, spec.in_key)]
        except (KeyError, TypeError, ValueError):
            continue  # the config findings name a missing key
        expected = (sizes[0], sizes[1] * len(spec.projections), sizes[2])
        if problem := blocks.layout_problem(info, tensors.get(stored + blocks.SCALES), expected):
            findings.append(Finding("layout", None, name, problem, "re-export the checkpoint (quantize writes this "
                                    "layout from the bf16 release)"))
    return findings


def _deep_blocks_findings(checkpoint: Checkpoint, fmt: Codec) -> list[Finding]:
    """Every ``*_blocks`` tensor decoded with its ``*_scales`` (E8M0 0xFF, NaN/Inf), a chunk of
    experts' rows after another: what the engines would serve."""
    findings = []
    tensors = checkpoint.tensors()
    with _TensorReader(checkpoint) as reader:
        for name, info in sorted(tensors.items()):
            stored = blocks.fused_name(name)
            scale = tensors.get(stored + blocks.SCALES) if stored else None
            if scale is None or info.dtype != "U8" or len(info.shape) != 4 or \
                    tuple(scale.shape) != tuple(info.shape[:3]):
                continue  # the layout findings name it
            rows = info.shape[0] * info.shape[1]
            findings += _decode_findings(fmt, reader, info, scale, rows, info.shape[2] * BLOCK)
    return findings


def _format_label(fmt) -> str:
    return fmt.name.upper() if fmt else "quantized"
