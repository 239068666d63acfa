"""Each captured graph gets a capture stream no other live graph of the package holds (capture_streams): dropping one
graph frees the cuBLAS workspace of its own stream only. Stand-in streams (torch's pool lends 32 per priority,
round-robin; no CUDA here) and stand-in graphs (freed by dropping the last reference)."""

from __future__ import annotations

import gc
import itertools

import torch

from hybrid_linear_models.capture_streams import (
    POOLED_PER_PRIORITY,
    PRIORITIES,
    CaptureStreams,
)


class Stream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


def pooled_streams():
    """torch's pool as a maker: each priority's POOLED_PER_PRIORITY streams, lent round-robin (so a second call
    of a priority's whole round gives the same handles again)."""
    counters = {priority: itertools.count() for priority in PRIORITIES}

    def make(device, priority):
        return Stream(1000 * (PRIORITIES.index(priority) + 1) + next(counters[priority]) % POOLED_PER_PRIORITY)

    return make


class Graph:
    pass


def test_live_graphs_get_streams_of_their_own_and_give_them_back_when_freed():
    streams = CaptureStreams(pooled_streams())
    device = torch.device("cuda", 0)
    graphs, taken = [], []
    for _ in range(len(PRIORITIES) * POOLED_PER_PRIORITY):
        stream = streams.take(device)
        graph = Graph()
        streams.hold(graph, stream)
        graphs.append(graph)
        taken.append(stream.cuda_stream)
    assert len(set(taken)) == len(taken) == 64  # every pooled stream, each by one graph
    first = taken[0]
    del graphs[0]
    gc.collect()
    assert streams.take(device).cuda_stream == first  # the freed graph's stream is the free one
    shared = Graph()  # past the pool: a stream held by one graph only, not a busier one
    streams.hold(shared, streams.take(device))
    extra = streams.take(device)
    assert streams.holders(extra) == 1

