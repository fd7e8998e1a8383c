"""Tiny random checkpoints of the MoE families, named exactly as their Hugging Face releases store
them. Each family folder's ``tiny.py`` (``manifests/families/<family>/tiny.py``) is its builder, so a
family added as a folder brings its own; this module runs them. A builder defines either

- ``build(num_hidden_layers, **overrides) -> (config, model class)``: transformers' own modeling class
  builds the decoder (so names and shapes are transformers'), saved; optionally ``DRAFT_LAYERS`` (the
  decoder layers built beyond ``num_hidden_layers`` for the release's MTP / next-n layer, which
  transformers does not build as such), ``release(tensors, config, num_hidden_layers, seed)`` (the
  release's names and the tensors it carries beyond transformers'), ``release_config(saved, config,
  num_hidden_layers)`` (config.json's keys as the release writes them) and ``ARCHITECTURE``; or
- ``write(dst, *, num_hidden_layers, seed, **overrides) -> Path``: it writes the checkpoint itself.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import tempfile
from pathlib import Path
from types import ModuleType

from quant.example import write_tokenizer
from quant.layout import family_dirs, family_named

TINY = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}


def family_module(family: str, name: str) -> ModuleType | None:
    """The family folder's ``<name>.py`` (``tiny``, ``full_size``) as a module; None where it has none."""
    folders = family_dirs()
    if family not in folders:
        raise KeyError(f"no family folder named {family!r}; the families: {', '.join(folders)}")
    path = folders[family] / f"{name}.py"
    return _load(path.resolve()) if path.is_file() else None


@functools.cache
def _load(path: Path) -> ModuleType:
    # named by the folder, so that a copied folder is a module of its own
    spec = importlib.util.spec_from_file_location(f"quantgate_family_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_builder(family: str) -> ModuleType:
    builder = family_module(family, "tiny")
    if builder is None:
        raise KeyError(f"family {family!r} has no tiny.py in {family_dirs()[family]}")
    return builder


def built_families() -> list[str]:
    """The discovered families whose tiny checkpoint transformers' own modeling class builds (``build``)."""
    return [f for f in family_dirs() if hasattr(family_module(f, "tiny"), "build")]


def serve_args(family: str) -> list[str]:
    """``--serve`` arguments for quantizing ``family``'s tiny checkpoint to MXFP4: the releases its ``tiny.py``
    names (``SERVE``) where an engine's newest release read cannot load that output (quantize refuses it
    otherwise); none for the rest."""
    return [arg for spec in getattr(tiny_builder(family), "SERVE", ()) for arg in ("--serve", spec)]


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    """Seeded small bf16 values for tensors a release carries beyond what transformers builds."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}


def renamed(tensors: dict, old: str, new: str) -> dict:
    """``tensors`` with the name prefix ``old`` replaced by ``new``."""
    return {(new + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}


def draft_fc_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """The draft's own tensors as Qwen3-Next / Qwen3.5 store them beside mtp.layers.0 (sglang qwen3_next.py
    load_weights)."""
    return {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
            "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}


def per_expert(rest: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]] | None:
    """transformers' fused 3-D experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
    [E, H, I]) as the releases store them, one weight per expert and projection (conversion_mapping.py
    reverted, as save_pretrained writes them); None for any other tensor."""
    if rest == "mlp.experts.gate_up_proj":
        return [(f"mlp.experts.{e}.{p}.weight", dtype, (shape[1] // 2, shape[2])) for e in range(shape[0])
                for p in ("gate_proj", "up_proj")]
    if rest == "mlp.experts.down_proj":
        return [(f"mlp.experts.{e}.down_proj.weight", dtype, tuple(shape[1:])) for e in range(shape[0])]
    return None


def layer_entries(state: dict, layers: str) -> tuple[dict[int, list], list]:
    """A (meta-device) state dict as header entries ``(name, dtype, shape)``, for a full-size layout
    built from a few layers: each decoder layer's (by its index under ``layers``, a name prefix such as
    ``language_model.model.layers``; names after the index) and the rest. Router bias F32, else BF16."""
    per_layer: dict[int, list] = {}
    rest = []
    for name, tensor in state.items():
        dtype = "F32" if "correction_bias" in name else "BF16"
        m = re.match(rf"{re.escape(layers)}\.(\d+)\.(.+)$", name)
        if m:
            per_layer.setdefault(int(m.group(1)), []).append((m.group(2), dtype, tuple(tensor.shape)))
        else:
            rest.append((name, dtype, tuple(tensor.shape)))
    return per_layer, rest


def write_family_checkpoint(dst: Path, family: str, *, num_hidden_layers: int = 3, seed: int = 0,
                            **config_overrides) -> Path:
    """A bf16 checkpoint of ``family`` in two shards with index, config.json and tokenizer
    (``config_overrides``: config keys other than the release's, e.g. ``mlp_only_layers``), by the
    family folder's ``tiny.py``. config.json names one of the family's model types (the manifest's
    first where the builder's is not the family's: a copied folder's checkpoint is read as the copy)."""
    builder = tiny_builder(family)
    if hasattr(builder, "write"):
        dst = Path(builder.write(Path(dst), num_hidden_layers=num_hidden_layers, seed=seed, **config_overrides))
    else:
        dst = _write_built(Path(dst), builder, num_hidden_layers, seed, config_overrides)
    config = json.loads((dst / "config.json").read_text())
    if named_as(config, family):
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def named_as(config: dict, family: str) -> bool:
    """Give ``config`` the family manifest's first model type where its own is not one of the family's
    (a copied folder's builder still writes the original's); whether it changed."""
    model_types = family_named(family).model_types
    if config.get("model_type") in model_types:
        return False
    config["model_type"] = model_types[0]
    return True


def write_shards(tensors: dict, dst: Path) -> None:
    """``tensors`` as a release stores them: two safetensors shards (names in sorted order) and their index."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        file = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))


def _write_built(dst: Path, builder: ModuleType, num_hidden_layers: int, seed: int, overrides: dict) -> Path:
    import torch
    from safetensors.torch import load_file

    config, model_class = builder.build(num_hidden_layers + getattr(builder, "DRAFT_LAYERS", 0), **overrides)
    torch.manual_seed(seed)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        # save_pretrained writes the release's names (transformers reverts its fused expert tensors
        # to the per-expert checkpoint layout, modeling_utils' weight conversions)
        model_class(config).to(torch.bfloat16).save_pretrained(tmp)
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if hasattr(builder, "release"):
            tensors = builder.release(tensors, config, num_hidden_layers, seed)
    dst.mkdir(parents=True, exist_ok=True)
    write_shards(tensors, dst)
    saved = config.to_dict()
    saved.update(architectures=[getattr(builder, "ARCHITECTURE", model_class.__name__)], torch_dtype="bfloat16")
    if hasattr(builder, "release_config"):
        builder.release_config(saved, config, num_hidden_layers)
    elif "text_config" not in saved:  # the draft's layer was built beside the decoder's: one kind per decoder layer
        saved.update(num_hidden_layers=num_hidden_layers)
        if "layer_types" in saved:
            saved["layer_types"] = saved["layer_types"][:num_hidden_layers]
    (dst / "config.json").write_text(json.dumps(saved, indent=2))
    text = getattr(config, "text_config", config)
    write_tokenizer(dst, text.vocab_size, text.max_position_embeddings)
    return dst
