"""Small tensor converters used by the name maps. Each maps a group of tensors on the format side to a group on the
canonical side (our Hugging Face layout) with `forward`, and back with `inverse`; both are pure data movement (copy,
slice, concatenate, transpose, row gather), so a round trip is bit-exact. The `*_shapes` methods do the same on
shapes, so a whole conversion can be planned and checked before any data is read. Tensors joined into one are joined
in the widest of their dtypes (`dtypes.in_widest_dtype`), so a checkpoint that stores them in different dtypes loses
no value.

A converter whose layout depends on the model's dimensions (e.g. the Gated DeltaNet head grouping) is bound to a
config first with `bind(config)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .dtypes import in_widest_dtype, widest_dtype

if TYPE_CHECKING:
    from ..configuration_hybrid_linear import HybridLinearConfig

Shape = tuple[int, ...]


class Converter:
    """Base class: one format-side group of tensors <-> one canonical-side group."""

    arity: tuple[int, int] = (1, 1)  # (format-side tensors, canonical-side tensors)

    def bind(self, config: HybridLinearConfig) -> Converter:  # noqa: ARG002 - for config-dependent converters
        return self

    def forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def inverse(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        raise NotImplementedError

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        raise NotImplementedError


class Identity(Converter):
    def forward(self, tensors):
        return list(tensors)

    inverse = forward

    def forward_shapes(self, shapes):
        return [tuple(s) for s in shapes]

    inverse_shapes = forward_shapes


class Transpose(Converter):
    """A 2-D weight stored transposed on the format side (Fast-LLM's MLP `layer_2`)."""

    def forward(self, tensors):
        return [tensors[0].t().contiguous()]

    inverse = forward

    def forward_shapes(self, shapes):
        rows, cols = shapes[0]
        return [(cols, rows)]

    inverse_shapes = forward_shapes


@dataclass(frozen=True)
class SplitRows(Converter):
    """One format tensor = `parts` canonical tensors of equal size stacked along dim 0 (e.g. K then V)."""

    parts: int = 2

    @property
    def arity(self):
        return (1, self.parts)

    def forward(self, tensors):
        return [chunk.contiguous() for chunk in torch.chunk(tensors[0], self.parts, dim=0)]

    def inverse(self, tensors):
        return [torch.cat(in_widest_dtype(tensors), dim=0)]

    def forward_shapes(self, shapes):
        rows, *rest = shapes[0]
        if rows % self.parts:
            raise ValueError(f"{rows} rows do not split into {self.parts} equal parts")
        return [(rows // self.parts, *rest)] * self.parts

    def inverse_shapes(self, shapes):
        return [(sum(s[0] for s in shapes), *shapes[0][1:])]


@dataclass(frozen=True)
class RowPermutation(Converter):
    """Canonical row i is format row `order[i]`."""

    order: tuple[int, ...]

    def _index(self, inverse: bool) -> torch.Tensor:
        index = torch.tensor(self.order, dtype=torch.long)
        return torch.argsort(index) if inverse else index

    def forward(self, tensors):
        return [tensors[0].index_select(0, self._index(False))]

    def inverse(self, tensors):
        return [tensors[0].index_select(0, self._index(True))]

    def _check(self, shape: Shape) -> None:
        if shape[0] != len(self.order):
            raise ValueError(f"{shape[0]} rows, the permutation is over {len(self.order)}")

    def forward_shapes(self, shapes):
        self._check(shapes[0])
        return [tuple(shapes[0])]

    def inverse_shapes(self, shapes):
        self._check(shapes[0])
        return [tuple(shapes[0])]


def flat_to_grouped_order(groups: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Row order taking a FLAT layout [S0 of all groups | S1 of all groups | ...] (section k holds `groups` blocks of
    `sizes[k]` rows) to a GROUPED one [group 0: S0 | S1 | ... | group 1: S0 | S1 | ... | ...]."""
    section_starts = [groups * sum(sizes[:k]) for k in range(len(sizes))]
    order: list[int] = []
    for group in range(groups):
        for start, size in zip(section_starts, sizes):
            order.extend(range(start + group * size, start + (group + 1) * size))
    return tuple(order)


@dataclass(frozen=True)
class GdnKeyHeadGrouping(Converter):
    """Gated DeltaNet projection rows: Fast-LLM stores them FLAT, per section over all heads; the canonical
    (Qwen3-Next) layout groups them per key head h: in_proj_qkvz = [q_h (dk) | k_h (dk) | v_h (r*dv) | z_h (r*dv)]
    and in_proj_ba = [b_h (r) | a_h (r)], r = value heads per key head. `projection` is "qkvz" or "ba"."""

    projection: str

    def bind(self, config: HybridLinearConfig) -> RowPermutation:
        key_heads = config.gdn_num_key_heads
        ratio = config.gdn_num_value_heads // key_heads
        if self.projection == "qkvz":
            dk, dv = config.gdn_key_head_dim, config.gdn_value_head_dim
            sizes = (dk, dk, ratio * dv, ratio * dv)
        elif self.projection == "ba":
            sizes = (ratio, ratio)
        else:
            raise ValueError(f"unknown GDN projection {self.projection!r}")
        return RowPermutation(flat_to_grouped_order(key_heads, sizes))


@dataclass(frozen=True)
class ConcatRows(Converter):
    """Several format tensors stacked along dim 0 make one canonical tensor (fla's separate q/k/v projections and
    convolutions -> our fused ones); `rows`: each format tensor's row count, in order."""

    rows: tuple[int, ...]

    @property
    def arity(self):
        return (len(self.rows), 1)

    def forward(self, tensors):
        return [torch.cat(in_widest_dtype(tensors), dim=0)]

    def inverse(self, tensors):
        return [part.contiguous() for part in torch.split(tensors[0], list(self.rows), dim=0)]

    def forward_shapes(self, shapes):
        if tuple(s[0] for s in shapes) != self.rows or len({tuple(s[1:]) for s in shapes}) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not stack into rows {self.rows}")
        return [(sum(self.rows), *shapes[0][1:])]

    def inverse_shapes(self, shapes):
        rows, *rest = shapes[0]
        if rows != sum(self.rows):
            raise ValueError(f"{rows} rows do not split into parts of {self.rows} rows")
        return [(part, *rest) for part in self.rows]


@dataclass(frozen=True)
class Chain(Converter):
    """`first`, then `then` (its canonical side is `then`'s format side): e.g. stack fla's projections, then group
    the rows by GDN key head. Both are bound to the config together."""

    first: Converter
    then: Converter

    @property
    def arity(self):
        return (self.first.arity[0], self.then.arity[1])

    def bind(self, config: HybridLinearConfig) -> Chain:
        return Chain(self.first.bind(config), self.then.bind(config))

    def forward(self, tensors):
        return self.then.forward(self.first.forward(tensors))

    def inverse(self, tensors):
        return self.first.inverse(self.then.inverse(tensors))

    def forward_shapes(self, shapes):
        return self.then.forward_shapes(self.first.forward_shapes(shapes))

    def inverse_shapes(self, shapes):
        return self.first.inverse_shapes(self.then.inverse_shapes(shapes))


@dataclass(frozen=True)
class ConfigDependent(Converter):
    """A converter whose layout follows the config (row counts, head groupings): `build(config)` makes it when the
    name map is bound to a layer's config."""

    build: Callable[[HybridLinearConfig], Converter]

    def bind(self, config: HybridLinearConfig) -> Converter:
        return self.build(config).bind(config)


@dataclass(frozen=True)
class StackedExperts(Converter):
    """Mixture-of-experts weights stored one expert at a time on the format side (the hub layout of Qwen3-Next and
    Qwen2-MoE: `experts.{e}.gate_proj`, `experts.{e}.up_proj`, ...) and as one 3-D tensor on the canonical side.
    The format tensors come expert by expert, `parts` per expert (gate then up, or down alone); canonical expert e is
    their concatenation along dim 0: `canonical[e] = cat(format[e * parts : (e + 1) * parts], dim=0)`, so gate and up
    of shape (I, H) become the (E, 2I, H) `gate_up_proj` whose first I rows per expert are the gate."""

    experts: int
    parts: int = 1

    @property
    def arity(self):
        return (self.experts * self.parts, 1)

    def forward(self, tensors):
        # one output buffer, each expert's parts copied into it: the peak is the inputs plus one stacked tensor
        # (a real layer's experts hold gigabytes; cat then stack would hold a third copy); the buffer has the widest
        # of the parts' dtypes, so copying a part into it never rounds
        first = tensors[0]
        stacked = first.new_empty((self.experts, first.shape[0] * self.parts, *first.shape[1:]),
                                  dtype=widest_dtype(tensor.dtype for tensor in tensors))
        rows = first.shape[0]
        for index, tensor in enumerate(tensors):
            expert, part = divmod(index, self.parts)
            stacked[expert, part * rows:(part + 1) * rows].copy_(tensor)
        return [stacked]

    def inverse(self, tensors):
        return [chunk.contiguous() for expert in tensors[0].unbind(0)
                for chunk in torch.chunk(expert, self.parts, dim=0)]

    def forward_shapes(self, shapes):
        first = tuple(shapes[0])
        if len(shapes) != self.experts * self.parts or any(tuple(s) != first for s in shapes):
            raise ValueError(f"{self.experts} experts of {self.parts} equal tensors expected")
        return [(self.experts, first[0] * self.parts, *first[1:])]

    def inverse_shapes(self, shapes):
        experts, rows, *rest = shapes[0]
        if experts != self.experts or rows % self.parts:
            raise ValueError(f"shape {tuple(shapes[0])} is not {self.experts} experts of {self.parts} parts")
        return [(rows // self.parts, *rest)] * (self.experts * self.parts)


IDENTITY = Identity()
TRANSPOSE = Transpose()
SPLIT_HALVES = SplitRows(2)

__all__ = ["Converter", "Identity", "Transpose", "SplitRows", "RowPermutation", "GdnKeyHeadGrouping", "ConcatRows",
           "Chain", "ConfigDependent", "StackedExperts", "flat_to_grouped_order", "IDENTITY", "TRANSPOSE",
           "SPLIT_HALVES"]
