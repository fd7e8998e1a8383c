"""Opening files that a hostile folder may hold, for every command of quantgate and its evals.

Writes never follow a link: a final name that is a symbolic link is refused (naming it), and the
``<name>.partial`` a file is written under is created fresh with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` after removing whatever stale entry held that name, so a link planted there is
removed, never written through. Reads take only regular files (a FIFO would block the reader, a
device like ``/dev/zero`` never ends): the file is opened non-blocking and checked on the open
descriptor before a byte is read, and whole-file reads are capped. JSON is parsed with integers
capped in digits and nesting bounded by the parser's recursion limit, so a hostile file is an
error naming it, never a traceback or an exhausted machine. YAML (policies, plans, recipes,
manifests) is read the same way, capped far lower, with aliases refused (``*name`` is how a few
hundred bytes expand to gigabytes: no quantgate file uses them) and integers capped in digits.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import yaml

from quant.errors import UnsafeFileError

JSON_BYTES = 64 << 20  # far above any config, index, progress file or bundle file quantgate reads
INT_DIGITS = 40  # far above any integer in those files (u64 has 20 digits)
YAML_BYTES = 1 << 20  # far above any policy, plan, recipe or manifest (the largest shipped is ~20 kB)


def refuse_link(path: Path) -> None:
    """Refuse (exit 2) a symbolic link at ``path``, where a file is about to be written."""
    if os.path.islink(path):
        raise UnsafeFileError(f"{path}: a symbolic link where quantgate writes a file; it never writes through a "
                              "link (it may point outside the output folder): remove the link, or choose another "
                              "folder")


def create_new(path: Path, mode: int = 0o644) -> int:
    """A write-only descriptor on a file created now at ``path``: a stale entry there (a partial
    file of a crashed run, or a planted link) is removed first, and ``O_EXCL | O_NOFOLLOW`` means
    the open can never reach through a link, even one planted after the removal (that is an error)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise UnsafeFileError(f"{path}: a folder where quantgate writes a file; remove it") from None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise UnsafeFileError(f"{path}: re-created by someone else while quantgate was writing it; make sure "
                              "nothing else writes into this folder, and rerun") from None


def make_folder(path: Path) -> Path:
    """``path`` as a folder quantgate writes into (created if missing), refused if it is a link:
    files written there would land wherever the link points."""
    refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path)
    return path


def open_regular_fd(path: Path, error=UnsafeFileError, follow: bool = True) -> int:
    """A read-only descriptor on ``path``, refused with ``error`` unless it is a regular file. It is
    opened non-blocking (opening a FIFO would wait for a writer forever) and checked on the open
    descriptor, so nothing can be swapped in between the check and the read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path}: a symbolic link, which quantgate does not follow here; replace it with the "
                        "file itself") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file (a FIFO, device or folder); put the real file there")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, limit: int = JSON_BYTES, error=UnsafeFileError, follow: bool = True) -> bytes:
    """The bytes of the regular file ``path``, refused with ``error`` if it holds more than ``limit``
    (``follow=False``: a link there is refused too)."""
    fd = open_regular_fd(path, error, follow)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)  # a file that grows meanwhile is still read only this far
    if len(data) > limit:
        raise error(f"{path}: larger than {limit >> 20} MiB, far more than such a file holds; "
                    "check that it is the right file")
    return data


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {INT_DIGITS} are read)")
    return int(text)


def parse_json(data: bytes | str, where: str, error=UnsafeFileError, fix: str = "check the file",
               object_pairs_hook=None):
    """``data`` parsed as JSON, any defect raised as ``error`` naming ``where`` (a file, a line)
    and ``fix``."""
    try:
        return json.loads(data, parse_int=_bounded_int, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read; {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise error(f"{where}: not valid JSON ({exc}); {fix}") from None


def read_json(path: Path, error=UnsafeFileError, fix: str = "check the file", limit: int = JSON_BYTES,
              follow: bool = True):
    """The JSON value in the regular file ``path`` (size capped, integers bounded), or ``error``."""
    return parse_json(read_regular(path, limit, error, follow), str(path), error, fix)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and with integers capped in digits."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "an alias (*name), which quantgate does not expand (a few "
                                              "aliases can expand to gigabytes): write the value out",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):
        digits = node.value.lstrip("+-").replace("_", "")
        if len(digits) > INT_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(digits)} digits (at most "
                                                    f"{INT_DIGITS} are read)", node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse_yaml(data: bytes | str, where: str, error=UnsafeFileError, fix: str = "check the file"):
    """``data`` parsed as YAML (JSON is YAML) by ``_BoundedLoader``, any defect raised as ``error``
    naming ``where`` and the line."""
    try:
        return yaml.load(data, Loader=_BoundedLoader)  # a SafeLoader, aliases refused
    except RecursionError:
        raise error(f"{where}: YAML nested too deeply to read; {fix}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise error(f"{where}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc}); {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{where}: not valid YAML ({exc}); {fix}") from None


def read_yaml(path: Path, error=UnsafeFileError, fix: str = "check the file", limit: int = YAML_BYTES):
    """The YAML value in the regular file ``path`` (size capped, no aliases, integers bounded), or ``error``."""
    try:
        data = read_regular(path, limit, error)
    except FileNotFoundError:
        raise error(f"{path}: not found; {fix}") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc}); {fix}") from None
    return parse_yaml(data, str(path), error, fix)


def hf_cache_blobs(folder: Path) -> Path | None:
    """The Hugging Face hub cache keeps a checkpoint as ``<repo>/snapshots/<revision>/<file>``,
    each file a link to ``<repo>/blobs/<sha>``; that ``blobs`` folder, when ``folder`` is such a
    snapshot (huggingface_hub's file_download.py, ``_create_symlink``)."""
    folder = folder.absolute()
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        return (folder.parent.parent / "blobs").resolve()
    return None


def check_source_file(folder: Path, name: str, error=UnsafeFileError) -> Path:
    """``folder / name``, refused with ``error`` if it is a link that leaves ``folder`` (or the
    Hugging Face cache's blobs beside a snapshot) or leads to anything but a regular file: a link
    to ``/proc/self/environ`` or a private file would otherwise land in an output someone publishes."""
    path = folder / name
    if not path.is_symlink():
        return path
    target = path.resolve()
    roots = [r for r in (folder.resolve(), hf_cache_blobs(folder)) if r is not None]
    if not any(root in target.parents for root in roots):
        raise error(f"{path}: a symbolic link to {target}, outside the checkpoint folder; quantgate copies and "
                    "reads only files inside it: replace the link with a copy of the file if you mean it")
    if not target.is_file():
        raise error(f"{path}: a symbolic link to {target}, which is not a regular file; put the real file there")
    return path
