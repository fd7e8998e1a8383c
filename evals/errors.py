"""The errors of ``evals`` and ``gate``, each carrying the exit code it means.

Exit codes mean one thing each: 0 pass (or done), 1 a verdict of FAIL or a blocked release (a
result, never an error), 2 bad input or a refused comparison, 3 a run that could not finish
(finished units are kept; ``--resume`` completes it). A command catches only ``QuantgateError``
and returns its ``exit_code``, so no command lists exception types by hand.
"""

from __future__ import annotations

from quant.errors import QuantgateError

EXIT_PASS, EXIT_BLOCK, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3


class BadInput(QuantgateError, ValueError):
    """Input that cannot be used as given (a file, a flag, a bundle); the message names it."""

    exit_code = EXIT_BAD_INPUT


class Refused(BadInput):
    """A request the gate will not answer as asked, e.g. comparing runs whose settings differ."""


class RunFailed(QuantgateError, RuntimeError):
    """A run that could not finish (a dead server, a crashed model); finished units are kept."""

    exit_code = EXIT_RUN_FAILED


__all__ = ["EXIT_BAD_INPUT", "EXIT_BLOCK", "EXIT_PASS", "EXIT_RUN_FAILED", "BadInput", "QuantgateError", "Refused",
           "RunFailed"]
