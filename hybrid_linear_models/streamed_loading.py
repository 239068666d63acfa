"""How `from_pretrained` reads a folder's safetensors shards when every weight goes to an accelerator: read into
buffers of their own, not memory-mapped.

transformers opens every shard with a memory map before it loads the first weight and closes them after the last:
each page that a weight's copy to the GPU touches stays mapped into the process until then, so the host's resident
memory climbs to the size of the whole folder (82 GB for Qwen3-Next-80B-A3B in FP8), although no weight stays on the
host. Through safetensors' `pread` backend (transformers' own reader on Windows and MPS) a weight's bytes are read
into a buffer of its own when transformers materialises it, copied to the device and freed: the host holds the
weights in flight (transformers materialises them on a pool of four threads), not the folder. The same slices go to
the same loading code; only where their bytes come from differs.

A whole tensor (what transformers asks of a slice, `slice[...]`) is read with one `os.preadv` of its byte range into
a tensor's own storage (`_WholeReads`): safetensors' pread backend takes twice as long for the same bytes (it reads
into a buffer of its own, then copies), slower than the memory map on a cold page cache. Partial reads (a sharded
load's slices), shapes and dtypes stay safetensors'.

Weights that stay on the host (a CPU model, a device map that places some on the CPU or the disk) keep the memory
map: a weight there is the mapped file's pages, read as they are used and shared with the page cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from .device_placement import placement_type
from .safetensors_dtypes import DTYPES

STREAMED_DEVICE_TYPES = ("cuda", "xpu")  # (tests add "cpu")


def streams(state_dict: dict | None, checkpoint_files: list[str] | None, load_config: Any) -> bool:
    """Whether this load reads its shards (see the module docstring): safetensors files, no state dict given, memory
    maps allowed, and a device map that places every weight on a device of `STREAMED_DEVICE_TYPES`."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    device_map = load_config.device_map
    return (state_dict is None and bool(checkpoint_files)
            and all(str(file).endswith(".safetensors") for file in checkpoint_files)
            and not load_config.disable_mmap and bool(device_map) and not is_deepspeed_zero3_enabled()
            and all(placement_type(placement) in STREAMED_DEVICE_TYPES for placement in device_map.values()))


@contextlib.contextmanager
def read_shards(checkpoint_files: list[str]) -> Iterator[dict[str, Any] | None]:
    """Every tensor of `checkpoint_files` as a lazy slice read through `pread` (name -> slice, as transformers' own
    reader collects them), the files closed on exit; None where the installed safetensors has no pread backend."""
    handles = []
    try:
        slices = {}
        for file in checkpoint_files:
            try:
                handle = safe_open(file, framework="pt", device="cpu", backend="pread")
            except TypeError:  # (a safetensors without backends: transformers' memory maps)
                slices = None
                break
            handles.append(handle)
            names = handle.keys()  # (a safe_open handle: no dict, no iteration)
            reads = _WholeReads.of(file)
            if reads is not None:
                handles.append(reads)
            slices.update((name, handle.get_slice(name) if reads is None else reads.slice(name, handle.get_slice(name)))
                          for name in names)
        yield slices
    finally:
        for handle in handles:
            handle.__exit__(None, None, None)


_MAX_READ = 2**30  # bytes a preadv call asks for (Linux returns at most 2 GiB - 4 KiB a call)


class _WholeReads:
    """One shard's tensors read whole with `os.preadv` into a tensor's own storage; their byte ranges from the
    safetensors header (8 bytes of little-endian length, then the JSON of dtypes, shapes and data_offsets)."""

    def __init__(self, fd: int, data_start: int, entries: dict[str, dict]):
        self.fd, self.data_start, self.entries = fd, data_start, entries

    @classmethod
    def of(cls, file: str) -> _WholeReads | None:
        """The reader of `file`; None where os.preadv is missing (Windows)."""
        if not hasattr(os, "preadv"):
            return None
        fd = os.open(file, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
        except BaseException:
            os.close(fd)
            raise
        header.pop("__metadata__", None)
        return cls(fd, 8 + length, header)

    def slice(self, name: str, fallback: Any) -> Any:
        entry = self.entries[name]  # (a dtype torch has no view for is read through safetensors)
        return fallback if entry["dtype"] not in DTYPES else _WholeSlice(self, entry, fallback)

    def read(self, entry: dict) -> torch.Tensor:
        start, end = entry["data_offsets"]
        data = torch.empty(end - start, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < end - start:
            count = os.preadv(self.fd, [view[done : done + _MAX_READ]], self.data_start + start + done)
            if count == 0:
                raise OSError(f"{end - start - done} bytes of a tensor are missing at the end of its safetensors file")
            done += count
        return data.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def __exit__(self, *_) -> None:
        os.close(self.fd)


class _WholeSlice:
    """A safetensors slice whose whole read (`slice[...]`, `slice[:]`) is `_WholeReads.read`; all else is the
    safetensors slice's."""

    def __init__(self, reads: _WholeReads, entry: dict, fallback: Any):
        self.reads, self.entry, self.fallback = reads, entry, fallback

    def __getitem__(self, key: Any) -> torch.Tensor:
        if key is Ellipsis or key == slice(None):
            return self.reads.read(self.entry)
        return self.fallback[key]

    def __getattr__(self, name: str) -> Any:  # get_shape, get_dtype, ...
        return getattr(self.fallback, name)


@contextlib.contextmanager
def streamed_state_dict(state_dict: dict | None, checkpoint_files: list[str] | None,
                        load_config: Any) -> Iterator[dict | None]:
    """The state dict for transformers' `_load_pretrained_model`: the shards' read slices where this load `streams`,
    else `state_dict` as given (None: transformers maps the files itself)."""
    if not streams(state_dict, checkpoint_files, load_config):
        yield state_dict
        return
    with read_shards(checkpoint_files) as slices:
        yield slices


__all__ = ["STREAMED_DEVICE_TYPES", "read_shards", "streamed_state_dict", "streams"]
