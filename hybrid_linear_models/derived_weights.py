"""Tensors computed from parameters (a zero-centred norm's 1 + w, KDA's concatenated conv kernels), kept between
forward passes that need no gradient, so decoding steps do not rebuild them: one kernel less per use and step; and
parameters stacked into one tensor that they share (`SharedRows`: the weights of projections that one GEMM runs).

A kept value is rebuilt as soon as a source changes: another tensor in its place, new data (`.data = ...`, as
`module.to` does: a new address) or an in-place update (its version counter: optimiser steps, `load_state_dict`),
in place when its layout allows. A captured CUDA graph reads the kept tensor without running Python, so
`CudaGraphDecoder` captures again when `stale()` says so or the kept tensor was replaced.

It asks before every replayed step, so the question must cost little next to a step of a millisecond or two, on
the host time between transformers' per-token synchronisation and the replay: asking each of a 16-layer model's ~110
kept tensors (`stale()`, a few attribute reads per source) costs a tenth of a millisecond or more per token.
`ChangeWatch` answers from a snapshot instead, in two depths. Before every step (`changed()`): the count of values
built anywhere since (`_BUILDS`, raised by every build) and the version counters of the derived values' sources, the
only in-place updates that change what a kept tensor should hold (a stacked weight's in-place update is in the shared
tensor already). Where the caller says a new run of steps starts (`changed(addresses=True)`: after a capture, an
uncaptured forward, a new cache): also every source's address, which new data changes (`module.to`, `.data = ...`).
Only when one differs are the kept tensors asked one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import torch


_VERSION = attrgetter("_version")  # a tensor's version counter (in-place updates raise it)
_BUILDS = [0]  # values built or joined by any DerivedWeight / SharedRows so far (ChangeWatch's cheap first test)


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
            _BUILDS[0] += 1
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




class SharedRows:
    """One tensor whose row blocks are the data of several parameters (the weights, or the biases, of Linear layers
    that read one input), so that they run as one GEMM. The parameters are not copied: after `get` each one's data
    is a view of its block (no memory spent, and any in-place update, an optimiser step or `load_state_dict`, is in
    the shared tensor by construction). A parameter given new data (`module.to`, `.data = ...`, or another Parameter
    in its place) leaves the sharing: the next `get` joins them again, into a new tensor, and `stale()` tells a
    captured graph (which reads the old one) to capture again. Views of one storage save as separate tensors
    (transformers' save_pretrained clones disjoint shared tensors)."""

    def __init__(self):
        self._value: torch.Tensor | None = None
        self._sources: list[torch.Tensor] = []

    def get(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensor of the `sources` (each [rows_i, ...], same trailing shape, dtype and device) stacked by rows."""
        if not self._shared(sources):
            _BUILDS[0] += 1
            with torch.inference_mode(False), torch.no_grad():  # normal tensors, usable later under autograd
                value = torch.cat([s.detach() for s in sources])
                start = 0
                for source in sources:
                    source.data = value[start : start + source.shape[0]]
                    start += source.shape[0]
            self._value, self._sources = value, list(sources)
        return self._value

    @property
    def value(self) -> torch.Tensor | None:
        return self._value

    def _shared(self, sources: Sequence[torch.Tensor]) -> bool:
        return (len(sources) == len(self._sources) and all(s is kept for s, kept in zip(sources, self._sources))
                and not self.stale())

    def stale(self) -> bool:
        """Whether a parameter's data is no longer its block of the shared tensor."""
        value = self._value
        if value is None:
            return False
        start = 0
        for source in self._sources:
            if (source.device != value.device or source.dtype != value.dtype or source.stride() != value.stride()
                    or source.shape[1:] != value.shape[1:]
                    or source.data_ptr() != value.data_ptr() + start * value.stride(0) * value.element_size()):
                return True
            start += source.shape[0]
        return start != value.shape[0]


class ChangeWatch:
    """Whether any of `kept` (DerivedWeight / SharedRows) is stale or holds another value than when watched (see the
    module docstring): a snapshot of the derived values' source versions and of every source's address, compared as
    flat lists."""

    def __init__(self, kept: Sequence[DerivedWeight | SharedRows]):
        self._pairs = [(k, k.value) for k in kept]
        self._sources = [s for k in kept for s in k._sources]
        self._versioned = [s for k in kept if isinstance(k, DerivedWeight) for s in k._sources]
        self._snapshot()

    def _snapshot(self) -> None:
        self._builds = _BUILDS[0]
        self._versions = list(map(_VERSION, self._versioned))
        self._addresses = list(map(torch.Tensor.data_ptr, self._sources))

    def changed(self, addresses: bool = False) -> bool:
        """addresses: also compare every source's address (a run of steps starts); per step, the versions suffice."""
        if (self._builds == _BUILDS[0] and list(map(_VERSION, self._versioned)) == self._versions
                and (not addresses or list(map(torch.Tensor.data_ptr, self._sources)) == self._addresses)):
            return False
        if any(k.value is not value or k.stale() for k, value in self._pairs):
            return True
        self._snapshot()  # a change the kept values survive (an in-place update of shared rows, a build elsewhere)
        return False


def derived_weights(model: torch.nn.Module) -> list[DerivedWeight | SharedRows]:
    """Every DerivedWeight and SharedRows held by the model's modules (directly, or through a holder listing them in
    its `kept_tensors()`)."""
    found = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (DerivedWeight, SharedRows)):
                found.append(value)
            elif hasattr(value, "kept_tensors"):
                found.extend(value.kept_tensors())
    return found
