"""Stop signals (SIGINT, SIGTERM, SIGHUP) during a conversion unwind like Ctrl-C, so the output folder is cleaned up.

By default SIGTERM and SIGHUP end the process on the spot, leaving a half-written `.DST.partial-*` folder and the
lock file beside DST. Within `stop_signals_raise()` they raise `Interrupted` (a KeyboardInterrupt) instead, so the
`finally` blocks that remove the staging folder and release the lock run. Only the main thread can do this (Python
runs signal handlers there), and only for signals whose handler is the default one: a signal that the program ignores
(`nohup` ignores SIGHUP) or handles itself is left alone. The previous handlers are restored on the way out.

`signals_deferred()` marks a few lines that must not be cut in half (the renames that put the output in place, the
lock's release): a signal arriving there is raised at their end. A second signal while the first one's cleanup runs
is ignored, so the cleanup completes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_DEFAULT_HANDLERS = (signal.SIG_DFL, signal.default_int_handler)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived during a conversion; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class _Guard:
    received: int | None = None  # the first stop signal; later ones are ignored
    deferring: int = 0  # depth of signals_deferred() blocks
    pending: bool = False  # received while deferring, not raised yet

    def handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            return  # the cleanup of the first signal is running: let it finish
        self.received = signum
        if self.deferring:
            self.pending = True
        else:
            raise Interrupted(signum)


_active: _Guard | None = None  # the guard whose handlers are installed (main thread only)


@contextlib.contextmanager
def stop_signals_raise(redeliver: bool = False) -> Iterator[None]:
    """Within: stop signals with default handlers raise `Interrupted`. With `redeliver` (the Python API), once the
    block has cleaned up and the default handlers are back, a SIGTERM or SIGHUP is sent again so that the process
    ends as it would have without this block; the command line instead reports it and exits with 128 + signal."""
    global _active
    if _active is not None or threading.current_thread() is not threading.main_thread():
        yield  # an outer block already handles the signals, or signals cannot be handled here
        return
    guard = _Guard()
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    installed = [signum for signum, handler in previous.items() if handler in _DEFAULT_HANDLERS]
    for signum in installed:
        signal.signal(signum, guard.handle)
    _active = guard
    try:
        yield
    except Interrupted as stop:
        ends_process = redeliver and stop.signum in installed and previous[stop.signum] == signal.SIG_DFL
        _restore(previous, installed)
        if ends_process:
            signal.raise_signal(stop.signum)  # the default action: the process ends here, its output folder clean
        raise
    finally:
        _restore(previous, installed)


def _restore(previous: dict, installed: list[int]) -> None:
    global _active
    for signum in installed:
        signal.signal(signum, previous[signum])
    installed.clear()
    _active = None


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within: a stop signal waits; it is raised when the block ends normally."""
    guard = _active
    if guard is None:
        yield
        return
    guard.deferring += 1
    try:
        yield
    finally:
        guard.deferring -= 1
    if not guard.deferring and guard.pending:
        guard.pending = False
        raise Interrupted(guard.received)


__all__ = ["STOP_SIGNALS", "Interrupted", "signals_deferred", "stop_signals_raise"]
