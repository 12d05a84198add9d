"""Stopping a run cleanly on SIGTERM / SIGINT.

with SignalGuard() as guard:
    while ...:
        ... one step ...
        if guard.requested: save a checkpoint and stop
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


class SignalGuard:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit 0. Second: exit at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            sys.stderr.write("\nkdistill: second signal, exiting now\n")
            os._exit(130)
        self.requested = signal.Signals(signum).name
        sys.stderr.write(
            f"\nkdistill: {self.requested} received: finishing this step and saving a checkpoint\n"
        )

    def __enter__(self) -> SignalGuard:
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
