"""Renders the model card (README.md) of an exported folder from the template `model_cards/hybrid_linear.md`."""

from __future__ import annotations

import re
from collections import Counter
from importlib import resources
from pathlib import Path

from ..configuration_hybrid_linear import HybridLinearConfig
from ..shown_values import brief
from .errors import ConversionError
from .hf_layout import layer_config, layer_overrides

TEMPLATE_NAME = "hybrid_linear.md"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_MIXER_NAMES = {
    "full_attention": "full attention",
    "sliding_attention": "sliding-window attention",
    "gated_deltanet": "Gated DeltaNet",
    "kimi_delta_attention": "Kimi Delta Attention",
}


def load_template() -> str:
    """The template from the installed `hybrid_linear_models.model_cards` package, else from the source checkout's
    top-level `model_cards/` folder."""
    try:
        return resources.files("hybrid_linear_models.model_cards").joinpath(TEMPLATE_NAME).read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConversionError(f"model card template {TEMPLATE_NAME} not found ({error}); reinstall the "
                              "hybrid_linear_models package.") from error


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def _intermediate_sizes(config: HybridLinearConfig) -> str:
    sizes = list(dict.fromkeys(layer_config(config, i).intermediate_size for i in range(config.num_hidden_layers)))
    return str(sizes[0]) if len(sizes) == 1 else ", ".join(map(str, sizes)) + " (per layer)"


def _overrides_text(config: HybridLinearConfig, index: int) -> str:
    """A layer's own settings (its per_layer_config overrides), for its row of the layer table."""
    overrides = layer_overrides(config, index)
    return "".join(f", {field}={brief(value)}" for field, value in sorted(overrides.items()))


def render_model_card(config: HybridLinearConfig, *, name: str, parameter_count: int, dtype: str,
                      source_format: str, source_format_description: str, source_path: str,
                      dtype_note: str = "", template: str | None = None) -> str:
    counts = Counter(config.layer_types)
    values = {
        "name": name,
        "parameter_count": _human(parameter_count),
        "parameter_count_exact": f"{parameter_count:,}",
        "num_layers": str(config.num_hidden_layers),
        "mixer_summary": ", ".join(f"{n} {_MIXER_NAMES[t]}" for t, n in counts.items()),
        "hidden_size": str(config.hidden_size),
        "intermediate_size": _intermediate_sizes(config),
        "vocab_size": str(config.vocab_size),
        "tied_embeddings": "yes" if config.tie_word_embeddings else "no",
        "dtype": dtype,
        "layer_rows": "\n".join(f"| {i} | {_MIXER_NAMES[t]} (`{t}`){_overrides_text(config, i)} |"
                                for i, t in enumerate(config.layer_types)),
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
