"""The subcommands of ``gate`` and ``evals``, one per module (lm-eval's ``_cli/`` layout).

Each module defines ``register(subparsers)``, which adds its parser and binds its handler with
``set_defaults(func=...)``; a handler takes the parsed arguments and returns the exit code of a
result (0 pass, 1 fail or block). Errors are raised, never printed here: ``evals.cli`` turns any
``QuantgateError`` into its message and its own exit code (2 bad input or refused, 3 a run that
could not finish). To add a subcommand, add a module and name it in ``evals.cli``'s list.
"""
