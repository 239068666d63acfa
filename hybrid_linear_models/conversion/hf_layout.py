"""The canonical layout: the parameter names and shapes of our Hugging Face model (`HybridLinearForCausalLM`) for a
given config, read from the model itself built on the meta device (no memory, no initialisation), so that a mixer's
tensors are declared once, by the mixer.

Only one decoder layer per distinct layer setting is built (the layer type plus its per-layer overrides), and the
model's top-level tensors come from a one-layer copy of the config: the cost does not grow with the number of
layers, and a config claiming a million layers never builds a million-entry module list. Readers still bound the
config's sizes by the stored tensors (`pipeline.TensorCensus`, `pipeline.check_tensor_sizes`) before anything is
built here; a size the meta build cannot even represent is a ValueError naming the layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from ..configuration_hybrid_linear import (
    DEFAULT_MLP_TYPE,
    PARALLEL_MTP_TYPE,
    HybridLinearConfig,
    repeated_layer_config,
)

Shape = tuple[int, ...]

EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_LAYERS = "model.layers."


def layer_prefix(index: int) -> str:
    return f"{_LAYERS}{index}."


def layer_overrides(config: HybridLinearConfig, index: int) -> dict[str, Any]:
    """Layer `index`'s per-layer overrides of the flat fields (empty for a homogeneous config)."""
    spec = config.__dict__.get("_heterogeneity_spec")
    return dict(spec.per_layer_overrides.get(index, {})) if spec is not None else {}


def layer_config(config: HybridLinearConfig, index: int) -> HybridLinearConfig:
    """Layer `index`'s resolved config (the global one for a homogeneous config)."""
    return config.per_layer_config[index]


def _layer_kinds(config: HybridLinearConfig) -> list[str]:
    """Each layer's mixer type, with its MLP type when that is not the default one."""
    return [layer_type if mlp_type == DEFAULT_MLP_TYPE else f"{layer_type}+{mlp_type}"
            for layer_type, mlp_type in zip(config.mixer_types, config.mlp_types)]


def _setting(kind: str, overrides: dict[str, Any]) -> str:
    return repr((kind, sorted(overrides.items()))) if overrides else kind


def layer_setting(config: HybridLinearConfig, index: int) -> str:
    """A key equal for two layers exactly when they have the same mixer and MLP types and the same overrides (same
    tensors)."""
    return _setting(_layer_kinds(config)[index], layer_overrides(config, index))


def layer_settings(config: HybridLinearConfig) -> list[str]:
    """`layer_setting` of every layer (cheap for the layers without overrides: their types)."""
    kinds, spec = _layer_kinds(config), config.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return kinds
    return [_setting(kind, spec.per_layer_overrides.get(index, {})) for index, kind in enumerate(kinds)]


def distinct_layers(config: HybridLinearConfig) -> dict[str, int]:
    """layer setting -> the first layer that has it."""
    first: dict[str, int] = {}
    for index, setting in enumerate(layer_settings(config)):
        first.setdefault(setting, index)
    return first


def _meta_shapes(module: torch.nn.Module) -> dict[str, Shape]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def _layer_shapes(config: HybridLinearConfig, index: int) -> dict[str, Shape]:
    """The tensors of decoder layer `index`, relative to its prefix, from the layer built on the meta device."""
    from ..modeling_hybrid_linear import HybridLinearDecoderLayer  # the model, only when a layout is asked for

    try:
        with torch.device("meta"):  # the layer's resolved config: a homogeneous one, whatever the model reads
            return _meta_shapes(HybridLinearDecoderLayer(layer_config(config, index), index))
    except AmbiguousGlobalPerLayerAttributeError:
        raise
    except RuntimeError as error:  # e.g. a size product beyond int64, which no checkpoint can hold
        raise ValueError(f"layer {index} ({config.mixer_types[index]}): its sizes make tensors this model cannot "
                         f"build ({str(error).splitlines()[0][:200]}); fix the config's sizes.") from None


def _top_level_shapes(config: HybridLinearConfig) -> dict[str, Shape]:
    """Embeddings, final norm and LM head (absent when tied), from a one-layer copy of the model on the meta device."""
    from ..modeling_hybrid_linear import HybridLinearForCausalLM

    # one layer: the first (its overrides do not change the top-level tensors), or, for Fast-LLM's MTP layers
    # (`mtp.*`, copies of the last layer), the last with its overrides
    parallel = config.num_mtp_layers and config.mtp_type == PARALLEL_MTP_TYPE
    one_layer = repeated_layer_config(config, config.num_hidden_layers - 1 if parallel else 0, 1)
    if not parallel:
        one_layer.__dict__.pop("_heterogeneity_spec", None)
    with torch.device("meta"):
        model = HybridLinearForCausalLM(one_layer)
    shapes = {name: shape for name, shape in _meta_shapes(model).items() if not name.startswith(_LAYERS)}
    if config.tie_word_embeddings:  # the tied copy is not stored
        for tied in getattr(model, "_tied_weights_keys", None) or {}:
            shapes.pop(tied, None)
    return shapes


class CanonicalLayout:
    """The canonical tensors of one config, with one meta layer built per distinct layer setting (and kept)."""

    def __init__(self, config: HybridLinearConfig):
        self.config = config
        self._settings = layer_settings(config)
        self._by_setting: dict[str, dict[str, Shape]] = {}
        self._top: dict[str, Shape] | None = None

    def layer(self, index: int) -> dict[str, Shape]:
        setting = self._settings[index]
        if setting not in self._by_setting:
            self._by_setting[setting] = _layer_shapes(self.config, index)
        return self._by_setting[setting]

    def top(self) -> dict[str, Shape]:
        if self._top is None:
            self._top = _top_level_shapes(self.config)
        return self._top

    def shapes(self, layers: Iterable[int] | None = None) -> dict[str, Shape]:
        top = self.top()
        shapes = {name: shape for name, shape in top.items() if name == EMBEDDINGS}
        for index in range(len(self._settings)) if layers is None else layers:
            prefix = layer_prefix(index)
            shapes.update((prefix + name, shape) for name, shape in self.layer(index).items())
        shapes.update((name, shape) for name, shape in top.items() if name != EMBEDDINGS)
        return shapes


def hf_tensor_shapes(config: HybridLinearConfig, layers: Iterable[int] | None = None) -> dict[str, Shape]:
    """Every tensor of the model in `config`, in a stable order: embeddings, layers (only `layers` if given), final
    norm, LM head (absent when the embeddings are tied)."""
    return CanonicalLayout(config).shapes(layers)


def one_layer_per_type(config: HybridLinearConfig) -> dict[str, Shape]:
    """The tensors of one layer of each distinct layer setting: every distinct tensor shape, cheaply."""
    return hf_tensor_shapes(config, sorted(distinct_layers(config).values()))


def elements_per_layer(config: HybridLinearConfig) -> list[int]:
    """Weight elements of each layer (one meta layer built per distinct setting)."""
    layout = CanonicalLayout(config)
    settings = layer_settings(config)
    first = {setting: index for index, setting in reversed(list(enumerate(settings)))}
    per_setting = {setting: sum(math.prod(shape) for shape in layout.layer(index).values())
                   for setting, index in first.items()}
    return [per_setting[setting] for setting in settings]


__all__ = ["hf_tensor_shapes", "one_layer_per_type", "elements_per_layer", "layer_prefix", "layer_config",
           "layer_overrides", "layer_setting", "layer_settings", "distinct_layers", "CanonicalLayout", "EMBEDDINGS",
           "FINAL_NORM", "LM_HEAD"]
