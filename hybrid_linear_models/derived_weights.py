"""Tensors computed from parameters (a zero-centred norm's 1 + w, KDA's concatenated conv kernels), kept between
forward passes that need no gradient, so decoding steps do not rebuild them: one kernel less per use and step.

A kept value is rebuilt as soon as a source changes: another tensor in its place, new data (`.data = ...`, as
`module.to` does: a new address) or an in-place update (its version counter: optimiser steps, `load_state_dict`),
in place when its layout allows. A captured CUDA graph reads the kept tensor without running Python, so
`CudaGraphDecoder` captures again when `stale()` says so or the kept tensor was replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _fingerprint(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()  # new dtype or device means new storage, so a new address


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()


class DerivedWeight:
    """One kept tensor, built by the caller's `build` from `sources` (see the module docstring)."""

    def __init__(self):
        self._value: torch.Tensor | None = None
        self._sources: list[torch.Tensor] = []  # held, so their addresses cannot pass to other tensors
        self._fingerprints: list[tuple] = []
        self._tag = None

    def get(self, sources: Sequence[torch.Tensor], build: Callable[[], torch.Tensor], tag=None) -> torch.Tensor:
        """build() (from `sources`), or the value kept from an earlier call with the same sources and `tag`."""
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(s.requires_grad for s in sources)):
            return build()  # autograd needs the graph from the parameters; a compiler fuses the build anyway
        if self._value is None or tag != self._tag or self._changed(sources):
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable later under autograd
                value = build()
                if self._value is not None and _same_layout(self._value, value):
                    self._value.copy_(value)  # in place: a captured graph reading it sees the new value
                else:
                    self._value = value
            self._sources, self._fingerprints, self._tag = list(sources), [_fingerprint(s) for s in sources], tag
        return self._value

    @property
    def value(self) -> torch.Tensor | None:
        return self._value

    def _changed(self, sources: Sequence[torch.Tensor]) -> bool:
        return len(sources) != len(self._sources) or any(
            s is not kept or _fingerprint(s) != fp for s, kept, fp in zip(sources, self._sources, self._fingerprints))

    def stale(self) -> bool:
        """Whether a kept value no longer matches its sources as they are now (an in-place update or new data)."""
        return self._value is not None and any(
            _fingerprint(s) != fp for s, fp in zip(self._sources, self._fingerprints))


def derived_weights(model: torch.nn.Module) -> list[DerivedWeight]:
    """Every DerivedWeight held by the model's modules."""
    return [value for module in model.modules() for value in vars(module).values() if isinstance(value, DerivedWeight)]
