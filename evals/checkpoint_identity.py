"""Which checkpoint a folder holds: the sha256s of its shards, checked against its conversion manifest.

``conversion_manifest.json`` records every output shard's size and sha256. A checkpoint's identity
(``checkpoint_sha256``) is the sha256 of those shard records with the bytes of ``config.json`` and
the shard index (what an engine reads besides the shards), never of the manifest's own bytes: two
byte-identical conversions of one source (manifests that differ only in timings) are one
checkpoint, and a manifest copied in beside other shards names the shards it describes, not the
folder's. ``evals run`` records the identity in run.json; ``gate release`` compares it.

Everything is taken only as a regular file inside the folder (a symbolic link is refused: it may
point anywhere, e.g. at another checkpoint's manifest), and every shard is hashed, streamed in
fixed-size blocks, against the manifest; ``verify=False`` checks only the shards' names and sizes
and says so (``Identity.verified``). Any mismatch is one line naming the file (exit 2).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from evals.errors import BadInput
from quant.hashing import sha256_fileobj, sha256_of
from quant.ladder import manifest_line
from quant.outputs import INDEX_NAME, MANIFEST_NAME
from quant.safe_files import open_regular_fd, parse_json, read_regular

KEY = "checkpoint_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Identity:
    sha256: str  # the checkpoint's identity
    verified: bool  # every shard hashed and equal to the manifest's record (else: names and sizes only)
    shards: int
    nbytes: int
    recipe: str | None  # the recipe's name, as the manifest records it
    ladder: str | None = None  # the precision ladder's choice (quant.ladder.describe), where it chose the recipe


def _regular(path: Path, what: str) -> os.stat_result:
    """``path``'s status if it is a regular file in its folder, not a link to one elsewhere."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: missing, but {what}; the checkpoint is incomplete: copy the whole folder "
                       "`quantize` wrote") from None
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{path}: a symbolic link; {what}, and a checkpoint is identified only by the files inside "
                       "its folder: put the file itself there (or release the folder `quantize` wrote)")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: not a regular file; {what}: put the file itself there")
    return st


def _shard_records(manifest_path: Path, manifest) -> list[tuple[str, int, str]]:
    """(file, size, sha256) of every shard, each a plain file name in the folder."""
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    bad = f"{manifest_path}: not a manifest `quantize` wrote ({{}}); release the folder `quantize` wrote, or reconvert"
    if not isinstance(shards, list) or not shards:
        raise BadInput(bad.format("no list of shards"))
    records, seen = [], set()
    for i, r in enumerate(shards):
        name = r.get("file") if isinstance(r, dict) else None
        size = r.get("size") if isinstance(r, dict) else None
        digest = r.get("sha256") if isinstance(r, dict) else None
        if not (isinstance(name, str) and name.endswith(".safetensors") and name == Path(name).name
                and name not in ("", ".", "..") and "\x00" not in name and name not in seen):
            raise BadInput(bad.format(f"shards[{i}].file {name!r} is not a new .safetensors file name in the folder"))
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0
                and isinstance(digest, str) and _HEX64.fullmatch(digest)):
            raise BadInput(bad.format(f"shards[{i}] ({name}) has no size and sha256"))
        seen.add(name)
        records.append((name, size, digest))
    return records


def _hash_shard(path: Path, bar) -> str:
    fd = open_regular_fd(path, BadInput, follow=False)  # checked on the descriptor that is read
    with os.fdopen(fd, "rb") as f:
        return sha256_fileobj(f, on_block=bar.update)


def identity(folder: Path, verify: bool = True) -> Identity | None:
    """The identity of the checkpoint in ``folder``, or None for a folder without a conversion
    manifest. Refused (``BadInput``, one line) if a file is a link or not regular, the manifest is
    malformed, a shard is missing, unlisted or of another size, or (``verify``) another sha256."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        return None
    what = "the manifest of the checkpoint must be a regular file inside its folder"
    _regular(manifest_path, what)
    manifest = parse_json(read_regular(manifest_path, error=BadInput, follow=False), str(manifest_path), BadInput,
                          "release the folder `quantize` wrote, or reconvert")
    records = _shard_records(manifest_path, manifest)
    listed = {name for name, _, _ in records}
    unlisted = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in listed)
    if unlisted:  # an engine may load it: a checkpoint holds what its manifest lists, nothing more
        raise BadInput(f"{folder / unlisted[0]}: a shard {manifest_path} does not list; this folder is not the "
                       "checkpoint `quantize` wrote: remove it, or release the folder `quantize` wrote")
    for name, size, _ in records:
        actual = _regular(folder / name, f"{MANIFEST_NAME} lists it as a shard").st_size
        if actual != size:
            raise BadInput(f"{folder / name}: {actual} bytes, but {manifest_path} records {size}: the shard changed "
                           "after `quantize` wrote it; this is not that checkpoint: reconvert, or release the folder "
                           "`quantize` wrote")
    nbytes = sum(size for _, size, _ in records)
    if verify:
        with tqdm(total=nbytes, unit="B", unit_scale=True, desc="verify shards", disable=None) as bar:
            for name, _, digest in records:
                actual = _hash_shard(folder / name, bar)
                if actual != digest:
                    raise BadInput(f"{folder / name}: sha256 {actual}, but {manifest_path} records {digest}: the "
                                   "shard changed after `quantize` wrote it (or the manifest was copied from another "
                                   "conversion); this is not that checkpoint: reconvert, or release the folder "
                                   "`quantize` wrote")
    extras = {}
    for name in ("config.json", INDEX_NAME):  # what an engine reads besides the shards
        if os.path.lexists(folder / name):
            _regular(folder / name, "the checkpoint's files must be regular files inside its folder")
            extras[name] = sha256_of(read_regular(folder / name, error=BadInput, follow=False))
    digest = sha256_of({"shards": sorted([name, size, sha] for name, size, sha in records), "files": extras})
    recipe = manifest.get("recipe")
    recipe = recipe.get("name") if isinstance(recipe, dict) else recipe
    return Identity(digest, verify, len(records), nbytes, recipe if isinstance(recipe, str) else None,
                    manifest_line(manifest))


__all__ = ["KEY", "Identity", "identity"]
