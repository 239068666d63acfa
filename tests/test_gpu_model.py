"""GPU checks of the model family (skipped without CUDA): the fla path against the pure-PyTorch path, and
CUDA-graph decoding against eager decoding."""

from __future__ import annotations

import pytest
import torch

from hybrid_linear_models import ops
from model_helpers import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _without_fla(monkeypatch):
    monkeypatch.setattr(ops, "_fla_ops", lambda: None)


@pytest.mark.skipif(not torch.cuda.is_available() or ops._fla_ops() is None, reason="needs fla")
def test_fla_path_matches_torch_path(monkeypatch):
    """Same model on the GPU through fla's kernels and through ours (float32 inputs; fla computes its dot products
    in TF32, hence ~1e-3 relative)."""
    model = tiny_model().cuda()
    input_ids = torch.randint(0, 128, (2, 300), device="cuda")
    with torch.no_grad():
        fla_logits = model(input_ids).logits
        _without_fla(monkeypatch)
        torch_logits = model(input_ids).logits
    assert (fla_logits - torch_logits).abs().max() <= 2e-3 * torch_logits.abs().max()


def test_cuda_graph_decoding_matches_eager_decoding():
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]).cuda()
    input_ids = torch.randint(1, 128, (3, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    graphed = model.generate(input_ids, **kwargs)
    assert model._graph_decoder._graph is not None  # the graph path ran
    model.set_cuda_graph_decoding(False)
    eager = model.generate(input_ids, **kwargs)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.scores, eager.scores):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_bf16_training_step_on_gpu_is_finite():
    model = tiny_model().cuda().to(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 256), device="cuda")
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
