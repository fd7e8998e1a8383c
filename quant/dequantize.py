"""``quantize --to bf16``: an MXFP4/MXFP6 (Quark) or block-FP8 checkpoint back to plain bf16.

transformers cannot load Quark MXFP4 MoE checkpoints; decoding them exactly (element value x
2^(byte - 127), or e4m3 x the tile's scale_inv) lets quantized numerics be evaluated anywhere.
Shards stream row chunk by row chunk into atomic files, like the converter's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from quant.formats import WeightFormat, checkpoint_format, logical_shape
from quant.hashing import StreamHasher
from quant.outputs import (INDEX_NAME, DestinationLock, aux_files, check_overlap, copy_atomic, create_destination,
                           prepare_destination, write_atomic)
from quant.checkpoint import Checkpoint
from quant.errors import CheckpointError
from quant.quark_config import strip_quantization_config
from quant.safetensors_io import ShardWriter

CHUNK_ROWS_BYTES = 16 << 20


def _shard_entries(header, fmt: WeightFormat) -> tuple[list[tuple[str, str, tuple[int, ...]]], set[str]]:
    """Output entries in file order, and the names of the weights to decode."""
    tensors = header.tensors
    packed = {n for n, t in tensors.items() if t.dtype == fmt.weight_dtype and n.endswith(".weight")
              and n + fmt.scale_suffix in tensors}
    entries = []
    for info in sorted(tensors.values(), key=lambda t: t.begin):
        if info.name.endswith(fmt.scale_suffix) and info.name.removesuffix(fmt.scale_suffix) in packed:
            continue
        if info.name in packed:
            shape = logical_shape(fmt, info.shape)
            expected = fmt.outputs(info.name, shape)[1][2]
            if tensors[info.name + fmt.scale_suffix].shape != tuple(expected):
                raise CheckpointError(f"{header.path}: {info.name} is {info.dtype}{list(info.shape)} but its scale does "
                                f"not fit {fmt.name} (expected {list(expected)}); cannot decode it")
            entries.append((info.name, "BF16", shape))
        else:
            entries.append((info.name, info.dtype, info.shape))
    return entries, packed


def dequantize_checkpoint(src: Path, dst: Path, *, overwrite: bool = False, show_progress: bool = True) -> dict:
    src, dst = Path(src), Path(dst)
    checkpoint = Checkpoint.open(src)
    config, headers = checkpoint.config, checkpoint.headers
    try:
        fmt = checkpoint_format(config)
    except ValueError as exc:
        raise CheckpointError(f"{checkpoint.config_path}: {exc}") from None
    missing, _ = checkpoint.index_problems()
    if missing or checkpoint.unlisted_files:
        what = missing[0].name if missing else checkpoint.unlisted_files[0]
        raise CheckpointError(f"{src / INDEX_NAME}: {what}: the index and the shards disagree; "
                              "regenerate the index (gate checkpoint lists every mismatch)")
    check_overlap(src, dst)
    create_destination(dst)
    with DestinationLock(dst):
        prepare_destination(dst, overwrite)
        return _decode(checkpoint, fmt, dst, show_progress)


def _decode(checkpoint: Checkpoint, fmt: WeightFormat, dst: Path, show_progress: bool) -> dict:
    src, config, headers = checkpoint.folder, checkpoint.config, checkpoint.headers
    weight_map, decoded = {}, 0
    total = sum(h.file_size for h in headers.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="dequantize", disable=not show_progress) as bar:
        for file, header in headers.items():
            entries, packed = _shard_entries(header, fmt)
            hasher = StreamHasher()
            writer = ShardWriter(dst / file, entries, hasher)
            try:
                with safe_open(str(checkpoint.path(file)), "pt") as f:
                    for name, _, shape in entries:
                        if name in packed:
                            weight, scale = f.get_slice(name), f.get_slice(name + fmt.scale_suffix)
                            step = max(fmt.row_multiple, CHUNK_ROWS_BYTES // (shape[1] * 2) // fmt.row_multiple
                                       * fmt.row_multiple)
                            for r in range(0, shape[0], step):
                                s0 = r // fmt.row_multiple
                                rows = fmt.dequantize(weight[r:r + step], scale[s0:s0 + -(-step // fmt.row_multiple)])
                                writer.write(name, r * shape[1] * 2, rows.view(torch.uint8).numpy().data)
                            decoded += 1
                        else:
                            tensor = f.get_tensor(name)
                            writer.write(name, 0, tensor.contiguous().view(torch.uint8).numpy().data
                                         if tensor.numel() else b"")
                        bar.update(header.tensors[name].nbytes)
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            finally:
                hasher.close()
            weight_map.update({name: file for name, _, _ in entries})
    for name in aux_files(src):
        copy_atomic(src / name, dst / name)
    write_atomic(dst / INDEX_NAME, json.dumps({"metadata": {"total_size": sum(
        (dst / f).stat().st_size for f in headers)}, "weight_map": weight_map}, indent=2).encode())
    write_atomic(dst / "config.json", json.dumps(strip_quantization_config(config), indent=2).encode())
    return {"source": str(src), "output": str(dst), "tensors_dequantized": decoded, "shards": len(headers)}
