"""The dtype of every tensor a conversion writes: nothing narrowed on the way, one cast at the end.

A checkpoint may store the tensors that one output tensor is made of in different dtypes (expert 0 in bfloat16 and
expert 1 in float32, fla's q_proj in bfloat16 beside a float32 k_proj). Joining them (stacking experts,
concatenating projections) happens in the widest of their dtypes, torch's type promotion (`widest_dtype`: bfloat16
and float16 give float32, which holds every value of both exactly), so no value is rounded or overflows while the
tensors are moved. The written tensor then takes `--dtype` if given, else that widest dtype, in one cast
(`cast_checked`), which refuses to turn a finite value into an infinity: float16's largest value is 65504, so a
float32 weight of 1e6 written as float16 would become inf and poison every activation it touches.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from .errors import ConversionError
from .untrusted import brief


def widest_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds every value of each of `dtypes` (floating point ones: the planner refuses the rest)."""
    return functools.reduce(torch.promote_types, dtypes)


def in_widest_dtype(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, each in their widest dtype (unchanged, not copied, when they already share one): ready to join."""
    dtype = widest_dtype(tensor.dtype for tensor in tensors)
    return [tensor.to(dtype) for tensor in tensors]


def cast_checked(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` (tensor `name`) in `dtype`; refuses a cast that makes a finite value infinite."""
    if tensor.dtype == dtype:
        return tensor
    cast = tensor.to(dtype)
    if torch.finfo(dtype).max < torch.finfo(tensor.dtype).max:
        overflow = torch.isinf(cast) & torch.isfinite(tensor)
        if bool(overflow.any()):
            index = tuple(int(i) for i in overflow.nonzero()[0])
            value = tensor[index].item()
            raise ConversionError(
                f"tensor {brief(name)} holds {value:g} at {list(index)}, beyond {_name(dtype)}'s largest value "
                f"{torch.finfo(dtype).max:g}: written as {_name(dtype)} it would become infinite; convert with a "
                f"wider --dtype ({_name(tensor.dtype)}, or leave --dtype out to keep the stored dtypes).")
    return cast


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["cast_checked", "in_widest_dtype", "widest_dtype"]
