"""A checkpoint folder, read safely once: ``config.json``, the index and every shard's header.

The planner (``quantize``), the checker (``gate checkpoint``) and the decoder (``--to bf16``)
all see a checkpoint through this class, so the rules below hold for each of them alike:

- shard names come from the index (or, without one, the folder listing) and must be plain file
  names ending in ``.safetensors``: no ``/``, no ``..``, no absolute path. Every file this tool
  reads or writes for a shard is ``folder / name``, so a hostile index cannot make it read or
  write outside the folder;
- a file read (config, index, shard) must be a regular file (a FIFO would block the reader), and
  a link among them must stay inside the folder (``safe_files.check_source_file``); JSON is read
  with a size cap and bounded integers;
- a shard's header must be one the safetensors
  library would load (``read_header``: offsets tile the data, nothing before or after);
- ``config.json`` and the index must be JSON objects of the expected types, and a tensor may
  live in only one shard.

Disagreements between the index and the shards are reported by ``index_problems``, once, and
each caller decides: the planner refuses the ones that would lose data, the gate lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quant.errors import CheckpointError
from quant.outputs import INDEX_NAME
from quant.safe_files import check_source_file, read_json
from quant.safetensors_io import ShardError, ShardHeader, TensorInfo, read_header

SHARD_SUFFIX = ".safetensors"
# NVIDIA ModelOpt's own file: its exports up to 0.29 write the quantization config only there, and both engines
# read it when config.json has none (vLLM 0.16.0 transformers_utils/config.py get_config; sglang 0.5.9
# configs/model_config.py ModelConfig._parse_quant_hf_config)
HF_QUANT_CONFIG = "hf_quant_config.json"
# What the engines and lm-eval load a tokenizer from (transformers' fast tokenizer, sentencepiece's, tiktoken's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")
TOKENIZER_FIX = ("copy in the tokenizer files of the model it was saved from (tokenizer.json and "
                 "tokenizer_config.json, or tokenizer.model)")


def tokenizer_problem(folder: Path) -> str | None:
    """Why ``folder`` has no tokenizer, or None: a model's ``save_pretrained`` writes weights and
    config only, so a newcomer's first folder often lacks one, and nothing can tokenize for it."""
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    return f"no tokenizer file ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})"


@dataclass(frozen=True)
class IndexProblem:
    name: str  # the tensor, or the shard file for a file the index does not list
    file: str
    why: str
    fix: str


def read_json_object(path: Path, what: str):
    """A JSON object from ``path`` (``what`` says what the file is for, in the error)."""
    try:
        data = read_json(check_source_file(path.parent, path.name, CheckpointError), CheckpointError,
                         f"restore the {what} from the original checkpoint")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {path.parent} is not a Hugging Face checkpoint folder") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror}); check the file and its permissions") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a JSON {type(data).__name__}, not an object; restore the {what} from the "
                              "original checkpoint")
    return data


def check_shard_name(name, source: str) -> str:
    """``name`` if it is a plain shard file name; ``source`` says where it came from, for the error."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name
    if not plain or not name.endswith(SHARD_SUFFIX):
        raise CheckpointError(f"{source}: shard name {name!r} is not a plain *{SHARD_SUFFIX} file name in the "
                              "checkpoint folder (no folders, '..' or absolute paths); fix the index entry")
    return name


def config_int(config: dict, key: str, config_path: Path) -> int:
    """A non-negative integer field of ``config.json``."""
    value = config.get(key)
    if value is None:
        raise CheckpointError(f"{config_path}: no {key!r}; add it (the model's config.json always has it)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{config_path}: {key} is {value!r}, not a non-negative integer; fix config.json")
    return value


# Counts a config declares that each need at least one tensor per unit (a layer, an expert).
DECLARED_COUNTS = ("num_hidden_layers", "n_routed_experts", "num_experts", "num_nextn_predict_layers")


def check_declared_counts(config_path: Path, config: dict, tensors: int) -> None:
    """A config declaring more layers or experts than the shards hold tensors is refused, in
    constant memory: each one has at least one tensor, so the output would lack them (``quantize``
    calls this; ``gate checkpoint`` lists the missing ones instead, in memory bounded by the files)."""
    # a multimodal release nests the language model's counts (Kimi-K2.5, Llama-4: text_config)
    nested = [(f"{name}.", sub) for name, sub in config.items() if isinstance(sub, dict)]
    for where, key in ((where, key) for where, sub in [("", config), *nested] for key in DECLARED_COUNTS):
        value = (config if not where else config[where[:-1]]).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > tensors:
            raise CheckpointError(f"{config_path}: {where}{key} is {value}, but the shards hold only {tensors} tensors (each "
                                  "layer or expert has at least one): this is not the checkpoint's config; restore "
                                  "config.json from the original checkpoint")


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    config: dict
    index: dict | None  # the parsed index (its metadata and weight_map), None for an index-less folder
    headers: dict[str, ShardHeader]  # shard file name -> header, in name order
    unlisted_files: tuple[str, ...]  # *.safetensors in the folder that the index does not name
    hf_quant_config: dict | None = None  # hf_quant_config.json, read where config.json has no quantization_config

    @classmethod
    def open(cls, folder: Path) -> "Checkpoint":
        folder = Path(folder)
        try:
            return cls._open(folder)
        except OSError as exc:  # e.g. a folder we may not list or enter
            raise CheckpointError(f"{exc.filename or folder}: cannot be read ({exc.strerror}); check the folder and "
                                  "its permissions") from None

    @classmethod
    def _open(cls, folder: Path) -> "Checkpoint":
        if not folder.exists():
            raise CheckpointError(f"{folder}: no such folder; give a Hugging Face checkpoint folder")
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: a file, not a folder; give the checkpoint folder that holds it")
        config = read_json_object(folder / "config.json", "config.json")
        index, weight_map = None, None
        on_disk = sorted(p.name for p in folder.glob("*" + SHARD_SUFFIX))
        if (folder / INDEX_NAME).exists():
            index = read_json_object(folder / INDEX_NAME, "index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{folder / INDEX_NAME}: weight_map is {type(weight_map).__name__}, not an "
                                      "object mapping tensor names to shard files; regenerate the index")
            if not weight_map:
                raise CheckpointError(f"{folder / INDEX_NAME}: weight_map lists no tensor; regenerate the index")
            for tensor, file in weight_map.items():
                check_shard_name(file, f"{folder / INDEX_NAME} entry {tensor}")
            files = sorted(set(weight_map.values()))
        else:
            if not on_disk:
                raise CheckpointError(f"{folder}: no {INDEX_NAME} and no *{SHARD_SUFFIX} files; "
                                      "give a Hugging Face checkpoint folder")
            files = on_disk
        try:
            headers = {file: read_header(check_source_file(folder, file, ShardError)) for file in files}
        except ShardError as exc:
            raise CheckpointError(str(exc)) from None
        seen: dict[str, str] = {}
        for file, header in headers.items():
            for tensor in header.tensors:
                if tensor in seen:
                    raise CheckpointError(f"{folder}: tensor {tensor} is in both {seen[tensor]} and {file}; "
                                          "remove the stale copy (or regenerate the shards)")
                seen[tensor] = file
        unlisted = tuple(f for f in on_disk if f not in headers)
        hf_quant = None
        if config.get("quantization_config") is None and (folder / HF_QUANT_CONFIG).exists():
            hf_quant = read_json_object(folder / HF_QUANT_CONFIG, HF_QUANT_CONFIG)
        return cls(folder, config, index, headers, unlisted, hf_quant)

    @property
    def config_path(self) -> Path:
        return self.folder / "config.json"

    def _quantization_config(self) -> tuple[object, str]:
        """The quantization config the engines read and where it is: config.json's ``quantization_config``,
        else ``hf_quant_config.json``'s content, else config.json's ``compression_config`` (compressed-tensors'
        older key; vLLM 0.16.0 model_arch_config_convertor.py _normalize_quantization_config)."""
        for found, where in ((self.config.get("quantization_config"), f"{self.config_path} quantization_config"),
                             (self.hf_quant_config, str(self.folder / HF_QUANT_CONFIG)),
                             (self.config.get("compression_config"), f"{self.config_path} compression_config")):
            if found is not None:
                return found, where
        return None, f"{self.config_path} compression_config"

    @property
    def quantization_config(self):
        """The quantization config the engines read (``_quantization_config``); None: none."""
        return self._quantization_config()[0]

    @property
    def quantization_config_source(self) -> str:
        """Where ``quantization_config`` was read, for messages."""
        return self._quantization_config()[1]

    @property
    def weight_map(self) -> dict[str, str] | None:
        return None if self.index is None else self.index["weight_map"]

    @property
    def files(self) -> list[str]:
        return list(self.headers)

    def path(self, file: str) -> Path:
        """The path of one of this checkpoint's shards (only those: names were checked on open)."""
        if file not in self.headers:
            raise KeyError(f"{file} is not a shard of {self.folder}")
        return self.folder / file

    def tensors(self) -> dict[str, TensorInfo]:
        return {name: info for header in self.headers.values() for name, info in header.tensors.items()}

    def config_int(self, key: str) -> int:
        return config_int(self.config, key, self.config_path)

    def check_declared_counts(self) -> None:
        check_declared_counts(self.config_path, self.config, sum(len(h.tensors) for h in self.headers.values()))

    def index_problems(self) -> tuple[list[IndexProblem], list[IndexProblem]]:
        """``(missing, unlisted)``: tensors the index names but no shard holds (data would be lost),
        and shard files or tensors on disk that the index does not name."""
        if self.weight_map is None:
            return [], []
        missing = [IndexProblem(tensor, file, f"{INDEX_NAME} maps it to {file}, which has no such tensor",
                                "re-download the shard or regenerate the index")
                   for tensor, file in sorted(self.weight_map.items()) if tensor not in self.headers[file].tensors]
        unlisted = [IndexProblem(file, file, f"a shard in the folder of which {INDEX_NAME} lists no tensor",
                                 "add its tensors to the index, or move the file out of the folder")
                    for file in self.unlisted_files]
        for file, header in self.headers.items():
            unlisted += [IndexProblem(tensor, file, f"in {file} but not in {INDEX_NAME}", "regenerate the index")
                         for tensor in sorted(set(header.tensors) - set(self.weight_map))]
        return missing, unlisted
