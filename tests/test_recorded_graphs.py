"""When recorded CUDA graphs are destroyed (recorded_graphs.DeviceGraphs), on the CPU: graphs stood in by objects
whose destruction a weak reference shows, torch's stream and synchronisation stood in too.
- A graph let go of stays alive while another is held; the last one let go of destroys them all.
- A release never expires a held graph; a recording that begins with more than MAX_PARKED parked destroys every
  graph first (the held ones expire), unless a loop replays a held one (`replays_under_way`).
- Nothing is destroyed during a capture, nor after it while the graph it captured is held; a failed capture is
  parked, and an exception kept from it does not destroy it later.
- A model whose step graphs are evicted and flushed over and over still generates what graphs-off generates.
(tests/test_gpu_recorded_graphs.py: the same rules on a GPU.)"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref

import pytest
import torch
from model_helpers import tiny_model

from hybrid_linear_models import cuda_graph_decoding, recorded_graphs
from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder
from hybrid_linear_models.recorded_graphs import (
    DeviceGraphs,
    RecordedGraph,
    replays_under_way,
)


class FakeGraph:
    """Stands for a CUDAGraph: counts its replays and its destructions; `made` holds a weak reference to each."""

    destroyed, made = 0, []

    def __init__(self):
        self.replays = 0
        FakeGraph.made.append(weakref.ref(self))

    def replay(self):
        self.replays += 1

    def __del__(self):
        FakeGraph.destroyed += 1


class EagerRecorded:
    """A holder's view of a stood-in recording: the RecordedGraph's replay and expiry, and the captured run eagerly."""

    def __init__(self, recorded: RecordedGraph, run, out):
        self.recorded, self.run, self.out = recorded, run, out

    @property
    def expired(self) -> bool:
        return self.recorded.expired

    def replay(self):
        self.recorded.replay()  # (raises where the graph expired)
        self.out.copy_(self.run())


@pytest.fixture
def device_graphs(monkeypatch):
    capturing = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(capturing))
    graphs = DeviceGraphs(torch.device("cpu"))
    graphs.capture_on_this_thread = capturing
    yield graphs
    gc.collect()  # (what the test left is released while torch's functions are still stood in)


def _record(graphs: DeviceGraphs, token: int) -> tuple[RecordedGraph, weakref.ref]:
    """What record_graph does around a capture that cannot fail: the flush, then the new graph held."""
    graphs.flush()
    fake = FakeGraph()
    return graphs.hold(fake, token), weakref.ref(fake)


def test_a_graph_let_go_of_is_kept_while_another_is_held(device_graphs):
    first, first_alive = _record(device_graphs, 0)
    second, second_alive = _record(device_graphs, 1)
    del second
    gc.collect()
    assert second_alive() is not None and device_graphs.parked() == 1
    first.replay()
    assert first_alive().replays == 1
    del first
    gc.collect()
    assert first_alive() is None and second_alive() is None  # the last one let go of: all destroyed together
    assert not device_graphs.graphs and not device_graphs.held


def test_past_max_parked_the_next_recording_destroys_every_graph_first(device_graphs):
    held, held_alive = _record(device_graphs, 0)
    parked = [_record(device_graphs, token)[1] for token in range(1, recorded_graphs.MAX_PARKED + 2)]
    gc.collect()
    # released past the bound: a release expires nothing (its holder may be about to replay another graph)
    assert device_graphs.parked() == recorded_graphs.MAX_PARKED + 1 and not held.expired
    new, new_alive = _record(device_graphs, recorded_graphs.MAX_PARKED + 2)
    assert held.expired and held_alive() is None and all(alive() is None for alive in parked)
    assert not new.expired and list(device_graphs.graphs) == [recorded_graphs.MAX_PARKED + 2]
    with pytest.raises(RuntimeError, match="capture it again"):
        held.replay()
    del held  # its release after the destruction changes nothing
    gc.collect()
    assert new_alive() is not None and not new.expired


def test_no_flush_while_a_loop_replays_a_held_graph(device_graphs, monkeypatch):
    monkeypatch.setattr(recorded_graphs, "_DEVICES", {0: device_graphs})
    held, _ = _record(device_graphs, 0)
    for token in range(1, recorded_graphs.MAX_PARKED + 2):
        _record(device_graphs, token)
    with replays_under_way(torch.device("cuda", 0)):
        _record(device_graphs, 100)  # an assistant model's capture between two rounds
        assert not held.expired
    _record(device_graphs, 101)
    assert held.expired


def test_nothing_is_destroyed_during_a_capture_nor_after_it_while_its_graph_is_held(device_graphs):
    old, old_alive = _record(device_graphs, 0)
    device_graphs.capturing = True  # the next graph's capture: a collection releases the old one meanwhile
    del old
    gc.collect()
    assert old_alive() is not None
    device_graphs.capturing = False
    new = device_graphs.hold(FakeGraph(), 1)  # the graph that capture made: the old one still alive
    assert old_alive() is not None and not new.expired
    device_graphs.capture_on_this_thread.append(True)  # (a capture of this thread, seen through torch)
    del new
    gc.collect()
    assert old_alive() is not None
    device_graphs.capture_on_this_thread.clear()
    device_graphs.flush()  # the next recording: nothing held, so everything goes
    assert old_alive() is None and not device_graphs.graphs


class CaptureContext:
    """Stands for torch.cuda.graph: holds the graph as torch's does (`cuda_graph`); its end raises where asked."""

    fail = False

    def __init__(self, cuda_graph, pool=None, stream=None):
        self.cuda_graph = cuda_graph

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if CaptureContext.fail:
            raise RuntimeError("operation not permitted when stream is capturing")  # (capture_end's error)


@pytest.fixture
def recording(device_graphs, monkeypatch):
    """record_graph on the CPU: torch's graph, streams and device stood in; the device's graphs are `device_graphs`."""

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(recorded_graphs, "_DEVICES", {0: device_graphs})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", CaptureContext)
    monkeypatch.setattr(CaptureContext, "fail", False)
    return lambda: recorded_graphs.record_graph(lambda: torch.zeros(1), torch.device("cuda", 0))


def _failed_capture(recording) -> tuple[BaseException, weakref.ref]:
    CaptureContext.fail = True
    try:
        recording()
    except RuntimeError as error:
        kept = error  # (what a REPL keeps as its last exception)
    CaptureContext.fail = False
    return kept, FakeGraph.made[-1]


def test_a_failed_capture_goes_with_the_others_not_when_its_kept_exception_goes(device_graphs, recording):
    kept, failed_alive = _failed_capture(recording)
    # nothing held: destroyed at once, not later when the exception (whose frames held it) is dropped, which could be
    # while a newer graph of the stream is held
    assert failed_alive() is None and not device_graphs.graphs
    held, _ = recording()
    kept, failed_alive = _failed_capture(recording)
    assert failed_alive() is not None and not held.expired  # parked while a graph is held
    del kept
    gc.collect()
    assert failed_alive() is not None
    del held
    gc.collect()
    assert failed_alive() is None and not device_graphs.graphs


def test_step_graphs_evicted_and_flushed_over_and_over_generate_as_graphs_off(device_graphs, monkeypatch):
    """9 batch sizes in turn, 8 step graphs kept, 2 parked at the most: evictions park graphs right after a capture
    and flushes expire the kept ones; every call generates what the uncaptured forward does."""
    monkeypatch.setattr(CudaGraphDecoder, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(recorded_graphs, "MAX_PARKED", 2)
    assert cuda_graph_decoding.KEPT_STEP_GRAPHS == 8
    tokens = itertools.count()

    def record(run, device, reset, pool=None):  # record_graph's order: flush, warm-up run, capture, hold
        device_graphs.flush()
        run()
        reset()
        out = run()
        # the device's graph references no `run` (a CUDAGraph does not); the holder's replays run it eagerly
        return EagerRecorded(device_graphs.hold(FakeGraph(), next(tokens)), run, out), out

    monkeypatch.setattr(CudaGraphDecoder, "_record", staticmethod(record))
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]).double()
    destroyed = FakeGraph.destroyed
    kwargs = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        for call in range(20):
            ids = torch.randint(1, 100, (1 + call % 9, 6), generator=torch.Generator().manual_seed(call))
            graphed = model.generate(ids, cache_implementation="static", **kwargs)
            plain = model.generate(ids, use_cache=False, **kwargs)  # (no cache: nothing captured)
            torch.testing.assert_close(graphed, plain, rtol=0, atol=0)
            gc.collect()  # (a step graph and its `run` reference each other: the collector releases them)
    # the model holds step graphs throughout, so every destruction was a flush's, which expired the held ones
    assert FakeGraph.destroyed - destroyed > 10 and device_graphs.held
