"""Output-folder hygiene shared by every writer (``--to`` any format, ``--to bf16``): never touch
the source, never mix with other files, and never leave a complete-looking partial file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from quant.errors import ConvertError
from quant.safetensors_io import PARTIAL_SUFFIX

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "conversion_manifest.json"
PROGRESS_NAME = ".quantgate-progress.json"
# Files a writer creates itself; everything else in a source folder is carried over unchanged.
WRITTEN = (INDEX_NAME, "config.json", MANIFEST_NAME, PROGRESS_NAME)


def aux_files(folder: Path) -> tuple[str, ...]:
    """The files to copy as they are: tokenizer, generation config, chat template, .py ..."""
    return tuple(sorted(p.name for p in folder.iterdir()
                        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in WRITTEN))


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + PARTIAL_SUFFIX)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_overlap(src: Path, dst: Path) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConvertError(f"output folder {dst} overlaps the input {src}; choose a separate, empty folder")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output {dst} exists and is not a folder")


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """A fresh output folder that neither overlaps the source nor holds anything else."""
    check_overlap(src, dst)
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            hint = " or --resume to finish it" if (dst / PROGRESS_NAME).exists() else ""
            raise ConvertError(f"output folder {dst} is not empty; choose an empty folder, pass --overwrite "
                               f"to replace a previous conversion there{hint}")
        if not (dst / "config.json").exists() and not any(dst.glob("*.safetensors*")) \
                and not (dst / PROGRESS_NAME).exists():
            raise ConvertError(f"--overwrite refuses {dst}: it does not look like a checkpoint folder "
                               "(no config.json or shards); remove it yourself if you mean it")
        shutil.rmtree(dst)
