"""The checks of a conversion that need no torch, run by `hybrid-linear-convert` before it imports the converters.

Importing torch and transformers takes seconds; a conversion refused for a mistyped path, a folder of another format
or an output that exists already answers at once instead. Each check here refuses only what the full conversion
refuses too (and in the same terms); whatever it cannot decide for certain (an unreadable or very large config.json,
a path that is not a plain folder) it leaves to the full conversion, which reads it under its own bounds.

A killed conversion leaves its staging folders and lock beside DST (`.B.partial-*`, `.B.ready-*`, `.B.old-*`,
`.B.lock`, see `hybrid_linear_models.conversion.safety`), and the next run restores or finishes that output before it
reads SRC: while such names are beside DST, only the arguments are checked here.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE, FormatEntry, parse_size

_LEFTOVER = re.compile(r"\..+\.(lock|(partial|ready|old)-[^/]+)")  # what a conversion keeps beside DST while it runs
_CONFIG_READ_LIMIT = 1 << 20  # a config.json larger than this is left to the full reader's bounded parse


class PreflightError(ValueError):
    """A conversion refused before any converter is imported; the message is one line."""


def _entry(name: str) -> FormatEntry:
    return next(entry for entry in FORMAT_CATALOGUE if entry.name == name)


def _shown(path: str | Path, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def _small_json(path: Path) -> object | None:
    """`path` parsed, or None where the full reader must decide (not a regular file, too large, not JSON)."""
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode) or status.st_size > _CONFIG_READ_LIMIT:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def _readers_of(model_type: object) -> list[str]:
    return [entry.name for entry in FORMAT_CATALOGUE if entry.can_read and model_type in entry.model_types]


def check_source(reader: FormatEntry, src: Path) -> None:
    """SRC exists, is a folder, holds the reader's marker file, and (a JSON config) declares the reader's model_type."""
    if not src.exists():
        raise PreflightError(f"SRC {_shown(src)} does not exist; give the path of the checkpoint folder to convert.")
    if not src.is_dir():
        raise PreflightError(f"SRC {_shown(src)} is not a folder; give the path of the checkpoint folder to convert.")
    marker = src / reader.source_marker
    if not marker.exists() and not marker.is_symlink():
        others = [entry.name for entry in FORMAT_CATALOGUE
                  if entry.can_read and entry.source_marker != reader.source_marker
                  and (src / entry.source_marker).is_file()]
        hint = f" It holds {_entry(others[0]).source_marker}: try --from {others[0]}." if others else ""
        raise PreflightError(f"SRC {_shown(src)} is not a {reader.name} checkpoint: it has no "
                             f"{reader.source_marker}.{hint}")
    if not reader.model_types or marker.suffix != ".json":
        return
    config = _small_json(marker)
    if not isinstance(config, dict) or "model_type" not in config:
        return  # the full reader says what is wrong with it
    model_type = config["model_type"]
    if model_type not in reader.model_types:
        readers = _readers_of(model_type)
        hint = f" (use --from {readers[0]})" if readers else ""
        shown = model_type if isinstance(model_type, str) and len(model_type) <= 60 else "(not a format name)"
        raise PreflightError(f"{_shown(marker)} has model_type {shown!r}; --from {reader.name} reads "
                             f"{' or '.join(repr(name) for name in reader.model_types)} models.{hint}")


def check_destination(dst: Path, src: Path, force: bool) -> None:
    """DST is not SRC nor inside it (or around it), and exists only with --force."""
    src_resolved, dst_resolved = src.resolve(), dst.resolve()
    if dst_resolved == src_resolved or src_resolved in dst_resolved.parents or dst_resolved in src_resolved.parents:
        raise PreflightError(f"DST {_shown(dst_resolved)} overlaps SRC {_shown(src_resolved)}; choose an output "
                             "folder outside the checkpoint.")
    if not force and (dst.exists() or dst.is_symlink()):
        raise PreflightError(f"DST {_shown(dst)} exists; choose a new folder, or pass --force to replace a previous "
                             "output of this converter.")


def _conversion_left_state(dst: Path) -> bool:
    """Whether a conversion's staging folders or lock are beside DST (a run in progress, or one that was killed)."""
    try:
        return any(_LEFTOVER.fullmatch(name) for name in os.listdir(dst.parent))
    except OSError:
        return True  # cannot tell: the full conversion decides


def preflight(from_format: str, to_format: str, src: str | Path, dst: str | Path, *, force: bool = False,
              max_shard_size: str | int | None = None, tokenizer: str | Path | None = None) -> None:
    """Raises `PreflightError` (one line) for a conversion the converters would refuse, without importing them."""
    reader, writer = _entry(from_format), _entry(to_format)
    if max_shard_size is not None:
        try:
            parse_size(max_shard_size)
        except ValueError as error:
            raise PreflightError(str(error)) from None
    if tokenizer is not None:
        if writer.output is None or not writer.output.tokenizer:
            holding = [entry.name for entry in FORMAT_CATALOGUE if entry.output is not None and entry.output.tokenizer]
            raise PreflightError(f"a tokenizer is copied into Hugging Face folders only (--to {' or '.join(holding)}), "
                                 f"not --to {writer.name}; leave the tokenizer option out.")
        if not Path(tokenizer).is_dir():
            raise PreflightError(f"tokenizer {_shown(tokenizer)} is not a folder; pass the folder that "
                                 "tokenizer.save_pretrained(...) wrote.")
    if not str(dst).strip():
        raise PreflightError("DST is an empty string (an unset shell variable?); give the path of a new folder for "
                             "the output.")
    dst_path = Path(os.path.abspath(dst))
    if _conversion_left_state(dst_path):
        return
    check_source(reader, Path(src))
    check_destination(dst_path, Path(src), force)


__all__ = ["PreflightError", "check_destination", "check_source", "preflight"]
