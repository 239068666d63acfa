"""Streaming safetensors I/O: a validating reader that loads one tensor at a time with plain file reads (no mmap, so
the resident memory stays near the tensor being converted), and a writer that writes each file's header first and
then the tensors one by one as they arrive.

File layout (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data area; offsets
are relative to the data area, which the tensors tile exactly.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..safetensors_dtypes import DTYPES
from .errors import ConversionError
from .source_files import open_source_file
from .untrusted import brief, describe, parse_json

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
_HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a tensor, known before its data is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Entry:
    info: TensorInfo
    begin: int  # absolute file offset of the first byte
    end: int


def _corrupt(path: Path, problem: str) -> ConversionError:
    return ConversionError(
        f"{path} is not a valid safetensors file: {problem}. The file is truncated or corrupt; copy or export the "
        "checkpoint again."
    )


class SafetensorsFile:
    """A safetensors file whose header has been read and fully validated against the file size."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            with open_source_file(self.path) as file:
                size = os.fstat(file.fileno()).st_size
                prefix = file.read(8)
                if len(prefix) < 8:
                    raise _corrupt(self.path, f"it has {size} bytes, fewer than the 8-byte header length")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > _MAX_HEADER_BYTES:
                    raise _corrupt(self.path, f"its header length field says {header_len} bytes, more than the "
                                              f"{_MAX_HEADER_BYTES} a safetensors header may have")
                if header_len > size - 8:
                    raise _corrupt(self.path, f"its header length field says {header_len} bytes but the file has "
                                              f"{size} bytes")
                raw = file.read(header_len)
        except OSError as error:
            raise ConversionError(f"cannot read {self.path}: {error}") from error
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise _corrupt(self.path, f"its header is not UTF-8 ({error.reason} at byte {error.start})") from None
        header = parse_json(text, f"{self.path} is not a valid safetensors file: its JSON header")
        if not isinstance(header, dict):
            raise _corrupt(self.path, f"its header should be a JSON object, got {describe(header)}")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise _corrupt(self.path, f"its __metadata__ should map names to strings, got {describe(metadata)}")
        self.metadata: dict[str, str] = metadata
        data_start = 8 + header_len
        entries: dict[str, _Entry] = {}
        for name, spec in header.items():
            entries[name] = self._parse_entry(name, spec, data_start, size)
        # The tensors must tile the data area exactly: no gap, no overlap, nothing missing at the end.
        position = data_start
        for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
            if entry.begin != position:
                raise _corrupt(self.path, f"tensor {brief(name)} starts at data offset {entry.begin - data_start}, "
                                          f"expected {position - data_start} (gap or overlap)")
            position = entry.end
        if position != size:
            raise _corrupt(self.path, f"the header describes {position} bytes of file but the file has {size} bytes")
        self._entries = entries

    def _parse_entry(self, name: str, spec: object, data_start: int, size: int) -> _Entry:
        """One header entry, every value type-checked (a bool is not a dimension) and its bytes inside the file."""
        if not isinstance(spec, dict):
            raise _corrupt(self.path, f"the header entry of {brief(name)} should be an object, got {describe(spec)}")
        dtype_name, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise _corrupt(self.path, f"tensor {brief(name)} has dtype {describe(dtype_name)}, not one of "
                                      f"{', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise _corrupt(self.path, f"tensor {brief(name)} has shape {describe(shape)}, not a list of integers >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) or (
                offsets[0] > offsets[1]):
            raise _corrupt(self.path, f"tensor {brief(name)} has data_offsets {describe(offsets)}, not [begin, end] "
                                      "with 0 <= begin <= end")
        if data_start + offsets[1] > size:
            raise _corrupt(self.path, f"tensor {brief(name)} ends at data offset {offsets[1]}, past the end of the "
                                      f"file's {size - data_start} bytes of data")
        info = TensorInfo(tuple(shape), dtype)
        if offsets[1] - offsets[0] != info.nbytes:
            raise _corrupt(self.path, f"tensor {brief(name)} of shape {brief(shape)} {dtype_name} needs {info.nbytes} "
                                      f"bytes but its data_offsets span {offsets[1] - offsets[0]}")
        return _Entry(info, data_start + offsets[0], data_start + offsets[1])

    def keys(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> TensorInfo:
        return self._entries[name].info

    def read(self, name: str, element_offset: int = 0, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Reads tensor `name`, or `prod(shape)` elements of it from `element_offset` on (for flat buffers)."""
        entry = self._entries[name]
        dtype = entry.info.dtype
        shape = tuple(entry.info.shape if shape is None else shape)
        count = math.prod(shape)
        begin = entry.begin + element_offset * dtype.itemsize
        end = begin + count * dtype.itemsize
        if element_offset < 0 or end > entry.end:
            raise ConversionError(f"{self.path}: elements [{element_offset}, {element_offset + count}) lie outside "
                                  f"tensor {brief(name)} of {entry.info.numel} elements")
        return read_bytes_as_tensor(self.path, begin, end - begin, dtype, shape)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_bytes_as_tensor(path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
                         ) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = bytearray(nbytes)
    try:
        with open_source_file(path, buffering=0) as file:
            file.seek(offset)
            view = memoryview(buffer)
            done = 0
            while done < nbytes:
                got = file.readinto(view[done:])
                if not got:
                    raise ConversionError(f"{path} ended early while reading {nbytes} bytes at offset {offset}; the "
                                          "file was truncated while converting")
                done += got
    except OSError as error:
        raise ConversionError(f"cannot read {path}: {error}") from error
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


# ------------------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class FilePlan:
    """One output file: its name and its tensors, in the order they will be written."""

    name: str
    tensors: tuple[tuple[str, TensorInfo], ...]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors)


def plan_files(tensors: Sequence[tuple[str, TensorInfo]], max_file_bytes: int,
               name_for: Callable[[int, int], str]) -> list[FilePlan]:
    """Cuts the tensors, in order, into files of at most `max_file_bytes` of data (a tensor larger than that gets a
    file of its own). `name_for(index, count)` names file `index` of `count`."""
    groups: list[list[tuple[str, TensorInfo]]] = [[]]
    size = 0
    for name, info in tensors:
        if groups[-1] and size + info.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, info))
        size += info.nbytes
    return [FilePlan(name_for(index, len(groups)), tuple(group)) for index, group in enumerate(groups)]


def _header_bytes(plan: FilePlan, metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, info in plan.tensors:
        header[name] = {"dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw little-endian bytes, without a copy when it is already contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_files(directory: Path, plans: Sequence[FilePlan], tensors: Iterable[tuple[str, torch.Tensor]],
                metadata: Mapping[str, str] | None = None,
                file_metadata: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Writes `plans` into `directory`, streaming `tensors`, which must arrive exactly in plan order with the planned
    shapes and dtypes. A file is opened when its first tensor arrives and closed after its last. Every header holds
    `metadata`, and a file named in `file_metadata` also its own entries."""
    iterator: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    for plan in plans:
        with open(directory / plan.name, "wb") as file:
            file.write(_header_bytes(plan, {**(metadata or {}), **(file_metadata or {}).get(plan.name, {})}))
            for name, info in plan.tensors:
                try:
                    got_name, tensor = next(iterator)
                except StopIteration:
                    raise RuntimeError(f"tensor stream ended before {name!r}") from None
                if got_name != name or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
                    raise RuntimeError(f"tensor stream out of plan: got {got_name!r} {tuple(tensor.shape)} "
                                       f"{tensor.dtype}, planned {name!r} {info.shape} {info.dtype}")
                file.write(tensor_bytes(tensor))
                del tensor  # before the next one is produced
            file.flush()
            os.fsync(file.fileno())
    leftover = next(iterator, None)
    if leftover is not None:
        raise RuntimeError(f"tensor stream has an unplanned tensor {leftover[0]!r}")


class SafetensorsTensors:
    """A `TensorSource` over tensors spread across safetensors files: {stored name: file}."""

    def __init__(self, files: Mapping[str, SafetensorsFile]):
        self._files = dict(files)

    def keys(self) -> list[str]:
        return list(self._files)

    def info(self, key: str) -> TensorInfo:
        return self._files[key].info(key)

    def load(self, key: str) -> torch.Tensor:
        return self._files[key].read(key)


__all__ = ["DTYPES", "DTYPE_NAMES", "TensorInfo", "SafetensorsFile", "SafetensorsTensors", "FilePlan", "plan_files",
           "write_files"]
