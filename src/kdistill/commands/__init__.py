"""The commands of the `kdistill` CLI, one module each: run, plan, report, kernels, eval, inspect.

Each module holds `<name>_command(args) -> int` and what only that command uses; cli.py maps the
parsed arguments to them. The library layers below (train, evaluate, models, kernels) never import
a command.
"""
