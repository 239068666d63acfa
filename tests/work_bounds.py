"""Bounds on the work a block of code does, in units a busy machine cannot stretch.

A refusal of hostile input must answer without first doing work proportional to what the input claims (a 10^15-entry
list, a loop over a million layer names). Seconds measure that badly: on a loaded 2-core machine a correct refusal
can take longer than a time bound allows, and a bound generous enough for it cannot tell a loop over 10^6 entries
from none. So the block's work is counted instead: the Python lines it runs (`sys.settrace` line events, deterministic for a
given input and code) and its peak Python allocation (`tracemalloc`). Work done in C without allocating (a regex or
a JSON parse over a large text) counts as one line: these bounds catch the Python loops and the allocations that a
size read from the input would drive.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def bounded_work(lines: int = 100_000, megabytes: float = 64.0) -> Iterator[None]:
    """The block must run at most `lines` Python lines (in every function it calls, on this thread) and allocate at
    most `megabytes` at its peak (Python allocations)."""
    counted = [0]

    def local_trace(frame, event, arg):
        if event == "line":
            counted[0] += 1
        return local_trace

    def global_trace(frame, event, arg):
        return local_trace

    previous = sys.gettrace()
    tracemalloc.start()
    sys.settrace(global_trace)
    try:
        yield
    finally:
        sys.settrace(previous)
        peak = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    assert counted[0] <= lines, f"ran {counted[0]} Python lines, more than {lines}"
    assert peak <= megabytes, f"peak {peak:.1f} MB, more than {megabytes} MB"
