"""When recorded CUDA graphs are destroyed (recorded_graphs.DeviceGraphs), on the CPU: graphs stood in by objects
whose destruction a weak reference shows, torch's stream and synchronisation stood in too. A graph let go of while
another is held stays alive; the last one let go of destroys them all; more than MAX_PARKED parked destroy the held
ones too, which then say they expired; nothing is destroyed during a capture. (tests/test_gpu_recorded_graphs.py:
the same on a GPU, with the cuBLAS workspace that makes it matter.)"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hybrid_linear_models import recorded_graphs
from hybrid_linear_models.recorded_graphs import DeviceGraphs, RecordedGraph


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.fixture
def device_graphs(monkeypatch):
    capturing = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(capturing))
    graphs = DeviceGraphs(torch.device("cpu"))
    graphs.capturing = capturing
    return graphs


def _record(graphs: DeviceGraphs, token: int) -> tuple[RecordedGraph, weakref.ref]:
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


def test_more_than_max_parked_destroy_the_held_graphs_too(device_graphs):
    held, held_alive = _record(device_graphs, 0)
    parked = []
    for token in range(1, recorded_graphs.MAX_PARKED + 1):
        recorded, alive = _record(device_graphs, token)
        parked.append(alive)
        del recorded
    gc.collect()
    assert device_graphs.parked() == recorded_graphs.MAX_PARKED and not held.expired  # at the bound: kept
    _record(device_graphs, recorded_graphs.MAX_PARKED + 1)  # one more, let go of at once
    gc.collect()
    assert held.expired and held_alive() is None and all(alive() is None for alive in parked)
    with pytest.raises(RuntimeError, match="capture it again"):
        held.replay()
    del held  # its release after the destruction changes nothing
    gc.collect()
    assert not device_graphs.graphs and not device_graphs.held


def test_nothing_is_destroyed_during_a_capture(device_graphs):
    recorded, alive = _record(device_graphs, 0)
    device_graphs.capturing.append(True)  # a garbage collection inside another graph's capture
    del recorded
    gc.collect()
    assert alive() is not None and device_graphs.destroy_due
    device_graphs.capturing.clear()
    later, _ = _record(device_graphs, 1)  # the next recording destroys what was due before it holds its own
    assert alive() is None and list(device_graphs.graphs) == [1] and not later.expired


def test_a_failed_capture_is_parked_not_destroyed(device_graphs):
    held, _ = _record(device_graphs, 0)
    failed = FakeGraph()
    failed_alive = weakref.ref(failed)
    device_graphs.park(failed, 1)
    del failed
    gc.collect()
    assert failed_alive() is not None and not held.expired
    del held
    gc.collect()
    assert failed_alive() is None
