"""How the tokens of a forward pass split into sequences, for the mixers that carry state along the sequence.

Attention layers get this from their masks; GDN/KDA layers (convolution + recurrence) need it explicitly:
- packed rows (several documents per row: `position_ids` restarting at 0, or `cu_seq_lens_q` from
  `DataCollatorWithFlattening`): the rows are flattened into one and `cu_seqlens` marks every document start, so the
  convolution and the recurrence restart at each boundary;
- padded rows (a 2D attention mask with zeros): `padding_mask` marks the real tokens; the mixers zero the inputs of
  pads and neutralise their decay and beta, so pads leave the state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceInfo:
    batch_size: int
    seq_len: int
    cu_seqlens: torch.Tensor | None = None  # [N + 1] over the flattened [1, B * T] tokens
    padding_mask: torch.Tensor | None = None  # [B, T] bool, True for real tokens

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, B * T, ...] when packed (the kernels take packed documents in a single row)."""
        if self.cu_seqlens is None or self.batch_size == 1:
            return x
        return x.reshape(1, self.batch_size * self.seq_len, *x.shape[2:])

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        if self.cu_seqlens is None or self.batch_size == 1:
            return x
        return x.reshape(self.batch_size, self.seq_len, *x.shape[2:])


def _cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """starts: [B, T] bool, True where a document begins (every row begins one) -> cu_seqlens over B * T tokens."""
    flat = starts.reshape(-1)
    boundaries = torch.nonzero(flat).squeeze(1)
    return torch.cat([boundaries, boundaries.new_tensor([flat.numel()])]).to(torch.int32)


def build_sequence_info(
    batch_size: int,
    seq_len: int,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    has_past: bool,
    cu_seq_lens: torch.Tensor | None = None,
) -> SequenceInfo:
    """Works out packing and padding for one forward pass (see the module docstring)."""
    info = SequenceInfo(batch_size, seq_len)
    if cu_seq_lens is not None:
        if batch_size != 1:
            raise ValueError(
                f"cu_seq_lens_q describes documents packed in one row, so the batch size must be 1, got {batch_size}."
            )
        info.cu_seqlens = cu_seq_lens.to(torch.int32)
        return info
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask[:, -seq_len:].bool()
        if not bool(mask.all()):
            info.padding_mask = mask
        return info
    if position_ids is not None and not has_past and seq_len > 1:
        position_ids = position_ids.expand(batch_size, -1)
        restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
        if bool(restarts.any()):
            starts = torch.cat([torch.ones_like(restarts[:, :1]), restarts], dim=1)
            info.cu_seqlens = _cu_seqlens_from_starts(starts)
    return info
