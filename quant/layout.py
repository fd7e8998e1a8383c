"""Model families as data: which checkpoint tensor plays which role.

A family manifest (``manifests/models/<family>.yaml``) lists roles by regex and names the model
class each engine builds it with (``engine_classes``); how that class names, fuses and quantizes
them is engine knowledge (``quant/engines/``, rules keyed by the class). Adding a family is a new
manifest plus the engine rules read for its classes, not new code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from quant.safe_files import read_yaml



@dataclass(frozen=True)
class Role:
    name: str
    pattern: re.Pattern[str]
    linear: bool
    quantizable: bool


@dataclass(frozen=True)
class TensorRole:
    role: str  # "other" when no pattern matched
    linear: bool
    quantizable: bool
    layer: int | None  # index in model.layers, None outside the decoder stack
    mtp: bool  # a next-n (MTP) layer: index >= num_hidden_layers


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

    @property
    def engine_class(self) -> dict[str, str]:
        return dict(self.engine_classes)

    def classify(self, tensor_name: str, num_hidden_layers: int) -> TensorRole:
        layer = self.layer_index(tensor_name)
        mtp = layer is not None and layer >= num_hidden_layers
        for role in self.roles:
            if role.pattern.search(tensor_name):
                return TensorRole(role.name, role.linear, role.quantizable, layer, mtp)
        return TensorRole("other", False, False, layer, mtp)


class UnknownFamilyError(ValueError):
    pass


def manifests_root() -> Path:
    return Path(str(resources.files("manifests")))


def read_yaml_mapping(path: Path, what: str, error: type[Exception]) -> dict:
    """A YAML file that must hold a mapping (read by ``safe_files.read_yaml``: a regular file, size
    capped, no aliases); anything else raises ``error`` naming the file and line."""
    data = read_yaml(Path(path), error, f"fix the {what}")
    if not isinstance(data, dict):
        raise error(f"{path}: a YAML {type(data).__name__}, not a mapping; compare it with the {what} files under "
                    f"{manifests_root()}")
    return data


def load_family(path: Path) -> Family:
    data = read_yaml_mapping(path, "family manifest", UnknownFamilyError)
    try:
        roles = tuple(
            Role(r["role"], re.compile(r["pattern"]), bool(r.get("linear", False)),
                 bool(r.get("quantizable", r.get("linear", False))))
            for r in data["roles"]
        )
        return Family(
            name=data["family"],
            model_types=tuple(data["model_types"]),
            num_layers_key=data.get("num_layers_key", "num_hidden_layers"),
            roles=roles,
            engine_classes=tuple(sorted((str(e), str(c)) for e, c in (data.get("engine_classes") or {}).items())),
            mtp_layers_key=data.get("mtp_layers_key", "num_nextn_predict_layers"),
            text_config_key=data.get("text_config_key"),
            layers_prefix=data.get("layers_prefix", "model.layers"),
        )
    except (KeyError, TypeError, AttributeError, re.error) as exc:  # a field missing or of the wrong type
        raise UnknownFamilyError(f"{path}: not a valid family manifest ({type(exc).__name__}: {exc}); compare it with "
                                 f"{manifests_root() / 'models' / 'glm_moe_dsa.yaml'}") from None


def _known() -> list[Family]:
    return [load_family(path) for path in sorted((manifests_root() / "models").glob("*.yaml"))]


def family_named(name: str) -> Family:
    """The built-in family manifest called ``name``."""
    for family in _known():
        if family.name == name:
            return family
    raise UnknownFamilyError(f"no family manifest named {name!r} under {manifests_root() / 'models'} (known: "
                             f"{', '.join(f.name for f in _known())})")


def family_for(config: dict, manifest: Path | None = None) -> Family:
    """The family manifest for a checkpoint's ``config.json`` (or the one given explicitly)."""
    if manifest is not None:
        return load_family(manifest)
    model_type = config.get("model_type")
    models_dir = manifests_root() / "models"
    known = _known()
    for family in known:
        if model_type in family.model_types:
            return family
    listed = "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in known)
    raise UnknownFamilyError(
        f"config.json model_type {model_type!r}: no model-family manifest (known families: {listed}). To add one: "
        f"write manifests/models/<family>.yaml like {models_dir / 'glm_moe_dsa.yaml'} (model_types, tensor roles by "
        "regex, engine_classes: the sglang and vLLM model class of the architecture; or pass it with "
        "--family-manifest FILE), and the engine rules read for those classes in the wheels "
        "(manifests/engines/<engine>.<family>.yaml: packed_modules_mapping, fused modules, which modules get the "
        "quant config, draft naming, shared-expert fusion)")
