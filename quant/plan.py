"""Pure planning: checkpoint headers (+ family + recipe) -> per-tensor actions, exclude list, sizes.

Here, and only here, each tensor's fate is decided: ``copy`` it, ``encode`` it into the plan's
codec (``make_plan``), ``decode`` it from the codec back to bf16 (``quant.decode_plan``, for
``--to bf16``), or nothing for a scale its weight's decode consumes. Reads no tensor data but the
few small tables of expert ids it checks (``quant.structure``), so ``quantize --dry-run`` answers
for a 1.5 TB checkpoint from headers alone, and the one executor (``convert``) only moves bytes the
plan already sized.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from quant import blocks
from quant.checkpoint import TOKENIZER_FIX, Checkpoint, config_int, tokenizer_problem
from quant.engines import Module, ReplayContext, draft_name, replay, select
from quant.engines.block_partition import block_findings, tp_summary, tp_warning
from quant.engines.config import layer_findings
from quant.engines.fusion import fusing_gpus, main_model_fusion
from quant.engines.replay import exclude_entries
from quant.engines.serving import DEFAULT
from quant.errors import QuantgateError
from quant.formats.codecs import Codec, get_codec
from quant.fused import Piece, pieces
from quant.layout import Family, FusedTensor, family_for
from quant.outputs import INDEX_NAME, aux_files
from quant.quark_config import strip_quantization_config
from quant.recipe import Recipe, RecipeError
from quant.rungs import INPUT_SCALE, RUNGS, SCALAR_DTYPE, SCALAR_SHAPE
from quant.static_scales import MeasuredInputs, input_scales
from quant.release_check import (
    check_serve,
    failing_newest,
    named,
    outcomes,
    release_warnings,
    rule_sets,
    ways_out,
)
from quant.release_check import summary as release_summary
from quant.safetensors_io import TensorInfo, encoded_size
from quant.serving import NamingError, build_exclude, expert_groups
from quant.structure import declared_counts, expert_id_findings, structure_findings

QUANTIZABLE_SOURCE_DTYPES = ("BF16", "F16", "F32")
Entry = tuple[str, str, tuple[int, ...]]  # (name, dtype, shape) of an output tensor


class PlanError(QuantgateError, ValueError):
    """The source cannot be converted as asked; the message names the file/tensor and the fix."""


COPY, ENCODE, DECODE, CONSUMED, ASSEMBLE = "copy", "encode", "decode", "consumed", "assemble"


@dataclass(frozen=True)
class TensorPlan:
    source: TensorInfo
    # COPY, ENCODE, DECODE, CONSUMED (a scale read by its weight's decode; no output), or ASSEMBLE
    # (``--to bf16`` of a fused family: one fused tensor written from its experts' weights)
    action: str
    outputs: tuple[Entry, ...]
    role: str = "other"
    linear: bool = False
    mtp: bool = False
    scale: TensorInfo | None = None  # DECODE: the weight's scale tensor
    # A fused expert tensor (``quant.fused``): the per-expert matrices it holds, which ENCODE writes
    # as ``outputs`` (each piece's weight and scale, in this order); COPY keeps the tensor as it is.
    # ASSEMBLE: where each expert's projection goes in the fused output (offsets from its start).
    pieces: tuple[Piece, ...] = ()
    # ASSEMBLE: per piece, the stored weight and its scale (None: a weight kept bf16, copied); the
    # plan's ``source`` is the first of them in the file, where the fused tensor is written.
    members: tuple[tuple[TensorInfo, TensorInfo | None], ...] = ()
    # ``fused_experts.writes: blocks``: ENCODE writes the pieces (one whole matrix per expert) into
    # the two ``outputs`` as the release's ``*_blocks`` / ``*_scales`` (``quant.blocks``)
    blocks: bool = False
    # ``fused_experts.writes: stacked``: ENCODE writes the pieces, expert by expert, into the two
    # ``outputs`` as one stacked weight and one stacked scale under the fused tensor's name
    stacked: bool = False
    # DECODE of a third-party checkpoint: the module's scheme (``quant.third_party.Scheme``) and every
    # other tensor of it the decode reads (scales, zero points, weight_shape), all in this shard
    scheme: object | None = None
    params: tuple[TensorInfo, ...] = ()
    # ENCODE by an mxfp4 recipe: the precision-ladder rung (``quant.rungs``) the weight is written at, and for a
    # rung with static FP8 activations the ``<module>.input_scale`` value (``quant.static_scales``)
    rung: str = ""
    input_scale: float | None = None

    def linear_modules(self) -> list[tuple[str, tuple[int, int]]]:
        """The Linear modules this tensor holds, by the engines' per-expert names, with their [out, in]."""
        if self.pieces:
            return [(p.name.removesuffix(".weight"), (p.rows, p.cols)) for p in self.pieces]
        if self.linear and len(self.source.shape) == 2:
            return [(self.source.name.removesuffix(".weight"), tuple(self.source.shape))]
        return []


@dataclass(frozen=True)
class ShardPlan:
    file: str
    source_size: int
    tensors: tuple[TensorPlan, ...]
    # The source as planned: the converter refuses a shard whose file or header is no longer this
    # one (``source.SourceReader``), since every offset above was read from that header.
    source_identity: dict | None = None
    header_sha256: str | None = None

    @property
    def entries(self) -> list[Entry]:
        return [entry for tensor in self.tensors for entry in tensor.outputs]

    @cached_property
    def output_size(self) -> int:
        return encoded_size(self.entries)


@dataclass(frozen=True)
class Plan:
    source_dir: Path
    config: dict
    codec: Codec  # the format encoded into, or, when ``to`` is "bf16", decoded from
    to: str
    shards: tuple[ShardPlan, ...]
    aux_files: tuple[str, ...]
    warnings: tuple[str, ...]
    family: Family | None = None  # encoding only: roles, recipe and exclude list
    recipe: Recipe | None = None
    num_hidden_layers: int = 0
    exclude: tuple[str, ...] = ()
    releases: dict | None = None  # per engine: the release ranges that load the output, fail, are not read
    # a mixed plan's static input scales: the sensitivity sidecar read, and per scale group its amax, tokens, scale
    calibration: MeasuredInputs | None = None
    static_scales: dict | None = None

    @property
    def decodes(self) -> bool:
        return self.to == "bf16"

    @property
    def tensors(self) -> list[TensorPlan]:
        return [tensor for shard in self.shards for tensor in shard.tensors]

    @property
    def writes_blocks(self) -> bool:
        """The family's fused experts are written in its release's own MXFP4 layout (``quant.blocks``)."""
        fused = self.family and self.family.fused_experts
        return bool(fused) and fused.writes == "blocks" and not self.decodes and any(t.blocks for t in self.tensors)

    @property
    def mixed(self) -> bool:
        """Some weight is written at another rung than the recipe's format (Quark's ``layer_quant_config``)."""
        return self.recipe is not None and any(t.action == ENCODE and t.rung not in ("", self.recipe.format)
                                               for t in self.tensors)

    def modules(self) -> dict[str, Module]:
        """The Linear modules of the planned output, quantized or not, as the engines name them; in a mixed
        plan each quantized one labelled with its rung, as ``gate checkpoint`` reads it from the tensors."""
        mixed = self.mixed
        return {module: Module(t.action == ENCODE, shape, t.role, t.rung if mixed and t.action == ENCODE else "")
                for t in self.tensors for module, shape in t.linear_modules()}

    def quantization_config(self) -> dict:
        if self.writes_blocks:  # the release's own config (gpt-oss: quant_method mxfp4), not Quark's
            return blocks.native_config(self.family.fused_experts.blocks_config)
        config = self.codec.quantization_config(list(self.exclude), self.recipe.scale_rule, self.recipe.weight_only)
        if self.mixed:
            config["layer_quant_config"] = self.layer_quant_config()
        return config

    def layer_quant_config(self) -> dict[str, dict]:
        """Quark's per-layer specs for the modules written at another rung than the global one, under keys both
        engines match: a FusedMoE as ``<layer>.mlp.experts*`` (fnmatch; vLLM asks the FusedMoE by
        ``<layer>.mlp.experts``, which ``...experts.*`` would miss, sglang by each expert's projection), any other
        module by its exact name (vLLM matches a key without ``*`` as a substring; sglang by fnmatch), and an
        MTP layer's modules also under each release's draft name (sglang's ``model.decoder.*``)."""
        keys: dict[str, str] = {}
        by_rung: dict[str, set[str]] = {}
        for t in self.tensors:
            if t.action == ENCODE and t.rung != self.recipe.format:
                by_rung.setdefault(t.rung, set()).update(module for module, _ in t.linear_modules())
        for rung, modules in by_rung.items():
            experts = expert_groups(modules)
            grouped = {m for members in experts.values() for m in members}
            for name in sorted(experts) + sorted(modules - grouped):
                wildcard = "*" if name in experts else ""
                for alias in {name, *(draft_name(name, rules, self.num_hidden_layers)
                                       for rules in select("all", self.family))} - {None}:
                    keys[alias + wildcard] = rung
        return {key: RUNGS[rung].spec(self.recipe.scale_rule) for key, rung in sorted(keys.items())}

    def rung_units(self) -> list[dict]:
        """Per (decoder layer, role, MTP or not): the rung its Linears are written at, with their count and the
        bytes written, in layer order (the conversion manifest's record and ``--dry-run``'s)."""
        units: dict[tuple, dict] = {}
        for t in self.tensors:
            if not t.linear_modules():
                continue
            layer = self.family.layer_index(t.source.name)
            rung = (t.rung or self.recipe.format) if t.action == ENCODE else "bf16"
            unit = units.setdefault((layer if layer is not None else -1, t.role, t.mtp, rung),
                                    {"layer": layer, "role": t.role, "mtp": t.mtp, "rung": rung,
                                     "label": RUNGS[rung].label if rung in RUNGS else rung, "modules": 0, "bytes": 0})
            unit["modules"] += len(t.linear_modules())
            unit["bytes"] += encoded_size(list(t.outputs), b"")
        return [units[key] for key in sorted(units)]

    def output_config(self) -> dict:
        config = strip_quantization_config(self.config)
        if self.decodes:  # compressed-tensors' older key, which the engines read as quantization_config
            config.pop("compression_config", None)
        written = dict(self.family.config_keys) if self.family else {}
        for keys in written.values():  # a decode (or another format) leaves none of them behind
            for key, _ in keys:
                config.pop(key, None)
        if not self.decodes:
            config.update(dict(written.get(self.recipe.format, ())))
            config["quantization_config"] = self.quantization_config()
        return config

    def weight_map(self) -> dict[str, str]:
        return {name: shard.file for shard in self.shards for name, _, _ in shard.entries}

    def summary(self) -> dict:
        sizes = {"source": str(self.source_dir), "to": self.to, "shards": len(self.shards),
                 "bytes_in": sum(s.source_size for s in self.shards),
                 "bytes_out": sum(s.output_size for s in self.shards)}
        if self.decodes:
            return {**sizes, "from": self.codec.name,
                    "tensors_decoded": sum(t.action == DECODE for t in self.tensors)
                    + sum(scale is not None for t in self.tensors for _, scale in t.members),
                    "fused_tensors_written": sum(t.action == ASSEMBLE for t in self.tensors),
                    "tensors_copied": sum(t.action == COPY for t in self.tensors),
                    "aux_files": list(self.aux_files), "warnings": list(self.warnings)}
        quantized = [t for t in self.tensors if t.action == ENCODE]
        by_role: dict[str, dict[str, int]] = {}
        for tensor in self.tensors:
            counts = by_role.setdefault(tensor.role, {"quantize": 0, "keep": 0})
            counts["quantize" if tensor.action == ENCODE else "keep"] += 1
        aliases = sorted({alias for rules in select("all", self.family) for name in self.exclude
                          if (alias := draft_name(name, rules, self.num_hidden_layers)) and alias != name})
        return {
            **sizes,
            "family": self.family.name,
            "recipe": self.recipe.to_dict(),
            "num_hidden_layers": self.num_hidden_layers,
            "mtp_layers": sorted({str(layer) for t in self.tensors if t.mtp and (
                layer := self.family.classify(t.source.name, self.num_hidden_layers).layer) is not None}),
            "tensors": len(self.tensors),
            "tensors_quantized": len(quantized),
            "tensors_kept": len(self.tensors) - len(quantized),
            "by_role": by_role,
            "bytes_quantized_in": sum(t.source.nbytes for t in quantized),
            "exclude_count": len(self.exclude),
            "exclude": list(self.exclude),
            "draft_aliases": aliases,
            "releases": self.releases,
            "aux_files": list(self.aux_files),
            "warnings": list(self.warnings),
            # block FP8: the TP sizes each engine release span loads the output at
            "block_fp8_tp": tp_summary(self.modules(), self.family.text_config(self.config),
                                       self.quantization_config()),
            **(self.rung_record() if self.mixed else {}),
        }

    def rung_record(self) -> dict:
        """A mixed plan's rungs: per rung its Linears and bytes written, per unit (layer, role) its rung, and the
        static input scales with the calibration they were measured on (the conversion manifest keeps it)."""
        units = self.rung_units()
        rungs: dict[str, dict] = {}
        for unit in units:
            total = rungs.setdefault(unit["rung"], {"label": unit["label"], "modules": 0, "bytes": 0})
            total["modules"] += unit["modules"]
            total["bytes"] += unit["bytes"]
        calibration = self.calibration and {"path": str(self.calibration.path), "sha256": self.calibration.sha256,
                                            "source": self.calibration.source}
        return {"rungs": {rung: rungs[rung] for rung in RUNGS if rung in rungs}, "units": units,
                "calibration": calibration, "static_scales": self.static_scales}


def _index_warnings(checkpoint: Checkpoint) -> list[str]:
    """Refuse what would silently lose data; say what is done with tensors the index forgot."""
    missing, unlisted = checkpoint.index_problems()
    if missing:
        first = missing[0]
        raise PlanError(f"{checkpoint.folder / INDEX_NAME}: {first.name}: {first.why} ({len(missing)} such "
                        f"tensors); the index and shards disagree: {first.fix}")
    if checkpoint.unlisted_files:
        raise PlanError(f"{checkpoint.folder}: {', '.join(checkpoint.unlisted_files)}: not listed in {INDEX_NAME}, "
                        "so would not be converted; add their tensors to the index, or move them out of the folder")
    by_file: dict[str, list[str]] = {}
    for problem in unlisted:
        by_file.setdefault(problem.file, []).append(problem.name)
    return [f"{file}: {len(names)} tensors not in the source index (e.g. {names[0]}); converted by the recipe like "
            "the others and listed in the output index" for file, names in sorted(by_file.items())]


def tokenizer_warnings(checkpoint: Checkpoint) -> list[str]:
    """A source without a tokenizer converts (the output's weights are sound, and the tokenizer can
    follow), but no engine serves the output until one is copied in: said before converting."""
    why = tokenizer_problem(checkpoint.folder)
    return [f"{checkpoint.folder}: {why}: the engines cannot serve the output without one; {TOKENIZER_FIX}: "
            "into SRC before converting (they are carried over) or into the output after"] if why else []


def _plan_fused(info: TensorInfo, spec: FusedTensor, family: Family, recipe: Recipe, num_hidden_layers: int,
                file: str, text_config: dict, config_path: Path) -> TensorPlan:
    """A fused expert tensor: planned per expert and projection, from its header and the config."""
    sizes = {key: config_int(text_config, key, config_path)
             for key in (family.fused_experts.experts_key, spec.out_key, spec.in_key)}
    experts, out, inner = (sizes[k] for k in (family.fused_experts.experts_key, spec.out_key, spec.in_key))
    expected = spec.expected_shape(experts, out, inner)
    where = f"{file}: tensor {info.name} {info.dtype}{list(info.shape)}"
    if tuple(info.shape) != expected:
        axes = ", ".join(spec.axes)
        raise PlanError(f"{where} is not the fused [{axes}] layout config.json gives ({list(expected)}: "
                        f"{', '.join(f'{k}={v}' for k, v in sizes.items())}); the checkpoint and its config disagree: "
                        "use the release's config.json with its shards")
    writes_blocks = family.fused_experts.writes == "blocks"
    found = (blocks.expert_matrices if writes_blocks else pieces)(info, spec, out, inner)
    roles = {family.classify(p.name, num_hidden_layers) for p in found}
    if len(roles) != 1:
        raise PlanError(f"{where}: its experts' names ({found[0].name}, ...) match {len(roles)} roles of family "
                        f"{family.name}'s manifest; fix fused_experts.names or the role patterns")
    role = roles.pop()
    quantize = recipe.action(role) == "quantize"
    if quantize and _rung(recipe, role) not in ("", recipe.format):
        raise PlanError(f"{where}: family {family.name} stores its routed experts fused, which quantgate writes at "
                        f"the recipe's own format only; give this layer's routed experts {recipe.format} or keep them "
                        "(format: bf16)")
    if not quantize:  # kept as the release stores it
        return TensorPlan(info, COPY, ((info.name, info.dtype, info.shape),), role.role, role.linear, role.mtp,
                          pieces=found)
    if info.dtype not in QUANTIZABLE_SOURCE_DTYPES:
        raise PlanError(f"{where} is not a float tensor; quantize from a bf16 checkpoint")
    if writes_blocks:
        return _plan_blocks(info, found, role, recipe, where, family)
    fmt = get_codec(recipe.format)
    if problem := fmt.shape_problem((out, inner)):
        raise PlanError(f"{where}: each expert's {spec.projections[0]} [{out}, {inner}]: {problem}; keep this role "
                        "bf16 in the recipe")
    if family.fused_experts.writes == "stacked":  # one weight and one scale, each with the experts axis first
        outputs = tuple((name, dtype, (len(found), *shape))
                        for name, dtype, shape in fmt.outputs(info.name, (found[0].rows, found[0].cols)))
        return TensorPlan(info, ENCODE, outputs, role.role, role.linear, role.mtp, pieces=found, stacked=True)
    outputs = tuple(entry for p in found for entry in fmt.outputs(p.name, (p.rows, p.cols)))
    return TensorPlan(info, ENCODE, outputs, role.role, role.linear, role.mtp, pieces=found)


def _plan_blocks(info: TensorInfo, found: tuple[Piece, ...], role, recipe: Recipe, where: str,
                 family: Family) -> TensorPlan:
    """A fused tensor written as the release's MXFP4 blocks: only MXFP4 exists in that layout."""
    if recipe.format != "mxfp4":
        raise PlanError(f"{where}: family {family.name} writes its routed experts in the release's own MXFP4 layout "
                        f"(*_blocks / *_scales, quant_method mxfp4), the only quantized expert layout its engines' loaders "
                        f"were read to take ({family.name}'s loaders read no {recipe.format} expert scales: sglang "
                        "GptOssForCausalLM._load_normal_weights and vLLM GptOssModel._load_weights_other load the fused "
                        "weights and biases only); use --to mxfp4, or keep the experts bf16")
    if problem := get_codec("mxfp4").shape_problem((found[0].rows, found[0].cols)):
        raise PlanError(f"{where}: each expert's [{found[0].rows}, {found[0].cols}]: {problem}; keep this role bf16 "
                        "in the recipe")
    if recipe.weight_only:
        raise PlanError(f"{where}: quant_method mxfp4 has no weight-only form (its config carries no activation spec: "
                        "the engines choose the activation path); drop --weight-only / activations: none")
    outputs = blocks.outputs(info.name, len(found), found[0].rows, found[0].cols)
    return TensorPlan(info, ENCODE, outputs, role.role, role.linear, role.mtp, pieces=found, blocks=True)


def _plan_tensor(info: TensorInfo, family: Family, recipe: Recipe, num_hidden_layers: int, file: str,
                 checkpoint: Checkpoint) -> TensorPlan:
    if family.fused_experts and (spec := family.fused_experts.match(info.name)):
        return _plan_fused(info, spec, family, recipe, num_hidden_layers, file, family.text_config(checkpoint.config),
                           checkpoint.config_path)
    role = family.classify(info.name, num_hidden_layers)
    quantize = recipe.action(role) == "quantize"
    if quantize and not role.quantizable:
        raise RecipeError(f"recipe {recipe.name} asks to quantize {info.name} (role {role.role}), which must stay "
                          f"{info.dtype}: the engines build it unquantized")
    if not quantize:
        return TensorPlan(info, COPY, ((info.name, info.dtype, info.shape),), role.role, role.linear, role.mtp)
    where = f"{file}: tensor {info.name} {info.dtype}{list(info.shape)}"
    if info.dtype not in QUANTIZABLE_SOURCE_DTYPES:
        raise PlanError(f"{where} is not a float tensor; quantize from a bf16 checkpoint "
                        "(dequantize FP8 sources first)")
    if len(info.shape) != 2:
        raise PlanError(f"{where} is not a 2-D Linear weight; check the family manifest's role patterns")
    if 0 in info.shape:
        raise PlanError(f"{where} has no elements: an empty Linear weight cannot be quantized; fix the source "
                        "checkpoint or keep this role bf16 in the recipe")
    fmt = get_codec(recipe.format)
    rung = _rung(recipe, role)
    problem = (get_codec(RUNGS[rung].weight) if rung else fmt).shape_problem(info.shape)
    if problem:
        raise PlanError(f"{where}: {problem}; keep this role bf16 in the recipe")
    return TensorPlan(info, ENCODE, rung_outputs(rung, info.name, tuple(info.shape), fmt), role.role, role.linear,
                      role.mtp, rung=rung)


def _rung(recipe: Recipe, role) -> str:
    """The precision-ladder rung a quantized tensor is written at: only an mxfp4 recipe mixes them (another
    recipe's ``fp8`` is block FP8, its codec, not the per-tensor rung): "" for other recipes."""
    return recipe.rung(role) if recipe.format == "mxfp4" else ""


def rung_outputs(rung: str, name: str, shape: tuple[int, int], codec: Codec) -> tuple[Entry, ...]:
    """The tensors a weight is written as at ``rung`` (``quant.rungs``; "": ``codec``'s): its weight codec's
    (MXFP4 codes and block scales; FP8 e4m3 codes and one ``weight_scale``), then, for a rung with static FP8
    activations, ``<module>.input_scale``, stored as Quark stores it."""
    weight = (get_codec(RUNGS[rung].weight) if rung else codec).outputs(name, shape)
    if rung and RUNGS[rung].static_input_scale:
        return (*weight, (name.removesuffix(".weight") + INPUT_SCALE, SCALAR_DTYPE, SCALAR_SHAPE))
    return weight


def make_plan(source: Path | Checkpoint, recipe: Recipe, family: Family | None = None,
              serve: tuple[tuple[str, str], ...] = (), calibration: MeasuredInputs | None = None) -> Plan:
    """The plan for converting ``source`` by ``recipe``; ``serve``: the (engine, release) pairs the output
    is for (``quantize --serve``), refused where one of them would not load it; ``calibration``: a
    sensitivity pass's measurements, where the static input scales of a mixed recipe's W4A8 / W8A8 rungs come
    from."""
    checkpoint = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    source_dir, config = checkpoint.folder, checkpoint.config
    family = family or family_for(config)
    num_hidden_layers = config_int(family.text_config(config), family.num_layers_key, checkpoint.config_path)
    checkpoint.check_declared_counts()  # 10**9 layers: refused before anything walks them
    declared = declared_counts(checkpoint, family)
    warnings = _index_warnings(checkpoint) + tokenizer_warnings(checkpoint)

    shards = []
    for file, header in checkpoint.headers.items():
        infos = sorted(header.tensors.values(), key=lambda t: t.begin)
        tensors = tuple(_plan_tensor(info, family, recipe, num_hidden_layers, file, checkpoint) for info in infos)
        shards.append(ShardPlan(file, header.file_size, tensors, header.identity, header.header_sha256))

    _check_roles(shards, family)
    _check_distinct_outputs(shards, family)
    shards, static_scales, scale_warnings = _with_input_scales(shards, recipe, calibration)
    warnings += scale_warnings
    check_structure(checkpoint, family, declared)
    for finding in expert_id_findings(checkpoint, family, declared):  # the hash tables' values: small, read here
        raise PlanError(f"{checkpoint.folder}: {finding.module}: {finding.why}; {finding.fix}")
    kept, quantized = set(), set()
    for shard in shards:
        for tensor in shard.tensors:
            for module, _ in tensor.linear_modules():
                (quantized if tensor.action == ENCODE else kept).add(module)
    if not quantized:
        warnings.append("the recipe quantizes no tensor of this checkpoint; the output is a copy with a Quark config")
    if get_codec(recipe.format).warning:
        warnings.append(f"{recipe.format}: {get_codec(recipe.format).warning}")
    if recipe.weight_only:
        warnings.append("weight-only (W4A16) config: sglang's Quark loader needs W4A4 for MXFP4 and will refuse it; "
                        "vLLM loads it")
    # the release's own MXFP4 config (quant.blocks) carries no exclude list the engines read
    writes_blocks = any(t.blocks for s in shards for t in s.tensors)
    exclude = () if writes_blocks else build_exclude(kept, quantized, num_hidden_layers, family)
    plan = Plan(source_dir, config, get_codec(recipe.format), recipe.format, tuple(shards), aux_files(source_dir),
                tuple(warnings), family, recipe, num_hidden_layers, tuple(exclude),
                calibration=calibration if static_scales else None, static_scales=static_scales or None)
    more, releases = _check_engines_load(plan, serve)
    # the default serving is TP 8: where the block-FP8 output does not load at it, say so
    more += [tp] if (tp := tp_warning(plan.modules(), family.text_config(config), plan.quantization_config())) else []
    return replace(plan, warnings=plan.warnings + tuple(more), releases=releases)


def _with_input_scales(shards: list[ShardPlan], recipe: Recipe,
                       calibration: MeasuredInputs | None) -> tuple[list[ShardPlan], dict, list[str]]:
    """A mixed recipe's rungs checked, and each weight at a static-activation rung given its input scale.
    Refused (exit 2): a mixed recipe with ``--weight-only`` (its rungs quantize activations), and one MoE
    layer's routed experts at two rungs (both engines load a layer's experts with one scheme; sglang raises)."""
    encoded = [t for s in shards for t in s.tensors if t.action == ENCODE and t.rung]
    if recipe.weight_only and any(t.rung != recipe.format for t in encoded):
        others = ", ".join(sorted({t.rung for t in encoded} - {recipe.format}))
        raise RecipeError(f"recipe {recipe.name} writes some layers at other rungs ({others}), which quantize "
                          "activations; a weight-only (W4A16) mixed checkpoint is not one the ladder "
                          "writes: drop --weight-only / activations: none")
    rungs_of: dict[str, dict[str, str]] = {}  # FusedMoE -> rung -> one of its modules
    for t in encoded:
        for aggregate, members in expert_groups({m for m, _ in t.linear_modules()}).items():
            rungs_of.setdefault(aggregate, {}).setdefault(t.rung, min(members))
    for aggregate, rungs in sorted(rungs_of.items()):
        if len(rungs) > 1:
            shown = ", ".join(f"{rung} ({module})" for rung, module in sorted(rungs.items()))
            raise RecipeError(f"recipe {recipe.name} gives the routed experts of {aggregate} {len(rungs)} rungs: "
                              f"{shown}; the engines load a layer's experts into one FusedMoE with one scheme (sglang "
                              "raises loading it): give them one format")
    static = [m for t in encoded if RUNGS[t.rung].static_input_scale for m, _ in t.linear_modules()]
    scales, record, warnings = input_scales(static, calibration)
    out = [replace(s, tensors=tuple(replace(t, input_scale=scales[t.source.name.removesuffix(".weight")])
                                    if t.action == ENCODE and t.rung and RUNGS[t.rung].static_input_scale else t
                                    for t in s.tensors)) for s in shards]
    return out, record, warnings


def check_structure(checkpoint: Checkpoint, family: Family, declared) -> None:
    """Refuse a source that is not whole (``quant.structure``: an expert, a layer's fused tensor or a
    required tensor missing, an index written twice): converted, it would pass for a complete model."""
    findings = structure_findings(checkpoint, family, declared)
    if findings:
        first = findings[0]
        more = f" (and {len(findings) - 1} more problem(s): gate checkpoint lists them)" if len(findings) > 1 else ""
        raise PlanError(f"{checkpoint.folder}: {first.module}: {first.why}; {first.fix}{more}")


def _check_roles(shards: list[ShardPlan], family: Family) -> None:
    """Refuse a checkpoint whose weights the family's roles do not name: a matrix matching no role
    would be copied as is while the engines look for the release's names (a transformers state_dict
    with fused 3-D experts, another family's layout, a renamed export)."""
    unmatched = [(s.file, t.source) for s in shards for t in s.tensors if t.role == "other" and len(t.source.shape) >= 2]
    if unmatched:
        shown = ", ".join(f"{info.name} {list(info.shape)} ({file})" for file, info in unmatched[:4])
        more = f" and {len(unmatched) - 4} more" if len(unmatched) > 4 else ""
        raise PlanError(f"{len(unmatched)} weight tensor(s) match no role of family {family.name}'s manifest: "
                        f"{shown}{more}. The checkpoint is not stored as the {family.name} release names its tensors; "
                        "convert the original release (not a re-saved state_dict), or fix the manifest's role "
                        "patterns (--family-manifest FILE)")


def _check_distinct_outputs(shards: list[ShardPlan], family: Family) -> None:
    """Refuse two outputs of one name (a per-expert name a fused tensor's experts are written as,
    also stored as it is): a shard's header holds one of them, the index maps the name to one file."""
    written: dict[str, str] = {}
    for shard in shards:
        for name, _, _ in shard.entries:
            if name in written:
                raise PlanError(f"{shard.file}: tensor {name} would be written twice (from {written[name]} and "
                                f"{shard.file}): the checkpoint stores it beside a fused tensor whose experts family "
                                f"{family.name}'s manifest writes under that name; remove the stale copy, or fix "
                                "fused_experts.tensors' names")
            written[name] = shard.file


def _check_native_rules(plan: Plan) -> None:
    """``fused_experts.writes: blocks`` is loaded by each engine's own MXFP4 path, replayed from its rule
    ``mxfp4_native``: a class whose rules were not read for it cannot be checked, so it is refused."""
    for rules in select("all", plan.family):
        if "mxfp4_native" not in rules.values:
            raise PlanError(f"{plan.family.path or plan.family.name}: fused_experts.writes: blocks, but {rules.id}'s "
                            f"rules for {rules.model_class} were not read to load that layout (no rule mxfp4_native); "
                            "write per_expert, or read the class's MXFP4 loader and add the rule")


def _check_engines_load(plan: Plan, serve: tuple[tuple[str, str], ...]) -> tuple[list[str], dict]:
    """Replay every engine release answered for on the planned checkpoint (served on the default setup,
    MI355X with TP; ``quant.release_check``): refuse what the newest release of an engine, or a
    ``serve`` release, would not load; warn naming the older releases that fail. Shared-expert fusion
    is a serving choice, not a checkpoint defect: the releases that fuse are named in a warning, with
    the ways out. Returns the warnings and the per-engine release ranges."""
    modules = plan.modules()
    draft = {module for t in plan.tensors if t.mtp for module, _ in t.linear_modules()}
    without_draft = {module: info for module, info in modules.items() if module not in draft}  # rungs kept
    kind = "mxfp4" if plan.writes_blocks else "fp8" if plan.recipe.format == "fp8" else "quark"
    if kind == "mxfp4":
        _check_native_rules(plan)
    qconfig = plan.quantization_config()
    text = plan.family.text_config(plan.config)

    def replayed(rules, with_draft: bool):
        return replay(ReplayContext(rules, modules if with_draft else without_draft, qconfig, plan.family.name,
                                    plan.num_hidden_layers, kind, plan.recipe.format.upper(), text))

    def at_default_tp(rules) -> list:  # a release served builds block FP8 per rank at the default TP 8
        fused, _ = main_model_fusion(rules, plan.family, plan.config, kind,
                                     exclude_entries(qconfig, rules, kind), DEFAULT, qconfig) \
            if rules.engine == "sglang" else (0, None)
        return block_findings(rules, modules, text, qconfig, replace(DEFAULT, check_tp=True), bool(fused))

    results = outcomes(plan.family, replayed, rule_sets(plan.family, qconfig))
    check_serve(results, plan.family, serve, at_default_tp)
    refused = [] if serve else failing_newest(results)
    if refused:
        listed = "; ".join(f"{f.engine}: {f.module}: {f.why}" for f in refused[:5])
        raise NamingError(f"this recipe gives a checkpoint that {len(refused)} engine check(s) of the newest "
                          f"releases read refuse: {listed}. Change the recipe (quantize whole fused modules and whole "
                          "expert layers), or name the older release you serve with --serve ENGINE==X")
    moe_present = {plan.family.layer_index(t.source.name) for t in plan.tensors
                   if t.role == "routed_expert" and not t.mtp}
    layers = [f for rules in select("all", plan.family) for f in layer_findings(rules, text, moe_present - {None})]
    warnings = [f"{f.engine}: {f.why}; {f.fix}" for f in layers] + release_warnings(results, plan.family)
    releases = release_summary(results, plan.family, serve)
    fusing = [o for o in results if o.fusion]
    if not fusing:
        return warnings, releases
    first = fusing[0].fusion[0]
    gpus = "; ".join(dict.fromkeys(fusing_gpus(o.rules) for o in fusing))  # each class's own rule, not DeepSeek-V2's
    spans = named("sglang", [v for o in fusing for v in o.releases])
    return warnings + [(f"shared-expert fusion: on {gpus} (TP, fusion on; the default MI355X is ROCm gfx950) "
                        f"{spans} fold the shared expert into the routed experts' FusedMoE and fail to load this "
                        f"output ({first.module}: {first.why}). "
                        f"Ways out: {ways_out(fusing[0], results, first)}. gate checkpoint lists each release and "
                        "GPU")], releases


__all__ = ["Plan", "PlanError", "ShardPlan", "TensorPlan", "make_plan"]
