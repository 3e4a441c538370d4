"""Preemption: SIGTERM/SIGINT become a flag the loop checks between optimizer steps, so it saves and exits 0."""

from __future__ import annotations

import signal
from types import FrameType


class StopRequest:
    """Set by SIGTERM or the first Ctrl-C; a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        print(f"\n{self.signal_name} received: finishing this step, then saving a checkpoint", flush=True)
