"""Recording the package's CUDA graphs, and when they are destroyed: together, never one alone.

cuBLAS keeps a workspace per (handle, stream), made at the first GEMM run on the stream, and every GEMM captured on
that stream writes to that workspace's address from its graph. In torch releases whose `CUDAGraph::reset` clears the
capture stream's cuBLAS workspaces (pytorch/pytorch#193402), destroying any graph frees the workspace while the other
graphs captured on that stream still write to it. The block goes to the next allocation of its memory pool, or back
to the driver at a later capture's `empty_cache`, and a replay then overwrites live tensors or faults with an illegal
memory access. The package drops graphs in the normal course of things: evicted prompt buckets, steps recaptured for
new weights, kept verify rounds replaced. (The torch 2.11 build measured on an H200 frees nothing there.)

So a graph recorded here is never destroyed while another one recorded on its stream may still be replayed:
- every graph is captured on this module's stream for its device (`DeviceGraphs.stream`), not on torch's default capture
  stream, which graphs of other code share and destroy when they like;
- a graph its holder lets go of is parked: kept alive, not replayed (`RecordedGraph` is what holders keep; the
  CUDAGraph itself stays here);
- when no graph of the device is held any more, all are destroyed together, after a synchronisation;
- when a recording begins with more than MAX_PARKED parked, every graph of the device is destroyed, the held ones
  too, before the capture. Each holder checks `expired` right before it replays and then captures its graph again;
  a loop that replays one graph while others may be recorded (`replays_under_way`) holds this back. This bounds what
  a long-lived step graph would otherwise keep alive in a process that evicts prompt buckets or recaptures as weights
  change;
- nothing is destroyed while a capture is under way (a garbage collection can run then, or a finaliser on another
  thread): a graph let go of then waits for a later release or recording. A capture that fails is parked, and the
  frames of its exception let go of it, so that a kept exception does not destroy it later.
The cost: a parked graph keeps its executable graph and its memory pool (per model and kind) alive, so a deleted
model's graph memory stays reserved while another model on the device holds graphs (`set_cuda_graph_decoding(False)`
on every model, or deleting them, lets it go); a flush makes every model's held graphs capture again at their next
use.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
import weakref
from collections.abc import Callable, Iterator

import torch

WARM_UP_RUNS = 1
MAX_PARKED = 64  # parked graphs per device before every graph of the device is destroyed and recaptured on use


class RecordedGraph:
    """A captured graph as its holder keeps it: `replay()` until `expired` (destroyed with the device's other graphs,
    see the module docstring; the holder then captures it again)."""

    __slots__ = ("__weakref__", "_graph")

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self._graph: torch.cuda.CUDAGraph | None = graph

    @property
    def expired(self) -> bool:
        return self._graph is None

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("this CUDA graph was destroyed with the other graphs of its device (recorded_graphs: "
                               "more than MAX_PARKED were let go of); capture it again")
        self._graph.replay()


class DeviceGraphs:
    """The graphs recorded on one device: each CUDAGraph by a token, the held ones' RecordedGraph by the same token;
    a token without a held RecordedGraph is parked. Graphs are recorded, replayed and let go of from one thread (as
    CUDA graph capture asks); a finaliser on another thread sees a capture under way (`capturing`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.held: dict[int, weakref.ref] = {}
        self.capturing = False  # a recording's capture under way (finalisers on other threads see it too)
        self.in_use = 0  # loops replaying a held graph across other recordings (`replays_under_way`)

    def hold(self, graph: torch.cuda.CUDAGraph, token: int) -> RecordedGraph:
        recorded = RecordedGraph(graph)
        self.graphs[token] = graph
        weakref.finalize(recorded, self.release, token).atexit = False  # (at exit torch tears the graphs down)
        self.held[token] = weakref.ref(recorded)
        return recorded

    def release(self, token: int) -> None:
        """The holder let go of the graph of `token` (a finaliser: at any point, a capture's included)."""
        if self.held.pop(token, None) is not None:
            self.destroy_unheld()

    def parked(self) -> int:
        return len(self.graphs) - len(self.held)

    def destroy_unheld(self) -> None:
        """Destroys every graph once none is held, unless a capture is under way (it then waits for a later release
        or recording: a graph captured since must not lose its workspace while held)."""
        if self.graphs and not self.held and not self.capture_under_way():
            self._destroy()

    def flush(self) -> None:
        """Before a recording begins: destroys every graph where none is held, or where more than MAX_PARKED are
        parked and no loop replays a held one (`in_use`): the held ones then expire, and their holders, which check
        `expired` before they replay, capture theirs again."""
        due = self.graphs and (not self.held or self.parked() > MAX_PARKED)
        if due and not self.in_use and not self.capture_under_way():
            self._destroy()

    def capture_under_way(self) -> bool:
        return self.capturing or torch.cuda.is_current_stream_capturing()

    def _destroy(self) -> None:
        torch.cuda.synchronize(self.device)  # (a replay in flight still runs its graph)
        for ref in self.held.values():
            recorded = ref()
            if recorded is not None:
                recorded._graph = None
        self.held.clear()
        self.graphs.clear()


_DEVICES: dict[int, DeviceGraphs] = {}
_TOKENS = itertools.count()


def device_graphs(device: torch.device) -> DeviceGraphs:
    """The recorded graphs of `device` (made on first use)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _DEVICES:
        _DEVICES[index] = DeviceGraphs(torch.device("cuda", index))
    return _DEVICES[index]


def record_graph(run: Callable[[], torch.Tensor], device: torch.device, pool=None,
                 reset: Callable[[], None] | None = None) -> tuple[RecordedGraph, torch.Tensor]:
    """A CUDA graph of run() and the output buffer each replay refills, after WARM_UP_RUNS eager runs on a side stream
    (what must not happen inside a capture: kernels compiled and autotuned, cuBLAS's handles made, the caching
    allocator's blocks found). One is enough, since they all happen on a kernel's first call, and each costs a whole
    uncaptured step (a quarter of a second for the 48-layer FP8 flagship: most of a capture's time). pool: a memory
    pool shared with other graphs replayed one at a time. reset: called before each warm-up run after the first, so
    that every one starts from the same state (a decoding step writes its token at the cache's counter and moves it
    on: a run from where the last left off would write one slot further, past the buffer when the step's token has
    the cache's last slot); the caller puts its state back after the capture."""
    graphs = device_graphs(device)
    graphs.flush()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for warm_up in range(WARM_UP_RUNS):
            if warm_up and reset is not None:
                reset()
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, token = torch.cuda.CUDAGraph(), next(_TOKENS)
    graphs.capturing, graphs.graphs[token] = True, graph  # (parked until held: so also a capture that fails)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=graphs.stream):
            out = run()
    except BaseException as error:
        graphs.capturing = False
        _let_go(error)
        del graph
        graphs.destroy_unheld()
        raise
    graphs.capturing = False
    return graphs.hold(graph, token), out


def _let_go(error: BaseException) -> None:
    """Clears the locals of the frames under record_graph in `error`'s traceback (torch's capture context holds the
    graph there), so that a kept exception (a REPL's last one) does not destroy the failed graph whenever it is
    dropped: the registry destroys it with the others. (record_graph's own frame is still running: it lets go
    itself.)"""
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__.tb_next)


@contextlib.contextmanager
def replays_under_way(device: torch.device) -> Iterator[None]:
    """While a loop replays a held graph of `device` and may record others meanwhile (a verify round's loop, whose
    assistant model captures its own steps): no flush expires the held graphs. A no-op off CUDA."""
    graphs = device_graphs(device) if torch.device(device).type == "cuda" else None
    if graphs is not None:
        graphs.in_use += 1
    try:
        yield
    finally:
        if graphs is not None:
            graphs.in_use -= 1
