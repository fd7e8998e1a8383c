"""The vocabulary of the engine rule files (``manifests/engines/*.yaml`` and the families' ``sglang.yaml`` /
``vllm.yaml``): the file, a rule set, and every rule kind, each defined once here with what it means.

A rule is ``{value: ..., cite: "<file>: <function> (what it does)"}``: the value as the release's loading
code has it, the citation where it was read in that release's wheel. Every schema is strict (``quant.schema``):
a misspelt rule or key, or a value of the wrong type, refuses the file with one line naming the key and the
nearest valid name, so a rule can never load and silently stop applying.

Three shapes recur across kinds and are defined once: ``Renames`` (how a loader renames a module),
``FusedModules`` (which checkpoint modules a loader stacks into one) and the draft's naming (``MtpNaming``,
with ``DraftModuleNames`` for a draft class built apart from the main model).
"""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from quant.schema import Schema, nearest, template_problem

Kind = Literal["quark", "fp8", "mxfp4"]  # a quantization_config's kind (quant.quark_config.config_kind)
Platform = Literal["cuda", "rocm"]
Capability = Annotated[list[int], Field(min_length=2, max_length=2)]  # torch.cuda.get_device_capability()

# A loader's renaming of checkpoint module names, applied in order, each once where it applies: a key starting
# with ``^`` renames that prefix, any other key the first occurrence of that text (quant.engines.replay.renamed).
Renames = dict[str, str]

# Modules a loader stacks into one: the fused module's leaf -> the leaves of its shards; a dotted key names
# the shard with its parent (DeepSeek-V4's compressor.wkv, fused with compressor.wgate). Read by
# quant.engines.replay.shards_of / fused_into and quant.serving's exclude list.
FusedModules = dict[str, list[str]]


def _mixed_shards_template(text: str) -> str:
    if problem := template_problem(text, ("shards", "module"), every=False):
        raise ValueError(problem)
    return text


def _known_role(name: str, info: ValidationInfo) -> str:
    """A role no family manifest gives a tensor would match nothing: a misspelt role must not pass
    silently (``context["roles"]``: the roles the loader knows)."""
    roles = (info.context or {}).get("roles")
    if roles is not None and name not in roles:
        raise ValueError(nearest(name, sorted(roles), "role"))
    return name


Role = Annotated[str, AfterValidator(_known_role)]  # a tensor role of the family manifests (quant.layout)

V = TypeVar("V")


class Rule(Schema, Generic[V]):
    """One rule of a rule set: its value and where it was read."""
    value: V
    cite: str = Field(min_length=1)  # "<file in the wheel>: <function> (what it does)"


class QuarkMatch(Schema):
    """Quark ``should_ignore_layer``: whether a fused name is matched before its shards (``fused_first``)
    and how a routed-experts prefix is excluded: ``none``; ``any_entry`` (sglang >= 0.5.21: a name ending
    in .experts when any entry starts with it); ``children`` (vLLM's check_children)."""
    fused_first: bool
    experts_prefix: Literal["none", "any_entry", "children"]


class MtpNaming(Schema):
    """How the class names the MTP draft's modules. ``style``: ``decoder`` (model.layers.N.x -> model.decoder.x,
    ``top_level`` parts -> model.x, ``skipped`` parts not loaded), ``renames`` (the draft under its own
    ``prefix``, or the layers from num_hidden_layers on when it has none, renamed by ``renames``),
    ``dropped`` (the draft's layers are not loaded; ``dropped_prefix``: draft modules stored outside the
    decoder stack), ``original`` (names kept). ``max_layers``: the most draft layers the class builds
    (None: no limit). ``{layer}`` in a rename's new name is the index the class gives draft layer i,
    num_hidden_layers * ``layer_times`` + i (vLLM's LongCat draft counts two attention sublayers per decoder
    layer: layer 2 * num_layers). ``decoder_as`` / ``top_level_as``: where the ``decoder`` style puts the
    draft's decoder layer and its own modules (dots.note's draft keeps them under model.heads.0)."""
    style: Literal["decoder", "renames", "dropped", "original"]
    top_level: list[str]
    skipped: list[str]
    max_layers: int | None
    prefix: str | None = None
    renames: Renames | None = None
    layer_times: int = Field(1, ge=1)
    dropped_prefix: str | None = None
    decoder_as: str = "model.decoder."
    top_level_as: str = "model."

    @model_validator(mode="after")
    def _renames_need_renames(self):
        # without a prefix the draft is the decoder layers at or after num_hidden_layers
        if self.style == "renames" and self.renames is None:
            raise ValueError("style renames needs the draft's renames")
        return self


class DraftModuleNames(Schema):
    """The names a separately built draft class asks its quant config for (DeepSeek-V4's MTP module): a module
    under ``prefix`` is main layer ``as_layer`` under ``layer_as``; ``top_level`` maps the draft's own modules."""
    prefix: str
    top_level: dict[str, str]
    as_layer: int
    layer_as: str


# How the draft (MTP) model's exclude list is derived from the checkpoint's, per family: ``none`` (as is),
# ``mapper_61`` (DeepseekV3ForCausalLMNextN.hf_to_sglang_mapper), ``mapper_61_draft_bf16`` (that, and the whole
# draft bf16 when its layer is excluded), ``glm_remap`` (GlmMoeDsaForCausalLMNextN._resolve_nextn_quant_config),
# ``nextn_mapper`` / ``nextn_mapper_target`` (a draft class's own mapper of layer num_hidden_layers to model.decoder,
# alone or joined with the target's ``exclude_mapper``, and the whole draft bf16 when that layer is excluded:
# quant.engines.replay.nextn_mapper), ``mtp_any_draft_bf16`` / ``mtp_experts_draft_bf16`` (the list as is, and the
# whole draft bf16 under Quark when any ``mtp.*`` entry is listed / one naming ``mlp.experts``: Qwen3.5's
# qwen3_5_mtp.py _mtp_quant_config), ``mtp_layers_unshifted_quark`` (the draft builds its layers as
# mtp.layers.{num_hidden_layers + i} and shifts only the FP8 skip list to them: under Quark no mtp.layers.* entry
# names a draft module, vLLM's Qwen4-Exp draft before 0.34.0).
DraftExclude = dict[str, Literal["none", "mapper_61", "mapper_61_draft_bf16", "glm_remap", "nextn_mapper",
                                 "nextn_mapper_target", "mtp_any_draft_bf16", "mtp_experts_draft_bf16",
                                 "mtp_layers_unshifted_quark"]]

# How the draft's eh_proj is built: ``plain`` (nn.Linear, always bf16), ``quant_config`` (with a Quark config
# only), ``any_quant_config`` (with any quant config).
EhProj = Literal["plain", "quant_config", "any_quant_config"]

IndexerBuild = Literal["quant_config", "bf16"]


class Indexer(Schema):
    """The DSA indexer's Linear leaves: built with the quant config or bf16; ``wk_fused_bf16_on_cuda``: wk fused
    into a bf16 wk_weights_proj on CUDA when the indexer's rope is interleaved; ``wk_dequantized``: the kinds
    whose quantized wk the loader dequantizes into that bf16 slot; ``interleaved_always``: the class builds the
    indexer's rope interleaved whatever config.json says (dots.note: Indexer(is_neox_style=False)), else it
    follows the config's indexer_rope_interleave."""
    wq_b: IndexerBuild
    wk: IndexerBuild
    weights_proj: IndexerBuild
    wk_fused_bf16_on_cuda: bool
    wk_dequantized: list[Kind]
    interleaved_always: bool = False


class QuarkConfig(Schema):
    """What ``QuarkConfig.from_config`` requires of a Quark quantization_config."""
    requires_export: bool
    formats: list[str]  # weight dtypes accepted
    requires_input_tensors: bool  # for fp4 weights: W4A4 only
    exclude_must_be_list: bool


class Fp8Skip(Schema):
    """FP8 ``Fp8Config.from_config`` + ``is_layer_skipped`` (quant.engines.match.fp8_skipped): the config keys
    read for the skip list and how, how an entry matches a module, how experts are decided, and the fused
    modules expanded to their shards (``fallback_fused``: the shards tried when the class maps none).
    ``fused_first``: whether a listed fused name is honoured before its shards are asked (unset: only
    under ``exact``; vLLM before 0.24.0 asks the shards alone)."""
    keys: list[str]
    keys_mode: Literal["first_present", "first_nonempty"]
    match: Literal["exact", "substring", "module_path"]
    fused_first: bool | None = None
    model_prefix_variants: bool
    experts: Literal["replace", "or", "contained"]
    fused: FusedModules
    fallback_fused: FusedModules


class Router(Schema):
    """The config keys the router code reads as attributes, and when the class creates a router bias:
    a topk_method (``noaux_tc``), ``always``, ``never``, or ``config:<key>`` (when that key is true)."""
    reads: list[str]
    bias_when: str = Field(min_length=1)


class DraftArch(Schema):
    """The architecture the draft's config says and the one its class compares for fusion."""
    config: str
    class_: str = Field(alias="class")


class FusionByArchitecture(Schema):
    """sglang's DeepSeek-V2-style decision (determine_num_fused_shared_experts, later
    shared_experts_fusion_disable_reason): the architecture per family (``arch``: None when the class compares
    none), the draft's (``draft_arch``), the expert counts that fuse (``routed_experts``: any, or count -> the
    kind it fuses under), the least GPU capability per platform, and under expert parallelism."""
    decided_by: Literal["determine_num_fused_shared_experts", "shared_experts_fusion_disable_reason"]
    exclude_veto: Literal["none", "mtp_prefix", "draft_layers"]  # exclude entries that keep fusion off
    arch: dict[str, str] | None
    draft_arch: dict[str, DraftArch]
    routed_experts: Literal["any"] | dict[int, Literal["any", "quark", "fp8"]]
    shared_experts: Literal["any"] | int
    min_capability: dict[Platform, Capability]
    ep_min_capability: dict[Platform, Capability]
    file: str | None = None  # the model file the decision is cited in (default deepseek_v2.py)


class FusionByBlock(Schema):
    """sglang's Qwen2-MoE-style decision (can_fuse_shared_expert): on ``platforms``, one shared expert of the
    routed experts' size; ``shared``: the shared expert's module name, ``experts_key``: the config key of the
    routed expert count."""
    decided_by: Literal["can_fuse_shared_expert"]
    exclude_veto: Literal["none", "mtp_prefix", "draft_layers"]
    platforms: list[Platform]
    config_reads: list[str]
    experts_key: str
    shared: str
    file: str
    # the MTP draft's blocks: ``own`` (decided with the draft's quant config), ``with_main`` (also off when the main
    # model cannot fuse: a server-wide switch); ``draft_shared_remap``: the draft's loader renames its shared expert
    # into the fused slot (without it a fused draft leaves that slot unloaded)
    draft_decision: Literal["own", "with_main"] = "own"
    draft_shared_remap: bool = True


SharedExpertsFusion = Annotated[FusionByArchitecture | FusionByBlock, Field(discriminator="decided_by")]


class MoeLayerStep(Schema):
    """MoE layers every ``step``-th layer (config key; MoE when (i + 1) % step == 0); a step of 0 means every
    layer (``zero: all``, when config key ``experts`` is positive) or none."""
    step: str
    zero: Literal["all", "none"]
    experts: str


# Which decoder layers the class builds as MoE: ``all`` (every layer), ``config`` (as config.json lists them)
# or a step rule.
MoeLayers = Literal["all", "config"] | MoeLayerStep


class MapperRenames(Schema):
    """A WeightsMapper's renames (None drops the entry)."""
    substr: dict[str, str | None] | None = None
    prefix: dict[str, str | None] | None = None
    suffix: dict[str, str | None] | None = None


class ExcludeMapper(MapperRenames):
    """The class's weight-name mapper applied to the exclude list for ``kinds`` (quant.engines.replay.mapped_entry),
    in the engine's ``style``; ``platforms``: the renames that replace these on one platform."""
    kinds: list[Kind]
    style: Literal["sglang", "vllm"]
    platforms: dict[Platform, MapperRenames] | None = None


class BuiltQuantized(Schema):
    """Leaves (per role) the class builds with the quant config whatever the exclude list says, under configs of
    ``weight_block_size`` when given; ``reason``, ``error`` and ``fix`` word the finding."""
    leaves: dict[Role, list[str]]
    weight_block_size: list[int] | None = None
    reason: str
    error: str
    fix: str


class Mxfp4Native(Schema):
    """A release's own MXFP4 layout (gpt-oss): the experts' scheme, the Linear layers', whether the exclude list
    is read, and the tensors of the layout."""
    experts: str
    linear: str
    reads_exclude: bool
    tensors: list[str]


class QkRotaryPermute(Schema):
    """Leaves the loader reshapes to permute for rotary, which fails for the ``fails`` kinds (a packed weight
    cannot take the view), unless the module name holds one of ``unless_name_has``. ``scales_left``: the view
    takes the packed weight but leaves its scales unpermuted, so the weight loads wrong instead of raising."""
    fails: list[Kind]
    leaves: list[str]
    unless_name_has: list[str]
    scales_left: bool = False


class ExpertScalesRenamed(Schema):
    """The class's loader renames a quantized routed expert's ``scale`` tensor of ``dtype`` to ``renamed`` for
    a layout of its own (MiMo-V2's MXFP4 experts: a uint8 weight_scale becomes weight_scale_inv), a parameter
    the MoE method of the ``fails`` kinds does not create: their quantized routed experts cannot load."""
    fails: list[Kind]
    scale: str
    dtype: str
    renamed: str


class LayerKinds(Schema):
    """The attention kind of each decoder layer (hybrid families): from an interval key (every ``key``-th layer
    ``full``, others ``linear``) or a per-layer list (``key``), falling back to ``interval_key``."""
    from_: Literal["interval", "list"] = Field(alias="from")
    key: str
    full: str
    linear: str
    interval_key: str | None = None
    interval_default: int | None = None
    # the kinds a listed layer may name (unset: any); the release has no decoder layer for another (KeyError)
    builds: list[str] | None = None


class Rules(Schema):
    """A rule set's rules, by kind; a rule set states only what changed since the previous set."""
    quark_match: Rule[QuarkMatch] | None = None
    quark_fused: Rule[FusedModules] | None = None  # the fused names the Quark config expands to shards
    built_fused: Rule[FusedModules] | None = None  # the modules the class builds fused
    mixed_shards_error: Rule[Annotated[str, AfterValidator(_mixed_shards_template)]] | None = None  # its message
    mtp_naming: Rule[MtpNaming] | None = None
    draft_module_names: Rule[DraftModuleNames | None] | None = None
    draft_exclude: Rule[DraftExclude] | None = None
    eh_proj: Rule[EhProj] | None = None
    indexer: Rule[Indexer | None] | None = None  # None: a class without a DSA indexer
    unquantized_roles: Rule[list[Role]] | None = None  # roles always built bf16
    unquantized_leaves: Rule[dict[Role, list[str]] | None] | None = None  # role -> leaves always built bf16
    quark_config: Rule[QuarkConfig] | None = None
    fp8_skip: Rule[Fp8Skip] | None = None
    router: Rule[Router] | None = None
    shared_experts_fusion: Rule[SharedExpertsFusion | None] | None = None  # None: the class never fuses
    moe_layers: Rule[MoeLayers] | None = None
    module_names: Rule[Renames | None] | None = None  # the class's prefix for the checkpoint's modules
    exclude_mapper: Rule[ExcludeMapper | None] | None = None
    built_quantized: Rule[dict[Kind, BuiltQuantized] | None] | None = None
    mxfp4_native: Rule[Mxfp4Native | None] | None = None
    qk_rotary_permute: Rule[QkRotaryPermute | None] | None = None
    layer_kinds: Rule[LayerKinds | None] | None = None
    expert_scales_renamed: Rule[ExpertScalesRenamed | None] | None = None


Version = Annotated[str, Field(pattern=r"^\d+(\.\d+)*(\.post\d+)?$")]


class RuleSetEntry(Schema):
    """The releases ``versions: [first, last]`` share these rules."""
    versions: Annotated[list[Version], Field(min_length=2, max_length=2)]
    rules: Rules


class RuleFile(Schema):
    """An engine rule file: the model classes it was read for, the releases read (``checked``; a ``.postN``
    follows the release ``post_releases`` maps it to) and the rule sets, oldest first. The engine's own file
    also names the ``engine_wide`` rules every class's file takes from it."""
    engine: Literal["sglang", "vllm"]
    model_classes: Annotated[list[str], Field(min_length=1)]
    checked: Annotated[list[Version], Field(min_length=1)]
    post_releases: dict[Version, Version] | None = None
    engine_wide: list[str] | None = None
    rule_sets: Annotated[list[RuleSetEntry], Field(min_length=1)]

    @field_validator("engine_wide")
    @classmethod
    def _rule_kinds(cls, names: list[str] | None) -> list[str] | None:
        for name in names or []:
            if name not in Rules.model_fields:
                raise ValueError(nearest(name, Rules.model_fields, "rule"))
        return names


class BlockLinear(Schema):
    """How a release checks a block-quantized (FP8 ``weight_block_size``) Linear's per-rank partitions:
    a row-parallel input partition % block_k and each column-parallel output partition % block_n raise
    when TP splits them; a merged (stacked) layer's partitions are checked at any TP.
    ``merged_mismatch_allowed``: a merged column layer with a partition that is not a multiple of block_n
    skips the check (it loads) instead of raising."""
    merged_mismatch_allowed: bool


class BlockMoe(Schema):
    """How a release builds a block-quantized FusedMoE whose per-rank intermediate size (TP: split, EP:
    whole) is not a multiple of the block: ``raise``; or ``refine`` the block down to
    gcd(block_n, block_k, partition, hidden) when that is at least ``refine_min``, else raise.
    ``rocm_pads``: on ROCm (aiter) the partition is padded to this size instead when it equals both
    block sides (None: never padded)."""
    misfit: Literal["raise", "refine"]
    refine_min: int | None = Field(default=None, ge=1)
    rocm_pads: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _refine_needs_min(self):
        if (self.misfit == "refine") != (self.refine_min is not None):
            raise ValueError("refine_min is given with misfit refine, and only then")
        return self


class BlockFp8Rules(Schema):
    linear: Rule[BlockLinear] | None = None
    moe: Rule[BlockMoe] | None = None


class BlockFp8Entry(Schema):
    """The releases ``versions: [first, last]`` (every registry release between them was read) share these rules."""
    versions: Annotated[list[Version], Field(min_length=2, max_length=2)]
    rules: BlockFp8Rules


class BlockFp8File(Schema):
    """``manifests/engines/block_fp8.<engine>.yaml``: the quantization layer's block-FP8 partition checks,
    the same for every model class of the release; rule sets oldest first, each listing what changed."""
    engine: Literal["sglang", "vllm"]
    rule_sets: Annotated[list[BlockFp8Entry], Field(min_length=1)]
