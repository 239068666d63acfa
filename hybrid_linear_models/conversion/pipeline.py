"""Plans and streams a conversion: source tensors -> canonical tensors (source rows, forward) -> target tensors
(target rows, inverse).

Planning works on shapes only, before any data is read: every source tensor must be consumed by exactly one source
row and every target tensor produced by exactly one target row (a leftover or missing tensor is an error naming it),
every source tensor's shape must be the one the config implies, and every weight must be floating point (an integer
or bool tensor is not a weight, and casting it would silently change its meaning). Each target tensor's dtype is
planned too: `--dtype`, else the widest dtype of the source tensors it is made of (`dtypes`: a checkpoint may mix
dtypes, and joining them narrows nothing), reached by one checked cast as the tensor is written.

Before that, while a reader builds the config, a `TensorCensus` of the stored tensors (from their headers) bounds the
config's sizes: a config claiming a million blocks or a 10^12 hidden size is refused by name before any per-layer
table, row permutation or buffer offset of that size is built. The schedule then loads one source row at a time
and emits each target row as soon as all its canonical inputs exist, so only a few tensors are in memory at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ..configuration_hybrid_linear import HybridLinearConfig
from ..fp8_settings import SCALE_SUFFIX
from .dtypes import cast_checked, widest_dtype
from .errors import ConversionError
from .hf_layout import hf_tensor_shapes, one_layer_per_type
from .name_maps import MapRow
from .safetensors_io import TensorInfo
from .untrusted import brief, clip

_LISTED = 8  # names shown in one error message


class TensorSource(Protocol):
    """Read access to a checkpoint's tensors by their stored name."""

    def keys(self) -> list[str]: ...

    def info(self, key: str) -> TensorInfo: ...

    def load(self, key: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorCensus:
    """What the stored tensors' headers say about the model's size, known before the config is built."""

    elements: int  # weight elements stored in all
    block_indices: frozenset[int] | None = None  # block numbers in tensor names; None: the names do not tell
    block_prefix: str = ""  # "decoder." or "model.layers."

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, TensorInfo]], block_prefix: str) -> TensorCensus:
        """Counts elements and the blocks named `{block_prefix}{index}.*`."""
        pattern = re.compile(re.escape(block_prefix) + r"(\d{1,18})\.")
        elements, indices = 0, set()
        for name, info in tensors:
            elements += info.numel
            match = pattern.match(name)
            if match:
                indices.add(int(match.group(1)))
        return cls(elements, frozenset(indices), block_prefix)

    @property
    def elements_phrase(self) -> str:
        return f"the {self.elements} weight elements the checkpoint holds in all"

    def blocks_phrase(self) -> str:
        if not self.block_indices:
            return f"no tensors of blocks ({self.block_prefix}N.*)"
        first, last = min(self.block_indices), max(self.block_indices)
        span = f"{self.block_prefix}{first}" + (f" ... {self.block_prefix}{last}" if last != first else "")
        return f"tensors for {len(self.block_indices)} blocks ({span})"

    def check_block_count(self, count: int, claim: str) -> None:
        """`claim` ("metadata.yaml: ...num_blocks is 1000000") must not ask for more blocks than the tensors hold."""
        if self.block_indices is None:
            if count > self.elements:  # every block holds weights
                raise ConversionError(f"{claim}, more blocks than {self.elements_phrase}; the config does not match "
                                      "the weights, fix the config.")
        elif count > len(self.block_indices):
            raise ConversionError(f"{claim} but the checkpoint holds {self.blocks_phrase()}; the config does not "
                                  "match the weights, fix the config (or add the missing blocks' tensors).")


def check_tensor_sizes(config: HybridLinearConfig, census: TensorCensus, where: str) -> None:
    """No tensor the config implies may be larger than all stored tensors together: this bounds the products of
    sizes (heads x head_dim x hidden_size) that the per-field checks cannot, before any row table is built."""
    try:
        shapes = one_layer_per_type(config)  # one meta layer per distinct setting: no memory, no per-layer list
    except ValueError as error:  # a size product no tensor can have (beyond int64)
        raise ConversionError(f"{where}: {error} The checkpoint holds {census.elements_phrase}; the config does not "
                              "match the weights.") from None
    for name, shape in shapes.items():
        if math.prod(shape) > census.elements:
            raise ConversionError(
                f"{where}: the config implies {name} of shape {brief(list(shape))} ({math.prod(shape)} elements), "
                f"more than {census.elements_phrase}; the config does not match the weights, fix its sizes."
            )


def config_difference(expected: HybridLinearConfig, got: HybridLinearConfig, fields: Iterable[str] | None = None
                      ) -> str | None:
    """The first field (of `fields`, default all) whose value differs, described for an error message."""
    want, have = expected.to_dict(), got.to_dict()
    for name in want if fields is None else fields:
        if name not in have or have[name] != want[name]:
            return f"{name} ({brief(want.get(name))} reads back as {brief(have.get(name, '<missing>'))})"
    return None


@dataclass(frozen=True)
class CarriedTensors:
    """Stored tensors our model has no parameters for but a conversion must not lose (Qwen3-Next's multi-token
    prediction head, `mtp.*`): they travel by name and byte for byte (cast only by an explicit --dtype) to formats
    that keep them (`FormatEntry.keeps_extra_tensors`), with the source config fields that describe them, so that a
    later conversion back gives both back. `origin` names the format whose fields these are."""

    origin: str
    keys: tuple[str, ...]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceCheckpoint:
    """What a format reader returns: the model config, the tensors and how they map to the canonical layout."""

    format_name: str
    path: Path
    config: HybridLinearConfig
    tensors: TensorSource
    rows: list[MapRow]
    skipped: list[str] = field(default_factory=list)  # stored tensors deliberately not converted (optimizer state,
    # the mixers of a supernet that inference does not use)
    carried: CarriedTensors | None = None  # stored tensors kept untouched beside the model's
    quantization: str | None = None  # "fp8": the config's FP8 setting, checked against the stored FP8 weights and
    # their scales (`fp8_blocks`), which convert as stored


@dataclass(frozen=True)
class Step:
    load: int | None = None  # index of a source row to load
    emit: int | None = None  # index of a target row to emit


@dataclass
class ConversionPlan:
    source: SourceCheckpoint
    target_rows: list[MapRow]
    steps: list[Step]
    targets: list[tuple[str, TensorInfo]]  # target tensors, in the order they are produced; carried ones last
    dtype: torch.dtype | None
    carried: tuple[str, ...] = ()  # the names of the carried tensors among `targets` (source.carried's keys)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for _, info in self.targets)


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(clip(name, 100) for name in sorted(names)[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _check_accounting(source: SourceCheckpoint) -> None:
    stored = set(source.tensors.keys())
    used = [key for row in source.rows for key in row.format_keys]
    used += list(source.carried.keys) if source.carried is not None else []
    duplicated = {key for key in used if used.count(key) > 1} if len(used) != len(set(used)) else set()
    if duplicated:
        raise RuntimeError(f"name map uses {sorted(duplicated)} twice")
    missing = sorted(set(used) - stored)
    extra = sorted(stored - set(used))
    where = f"{source.path} ({source.format_name} format)"
    if missing:
        raise ConversionError(
            f"{where} is missing tensor(s) {_listing(missing)} that its config requires "
            f"(layer types {brief(source.config.mixer_types)}). The checkpoint is incomplete or its config does not "
            "match its weights; export it again."
        )
    if extra:
        raise ConversionError(
            f"{where} has tensor(s) {_listing(extra)} that its config does not account for. The config does not "
            "match the weights, or the checkpoint holds parameters this converter does not know (biases, adapters, "
            "extra heads); fix the config or remove them."
        )


def _check_floating_point(source: SourceCheckpoint) -> None:
    carried = source.carried.keys if source.carried is not None else ()
    for keys in [*(row.format_keys for row in source.rows), carried]:
        for key in keys:
            dtype = source.tensors.info(key).dtype
            if not dtype.is_floating_point:
                raise ConversionError(
                    f"{source.path}: tensor {brief(key)} has dtype {str(dtype).removeprefix('torch.')}, but model "
                    "weights are floating point; the checkpoint is corrupt or is not a model checkpoint."
                )
            if dtype.itemsize == 1 and source.quantization != "fp8":  # FP8 converts only with its block scales
                raise ConversionError(
                    f"{source.path}: tensor {brief(key)} is {str(dtype).removeprefix('torch.')}, which converts only "
                    "as a block-scaled FP8 weight of a folder whose config.json has a quantization_config "
                    "(fp8_blocks)."
                )


def _check_shapes(source: SourceCheckpoint, canonical: dict[str, tuple[int, ...]]) -> None:
    for row in source.rows:
        expected = row.converter.inverse_shapes([canonical[key] for key in row.canonical_keys])
        for key, shape in zip(row.format_keys, expected):
            actual = source.tensors.info(key).shape
            if tuple(actual) != tuple(shape):
                raise ConversionError(
                    f"{source.path}: tensor {key} has shape {brief(list(actual))}, but the config implies "
                    f"{list(shape)}. The config does not match the weights; fix the config (or the tensor) so they "
                    "agree."
                )


def _written_dtype(key: str, stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """`requested` (--dtype), else `stored`; FP8 weights and their scales (`fp8_blocks`) always keep `stored`: they
    are one quantized weight, whose bytes a cast would change."""
    if requested is None or stored.itemsize == 1 or key.endswith(SCALE_SUFFIX):
        return stored
    return requested


def plan_conversion(source: SourceCheckpoint, target_rows: list[MapRow], dtype: torch.dtype | None = None
                    ) -> ConversionPlan:
    canonical = hf_tensor_shapes(source.config)
    _check_accounting(source)
    _check_floating_point(source)
    _check_shapes(source, canonical)
    produced = [key for row in source.rows for key in row.canonical_keys]
    needed = [key for row in target_rows for key in row.canonical_keys]
    head = sorted(set(canonical) - set(needed))
    if head and all(key.startswith("mtp.") for key in head):  # a format without the MTP head (mtp_heads.py)
        kind = source.config.mtp_type  # (each kind is named after the format that holds it besides hf)
        raise ConversionError(f"this model has {source.config.num_mtp_layers} multi-token-prediction layer(s) of "
                              f"mtp_type {kind!r} ({head[0]}, ...), which the target format cannot hold; convert it "
                              f"to the hf or {kind} format instead.")
    if sorted(produced) != sorted(canonical) or sorted(needed) != sorted(canonical):
        raise RuntimeError("name maps disagree with the canonical layout: "
                           f"{sorted(set(produced) ^ set(canonical)) or sorted(set(needed) ^ set(canonical))}")

    canonical_dtype = {}  # what the source rows produce: the widest dtype of the tensors each row joins
    for row in source.rows:
        row_dtype = widest_dtype(source.tensors.info(key).dtype for key in row.format_keys)
        canonical_dtype.update(dict.fromkeys(row.canonical_keys, row_dtype))
    target_row_of = {key: index for index, row in enumerate(target_rows) for key in row.canonical_keys}
    steps: list[Step] = []
    targets: list[tuple[str, TensorInfo]] = []
    available: set[str] = set()
    for index, row in enumerate(source.rows):
        steps.append(Step(load=index))
        available.update(row.canonical_keys)
        for key in row.canonical_keys:
            target_index = target_row_of[key]
            target = target_rows[target_index]
            if key in available and all(k in available for k in target.canonical_keys):
                available.difference_update(target.canonical_keys)
                steps.append(Step(emit=target_index))
                shapes = target.converter.inverse_shapes([canonical[k] for k in target.canonical_keys])
                stored = widest_dtype(canonical_dtype[k] for k in target.canonical_keys)
                out_dtype = _written_dtype(target.canonical_keys[0], stored, dtype)
                targets += [(k, TensorInfo(tuple(s), out_dtype)) for k, s in zip(target.format_keys, shapes)]
    carried = source.carried.keys if source.carried is not None else ()
    for key in carried:
        info = source.tensors.info(key)
        targets.append((key, TensorInfo(tuple(info.shape), _written_dtype(key, info.dtype, dtype))))
    emitted = [key for key, _ in targets]
    if len(emitted) != len(set(emitted)) or available:
        raise RuntimeError(f"conversion schedule incomplete: pending {sorted(available)} or a name twice")
    return ConversionPlan(source, target_rows, steps, targets, dtype, tuple(carried))


def stream_tensors(plan: ConversionPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the target tensors in plan order, reading each source tensor once."""
    source = plan.source
    canonical: dict[str, torch.Tensor] = {}
    planned = iter(plan.targets)
    for step in plan.steps:
        if step.load is not None:
            row = source.rows[step.load]
            tensors = [source.tensors.load(key) for key in row.format_keys]
            canonical.update(zip(row.canonical_keys, row.converter.forward(tensors)))
            del tensors
            continue
        row = plan.target_rows[step.emit]
        outputs = row.converter.inverse([canonical.pop(key) for key in row.canonical_keys])
        outputs.reverse()
        for key in row.format_keys:
            # popped, not kept in a local: no reference outlives its write, so memory stays near one tensor (and a
            # cast does not keep the uncast tensor alive beside it)
            yield key, _as_planned(key, outputs.pop(), next(planned))
    for key in plan.carried:  # untouched, after the model's tensors
        yield key, _as_planned(key, source.tensors.load(key), next(planned))


def _as_planned(key: str, tensor: torch.Tensor, planned: tuple) -> torch.Tensor:
    """`tensor` cast once to its planned dtype (`dtypes.cast_checked`: never to an infinity), checked against the
    (name, info) the plan wrote into the files' headers."""
    name, info = planned
    if name != key or tuple(tensor.shape) != info.shape:
        raise RuntimeError(f"produced {key} {tuple(tensor.shape)}, planned {name} {info.shape}")
    return cast_checked(key, tensor, info.dtype)


def check_carried(source: SourceCheckpoint, to_format: str, keeps_extra_tensors: bool) -> None:
    """A source with carried tensors converts only to a format that keeps them: never drop a weight silently."""
    if source.carried is not None and not keeps_extra_tensors:
        raise ConversionError(
            f"{source.path} holds {len(source.carried.keys)} tensor(s) beside the model's "
            f"({_listing(source.carried.keys)}, from {source.carried.origin}), which the {to_format} format cannot "
            "keep; convert to a format that keeps them (hf, or their own format), or remove them from the source if "
            "you mean to drop them."
        )


@dataclass(frozen=True)
class WriteOptions:
    """What a writer needs beyond the plan and the tensors."""

    max_shard_bytes: int
    output_name: str = "model"  # the final folder name (writers work in a temporary folder)
    source_description: str = ""  # one line on the source format, for the model card


__all__ = ["TensorSource", "TensorCensus", "CarriedTensors", "check_carried",
           "check_tensor_sizes", "config_difference", "SourceCheckpoint",
           "ConversionPlan", "WriteOptions", "plan_conversion", "stream_tensors"]
