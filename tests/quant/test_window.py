"""The release window kept mechanically (``quant.engines.window``): every lock matches its rule file, a carried
release is proven from the wheels, a changed function makes a release "needs reading", a stale lock and a cite
naming nothing are refused.

The wheel-backed tests recompute a sample each run (printed): one rule file's lock (a different one each day) in
its read releases and two carried ones, and three carried releases against the releases they are carried from;
``QUANTGATE_WINDOW=all`` recomputes every lock in every release of the window and every carried release."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from quant.engines import rules, window
from tests.quant.engine_sources import window_sample

REPO = Path(__file__).resolve().parents[2]


def test_every_lock_matches_its_rule_file():
    """A rule file whose cites or spans changed, or a window grown by a release, needs its lock rewritten."""
    stale = window.stale_locks()
    assert not stale, "\n".join(stale)


def _carried() -> list[tuple[str, str, str]]:
    """(rule file, release, the read release it is carried from) for every carried release of every family."""
    from quant.layout import known_families
    found = {}
    for family in known_families():
        for engine in family.engine_class:
            name = rules.rules_file(engine, family)
            for state in rules.release_states(engine, family).values():
                if state.state == "carried":
                    found[name, state.release] = state.follows
    return [(name, release, follows) for (name, release), follows in sorted(found.items())]


def _lock_keys(name: str, follows: str) -> list[str]:
    lock = rules._lock(name)
    rule_set = next(s for s in lock["sets"] if rules.Version(s[0]) <= rules.Version(
        rules.releases_read(name.split(".")[0], _family_of(name))[follows]) <= rules.Version(s[1]))
    return sorted({k for keys in lock["sets"][rule_set].values() for k in keys})


def _family_of(name: str) -> str:
    from quant.layout import known_families
    engine = name.split(".")[0]
    return next(f.name for f in known_families() if engine in f.engine_class and rules.rules_file(engine, f) == name)


def test_carried_releases_are_proven_from_the_wheels():
    """A carried release's cited symbols hash as its read release's, recomputed from both wheels (not the lock)."""
    carried = _carried()
    if not carried:
        pytest.skip("no release is carried over today")
    sample = carried if os.environ.get("QUANTGATE_WINDOW") == "all" else \
        [carried[i] for i in sorted({(len(carried) * k) // 3 for k in range(3)})]
    print("carried releases recomputed:", ", ".join(f"{n} {r} (from {f})" for n, r, f in sample))
    wheels = window.Wheels()
    for name, release, follows in sample:
        engine = name.split(".")[0]
        keys = _lock_keys(name, follows)
        try:
            mine, theirs = (window.release_hashes(wheels(engine, r), keys) for r in (release, follows))
        except rules.RuleFileError as exc:
            pytest.skip(str(exc))
        assert mine == theirs, f"{name} {release}: cited source differs from {follows}"
        lock = rules._lock(name)
        assert mine == {k: lock["hashes"][k][release] for k in keys}, f"{name} {release}: the lock is not the wheel's"


def test_a_sampled_release_hashes_as_its_lock_says():
    """Every symbol of one rule file's lock, recomputed in its read releases and a sample of its carried ones."""
    names = window.rule_file_names()
    everything = os.environ.get("QUANTGATE_WINDOW") == "all"  # every lock, every release of the window
    if not everything:
        names = [names[datetime.date.today().toordinal() % len(names)]]  # a different rule file each day
    print("locks recomputed:", ", ".join(str(window.lock_path(n)) for n in names))
    wheels = window.Wheels()
    for name in names:
        engine = name.split(".")[0]
        lock = rules._lock(name)
        keys = sorted(lock["hashes"])
        for release in rules.window(engine) if everything else window_sample(engine, _family_of(name)):
            try:
                whl = wheels(engine, release)
            except rules.RuleFileError as exc:
                pytest.skip(str(exc))
            assert window.release_hashes(whl, keys) == {k: lock["hashes"][k][release] for k in keys}, (name, release)


# --- a window of three small wheel-like zips: one unchanged but for comments, one with a cited function changed ---

MIXTRAL = "sglang/srt/models/mixtral.py"


@pytest.fixture(scope="module")
def small_window(tmp_path_factory):
    """A copy of the manifests whose sglang window is 0.5.21..0.5.23 and whose Mixtral rules were read in 0.5.21
    only, beside three zips holding the files those rules cite, taken from the real 0.5.21 wheel: 0.5.22 with
    MixtralMoE.__init__ changed, 0.5.23 with only comments and docstrings changed."""
    root = tmp_path_factory.mktemp("window")
    shutil.copytree(REPO / "manifests", root / "manifests")
    releases = root / "manifests" / "engines" / "releases.yaml"
    data = yaml.safe_load(releases.read_text())
    releases.write_text(yaml.safe_dump({"sglang": ["0.5.21", "0.5.22", "0.5.23"], "vllm": data["vllm"]}))
    family = root / "manifests" / "families" / "mixtral" / "sglang.yaml"
    rule_file = yaml.safe_load(family.read_text())
    rule_file["checked"] = ["0.5.21"]
    rule_file.pop("post_releases", None)
    merged: dict = {}  # the rules 0.5.21 replays: every set up to it, each overriding the one before
    for entry in rule_file["rule_sets"]:
        if Version(str(entry["versions"][0])) <= Version("0.5.21"):
            merged.update(entry["rules"] or {})
    rule_file["rule_sets"] = [{"versions": ["0.5.21", "0.5.21"], "rules": merged}]
    family.write_text(yaml.safe_dump(rule_file, sort_keys=False, width=10_000))
    try:
        real = window.wheel("sglang", "0.5.21")
    except rules.RuleFileError as exc:
        pytest.skip(str(exc))
    lock = yaml.safe_load((REPO / "manifests" / "families" / "mixtral" / "sglang.lock.yaml").read_text())
    files = {k.rpartition(":")[0] for k in lock["hashes"]} | {MIXTRAL}
    with zipfile.ZipFile(real) as z:
        sources = {f: z.read(f).decode("utf-8-sig") for f in files}
    assert "class MixtralMoE" in sources[MIXTRAL] and "def __init__(" in sources[MIXTRAL]
    moe = sources[MIXTRAL].index("class MixtralMoE(")
    anchor = sources[MIXTRAL].index("        super().__init__()\n", moe)
    changed = sources[MIXTRAL][:anchor] + "        self.changed_in_this_release = True\n" + sources[MIXTRAL][anchor:]
    comments = sources[MIXTRAL].replace("class MixtralMoE(nn.Module):", "class MixtralMoE(nn.Module):  # a comment", 1)
    comments = comments.replace("A tensor-parallel MoE implementation for Mixtral", "A docstring decides nothing", 1)
    assert changed != sources[MIXTRAL] != comments and "A docstring decides nothing" in comments
    for release, mixtral in (("0.5.21", sources[MIXTRAL]), ("0.5.22", changed), ("0.5.23", comments)):
        folder = root / "wheels" / f"sglang-{release}"
        folder.mkdir(parents=True)
        with zipfile.ZipFile(folder / f"sglang-{release}-py3-none-any.whl", "w") as z:
            for path, text in sources.items():
                z.writestr(path, mixtral if path == MIXTRAL else text)
    return root


def run(root: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "QUANTGATE_WHEELS": str(root / "wheels")}
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "quant.engines.window", *args]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)


def _states(root: Path) -> dict[str, dict]:
    done = run(root, "report", "--engine", "sglang", "--family", "mixtral", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    return {s["release"]: s for s in row["releases"]}


def test_a_changed_function_needs_reading_and_comments_carry_over(small_window):
    mixtral_file = "manifests/families/mixtral/sglang.yaml"
    assert run(small_window, "check").returncode == 1  # the copied lock was computed for other spans
    done = run(small_window, "lock", mixtral_file)
    assert done.returncode == 0, done.stderr
    states = _states(small_window)
    assert states["0.5.21"]["state"] == "read"
    assert states["0.5.23"]["state"] == "carried" and states["0.5.23"]["follows"] == "0.5.21"
    assert states["0.5.22"]["state"] == "needs reading" and states["0.5.22"]["follows"] == "0.5.21"
    assert f"router: {MIXTRAL}:MixtralMoE.__init__" in states["0.5.22"]["changed"], states["0.5.22"]["changed"]
    # a carried release is replayed with the rules of the release it is carried from; the other is refused
    done = run(small_window, code="from quant.engines.rules import select, UnknownEngine\n"
               "print(select('sglang==0.5.23', 'mixtral')[0].id)\n"
               "try:\n    select('sglang==0.5.22', 'mixtral')\nexcept UnknownEngine as exc:\n    print(exc)\n")
    assert done.returncode == 0, done.stderr
    carried, refused = done.stdout.splitlines()
    assert carried == "sglang 0.5.23 (rules of 0.5.21)"
    assert refused.startswith("sglang 0.5.22 has not been read for family mixtral") and "since 0.5.21" in refused


def test_a_stale_lock_is_named_with_the_command(small_window):
    family = small_window / "manifests" / "families" / "mixtral" / "sglang.yaml"
    before = family.read_text()
    try:
        family.write_text(before.replace("MixtralAttention.__init__ (qkv_proj", "MixtralAttention.__init__ (a qkv"))
        done = run(small_window, "check")
        assert done.returncode == 1
        assert "mixtral/sglang.lock.yaml: does not match" in done.stdout
        assert "python -m quant.engines.window lock manifests/families/mixtral/sglang.yaml" in done.stdout
        states = _states(small_window)
        assert states["0.5.23"]["state"] == "needs reading" and "no current lock" in states["0.5.23"]["changed"][0]
    finally:
        family.write_text(before)


def test_a_cite_naming_a_missing_function_is_refused(small_window):
    family = small_window / "manifests" / "families" / "mixtral" / "sglang.yaml"
    lock = family.with_name("sglang.lock.yaml")
    before, locked = family.read_text(), lock.read_bytes()
    try:
        family.write_text(before.replace("MixtralAttention.__init__ (qkv_proj", "MixtralAttention.no_such_method (qkv"))
        done = run(small_window, "lock", "manifests/families/mixtral/sglang.yaml")
        assert done.returncode == 2 and done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert "built_fused" in line and "MixtralAttention.no_such_method" in line and "0.5.21" in line
        assert lock.read_bytes() == locked  # nothing written
    finally:
        family.write_text(before)


def test_a_release_off_the_registry_is_refused_in_one_line():
    with pytest.raises(rules.UnknownEngine, match=r"sglang 0\.5\.99 has not been read .*not a registry release"):
        rules.select("sglang==0.5.99", "mixtral")


def test_cite_parsing_reads_paths_names_and_platform_copies():
    groups, mentioned = window.parse_cite(
        "vllm/models/x/nvidia/mtp.py (amd/mtp.py, model_executor/models/y.py): *PredictorLayer.__init__ (eh_proj "
        "= nn.Linear); layers/q/utils.py: is_skipped, _match, _FALLBACK (text), and lm_head in prose; "
        "model_loader/loader.py applies it")
    assert groups[0].written == ("vllm/models/x/nvidia/mtp.py", "amd/mtp.py", "model_executor/models/y.py")
    assert groups[0].required == ("*PredictorLayer.__init__",)
    assert groups[1].written == ("layers/q/utils.py",) and groups[1].required == ("is_skipped", "_match", "_FALLBACK")
    assert "lm_head" in groups[1].optional and "model_loader/loader.py" in mentioned


def test_refresh_names_the_registry_releases_the_window_lacks(small_window):
    releases = small_window / "manifests" / "engines" / "releases.yaml"
    before = releases.read_text()
    try:
        releases.write_text(before.replace("- 0.5.22\n", ""))
        done = run(small_window, "refresh", "--dry-run")
        if done.returncode == 2 and "pip index versions" in done.stderr:
            pytest.skip(done.stderr)
        assert done.returncode == 0, done.stderr
        assert "sglang==0.5.22" in done.stdout.splitlines()
        assert releases.read_text() == before.replace("- 0.5.22\n", "")  # a dry run writes nothing
    finally:
        releases.write_text(before)


def test_an_unknown_family_or_rule_file_is_one_line():
    for args in (["report", "--family", "nope"], ["lock", "nothing.yaml"]):
        done = subprocess.run([sys.executable, "-m", "quant.engines.window", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
