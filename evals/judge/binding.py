"""A verdict bound to its artifacts: the two runs are two, the released checkpoint is the one the
candidate run evaluated, and the report says what judged them.

A checkpoint's identity is the sha256 of its ``conversion_manifest.json`` (``run.checkpoint_manifest_sha256``:
the manifest holds every output shard's sha256); ``evals run`` records it in run.json under
``checkpoint_manifest_sha256`` (a local ``--model DIR``, or ``--checkpoint DIR`` for a served one).
Every refusal here is one line naming what differs and what to do (exit 2).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from evals.errors import BadInput, Refused
from quant.hashing import sha256_of

KEY = "checkpoint_manifest_sha256"
UNVERIFIED_FLAG = "--unverified-checkpoint"


def distinct_arms(candidate: Path, reference: Path, cand_run: dict, ref_run: dict) -> None:
    """Refuse a candidate and reference that are one run (the same folder, or a copy of it)
    or that evaluated the same checkpoint: a comparison with itself passes whatever the model is."""
    candidate, reference = Path(candidate), Path(reference)
    if candidate.resolve() == reference.resolve():
        raise Refused(f"--candidate and --reference are the same run ({candidate}): compare two runs, "
                      "the candidate's and the reference's")
    if all(sha256_of(candidate / name) == sha256_of(reference / name) for name in ("run.json", "samples.jsonl")):
        raise Refused(f"--candidate {candidate} and --reference {reference} are copies of one run (identical "
                      "run.json and samples.jsonl): compare two runs, the candidate's and the reference's")
    cand_sha, ref_sha = cand_run.get(KEY), ref_run.get(KEY)
    if cand_sha and cand_sha == ref_sha:
        raise Refused(f"--candidate {candidate} and --reference {reference} evaluated the same checkpoint "
                      f"({KEY} {cand_sha}): the reference must be another checkpoint (e.g. the FP8 one)")


def bind_checkpoint(checkpoint: Path, candidate: Path, cand_run: dict, unverified: bool = False) -> dict:
    """``{"sha256", "verified"}`` of the released checkpoint, refusing one the candidate run did not
    evaluate. A run without a recorded checkpoint (against a server, without ``--checkpoint``) or a
    checkpoint without a manifest is refused too, unless ``unverified``; the report then says so."""
    from evals.run import checkpoint_manifest_sha256

    actual, recorded = checkpoint_manifest_sha256(checkpoint), cand_run.get(KEY)
    if actual and recorded and actual != recorded:
        raise Refused(f"{checkpoint} is not the checkpoint {candidate} evaluated: its conversion_manifest.json "
                      f"has sha256 {actual}, {candidate}/run.json records {KEY} {recorded}; release the "
                      "checkpoint that run evaluated, or evaluate this one")
    if actual and recorded:
        return {"sha256": actual, "verified": True}
    if not unverified:
        if not recorded and actual:
            raise Refused(f"{candidate}/run.json records no {KEY} (a run against a server), so nothing shows it "
                          f"evaluated {checkpoint}: rerun it with `evals run --checkpoint {checkpoint} ...`, or pass "
                          f"{UNVERIFIED_FLAG}")
        if not recorded:
            raise Refused(f"{checkpoint} has no conversion_manifest.json and {candidate}/run.json records no {KEY}: "
                          "nothing shows the run evaluated this checkpoint; release a quantgate conversion evaluated "
                          f"with `evals run --model DIR` (or `--checkpoint DIR` against a server), or pass "
                          f"{UNVERIFIED_FLAG}")
        raise Refused(f"{checkpoint} has no conversion_manifest.json, so it cannot be the checkpoint {candidate} "
                      f"evaluated ({KEY} {recorded}); release that checkpoint, or pass {UNVERIFIED_FLAG}")
    return {"sha256": actual, "verified": False}


def provenance(checkpoint: Path, binding: dict, ref_run: dict, policy_source: str | None,
               margins: dict[str, float] | None = None) -> dict:
    """What judged the release and what it judged: policy (path, sha256, --margin overrides), tool
    version, date (UTC), the checkpoint's recipe and both arms' checkpoint hashes."""
    import quant
    from quant.safe_files import read_json

    manifest = Path(checkpoint) / "conversion_manifest.json"
    recipe = None
    if manifest.is_file():
        recipe = (read_json(manifest, BadInput) or {}).get("recipe")
    return {
        "policy": {"path": policy_source, "sha256": sha256_of(Path(policy_source)) if policy_source else None,
                   "margin_overrides": margins or {}},
        "tool": {"name": "quantgate", "version": quant.__version__},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "recipe": recipe.get("name") if isinstance(recipe, dict) else recipe,
        "candidate_checkpoint_sha256": binding["sha256"],
        "checkpoint_verified": binding["verified"],
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
    cand = ((f"sha256 {sha}" if sha else "no conversion_manifest.json")
            + ("" if prov["checkpoint_verified"] else f" (UNVERIFIED: released with {UNVERIFIED_FLAG})"))
    return [("policy", f"{pol['path']} (sha256 {pol['sha256']})" + (f", --margin {overrides}" if overrides else "")),
            ("tool", f"{prov['tool']['name']} {prov['tool']['version']}"), ("date", prov["date"]),
            ("recipe", prov["recipe"] or "-"),
            ("candidate checkpoint", cand),
            ("reference checkpoint", f"sha256 {ref}" if prov["reference_checkpoint_sha256"] else ref)]
