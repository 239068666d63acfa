"""A writer's guard, shared by every format's writer: the config file it is about to write (config.json,
metadata.yaml), read back through the format's own reader, must give the model it was written from again, model-wide
and layer by layer. Otherwise the converter would write a checkpoint it cannot read, or one that reads as another
model; the check runs before any file is written, so a refused conversion leaves nothing behind.

Per-layer settings are compared on the first layer of each distinct setting of either config (`distinct_layers`):
two layers equal in both configs agree or differ together, so this covers every layer at the cost of one comparison
per distinct setting, not per layer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .hf_layout import distinct_layers, layer_config
from .untrusted import brief

Difference = Callable[[HybridLinearConfig, HybridLinearConfig], "str | None"]


def layer_difference(expected: HybridLinearConfig, got: HybridLinearConfig,
                     fields_of: Callable[[HybridLinearConfig, int], Iterable[str]]) -> str | None:
    """The first per-layer field (of `fields_of(expected, layer)`: those the format carries) whose resolved value
    differs, described for an error message; None when every layer reads back."""
    firsts = sorted(set(distinct_layers(expected).values()) | set(distinct_layers(got).values()))
    for index in firsts:
        want, have = layer_config(expected, index), layer_config(got, index)
        for field in fields_of(expected, index):
            if getattr(want, field) != getattr(have, field):
                return (f"{field} of layer {index} ({brief(getattr(want, field))} reads back as "
                        f"{brief(getattr(have, field))})")
    return None


def check_reads_back(config: HybridLinearConfig, text: str, *, file: str, read: Callable[[str], HybridLinearConfig],
                     difference: Difference, does_not_survive: str) -> None:
    """Raises unless `read(text)` (the reader's path) gives `config` again as far as `difference` looks.
    `does_not_survive` ends the message for a field that changes: where it is lost and what to do ("config.json, so
    the written folder would describe another model; fix the field.")."""
    try:
        again = read(text)
    except ConversionError as error:
        raise ConversionError(f"refusing to write {file}: it would not read back ({str(error).rstrip('.')}). This is "
                              "a bug in the converter; please report it with the source config.") from None
    found = difference(config, again)
    if found is not None:
        raise ConversionError(f"refusing to write {file}: the config field {found} does not survive "
                              f"{does_not_survive}")


__all__ = ["check_reads_back", "layer_difference"]
