"""Pure planning of ``--to bf16``: checkpoint headers -> each stored weight decoded exactly to bf16
(and a fused family's experts written back into its release's fused tensors), the rest copied.
Like ``quant.plan``, never reads tensor data; the same executor (``convert``) runs the plan.
"""

from __future__ import annotations

from pathlib import Path

from quant import blocks, third_party
from quant.checkpoint import HF_QUANT_CONFIG, Checkpoint, config_int
from quant.formats.codecs import Codec, codec_for_config, get_codec
from quant.formats.constants import BLOCK
from quant.fused import name_pattern, pieces
from quant.layout import Family, FusedTensor, UnknownFamilyError, family_for
from quant.outputs import aux_files
from quant.plan import (
    ASSEMBLE,
    CONSUMED,
    COPY,
    DECODE,
    Plan,
    PlanError,
    ShardPlan,
    TensorPlan,
    _index_warnings,
    tokenizer_warnings,
    check_structure,
)
from quant.quark_config import format_kind
from quant.safetensors_io import ShardHeader, TensorInfo, numel
from quant.structure import declared_counts


def _decoded_shape(header: ShardHeader, info: TensorInfo, scale: TensorInfo, codec: Codec) -> tuple[int, ...]:
    """The bf16 shape a stored weight decodes to, after checking it and its scale are the codec's; a
    stacked weight ``[experts, out, in]`` (``fused_experts.writes: stacked``) as one matrix per expert."""
    stacked = info.shape[:1] if len(info.shape) == 3 else ()
    if problem := codec.stored_shape_problem(info.shape[len(stacked):]):
        raise PlanError(f"{header.path}: {info.name} {info.dtype}{list(info.shape)}: {problem}; not a "
                        f"{codec.name} weight quantgate can decode: re-export the checkpoint (gate checkpoint "
                        "lists every problem)")
    shape = codec.logical_shape(info.shape[len(stacked):])
    _, scale_dtype, scale_shape = codec.outputs(info.name, shape)[1]
    expected = (None, scale_dtype, (*stacked, *scale_shape))
    if (scale.dtype, scale.shape) != expected[1:]:
        raise PlanError(f"{header.path}: {info.name} is {info.dtype}{list(info.shape)} but its scale is "
                        f"{scale.dtype}{list(scale.shape)}, not the {codec.name} scale {expected[1]}"
                        f"{list(expected[2])}; cannot decode it (gate checkpoint lists every problem)")
    return (*stacked, *shape)


def _plan_decode(header: ShardHeader, codec: Codec, assembled: list[TensorPlan]) -> tuple[TensorPlan, ...]:
    """Each stored weight of ``codec`` (with its scale beside it) decoded to bf16, the rest copied;
    the weights of a fused tensor written back (``assembled``) are read by its ASSEMBLE, which
    takes the place of the first of them in the file."""
    tensors = header.tensors
    absorbed = {t.name for plan in assembled for member in plan.members for t in member if t is not None}
    starts = {plan.source.name: plan for plan in assembled}
    weights = {n for n, t in tensors.items() if t.dtype == codec.weight_dtype and len(t.shape) in (2, 3)
               and n + codec.scale_suffix in tensors}
    scales = {n + codec.scale_suffix for n in weights}
    plans = []
    for info in sorted(tensors.values(), key=lambda t: t.begin):
        if info.name in starts:
            plans.append(starts[info.name])
        if info.name in absorbed:
            continue
        if info.name in scales:
            plans.append(TensorPlan(info, CONSUMED, ()))
            continue
        if info.name not in weights:
            plans.append(TensorPlan(info, COPY, ((info.name, info.dtype, info.shape),)))
            continue
        scale = tensors[info.name + codec.scale_suffix]
        plans.append(TensorPlan(info, DECODE, ((info.name, "BF16", _decoded_shape(header, info, scale, codec)),),
                                scale=scale))
    return tuple(plans)


def _fused_back(checkpoint: Checkpoint, family: Family | None, codec: Codec) -> dict[str, list[TensorPlan]]:
    """``--to bf16`` of a family whose release stores its experts fused: the per-expert weights of
    each fused tensor (``fused_experts``) planned as one ASSEMBLE that writes the release's tensor,
    name, axes and gate/up layout, by shard file. Every expert and projection must be there, in one
    shard, each either stored in ``codec`` (decoded) or kept bf16 (copied bit for bit)."""
    if family is None or family.fused_experts is None:
        return {}
    fused = family.fused_experts
    specs = [(spec, name_pattern(spec)) for spec in fused.tensors]
    found: dict[str, tuple[FusedTensor, dict]] = {}  # fused name -> (its spec, {(expert, projection): (file, info)})
    for file, header in checkpoint.headers.items():
        for name, info in header.tensors.items():
            for spec, pattern in specs:
                if (m := pattern.match(name)) and (target := spec.fused_name(m["experts"])):
                    found.setdefault(target, (spec, {}))[1][(int(m["e"]), m["proj"])] = (file, info)
                    break
    text_config = family.text_config(checkpoint.config)
    by_file: dict[str, list[TensorPlan]] = {}
    for target, (spec, members) in sorted(found.items()):
        experts, out, inner = (config_int(text_config, key, checkpoint.config_path)
                               for key in (fused.experts_key, spec.out_key, spec.in_key))
        shape = spec.expected_shape(experts, out, inner)
        what = (f"{target} BF16{list(shape)} (stored fused by the {family.name} release: {'/'.join(spec.projections)} "
                f"of {experts} experts, {fused.experts_key} in config.json)")
        layout = pieces(TensorInfo(target, "BF16", shape, 0, 2 * numel(shape)), spec, out, inner)
        if extra := sorted(set(members) - {(p.expert, p.projection) for p in layout}):
            raise PlanError(f"{checkpoint.folder}: {members[extra[0]][1].name}: expert {extra[0][0]} is beyond the "
                            f"{experts} experts of {what}; the checkpoint and its config.json disagree")
        first_file, chosen = None, []
        for piece in layout:
            if (piece.expert, piece.projection) not in members:
                raise PlanError(f"{checkpoint.folder}: no tensor {piece.name}: --to bf16 writes {what} back from "
                                "every expert's weights; the checkpoint is incomplete: re-export it")
            file, info = members[(piece.expert, piece.projection)]
            header, first_file = checkpoint.headers[file], first_file or file
            if file != first_file:
                raise PlanError(f"{checkpoint.folder}: {info.name} is in {file}, {layout[0].name} in {first_file}: "
                                f"--to bf16 writes {what} in one shard, from the experts' weights in that shard; "
                                "put one layer's experts in one shard (or decode with a family manifest without "
                                "fused_experts, which keeps them per expert)")
            scale = header.tensors.get(info.name + codec.scale_suffix)
            if info.dtype == codec.weight_dtype and scale is not None:
                got = _decoded_shape(header, info, scale, codec)
            elif info.dtype == "BF16" and scale is None:  # kept bf16 by the recipe: copied as it is
                got = tuple(info.shape)
            else:
                raise PlanError(f"{header.path}: {info.name} {info.dtype}{list(info.shape)} is neither a {codec.name} "
                                f"weight with its scale nor a bf16 one: cannot write {what} from it")
            if tuple(got) != (out, inner):
                raise PlanError(f"{header.path}: {info.name} is [{got[0]}, {got[1]}] once decoded, not the "
                                f"[{out}, {inner}] ({spec.out_key}, {spec.in_key}) each expert of {what} holds; the "
                                "checkpoint and its config.json disagree")
            chosen.append((info, scale))
        start = min((info for info, _ in chosen), key=lambda t: t.begin)
        by_file.setdefault(first_file, []).append(
            TensorPlan(start, ASSEMBLE, ((target, "BF16", shape),), pieces=layout, members=tuple(chosen)))
    return by_file


def _blocks_back(checkpoint: Checkpoint, family: Family) -> dict[str, list[TensorPlan]]:
    """``--to bf16`` of the release's own MXFP4 layout (``quant.blocks``): each ``<fused>_blocks`` with
    its ``_scales`` planned as one ASSEMBLE writing ``<fused>`` in the release's bf16 axes, expert
    by expert (each expert's slice of the two tensors is one weight and its scale)."""
    fused = family.fused_experts
    text_config = family.text_config(checkpoint.config)
    by_file: dict[str, list[TensorPlan]] = {}
    for file, header in checkpoint.headers.items():
        for name, info in sorted(header.tensors.items()):
            target = blocks.fused_name(name)
            spec = fused.match(target) if target else None
            if spec is None:
                continue
            experts, out, inner = (config_int(text_config, key, checkpoint.config_path)
                                   for key in (fused.experts_key, spec.out_key, spec.in_key))
            rows = out * len(spec.projections)
            scales = header.tensors.get(target + blocks.SCALES)
            if problem := blocks.layout_problem(info, scales, (experts, rows, inner)):
                raise PlanError(f"{header.path}: {name}: {problem}; cannot decode it (gate checkpoint lists every "
                                "problem)")
            shape = spec.expected_shape(experts, out, inner)
            layout = blocks.expert_matrices(TensorInfo(target, "BF16", shape, 0, 2 * numel(shape)), spec, out, inner)
            weight_bytes, scale_bytes = rows * inner // 2, rows * inner // BLOCK
            members = tuple((TensorInfo(name, "U8", (rows, inner // 2), info.begin + e * weight_bytes,
                                        info.begin + (e + 1) * weight_bytes),
                             TensorInfo(scales.name, "U8", (rows, inner // BLOCK), scales.begin + e * scale_bytes,
                                        scales.begin + (e + 1) * scale_bytes)) for e in range(experts))
            by_file.setdefault(file, []).append(
                TensorPlan(members[0][0], ASSEMBLE, ((target, "BF16", shape),), pieces=layout, members=members))
    return by_file


# The schemes ``quant.formats.third_party_decode`` decodes (MXFP8 is read by gate checkpoint, not decoded)
DECODED_SCHEMES = (third_party.NVFP4, third_party.MXFP4, third_party.INT4, third_party.INT8, third_party.FP8,
                   third_party.FP8_CHANNEL, third_party.FP8_BLOCK)
QUANTIZED_DTYPES = ("U8", "I8", "I32", "F8_E4M3", "F8_E5M2")  # a weight stored so is not a bf16 one
KV_CACHE_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale")  # a quantized KV cache's; none in bf16


def _third_party_shards(checkpoint: Checkpoint, fmt: str) -> tuple[ShardPlan, ...]:
    """A compressed-tensors or ModelOpt checkpoint: each module it stores quantized (``third_party.read_modules``:
    the format's own matching of its config to the modules) decoded to ``<module>.weight`` bf16 by its scheme,
    the scales, zero points and ``weight_shape`` it reads consumed, its static activation scales and the KV
    cache's scales dropped (a bf16 model quantizes neither); everything else copied. Refused, naming the
    tensor: a layout problem (gate checkpoint lists them all), a scheme not decoded, a module's tensors split
    across shards, and a weight stored quantized that no scheme of the config decodes."""
    where = checkpoint.quantization_config_source
    try:
        config = third_party.parse(fmt, checkpoint.quantization_config)
    except third_party.UnsupportedScheme as exc:
        raise PlanError(f"{where}: {exc}") from None
    tensors = checkpoint.tensors()
    modules, problems = third_party.read_modules(tensors, config)
    if problems:
        name, why, fix = problems[0]
        raise PlanError(f"{checkpoint.folder}: {name}: {why}; {fix} (gate checkpoint lists every problem: "
                        f"{len(problems)} here)")
    file_of = {name: file for file, header in checkpoint.headers.items() for name in header.tensors}
    decoded: dict[str, TensorPlan] = {}  # stored weight -> its DECODE
    consumed: set[str] = set()
    for module, found in sorted(modules.items()):
        scheme = found.scheme
        weight = tensors[f"{module}.{scheme.weight}"]
        if scheme.label not in DECODED_SCHEMES:
            raise PlanError(f"{checkpoint.folder}: {weight.name}: {scheme.label} ({scheme.fmt} {scheme.storage}) is "
                            f"read by gate checkpoint but not decoded; --to bf16 decodes {', '.join(DECODED_SCHEMES)}")
        rows = [row for row in scheme.tensors(*found.shape)[1:] if f"{module}.{row.suffix}" in tensors]
        for row in rows:
            other = f"{module}.{row.suffix}"
            if file_of[other] != file_of[weight.name]:
                raise PlanError(f"{checkpoint.folder}: {other} is in {file_of[other]}, {weight.name} in "
                                f"{file_of[weight.name]}: --to bf16 decodes a module from the tensors in its weight's "
                                "shard; re-shard the checkpoint so each module's tensors share a file")
            consumed.add(other)
        params = tuple(tensors[f"{module}.{row.suffix}"] for row in rows if not row.activation)
        decoded[weight.name] = TensorPlan(weight, DECODE, ((f"{module}.weight", "BF16", found.shape),),
                                          scale=tensors.get(f"{module}.weight_scale"), scheme=scheme, params=params)
    consumed.update(name for name in tensors if name.endswith(KV_CACHE_SCALES))
    left = [info for name, info in sorted(tensors.items()) if name not in decoded and name not in consumed
            and info.dtype in QUANTIZED_DTYPES and name.endswith((".weight", ".weight_packed"))]
    if left:
        raise PlanError(f"{checkpoint.folder}: {left[0].name} is {left[0].dtype}{list(left[0].shape)}: stored "
                        f"quantized, but no {fmt} scheme of the config decodes it ({len(left)} such; a stacked 3-D "
                        "expert tensor is not decoded): the output would not be a bf16 checkpoint")
    shards = []
    for file, header in checkpoint.headers.items():
        plans = []
        for info in sorted(header.tensors.values(), key=lambda t: t.begin):
            if info.name in decoded:
                plans.append(decoded[info.name])
            elif info.name in consumed:
                plans.append(TensorPlan(info, CONSUMED, ()))
            else:
                plans.append(TensorPlan(info, COPY, ((info.name, info.dtype, info.shape),)))
        shards.append(ShardPlan(file, header.file_size, tuple(plans), header.identity, header.header_sha256))
    return tuple(shards)


def make_decode_plan(source: Path | Checkpoint, family: Family | None = None) -> Plan:
    """``--to bf16``: every weight stored in the checkpoint's declared format decoded exactly to bf16;
    a family whose release stores its experts fused (``family``, else the config's, if any) gets
    them back in that release's fused tensors."""
    checkpoint = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    # hf_quant_config.json is ModelOpt's config: the engines would read the bf16 output as quantized by it
    aux = tuple(name for name in aux_files(checkpoint.folder) if name != HF_QUANT_CONFIG)
    if fmt := format_kind(checkpoint.quantization_config):  # each module by its own scheme; experts stay per expert
        shards = _third_party_shards(checkpoint, fmt)
        warnings = _index_warnings(checkpoint) + tokenizer_warnings(checkpoint)
        if not any(t.action == DECODE for s in shards for t in s.tensors):
            warnings.append(f"no {fmt} weight found: the output is a copy with the quantization config removed")
        return Plan(checkpoint.folder, checkpoint.config, get_codec(fmt), "bf16", shards, aux, tuple(warnings))
    if family is None:
        try:
            family = family_for(checkpoint.config)
        except UnknownFamilyError:  # decoding needs no family: only fused experts are put back by one
            family = None
    native = blocks.is_native(checkpoint.config, family)  # the release's own MXFP4 (gpt-oss's *_blocks)
    try:
        codec = get_codec("mxfp4") if native else codec_for_config(checkpoint.config)
    except ValueError as exc:
        raise PlanError(f"{checkpoint.config_path}: {exc}") from None
    warnings = _index_warnings(checkpoint) + tokenizer_warnings(checkpoint)
    declared = declared_counts(checkpoint, family) if family is not None else None
    assembled = _blocks_back(checkpoint, family) if native else _fused_back(checkpoint, family, codec)
    if family is not None:  # the experts put back must all be there, each written once
        check_structure(checkpoint, family, declared)
    shards = tuple(ShardPlan(file, header.file_size, _plan_decode(header, codec, assembled.get(file, [])),
                             header.identity, header.header_sha256) for file, header in checkpoint.headers.items())
    if not any(t.action in (DECODE, ASSEMBLE) for s in shards for t in s.tensors):
        warnings.append(f"no {codec.name} weight found: the output is a copy with the quantization_config removed")
    return Plan(checkpoint.folder, checkpoint.config, codec, "bf16", shards, aux, tuple(warnings), family)


__all__ = ["make_decode_plan"]
