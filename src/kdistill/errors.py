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
        super().__init__(one_line(message))


# A message quotes user values (a config value, an override, a data record's field): each run of text
# without a space is kept to WORD_LIMIT characters, the whole line to LINE_LIMIT, so that a megabyte value
# never becomes a megabyte message. Call sites shorten values themselves (kdistill.jsonio.short_repr);
# this is the net under every one of them.
WORD_LIMIT = 200
LINE_LIMIT = 1000


def one_line(message: object) -> str:
    """`message` on one line (newlines would break the one-line contract), every word of it at most
    WORD_LIMIT characters (its head and tail kept: a long path keeps its file name) and the line at most
    LINE_LIMIT (its head and tail kept: the field named first, what was expected last)."""
    words = str(message).split()
    for i, w in enumerate(words):
        if len(w) > WORD_LIMIT:
            words[i] = f"{w[: WORD_LIMIT - 63]}...{w[-60:]}"
    text = " ".join(words)
    if len(text) > LINE_LIMIT:
        text = f"{text[: LINE_LIMIT - 305]} ... {text[-300:]}"
    return text


class KernelCacheMiss(UserError):
    """A Triton kernel was compiled after the cache was sealed (strict mode)."""


class KernelError(RuntimeError):
    """A kernel failed to compile or launch; callers fall back to the reference path."""
