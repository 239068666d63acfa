"""Fast-LLM's `distributed` checkpoint format (read only): `metadata.yaml` + `rank_{r}.safetensors`, each rank file
holding one flat buffer per state shard (`weights_shard`, optimizer shards). Supported for a single-rank save
(world size 1), whose `weights_shard` is the model's parameters laid out by Fast-LLM's stage rules:

- one stage for the embeddings, one per decoder block, one for the head (final norm, then the output weight unless
  tied), then for each multi-token-prediction head one for its block (a copy of the last block) and one for its
  final norm (its output weight is the first head's, not stored again); each stage's slice is padded with zeros to
  a multiple of 32 elements;
- inside a stage, parameters in definition order (block: norm_1, norm_2, mixer, MLP), then stably sorted by
  (weight decay, weight decay == tensor-parallel), i.e. no-decay tensor-parallel parameters (dt_bias, A_log) first,
  then norms, then weights that are not tensor-parallel (low-rank KDA projections, MQA key_value), then the rest.

Tensor-parallel means "has a dimension Fast-LLM can split over heads", independent of the actual parallelism; both
flags are columns of the parameter tables (`parameters.py`, and each mixer's record in `mixers.py`), which also give
the name map, and each block's flags follow that block's own settings (a 1-KV-head block's key_value is not
tensor-parallel, a 2-KV-head block's is).
Biases (no weight decay; tensor-parallel unless they belong to an output projection) follow Fast-LLM's
AffineLinearConfig; the fixtures have none, so their place is pinned only by Fast-LLM's source and by the tests'
checkpoints laid out from it. The weight layouts are checked against both fixtures; configurations the fixtures do not
cover (a GDN/KDA mixer with a single head) are refused rather than guessed.

A flat buffer's names say nothing about the blocks, so the config's sizes are bounded by the buffer's length while
they are read, and the buffer length the config implies is computed from one meta-built layer per distinct layer
setting and compared before `stage_layout` builds its per-layer table.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...configuration_hybrid_linear import HybridLinearConfig
from ..errors import ConversionError
from ..hf_layout import distinct_layers, elements_per_layer, hf_tensor_shapes, layer_config
from ..name_maps import MapRow
from ..pipeline import SourceCheckpoint, TensorCensus
from ..safetensors_io import SafetensorsFile, TensorInfo
from ..untrusted import Fields, brief, matches
from .checkpoint import WEIGHTS_SHARD, load_metadata
from .config import block_path, fast_llm_to_hybrid_config
from .mixers import mixer_of_layer_type
from .parameters import (
    EMBEDDINGS_PARAMETERS,
    HEAD_PARAMETERS,
    MTP_HEAD_PARAMETERS,
    Parameter,
    block_definition_order,
    block_prefix,
    build_fast_llm_rows,
    mtp_block_prefix,
    mtp_head_prefix,
)

STAGE_PAD = 32


def _check_verified(config: HybridLinearConfig, base_model: dict) -> None:
    for index in distinct_layers(config).values():
        layer_type = config.mixer_types[index]
        reason = mixer_of_layer_type(layer_type).distributed_unverified(layer_config(config, index))
        if reason is not None:
            raise ConversionError(f"metadata.yaml: Fast-LLM block {block_path(base_model, index)} (layer {index}): "
                                  f"{reason}; save the checkpoint in Fast-LLM's `fast_llm` format and convert that.")


def _stage_order(parameters: list[Parameter], prefix: str, config: HybridLinearConfig) -> list[str]:
    def key(parameter: Parameter) -> tuple[bool, bool]:
        return parameter.weight_decay, parameter.weight_decay == parameter.tensor_parallel(config)

    return [prefix + p.name for p in sorted(parameters, key=key) if p.present(config)]  # sorted() is stable


def stage_layout(config: HybridLinearConfig) -> list[list[str]]:
    """Parameter names per stage, in buffer order; each block's flags follow that block's own settings."""
    stages = [_stage_order(list(EMBEDDINGS_PARAMETERS), "", config)]
    for index in range(len(config.mixer_types)):
        stages.append(_stage_order(list(block_definition_order(config, index)), block_prefix(index),
                                   layer_config(config, index)))
    stages.append(_stage_order(list(HEAD_PARAMETERS), "", config))
    last = config.num_hidden_layers - 1  # each MTP head: a stage for its block (a copy of the last), one for its norm
    for index in range(config.num_mtp_layers):
        stages.append(_stage_order(list(block_definition_order(config, last)), mtp_block_prefix(index),
                                   layer_config(config, last)))
        stages.append(_stage_order(list(MTP_HEAD_PARAMETERS), mtp_head_prefix(index), config))
    return stages


class DistributedTensors:
    """A `TensorSource` over parameters stored as slices of one flat buffer."""

    def __init__(self, file: SafetensorsFile, buffer: str, slices: dict[str, tuple[int, tuple[int, ...]]]):
        self._file, self._buffer, self._slices = file, buffer, slices
        self._dtype = file.info(buffer).dtype

    def keys(self) -> list[str]:
        return list(self._slices)

    def info(self, key: str) -> TensorInfo:
        return TensorInfo(self._slices[key][1], self._dtype)

    def load(self, key: str) -> torch.Tensor:
        offset, shape = self._slices[key]
        return self._file.read(self._buffer, offset, shape)


def _check_single_rank(path: Path, metadata: dict) -> None:
    config = Fields(metadata["config"], "config", str(path / "metadata.yaml"))
    distributed = config.mapping("distributed")
    for field, single in (("world_size", 1), ("tensor_parallel", 1), ("pipeline_parallel", 1),
                          ("sequence_tensor_parallel", False)):
        if not matches(distributed.get(field, single), single):
            raise ConversionError(f"{path / 'metadata.yaml'}: config.distributed.{field} = "
                                  f"{brief(distributed.get(field))}; only single-rank distributed checkpoints "
                                  "convert. Save it in the `fast_llm` format instead.")
    if config.get("multi_stage"):
        raise ConversionError(f"{path / 'metadata.yaml'}: config.multi_stage is set ({brief(config.get('multi_stage'))}"
                              "), which changes the stage layout; save the checkpoint in the `fast_llm` format "
                              "instead.")
    ranks = sorted(p.name for p in path.glob("rank_*.safetensors"))
    if ranks != ["rank_0.safetensors"]:
        raise ConversionError(f"SRC {path} has rank files {brief(ranks)}; a single-rank checkpoint has exactly "
                              "rank_0.safetensors.")


def _padded(elements: int) -> int:
    return -(-elements // STAGE_PAD) * STAGE_PAD


def buffer_elements(config: HybridLinearConfig) -> int:
    """The flat buffer's length for `config`, by arithmetic over one meta layer per distinct layer setting (no
    per-layer table: it is compared with the stored buffer before `stage_layout` builds one)."""
    head = config.hidden_size + (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    per_layer = elements_per_layer(config)
    blocks = sum(_padded(elements) for elements in per_layer)
    mtp = config.num_mtp_layers * (_padded(per_layer[-1]) + _padded(config.hidden_size))  # (copies of the last block)
    return _padded(config.vocab_size * config.hidden_size) + blocks + _padded(head) + mtp


def read_fast_llm_distributed(path: Path) -> SourceCheckpoint:
    path = Path(path)
    metadata = load_metadata(path, "distributed", "fast_llm_distributed")
    _check_single_rank(path, metadata)
    file = SafetensorsFile(path / "rank_0.safetensors")
    buffer = f"{WEIGHTS_SHARD}_shard"
    expected_buffers = {f"{shard}_shard" for shard in metadata.get("shards", [])}
    unknown = sorted(set(file.keys()) - expected_buffers)
    if buffer not in file.keys() or unknown:
        raise ConversionError(f"{file.path} holds {brief(sorted(file.keys()))}; expected one flat buffer per shard "
                              f"listed in metadata.yaml ({brief(sorted(expected_buffers))}).")
    skipped = sorted(set(file.keys()) - {buffer})
    info = file.info(buffer)
    if len(info.shape) != 1:
        raise ConversionError(f"{file.path}: {buffer} has shape {brief(list(info.shape))}; a flat buffer has one "
                              "dimension. The checkpoint is corrupt.")
    # The names of a flat buffer do not tell the blocks: the census bounds sizes by the buffer's length only.
    census = TensorCensus(info.numel)
    # The config decides the layout; whether the output weight is tied cannot be read from a flat buffer.
    config = fast_llm_to_hybrid_config(metadata["config"]["base_model"], " (it decides the buffer layout)", census)
    expected = buffer_elements(config)
    if info.shape != (expected,):
        raise ConversionError(f"{file.path}: {buffer} has shape {list(info.shape)}, but the config in metadata.yaml "
                              f"implies [{expected}]. The config does not match the weights, or the checkpoint was "
                              "saved with a parallel layout; save it in the `fast_llm` format instead.")
    _check_verified(config, metadata["config"]["base_model"])
    rows = build_fast_llm_rows(config)
    shapes = _format_shapes(config, rows)
    slices: dict[str, tuple[int, tuple[int, ...]]] = {}
    padding: list[tuple[int, int]] = []
    offset = 0
    for stage in stage_layout(config):
        begin = offset
        for name in stage:
            slices[name] = (offset, shapes[name])
            offset += math.prod(shapes[name])
        end = begin + _padded(offset - begin)
        padding.append((offset, end))
        offset = end
    if offset != expected:
        raise RuntimeError(f"stage layout of {offset} elements, arithmetic gives {expected}")
    for begin, end in padding:
        if end > begin and torch.count_nonzero(file.read(buffer, begin, (end - begin,))):
            raise ConversionError(f"{file.path}: the stage padding at elements [{begin}, {end}) is not zero, so the "
                                  "buffer layout is not the one this converter expects; save the checkpoint in the "
                                  "`fast_llm` format instead.")
    return SourceCheckpoint("fast_llm_distributed", path, config, DistributedTensors(file, buffer, slices), rows,
                            skipped)


def _format_shapes(config: HybridLinearConfig, rows: list[MapRow]) -> dict[str, tuple[int, ...]]:
    canonical = hf_tensor_shapes(config)
    shapes = {}
    for row in rows:
        for name, shape in zip(row.format_keys, row.converter.inverse_shapes([canonical[k] for k in
                                                                                row.canonical_keys])):
            shapes[name] = tuple(shape)
    return shapes


__all__ = ["read_fast_llm_distributed", "stage_layout", "buffer_elements"]
