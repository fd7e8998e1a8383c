"""Replay of sglang's and vLLM's loading rules on a checkpoint: which module each engine builds
quantized, and whether the tensors on disk fit it. The rules are data (``manifests/engines/``,
each citing the engine source it comes from); this module only applies them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from quant.layout import Family, manifests_root
from quant.serving import expert_groups, sglang_mtp_alias

ENGINES = ("sglang", "vllm")
GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class EngineRules:
    name: str
    mtp_naming: str  # "decoder" (sglang's draft model) or "original"
    fused: dict[str, tuple[str, ...]]
    expert_children_match: bool
    eh_proj_quantizable: bool
    requires_input_tensors: bool
    formats: tuple[str, ...]
    unquantized_roles: tuple[str, ...]  # built without a quant method whatever the exclude list says


@dataclass(frozen=True)
class Module:
    """A checkpoint Linear: U8 (MXFP4) on disk or not, its logical [out, in], its family role."""
    quantized: bool
    shape: tuple[int, int]
    role: str


@dataclass(frozen=True)
class Finding:
    check: str  # layout | config | engine
    engine: str | None
    module: str
    why: str
    fix: str


def load_rules(engine: str) -> EngineRules:
    data = yaml.safe_load((manifests_root() / "engines" / f"{engine}.yaml").read_text())
    return EngineRules(data["engine"], data["mtp_naming"], {k: tuple(v) for k, v in data["fused"].items()},
                       bool(data["expert_children_match"]), bool(data["eh_proj_quantizable"]),
                       bool(data["requires_input_tensors"]), tuple(data["formats"]),
                       tuple(data.get("unquantized_roles") or ()))


def exclude_matcher(exclude: list[str]):
    """The engines' ``should_ignore_layer`` test: exact equality, or ``re.match`` for ``re:`` entries."""
    exact = {e for e in exclude if not e.startswith("re:")}
    patterns = [re.compile(e[3:]) for e in exclude if e.startswith("re:")]
    return lambda name: name in exact or any(p.match(name) for p in patterns)


def _engine_name(module: str, rules: EngineRules, family: Family, num_hidden_layers: int) -> str:
    if rules.mtp_naming == "decoder":
        return sglang_mtp_alias(module, num_hidden_layers, family) or module
    return module


def replay(rules: EngineRules, modules: dict[str, Module], exclude: list[str], family: Family,
           num_hidden_layers: int) -> list[Finding]:
    """Findings for one engine, from the checkpoint's Linear modules and the exclude list."""
    skipped = exclude_matcher(exclude)
    findings: list[Finding] = []
    name = lambda m: _engine_name(m, rules, family, num_hidden_layers)  # noqa: E731
    for module, info in sorted(modules.items()):
        if info.role in rules.unquantized_roles and info.quantized:
            findings.append(Finding("engine", rules.name, name(module),
                                    f"{rules.name} builds this {info.role} unquantized; a U8 weight cannot load",
                                    "keep it bf16 (quantgate's recipes never quantize it)"))
    modules = {m: i for m, i in modules.items() if i.role not in rules.unquantized_roles}

    groups = expert_groups(set(modules))
    for aggregate, members in sorted(groups.items()):
        engine_module = name(aggregate)
        on_disk = {modules[m].quantized for m in members}
        excluded = skipped(engine_module) or (rules.expert_children_match and any(
            e.startswith(engine_module + ".") for e in exclude))
        if len(on_disk) > 1:
            findings.append(Finding("engine", rules.name, engine_module,
                                    "routed experts of one layer are partly MXFP4, partly bf16; the FusedMoE module "
                                    "loads all of them with one scheme",
                                    "quantize all routed experts of the layer or none"))
        elif on_disk == {False} and not excluded:
            # The first weight loaded into w13 (gate_proj) fails: [.., in/2] slot vs [.., in] tensor.
            out, cols = modules[min(members, key=lambda m: not m.endswith("gate_proj"))].shape
            findings.append(Finding("engine", rules.name, engine_module,
                                    f"bf16 experts meet an MXFP4 FusedMoE: RuntimeError: The size of tensor a "
                                    f"({cols // 2}) must match the size of tensor b ({cols}) at non-singleton "
                                    "dimension 1",
                                    f"add exclude entry {engine_module!r}"))
        elif on_disk == {True} and excluded:
            findings.append(Finding("engine", rules.name, engine_module,
                                    "MXFP4 experts on disk but the exclude list makes the FusedMoE bf16: "
                                    "packed bytes would load as weights",
                                    f"remove the exclude entries matching {engine_module!r}"))

    rest = {m for m in modules if not any(m in members for members in groups.values())}
    handled: set[str] = set()
    for module in sorted(rest):
        if module in handled:
            continue
        parent, _, leaf = module.rpartition(".")
        fused = next(((f, shards) for f, shards in rules.fused.items() if leaf in shards), None)
        shard_modules = [f"{parent}.{s}" for s in fused[1] if f"{parent}.{s}" in rest] if fused else [module]
        handled.update(shard_modules)
        engine_module = name(f"{parent}.{fused[0]}") if fused else name(module)
        decisions = {s: not skipped(name(s)) for s in shard_modules}
        if len(set(decisions.values())) > 1:
            findings.append(Finding("engine", rules.name, engine_module,
                                    f"shards {[name(s) for s in shard_modules]} disagree in the exclude list: the engine "
                                    "raises 'Detected some but not all shards ... different quantization schemes'",
                                    "exclude all shards of the fused module or none"))
            continue
        part_of = f" (a shard of {engine_module})" if fused else ""
        for shard in shard_modules:
            quantized_on_disk, shape = modules[shard].quantized, modules[shard].shape
            if leaf == "eh_proj" and quantized_on_disk and not rules.eh_proj_quantizable:
                findings.append(Finding("engine", rules.name, name(shard),
                                        f"{rules.name} builds eh_proj as a plain bf16 Linear; a U8 eh_proj cannot load",
                                        "keep eh_proj bf16 (quantgate always does) and exclude it"))
            elif decisions[shard] and not quantized_on_disk:
                out, cols = shape
                findings.append(Finding("engine", rules.name, name(shard),
                                        f"bf16 weight [{out}, {cols}]{part_of} meets an MXFP4 slot "
                                        f"[{out}, {cols // 2}]: AssertionError on shapes at load (the seed's outage)",
                                        f"add exclude entry {name(shard)!r}"))
            elif not decisions[shard] and quantized_on_disk:
                findings.append(Finding("engine", rules.name, name(shard),
                                        f"MXFP4 (U8) weight on disk{part_of} but the exclude list makes it bf16",
                                        f"remove the exclude entry matching {name(shard)!r}"))
    return findings


def config_findings(rules: EngineRules, qconfig: dict) -> list[Finding]:
    """What an engine refuses in the quantization_config itself."""
    findings = []
    weight = (qconfig.get("global_quant_config") or {}).get("weight") or {}
    inputs = (qconfig.get("global_quant_config") or {}).get("input_tensors")
    if weight.get("dtype") not in rules.formats:
        findings.append(Finding("config", rules.name, "global_quant_config.weight",
                                f"{rules.name}'s Quark loader does not accept weight dtype {weight.get('dtype')!r}",
                                f"use one of {list(rules.formats)} or serve with another engine"))
    if rules.requires_input_tensors and weight.get("dtype") == "fp4" and not inputs:
        findings.append(Finding("config", rules.name, "global_quant_config.input_tensors",
                                "MXFP4 weight-only (W4A16): sglang's Quark loader needs W4A4 (an fp4 input_tensors spec)",
                                "re-export without --weight-only"))
    return findings


def engine_rules(engine: str) -> list[EngineRules]:
    return [load_rules(e) for e in (ENGINES if engine == "all" else (engine,))]
