"""Wall-clock timing of device work, shared by the benchmark scripts. A GPU runs queued kernels after the host call
returns, so a call is timed between two synchronisations of its device (the CPU runs its work as it is called)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def synchronize(device: torch.device | str) -> None:
    """Waits for the work queued on `device` (a CUDA device; nothing to wait for elsewhere)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], Result], device: torch.device | str,
          clock: Callable[[], float] = time.perf_counter) -> tuple[Result, float]:
    """run()'s result and the seconds it took on `clock` (wall time by default), the device's queued work finished
    before and after."""
    synchronize(device)
    start = clock()
    result = run()
    synchronize(device)
    return result, clock() - start
