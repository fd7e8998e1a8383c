"""Executes a plan: streams tensors shard by shard into atomic output files, then the metadata.

Order of appearance in DST, each file under its final name only once complete: auxiliary files,
shards (each written as ``<name>.partial`` and renamed), the index, ``config.json``, and last the
conversion manifest. So a folder without ``conversion_manifest.json`` is an unfinished one, and
no final-named shard is ever a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

import quant
from quant.formats import mxfp4
from quant.plan import INDEX_NAME, Plan, ShardPlan, TensorPlan
from quant.safetensors_io import PARTIAL_SUFFIX, ShardWriter, copy_range, read_rows

MANIFEST_NAME = "conversion_manifest.json"
CHUNK_BYTES = 32 << 20  # source bytes quantized per step: bounds memory independent of tensor size
log = logging.getLogger(__name__)


class ConvertError(RuntimeError):
    """The conversion cannot proceed; nothing under a final name is incomplete."""


class NonFiniteError(ConvertError):
    pass


def check_destination(plan: Plan, dst: Path, overwrite: bool) -> None:
    """Refuse a destination that would destroy the source or mix with other files."""
    src = plan.source_dir.resolve()
    dst = dst.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConvertError(f"output folder {dst} overlaps the input {src}; choose a separate, empty folder")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output {dst} exists and is not a folder")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise ConvertError(f"output folder {dst} is not empty; choose an empty folder or pass --overwrite "
                               "to replace a previous conversion there")
        if not (dst / "config.json").exists() and not any(dst.glob("*.safetensors*")):
            raise ConvertError(f"--overwrite refuses {dst}: it does not look like a checkpoint folder "
                               "(no config.json or shards); remove it yourself if you mean it")
        shutil.rmtree(dst)
    needed = sum(s.output_size for s in plan.shards)
    free = shutil.disk_usage(dst if dst.exists() else dst.parent if dst.parent.exists() else Path("/")).free
    if needed > free:
        raise ConvertError(f"{dst}: needs {needed / 1e9:.2f} GB but only {free / 1e9:.2f} GB are free")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + PARTIAL_SUFFIX)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _quantize_tensor(src_fd: int, tensor: TensorPlan, writer: ShardWriter, rule: mxfp4.ScaleRule,
                     progress: tqdm | None) -> dict:
    """Quantize one weight in row chunks; returns its error figures for the manifest."""
    info = tensor.source
    rows, cols = info.shape
    step = max(1, CHUNK_BYTES // (info.nbytes // rows))
    weight_name, scale_name = tensor.outputs[0][0], tensor.outputs[1][0]
    err_sq = ref_sq = 0.0
    for start in range(0, rows, step):
        end = min(rows, start + step)
        x = read_rows(src_fd, info, start, end)
        if not torch.isfinite(x).all():
            bad = (~torch.isfinite(x)).nonzero()[0].tolist()
            raise NonFiniteError(f"{info.name}: NaN/Inf at row {start + bad[0]}, column {bad[1]}; "
                                 "fix the source checkpoint (Quark would silently write garbage here)")
        packed, scales = mxfp4.quantize(x, rule)
        writer.write(weight_name, start * (cols // 2), packed.numpy().tobytes())
        writer.write(scale_name, start * (cols // mxfp4.BLOCK), scales.numpy().tobytes())
        xf = x.to(torch.float32)
        err_sq += float(((mxfp4.dequantize(packed, scales, torch.float32) - xf) ** 2).sum())
        ref_sq += float((xf * xf).sum())
        if progress:
            progress.update((end - start) * (info.nbytes // rows))
    return {"shape": list(info.shape), "rel_rms_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0}


def convert_shard(plan: Plan, shard: ShardPlan, dst: Path, progress: tqdm | None = None) -> dict:
    """Write one output shard; returns its manifest record."""
    writer = ShardWriter(dst / shard.file, shard.entries)
    src_path = plan.source_dir / shard.file
    errors: dict[str, dict] = {}
    src_fd = os.open(src_path, os.O_RDONLY)
    try:
        for tensor in shard.tensors:
            if tensor.quantize:
                errors[tensor.source.name] = _quantize_tensor(src_fd, tensor, writer, plan.recipe.scale_rule, progress)
            else:
                copy_range(src_fd, tensor.source.begin, writer, tensor.source.name, tensor.source.nbytes)
                if progress:
                    progress.update(tensor.source.nbytes)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        os.close(src_fd)
    out_path = dst / shard.file
    return {
        "file": shard.file,
        "source_size": shard.source_size,
        "source_sha256": sha256_file(src_path),
        "size": out_path.stat().st_size,
        "sha256": sha256_file(out_path),
        "quantized": errors,
    }


def convert(plan: Plan, dst: Path, *, overwrite: bool = False, show_progress: bool = True,
            command: list[str] | None = None) -> dict:
    """Run the whole plan into ``dst``; returns the conversion manifest (also written there)."""
    dst = Path(dst)
    check_destination(plan, dst, overwrite)
    dst.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for name in plan.aux_files:
        _copy_atomic(plan.source_dir / name, dst / name)

    total = sum(s.source_size for s in plan.shards)
    records = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not show_progress) as progress:
        for shard in plan.shards:
            progress.set_postfix_str(shard.file)
            records.append(convert_shard(plan, shard, dst, progress))

    weight_map = plan.weight_map()
    index = {"metadata": {"total_size": sum(r["size"] for r in records)}, "weight_map": weight_map}
    _write_atomic(dst / INDEX_NAME, json.dumps(index, indent=2).encode())
    _write_atomic(dst / "config.json", json.dumps(plan.output_config(), indent=2).encode())
    elapsed = time.time() - started
    manifest = {
        "tool": "quantgate",
        "version": quant.__version__,
        "command": command,
        "created_unix": int(started),
        "seconds": round(elapsed, 3),
        "source": str(plan.source_dir.resolve()),
        "family": plan.family.name,
        "recipe": plan.recipe.to_dict(),
        "format": plan.recipe.format,
        "exclude_count": len(plan.exclude),
        "shards": records,
        "summary": {
            "tensors_quantized": sum(len(r["quantized"]) for r in records),
            "bytes_in": sum(r["source_size"] for r in records),
            "bytes_out": sum(r["size"] for r in records),
            "gb_per_s": round(total / 1e9 / elapsed, 4) if elapsed else None,
        },
        "warnings": list(plan.warnings),
    }
    _write_atomic(dst / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
    return manifest
