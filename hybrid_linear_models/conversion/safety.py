"""Atomic output: everything is written into a temporary folder beside DST, which is renamed to DST only once it is
complete. A failure or Ctrl-C removes the temporary folder and leaves DST as it was (absent, or the old one with
--force)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import ConversionError


def check_paths(src: Path, dst: Path, force: bool) -> None:
    """Refuses an existing DST (without force) and a DST that would overwrite or live inside SRC."""
    src, dst = src.resolve(), dst.resolve()
    if not src.exists():
        raise ConversionError(f"SRC {src} does not exist; give the path of the checkpoint folder to convert.")
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConversionError(f"DST {dst} overlaps SRC {src}; choose an output folder outside the checkpoint.")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConversionError(f"DST {dst} already exists; choose another path or pass --force to replace it.")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_output_dir(dst: Path, force: bool = False) -> Iterator[Path]:
    """Yields an empty temporary folder; on normal exit it becomes `dst` (replacing an old `dst` only with `force`,
    and only now that the new output is complete)."""
    dst = Path(dst).absolute()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConversionError(f"DST {dst} already exists; choose another path or pass --force to replace it.")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; DST should get the usual permissions
    except OSError as error:
        raise ConversionError(f"cannot create the output folder beside {dst}: {error}") from error
    try:
        yield staging
        if dst.exists() or dst.is_symlink():
            if not force:  # appeared while converting
                raise ConversionError(f"DST {dst} appeared while converting; pass --force to replace it.")
            retired = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, retired / "old")
            try:
                os.replace(staging, dst)
            except BaseException:
                os.replace(retired / "old", dst)  # put the old output back
                _remove(retired)
                raise
            _remove(retired)
        else:
            os.replace(staging, dst)
    except BaseException:
        _remove(staging)
        raise


__all__ = ["atomic_output_dir", "check_paths"]
