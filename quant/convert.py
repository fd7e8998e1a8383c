"""Executes a plan: shards in parallel worker processes, atomic outputs, resumable, then metadata.

Order of appearance in DST, each file under its final name only once complete: auxiliary files,
shards (each written as ``<name>.partial`` and renamed; ``.quantgate-progress.json`` records each
finished one with its size and sha256), the index, ``config.json``, and last the conversion
manifest. A folder without ``conversion_manifest.json`` is unfinished; ``--resume`` completes it,
re-checking every shard it keeps against the recorded size and hash, and its source against the
recorded identity (or, on any doubt, sha256). One run at a time holds DST (``DestinationLock``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

import quant
from quant.outputs import (INDEX_NAME, MANIFEST_NAME, PROGRESS_NAME, DestinationLock, check_overlap, copy_atomic,
                           create_destination, output_mode, prepare_destination, write_atomic)
from quant.plan import Plan
from quant.hashing import sha256_file, sha256_of
from quant.safe_files import read_json, refuse_link
from quant.safetensors_io import PARTIAL_SUFFIX
from quant.errors import ConvertError, DiskFullError, NonFiniteError
from quant.formats.numba_threads import size_pool
from quant.shard import ShardJob, convert_shard, file_identity

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
log = logging.getLogger(__name__)
# A worker process starts in about 1 s of CPU (interpreter, numpy, loading numba's kernel; 0.8 s
# wall measured here), what converting ~1 GB takes: one per 4 GB keeps start-up under a quarter.
MIN_BYTES_PER_WORKER = 4 << 30


__all__ = ["ConvertError", "DiskFullError", "NonFiniteError", "MANIFEST_NAME", "PROGRESS_NAME", "convert",
           "sha256_file"]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(nbytes: int) -> int:
    """One worker process per two cores: a shard keeps two busy, one hashing its source (sha256
    is sequential) and one running the kernel, writing and hashing the output; never more than
    the work pays for."""
    return max(1, min(usable_cores() // 2, -(-nbytes // MIN_BYTES_PER_WORKER)))


def plan_fingerprint(plan: Plan) -> str:
    """What must not change between a run and its --resume: the shard files, recipe, exclude, tool
    version. Not each source's size: a kept shard's source is proven unchanged on its own
    (``_source_unchanged``), and one that changed (a shard restored or re-downloaded after a run
    stopped on it) is converted again."""
    key = {"version": quant.__version__, "to": plan.to, "codec": plan.codec.name,
           "recipe": plan.recipe.to_dict() if plan.recipe else None, "exclude": list(plan.exclude),
           "shards": [s.file for s in plan.shards]}
    return sha256_of(key)


def _read_progress(dst: Path) -> dict:
    path = dst / PROGRESS_NAME
    try:
        state = read_json(path, ConvertError, "start over with --overwrite", follow=False)
    except FileNotFoundError:
        state = None
    records = state.get("shards") if isinstance(state, dict) else None
    sources = state.get("sources") if isinstance(state, dict) else None
    valid = isinstance(records, dict) and isinstance(sources, dict) and all(
        isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
        and isinstance(r.get("source_sha256"), str) and isinstance(sources.get(name), dict)
        for name, r in records.items())
    if not valid:
        raise ConvertError(f"--resume: {path} is missing, unreadable or incomplete (written by another version?); "
                           "start over with --overwrite")
    return state


RACY_NS = 2_000_000_000  # a file modified this close to its reading may change again within one mtime tick


def _source_unchanged(source: Path, record: dict, identity: dict) -> bool:
    """The source shard is the one converted: the same size, mtime, inode and device, or, on any
    doubt (one differs, or the file was modified just before it was read), the same sha256."""
    try:
        current = file_identity(source.stat())
        if all(identity.get(k) == v for k, v in current.items()) \
                and max(current["mtime_ns"], current["ctime_ns"]) < identity.get("opened_ns", 0) - RACY_NS:
            return True
        return sha256_file(source) == record["source_sha256"]
    except OSError:
        return False


def _load_resumable(plan: Plan, dst: Path, show_progress: bool) -> tuple[dict[str, dict], dict[str, dict]]:
    """Finished shards whose output is intact and whose source is unchanged, with their source
    identities; anything else there is removed to be redone."""
    if (dst / MANIFEST_NAME).exists():
        raise ConvertError(f"--resume: {dst} is already a finished conversion ({MANIFEST_NAME} is there)")
    for path in dst.iterdir():  # what a run writes is never a link: one there would be written through
        refuse_link(path)
    state = _read_progress(dst)
    if state.get("fingerprint") != plan_fingerprint(plan):
        raise ConvertError(f"--resume: {dst} was started with other sources, recipe or quantgate version; "
                           "start over with --overwrite (or resume with the original options)")
    kept: dict[str, dict] = {}
    records, sources = state["shards"], state["sources"]
    for name in tqdm(sorted(records), desc="verify", unit="shard", disable=not show_progress):
        record, path = records[name], dst / name
        if not (path.is_file() and not path.is_symlink() and path.stat().st_size == record["size"]
                and sha256_file(path) == record["sha256"]):
            continue
        if not _source_unchanged(plan.source_dir / name, record, sources[name]):
            log.warning("%s: the source changed since it was converted; converting it again", plan.source_dir / name)
            continue
        kept[name] = record
    for path in dst.iterdir():  # stale partials and shards that failed verification
        if path.name.endswith(PARTIAL_SUFFIX) or (path.suffix == ".safetensors" and path.name not in kept):
            path.unlink()
    return kept, {name: sources[name] for name in kept}


def _private_mode(plan: Plan) -> int:
    """The permissions of what no single source file gives its own (index, manifest, progress):
    no wider than any of config.json, the index and the shards (``outputs.output_mode``)."""
    names = ["config.json", *([INDEX_NAME] if (plan.source_dir / INDEX_NAME).exists() else []),
             *(s.file for s in plan.shards)]
    return output_mode(*(os.stat(plan.source_dir / name).st_mode for name in names))


def _check_space(dst: Path, needed: int) -> None:
    free = shutil.disk_usage(dst).free
    if needed > free:
        raise DiskFullError(f"{dst}: needs {needed / 1e9:.2f} GB more but only {free / 1e9:.2f} GB are free; "
                            "free space (then --resume if a run was started)")


_progress_counter = None


def _die_with_parent(parent_pid: int) -> None:
    """A worker must not outlive a parent killed by kill -9: the kernel sends it SIGKILL then
    (Linux ``PR_SET_PDEATHSIG``; the pool starts workers from the main thread, which lives as long
    as the parent process)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


_converting = False  # a worker is inside convert_shard
_interrupted = False  # Ctrl-C came while converting: stop at the next chunk


def _interrupt_if_converting(signum, frame) -> None:
    """Ctrl-C reaches the whole process group. A worker converting a shard stops at its next chunk
    (``_check_interrupt``; its partial file is removed, the parent reports once); an idle one ignores
    it, as the parent shuts the pool down: without this, each idle worker printed a KeyboardInterrupt
    traceback. Not raised where the signal lands: a KeyboardInterrupt inside a queue's or a lock's
    internals (the ShardWriter's hand-off to its helper threads) lost a wake-up, and the worker hung
    joining its writer thread."""
    global _interrupted
    if _converting:
        _interrupted = True


def _check_interrupt() -> None:
    if _interrupted:
        raise KeyboardInterrupt


def _init_worker(threads: int, counter, parent_pid: int) -> None:
    global _progress_counter
    signal.signal(signal.SIGINT, _interrupt_if_converting)
    _die_with_parent(parent_pid)
    _progress_counter = counter
    size_pool(threads)  # numba is loaded already: unpickling this initializer imported it


def _advance_shared(nbytes: int) -> None:
    _check_interrupt()
    with _progress_counter.get_lock():
        _progress_counter.value += nbytes


def _run_in_worker(job: ShardJob) -> dict:
    global _converting
    _converting = True
    try:
        return convert_shard(job, _advance_shared)
    finally:
        _converting = False


@contextlib.contextmanager
def _deferred_sigint():
    """In this process (``--workers 1``), Ctrl-C while converting stops at the next chunk, for the
    same reason as in a worker; the previous handler is back afterwards."""
    global _converting, _interrupted
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to defer
        return
    previous = signal.signal(signal.SIGINT, _interrupt_if_converting)
    _converting, _interrupted = True, False
    try:
        yield
    finally:
        _converting = False
        signal.signal(signal.SIGINT, previous)


def _run_jobs(jobs: list[ShardJob], workers: int, progress: tqdm, on_done) -> None:
    """Convert shards, calling ``on_done(record)`` as each finishes (also when another one fails)."""
    if workers <= 1:
        def advance(nbytes: int) -> None:
            _check_interrupt()
            progress.update(nbytes)

        with _deferred_sigint():
            for job in jobs:
                progress.set_postfix_str(job.shard.file)
                on_done(convert_shard(job, advance))
                _check_interrupt()  # Ctrl-C between two shards: the finished ones are kept
        return
    context = multiprocessing.get_context("spawn")  # no fork after numba's or torch's threads started
    counter = context.Value("q", 0)
    threads = jobs[0].kernel_threads or 1  # the plan's per-worker kernel threads: numba's pool needs no more
    pool = cf.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                initargs=(threads, counter, os.getpid()))
    pending = {pool.submit(_run_in_worker, job) for job in jobs}
    failure: BaseException | None = None
    try:
        while pending:
            done, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            progress.update(counter.value - progress.n)
            for future in done:
                if future.exception() is None:
                    on_done(future.result())
                elif failure is None:
                    failure = future.exception()
                    for other in pending:
                        other.cancel()
    except BaseException as exc:  # Ctrl-C: workers abort their partial files; keep what finished
        failure = exc
        for other in pending:
            other.cancel()
        for future in cf.as_completed(pending):
            if not future.cancelled() and future.exception() is None:
                on_done(future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if failure is not None:
        raise failure


def convert(plan: Plan, dst: Path, *, overwrite: bool = False, resume: bool = False, workers: int | None = None,
            device: str = "cpu", show_progress: bool = True, command: list[str] | None = None,
            strict: bool = False, ladder: dict | None = None) -> dict:
    """Run the whole plan into ``dst``; returns the conversion manifest (also written there); ``ladder``: the
    precision ladder's record of how it chose the plan's recipe (``quant.ladder.record``), kept in the manifest.

    ``dst`` is locked for the whole run: a second writer is refused, naming this one's pid."""
    dst = Path(dst)
    check_overlap(plan.source_dir, dst)
    resuming = resume and dst.exists()
    try:
        create_destination(dst)
        with DestinationLock(dst):
            if resuming:
                done, sources = _load_resumable(plan, dst, show_progress)
            else:
                prepare_destination(dst, overwrite)
                done, sources = {}, {}
            return _run(plan, dst, done, sources, workers, device, show_progress, command, strict, ladder)
    except OSError as exc:  # before the first shard (the run itself reports what it kept)
        if exc.errno in _DISK_ERRNOS:
            raise DiskFullError(f"disk full writing into {dst}: {exc.strerror}; free space and rerun "
                                f"({'--resume' if resuming else 'nothing was converted yet'})") from exc
        raise


def _run(plan: Plan, dst: Path, done: dict[str, dict], sources: dict[str, dict], workers: int | None, device: str,
         show_progress: bool, command: list[str] | None, strict: bool, ladder: dict | None = None) -> dict:
    todo = [s for s in plan.shards if s.file not in done]
    _check_space(dst, sum(s.output_size for s in todo))
    started = time.time()
    fingerprint = plan_fingerprint(plan)
    private = _private_mode(plan)

    def save_progress() -> None:
        state = {"fingerprint": fingerprint, "shards": done, "sources": sources}
        write_atomic(dst / PROGRESS_NAME, json.dumps(state).encode(), private)

    stage_seconds: dict[str, float] = {}  # summed over the shards converted now; not part of a shard's record

    def record(result: dict) -> None:
        file = result["file"]
        for stage, seconds in result.pop("seconds").items():
            stage_seconds[stage] = round(stage_seconds.get(stage, 0.0) + seconds, 4)
        for tensor, where in result["kept_non_finite"].items():
            log.warning("%s: NaN/Inf at %s in a tensor kept as it is (copied unchanged; --strict refuses it)",
                        tensor, where)
        sources[file], done[file] = result.pop("source_identity"), result
        try:
            save_progress()
        except BaseException:  # not recorded, so not kept: --resume redoes it
            del sources[file], done[file]
            raise

    todo_bytes = sum(s.source_size for s in todo)
    workers = 1 if device != "cpu" else max(1, min(workers or default_workers(todo_bytes), len(todo)))
    kernel_threads = max(1, usable_cores() // workers - 1)  # each worker's other core hashes its source
    jobs = [ShardJob(plan.source_dir, dst, s, plan.codec, plan.recipe and plan.recipe.scale_rule, device, strict,
                     kernel_threads) for s in todo]
    try:
        save_progress()
        for name in plan.aux_files:
            copy_atomic(plan.source_dir / name, dst / name)
        with tqdm(total=todo_bytes, unit="B", unit_scale=True, desc="decode" if plan.decodes else "quantize",
                  disable=not show_progress) as bar:
            _run_jobs(jobs, workers, bar, record)
            bar.update(bar.total - bar.n)  # the kernels report tensor bytes; headers and padding finish the bar
        elapsed = time.time() - started
        records = [done[s.file] for s in plan.shards]
        index = {"metadata": {"total_size": sum(r["size"] for r in records)}, "weight_map": plan.weight_map()}
        write_atomic(dst / INDEX_NAME, json.dumps(index, indent=2).encode(), private)
        write_atomic(dst / "config.json", json.dumps(plan.output_config(), indent=2).encode(),
                     output_mode(os.stat(plan.source_dir / "config.json").st_mode))
        manifest = {
            "tool": "quantgate",
            "version": quant.__version__,
            "command": command,
            "created_unix": int(started),
            "seconds": round(elapsed, 3),
            "resumed_shards": len(plan.shards) - len(todo),
            "source": str(plan.source_dir.resolve()),
            "family": plan.family.name if plan.family else None,
            "recipe": plan.recipe.to_dict() if plan.recipe else None,
            **({"ladder": ladder} if ladder else {}),
            "format": plan.to,
            # a mixed recipe: the rung of every (layer, role), bytes per rung, static scales and their calibration
            **({"mixed": plan.rung_record()} if not plan.decodes and plan.mixed else {}),
            "decoded_from": plan.codec.name if plan.decodes else None,
            "exclude_count": len(plan.exclude),
            "shards": records,
            "summary": {
                "tensors_quantized": sum(len(r["quantized"]) for r in records),
                "tensors_decoded": sum(len(r["decoded"]) for r in records),
                "bytes_in": sum(r["source_size"] for r in records),
                "bytes_out": sum(r["size"] for r in records),
                "gb_per_s": round(todo_bytes / 1e9 / elapsed, 4) if elapsed else None,
                "workers": workers,
                "device": device,
                "stage_seconds": stage_seconds,
            },
            "warnings": list(plan.warnings) + [f"{tensor}: NaN/Inf at {where}, kept as it is" for r in records
                                               for tensor, where in r["kept_non_finite"].items()],
        }
        write_atomic(dst / MANIFEST_NAME, json.dumps(manifest, indent=2).encode(), private)
    except BaseException as exc:
        for partial in dst.glob("*" + PARTIAL_SUFFIX):  # every worker has stopped by now
            partial.unlink()
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            where = f" ({Path(exc.filename).name.removesuffix(PARTIAL_SUFFIX)})" if exc.filename else ""
            raise DiskFullError(f"disk full writing into {dst}{where}: {exc.strerror}; {len(done)} of "
                                f"{len(plan.shards)} shards are finished and kept; free space and rerun with "
                                "--resume") from exc
        raise
    (dst / PROGRESS_NAME).unlink()
    return manifest
