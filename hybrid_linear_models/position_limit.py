"""How far a model's positions go, and the one-line warning for inputs past them.

Only full-attention layers with a rotary embedding have a reach: rotary attention depends on the distance between a
query and a key, which in a full-attention layer grows with the context, while a sliding-window layer never sees a
distance past its window and the GDN/KDA layers take no positions. A model without such a layer has no limit (None).

A full-attention layer's reach is `max_position_embeddings`, extended by its rope scaling: `factor` times the
pretrained length for the types that stretch the positions ("linear", "dynamic", "yarn", "llama3"), the pretrained
length being `original_max_position_embeddings` where the config gives it (yarn, llama3) and
`max_position_embeddings` otherwise. Configs written either way read right: Qwen's
(max_position_embeddings 32768, yarn factor 4 from an original 32768: 131,072 positions) and DeepSeek's (an extended
max_position_embeddings 163840 beside an original 4096 and factor 40: 163,840). The model's limit is the smallest reach
of its layers.

Past it, transformers' Qwen3-Next runs as asked (its forward checks nothing; `generate` only warns once, past
`max_position_embeddings`), and the rotary tables themselves are defined at any position: so does this model, with
one warning per model naming the limit and how to extend it, before any work. A static cache's key slots past it are
refused up front (cache_checks: what `generate` would otherwise allocate for max_new_tokens=10**9).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)

# rope types whose `factor` stretches the trained positions (transformers' ROPE_INIT_FUNCTIONS); "longrope" switches
# to its long factors past the original length, up to max_position_embeddings
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def layer_reach(settings: Any, rope: dict) -> tuple[int, str]:
    """(positions, how they are made up) of one full-attention layer of `settings` with rotary `rope` parameters."""
    positions = settings.max_position_embeddings
    factor = rope.get("factor")
    if rope.get("rope_type") not in STRETCHING_ROPE_TYPES or not isinstance(factor, (int, float)) or factor <= 1:
        return positions, "max_position_embeddings"
    original = rope.get("original_max_position_embeddings") or positions
    stretched = math.floor(original * factor)
    if stretched <= positions:  # max_position_embeddings is the extended length already (DeepSeek's way)
        return positions, "max_position_embeddings"
    source = "original_max_position_embeddings" if original != positions else "max_position_embeddings"
    return stretched, f"{source} {original} x rope factor {factor:g}, {rope['rope_type']}"


def position_limit(config: Any) -> tuple[int, str] | None:
    """(the positions the model reaches, how they are made up) over its full-attention layers with rotary embeddings
    (see the module docstring); None: no such layer, no limit."""
    from .mixer_registry import MIXERS

    reaches = []
    for index, mixer_type in enumerate(config.mixer_types):
        spec = MIXERS[mixer_type]
        if spec.state != "kv" or spec.layer_type != "full_attention":
            continue
        settings = config.per_layer_config[index]
        rotary = spec.rotary_settings(settings)
        if rotary is not None:
            reaches.append(layer_reach(settings, rotary.rope_parameters))
    return min(reaches, key=lambda reach: reach[0]) if reaches else None


def model_position_limit(model: Any) -> tuple[int, str] | None:
    """`position_limit` of a model's config, worked out once per model (read at every forward)."""
    reach = model.__dict__.get("_position_reach", False)
    if reach is False:  # (None: no limit)
        reach = model.__dict__["_position_reach"] = position_limit(model.config)
    return reach


def past_positions_line(config: Any, tokens: int, what: str) -> str | None:
    """The warning for `what` ("the input", "the prompt plus max_new_tokens") of `tokens` positions, None where they
    fit."""
    limit = position_limit(config)
    if limit is None or tokens <= limit[0]:
        return None
    positions, made_up = limit
    rope = config.rope_parameters if isinstance(config.rope_parameters, dict) else {}
    original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = math.ceil(tokens / original * 10) / 10  # (one decimal, rounded up: enough)
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            **{key: rope[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope}}
    return (f"{what} reaches {tokens} positions; this model's positions go to {positions} ({made_up}), past which its "
            f"full-attention layers' rotary embedding is untrained: shorten it, or extend the positions with "
            f"rope_parameters={yarn} in the config.")


def warn_if_input_past_positions(model: Any, past: Any, new_tokens: int, position_ids: Any = None) -> None:
    """A forward's check, before any work: `warn_past_positions` for an input of `new_tokens` after `past` cached
    ones (the positions given, where given, are read only past the limit). Costs a comparison per call: the limit
    is worked out once per model; a count only the device holds (a static cache's on CUDA) and a compiled forward are
    not checked."""
    if not isinstance(past, int) or getattr(model, "_warned_past_positions", False):
        return
    if torch.compiler.is_compiling():
        return
    reach = model_position_limit(model)
    if reach is None or past + new_tokens <= reach[0]:
        return
    tokens = past + new_tokens
    if isinstance(position_ids, torch.Tensor) and position_ids.numel():  # (left padding counts no position)
        tokens = int(position_ids.max()) + 1
    warn_past_positions(model, tokens, "the input")


def warn_past_positions(model: Any, tokens: int, what: str) -> None:
    """Logs `past_positions_line` once per model (the first input past the positions; later ones say nothing)."""
    if getattr(model, "_warned_past_positions", False):
        return
    line = past_positions_line(model.config, tokens, what)
    if line is not None:
        model._warned_past_positions = True
        logger.warning(line)


__all__ = ["STRETCHING_ROPE_TYPES", "layer_reach", "model_position_limit", "past_positions_line", "position_limit",
           "warn_if_input_past_positions", "warn_past_positions"]
