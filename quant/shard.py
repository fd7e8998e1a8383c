"""Converting one shard: read tensors in file order, carry out each one's planned action (encode,
decode or copy), write one atomic file.

Four threads overlap, each on one stream, so a shard keeps two cores busy (``convert`` gives a
worker process two cores): the source's sha256 (``quant.source.SourceHasher``, from the moment
the file opens, on its own mapping), the kernel (this thread; numba's threads inside, ``kernel_threads``
of them), and the output's sha256 and its writing (``ShardWriter``'s two helpers). hashlib,
numba and pwrite all release the GIL. sha256 is sequential, so on two cores the source's hash is
the floor: about 2 GB/s per core here. Memory is bounded by a few chunks (``CHUNK_BYTES`` of
source) whatever the tensor or shard size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from quant.errors import NonFiniteError, SourceError
from quant.formats.codecs import Codec, get_codec
from quant.formats.constants import ScaleRule
from quant.outputs import output_mode
from quant.fused import Piece
from quant.plan import ASSEMBLE, CONSUMED, COPY, DECODE, ENCODE, ShardPlan, TensorPlan
from quant.rungs import RUNGS
from quant.safetensors_io import DTYPE_BYTES, ShardWriter, TensorInfo, file_identity, numel, torch_dtype
from quant.source import CHUNK_BYTES, SourceReader, first_non_finite
from quant.strided import copy2d


@dataclass(frozen=True)
class ShardJob:
    source_dir: Path
    dst: Path
    shard: ShardPlan
    codec: Codec
    scale_rule: ScaleRule | None  # encoding only
    device: str = "cpu"
    strict: bool = False  # NaN/Inf in a tensor kept as it is: an error, not a warning
    kernel_threads: int | None = None  # cores the CPU kernel may use (None: all)


# Exponent-field masks: a float is NaN or Inf exactly when all its exponent bits are set.

def _encode_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                   advance: Callable[[int], None], timing: dict) -> dict:
    info = tensor.source
    if tensor.blocks or tensor.stacked:  # every expert's matrix into one weight (*_blocks), then one scale
        scales: list = []
        _, dtype, shape = tensor.outputs[0]
        expert_bytes = numel(shape[1:]) * DTYPE_BYTES[dtype]
        errors = [_encode_rows(piece_rows(reader, piece, job.kernel_threads), (piece.rows, piece.cols), tensor.outputs, info.dtype,
                               f"{info.name} expert {piece.expert}", writer, job, advance, timing,
                               weight_base=i * expert_bytes, scales_out=scales)
                  for i, piece in enumerate(tensor.pieces)]
        writer.write(tensor.outputs[1][0], 0, np.concatenate(scales).data)
        err_sq, ref_sq = sum(e for e, _ in errors), sum(r for _, r in errors)
    elif tensor.pieces:  # a fused expert tensor: each expert's projection encoded as its own weight
        errors = [_encode_rows(piece_rows(reader, piece, job.kernel_threads), (piece.rows, piece.cols), tensor.outputs[2 * i:2 * i + 2],
                               info.dtype, piece.name, writer, job, advance, timing)
                  for i, piece in enumerate(tensor.pieces)]
        err_sq, ref_sq = sum(e for e, _ in errors), sum(r for _, r in errors)
    else:
        row_bytes = info.nbytes // info.shape[0]
        rows = lambda start, count: reader.read(info.begin + start * row_bytes, count * row_bytes)  # noqa: E731
        if tensor.rung == "fp8":  # its one scale needs the whole tensor's amax first: a scan that copies, ahead
            scan = lambda start, count: reader.fetch(info.begin + start * row_bytes, count * row_bytes)  # noqa: E731
            err_sq, ref_sq = _encode_fp8_tensor(rows, scan, info.shape, tensor.outputs[:2], info.dtype, info.name,
                                                writer, job, advance, timing)
        else:
            err_sq, ref_sq = _encode_rows(rows, info.shape, tensor.outputs[:2], info.dtype, info.name, writer, job,
                                          advance, timing)
    record = {"shape": list(info.shape), "rel_rms_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0}
    if tensor.input_scale is not None:  # a static-activation rung: the scale measured on calibration data
        writer.write(tensor.outputs[-1][0], 0, _scalar_bytes(tensor.input_scale, tensor.outputs[-1][1]))
        record["input_scale"] = tensor.input_scale
    return {**record, "rung": tensor.rung} if tensor.rung else record


def _scalar_bytes(value: float, dtype: str) -> bytes:
    """One value stored as a ``[]`` tensor of safetensors ``dtype`` (a per-tensor scale)."""
    import torch

    return torch.tensor([value], dtype=torch_dtype(dtype)).view(torch.uint8).numpy().tobytes()


def _encode_fp8_tensor(rows_at: Callable[[int, int], object], scan_at: Callable[[int, int], object],
                       shape: tuple[int, int], outputs, dtype: str, what: str, writer: ShardWriter, job: ShardJob,
                       advance: Callable[[int], None], timing: dict) -> tuple[float, float]:
    """Encode a ``[rows, cols]`` matrix as FP8 e4m3 with ONE scale for the whole tensor (the W8A8 rung,
    ``fp8_tensor``): a first pass over the rows (``scan_at``: copies read ahead of the file position) takes
    its amax, refusing NaN/Inf; then the rows are encoded in file order under that scale like any codec's."""
    codec = get_codec(RUNGS["fp8"].weight)
    rows, cols = shape
    row_bytes = cols * DTYPE_BYTES[dtype]
    step = max(1, CHUNK_BYTES // row_bytes)
    amax = 0.0
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(scan_at(start, count), np.uint8).reshape(count, row_bytes)
        started = time.perf_counter()
        try:
            amax = max(amax, codec.amax(raw, dtype, row0=start, threads=job.kernel_threads))
        except NonFiniteError as exc:
            raise NonFiniteError(f"{what}: {exc}") from None
        timing["kernel"] += time.perf_counter() - started
    return _encode_rows(rows_at, shape, outputs, dtype, what, writer, job, advance, timing, codec=codec,
                        scale=codec.scale_of(amax))


def piece_rows(reader: SourceReader, piece: Piece, threads: int | None = None) -> Callable[[int, int], memoryview | np.ndarray]:
    """Rows of one fused expert's projection: read as they lie where they follow each other, else
    gathered (every other row of an interleaved tensor, the transpose of an ``[E, H, 2I]`` slice)."""
    row_bytes = piece.cols * piece.item
    if piece.contiguous:
        return lambda start, count: reader.read(piece.offset + start * piece.row_stride, count * row_bytes)
    return lambda start, count: reader.gather(piece.offset + start * piece.row_stride, count, piece.cols,
                                              piece.row_stride, piece.col_stride, piece.item, threads)


def _encode_rows(rows_at: Callable[[int, int], object], shape: tuple[int, int], outputs, dtype: str, what: str,
                 writer: ShardWriter, job: ShardJob, advance: Callable[[int], None], timing: dict,
                 weight_base: int = 0, scales_out: list | None = None, codec: Codec | None = None,
                 scale: float | None = None) -> tuple[float, float]:
    """Encode a ``[rows, cols]`` matrix whose rows ``rows_at(start, count)`` gives as raw bytes, in
    chunks of ``CHUNK_BYTES``; returns the squared error and reference sums. ``weight_base``: where in
    the weight tensor the matrix starts (one expert of a ``*_blocks`` tensor); ``scales_out``: collect
    the scales there for the caller to write (after every expert's blocks), instead of writing them.
    ``codec``: another than the job's (a mixed plan's rung); ``scale``: a per-tensor codec's one scale."""
    codec = codec or job.codec
    per_tensor = {} if scale is None else {"scale": scale}
    rows, cols = shape
    row_bytes = cols * DTYPE_BYTES[dtype]
    step = max(codec.row_multiple, CHUNK_BYTES // row_bytes // codec.row_multiple * codec.row_multiple)
    (weight_name, _, _), (scale_name, _, _) = outputs
    err_sq = ref_sq = 0.0
    scale_chunks = []  # written after the weight, keeping the file order (1/64 of the tensor's size)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(rows_at(start, count), np.uint8)
        started = time.perf_counter()
        try:
            out = codec.encode(raw.reshape(count, row_bytes), dtype, job.scale_rule, device=job.device, row0=start,
                               threads=job.kernel_threads, **per_tensor)
        except NonFiniteError as exc:
            raise NonFiniteError(f"{what}: {exc}") from None
        timing["kernel"] += time.perf_counter() - started
        writer.write(weight_name, weight_base + start * out.weight.shape[1] * out.weight.itemsize, out.weight.data)
        scale_chunks.append(out.scales)
        err_sq, ref_sq = err_sq + out.err_sq, ref_sq + out.ref_sq
        advance(count * row_bytes)
    if scales_out is not None:
        scales_out.extend(scale_chunks)
    else:
        writer.write(scale_name, 0, np.concatenate(scale_chunks).data)
    return err_sq, ref_sq


def _decoded_rows(job: ShardJob, info, scale, raw_scales: bytes, rows_at: Callable[[int, int], object],
                  shape: tuple[int, int], timing: dict, advance: Callable[[int], None]) -> Iterator[tuple[int, np.ndarray]]:
    """The bf16 rows (uint8 ``[count, cols * 2]``, from row ``start``) of one stored weight whose rows
    ``rows_at(offset, nbytes)`` reads, in chunks. Scales, codes and the decoded values are checked
    before a row is given: a scale or code the format forbids (E8M0 0xFF, a NaN/Inf/negative FP8
    scale, an e4m3 NaN code) or a value that overflows bf16 is refused naming the tensor, never
    written as NaN or Inf."""
    codec, multiple = job.codec, job.codec.row_multiple
    rows, cols = shape
    where = f"{job.source_dir / job.shard.file}: tensor"
    fix = "the checkpoint is corrupt: re-export it (gate checkpoint --deep lists every such tensor)"
    scales = np.frombuffer(raw_scales, np.uint8).reshape(scale.shape[0], -1)
    if problem := codec.scale_problem(scales):
        raise SourceError(f"{where} {scale.name}: {problem}; {fix}")
    may_overflow = codec.may_overflow(scales)
    row_bytes = info.nbytes // rows
    step = max(multiple, CHUNK_BYTES // (cols * 2) // multiple * multiple)  # bounded by the bf16 written
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.frombuffer(rows_at(info.begin + start * row_bytes, count * row_bytes), np.uint8)
        started = time.perf_counter()
        codes = raw.reshape(count, row_bytes)
        if problem := codec.code_problem(codes, start):
            raise SourceError(f"{where} {info.name}: {problem}; {fix}")
        first = start // multiple
        out = codec.decode_bytes(codes, scales[first:first + -(-count // multiple)], job.kernel_threads)
        if may_overflow and (bad := first_non_finite(out.data, "BF16")) is not None:
            raise SourceError(f"{where} {info.name}: decodes to NaN/Inf at row {start + bad // cols}, column "
                              f"{bad % cols} (its scale is too large for bf16); {fix}")
        timing["kernel"] += time.perf_counter() - started
        yield start, out
        advance(count * row_bytes)


def _decode_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                   advance: Callable[[int], None], timing: dict, stored_scales: bytes | None) -> None:
    """Decode one weight; ``stored_scales``: its scale's bytes when the file holds the scale before
    the weight (read as the reader passed them), else None (read ahead now)."""
    info, scale = tensor.source, tensor.scale
    name, _, shape = tensor.outputs[0]
    raw_scales = stored_scales if stored_scales is not None else reader.peek(scale.begin, scale.nbytes)
    # a stacked weight [experts, out, in] (fused_experts writes: stacked) decodes expert by expert, each
    # matrix with its own scales (block FP8's tiles do not run across experts)
    experts = shape[0] if len(shape) == 3 else 1
    weight_bytes, scale_bytes = info.nbytes // experts, scale.nbytes // experts
    rows, cols = shape[-2:]
    for e in range(experts):
        one = TensorInfo(info.name, info.dtype, info.shape[-2:], info.begin + e * weight_bytes,
                         info.begin + (e + 1) * weight_bytes)
        one_scale = TensorInfo(scale.name, scale.dtype, scale.shape[-2:], scale.begin + e * scale_bytes,
                               scale.begin + (e + 1) * scale_bytes)
        scales = raw_scales[e * scale_bytes:(e + 1) * scale_bytes]
        for start, out in _decoded_rows(job, one, one_scale, scales, reader.read, (rows, cols), timing, advance):
            writer.write(name, (e * rows + start) * cols * 2, out.data)


def _decode_scheme_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                          advance: Callable[[int], None], timing: dict, early: dict[str, bytes]) -> None:
    """Decode one module of a third-party checkpoint by its scheme (``quant.formats.third_party_decode``),
    in chunks of rows; its scales and zero points (``tensor.params``) are read whole first (from ``early``
    where the file holds them before the weight). Scales the format forbids (NaN, Inf, a zero global
    scale), a ``weight_shape`` other than the planned one and any value decoding to NaN/Inf are refused
    naming the tensor, never written."""
    from quant.formats import third_party_decode

    info, scheme = tensor.source, tensor.scheme
    name, _, (rows, cols) = tensor.outputs[0]
    module = name.removesuffix(".weight")
    where = f"{job.source_dir / job.shard.file}: tensor"
    fix = "the checkpoint is corrupt: re-export it (gate checkpoint --deep lists every such tensor)"
    stored = {p.name[len(module) + 1:]: (p.dtype, tuple(p.shape),
                                         early.pop(p.name, None) or reader.peek(p.begin, p.nbytes))
              for p in tensor.params}
    try:
        params = third_party_decode.load_params(scheme, stored, rows, cols)
    except ValueError as exc:
        raise SourceError(f"{where} {module}: {exc}; {fix}") from None
    if problem := third_party_decode.param_problem(scheme, params):
        raise SourceError(f"{where} {module}.{problem}; {fix}")
    row_bytes = info.nbytes // rows
    step = max(1, CHUNK_BYTES // (cols * 2))  # bounded by the bf16 written
    for start in range(0, rows, step):
        count = min(step, rows - start)
        codes = np.frombuffer(reader.read(info.begin + start * row_bytes, count * row_bytes), np.uint8)
        started = time.perf_counter()
        out = third_party_decode.decode_rows(scheme, codes.reshape(count, row_bytes), start, cols, params,
                                             job.kernel_threads)
        if (bad := first_non_finite(out.data, "BF16")) is not None:
            raise SourceError(f"{where} {info.name}: decodes to NaN/Inf at row {start + bad // cols}, column "
                              f"{bad % cols} (a NaN code, or a scale too large for bf16); {fix}")
        timing["kernel"] += time.perf_counter() - started
        writer.write(name, start * cols * 2, out.data)
        advance(count * row_bytes)


def _assemble_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                     advance: Callable[[int], None], timing: dict) -> None:
    """Write one fused tensor (``--to bf16`` of a fused family) from its experts' weights, expert by
    expert: each expert's block of the fused tensor (its projections, in the release's axis order
    and gate/up layout, as ``tensor.pieces`` place them) is filled from their decoded rows (or the
    rows of a weight kept bf16, copied) and written, so memory is one expert's block and a chunk,
    whatever the tensor's size. The weights are read in expert order (``SourceReader.fetch``)."""
    name, _, shape = tensor.outputs[0]
    experts = tensor.pieces[-1].expert + 1
    block_items = numel(shape) // experts  # one expert's [out, in] or [in, out] block, in bf16 items
    # [E, 2I, H] with gate then up: each piece's rows follow the previous piece's in the output,
    # so decoded rows are written as they come; any other layout fills an expert's block first.
    direct = all(piece.contiguous for piece in tensor.pieces)
    block = None
    for piece, (weight, scale) in zip(tensor.pieces, tensor.members):
        if not direct and (block is None or piece.expert != expert):
            if block is not None:
                writer.write(name, expert * block_items * 2, block)
            expert, block = piece.expert, np.empty(block_items, np.uint16)  # a new one: the writer holds the last
        item, row_bytes = piece.item, piece.cols * piece.item
        if scale is None:  # kept bf16: its rows as they are
            rows = _kept_rows(reader, weight, row_bytes, advance)
        else:
            rows = _decoded_rows(job, weight, scale, bytes(reader.fetch(scale.begin, scale.nbytes)), reader.fetch,
                                 (piece.rows, piece.cols), timing, advance)
        if direct:
            for start, out in rows:
                writer.write(name, piece.offset + start * row_bytes, out.data)
        else:
            place = np.ndarray((piece.rows, piece.cols), np.uint16, block, piece.offset - expert * block_items * item,
                               (piece.row_stride, piece.col_stride))
            for start, out in rows:
                count = out.shape[0]
                started = time.perf_counter()
                copy2d(out.view(np.uint16).reshape(count, piece.cols), place[start:start + count], job.kernel_threads)
                timing["kernel"] += time.perf_counter() - started
        if scale is not None:
            advance(scale.nbytes)
    if block is not None:
        writer.write(name, expert * block_items * 2, block)


def _kept_rows(reader: SourceReader, weight, row_bytes: int,
               advance: Callable[[int], None]) -> Iterator[tuple[int, np.ndarray]]:
    """The rows of a weight kept bf16 (uint8 ``[count, row_bytes]``), in chunks."""
    rows = weight.nbytes // row_bytes
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        yield start, reader.fetch(weight.begin + start * row_bytes, count * row_bytes).reshape(count, row_bytes)
        advance(count * row_bytes)


def _copy_tensor(reader: SourceReader, tensor: TensorPlan, writer: ShardWriter, job: ShardJob,
                 advance: Callable[[int], None]) -> str | None:
    """Copy a kept tensor unchanged; returns where its first NaN/Inf is (None if it has none)."""
    info = tensor.source
    non_finite = None
    item = numel(info.shape) and info.nbytes // numel(info.shape)
    for done in range(0, info.nbytes, CHUNK_BYTES):
        size = min(CHUNK_BYTES, info.nbytes - done)
        data = reader.read(info.begin + done, size)
        if non_finite is None and (bad := first_non_finite(data, info.dtype)) is not None:
            element = done // item + bad
            cols = info.shape[-1] if len(info.shape) > 1 else 0
            non_finite = f"row {element // cols}, column {element % cols}" if cols else f"element {element}"
            if job.strict:
                raise NonFiniteError(f"{job.source_dir / job.shard.file}: tensor {info.name}: NaN/Inf at "
                                     f"{non_finite} (kept as it is by the recipe; --strict refuses it); fix the "
                                     "source checkpoint, or drop --strict to copy it unchanged")
        writer.write(info.name, done, data)
        advance(size)
    return non_finite


def convert_shard(job: ShardJob, advance: Callable[[int], None] = lambda n: None) -> dict:
    """Write one output shard atomically; returns its record for the conversion manifest, with the
    seconds each stage was busy (the hashes and the writing run on helper threads, overlapping the
    kernel; the kernel's first call includes loading numba)."""
    shard = job.shard
    started = time.perf_counter()
    timing = {"kernel": 0.0}
    writer = reader = None
    errors: dict[str, dict] = {}
    decoded: list[str] = []
    kept_non_finite: dict[str, str] = {}
    # Scales stored before their weight (safetensors' save_file puts F32 before F8, so every FP8
    # scale_inv): kept as the reader passes them, until their weight is decoded.
    early_scales: dict[str, bytes] = {}
    used_scales: set[str] = set()
    try:
        # The source first: checked against the plan (and leased) before an output file exists.
        reader = SourceReader(job.source_dir / shard.file, shard)
        writer = ShardWriter(job.dst / shard.file, shard.entries, output_mode(reader.opened.st_mode))
        for tensor in shard.tensors:  # the plan decided each tensor's action; this only carries it out
            if tensor.action == ENCODE:
                errors[tensor.source.name] = _encode_tensor(reader, tensor, writer, job, advance, timing)
            elif tensor.action == DECODE and tensor.scheme is not None:
                _decode_scheme_tensor(reader, tensor, writer, job, advance, timing, early_scales)
                used_scales.update(p.name for p in tensor.params)
                decoded.append(tensor.source.name)
            elif tensor.action == DECODE:
                _decode_tensor(reader, tensor, writer, job, advance, timing, early_scales.pop(tensor.scale.name, None))
                used_scales.add(tensor.scale.name)
                decoded.append(tensor.source.name)
            elif tensor.action == ASSEMBLE:
                _assemble_tensor(reader, tensor, writer, job, advance, timing)
                decoded += [weight.name for weight, scale in tensor.members if scale is not None]
            elif tensor.action == COPY:
                if where := _copy_tensor(reader, tensor, writer, job, advance):
                    kept_non_finite[tensor.source.name] = where
            elif tensor.action == CONSUMED:  # a scale for its weight's decode: hashed as the reading passes it
                if tensor.source.name not in used_scales:  # its weight comes later in the file
                    early_scales[tensor.source.name] = bytes(reader.read(tensor.source.begin, tensor.source.nbytes))
                advance(tensor.source.nbytes)
            else:
                raise AssertionError(f"{tensor.source.name}: unknown action {tensor.action!r}")
        source_sha256 = reader.finish()
        output_sha256 = writer.commit()
    except BaseException:
        if writer:
            writer.abort()
        raise
    finally:
        if reader:
            reader.close()
    seconds = {"total": time.perf_counter() - started, "read": reader.read_s, **timing,
               "source_hash": reader.hash.busy_s, "output_hash": writer.hash_s, "write": writer.write_s}
    return {"file": shard.file, "source_size": shard.source_size, "source_sha256": source_sha256,
            "size": writer.size, "sha256": output_sha256, "quantized": errors, "decoded": decoded, "kept_non_finite": kept_non_finite,
            "source_identity": {**file_identity(reader.opened), "opened_ns": reader.opened_ns},
            "seconds": {k: round(v, 4) for k, v in seconds.items()}}
