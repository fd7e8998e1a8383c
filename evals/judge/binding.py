"""A verdict bound to its artifacts: the two runs are two, the released checkpoint is the one the
candidate run evaluated, and the report says what judged them.

A checkpoint is identified by its shards (``evals.checkpoint_identity``: their sha256s as its
conversion manifest records them, each shard hashed against that record, with config.json and the
index); ``evals run`` records the identity in run.json under ``checkpoint_sha256`` (a local
``--model DIR``, or ``--checkpoint DIR`` for a served one). Every refusal here is one line naming
what differs and what to do (exit 2).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from evals.checkpoint_identity import KEY, identity
from evals.errors import Refused
from quant.hashing import sha256_of

LEGACY_KEY = "checkpoint_manifest_sha256"  # what runs recorded before: the manifest's own sha256
UNVERIFIED_FLAG = "--unverified-checkpoint"
FAST_FLAG = "--fast"


def distinct_arms(candidate: Path, reference: Path, cand_run: dict, ref_run: dict) -> None:
    """Refuse a candidate and reference that are one run (the same folder, or a copy of it)
    or that evaluated the same checkpoint (the same shards, whatever folder or conversion they
    came from): a comparison with itself passes whatever the model is."""
    candidate, reference = Path(candidate), Path(reference)
    if candidate.resolve() == reference.resolve():
        raise Refused(f"--candidate and --reference are the same run ({candidate}): compare two runs, "
                      "the candidate's and the reference's")
    if all(sha256_of(candidate / name) == sha256_of(reference / name) for name in ("run.json", "samples.jsonl")):
        raise Refused(f"--candidate {candidate} and --reference {reference} are copies of one run (identical "
                      "run.json and samples.jsonl): compare two runs, the candidate's and the reference's")
    for key in (KEY, LEGACY_KEY):  # runs recorded before checkpoints were identified by their shards: one manifest
        cand_sha, ref_sha = cand_run.get(key), ref_run.get(key)
        if cand_sha and cand_sha == ref_sha:
            raise Refused(f"--candidate {candidate} and --reference {reference} evaluated the same checkpoint "
                          f"({key} {cand_sha}: the same shards, e.g. two conversions of one source with one recipe): "
                          "the reference must be another checkpoint (e.g. the FP8 one)")


def bind_checkpoint(checkpoint: Path, candidate: Path, cand_run: dict, unverified: bool = False,
                    fast: bool = False) -> dict:
    """``{"sha256", "verified", "shards_verified", "recipe"}`` of the released checkpoint, refusing one
    the candidate run did not evaluate or whose shards are not those its manifest records (``fast``:
    their sizes only, and the report says so). A run without a recorded checkpoint (against a server,
    without ``--checkpoint``) or a checkpoint without a manifest is refused too, unless
    ``unverified``; the report then says so."""
    ident, recorded = identity(checkpoint, verify=not fast), cand_run.get(KEY)
    actual = ident.sha256 if ident else None
    if actual and recorded and actual != recorded:
        raise Refused(f"{checkpoint} is not the checkpoint {candidate} evaluated: its shards give {KEY} {actual}, "
                      f"{candidate}/run.json records {recorded}; release the checkpoint that run evaluated, or "
                      "evaluate this one")
    bound = {"sha256": actual, "verified": bool(actual and recorded), "shards_verified": bool(ident and ident.verified),
             "shards": ident.shards if ident else 0, "recipe": ident.recipe if ident else None,
             "ladder": ident.ladder if ident else None}
    if actual and recorded:
        return bound
    if not unverified:
        if not recorded and actual:
            raise Refused(f"{candidate}/run.json records no {KEY} (a run against a server, or by a quantgate before "
                          f"checkpoints were identified by their shards), so nothing shows it evaluated {checkpoint}: "
                          f"rerun it with `evals run --checkpoint {checkpoint} ...`, or pass {UNVERIFIED_FLAG}")
        if not recorded:
            raise Refused(f"{checkpoint} has no conversion_manifest.json and {candidate}/run.json records no {KEY}: "
                          "nothing shows the run evaluated this checkpoint; release a quantgate conversion evaluated "
                          f"with `evals run --model DIR` (or `--checkpoint DIR` against a server), or pass "
                          f"{UNVERIFIED_FLAG}")
        raise Refused(f"{checkpoint} has no conversion_manifest.json, so it cannot be the checkpoint {candidate} "
                      f"evaluated ({KEY} {recorded}); release that checkpoint, or pass {UNVERIFIED_FLAG}")
    return bound


def provenance(binding: dict, ref_run: dict, policy_source: str | None,
               margins: dict[str, float] | None = None) -> dict:
    """What judged the release and what it judged: policy (path, sha256, --margin overrides), tool
    version, date (UTC), the checkpoint's recipe and both arms' checkpoint identities."""
    import quant

    return {
        "policy": {"path": policy_source, "sha256": sha256_of(Path(policy_source)) if policy_source else None,
                   "margin_overrides": margins or {}},
        "tool": {"name": "quantgate", "version": quant.__version__},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "recipe": binding["recipe"],
        "ladder": binding.get("ladder"),  # the precision ladder's choice and measurements, where it chose the recipe
        "candidate_checkpoint_sha256": binding["sha256"],
        "checkpoint_verified": binding["verified"],
        "shards_verified": binding["shards_verified"],
        "shards": binding["shards"],
        "reference_checkpoint_sha256": ref_run.get(KEY),
    }


def lines(prov: dict | None) -> list[tuple[str, str]]:
    """``(label, text)`` pairs as report.md, the page and the CLI print them (none for a report without)."""
    if not prov:
        return []
    pol = prov["policy"]
    overrides = ", ".join(f"{b}={m:g}" for b, m in pol["margin_overrides"].items())
    ref = prov["reference_checkpoint_sha256"] or "not recorded (a run without a conversion manifest, e.g. bf16 or a server)"
    sha = prov["candidate_checkpoint_sha256"]
    cand = f"sha256 {sha}" if sha else "no conversion_manifest.json"
    if sha and "shards_verified" in prov:  # (a report written before shards were hashed says nothing)
        cand += (f" ({prov['shards']} shards hashed, each the sha256 its conversion_manifest.json records)"
                 if prov["shards_verified"] else
                 f" (shards NOT verified: released with {FAST_FLAG}, only their names and sizes were checked)")
    if not prov["checkpoint_verified"]:
        cand += f" (UNVERIFIED: released with {UNVERIFIED_FLAG})"
    return [("policy", f"{pol['path']} (sha256 {pol['sha256']})" + (f", --margin {overrides}" if overrides else "")),
            ("tool", f"{prov['tool']['name']} {prov['tool']['version']}"), ("date", prov["date"]),
            ("recipe", prov["recipe"] or "-"),
            *([("ladder", prov["ladder"])] if prov.get("ladder") else []),
            ("candidate checkpoint", cand),
            ("reference checkpoint", f"sha256 {ref}" if prov["reference_checkpoint_sha256"] else ref)]
