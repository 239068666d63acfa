"""When this package's Triton kernels autotune: inside `autotuning()`, which `warm_up` enters, not on a first call.

triton's autotuner compiles and times every configuration of a kernel the first time it meets a tuning key (a
weight's shape and flags): about a second a configuration, so a model with a dozen weight shapes would stall for tens
of seconds in its first prompt or decoding step (the full-size FP8 Qwen3-Next: 28 s before its first token). So a
call outside `autotuning()` runs the kernel's default configuration (compiled on first use, no timing; the
configuration the tuning picks most often on an H200), unless its key was tuned earlier in the process. Inside, the
autotuner times every configuration (or reads the timings triton kept on disk from an earlier process), and that
key's choice then serves every later call of the process.

HYBRID_LINEAR_AUTOTUNE=1 in the environment tunes every call, as if all ran inside `autotuning()` (the kernel
benchmarks, which compare tuned kernels).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

_ENV = "HYBRID_LINEAR_AUTOTUNE"
_depth = 0  # open autotuning() contexts
_tuned: set[tuple] = set()  # keys tuned in this process


@contextlib.contextmanager
def autotuning() -> Iterator[None]:
    """Inside, this package's Triton kernels autotune each new key (see the module docstring)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def autotuning_active() -> bool:
    """Whether a call now tunes its new keys: inside `autotuning()`, or with HYBRID_LINEAR_AUTOTUNE=1."""
    return _depth > 0 or os.environ.get(_ENV, "") == "1"


def launch(autotuner: Any, kernel: Any, grid: Callable[[dict], tuple], key: tuple, default: Any, args: tuple,
           flags: dict) -> None:
    """Runs `kernel` over `grid` (a function of the configuration's meta-parameters): through `autotuner` (triton's
    Autotuner of it) where tuning is active or `key` (the values of the autotuner's key, with the kernel's name; the
    dtypes of the tensor arguments are added here, as triton adds them) was tuned in this process, else with
    `default` (a triton.Config) as it is."""
    key = (*key, *(str(arg.dtype) for arg in args if hasattr(arg, "dtype")))
    if key in _tuned or autotuning_active():
        _tuned.add(key)
        autotuner[grid](*args, **flags)
        return
    meta = default.all_kwargs()
    kernel[grid(meta)](*args, **flags, **meta)


__all__ = ["autotuning", "autotuning_active", "launch"]
