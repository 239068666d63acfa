"""The checks every forward runs on its inputs before any work: one clear line naming the input, what is wrong with it
and the fix, instead of a reshape, indexing or dtype error deep in a mixer that names none of the inputs (or, on a GPU,
a device-side assertion that leaves the process's CUDA context unusable).

What is accepted, and how:
- token ids (`input_ids`, `labels`): integer tensors of any integer dtype, taken exactly (`token_indices` widens them to
  the int64 an embedding lookup and the loss index with; every integer dtype's values fit). Floats and bools are
  refused (a float id is a bug upstream, not a token). Their values are checked against the vocabulary where reading
  them costs no device synchronisation (not on CUDA, not under torch.compile); `labels` may also hold -100 (ignored).
- `inputs_embeds`: floating-point, in the dtype of the model's own embeddings (what `input_ids` would give), as
  transformers' models need (Qwen3-Next's first projection fails on another dtype); under torch.autocast any floating
  dtype (autocast casts at each matmul).
- masks and positions: a 2-D `attention_mask` [batch, past + seq_len] of 0 (padding) and 1 (token), or a 4-D one (bool
  or additive float) [batch or 1, heads or 1, seq_len, keys]; `position_ids` [batch or 1, seq_len], integers.
- the cache: a transformers `Cache` (the legacy tuple format holds no GDN/KDA state), checked by `cache_checks`.
"""

from __future__ import annotations

from typing import Any

import torch

from .sequence_info import check_cu_seq_lens

IGNORE_INDEX = -100  # the label transformers' causal-LM loss ignores


def check_inputs(vocab_size: int, hidden_size: int, input_ids: Any, inputs_embeds: Any, attention_mask: Any,
                 position_ids: Any, *, embedding_dtype: torch.dtype | None = None, labels: Any = None,
                 cu_seq_lens: dict[str, Any] | None = None) -> tuple[int, int]:
    """Raises a one-line ValueError/TypeError for a malformed input; returns the inputs' (batch, seq_len).
    cu_seq_lens: the packed-sequence boundaries passed as keyword arguments (cu_seq_lens_q, cu_seq_lens_k)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids [batch, seq_len] or inputs_embeds [batch, seq_len, hidden].")
    if input_ids is not None:
        _check_input_ids(vocab_size, input_ids)
        batch, seq_len = input_ids.shape
    else:
        _check_inputs_embeds(hidden_size, inputs_embeds, embedding_dtype)
        batch, seq_len = inputs_embeds.shape[:2]
    if batch == 0 or seq_len == 0:
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        raise ValueError(
            f"{name} of shape [batch, seq_len] = [{batch}, {seq_len}] holds no tokens; give at least one row of at "
            "least one token (to generate() from nothing, start the prompt with the BOS token: [[bos_token_id]])."
        )
    if attention_mask is not None and not isinstance(attention_mask, dict):
        _check_attention_mask(attention_mask, batch, seq_len)
    if position_ids is not None:
        _check_position_ids(position_ids, batch, seq_len)
    if labels is not None:
        _check_labels(vocab_size, labels, batch, seq_len)
    for name, boundaries in (cu_seq_lens or {}).items():
        if boundaries is not None:
            check_cu_seq_lens(name, boundaries, batch, seq_len)
    return batch, seq_len


def token_indices(ids: torch.Tensor | None) -> torch.Tensor | None:
    """Integer token ids as int64 (exact for every integer dtype the checks accept; int64 stays as it is)."""
    return ids if ids is None or ids.dtype == torch.int64 else ids.long()


def _require_tensor(name: str, value: Any, shape: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(value).__name__}; convert it with "
                        "torch.as_tensor.")


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _values_readable(tensor: torch.Tensor) -> bool:
    """Whether a tensor's values can be read for a check without a device synchronisation or a graph break."""
    return tensor.numel() > 0 and not torch.compiler.is_compiling() and tensor.device.type != "cuda"


def _value_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(min, max) of an integer tensor; the wide unsigned dtypes, which torch cannot reduce, through float64 (exact below
    2**53, far beyond any vocabulary, so the bounds compare right)."""
    if tensor.dtype in (torch.uint16, torch.uint32, torch.uint64):
        tensor = tensor.to(torch.float64)
    return int(tensor.min()), int(tensor.max())


def _check_input_ids(vocab_size: int, input_ids: Any) -> None:
    _require_tensor("input_ids", input_ids, "of integer token ids [batch, seq_len]")
    if input_ids.dim() == 1 and _is_integer(input_ids.dtype):
        raise ValueError(
            f"input_ids must be a 2-D tensor [batch, seq_len], got a 1-D tensor of shape {tuple(input_ids.shape)}; "
            "add the batch dimension: input_ids.unsqueeze(0)."
        )
    if input_ids.dim() != 2 or not _is_integer(input_ids.dtype):
        raise ValueError(
            f"input_ids must be a 2-D tensor of integer token ids [batch, seq_len], got dtype {input_ids.dtype} "
            f"and shape {tuple(input_ids.shape)}; pass token ids (e.g. input_ids.long())."
        )
    if _values_readable(input_ids):
        low, high = _value_range(input_ids)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input_ids must lie in [0, {vocab_size}) (vocab_size), got values in [{low}, {high}].")


def _check_inputs_embeds(hidden_size: int, inputs_embeds: Any, embedding_dtype: torch.dtype | None) -> None:
    _require_tensor("inputs_embeds", inputs_embeds, f"[batch, seq_len, {hidden_size}]")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        fix = " (add the batch dimension: inputs_embeds.unsqueeze(0))" if inputs_embeds.dim() == 2 else ""
        raise ValueError(
            f"inputs_embeds must be [batch, seq_len, {hidden_size}] (hidden_size), got "
            f"{tuple(inputs_embeds.shape)}{fix}."
        )
    if not inputs_embeds.dtype.is_floating_point:
        raise ValueError(f"inputs_embeds must be a floating-point tensor, got dtype {inputs_embeds.dtype}.")
    if (embedding_dtype is not None and inputs_embeds.dtype != embedding_dtype
            and not torch.is_autocast_enabled(inputs_embeds.device.type)):
        raise ValueError(
            f"inputs_embeds is {inputs_embeds.dtype} but the model computes in {embedding_dtype} (the dtype of its "
            f"embeddings); cast them: inputs_embeds.to({embedding_dtype}), or run under torch.autocast."
        )


def _check_attention_mask(attention_mask: Any, batch: int, seq_len: int) -> None:
    _require_tensor("attention_mask", attention_mask, "[batch, past + seq_len] of 0 (padding) and 1 (token)")
    if attention_mask.dim() not in (2, 4):
        raise ValueError(f"attention_mask must be 2-D [batch, length] or 4-D, got {tuple(attention_mask.shape)}.")
    if attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must be a bool, integer or float tensor, got dtype {attention_mask.dtype}.")
    if attention_mask.dim() == 2:
        if attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
            raise ValueError(
                f"attention_mask must be [batch, past + seq_len] = [{batch}, >= {seq_len}] for inputs of shape "
                f"[{batch}, {seq_len}], got {tuple(attention_mask.shape)}."
            )
        if _values_readable(attention_mask) and attention_mask.dtype != torch.bool:
            outside = (attention_mask != 0) & (attention_mask != 1)
            if bool(outside.any()):
                raise ValueError(
                    f"a 2-D attention_mask holds 0 (padding) and 1 (token), got {attention_mask[outside][0].item()}; "
                    "to keep packed documents apart pass position_ids restarting at 0 or cu_seq_lens_q instead."
                )
        return
    if (attention_mask.shape[0] not in (1, batch) or attention_mask.shape[2] != seq_len
            or attention_mask.shape[3] < seq_len):
        raise ValueError(
            f"a 4-D attention_mask must be [batch or 1, heads or 1, seq_len, keys >= seq_len] = [{batch}, ., "
            f"{seq_len}, >= {seq_len}] for inputs of shape [{batch}, {seq_len}], got {tuple(attention_mask.shape)}."
        )
    if not (attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point):
        raise ValueError(
            f"a 4-D attention_mask must be bool (True: attended) or an additive float mask, got dtype "
            f"{attention_mask.dtype}."
        )


def _check_position_ids(position_ids: Any, batch: int, seq_len: int) -> None:
    _require_tensor("position_ids", position_ids, "of integer positions [batch or 1, seq_len]")
    if position_ids.dim() != 2 or position_ids.shape[1] != seq_len or position_ids.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids must be [batch or 1, seq_len] = [{batch}, {seq_len}], got {tuple(position_ids.shape)}."
        )
    if not _is_integer(position_ids.dtype):
        raise ValueError(f"position_ids must be integer positions, got dtype {position_ids.dtype}.")


def _check_labels(vocab_size: int, labels: Any, batch: int, seq_len: int) -> None:
    _require_tensor("labels", labels, "of integer token ids [batch, seq_len]")
    if tuple(labels.shape) != (batch, seq_len):
        raise ValueError(
            f"labels must have the [batch, seq_len] shape of the inputs, {(batch, seq_len)}, got {tuple(labels.shape)}."
        )
    if not _is_integer(labels.dtype):
        raise ValueError(f"labels must be integer token ids (or {IGNORE_INDEX}, ignored), got dtype {labels.dtype}.")
    if _values_readable(labels):
        counted = labels[labels != IGNORE_INDEX]
        if counted.numel():
            low, high = _value_range(counted)
            if low < 0 or high >= vocab_size:
                raise ValueError(f"labels must lie in [0, {vocab_size}) (vocab_size) or be {IGNORE_INDEX} (ignored), "
                                 f"got values in [{low}, {high}].")


__all__ = ["IGNORE_INDEX", "check_inputs", "token_indices"]
