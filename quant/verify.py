"""Structural checks of a finished checkpoint against its config and the engines' loading rules.

Headers and config only (seconds on 1.5 TB); ``deep`` also reads tensor data. Every finding
names the module or tensor, why it fails and what to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from quant.engines import GLOB_CHARS, Finding, Module, config_findings, engine_rules, replay
from quant.formats import WeightFormat, checkpoint_format, logical_shape
from quant.layout import UnknownFamilyError, family_for
from quant.plan import INDEX_NAME, PlanError, read_config, source_shards
from quant.safetensors_io import ShardError, ShardHeader, read_header

FLOAT_DTYPES = ("BF16", "F16", "F32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")


class UnreadableCheckpoint(ValueError):
    """Not a checkpoint, or one that cannot be read (exit code 2)."""


@dataclass
class Report:
    checkpoint: str
    engines: list[str]
    findings: list[Finding] = field(default_factory=list)
    modules_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def for_engine(self, engine: str) -> list[Finding]:
        return [f for f in self.findings if f.engine in (None, engine)]

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "ok": self.ok, "modules_checked": self.modules_checked,
                "engines": {e: {"ok": not self.for_engine(e), "findings": [asdict(f) for f in self.for_engine(e)]}
                            for e in self.engines}}


def _load(checkpoint: Path) -> tuple[dict, dict[str, str] | None, dict[str, ShardHeader]]:
    try:
        config = read_config(checkpoint)
        weight_map, files = source_shards(checkpoint)
        headers = {f: read_header(checkpoint / f) for f in files}
    except (PlanError, ShardError) as exc:
        raise UnreadableCheckpoint(str(exc)) from None
    return config, weight_map, headers


def _layout_findings(checkpoint: Path, weight_map: dict[str, str] | None, headers: dict[str, ShardHeader],
                     fmt: WeightFormat | None) -> list[Finding]:
    findings = []
    tensors = {name: info for h in headers.values() for name, info in h.tensors.items()}
    suffix = fmt.scale_suffix if fmt else "_scale"
    for name, info in sorted(tensors.items()):
        if not name.endswith(".weight"):
            continue
        scale = tensors.get(name + suffix)
        if fmt and info.dtype == fmt.weight_dtype:
            expected = fmt.outputs(name, logical_shape(fmt, info.shape))[1]
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
    if weight_map is not None:
        for name, file in sorted(weight_map.items()):
            if name not in headers[file].tensors:
                findings.append(Finding("layout", None, name, f"{INDEX_NAME} maps it to {file}, which lacks it",
                                        "regenerate the index or re-copy the shard"))
        listed = set(weight_map)
        for name in sorted(set(tensors) - listed):
            findings.append(Finding("layout", None, name, f"in a shard but not in {INDEX_NAME}",
                                    "regenerate the index"))
        index = json.loads((checkpoint / INDEX_NAME).read_text())
        total = (index.get("metadata") or {}).get("total_size")
        file_bytes = sum(h.file_size for h in headers.values())
        data_bytes = sum(t.nbytes for t in tensors.values())
        if total is not None and total not in (file_bytes, data_bytes):
            findings.append(Finding("layout", None, INDEX_NAME, f"total_size {total} matches neither the tensor bytes "
                                    f"({data_bytes}) nor the shard sizes ({file_bytes})", "regenerate the index"))
    if not any((checkpoint / f).exists() for f in TOKENIZER_FILES):
        findings.append(Finding("layout", None, "tokenizer", "no tokenizer file; the engines cannot start without one",
                                "copy the source checkpoint's tokenizer files"))
    return findings


def _config_findings(qconfig: dict | None, has_u8: bool) -> list[Finding]:
    if qconfig is None:
        return [Finding("config", None, "quantization_config", "U8 weights but no quantization_config",
                        "re-export the checkpoint")] if has_u8 else []
    findings = []
    if qconfig.get("quant_method") != "quark":
        return findings  # not a Quark checkpoint: nothing more to check here
    if not isinstance(qconfig.get("export"), dict):
        findings.append(Finding("config", None, "quantization_config.export", "missing: sglang's Quark loader requires it",
                                "add Quark's export block (quantgate writes it)"))
    for key in ("layer_quant_config", "layer_type_quant_config"):
        if not isinstance(qconfig.get(key), dict):
            findings.append(Finding("config", None, f"quantization_config.{key}",
                                    "must be a dict: vLLM iterates it unguarded", f'write "{key}": {{}}'))
    for entry in qconfig.get("exclude") or []:
        if not isinstance(entry, str):
            findings.append(Finding("config", None, repr(entry), "exclude entries must be strings", "fix the entry"))
        elif not entry.startswith("re:") and GLOB_CHARS & set(entry):
            findings.append(Finding("config", None, entry, "glob entry: the engines match exclude entries exactly "
                                    "(or by re: regex), so it matches nothing",
                                    "replace it with the exact module names (quantize writes them)"))
    return findings


def _deep_findings(checkpoint: Path, headers: dict[str, ShardHeader]) -> list[Finding]:
    findings = []
    for file, header in headers.items():
        with safe_open(str(checkpoint / file), "pt") as f:
            for name, info in header.tensors.items():
                tensor = f.get_tensor(name)
                if name.endswith(".weight_scale") and info.dtype == "U8":  # MX scales
                    if (tensor == 255).any():
                        findings.append(Finding("layout", None, name, "scale byte 255 (E8M0 NaN)", "re-export"))
                    zero_rows = int((tensor == 0).all(dim=-1).sum()) if tensor.dim() == 2 else 0
                    if zero_rows:
                        findings.append(Finding("layout", None, name, f"{zero_rows} all-zero scale rows (never "
                                                "written?)", "re-export this shard"))
                elif info.dtype in FLOAT_DTYPES and not torch.isfinite(tensor).all():
                    findings.append(Finding("layout", None, name, "NaN/Inf values", "fix the source and re-export"))
    return findings


def verify(checkpoint: Path, engine: str = "all", deep: bool = False) -> Report:
    checkpoint = Path(checkpoint)
    config, weight_map, headers = _load(checkpoint)
    try:
        family = family_for(config)
    except UnknownFamilyError as exc:
        raise UnreadableCheckpoint(str(exc)) from None
    rules = engine_rules(engine)
    report = Report(str(checkpoint), [r.name for r in rules])
    num_hidden_layers = int(config[family.num_layers_key])
    try:
        fmt = checkpoint_format(config) if config.get("quantization_config") else None
    except ValueError as exc:
        raise UnreadableCheckpoint(str(exc)) from None
    modules: dict[str, Module] = {}
    for header in headers.values():
        for name, info in header.tensors.items():
            role = family.classify(name, num_hidden_layers)
            if role.linear and name.endswith(".weight") and len(info.shape) == 2:
                quantized = fmt is not None and info.dtype == fmt.weight_dtype
                shape = logical_shape(fmt, info.shape) if quantized else tuple(info.shape)
                modules[name.removesuffix(".weight")] = Module(quantized, shape, role.role)
    report.modules_checked = len(modules)
    qconfig = config.get("quantization_config")
    report.findings += _layout_findings(checkpoint, weight_map, headers, fmt)
    has_quantized = any(i.dtype in ("U8", "F8_E4M3") for h in headers.values() for i in h.tensors.values())
    report.findings += _config_findings(qconfig, has_quantized)
    exclude = (qconfig or {}).get("exclude") or []
    is_quark = (qconfig or {}).get("quant_method") == "quark"
    for rule in rules:
        if is_quark:
            report.findings += config_findings(rule, qconfig)
            report.findings += replay(rule, modules, [e for e in exclude if isinstance(e, str)], family,
                                      num_hidden_layers)
        elif any(m.quantized for m in modules.values()) and (qconfig or {}).get("quant_method") != "fp8":
            report.findings.append(Finding("config", rule.name, "quantization_config",
                                           "U8 weights without a Quark quantization_config", "re-export"))
    if deep:
        report.findings += _deep_findings(checkpoint, headers)
    return report
