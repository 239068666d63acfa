"""Pure-PyTorch depthwise causal short convolution with a carried state of the last K-1 inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _depthwise_valid(ext: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise convolution without padding: ext [R, L, C], weight [C, K] -> [R, L - K + 1, C]."""
    out = F.conv1d(ext.transpose(1, 2), weight.to(ext.dtype).unsqueeze(1), groups=weight.shape[0])
    return out.transpose(1, 2)


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out_t = act(sum_i weight[:, i] * x_{t-K+1+i}) per channel, where inputs before a sequence's start come from its
    state ([N, C, K-1], oldest first; zeros when absent). x: [B, T, C]; weight: [C, K].

    Each sequence is laid out as [its state | its tokens] and convolved without padding, so no window ever reaches
    into another sequence. With `cu_seqlens` the documents of the single row are laid out this way one after another.
    """
    K = weight.shape[-1]
    keep = K - 1
    if cu_seqlens is None:
        state = initial_state if initial_state is not None else x.new_zeros(x.shape[0], x.shape[2], keep)
        ext = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, K-1 + T, C]
        out = _depthwise_valid(ext, weight)
        final = ext[:, ext.shape[1] - keep :].transpose(1, 2) if output_final_state else None
    else:
        tokens, channels = x.shape[1], x.shape[2]
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        docs = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        doc_of_token = torch.repeat_interleave(torch.arange(docs, device=x.device), lengths, output_size=tokens)
        # position of every token and state slot in the extended row [state_0 | doc_0 | state_1 | doc_1 | ...]
        token_pos = torch.arange(tokens, device=x.device) + (doc_of_token + 1) * keep
        slot_pos = (cu[:-1] + torch.arange(docs, device=x.device) * keep).unsqueeze(1) + torch.arange(keep, device=x.device)
        if initial_state is not None:
            source = torch.cat([x[0], initial_state.transpose(1, 2).reshape(docs * keep, channels).to(x.dtype)])
            slot_source = tokens + torch.arange(docs * keep, device=x.device)
        else:
            source = torch.cat([x[0], x.new_zeros(1, channels)])
            slot_source = torch.full((docs * keep,), tokens, device=x.device)
        index = torch.empty(tokens + docs * keep, dtype=torch.long, device=x.device)
        index[token_pos] = torch.arange(tokens, device=x.device)
        index[slot_pos.flatten()] = slot_source
        ext = source.index_select(0, index).unsqueeze(0)
        out = _depthwise_valid(ext, weight)[:, token_pos - keep]
        final = None
        if output_final_state:
            last = (cu[1:] + torch.arange(docs, device=x.device) * keep).unsqueeze(1) + torch.arange(keep, device=x.device)
            final = ext[0, last.flatten()].view(docs, keep, channels).transpose(1, 2)
    if activation is not None:  # "silu" / "swish", checked by the caller
        out = F.silu(out)
    return out, (final.contiguous() if final is not None else None)
