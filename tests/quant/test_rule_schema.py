"""Engine rule files are read against one strict schema (quant/engines/rule_kinds.py): a misspelt rule,
a misspelt key inside a rule or a role no family defines is refused in one line naming the file, the
key and the nearest valid name (exit 2), where it used to load and silently stop applying. The typed
reading changes no value."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quant.engines.rule_kinds import RuleFile
from quant.engines.rules import ENGINES, RuleFileError, rule_file, rules_path
from quant.layout import FAMILIES_ENV, family_dirs
from quant.schema import validate
from tests.quant.test_hostile import one_line_error


def test_every_rule_file_reads_as_its_yaml():
    """The typed file, dumped, is the YAML itself: the rule sets the replay reads are unchanged."""
    names = [f"{engine}{suffix}" for engine in ENGINES
             for suffix in ["", *(f".{family}" for family, folder in family_dirs().items()
                                   if (folder / f"{engine}.yaml").is_file())]]
    assert len(names) > len(ENGINES)
    for name in names:
        raw = yaml.safe_load(rules_path(name).read_text())
        assert rule_file(name).model_dump(by_alias=True, exclude_unset=True) == raw, name


def _copied_family(root: Path, edit) -> tuple[str, str]:
    """Mixtral's folder copied under a new family name, model type and model class (so its own rule
    files are the ones read for it), with ``edit(engine, data)`` applied to its rule files."""
    folder = root / "mixtral_typo"
    shutil.copytree(family_dirs()["mixtral"], folder)
    manifest = (folder / "family.yaml").read_text().replace("family: mixtral", "family: mixtral_typo")
    manifest = manifest.replace("model_types: [mixtral]", "model_types: [mixtral_typo]")
    (folder / "family.yaml").write_text(manifest.replace("MixtralForCausalLM", "MixtralTypoForCausalLM"))
    for engine in ENGINES:
        data = yaml.safe_load((folder / f"{engine}.yaml").read_text().replace("{mixtral: ", "{mixtral_typo: "))
        data["model_classes"] = ["MixtralTypoForCausalLM"]
        edit(engine, data)
        (folder / f"{engine}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return tuple(str(folder / f"{engine}.yaml") for engine in ENGINES)


def _misspelt_rule(engine, data):
    if engine == "sglang":  # sglang's Llama-4 rule, misspelt, in the last rule set
        data["rule_sets"][-1]["rules"]["qk_rotary_permut"] = {
            "value": {"fails": ["quark"], "leaves": ["q_proj", "k_proj"], "unless_name_has": []}, "cite": "x.py: f"}


def _misspelt_key(engine, data):
    if engine == "vllm":
        skip = data["rule_sets"][0]["rules"]["fp8_skip"]["value"]
        skip["keys_mod"] = skip.pop("keys_mode")


def _misspelt_role(engine, data):
    if engine == "vllm":  # the router kept bf16, under a role no family manifest defines
        data["rule_sets"][0]["rules"]["unquantized_roles"]["value"][0] = "routr"


def _original_family_key(engine, data):
    if engine == "vllm":  # the copy's per-family value still keyed by the family it was copied from
        draft = data["rule_sets"][0]["rules"]["draft_exclude"]["value"]
        draft["mixtral"] = draft.pop("mixtral_typo")


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    from tests.quant.family_checkpoints import write_family_checkpoint

    folder = write_family_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", "mixtral", num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mixtral_typo"}))
    return folder


@pytest.mark.parametrize(("edit", "engine", "key", "near"), [
    (_misspelt_rule, "sglang", "rule_sets.2.rules: unknown key 'qk_rotary_permut'", "qk_rotary_permute"),
    (_misspelt_key, "vllm", "rule_sets.0.rules.fp8_skip.value: unknown key 'keys_mod'", "keys_mode"),
    (_misspelt_role, "vllm", "rule_sets.0.rules.unquantized_roles.value.0: unknown role 'routr'", "router"),
    (_original_family_key, "vllm", "rule_sets.0.rules.draft_exclude.value: unknown family 'mixtral'", "mixtral_typo"),
], ids=["rule", "key-in-rule", "role", "family-key"])
def test_a_misspelt_rule_is_refused_by_the_cli(tmp_path, mixtral_checkpoint, edit, engine, key, near):
    """``gate checkpoint`` and ``quantize --dry-run`` on a checkpoint of a family whose rule file holds
    the typo: exit 2, one line naming the file, the key path and the nearest valid name, nothing written."""
    files = dict(zip(ENGINES, _copied_family(tmp_path / "families", edit)))
    n_sets = len(yaml.safe_load(Path(files["sglang"]).read_text())["rule_sets"])
    key = key.replace("rule_sets.2.", f"rule_sets.{n_sets - 1}.")
    env = {**os.environ, FAMILIES_ENV: str(tmp_path / "families")}
    for command in ([sys.executable, "-m", "evals.cli", "checkpoint", str(mixtral_checkpoint)],
                    [sys.executable, "-m", "quant.cli", "--to", "mxfp4", "--dry-run", str(mixtral_checkpoint),
                     str(tmp_path / "out")]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        one_line_error(done.stderr, files[engine], key, f"did you mean {near!r}")
        assert not (tmp_path / "out").exists()


def test_a_rule_value_the_code_does_not_know_is_refused():
    """A value outside its kind's vocabulary (a shared-expert fusion veto the replay does not know)
    names the key and the valid values."""
    data = rule_file("sglang").model_dump(by_alias=True, exclude_unset=True)
    data["rule_sets"][0]["rules"]["shared_experts_fusion"]["value"]["exclude_veto"] = "mtp"
    with pytest.raises(RuleFileError, match=r"^sglang\.yaml: .*shared_experts_fusion\.value\..*exclude_veto: "
                                            r"Input should be 'none', 'mtp_prefix' or 'draft_layers'"):
        validate(data, RuleFile, Path("sglang.yaml"), "engine rule file", RuleFileError, "")


def test_two_rule_files_for_one_class_are_refused(tmp_path, mixtral_checkpoint):
    """A folder copied without giving its rule files the new class would share Mixtral's class with
    Mixtral's own folder: which rules are replayed would depend on the folders' order, so it is refused."""
    _copied_family(tmp_path / "families", lambda engine, data: data.update(model_classes=["MixtralForCausalLM"]))
    manifest = tmp_path / "families" / "mixtral_typo" / "family.yaml"  # the copy keeps Mixtral's class too
    manifest.write_text(manifest.read_text().replace("MixtralTypoForCausalLM", "MixtralForCausalLM"))
    env = {**os.environ, FAMILIES_ENV: str(tmp_path / "families")}
    done = subprocess.run([sys.executable, "-m", "evals.cli", "checkpoint", str(mixtral_checkpoint)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    one_line_error(done.stderr, "both list its", "MixtralForCausalLM")
