"""How the tokens of a forward pass split into sequences, for the mixers that carry state along the sequence.

Attention layers get this from their masks; GDN/KDA layers (convolution + recurrence) need it explicitly:
- packed rows (several documents per row: `position_ids` restarting at 0, or `cu_seq_lens_q` from
  `DataCollatorWithFlattening`): the rows are flattened into one and `cu_seqlens` marks every document start, so the
  convolution and the recurrence restart at each boundary;
- padded rows (a 2D attention mask with zeros): `padding_mask` marks the real tokens; the mixers zero the inputs of
  pads and neutralise their decay and beta, so pads leave the state as it was. Whether a mask holds a zero is read on
  the host in eager mode (an unpadded batch then skips the masking); under torch.compile it is not read
  (`may_hold_padding`), so the graph has no branch on a tensor's values: every 2D mask is applied, and applying a
  mask of ones (masked_fill / where on no position) changes no value.
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


def check_cu_seq_lens(name: str, cu_seq_lens: object, batch_size: int, seq_len: int) -> None:
    """Refuses packed-sequence boundaries that do not describe the row's tokens: a 1-D integer tensor [N + 1] starting
    at 0, rising strictly (every document holds a token) and ending at seq_len, for a batch of one row. Its values are
    read on the host (one synchronisation, skipped under torch.compile: the kernels read them there anyway)."""
    if not isinstance(cu_seq_lens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor of document boundaries, got "
                        f"{type(cu_seq_lens).__name__}.")
    if batch_size != 1:
        raise ValueError(
            f"{name} describes documents packed in one row, so the batch size must be 1, got {batch_size}."
        )
    integer = not (cu_seq_lens.dtype.is_floating_point or cu_seq_lens.dtype.is_complex
                   or cu_seq_lens.dtype == torch.bool)
    if cu_seq_lens.dim() != 1 or cu_seq_lens.shape[0] < 2 or not integer:
        raise ValueError(f"{name} must be a 1-D integer tensor [documents + 1] of boundaries (0, ..., {seq_len}), "
                         f"got dtype {cu_seq_lens.dtype} and shape {tuple(cu_seq_lens.shape)}.")
    if torch.compiler.is_compiling():
        return
    bounds = cu_seq_lens.to("cpu", torch.float64)  # (float64: the unsigned dtypes torch cannot reduce; exact here)
    first, last = int(bounds[0]), int(bounds[-1])
    if first != 0 or last != seq_len or not bool((bounds[1:] > bounds[:-1]).all()):
        shown = bounds[:8].long().tolist()
        raise ValueError(
            f"{name} must start at 0, rise strictly (no empty document) and end at the row's {seq_len} tokens, got "
            f"{shown}{' ...' if bounds.shape[0] > 8 else ''} (ending at {last}); build it from the documents' "
            "lengths: [0, *lengths.cumsum(0)]."
        )


def may_hold_padding(mask: torch.Tensor) -> bool:
    """Whether a 2D attention mask (1: token, 0: pad) may mark a pad: read on the host in eager mode; always True while
    torch.compile traces (see the module docstring)."""
    return torch.compiler.is_compiling() or not bool(mask.all())


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
    if cu_seq_lens is not None:  # (boundaries `check_cu_seq_lens` accepted)
        info.cu_seqlens = cu_seq_lens.to(torch.int32)
        return info
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask[:, -seq_len:].bool()
        if may_hold_padding(mask):
            info.padding_mask = mask
        return info
    if position_ids is not None and seq_len > 1 and not has_past:  # (a one-token step never reads has_past)
        position_ids = position_ids.expand(batch_size, -1)
        restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
        if bool(restarts.any()):
            starts = torch.cat([torch.ones_like(restarts[:, :1]), restarts], dim=1)
            info.cu_seqlens = _cu_seqlens_from_starts(starts)
    return info
