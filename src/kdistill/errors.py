"""Errors a user can cause, and how they reach the terminal.

A `UserError` carries one line that names the file, field or line at fault and what was expected.
The CLI prints it as ``kdistill: error: <message>`` and exits 2; the traceback is shown only
under ``--debug``.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (file, config field, data line). Exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line only: newlines in a message would break the one-line contract.
        super().__init__(" ".join(str(message).split()))


class KernelCacheMiss(UserError):
    """A Triton kernel was compiled after the cache was sealed (strict mode)."""


class KernelError(RuntimeError):
    """A kernel failed to compile or launch; callers fall back to the reference path."""
