"""Model families as data: which checkpoint tensor plays which role.

A family is one folder, ``manifests/families/<family>/``: its manifest (``family.yaml``) lists
roles by regex and names the model class each engine builds it with (``engine_classes``); beside it
the rules each engine's release applies to that class (``sglang.yaml``, ``vllm.yaml``: engine
knowledge, read by ``quant/engines/``). The families are discovered from the folders (the package's
own, then each root in ``QUANTGATE_FAMILIES``), so adding one is a folder, not new code.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from quant.errors import QuantgateError
from quant.schema import JsonValue, Schema, load, template_problem


@dataclass(frozen=True)
class Role:
    name: str
    pattern: re.Pattern[str]
    linear: bool
    quantizable: bool
    expert_ids: bool = False  # its values are routed expert ids (a hash routing table): checked in range


@dataclass(frozen=True)
class TensorRole:
    role: str  # "other" when no pattern matched
    linear: bool
    quantizable: bool
    layer: int | None  # index in model.layers, None outside the decoder stack
    mtp: bool  # a next-n (MTP) layer: index >= num_hidden_layers (a module under mtp_prefix counts as one)


AXES = {("experts", "out", "in"), ("experts", "in", "out")}  # Qwen3.5: [E, 2I, H]; Llama-4, gpt-oss: [E, H, 2I]
SPLITS = ("halves", "interleaved")  # gate then up along the out axis, or gate, up alternating (gpt-oss)
# the layouts the converter writes fused experts in: Quark's per-expert 2-D names (published MXFP4
# releases), or a release's own ``<fused>_blocks`` / ``_scales`` form (gpt-oss: quant/blocks.py)
WRITES = ("per_expert", "blocks", "stacked")


@dataclass(frozen=True)
class FusedTensor:
    """One fused expert tensor: all routed experts of a layer's projections in one 3-D tensor."""
    pattern: re.Pattern[str]  # matches the fused tensor's name
    axes: tuple[str, str, str]  # the order of the experts, projection output and input dimensions
    projections: tuple[str, ...]  # stacked along the out axis, in this order: (gate_proj, up_proj) or (down_proj,)
    out_key: str  # the text config key giving each projection's output size (moe_intermediate_size, hidden_size)
    in_key: str  # ... and its input size
    split: str = "halves"  # how the projections share the out axis (SPLITS)
    # The per-expert tensor each projection of expert e is written as ({experts}: the fused tensor's
    # name less its last component, e.g. model.language_model.layers.0.mlp.experts)
    names: str = "{experts}.{e}.{proj}.weight"
    # The fused tensor's last name component (gate_up_proj): ``--to bf16`` writes the per-expert
    # weights back as ``{experts}.<name>``; the manifest's ``name``, else read off a pattern ending
    # in ``\.<name>$``. The pattern must match only what the release stores fused (Qwen3.5's MTP
    # layer is per expert): a per-expert name is fused back only where its fused name matches it.
    name: str = ""
    bias: bool = False  # the release stores ``<fused>_bias`` [experts, out] beside it (gpt-oss)

    def per_expert_name(self, fused_name: str, expert: int, projection: str) -> str:
        # {experts}: the fused name less its ``name`` (one component, or several where the release stores
        # each projection stacked as <parent>.<proj>.weight: Step-3.7's moe.gate_proj.weight)
        suffix = "." + self.name
        experts = fused_name.removesuffix(suffix) if fused_name.endswith(suffix) else fused_name.rpartition(".")[0]
        return self.names.format(experts=experts, e=expert, proj=projection)

    def fused_name(self, experts: str) -> str | None:
        """The fused tensor ``experts`` (a per-expert name's ``{experts}``) is written back as, None
        where the release stores those experts per expert (the pattern does not match it)."""
        name = f"{experts}.{self.name}"
        return name if self.pattern.search(name) else None

    def expected_shape(self, experts: int, out: int, inner: int) -> tuple[int, int, int]:
        """The fused shape the config implies (``out``/``inner``: one projection's sizes)."""
        dims = {"experts": experts, "out": out * len(self.projections), "in": inner}
        return tuple(dims[axis] for axis in self.axes)


@dataclass(frozen=True)
class FusedExperts:
    """How a family stores its routed experts fused (manifest ``fused_experts``), and the layout the
    converter writes them in (``writes``: ``per_expert``, the per-expert 2-D names the engines'
    per-expert loaders map; ``blocks``, the release's own ``<fused>_blocks`` / ``_scales`` tensors,
    written by quant.blocks; or ``stacked``, each fused tensor under its own name as the codec's weight
    ``[experts, *weight]`` and scale ``[experts, *scale]``, for loaders that read only the release's
    stacked layout: Step-3.7's)."""
    experts_key: str  # the text config key counting the routed experts
    tensors: tuple[FusedTensor, ...]
    writes: str = "per_expert"
    # ``writes: blocks``: config.json's quantization_config as the release ships it (its own
    # quant_method, e.g. gpt-oss's {quant_method: mxfp4, modules_to_not_convert: [...]})
    blocks_config: dict | None = None

    def match(self, name: str) -> FusedTensor | None:
        return next((t for t in self.tensors if t.pattern.search(name)), None)


# Where a required tensor is looked for: under every decoder layer, every MTP module the checkpoint
# holds, once where it holds a draft, or once per checkpoint; ``{prefix}`` is the layer's or module's
# name prefix (``model.layers.3``, ``mtp.0``), the only field a name may use
REQUIRED_PER = {"layer": ("prefix",), "mtp": ("prefix",), "draft": (), "model": ()}


@dataclass(frozen=True)
class Required:
    name: str  # a template: ``{prefix}.eh_proj.weight``
    per: str  # a key of REQUIRED_PER


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    num_layers_key: str
    roles: tuple[Role, ...]
    engine_classes: tuple[tuple[str, str], ...] = ()  # (engine, the engine's model class for the architecture)
    mtp_layers_key: str = "num_nextn_predict_layers"  # the config key counting the MTP layers after the decoder
    # A multimodal release keeps the language model's config under one key (Kimi-K2.5: text_config)
    # and its decoder layers under another prefix (language_model.model.layers); None: top level.
    text_config_key: str | None = None
    layers_prefix: str = "model.layers"
    fused_experts: FusedExperts | None = None  # routed experts stored as 3-D tensors (Qwen3.5, Llama-4)
    # MTP modules stored outside the decoder stack (MiniMax-M3: language_model.model.mtp.layers.i,
    # Qwen3-Next: mtp.layers.i beside mtp.fc): module i is MTP layer num_hidden_layers + i; None: they
    # follow the decoder layers (model.layers.N)
    mtp_prefix: str | None = None
    mtp_layers_default: int = 0  # the draft layers the engines build when the config omits mtp_layers_key
    # Which attention each decoder layer has (Qwen3-Next: linear_attention | full_attention), as the
    # role its tensors play: kind -> role. How each engine computes the kinds is its rule layer_kinds.
    layer_kinds: tuple[tuple[str, str], ...] = ()
    # config.json keys written beside a quantization_config of a format (format -> {key: value}),
    # where an engine reads the format from the config rather than the quantization_config
    # (DeepSeek-V4: vLLM's expert_dtype); a --to bf16 decode drops them again
    config_keys: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    # The text config key counting each MoE layer's routed experts (the first present of these: a
    # release may write either name); the routed_expert role's pattern names each one's index with a
    # (?P<expert>...) group. A fused family: fused_experts.experts_key unless given.
    experts_keys: tuple[str, ...] = ()
    required_tensors: tuple[Required, ...] = ()  # tensors the release always holds (REQUIRED_PER)
    title: str = ""  # the releases' name for people (``GLM-4.5 / 4.6 / 4.7``): what help texts list
    path: Path | None = field(default=None, compare=False)  # the manifest it was read from, for messages

    def text_config(self, config: dict) -> dict:
        """The language model's config: the keys the engines' text model reads (layers, experts,
        router, architectures), nested under ``text_config_key`` where the release nests them."""
        if self.text_config_key is None:
            return config
        nested = config.get(self.text_config_key)
        return nested if isinstance(nested, dict) else {}

    def layer_index(self, tensor_name: str) -> int | None:
        """The decoder layer a tensor belongs to (None outside the decoder stack)."""
        head = self.layers_prefix + "."
        if not tensor_name.startswith(head):
            return None
        index, dot, _ = tensor_name[len(head):].partition(".")
        return int(index) if dot and index.isascii() and index.isdigit() else None

    def role_named(self, name: str) -> Role | None:
        return next((role for role in self.roles if role.name == name), None)

    def expert_match(self, tensor_name: str, role: str) -> re.Match | None:
        """The routed_expert pattern's match of a per-expert tensor (its ``expert`` group: the index),
        None for any other tensor (a fused one included); ``role`` is the tensor's, from ``classify``."""
        routed = self.role_named("routed_expert")
        if role != "routed_expert" or routed is None or "expert" not in routed.pattern.groupindex:
            return None
        match = routed.pattern.search(weight_named(tensor_name))
        return match if match is not None and match.group("expert") is not None else None

    def mtp_module_prefix(self, layer: int, num_hidden_layers: int) -> str:
        """The name prefix of MTP layer ``layer`` (``mtp.layers.0``, or ``model.layers.61``)."""
        if self.mtp_prefix:
            return f"{self.mtp_prefix}.{layer - num_hidden_layers}"
        return f"{self.layers_prefix}.{layer}"

    @property
    def engine_class(self) -> dict[str, str]:
        return dict(self.engine_classes)

    def classify(self, tensor_name: str, num_hidden_layers: int) -> TensorRole:
        tensor_name = weight_named(tensor_name)
        layer = self.layer_index(tensor_name)
        mtp = layer is not None and layer >= num_hidden_layers
        if layer is None and self.mtp_prefix and tensor_name.startswith(self.mtp_prefix + "."):
            index, dot, _ = tensor_name[len(self.mtp_prefix) + 1:].partition(".")
            if dot and index.isascii() and index.isdigit():
                layer, mtp = num_hidden_layers + int(index), True
        for role in self.roles:
            if role.pattern.search(tensor_name):
                return TensorRole(role.name, role.linear, role.quantizable, layer, mtp)
        return TensorRole("other", False, False, layer, mtp)


def weight_named(tensor_name: str) -> str:
    """A tensor's name for its role: compressed-tensors' packed weight (``weight_packed``) plays the weight's."""
    return tensor_name.removesuffix("_packed") if tensor_name.endswith(".weight_packed") else tensor_name


class UnknownFamilyError(QuantgateError, ValueError):
    """No family manifest describes the checkpoint (or the name asked for); the message lists the known ones."""


MTP_LAYERS_MAX = 64  # draft layers an engine builds by default: released families build one
TEMPLATE_FIELDS = ("experts", "e", "proj")  # what FusedTensor.per_expert_name supplies to ``names``


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r:.80} is not a regular expression ({exc})") from None
    return text


Regex = Annotated[str, AfterValidator(_regex)]


class RoleEntry(Schema):
    role: str
    pattern: Regex
    linear: bool = False
    quantizable: bool | None = None  # None: as linear
    expert_ids: bool = False


class FusedTensorEntry(Schema):
    pattern: Regex
    axes: list[str]
    split: Literal[SPLITS] = "halves"
    projections: list[str] = Field(min_length=1)
    out: str
    in_: str = Field(alias="in")
    names: str = FusedTensor.names
    name: str = ""
    bias: bool = False

    @field_validator("axes")
    @classmethod
    def _axes(cls, axes: list[str]) -> list[str]:
        if tuple(axes) not in AXES:
            raise ValueError(f"{axes} is not a layout quantgate reads (axes: {sorted(map(list, AXES))})")
        return axes

    @field_validator("projections")
    @classmethod
    def _distinct(cls, projections: list[str]) -> list[str]:
        if len(set(projections)) != len(projections):  # two pieces of one expert would share a name
            raise ValueError(f"{projections} names a projection twice")
        return projections

    @field_validator("names")
    @classmethod
    def _template(cls, names: str) -> str:
        if problem := template_problem(names, TEMPLATE_FIELDS):
            raise ValueError(problem)
        return names

    @property
    def last_name(self) -> str:
        """The fused tensor's last name component: ``name``, else the pattern's literal ``\\.NAME$``."""
        ending = re.search(r"\\\.(\w+)\$$", self.pattern)
        return self.name or (ending.group(1) if ending else "")

    @model_validator(mode="after")
    def _named(self):
        if not self.last_name:
            raise ValueError(f"pattern {self.pattern!r:.80} does not end in \\.NAME$; give the fused tensor's last "
                             "name component as name: (--to bf16 writes it back under that name)")
        return self


class FusedExpertsEntry(Schema):
    experts_key: str
    writes: Literal[WRITES] = "per_expert"
    blocks_config: dict[str, JsonValue] | None = None
    tensors: list[FusedTensorEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self):
        if (self.writes == "blocks") != (self.blocks_config is not None):
            raise ValueError("writes: blocks needs blocks_config (the release's quantization_config), and only it "
                             "takes one")
        projections = [p for t in self.tensors for p in t.projections]
        if twice := next((p for p in projections if projections.count(p) > 1), None):
            # both tensors' experts would be written under one name
            raise ValueError(f"projection {twice!r} is in more than one of tensors; each per-expert name must be "
                             "written once")
        return self


class RequiredEntry(Schema):
    name: str
    per: str

    @field_validator("per")
    @classmethod
    def _per(cls, per: str) -> str:
        if per not in REQUIRED_PER:
            raise ValueError(f"per {per!r:.60} is not one of {', '.join(REQUIRED_PER)}")
        return per

    @model_validator(mode="after")
    def _template(self):
        if problem := template_problem(self.name, REQUIRED_PER[self.per], every=False):
            fields = ", ".join(f"{{{f}}}" for f in REQUIRED_PER[self.per]) or "no field"
            raise ValueError(f"a per-{self.per} name may use {fields} (plain): {problem}")
        return self


class FamilyFile(Schema):
    """A family manifest as written (``manifests/families/*/family.yaml``; the fields are ``Family``'s)."""
    family: str
    title: str = ""
    model_types: list[str] = Field(min_length=1)
    num_layers_key: str = "num_hidden_layers"
    roles: list[RoleEntry]
    engine_classes: dict[str, str] = Field(default_factory=dict)
    mtp_layers_key: str = "num_nextn_predict_layers"
    text_config_key: str | None = None
    layers_prefix: str = "model.layers"
    fused_experts: FusedExpertsEntry | None = None
    mtp_prefix: str | None = None
    mtp_layers_default: int = Field(0, ge=0, le=MTP_LAYERS_MAX)
    layer_kinds: dict[str, str] = Field(default_factory=dict)
    config_keys: dict[str, dict[str, JsonValue]] = Field(default_factory=dict)
    experts_key: str | list[str] | None = None  # None: fused_experts.experts_key, if any
    required_tensors: list[RequiredEntry] = Field(default_factory=list)

    @property
    def experts_keys(self) -> tuple[str, ...]:
        keys = self.experts_key or (self.fused_experts.experts_key if self.fused_experts else [])
        return (keys,) if isinstance(keys, str) else tuple(keys)

    @model_validator(mode="after")
    def _expert_index(self):
        routed = next((r for r in self.roles if r.role == "routed_expert"), None)
        if self.experts_keys and (routed is None or "expert" not in re.compile(routed.pattern).groupindex):
            raise ValueError(f"experts_key {list(self.experts_keys)!r}: name the expert index in the routed_expert "
                             "role's pattern as (?P<expert>\\d+)")
        return self


def manifests_root() -> Path:
    return Path(str(resources.files("manifests")))


def load_family(path: Path) -> Family:
    """The family manifest at ``path``, checked against ``FamilyFile`` before anything uses it."""
    data = load(path, FamilyFile, "family manifest", UnknownFamilyError,
                f"compare it with {manifests_root() / 'families' / 'glm_moe_dsa' / FAMILY_FILE}")
    fused = data.fused_experts
    return Family(
        name=data.family,
        model_types=tuple(data.model_types),
        num_layers_key=data.num_layers_key,
        roles=tuple(Role(r.role, re.compile(r.pattern), r.linear, r.linear if r.quantizable is None else r.quantizable,
                         r.expert_ids) for r in data.roles),
        engine_classes=tuple(sorted(data.engine_classes.items())),
        mtp_layers_key=data.mtp_layers_key,
        text_config_key=data.text_config_key,
        layers_prefix=data.layers_prefix,
        fused_experts=fused and FusedExperts(
            fused.experts_key,
            tuple(FusedTensor(re.compile(t.pattern), tuple(t.axes), tuple(t.projections), t.out, t.in_, t.split,
                              t.names, t.last_name, t.bias) for t in fused.tensors),
            fused.writes, fused.blocks_config),
        mtp_prefix=data.mtp_prefix,
        mtp_layers_default=data.mtp_layers_default,
        layer_kinds=tuple(data.layer_kinds.items()),
        config_keys=tuple((f, tuple(sorted(keys.items()))) for f, keys in data.config_keys.items()),
        experts_keys=data.experts_keys,
        required_tensors=tuple(Required(r.name, r.per) for r in data.required_tensors),
        title=data.title,
        path=Path(path),
    )


FAMILIES_ENV = "QUANTGATE_FAMILIES"  # more roots of family folders, os.pathsep-separated
FAMILY_FILE = "family.yaml"


def family_roots() -> list[Path]:
    """Where family folders are looked for: the package's own, then each root in ``QUANTGATE_FAMILIES``
    (how a family is added without touching the package)."""
    extra = [Path(p) for p in os.environ.get(FAMILIES_ENV, "").split(os.pathsep) if p]
    for root in extra:
        if not root.is_dir():
            raise UnknownFamilyError(f"{FAMILIES_ENV} names {root}, which is not a folder (it lists folders that hold "
                                     f"family folders, <root>/<family>/{FAMILY_FILE})")
    return [manifests_root() / "families", *extra]


def family_dirs() -> dict[str, Path]:
    """Every family's folder by its name (the folder's name), in discovery order."""
    found: dict[str, Path] = {}
    for root in family_roots():
        for manifest in sorted(root.glob(f"*/{FAMILY_FILE}")):
            name = manifest.parent.name
            if name in found:
                raise UnknownFamilyError(f"two family folders named {name!r}: {found[name]} and {manifest.parent}; "
                                         "rename one (the folder's name is the family's)")
            found[name] = manifest.parent
    return found


def family_names() -> list[str]:
    return list(family_dirs())


def known_families() -> list[Family]:
    """Every discovered family, read once per state of their files: each command asks many times (a
    recipe's roles, each engine rule file's role check, the family lookup), and parsing thirteen
    manifests costs about 0.1 s a time."""
    stamps = []
    for name, folder in family_dirs().items():
        stat = (folder / FAMILY_FILE).stat()
        stamps.append((name, folder, stat.st_mtime_ns, stat.st_size))
    return list(_read_families(tuple(stamps)))


@cache
def _read_families(stamps: tuple[tuple[str, Path, int, int], ...]) -> tuple[Family, ...]:
    families = []
    for name, folder, _, _ in stamps:
        family = load_family(folder / FAMILY_FILE)
        if family.name != name:
            raise UnknownFamilyError(f"{folder / FAMILY_FILE}: family {family.name!r} in a folder named {name!r}; "
                                     "make them the same (the folder's name is the family's)")
        families.append(family)
    return tuple(families)


def families_listing() -> str:
    """One line per discovered family (its name, title and model types), read from the folders so
    that help texts list exactly the families quantgate reads, a family added by a folder included."""
    known = known_families()
    width = max((len(f.name) for f in known), default=0)
    return "\n".join(f"  {f.name:<{width}}  {f.title or f.name} (model_type {', '.join(f.model_types)})"
                     for f in known)


def family_named(name: str) -> Family:
    """The family called ``name`` (its folder's manifest)."""
    folder = family_dirs().get(name)
    if folder is None:
        raise UnknownFamilyError(f"no family named {name!r} (known: {', '.join(family_dirs())}; a family is a folder "
                                 f"<root>/{name}/{FAMILY_FILE} under {manifests_root() / 'families'} or a root in "
                                 f"{FAMILIES_ENV})")
    return next(f for f in known_families() if f.name == name)


def family_for(config: dict, manifest: Path | None = None) -> Family:
    """The family manifest for a checkpoint's ``config.json`` (or the one given explicitly)."""
    if manifest is not None:
        return load_family(manifest)
    model_type = config.get("model_type")
    known = known_families()
    for family in known:
        if model_type in family.model_types:
            return family
    listed = "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in known)
    example = manifests_root() / "families" / "glm4_moe"
    raise UnknownFamilyError(
        f"config.json model_type {model_type!r}: no model family (known families: {listed}). To add one: copy a "
        f"family folder such as {example} to <root>/<family>/ and list <root> in {FAMILIES_ENV} (or pass the "
        "manifest with --family-manifest FILE): its family.yaml (model_types, tensor roles by regex, "
        "engine_classes: the sglang and vLLM model class of the architecture) and the engine rules read for those "
        "classes in the wheels (sglang.yaml, vllm.yaml: packed_modules_mapping, fused modules, which modules get "
        "the quant config, draft naming, shared-expert fusion)")
