"""Stopping a training run cleanly on SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C).

While ``StopSignals`` is entered, the first SIGTERM or SIGINT only records the request (``signum``). The
training loop reads it after each step; under torchrun the ranks combine their requests
(``titans.training.distributed.agree_to_stop``), so every rank stops after the same step, and the run
writes one checkpoint and its report before the command exits.

A second signal stops at once, with the behaviour the signal had before ``StopSignals`` was entered:
SIGINT raises ``KeyboardInterrupt`` (``titans train`` turns it into one line and exit status 130),
SIGTERM ends the process (status 143 to a shell). A repeat less than ``REPEAT_WINDOW_S`` after the first
counts as the same request: a launcher that forwards a signal to workers that already got it (SLURM
signals every process of a job step, and torchrun then forwards it again) must not turn a clean stop
into an abrupt one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 1.0


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by signal ``signum``: 128 + its number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_if_stopped(stopped_by: str | None, what: str) -> None:
    """End a command whose training a signal stopped (``stopped_by``: the signal's name, as a
    `TrainResult` or task history records it) with the shell's status for that signal, saying what was
    cut short: a command that trains several models and went on to the next (an ablation, a depth
    study) exited 0 with a result file that reported the cut-short model as trained."""
    if stopped_by is None or stopped_by not in signal.Signals.__members__:
        return
    print(f"titans: stopped by {stopped_by} {what}; no results written", file=sys.stderr, flush=True)
    raise SystemExit(exit_status(signal.Signals[stopped_by]))


def _say(text: str) -> None:
    # os.write, not print: a handler may run in the middle of a print to the same stream, and a
    # buffered stream refuses re-entrant writes
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


class StopSignals:
    """Context manager: handle SIGTERM / SIGINT as stop requests (see the module docstring).

    ``enabled=False`` or use outside the main thread (where Python cannot install handlers): a no-op,
    ``signum`` stays None. A signal whose handler is SIG_IGN is left ignored. ``announce``: write a line
    to stderr when a signal arrives (rank 0 only), saying ``next_steps``.
    """

    def __init__(self, *, enabled: bool = True, announce: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.announce = announce
        self.signum: int | None = None
        # what the announcement says happens next (a trainer past its last step sets its own)
        self.next_steps = "finishing the current step, then saving a checkpoint"
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for s in SIGNALS:
                # a signal ignored on purpose (SIGINT of a shell's background job) stays ignored
                if signal.getsignal(s) != signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        name = signal_name(signum)
        if self.signum is None:
            self.signum, self._first = signum, now
            if self.announce:
                _say(
                    f"titans: got {name}: {self.next_steps} "
                    f"(send {name} again to stop at once, without one)\n"
                )
            return
        if now - self._first < REPEAT_WINDOW_S:
            return
        if self.announce:
            _say(f"titans: second {name}: stopping at once\n")
        previous = self._previous.get(signum)
        self._restore()  # from here on every signal has its usual effect
        if callable(previous):  # Python's SIGINT handler: KeyboardInterrupt
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
