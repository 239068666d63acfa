"""`convert_checkpoint`: the conversion API behind the CLI.

The source is read and the output written while holding DST's lock, into a staging folder that becomes DST only when
complete (`safety`); SIGTERM and SIGHUP clean up like Ctrl-C (`interrupts`). Sizes are decimal (5GB = 5e9 bytes, as
in transformers), in the progress bar as in the summary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybrid_linear_cli.conversion_catalogue import DEFAULT_MAX_SHARD_SIZE, DTYPE_NAMES, SIZE_BASE
from hybrid_linear_cli.conversion_catalogue import parse_size as catalogue_parse_size

from .errors import ConversionError
from .formats import get_format
from .fp8_blocks import dequantized_source, kept_fp8_source
from .interrupts import stop_signals_raise
from .pipeline import ConversionPlan, WriteOptions, check_carried, plan_conversion, stream_tensors
from ..shown_values import brief
from .safety import atomic_output_dir, check_paths, check_source
from .tokenizer_files import copy_tokenizer, tokenizer_to_copy

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def parse_size(text: str | int) -> int:
    """Bytes in "5GB" (decimal, as in transformers), "500MiB" (binary), "1.5G" or a plain integer (read by the
    command line's torch-free catalogue, which checks it before a conversion starts)."""
    try:
        return catalogue_parse_size(text)
    except ValueError as error:
        raise ConversionError(str(error)) from None


@dataclass(frozen=True)
class ConversionResult:
    destination: Path
    tensors: int
    bytes: int
    seconds: float
    skipped: int = 0  # stored tensors deliberately not converted (optimizer state, unused supernet mixers)
    tokenizer_files: tuple[str, ...] = ()  # copied into a Hugging Face output; () when it has no tokenizer


def _with_progress(plan: ConversionPlan, quiet: bool, label: str) -> Iterator[tuple[str, torch.Tensor]]:
    # `delay`: the bar appears only when the conversion takes more than a moment.
    with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, unit_divisor=SIZE_BASE, desc=label, disable=quiet,
              delay=0.5, file=sys.stderr, leave=False) as bar:
        for name, tensor in stream_tensors(plan):
            nbytes = tensor.numel() * tensor.element_size()
            yield name, tensor
            del tensor  # hold no reference while the next tensor is produced
            bar.update(nbytes)


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConversionError(f"unknown dtype {brief(dtype)}; choose one of {', '.join(DTYPES)}.")
        return DTYPES[dtype]
    return dtype


def convert_checkpoint(src: str | Path, dst: str | Path, *, from_format: str, to_format: str,
                       dtype: str | torch.dtype | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                       force: bool = False, quiet: bool = True,
                       tokenizer: str | Path | None = None, dequantize_fp8: bool = False) -> ConversionResult:
    """Converts the checkpoint at `src` (format `from_format`) into a new folder `dst` (format `to_format`).

    Tensors keep their dtype unless `dtype` ("float32", "bfloat16", "float16") is given. `dst` appears only when
    complete. An existing `dst` is refused unless `force`, and then only replaced, at the end, if it is empty or
    holds a `to_format` checkpoint and nothing else. A `dst` that is the working directory, an ancestor of it, the
    home folder or the filesystem root, or overlaps `src`, is always refused. Raises `ConversionError` with a one-line
    explanation for bad inputs. Called in the main thread, SIGTERM and SIGHUP first remove the partial output, then
    end the process as they would have (the previous handlers are restored). A Hugging Face output also gets the
    tokenizer files of the folder `tokenizer` (what `tokenizer.save_pretrained` wrote), else those found beside the
    source. A source of block-scaled FP8 weights (`fp8_blocks`) keeps them, with their scales and quantization_config,
    byte for byte (`dtype` casts only the other tensors), to a format that holds them (hf, qwen3_next); with
    `dequantize_fp8` they convert to floating-point weights instead (`dtype`'s, bfloat16 by default).
    """
    started = time.perf_counter()
    torch_dtype = _torch_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    reader, writer = get_format(from_format, "read"), get_format(to_format, "write")
    output = check_paths(src, dst)
    # the lock is taken, a killed run's commit finished or undone and an existing DST checked before SRC is read
    with stop_signals_raise(redeliver=True), atomic_output_dir(output, writer if force else None) as staging:
        check_source(src)
        source = reader.read(Path(src))
        if source.quantization == "fp8" and dequantize_fp8:
            source = dequantized_source(source, torch_dtype)
        if source.quantization == "fp8":
            source = kept_fp8_source(source, to_format, writer.target_rows)
        check_carried(source, to_format, writer.keeps_extra_tensors)
        plan = plan_conversion(source, writer.target_rows(source.config), torch_dtype)
        tokenizer_copied = tokenizer_to_copy(writer, Path(src), tokenizer, source.config.vocab_size)
        options = WriteOptions(max_shard_bytes, output_name=output.name, source_description=reader.description)
        writer.write(staging, plan, _with_progress(plan, quiet, f"{from_format} -> {to_format}"), options)
        copy_tokenizer(tokenizer_copied, staging)
    return ConversionResult(Path(dst), len(plan.targets), plan.total_bytes, time.perf_counter() - started,
                            len(source.skipped), tuple(path.name for path in tokenizer_copied))


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPES", "ConversionResult", "convert_checkpoint", "parse_size"]
