"""Renders the model card (README.md) of an exported folder from the template
`hybrid_linear_models/model_cards/hybrid_linear.md`.

The card describes the layers through the registrations of their components (`mixer_registry`, `mlp_registry`):
each spec's `title` names it ("Gated DeltaNet") and its `describe(settings)` sums up one layer's settings ("8 key
heads of 64, 16 value heads of 64"), so a new mixer or MLP appears on the card with no edit here.
"""

from __future__ import annotations

import re
from collections import Counter
from importlib import resources

from ..component_registry import ComponentSpec
from ..configuration_hybrid_linear import HybridLinearConfig
from ..mixer_registry import MIXERS
from ..mlp_registry import MLPS
from ..shown_values import brief
from .errors import ConversionError
from .hf_layout import distinct_layers, layer_config, layer_overrides, layer_settings

TEMPLATE_NAME = "hybrid_linear.md"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def load_template() -> str:
    """The template shipped as the `hybrid_linear_models.model_cards` package data (read through importlib.resources,
    so a wheel, an editable install and a checkout on sys.path all find it beside this code)."""
    try:
        return resources.files("hybrid_linear_models.model_cards").joinpath(TEMPLATE_NAME).read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, OSError) as error:
        raise ConversionError(f"model card template {TEMPLATE_NAME} not found ({error}); reinstall the "
                              "hybrid_linear_models package.") from error


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def _title(spec: ComponentSpec, name: str) -> str:
    return spec.title or name


def _summary(config: HybridLinearConfig, kinds: list[str], registry: dict) -> str:
    """The layers' components from one registry (`kinds`: each layer's entry in it), counted by title and
    description: "6 Gated DeltaNet (8 key heads of 64, 16 value heads of 64), 2 full attention (8 heads of 128, 2 KV
    heads)". Each distinct layer setting is described once."""
    firsts, described, counts = distinct_layers(config), {}, Counter()
    for setting in layer_settings(config):
        if setting not in described:
            index = firsts[setting]
            spec = registry[kinds[index]]
            description = spec.describe(layer_config(config, index))
            described[setting] = _title(spec, kinds[index]) + (f" ({description})" if description else "")
        counts[described[setting]] += 1
    return ", ".join(f"{count} {text}" for text, count in counts.items())


def _overrides_text(config: HybridLinearConfig, index: int) -> str:
    """A layer's own settings (its per_layer_config overrides), for its row of the layer table."""
    overrides = layer_overrides(config, index)
    return "".join(f", {field}={brief(value)}" for field, value in sorted(overrides.items()))


def _layer_row(config: HybridLinearConfig, index: int, several_mlps: bool) -> str:
    layer_type, mlp_type = config.mixer_types[index], config.mlp_types[index]
    mlp = f", {_title(MLPS[mlp_type], mlp_type)} (`{mlp_type}`)" if several_mlps else ""
    mixer = f"{_title(MIXERS[layer_type], layer_type)} (`{layer_type}`)"
    return f"| {index} | {mixer}{mlp}{_overrides_text(config, index)} |"


def render_model_card(config: HybridLinearConfig, *, name: str, parameter_count: int, dtype: str,
                      source_format: str, source_format_description: str, source_path: str,
                      dtype_note: str = "", template: str | None = None) -> str:
    several_mlps = len(Counter(config.mlp_types)) > 1
    values = {
        "name": name,
        "parameter_count": _human(parameter_count),
        "parameter_count_exact": f"{parameter_count:,}",
        "num_layers": str(config.num_hidden_layers),
        "mixer_summary": _summary(config, config.mixer_types, MIXERS),
        "mlp_summary": _summary(config, config.mlp_types, MLPS),
        "hidden_size": str(config.hidden_size),
        "vocab_size": str(config.vocab_size),
        "tied_embeddings": "yes" if config.tie_word_embeddings else "no",
        "dtype": dtype,
        "layer_rows": "\n".join(_layer_row(config, i, several_mlps) for i in range(config.num_hidden_layers)),
        "source_format": source_format,
        "source_format_description": source_format_description,
        "source_path": source_path,
        "dtype_note": dtype_note,
    }
    text = template if template is not None else load_template()
    unknown = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if unknown:
        raise ConversionError(f"model card template has unknown placeholders {unknown}")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


__all__ = ["render_model_card", "load_template"]
