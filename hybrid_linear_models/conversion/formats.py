"""The registry of checkpoint formats. A format has a name, a one-line description (shown by --help), and a reader
and/or a writer. Readers return a `SourceCheckpoint` (config + tensors + name map to the canonical layout); writers
declare their name map (`target_rows`, which also refuses configs the format cannot express) and write a plan's
tensors. Peers (`qwen3_next`, `kimi_linear`, `fla`) join by registering the same three functions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .fast_llm import fast_llm_rows, read_fast_llm, write_fast_llm
from .fast_llm_distributed import read_fast_llm_distributed
from .hf import read_hf, write_hf
from .name_maps import MapRow, build_hf_rows
from .pipeline import ConversionPlan, SourceCheckpoint, WriteOptions

Reader = Callable[[Path], SourceCheckpoint]
TargetRows = Callable[[HybridLinearConfig], list[MapRow]]
Writer = Callable[[Path, ConversionPlan, Iterable[tuple[str, torch.Tensor]], WriteOptions], None]


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    description: str
    read: Reader | None = None
    target_rows: TargetRows | None = None
    write: Writer | None = None

    @property
    def can_read(self) -> bool:
        return self.read is not None

    @property
    def can_write(self) -> bool:
        return self.write is not None and self.target_rows is not None


FORMATS: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str, role: str) -> CheckpointFormat:
    """The format called `name`, which must be able to `role` ("read" or "write")."""
    fmt = FORMATS.get(name)
    able = [n for n, f in FORMATS.items() if (f.can_read if role == "read" else f.can_write)]
    if fmt is None or not (fmt.can_read if role == "read" else fmt.can_write):
        done = {"read": "read", "write": "written"}[role]
        raise ConversionError(f"cannot {role} format {name!r}; formats that can be {done}: {', '.join(able)}.")
    return fmt


register(CheckpointFormat(
    "hf", "this project's Hugging Face folder (config.json with auto_map, safetensors shards, remote code)",
    read=read_hf, target_rows=build_hf_rows, write=write_hf,
))
register(CheckpointFormat(
    "fast_llm", "Fast-LLM's export format: metadata.yaml + model_{n}.safetensors with '{parameter}/weights' tensors",
    read=read_fast_llm, target_rows=fast_llm_rows, write=write_fast_llm,
))
register(CheckpointFormat(
    "fast_llm_distributed", "Fast-LLM's training-state format, single rank: metadata.yaml + rank_0.safetensors",
    read=read_fast_llm_distributed,
))

__all__ = ["CheckpointFormat", "FORMATS", "register", "get_format"]
