"""A CUDA stream for each graph this package captures that no other live graph of the package was captured on.

PyTorch keeps one cuBLAS workspace per (handle, stream) and each GEMM a graph captures bakes that workspace's address
in. When a graph is destroyed, `CUDAGraph::reset` frees the workspace of the stream it was captured on
(`clearCublasWorkspacesForStream`), whichever graphs still use it (pytorch/pytorch#193402). `torch.cuda.graph`
captures every graph on one default stream, so dropping one graph (a prompt bucket evicted, a decoding step
recaptured, a kept verify round let go) leaves every other graph of the process with a freed workspace: a later
replay reads and writes memory the allocator has given to something else, or released (an illegal address).

`take` hands each capture a stream that no live graph of the package holds, among the streams torch's pool lends
(32 per priority and device, two priorities); `hold` ties it to the graph, which gives it back when it is freed.
Past that many live graphs a stream is shared by the fewest graphs, and dropping one of them is as unsafe as before
for the others (a process rarely keeps more: steps, prompt buckets and verify rounds are kept per model by the
dozen at most). The streams are only capture streams: replays run on the caller's stream.

Imported for CUDA graphs only; the tests stand in the streams' maker (no CUDA).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

PRIORITIES = (0, -1)  # torch's pooled streams: the default priority's, then the high one's
POOLED_PER_PRIORITY = 32  # streams per priority and device in torch's pool (kStreamsPerPool)


class CaptureStreams:
    """The capture streams of this process's graphs, per device (see the module docstring)."""

    def __init__(self, make_stream: Callable[[torch.device, int], Any] | None = None):
        self._make = make_stream or (lambda device, priority: torch.cuda.Stream(device, priority=priority))
        self._streams: dict[torch.device, list] = {}
        self._holders: dict[int, int] = {}  # stream handle -> live graphs captured on it

    def _pooled(self, device: torch.device) -> list:
        """The distinct streams torch's pool lends on `device` (drawn round-robin, each priority's whole pool)."""
        if device not in self._streams:
            found: dict[int, Any] = {}
            for priority in PRIORITIES:
                for _ in range(POOLED_PER_PRIORITY):
                    stream = self._make(device, priority)
                    found.setdefault(stream.cuda_stream, stream)
            self._streams[device] = list(found.values())
        return self._streams[device]

    def take(self, device: torch.device) -> Any:
        """A stream on `device` held by no live graph of this package, else the one held by the fewest."""
        return min(self._pooled(device), key=lambda stream: self._holders.get(stream.cuda_stream, 0))

    def hold(self, graph: Any, stream: Any) -> None:
        """Counts `graph` as captured on `stream` until it is freed."""
        handle = stream.cuda_stream
        self._holders[handle] = self._holders.get(handle, 0) + 1
        weakref.finalize(graph, self._release, handle)

    def holders(self, stream: Any) -> int:
        return self._holders.get(stream.cuda_stream, 0)

    def _release(self, handle: int) -> None:
        self._holders[handle] -= 1
        if not self._holders[handle]:
            del self._holders[handle]


CAPTURE_STREAMS = CaptureStreams()

__all__ = ["CAPTURE_STREAMS", "CaptureStreams"]
