"""The lifetime of recorded CUDA graphs on a GPU (recorded_graphs.py):
- letting go of one graph while another captured on its stream is held frees nothing (the allocator's count of
  allocated bytes, pools included): the cuBLAS workspace the held graph's GEMMs write to stays allocated, also under
  the torch releases whose graph destruction frees its stream's workspaces;
- every graph of the device is destroyed once none is held;
- a recording that begins with more than MAX_PARKED parked expires the held graphs first."""

from __future__ import annotations

import gc

import pytest
import torch

from hybrid_linear_models import recorded_graphs
from hybrid_linear_models.recorded_graphs import record_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _operands():
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, generator=generator)
    return x, w


def _freed_by(drop) -> int:
    """Bytes the caching allocator counts as freed (pools' blocks included) by drop() and a collection."""
    gc.collect()  # (what earlier tests left to the collector is not counted)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    drop()
    gc.collect()
    torch.cuda.synchronize()
    return before - torch.cuda.memory_allocated()


def _own(devices, before: set) -> set:
    """The tokens of the graphs recorded since `before` was taken (other tests' graphs may be held too)."""
    return set(devices.graphs) - before


def test_a_recorded_graph_keeps_its_workspace_when_another_is_let_go_of():
    x, w = _operands()
    pool = torch.cuda.graph_pool_handle()
    devices = recorded_graphs.device_graphs(x.device)
    before = set(devices.graphs)
    first, product = record_graph(lambda: x @ w, x.device, pool)
    second, _ = record_graph(lambda: x @ w, x.device, pool)
    parked = devices.parked()

    def drop():
        nonlocal second
        second = None

    assert _freed_by(drop) == 0 and devices.parked() == parked + 1  # kept alive, not destroyed: the first is held
    first.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(product.float(), x.float() @ w.float(), rtol=1e-2, atol=0.5)
    assert len(_own(devices, before)) == 2
    if len(devices.held) == 1:  # (no other test's graph held in this process)

        def drop_first():
            nonlocal first
            first = None

        _freed_by(drop_first)
        assert not _own(devices, before)  # nothing held: every graph of the device destroyed together


def test_past_max_parked_a_recording_expires_the_held_graphs_first():
    x, w = _operands()
    held, _ = record_graph(lambda: x @ w, x.device)
    for _ in range(recorded_graphs.MAX_PARKED + 1):
        record_graph(lambda: x @ w, x.device)  # let go of at once: parked, the held one untouched
    assert not held.expired
    new, product = record_graph(lambda: x @ w, x.device)
    assert held.expired and not new.expired
    with pytest.raises(RuntimeError, match="capture it again"):
        held.replay()
    new.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(product.float(), x.float() @ w.float(), rtol=1e-2, atol=0.5)
