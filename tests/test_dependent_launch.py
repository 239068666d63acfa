"""Programmatic dependent launch of the decoding kernels (kernels_launch_triton): a kernel that starts before the one
ahead of it has finished must still read that kernel's output, never what the buffer held before. On a GPU of compute
capability 9.0 or later, chains of this package's kernels, each reading what the one before wrote, replayed from CUDA
graphs with new inputs each time, give the same bits with dependent launches as launched plainly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs a GPU of compute "
                                                        "capability 9.0 or later (and triton)")


def _chain(x: torch.Tensor, weights: dict) -> list[torch.Tensor]:
    """A wide GEMV (many waves of programs: the next kernel starts early, during its last ones), then an RMSNorm with
    its residual, the gated MLP's GEMV with SwiGLU pairs, a GEMV through a row index, and a last RMSNorm: each kernel
    reads what the previous one wrote."""
    from hybrid_linear_models.kernels_gemv import swiglu_pair_rows
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv
    from hybrid_linear_models.kernels_norm_triton import triton_rms_norm

    wide = triton_gemv(x, weights["wide"], None)
    normed, summed = triton_rms_norm(wide, weights["norm"], 1e-6, weights["residual"])
    paired = triton_gemv(normed, weights["gate_up"], None, swiglu_pair_rows(weights["gate_up"].shape[0] // 2, x.device),
                         swiglu_pairs=True)
    picked = triton_gemv(paired, weights["down"], weights["bias"], weights["rows"])
    return [wide, summed, paired, picked, triton_rms_norm(picked, weights["last_norm"], 1e-6)]


def _replays(inputs: list[torch.Tensor], weights: dict) -> list[list[torch.Tensor]]:
    """The chain captured in a CUDA graph (after warm-up runs: autotuning, compilation), replayed for each input."""
    from hybrid_linear_models.recorded_graphs import record_graph

    buffer = inputs[0].clone()
    graph, outputs = record_graph(lambda: _chain(buffer, weights), buffer.device)
    results = []
    for x in inputs:
        buffer.copy_(x)
        graph.replay()
        results.append([t.clone() for t in outputs])
    torch.cuda.synchronize()
    return results


@needs_hopper
@pytest.mark.parametrize("rows", [1, 4])  # the one-row form and the tl.dot form of the GEMV
def test_dependent_launches_read_what_the_kernel_before_wrote(monkeypatch, rows):
    from hybrid_linear_models import kernels_launch_triton
    from hybrid_linear_models.kernels_launch_triton import dependent_launch

    assert dependent_launch(torch.device("cuda"))["PDL"]  # (on where this test runs)
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to("cuda", torch.bfloat16)

    hidden, wide, inner = 2048, 16384, 2048
    weights = dict(wide=randn(wide, hidden, scale=hidden ** -0.5), norm=randn(wide), residual=randn(rows, wide),
                   gate_up=randn(2 * inner, wide, scale=wide ** -0.5), down=randn(hidden, inner, scale=inner ** -0.5),
                   bias=randn(hidden), rows=torch.randperm(hidden, generator=g).cuda(), last_norm=randn(hidden))
    inputs = [randn(rows, hidden) for _ in range(6)]
    with_pdl = _replays(inputs, weights)
    monkeypatch.setattr(kernels_launch_triton, "PDL_DEVICE_TYPES", ())
    assert not dependent_launch(torch.device("cuda"))["PDL"]
    plain = _replays(inputs, weights)
    for step, (ours, reference) in enumerate(zip(with_pdl, plain)):
        for name, a, b in zip(("wide", "summed", "paired", "picked", "normed"), ours, reference):
            assert torch.equal(a, b), f"input {step}: the {name} output differs with dependent launches"
    # (each replay's outputs are its own input's: not the previous replay's, which a read before the wait would give)
    assert not torch.equal(with_pdl[0][-1], with_pdl[1][-1])
