"""Random checkpoints of a given config in any writable format, generated and written tensor by tensor (for tests
and benchmarks; the values are plausible, not trained)."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from ..configuration_hybrid_linear import HybridLinearConfig
from .formats import get_format
from .hf_layout import hf_tensor_shapes
from .name_maps import build_hf_rows
from .pipeline import SourceCheckpoint, WriteOptions, plan_conversion, stream_tensors
from .safety import atomic_output_dir
from .safetensors_io import TensorInfo


class RandomTensors:
    """A `TensorSource` of canonical tensors drawn from a generator seeded per tensor name (deterministic)."""

    def __init__(self, config: HybridLinearConfig, dtype: torch.dtype = torch.float32, seed: int = 0):
        self._shapes = hf_tensor_shapes(config)
        self._dtype, self._seed = dtype, seed

    def keys(self) -> list[str]:
        return list(self._shapes)

    def info(self, key: str) -> TensorInfo:
        return TensorInfo(self._shapes[key], self._dtype)

    def load(self, key: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + zlib.crc32(key.encode()))
        values = torch.randn(self._shapes[key], generator=generator)
        if key.endswith(("norm.weight", "layernorm.weight")):
            values = 1.0 + 0.1 * values
        elif key.endswith(("dt_bias", "A_log")):
            values = 0.5 + 0.3 * values
        else:
            values = 0.05 * values
        return values.to(self._dtype)


def write_random_checkpoint(path: str | Path, config: HybridLinearConfig, to_format: str = "fast_llm",
                            dtype: torch.dtype = torch.float32, seed: int = 0,
                            max_shard_bytes: int = 5 * 10**9) -> Path:
    """Writes a random checkpoint of `config` at `path` (which must not exist) in `to_format`."""
    path = Path(path)
    writer = get_format(to_format, "write")
    source = SourceCheckpoint("random", Path("<random>"), config, RandomTensors(config, dtype, seed),
                              build_hf_rows(config))
    plan = plan_conversion(source, writer.target_rows(config))
    with atomic_output_dir(path) as staging:
        writer.write(staging, plan, stream_tensors(plan), WriteOptions(max_shard_bytes, output_name=path.name,
                                                                        source_description="random weights"))
    return path


__all__ = ["RandomTensors", "write_random_checkpoint"]
