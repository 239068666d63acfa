"""The registry of checkpoint formats. A format has a name, a one-line description (shown by --help), a reader
and/or a writer, and for a writer the layout of the folder it creates. Readers return a `SourceCheckpoint` (config +
tensors + name map to the canonical layout); writers declare their name map (`target_rows`, which also refuses
configs the format cannot express) and write a plan's tensors; the layout (marker file, file names) tells `--force`
which folders it may replace.

The built-in formats are registered once, as plain data, in `hybrid_linear_cli.conversion_catalogue` (torch-free, so
that `hybrid-linear-convert --help` lists them at once); this module resolves their functions, and adds to a layout
that ships remote code the names of those source files (they follow from the package's files). Peers (`qwen3_next`,
`kimi_linear`, `fla`) join with one catalogue entry; Python code can also `register` a format with functions."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE, FormatEntry, OutputLayout

from ..configuration_hybrid_linear import HybridLinearConfig
from ..shown_values import brief
from .errors import ConversionError
from .name_maps import MapRow
from .pipeline import ConversionPlan, SourceCheckpoint, WriteOptions
from .remote_code import remote_code_files

Reader = Callable[[Path], SourceCheckpoint]
TargetRows = Callable[[HybridLinearConfig], list[MapRow]]
Writer = Callable[[Path, ConversionPlan, Iterable[tuple[str, torch.Tensor]], WriteOptions], None]


@dataclass(frozen=True)
class CheckpointFormat(FormatEntry):
    """A catalogue entry with its functions in place of their "module:function" references (the same rules for
    `can_read` / `can_write`)."""

    read: Reader | None = None
    target_rows: TargetRows | None = None
    write: Writer | None = None
    output: OutputLayout | None = None  # what `write` creates; required to write (--force checks DST against it)

    @classmethod
    def from_entry(cls, entry: FormatEntry) -> CheckpointFormat:
        """The format of a catalogue entry, its "module:function" references imported."""
        return cls(entry.name, entry.description, _resolve(entry.read), _resolve(entry.target_rows),
                   _resolve(entry.write), entry.output, entry.keeps_extra_tensors, entry.model_types)


def with_remote_code(layout: OutputLayout | None) -> OutputLayout | None:
    """`layout` with the names of the modeling sources its writer ships (`remote_code_files`) among its files."""
    if layout is None or not layout.remote_code:
        return layout
    names = tuple(path.name for path in remote_code_files())
    return dataclasses.replace(layout, files=layout.files + tuple(name for name in names if name not in layout.files))


def _resolve(reference: str | None) -> Callable | None:
    if reference is None:
        return None
    module, _, function = reference.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), function)


FORMATS: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Adds `fmt` to the registry, its output layout naming the modeling sources its writer ships."""
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is already registered")
    fmt = dataclasses.replace(fmt, output=with_remote_code(fmt.output))
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str, role: str) -> CheckpointFormat:
    """The format called `name`, which must be able to `role` ("read" or "write")."""
    fmt = FORMATS.get(name)
    able = [n for n, f in FORMATS.items() if (f.can_read if role == "read" else f.can_write)]
    if fmt is None or not (fmt.can_read if role == "read" else fmt.can_write):
        done = {"read": "read", "write": "written"}[role]
        raise ConversionError(f"cannot {role} format {brief(name)}; formats that can be {done}: {', '.join(able)}.")
    return fmt


for _entry in FORMAT_CATALOGUE:
    register(CheckpointFormat.from_entry(_entry))

__all__ = ["FORMATS", "CheckpointFormat", "OutputLayout", "get_format", "register", "with_remote_code"]
