"""Console output shared by the commands: one JSON object, and the training progress bar.

    print_json(summary)                                   # the `--json` output of every command
    bar = progress_bar(total=100, initial=0, desc="KD student", disable=quiet)

A leaf: it imports nothing of kdistill, so any layer may print through it.
"""

from __future__ import annotations

import json
import sys

from tqdm import tqdm


def print_json(obj: object) -> None:
    """Print one JSON object on stdout."""
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def progress_bar(total: int, initial: int, desc: str, disable: bool) -> tqdm:
    """The step progress bar, on stderr so that stdout holds only results."""
    return tqdm(
        total=total,
        initial=initial,
        disable=disable,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
