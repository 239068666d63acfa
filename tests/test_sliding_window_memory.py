"""Sliding-window attention runs block by block (O(T * window) memory) and equals transformers' masked attention.

The reference is the same model with the block path switched off (`_described_mask` returning None), which hands
the layers transformers' 4-D sliding-window mask. The blocked path sums the same terms (the keys it skips are exactly
those the mask hides, whose softmax weights are exactly 0), in another order: in float64 the two agree to ~1e-13, which
is what the tight comparisons below check; in float32 the different order of the softmax sums moves the logits by a few
float32 ulps of their size per layer, hence the float32 check's 1e-5 relative tolerance.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_helpers import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_linear_models import mixer_attention, modeling_hybrid_linear
from hybrid_linear_models.mixer_attention import SlidingWindowMask
from hybrid_linear_models.modeling_hybrid_linear import HybridLinearModel

LAYERS = ["sliding_attention", "gated_deltanet", "sliding_attention", "kimi_delta_attention"]
T = 150  # with query blocks of at least 16 (below): ten blocks for window 6, four for window 40


@pytest.fixture(autouse=True)
def small_query_blocks(monkeypatch):
    """Blocks of 16 queries (256 in use) so that short inputs cross many block boundaries."""
    monkeypatch.setattr(mixer_attention, "_MIN_QUERY_BLOCK", 16)


@contextlib.contextmanager
def reference(monkeypatch):
    """Context in which sliding layers get transformers' materialised mask (the path before the blocked one)."""
    with monkeypatch.context() as patch:
        patch.setattr(HybridLinearModel, "_described_mask", lambda *args, **kwargs: None)
        yield


def both_paths(monkeypatch, run):
    blocked = run()
    with reference(monkeypatch):
        expected = run()
    return blocked, expected


def ids(batch=2, length=T, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padding_mask():
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :7] = 0
    mask[1, :60] = 0  # longer than a query block: whole blocks of pads
    return mask


CASES = {
    "plain": lambda m: m(ids()).logits,
    "left-padded": lambda m: m(ids(), attention_mask=left_padding_mask()).logits * left_padding_mask()[..., None],
    "packed": lambda m: m(ids(1), position_ids=torch.cat([torch.arange(50), torch.arange(70), torch.arange(30)])[None]
                          ).logits,
    "chunked prefill and decode": lambda m: _chunked_prefill_then_decode(m),
}


def _chunked_prefill_then_decode(model):
    first = model(ids()[:, :90], use_cache=True)
    second = model(ids()[:, 90:], cache=first.cache)
    steps = [second]
    for token in (3, 4, 5):
        steps.append(model(torch.full((2, 1), token), cache=steps[-1].cache))
    return torch.cat([first.logits] + [step.logits for step in steps], dim=1)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [6, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_blocked_sliding_window_equals_the_masked_path(monkeypatch, implementation, window, case):
    model = tiny_model(LAYERS, sliding_window=window, attn_implementation=implementation).double()
    with torch.no_grad():
        blocked, expected = both_paths(monkeypatch, lambda: CASES[case](model))
    assert torch.isfinite(blocked).all()
    torch.testing.assert_close(blocked, expected, rtol=1e-10, atol=1e-10)


def test_blocked_sliding_window_float32_within_summation_order(monkeypatch):
    model = tiny_model(LAYERS, sliding_window=6)
    with torch.no_grad():
        blocked, expected = both_paths(monkeypatch, lambda: model(ids()).logits)
    torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_blocked_sliding_window_gradients_equal_the_masked_path(monkeypatch, implementation):
    model = tiny_model(LAYERS, sliding_window=6, attn_implementation=implementation).double()
    mask = left_padding_mask()
    # the logits of a pad are never read: a pad sees no key, and the two paths fill its row differently (transformers'
    # mask leaves the whole row to softmax, the blocks its block); so no label follows a pad (labels are shifted)
    follows_pad = torch.nn.functional.pad(mask, (1, 0))[:, :-1] == 0
    labels = ids().masked_fill((mask == 0) | follows_pad, -100)

    def gradients():
        model.zero_grad()
        loss = model(ids(), attention_mask=mask, labels=labels).loss
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    blocked, expected = both_paths(monkeypatch, gradients)
    torch.testing.assert_close(blocked, expected, rtol=1e-9, atol=1e-11)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def largest_tensor(model, input_ids) -> int:
    with torch.no_grad(), LargestTensor() as spy:
        model(input_ids, use_cache=False)
    return spy.numel


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_sliding_window_prefill_builds_no_t_by_t_tensor(monkeypatch, implementation):
    monkeypatch.setattr(mixer_attention, "_MIN_QUERY_BLOCK", 256)  # the blocks in use
    length = 2048
    model = tiny_model(["sliding_attention"], sliding_window=128, attn_implementation=implementation,
                       vocab_size=16, hidden_size=16, intermediate_size=16)
    input_ids = ids(1, length) % 16
    blocked = largest_tensor(model, input_ids)
    assert blocked < length * length // 8  # the largest is a block's scores: heads x 256 x (256 + 127) at most
    with reference(monkeypatch):  # the spy does see the materialised mask: the check can fail
        assert largest_tensor(model, input_ids) >= length * length


def test_described_mask_is_described_not_built_for_a_padded_prefill(monkeypatch):
    built = []
    real = modeling_hybrid_linear.create_sliding_window_causal_mask
    monkeypatch.setattr(modeling_hybrid_linear, "create_sliding_window_causal_mask",
                        lambda **kwargs: built.append(1) or real(**kwargs))
    model = tiny_model(["sliding_attention"])
    seen = []
    monkeypatch.setattr(model.model.layers[0].self_attn, "forward", _recording(model.model.layers[0].self_attn, seen))
    model(ids(), attention_mask=left_padding_mask())
    assert not built and isinstance(seen[0], SlidingWindowMask)


def _recording(module, seen):
    forward = module.forward

    def record(hidden_states, position_embeddings, attention_mask, **kwargs):
        seen.append(attention_mask)
        return forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    return record


def test_full_attention_sdpa_prefill_builds_no_t_by_t_tensor():
    length = 2048
    model = tiny_model(["full_attention"], vocab_size=16, hidden_size=16, intermediate_size=16)
    assert largest_tensor(model, ids(1, length) % 16) < length * length // 8  # sdpa's is_causal: no mask at all


# ------------------------------------------------------------------------ full attention, described (long prompts)

FULL_LAYERS = ["full_attention", "gated_deltanet", "mla_attention", "kimi_delta_attention"]


@contextlib.contextmanager
def full_masks_described(monkeypatch):
    """Prompts of 32 tokens or more get the full-attention mask described, in blocks of 16 queries."""
    with monkeypatch.context() as patch:
        patch.setattr(modeling_hybrid_linear, "DESCRIBED_MASK_QUERIES", 32)
        patch.setattr(mixer_attention, "_MAX_QUERY_BLOCK", 16)
        yield


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", ["left-padded", "packed", "chunked prefill and decode"])
def test_described_full_attention_equals_the_masked_path(monkeypatch, implementation, case):
    """Full attention and MLA with their mask described (a long prompt that is padded, packed or continues a cache)
    against transformers' materialised mask, in float64."""
    model = tiny_model(FULL_LAYERS, attn_implementation=implementation).double()
    seen = []
    monkeypatch.setattr(model.model.layers[0].self_attn, "forward", _recording(model.model.layers[0].self_attn, seen))
    with torch.no_grad():
        with full_masks_described(monkeypatch):
            described = CASES[case](model)
        assert any(isinstance(mask, SlidingWindowMask) for mask in seen)
        seen.clear()
        expected = CASES[case](model)
        assert not any(isinstance(mask, SlidingWindowMask) for mask in seen)
    assert torch.isfinite(described).all()
    torch.testing.assert_close(described, expected, rtol=1e-10, atol=1e-10)


def test_a_long_padded_prompt_builds_no_t_by_t_mask(monkeypatch):
    """A left-padded prompt past DESCRIBED_MASK_QUERIES: no tensor of T x T elements (the materialised mask is
    [batch, 1, T, T]); below it (the spy's check), the mask is built."""
    monkeypatch.setattr(modeling_hybrid_linear, "DESCRIBED_MASK_QUERIES", 1024)
    length = 4096
    model = tiny_model(["full_attention", "gated_deltanet"], vocab_size=16, hidden_size=16, intermediate_size=16)
    input_ids = ids(2, length) % 16
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :100] = 0
    with torch.no_grad(), LargestTensor() as spy:
        model(input_ids, attention_mask=mask, use_cache=False)
    assert spy.numel <= 2 * 1024 * length  # (a block of 1,024 queries: rows x heads x 1,024 x keys at most)
    monkeypatch.setattr(modeling_hybrid_linear, "DESCRIBED_MASK_QUERIES", 4 * length)
    with torch.no_grad(), LargestTensor() as spy:
        model(input_ids, attention_mask=mask, use_cache=False)
    assert spy.numel >= 2 * length * length
