"""Third-party quantized checkpoints read from their config and shard headers: compressed-tensors
(llm-compressor's format, ``quant_method: compressed-tensors``) and NVIDIA ModelOpt (``quant_method:
modelopt``, or an ``hf_quant_config.json`` whose ``producer.name`` is ``modelopt``).

Contract (the decoder, ``gate checkpoint --deep`` and the engines' replay build on it):

- ``scheme_label(fmt, spec)``: the canonical label of a scheme, one of ``LABELS``:
  ``nvfp4`` (FP4 E2M1 codes, FP8 E4M3 scale per 16, FP32 global scale), ``mxfp4`` (FP4 E2M1 codes, E8M0
  scale per 32), ``int4`` / ``int8`` (integers, scale per tensor / channel / group, zero points if
  asymmetric), ``fp8`` (FP8 E4M3, one scale), ``fp8-channel`` (one scale a row), ``fp8-block`` (one scale a
  block of rows x columns), ``mxfp8`` (FP8 E4M3, E8M0 scale per 32). ``""`` is an unquantized (bf16) module.
  The label names the numbers, not how they are stored: compressed-tensors' ``int-quantized`` and
  ``pack-quantized`` 8-bit are both ``int8``; ``Scheme.storage`` says how. ``spec`` is a compressed-tensors
  ``weights`` argument dict (its group's ``format`` beside it, as ``format``) or a ModelOpt ``quant_algo``.
- ``parse(fmt, qconfig) -> Config``: the config as the format defines it: its schemes, which module each
  applies to (``Config.resolve(module)``: compressed-tensors' target/ignore matching, ModelOpt's
  ``exclude_modules`` / ``quantized_layers``), refused ones raising ``UnsupportedScheme`` (exit 2) by name.
- ``Scheme.tensors(out, inner)``: what the scheme stores beside each module of logical ``[out, in]``, as
  ``Stored`` rows (suffix, accepted dtypes, shape; ``shape`` None is a per-tensor scalar, ``[]`` or ``[1]``);
  ``activation`` rows (``input_scale``, ``input_global_scale``) are the static activation scales.
- ``read_modules(tensors, config)``: each quantized module found on disk (by ``weight`` or
  ``weight_packed``) with the label its tensors show (``OnDisk``), and ``(tensor, why, fix)`` layout problems
  for a tensor missing, misshapen or mistyped (an activation scale's absence is left to ``--deep``, which
  says why). A module stored bf16 is absent (the caller reads it as bf16); a quantized weight no scheme of
  the config fits is a problem, its ``OnDisk.scheme`` None and its label the config's for it.
- The config itself is ``quant.checkpoint.Checkpoint.quantization_config`` (config.json's, else
  hf_quant_config.json's, else compression_config); its format ``quant.quark_config.format_kind``.

Sources read: compressed-tensors 0.20.1 (``quantization/quant_args.py`` QuantizationArgs
``validate_model_after``: strategy from group_size; ``quantization/lifecycle/initialize.py``
``initialize_qparams``: scale shapes per strategy, global scales for tensor_group;
``compressors/*/base.py`` ``compression_param_names`` / ``compress``: the tensors each format stores;
``utils/match.py`` ``match_targets`` / ``match_name``: exact, then ``re:`` (re.match), then class name);
ModelOpt as vLLM 0.16.0 reads it (``transformers_utils/config.py`` ``get_config``: config.json's
quantization_config, else ``hf_quant_config.json``; ``transformers_utils/model_arch_config_convertor.py``
``_normalize_quantization_config``: quant_method from ``producer.name``; ``layers/quantization/modelopt.py``
``from_config`` and each method's ``create_weights``).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from quant.errors import CheckpointError

CT = "compressed-tensors"
MODELOPT = "modelopt"
FORMATS = (CT, MODELOPT)

NVFP4, MXFP4, INT4, INT8 = "nvfp4", "mxfp4", "int4", "int8"
FP8, FP8_CHANNEL, FP8_BLOCK, MXFP8 = "fp8", "fp8-channel", "fp8-block", "mxfp8"
LABELS = (NVFP4, MXFP4, INT4, INT8, FP8, FP8_CHANNEL, FP8_BLOCK, MXFP8)

# a float scale: compressed-tensors keeps the dtype of the weight it was observed on, ModelOpt writes F32 (its
# block FP8 scale in the weight's dtype), and the engines copy any of them into their float32 parameters
FLOATS = ("BF16", "F16", "F32")
E4M3 = ("F8_E4M3",)
E8M0 = ("U8",)

# compressed-tensors formats (config/format.py CompressionFormat) this module reads, and those it refuses
CT_STORAGES = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "float-quantized",
               "int-quantized", "naive-quantized", "mxfp8-quantized")
CT_SPARSE = ("sparse-bitmask", "sparse-24-bitmask", "marlin-24")
# ModelOpt quant_algo values read (vLLM modelopt.py LINEAR_ALGOS), per algo its label
MODELOPT_ALGOS = {"FP8": FP8, "FP8_PER_CHANNEL_PER_TOKEN": FP8_CHANNEL, "FP8_PB_WO": FP8_BLOCK,
                  "NVFP4": NVFP4, "W4A16_NVFP4": NVFP4, "MXFP8": MXFP8}
MODELOPT_MIXED = "MIXED_PRECISION"


class UnsupportedScheme(CheckpointError):
    """A third-party quantization config quantgate does not read (exit code 2); the message names the
    key and value and what is read instead."""


@dataclass(frozen=True)
class Stored:
    """One tensor a scheme stores beside a module: ``<module>.<suffix>``."""
    suffix: str
    dtypes: tuple[str, ...]
    shape: tuple[int, ...] | None  # None: a per-tensor scalar, stored as [] or [1]
    activation: bool = False  # a static activation scale: its absence is a --deep finding, not a layout one

    def problem(self, dtype: str, shape: tuple[int, ...]) -> str | None:
        """Why a stored ``dtype[shape]`` is not this tensor, or None."""
        want = self.shape if self.shape is not None else "[] or [1]"
        fits_shape = tuple(shape) in ((), (1,)) if self.shape is None else tuple(shape) == self.shape
        if dtype in self.dtypes and fits_shape:
            return None
        return (f"{dtype}{list(shape)}, expected {'/'.join(self.dtypes)}"
                f"{list(want) if isinstance(want, tuple) else want}")


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme as a format stores it."""
    fmt: str  # CT | MODELOPT
    label: str  # one of LABELS
    storage: str  # compressed-tensors format ("pack-quantized") or ModelOpt quant_algo ("NVFP4")
    bits: int
    strategy: str  # tensor | channel | group | tensor_group | block (compressed-tensors' words, for both)
    group: int | None = None  # elements a scale covers along ``in`` (group, tensor_group; MX: 32)
    block: tuple[int, int] | None = None  # rows x columns a block scale covers
    symmetric: bool = True
    input_scale: str | None = None  # the static activation scale stored: input_scale | input_global_scale

    @property
    def weight(self) -> str:
        """The suffix of the quantized weight itself."""
        return "weight_packed" if self.fmt == CT and self.storage.endswith("pack-quantized") else "weight"

    @property
    def packed_words(self) -> bool:
        return self.storage == "pack-quantized"

    def weight_dtype(self) -> str:
        if self.packed_words:
            return "I32"
        if self.label in (NVFP4, MXFP4):
            return "U8"
        return "I8" if self.label in (INT4, INT8) else "F8_E4M3"

    def stored_weight_shape(self, out: int, inner: int) -> tuple[int, int]:
        if self.packed_words:  # compressed-tensors packs num_bits-wide integers densely into int32 words
            return out, -(-inner * self.bits // 32)
        return (out, inner // 2) if self.label in (NVFP4, MXFP4) else (out, inner)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        """The module's [out, in] from its stored weight (a packed int32 row: its upper bound; the exact
        ``in`` is in ``weight_shape``'s data)."""
        out, cols = stored[-2], stored[-1]
        if self.packed_words:
            return out, cols * 32 // self.bits
        return (out, cols * 2) if self.label in (NVFP4, MXFP4) else (out, cols)

    def scale_shape(self, out: int, inner: int) -> tuple[int, ...] | None:
        if self.strategy == "tensor":
            return None
        if self.strategy == "channel":
            return (out,) if self.fmt == MODELOPT else (out, 1)
        if self.strategy == "block":
            return -(-out // self.block[0]), -(-inner // self.block[1])
        return out, -(-inner // self.group)

    def tensors(self, out: int, inner: int) -> list[Stored]:
        """Every tensor this scheme stores beside a module of logical ``[out, in]``, the weight first."""
        rows = [Stored(self.weight, (self.weight_dtype(),), self.stored_weight_shape(out, inner))]
        scale = self.scale_shape(out, inner)
        if self.label == NVFP4:
            rows.append(Stored("weight_scale", E4M3, scale))
            rows.append(Stored("weight_global_scale" if self.fmt == CT else "weight_scale_2", FLOATS, None))
        elif self.label in (MXFP4, MXFP8):
            rows.append(Stored("weight_scale", E8M0, scale))
        else:
            rows.append(Stored("weight_scale", FLOATS, scale))
        if self.packed_words:
            rows.append(Stored("weight_shape", ("I64", "I32"), (2,)))
        if not self.symmetric:
            zero = (-(-out * self.bits // 32), scale[-1]) if self.packed_words and scale else scale
            rows.append(Stored("weight_zero_point", ("I32",) if self.packed_words else ("I8", "I32", *FLOATS),
                               zero))
        if self.input_scale:
            rows.append(Stored(self.input_scale, FLOATS, None, activation=True))
        return rows


def scheme_label(fmt: str, spec) -> str:
    """The label (``LABELS``) of a compressed-tensors ``weights`` dict (its group's ``format`` as
    ``format``) or a ModelOpt ``quant_algo``; ``UnsupportedScheme`` names what is not read."""
    if fmt == MODELOPT:
        algo = str(spec).upper()
        if algo not in MODELOPT_ALGOS:
            raise UnsupportedScheme(f"ModelOpt quant_algo {spec!r} is not read; read: {', '.join(MODELOPT_ALGOS)}")
        return MODELOPT_ALGOS[algo]
    return _ct_scheme(spec, None, spec.get("format") if isinstance(spec, dict) else None, "weights").label


@dataclass(frozen=True)
class Group:
    """A compressed-tensors config group (or the one ModelOpt scheme) and the modules it targets."""
    name: str
    scheme: Scheme
    targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    """A third-party quantization config as its format defines it."""
    fmt: str
    groups: tuple[Group, ...]
    ignore: tuple[str, ...] = ()  # compressed-tensors ignore / ModelOpt exclude_modules, as written
    layers: dict = field(default_factory=dict)  # ModelOpt MIXED_PRECISION: module -> Scheme

    @property
    def schemes(self) -> list[Scheme]:
        return list(dict.fromkeys([g.scheme for g in self.groups] + list(self.layers.values())))

    def resolve(self, module: str, cls: str = "Linear") -> Scheme | None:
        """The scheme the format gives checkpoint module ``module`` (a ``cls``), None: left unquantized.

        compressed-tensors (utils/match.py ``match_targets``): a module in ``ignore`` (exact name, ``re:``
        by re.match, or its class name) is not quantized; otherwise the first group whose target matches,
        exact names before ``re:`` patterns before class names. ModelOpt: ``quantized_layers`` (mixed
        precision) names each quantized module; otherwise every Linear not matched by an
        ``exclude_modules`` wildcard pattern (fnmatch, as ModelOpt writes them) has the one quant_algo."""
        if self.fmt == MODELOPT:
            if self.layers:
                return self.layers.get(module)
            return None if any(fnmatch.fnmatchcase(module, p) for p in self.ignore) else self.groups[0].scheme
        if any(_ct_match(module, cls, t) for t in self.ignore):
            return None
        # target -> group, a later group's target replacing an earlier one's (lifecycle/apply.py
        # apply_quantization_config's target_to_scheme), tried exact names, then re:, then class names
        targets = {t: g for g in self.groups for t in g.targets}
        ordered = sorted(targets, key=lambda t: ("re:" in t, t))
        matched = [t for t in ordered if _ct_name_match(module, t)] + [t for t in ordered if t == cls]
        return targets[matched[0]].scheme if matched else None


def _ct_name_match(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _ct_match(name: str, cls: str, target: str) -> bool:
    return _ct_name_match(name, target) or target == cls


def _need(container: dict, key: str, kinds, where: str):
    value = container.get(key)
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise UnsupportedScheme(f"quantization_config.{where}{key} is {value!r:.60}, not a {names}; "
                                "restore the config the checkpoint was exported with")
    return value


def _ct_scheme(weights, activations, storage, where: str) -> Scheme:
    """A compressed-tensors group's weights (and input activations) args as the Scheme they store."""
    if not isinstance(weights, dict):
        raise UnsupportedScheme(f"quantization_config.{where} is {weights!r:.60}, not an object of quantization "
                                "args; restore the config the checkpoint was exported with")
    bits = _need(weights, "num_bits", int, where + ".")
    kind = weights.get("type", "int")
    group_size, block = weights.get("group_size"), weights.get("block_structure")
    strategy = weights.get("strategy") or ("tensor" if group_size is None else "group" if group_size > 0
                                           else "channel")
    if (kind, bits) == ("float", 4):
        label = MXFP4 if storage == "mxfp4-pack-quantized" or group_size == 32 else NVFP4
    elif (kind, bits) == ("float", 8):
        label = MXFP8 if storage == "mxfp8-quantized" else {"tensor": FP8, "channel": FP8_CHANNEL,
                                                            "block": FP8_BLOCK}.get(strategy, "")
    elif kind == "int" and bits in (4, 8):
        label = INT4 if bits == 4 else INT8
    else:
        label = ""
    if not label or strategy not in ("tensor", "channel", "group", "tensor_group", "block"):
        raise UnsupportedScheme(f"quantization_config.{where}: {kind} {bits}-bit weights with strategy {strategy!r} "
                                f"are not read; read: {', '.join(LABELS)}")
    if storage is None:  # what the library picks for these args (compressors' can_compress)
        storage = {NVFP4: "nvfp4-pack-quantized", MXFP4: "mxfp4-pack-quantized", MXFP8: "mxfp8-quantized"}.get(
            label, "pack-quantized" if kind == "int" and not activations else
            "int-quantized" if kind == "int" else "float-quantized")
    if storage in CT_SPARSE:
        raise UnsupportedScheme(f"compressed-tensors format {storage!r} (sparse) is not read: quantgate reads "
                                f"{', '.join(CT_STORAGES)}")
    if storage not in CT_STORAGES:
        raise UnsupportedScheme(f"compressed-tensors format {storage!r} is not read: quantgate reads "
                                f"{', '.join(CT_STORAGES)}")
    if strategy == "block":
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedScheme(f"quantization_config.{where}.block_structure is {block!r:.60}: a block strategy "
                                    "needs [rows, columns]; restore the exported config")
    elif strategy in ("group", "tensor_group") and not (isinstance(group_size, int) and group_size > 0):
        raise UnsupportedScheme(f"quantization_config.{where}.group_size is {group_size!r}: strategy {strategy} "
                                "needs a positive group size; restore the exported config")
    if label in (MXFP4, MXFP8):
        group_size, strategy = 32, "group"
    input_scale = None
    if isinstance(activations, dict):
        dynamic = activations.get("dynamic", False)
        if activations.get("strategy") == "tensor_group" and dynamic is not True:
            input_scale = "input_global_scale"  # initialize_qparams: the global scale even when "local"
        elif dynamic is False:
            input_scale = "input_scale"
    return Scheme(CT, label, storage, bits, strategy, group_size if strategy in ("group", "tensor_group") else None,
                  tuple(block) if strategy == "block" else None, weights.get("symmetric", True) is not False,
                  input_scale)


def _modelopt_scheme(algo, group_size) -> Scheme:
    label = scheme_label(MODELOPT, algo)
    algo = str(algo).upper()
    if label == NVFP4:
        return Scheme(MODELOPT, label, algo, 4, "tensor_group", group_size if isinstance(group_size, int) else 16,
                      input_scale=None if algo == "W4A16_NVFP4" else "input_scale")
    if label == MXFP8:
        return Scheme(MODELOPT, label, algo, 8, "group", 32)
    if label == FP8_BLOCK:
        return Scheme(MODELOPT, label, algo, 8, "block", block=(128, 128))
    if label == FP8_CHANNEL:
        return Scheme(MODELOPT, label, algo, 8, "channel")
    return Scheme(MODELOPT, label, algo, 8, "tensor", input_scale="input_scale")


def parse(fmt: str, qconfig: dict) -> Config:
    """``qconfig`` (config.json's quantization_config, or hf_quant_config.json's content) as ``fmt`` defines it."""
    if fmt == MODELOPT:
        body = qconfig.get("quantization") if isinstance(qconfig.get("quantization"), dict) else qconfig
        where = "quantization." if body is not qconfig else ""
        algo = body.get("quant_algo")
        if not isinstance(algo, str):
            raise UnsupportedScheme(f"quantization_config.{where}quant_algo is {algo!r:.60}; a ModelOpt config names "
                                    "its quant_algo (FP8, NVFP4, ...): restore the exported config")
        # hf_quant_config.json's "quantization" names them exclude_modules; a flat config.json export writes
        # "ignore" (vLLM 0.34.0 modelopt.py ModelOptQuantConfigBase.from_config reads it first)
        nested = body is not qconfig
        ignore = (body.get("exclude_modules") if nested else body.get("ignore", body.get("exclude_modules"))) or []
        if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
            raise UnsupportedScheme(f"quantization_config.{where}exclude_modules is {ignore!r:.60}, not a list of "
                                    "module patterns; restore the exported config")
        if algo.upper() == MODELOPT_MIXED:
            layers = _need(body, "quantized_layers", dict, where)
            return Config(MODELOPT, (), tuple(ignore), {
                name: _modelopt_scheme(_need(spec, "quant_algo", str, f"{where}quantized_layers.{name}.")
                                       if isinstance(spec, dict) else spec,
                                       spec.get("group_size", body.get("group_size")) if isinstance(spec, dict)
                                       else None)
                for name, spec in layers.items()})
        return Config(MODELOPT, (Group(algo, _modelopt_scheme(algo, body.get("group_size"))),), tuple(ignore))
    groups = _need(qconfig, "config_groups", dict, "")
    storage = qconfig.get("format")
    sparsity = qconfig.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format") in CT_SPARSE:
        raise UnsupportedScheme(f"compressed-tensors sparsity format {sparsity['format']!r} is not read: "
                                "quantgate reads dense quantized checkpoints only")
    ignore = qconfig.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise UnsupportedScheme(f"quantization_config.ignore is {ignore!r:.60}, not a list of module names; "
                                "restore the exported config")
    read = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise UnsupportedScheme(f"quantization_config.{where} is {group!r:.60}, not an object; restore the "
                                    "exported config")
        targets = _need(group, "targets", list, where + ".")
        if group.get("weights") is None:
            continue  # activations only (a KV cache or attention scheme): no weight is stored quantized
        own = group.get("format")
        scheme = _ct_scheme(group["weights"], group.get("input_activations"),
                            own if isinstance(own, str) else storage if storage != "mixed-precision" else None,
                            where + ".weights")
        read.append(Group(name, scheme, tuple(str(t) for t in targets)))
    return Config(CT, tuple(read), tuple(ignore))


@dataclass(frozen=True)
class OnDisk:
    """A module as the checkpoint stores it: the label its tensors show ("" unquantized), its logical
    [out, in], and the scheme read (None: unquantized)."""
    label: str
    shape: tuple[int, int]
    scheme: Scheme | None = None


def _fits(scheme: Scheme, tensors: dict, module: str, by_scale: bool) -> bool:
    """Whether ``module``'s stored weight is this scheme's (``by_scale``: and its weight scale's dtype,
    which tells NVFP4 from MXFP4 codes). Its other tensors are checked once the scheme is chosen, so a
    wrong one is named rather than turning the module into another scheme."""
    weight = tensors.get(f"{module}.{scheme.weight}")
    if weight is None or len(weight.shape) != 2 or weight.dtype != scheme.weight_dtype():
        return False
    scale = tensors.get(f"{module}.weight_scale")
    expected = scheme.tensors(*scheme.logical_shape(weight.shape))[1]
    return not by_scale or scale is None or scale.dtype in expected.dtypes


def _described(info) -> str:
    return "absent" if info is None else f"{info.dtype}{list(info.shape)}"


def read_modules(tensors: dict, config: Config) -> tuple[dict[str, OnDisk], list[tuple[str, str, str]]]:
    """Every quantized module on disk (named by its ``weight`` or ``weight_packed``) with what its tensors
    show, and ``(tensor, why, fix)`` for each tensor of its scheme missing, misshapen or mistyped. A module
    is read as the scheme the config gives it where its weight fits that scheme, else as the config's
    scheme its weight fits (the engines' replay compares what they build with this label)."""
    modules, problems = {}, []
    weights = {n.rsplit(".", 1)[0] for n, info in tensors.items()
               if n.endswith((".weight", ".weight_packed")) and len(info.shape) == 2}
    for module in sorted(weights):
        resolved = config.resolve(module)
        candidates = ([resolved] if resolved else []) + [s for s in config.schemes if s != resolved]
        scheme = next((s for by_scale in (True, False) for s in candidates if _fits(s, tensors, module, by_scale)),
                      None)
        if scheme is None:
            weight = tensors.get(f"{module}.weight")
            if weight is not None and weight.dtype in FLOATS:
                continue  # stored unquantized: the caller reads it as it reads any bf16 module
            weight = weight or tensors[f"{module}.weight_packed"]
            labels = ", ".join(f"{s.label} ({s.storage})" for s in config.schemes) or "none"
            why = (f"{weight.dtype}{list(weight.shape)} with weight_scale "
                   f"{_described(tensors.get(module + '.weight_scale'))}: no scheme of the config stores a weight "
                   f"so (its schemes: {labels})")
            problems.append((weight.name, why, "re-export the checkpoint, or restore the config it was exported with"))
            label = resolved.label if resolved else candidates[0].label if candidates else "unknown"
            modules[module] = OnDisk(label, tuple(weight.shape))
            continue
        out, inner = scheme.logical_shape(tensors[f"{module}.{scheme.weight}"].shape)
        for row in scheme.tensors(out, inner):
            name = f"{module}.{row.suffix}"
            info = tensors.get(name)
            if info is None:
                if not row.activation:  # --deep says what a missing activation scale does
                    why = (f"missing: a {scheme.label} module ({scheme.fmt} {scheme.storage}) stores {row.suffix} "
                           f"beside {scheme.weight}; the engines cannot load it")
                    problems.append((name, why, "re-export the checkpoint (the tensor was dropped or renamed)"))
            elif why := row.problem(info.dtype, tuple(info.shape)):
                why = f"{why} for a {scheme.label} module of [{out}, {inner}] ({scheme.fmt} {scheme.storage})"
                problems.append((name, why, "re-export the checkpoint"))
        modules[module] = OnDisk(scheme.label, (out, inner), scheme)
    return modules, problems
