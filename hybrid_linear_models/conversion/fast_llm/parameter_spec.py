"""One Fast-LLM parameter, as the tables of `parameters.py` (embeddings, block norms, MLP, head) and of each mixer
(`mixer_*.py`) declare it: its name, how it maps to canonical (our Hugging Face) tensors, and its two flags in
Fast-LLM's stage order (weight decay; tensor-parallel: has a dimension Fast-LLM can split over heads, independent of
the actual parallelism), which decide the `distributed` format's buffer order (`distributed.stage_layout`).

Biases (Fast-LLM's `{layer}.bias`, right after the layer's weight) have no weight decay and are tensor-parallel when
the layer's output dimension is split: not for output projections, whose output is the hidden size
(fast_llm/layers/common/linear/config.py, AffineLinearConfig.get_layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, Converter

Rule = Callable[[HybridLinearConfig], bool]
ALWAYS: Rule = lambda config: True  # noqa: E731
NEVER: Rule = lambda config: False  # noqa: E731


@dataclass(frozen=True)
class Parameter:
    """One Fast-LLM parameter: its name (relative to `decoder.{i}.` inside a block), how it maps to canonical tensors,
    and its flags in Fast-LLM's stage order. `when` restricts it to some configs (the output weight exists only when
    untied, biases only when enabled)."""

    name: str
    converter: Converter
    canonical: str | tuple[str, ...]
    weight_decay: bool = True
    tensor_parallel: Rule = ALWAYS
    when: Rule | None = None

    def present(self, config: HybridLinearConfig) -> bool:
        return self.when is None or self.when(config)


def same(name: str, canonical: str, weight_decay: bool = True, tensor_parallel: Rule = ALWAYS) -> Parameter:
    """A parameter stored as our tensor is."""
    return Parameter(name, IDENTITY, canonical, weight_decay, tensor_parallel)


def bias(name: str, converter: Converter, canonical: str | tuple[str, ...], tensor_parallel: Rule,
         when: Rule) -> Parameter:
    """A bias: no weight decay, present only `when` the config enables it."""
    return Parameter(name, converter, canonical, weight_decay=False, tensor_parallel=tensor_parallel, when=when)


__all__ = ["Rule", "ALWAYS", "NEVER", "Parameter", "same", "bias"]
