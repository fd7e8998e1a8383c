"""Output-folder hygiene shared by every writer (``--to`` any format, ``--to bf16``): never touch
the source, never mix with other files, one writer at a time, and never leave a complete-looking
partial file."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

from quant.errors import ConvertError, UnsafeFileError
from quant.safe_files import check_source_file, create_new, open_regular_fd, refuse_link
from quant.safetensors_io import PARTIAL_SUFFIX

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "conversion_manifest.json"
PROGRESS_NAME = ".quantgate-progress.json"
LOCK_NAME = ".quantgate.lock"
# Files a writer creates itself; everything else in a source folder is carried over unchanged.
WRITTEN = (INDEX_NAME, "config.json", MANIFEST_NAME, PROGRESS_NAME, LOCK_NAME)


def aux_files(folder: Path) -> tuple[str, ...]:
    """The files to copy as they are: tokenizer, generation config, chat template, .py ... A link
    among them that leaves the folder or leads to a special file is refused (``check_source_file``);
    FIFOs, devices and folders are not files to copy."""
    names = sorted(p.name for p in folder.iterdir() if (p.is_file() or p.is_symlink()) and not p.is_dir()
                   and not p.name.endswith(".safetensors") and p.name not in WRITTEN)
    return tuple(name for name in names if check_source_file(folder, name).is_file())


DEFAULT_MODE = 0o644


def output_mode(*source_modes: int) -> int:
    """The permissions of a file written from these sources: read for group and others only where
    every source grants it (a 0600 shard gives a 0600 output, never 0644); the owner, who wrote it,
    reads and writes it. The umask still applies on creation, so the stricter of the two wins."""
    shared = DEFAULT_MODE & 0o044
    for mode in source_modes:
        shared &= mode
    return 0o600 | shared


@contextmanager
def atomic_file(path: Path, mode: int = DEFAULT_MODE):
    """A binary file to fill that appears at ``path`` only once complete and on disk: a crash
    leaves the old file or none, never half of it. Never through a link (``safe_files``: a link
    at ``path`` is refused, the ``.partial`` is created new, a stale one removed first).
    ``mode``: the permissions it is created with, less the umask (a copy passes its source's)."""
    refuse_link(path)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    fd = create_new(tmp, mode & 0o7777)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # ours: created with O_EXCL above
        raise


def write_atomic(path: Path, data: bytes | str, mode: int = DEFAULT_MODE) -> None:
    """``data`` (text as UTF-8) under ``path``, atomically: the one atomic write of quantgate and its evals
    (``mode`` as in ``atomic_file``)."""
    with atomic_file(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def copy_atomic(src: Path, dst: Path) -> None:
    """A copy of the regular file ``src``, with its permissions less the umask (never wider than
    the source), appearing at ``dst`` only when complete."""
    with os.fdopen(open_regular_fd(src), "rb") as source:
        with atomic_file(dst, stat.S_IMODE(os.fstat(source.fileno()).st_mode)) as f:
            shutil.copyfileobj(source, f, 1 << 20)


def check_overlap(src: Path, dst: Path) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConvertError(f"output folder {dst} overlaps the input {src}; choose a separate, empty folder")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output {dst} exists and is not a folder")


def create_destination(dst: Path) -> None:
    """``dst`` and its parents as folders; a path that cannot be one is bad input, not a failure."""
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError, PermissionError) as exc:
        raise ConvertError(f"cannot create the output folder {dst} ({exc.strerror}: {exc.filename}); "
                           "choose a folder you can write") from None


class DestinationLock:
    """Exclusive hold on an output folder for a writer's whole run (``with DestinationLock(dst):``).

    An advisory ``flock`` on ``DST/.quantgate.lock``, which holds the writer's pid so a second
    writer can say whom it waits for. The kernel drops the lock when its holder dies (even by
    kill -9), so a stale file never blocks anyone; a finished run removes it.
    """

    def __init__(self, dst: Path, writer: str = "quantize run", error: type[Exception] = ConvertError):
        self.path = Path(dst) / LOCK_NAME
        self.writer, self.error = writer, error  # who writes (named to the one refused), what refusing raises
        self.fd = -1

    def __enter__(self) -> "DestinationLock":
        for _ in range(10):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise self.error(f"{self.path.parent} is being written by another {self.writer} (pid {holder}) "
                                 f"holding {self.path}: wait for it to finish or stop it (then --resume), or choose "
                                 "another folder") from None
            try:  # the holder before us may have removed the file between our open and our lock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return self
            os.close(fd)
        raise self.error(f"{self.path}: could not take the lock (the file keeps being replaced); retry")

    def _open(self) -> int:
        """The lock file, never through a link (the pid written into it would truncate the target)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                refuse_link(self.path)
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeFileError(f"{self.path}: not a regular file (a FIFO, device or folder); remove it")
        return fd

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # while still held: nobody can have locked this file meanwhile
        os.close(self.fd)
        self.fd = -1


def prepare_destination(dst: Path, overwrite: bool) -> None:
    """An empty output folder (the lock aside): a previous conversion there is removed with
    ``overwrite``, anything else is refused. Call while holding the ``DestinationLock``."""
    entries = [p for p in dst.iterdir() if p.name != LOCK_NAME]
    if not entries:
        return
    if not overwrite:
        raise _not_empty(dst)
    if _foreign_checkpoint(dst):
        raise _swapped_or_foreign(None, dst)
    if not _holds_checkpoint(dst) and not (dst / PROGRESS_NAME).exists():
        raise ConvertError(f"--overwrite refuses {dst}: it does not look like a checkpoint folder "
                           "(no config.json or shards); remove it yourself if you mean it")
    for path in entries:  # the folder itself stays: the lock lives in it
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _not_empty(dst: Path) -> ConvertError:
    hint = " or --resume to finish it" if (dst / PROGRESS_NAME).exists() else ""
    return ConvertError(f"output folder {dst} is not empty; choose an empty folder, pass --overwrite "
                        f"to replace a previous conversion there{hint}")


def _holds_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").exists() or any(folder.glob("*.safetensors*"))


def _written_by_quantize(folder: Path) -> bool:
    """A finished conversion (its manifest) or an unfinished one (its progress file)."""
    return (folder / MANIFEST_NAME).exists() or (folder / PROGRESS_NAME).exists()


def _foreign_checkpoint(folder: Path) -> bool:
    """A checkpoint quantize did not write: a source, most likely; never replaced (``--overwrite``
    replaces a previous conversion only) nor resumed."""
    return _holds_checkpoint(folder) and not _written_by_quantize(folder)


def _swapped_or_foreign(src: Path | None, dst: Path) -> ConvertError:
    """DST holds a checkpoint that may be the user's source: say why SRC and DST look swapped where
    SRC shows it (absent, or quantize's own output), and never suggest --overwrite."""
    evidence = ("" if src is None else f"{src} does not exist" if not src.exists()
                else f"{src} is quantize's output ({MANIFEST_NAME})" if _written_by_quantize(src) else "")
    what = (f"a checkpoint quantize did not write (no {MANIFEST_NAME}), maybe your source, which it never writes "
            "over" if _foreign_checkpoint(dst) else "a checkpoint, maybe your source")
    swapped = f"SRC and DST look swapped: {evidence}" if evidence else "if it is, SRC and DST are swapped"
    return ConvertError(f"output folder {dst} holds {what}; {swapped}; give the source first "
                        "(quantize --to FORMAT SRC DST), or an empty output folder")


def check_destination(src: Path, dst: Path, overwrite: bool, resume: bool) -> None:
    """Read-only and early (before a plan is made or printed): the refusals the run would reach
    only after planning, an output folder that overlaps the input or holds something else. A DST
    that may be the user's source (a checkpoint quantize did not write, or any checkpoint where SRC
    does not exist) is refused whatever the flags, saying what looks swapped."""
    check_overlap(src, dst)
    if not dst.is_dir():
        return
    if _foreign_checkpoint(dst) or (not src.exists() and _holds_checkpoint(dst)):
        raise _swapped_or_foreign(src, dst)
    if overwrite or resume:
        return
    if any(p.name != LOCK_NAME for p in dst.iterdir()):
        raise _not_empty(dst)
