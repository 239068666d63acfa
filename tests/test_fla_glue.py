"""The glue around fla's ops, checked on the CPU with each op stood in by its documented contract, so these tests pin
our side of the call (fla's kernels themselves are compared on GPUs in test_gpu_model.py and test_ops_gpu.py; the
contracts were checked against fla's real kernels under triton's interpreter).

- `block_ops.fused_causal_lm_loss` hands fla's `fused_linear_cross_entropy_loss` flattened hidden states, the LM head
  and the shifted labels, and scales its sum by `num_items_in_batch`. Contract: cross-entropy of x @ W^T against the
  targets, `ignore_index` skipped, mean over the counted targets or sum.
- `ops.causal_conv1d` converts its state ([N, C, K-1], the last K-1 inputs) to fla's ([N, C, K], the last K inputs,
  the oldest never read) and back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from hybrid_linear_models import block_ops, fla_backend, ops
from hybrid_linear_models.kernels_conv import causal_conv1d_torch


def _fla_contract_loss(x, target, weight, ignore_index=-100, reduction="mean", num_chunks=8,
                       accumulate_grad_in_fp32=True):
    return F.cross_entropy(F.linear(x, weight).float(), target, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def fake_fla(monkeypatch):
    fake = SimpleNamespace(fused_linear_cross_entropy_loss=_fla_contract_loss)
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: fake)


@pytest.mark.parametrize("items", [None, 57])
@pytest.mark.parametrize("given_shift_labels", [False, True])
def test_fused_loss_glue_matches_transformers_loss(fake_fla, items, given_shift_labels):
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16), torch.randn(30, 16)
    labels = torch.randint(0, 30, (2, 9))
    labels[0, :3] = -100
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous() if given_shift_labels else None
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, hidden, weight)]
    fused = block_ops.fused_causal_lm_loss(leaves[0], leaves[1], labels, shift_labels=shift_labels,
                                           num_items_in_batch=items)
    reference = ForCausalLMLoss(F.linear(leaves[2], leaves[3]), labels, 30, num_items_in_batch=items,
                                shift_labels=shift_labels)
    (fused + reference).backward()
    torch.testing.assert_close(fused, reference.to(fused.dtype), rtol=1e-6, atol=0)
    torch.testing.assert_close(leaves[0].grad, leaves[2].grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaves[1].grad, leaves[3].grad, rtol=1e-6, atol=1e-7)


def test_fused_loss_runs_as_one_chunk_while_its_logits_fit(monkeypatch):
    """One chunk keeps the LM head's gradient a single GEMM in the weights' dtype (no float32 GEMMs); larger logits
    are split, with the gradient accumulated in float32 across chunks."""
    calls = []
    fake = SimpleNamespace(fused_linear_cross_entropy_loss=lambda *a, **k: calls.append(k) or _fla_contract_loss(*a, **k))
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: fake)
    hidden, weight, labels = torch.randn(2, 8, 16), torch.randn(30, 16), torch.randint(0, 30, (2, 8))
    block_ops.fused_causal_lm_loss(hidden, weight, labels)
    assert calls[-1]["num_chunks"] == 1 and calls[-1]["accumulate_grad_in_fp32"] is False
    assert block_ops.loss_chunking(16384, 32000, 2) == {"num_chunks": 1, "accumulate_grad_in_fp32": False}  # bench
    monkeypatch.setattr(block_ops, "LOSS_CHUNK_BYTES", 3 * 30 * 4)  # float32 logits of 3 tokens per chunk
    block_ops.fused_causal_lm_loss(hidden, weight, labels)
    assert calls[-1]["num_chunks"] == 6 and calls[-1]["accumulate_grad_in_fp32"] is True


def test_fused_loss_is_not_used_without_fla_or_for_float64(monkeypatch):
    hidden, weight, labels = torch.randn(1, 4, 8), torch.randn(10, 8), torch.randint(0, 10, (1, 4))
    assert block_ops.fused_causal_lm_loss(hidden, weight, labels) is None  # CPU: no fla
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: SimpleNamespace())
    assert block_ops.fused_causal_lm_loss(hidden.double(), weight.double(), labels) is None


def _fla_contract_conv(x, weight, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's causal_conv1d for one unpacked batch: the state holds the K inputs before the sequence, oldest first;
    out_t = act(sum_i weight[:, i] x_{t-K+1+i}); the final state is the last K inputs."""
    assert cu_seqlens is None
    B, T, C = x.shape
    K = weight.shape[1]
    state = initial_state if initial_state is not None else x.new_zeros(B, C, K)
    ext = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, K + T, C]
    out = sum(weight[:, i] * ext[:, 1 + i : 1 + i + T] for i in range(K))
    out = F.silu(out) if activation in ("silu", "swish") else out
    return out, (ext[:, -K:].transpose(1, 2) if output_final_state else None)


def test_conv_state_is_converted_to_and_from_fla_layout(monkeypatch):
    torch.manual_seed(0)
    x, weight, state = torch.randn(2, 7, 5), torch.randn(5, 4), torch.randn(2, 5, 3)
    expected, expected_final = causal_conv1d_torch(x, weight, "silu", state, True)
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: SimpleNamespace(causal_conv1d=_fla_contract_conv))
    out, final = ops.causal_conv1d(x, weight, initial_state=state, output_final_state=True)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(final, expected_final)


def test_a_state_viewed_in_a_window_reaches_fla_as_that_window(monkeypatch):
    """The caches keep the state as the last K-1 columns of a [N, C, K] window (fla's layout): the window itself goes
    to fla (no padded copy), whatever its first column holds (fla never reads it), with the same outputs."""
    torch.manual_seed(0)
    x, weight, state = torch.randn(2, 7, 5), torch.randn(5, 4), torch.randn(2, 5, 3)
    window = torch.cat([torch.full((2, 5, 1), float("nan")), state], dim=-1)  # column 0: never read
    seen = []

    def fla_conv(x, weight, initial_state=None, **kwargs):
        seen.append(initial_state)
        return _fla_contract_conv(x, weight, initial_state=torch.nan_to_num(initial_state, nan=1e9), **kwargs)

    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: SimpleNamespace(causal_conv1d=fla_conv))
    expected, expected_final = causal_conv1d_torch(x, weight, "silu", state, True)
    out, final = ops.causal_conv1d(x, weight, initial_state=window[..., 1:], output_final_state=True)
    assert seen[0].data_ptr() == window.data_ptr() and seen[0].shape == window.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(final, expected_final)
    out, _ = ops.causal_conv1d(x, weight, initial_state=state.clone())  # not a window's view: padded, a copy
    assert seen[1].data_ptr() != state.data_ptr() and seen[1].shape == window.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)



def _fla_contract_conv_update(x, cache, weight=None, activation=None):
    """fla's causal_conv1d_update: cache [N, C, K] holds the last K inputs; x [N, 1, C] is shifted in, in place;
    out = act(sum_i weight[:, i] cache[:, :, i]) over the updated cache."""
    cache.copy_(torch.cat([cache[..., 1:], x.transpose(1, 2)], dim=-1))
    out = (cache * weight).sum(-1).unsqueeze(1)
    return (F.silu(out) if activation in ("silu", "swish") else out), cache


def test_conv_step_hands_fla_the_window_and_matches_the_torch_path(monkeypatch):
    torch.manual_seed(0)
    x, weight, state = torch.randn(3, 1, 6), torch.randn(6, 1, 4), torch.randn(3, 6, 3)
    window = F.pad(state, (1, 0))
    expected, expected_state = causal_conv1d_torch(x, weight.squeeze(1), "silu", state, True)
    monkeypatch.setattr(fla_backend, "fla_for",
                        lambda tensor: SimpleNamespace(causal_conv1d_update=_fla_contract_conv_update))
    out = ops.causal_conv1d_step(x, weight, window)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(window[..., 1:], expected_state)


def _fake_fla_package(monkeypatch, modules: dict[str, dict]) -> None:
    """Installs a stand-in `fla` package holding only `modules` (dotted name -> attributes) in sys.modules."""
    import sys
    import types

    for name in ["fla", *modules]:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            dotted = ".".join(parts[:depth])
            if dotted not in sys.modules or depth == len(parts):
                module = types.ModuleType(dotted)
                module.__path__ = []  # a package, so that submodule imports look in sys.modules only
                monkeypatch.setitem(sys.modules, dotted, module)
        for attribute, value in modules.get(name, {}).items():
            setattr(sys.modules[name], attribute, value)


def test_fla_ops_load_per_module_so_one_missing_module_keeps_the_others(monkeypatch, caplog):
    """A module missing from the installed fla (here its norms) sends only its own ops to the torch path."""
    def swiglu(gate, up):
        return gate * up

    _fake_fla_package(monkeypatch, {"fla.modules.activations": {"swiglu": swiglu}})
    kernels = fla_backend.LazyFlaKernels()
    with caplog.at_level("WARNING", logger=fla_backend.logger.name):
        assert kernels.swiglu is swiglu
        assert kernels.rms_norm is None and kernels.rms_norm is None  # looked up twice, said once
    missing = [r.message for r in caplog.records if "fla.modules.norm.layernorm.rms_norm" in r.message]
    assert len(missing) == 1 and "torch path" in missing[0]
    with pytest.raises(AttributeError):
        kernels.not_an_fla_op  # noqa: B018


def test_fla_kernel_is_the_one_choice_of_backend(monkeypatch):
    """fla serves an op only for a non-float64 plain tensor and an importable kernel; otherwise the torch path."""
    def swiglu(gate, up):
        return gate * up

    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: SimpleNamespace(swiglu=swiglu, rms_norm=None))
    x = torch.randn(2, 3)
    assert fla_backend.fla_kernel("swiglu", x, x) is swiglu
    assert fla_backend.fla_kernel("swiglu", x.double()) is None  # float64 keeps the exact torch path
    assert fla_backend.fla_kernel("rms_norm", x) is None  # that kernel did not import
    assert fla_backend.fla_kernel("chunk_kda", x) is None  # not in this fla at all
    torch.testing.assert_close(block_ops.rms_norm(x, torch.ones(3), 1e-6),
                               x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: None)
    assert fla_backend.fla_kernel("swiglu", x) is None  # CPU tensor, or fla not importable


@pytest.mark.parametrize("hopper, above_3_4, above_3_7_1, tilelang, refused", [
    (True, True, False, False, True),  # fla 0.6's refusal: Hopper, triton 3.4 to 3.7.0, no tilelang
    (True, True, True, False, False),  # triton 3.7.1 or later
    (True, True, False, True, False),  # tilelang serves the kernel
    (False, True, False, False, False),  # not Hopper
    (True, False, False, False, False),  # triton older than 3.4
])
def test_training_refusal_names_fla_s_triton_condition_before_a_forward(monkeypatch, hopper, above_3_4, above_3_7_1,
                                                                        tilelang, refused):
    """fla_training_refusal states, before any training step, the condition under which fla's gated backward raises
    in the first backward (fla.utils' flags, stood in here), and the fix; None elsewhere and off CUDA."""
    import importlib.util
    import sys

    monkeypatch.setattr(fla_backend, "fla_kernels", lambda: object())
    monkeypatch.setitem(sys.modules, "fla", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "fla.utils", SimpleNamespace(
        IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=above_3_4, TRITON_ABOVE_3_7_1=above_3_7_1))
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.6.0"))
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "tilelang":
            return object() if tilelang else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    reason = fla_backend.fla_training_refusal(torch.device("cuda"))
    assert (reason is not None) == refused
    if refused:
        assert "triton 3.6.0" in reason and "triton>=3.7.1" in reason and "\n" not in reason
    assert fla_backend.fla_training_refusal(torch.device("cpu")) is None


def test_fla_is_loaded_where_the_weights_land_not_at_the_first_call(monkeypatch, tmp_path):
    """Moving a model (`to`, `cuda`) and `from_pretrained` hand its weights to fla_for, which imports fla for a CUDA
    tensor (and nothing for others): the import's seconds are paid at load, not by the first generate."""
    from model_helpers import tiny_model

    from hybrid_linear_models import HybridLinearForCausalLM

    model = tiny_model(["gated_deltanet", "full_attention"])
    model.save_pretrained(tmp_path)
    asked: list[torch.Tensor] = []
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: asked.append(tensor))
    model.to(torch.float64)
    assert asked and asked[-1].dtype == torch.float64
    asked.clear()
    loaded, info = HybridLinearForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert asked and not info["missing_keys"]
    assert any(tensor is next(loaded.parameters()) for tensor in asked)
