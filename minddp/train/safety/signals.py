"""Graceful stop on SIGTERM (Slurm time limit, preemption, torchrun shutting down), SIGUSR1
(Slurm's warning before the time limit) and SIGINT (Ctrl-C: the run keeps what it did; exit 130).

The handler only records the signal. The training loop folds the flag into the
per-step loss all-reduce, so every rank sees "someone was asked to stop" at the
same step, writes the checkpoint together and exits cleanly: no rank leaves the
loop alone while the others wait in a collective.
"""

from __future__ import annotations

import signal


class StopRequest:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT), on_signal=None):
        self.signum: int | None = None
        self.requested = False  # read every step: a plain attribute
        self.on_signal = on_signal  # e.g. dump the flight recorder
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum, self.requested = signum, True
        if self.on_signal:
            self.on_signal()
        # a second signal (e.g. the rank is stuck in a collective) terminates as usual
        signal.signal(signum, signal.SIG_DFL)

    @property
    def exit_code(self) -> int:
        """A shell's code for Ctrl-C (128 + SIGINT); 0 for a requested stop (SIGTERM, SIGUSR1)."""
        return 128 + signal.SIGINT if self.signum == signal.SIGINT else 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""
