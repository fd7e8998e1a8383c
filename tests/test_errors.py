"""One error base: every error a user can cause derives from ``QuantgateError`` and carries the exit
code its command returns, and ``quantize``, ``gate`` and ``evals`` each turn any of them into one line
and that code (no command lists exception types by hand, so a new error cannot be forgotten)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import evals
import quant
import quantgate
from quant.errors import QuantgateError

PACKAGES = (quant, evals, quantgate)
EXIT_CODES = {1, 2, 3}  # a failed run (disk full), bad input or refused, a run that could not finish


def _all_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    for name in names:
        importlib.import_module(name)  # every module, so every error class it defines is seen
    return names


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def project_errors() -> list[type[BaseException]]:
    """Every public exception class the packages define (a leading underscore marks control flow, e.g.
    the aiter padding reader's early return, never shown to a user)."""
    modules = set(_all_modules())
    return sorted((c for c in _subclasses(Exception) if c.__module__ in modules and not c.__name__.startswith("_")),
                  key=lambda c: f"{c.__module__}.{c.__qualname__}")


ERRORS = project_errors()


def test_the_walk_finds_the_errors():
    names = {c.__name__ for c in ERRORS}
    assert {"RecipeError", "KernelInputError", "UnknownFamilyError", "PlanError", "ShardError", "NamingError",
            "CheckpointError", "NonFiniteError", "ConvertError", "BadInput", "RunFailed", "LoadError"} <= names


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_derives_from_the_base_and_carries_an_exit_code(error):
    assert issubclass(error, QuantgateError), f"{error.__module__}.{error.__qualname__} is not a QuantgateError"
    assert error.exit_code in EXIT_CODES


def _raiser(error):
    def run(*_args, **_kwargs):
        raise error(f"{error.__name__}: the input named here; do this to fix it")
    return run


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__qualname__)
def test_quantize_maps_every_error_to_one_line_and_its_code(error, monkeypatch, capsys):
    import quant.cli

    monkeypatch.setattr(quant.cli, "run", _raiser(error))
    assert quant.cli.main(["--to", "mxfp4"]) == error.exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{error.__name__}: the input named here" in err, err


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__qualname__)
@pytest.mark.parametrize("command", ["gate", "evals"])
def test_gate_and_evals_map_every_error_to_one_line_and_its_code(error, command, monkeypatch, capsys):
    import evals.cli
    from evals._cli import evals_data, gate_plan

    if command == "gate":
        monkeypatch.setattr(gate_plan, "run", _raiser(error))
        code = evals.cli.main(["plan"])
    else:
        monkeypatch.setattr(evals_data, "run", _raiser(error))
        code = evals.cli.evals_main(["data", "--data-dir", "unused"])
    assert code == error.exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{command}: error: {error.__name__}: the input named"), err


def test_the_load_sweeps_input_checks_carry_their_exit_code_on_the_api_too():
    from evals.load import Workload

    with pytest.raises(QuantgateError, match="--prefix-hit 1.5") as bad:
        Workload(prefix_hit=1.5)
    assert bad.value.exit_code == 2
