"""The decoder blocks' elementwise ops and the language-model loss, fused where fla offers a kernel.

For CUDA tensors with fla importable: fla's Triton RMSNorm (with the residual add), SwiGLU and fused linear +
cross-entropy (the loss without keeping the [tokens, vocab] logits for the backward). Otherwise plain torch with the
same math (float32 inside). The RMSNorm of inference (no gradient wanted) on CUDA runs as this package's Triton kernel
(`inference_norm`: fla's forward is compiled and tuned again for every new bucket of row counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import fla_backend
from .inference_norm import inference_rms_norm
from .kernels_delta_rule import compute_dtype

IGNORE_INDEX = -100


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32 (float64 for float64 x), returned
    in x's dtype. With `residual`, normalises s = x + residual instead and returns (normed, s) (the pre-norm block's
    residual add, fused into the norm's kernel on CUDA). On CUDA: this package's Triton kernel where no gradient is
    wanted (`inference_norm`), else fla's. Takes part in `__torch_function__` dispatch."""
    if has_torch_function_variadic(x, weight, residual):
        return handle_torch_function(rms_norm, (x, weight, residual), x, weight, eps, residual=residual)
    out = inference_rms_norm(x, weight, eps, residual)
    if out is not None:
        return out
    kernel = fla_backend.fla_kernel("rms_norm", x, weight)
    if kernel is not None:
        if residual is None:
            return kernel(x, weight, None, eps=eps)
        return kernel(x, weight, None, residual=residual, eps=eps, prenorm=True)
    if residual is not None:
        x = x + residual
    dtype = compute_dtype(x)
    x32 = x.to(dtype)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype)).to(x.dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU of the gated MLP)."""
    kernel = fla_backend.fla_kernel("swiglu", gate, up)
    if kernel is not None:
        return kernel(gate, up)
    return F.silu(gate) * up


# Largest [tokens, vocab] logits block the fused loss holds at once. Up to it the loss runs as one chunk, and the LM
# head's gradient is one GEMM in the weights' dtype (accumulated in float32 inside, rounded once), as without fusion.
# Past it, fla splits the tokens and accumulates that gradient in float32 across chunks: bounded memory, but with
# float32 GEMMs (no tensor cores, several times slower).
LOSS_CHUNK_BYTES = 4 * 2**30


def loss_chunking(tokens: int, vocab: int, element_size: int) -> dict:
    """fla's `num_chunks` and `accumulate_grad_in_fp32` for a fused loss over [tokens, vocab] logits."""
    chunks = max(1, -(-tokens * vocab * element_size // LOSS_CHUNK_BYTES))
    return {"num_chunks": chunks, "accumulate_grad_in_fp32": chunks > 1}


def fused_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | None:
    """The next-token cross-entropy of transformers' causal LMs (labels shifted left, `ignore_index` skipped, mean
    over the counted tokens or sum / `num_items_in_batch`), computed from the final hidden states [B, T, H] and the
    LM head weight [V, H] in chunks of at most LOSS_CHUNK_BYTES of logits, none kept for the backward (the gradients
    are computed in the forward). None when no fused kernel applies
    (not CUDA, fla missing, float64, or a sharded LM head): the caller then computes logits and the usual loss."""
    loss_kernel = fla_backend.fla_kernel("fused_linear_cross_entropy_loss", hidden_states, lm_head_weight)
    if loss_kernel is None:
        return None
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else hidden_states.dtype
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1]).to(dtype)
    weight = lm_head_weight.to(dtype)
    targets = shift_labels.reshape(-1).to(hidden.device)
    chunking = loss_chunking(hidden.shape[0], weight.shape[0], hidden.element_size())
    with torch.autocast("cuda", enabled=False):  # fla's kernel takes one dtype; it accumulates in float32
        if num_items_in_batch is None:
            return loss_kernel(hidden, targets, weight, ignore_index=ignore_index, **chunking)
        loss = loss_kernel(hidden, targets, weight, ignore_index=ignore_index, reduction="sum", **chunking)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
