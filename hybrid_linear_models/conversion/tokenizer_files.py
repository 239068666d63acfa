"""The tokenizer of a converted Hugging Face folder.

A converted folder should be usable as it stands, `AutoTokenizer.from_pretrained(folder)` included, but the checkpoints
being converted rarely hold a tokenizer (Fast-LLM keeps its tokenizer apart from its checkpoints). So the converter
copies the files of a tokenizer folder, the one written by `tokenizer.save_pretrained(...)`: the folder named by the
caller, else the source checkpoint's folder when it holds one. The files are copied unchanged (transformers reads
them without this package); the one check is that the tokenizer's ids fit the model's embedding, which catches the
tokenizer of another model before it produces out-of-range ids at generation time.

Only regular files inside the tokenizer folder are read and copied, since their bytes go into the output as they are
(a hostile folder's `tokenizer.json` linking to a private key would otherwise be published with the model): a
tokenizer file that is a symbolic link leading out of the folder, or that is not a regular file (a FIFO would block
the copy forever), is refused by name before anything is read. A link within the folder is followed; so is one
within the repository folder of a Hugging Face cache snapshot (`models--X/snapshots/REV/` holds links into
`models--X/blobs/`). The copy is created afresh in the output (never opened through an existing name), so it cannot
write anywhere else.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE, TOKENIZER_FILES

from ..shown_values import clip
from ..tokenizer_loading import ADD_TOKENIZER_HINT, VOCABULARY_FILES
from .errors import ConversionError
from .untrusted import Fields, brief, describe, parse_json, read_text

if TYPE_CHECKING:
    from hybrid_linear_cli.conversion_catalogue import FormatEntry

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot hang the open
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _checkpoint_root(folder: Path) -> Path:
    """What links in `folder` may lead into: the folder, or for a Hugging Face cache snapshot its repository folder."""
    folder = folder.resolve()
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def _file_inside(path: Path) -> os.stat_result | None:
    """The status of the regular file `path` (following links that stay inside its folder), None when absent;
    refuses a link that leads out of the folder (or nowhere) and anything that is not a regular file."""
    try:
        path.lstat()
    except FileNotFoundError:
        return None
    folder, target = _checkpoint_root(path.parent), path.resolve()
    if folder not in target.parents:
        raise ConversionError(f"tokenizer file {clip(path)} is a symbolic link to {clip(target)}, outside "
                              f"{clip(folder)}; only files inside the tokenizer folder are read: copy the file in "
                              "(cp -L) or remove the link.")
    try:
        status = target.stat()
    except OSError as error:
        raise ConversionError(f"cannot read tokenizer file {clip(path)}: {error.strerror}.") from None
    if not stat.S_ISREG(status.st_mode):
        raise ConversionError(f"tokenizer file {clip(path)} is not a regular file; replace it with the file "
                              "tokenizer.save_pretrained(...) wrote, or remove it.")
    return status


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files in `folder` (each checked by `_file_inside`), or [] when it holds no tokenizer."""
    present = [folder / name for name in TOKENIZER_FILES if _file_inside(folder / name) is not None]
    if not any(path.name in VOCABULARY_FILES for path in present):
        return []
    return present


def find_tokenizer(source: Path, tokenizer: Path | None) -> list[Path]:
    """The files to copy: those of the `tokenizer` folder (which must hold one), else the source folder's, if any."""
    if tokenizer is None:
        return tokenizer_files(source) if source.is_dir() else []
    if not tokenizer.is_dir():
        raise ConversionError(f"tokenizer {clip(tokenizer)} is not a folder; pass the folder that "
                              "tokenizer.save_pretrained(...) wrote.")
    files = tokenizer_files(tokenizer)
    if not files:
        raise ConversionError(f"tokenizer folder {clip(tokenizer)} holds no tokenizer (none of "
                              f"{', '.join(VOCABULARY_FILES)}); pass the folder that tokenizer.save_pretrained(...) "
                              "wrote.")
    return files


MAX_TOKENIZER_BYTES = 512 * 2**20  # the largest real tokenizer.json files (250k-token vocabularies) are ~35 MB


def largest_token_id(tokenizer_json: Path) -> int | None:
    """The largest id in a tokenizer.json (its model's vocabulary and its added tokens), None if it has none. The
    file is untrusted input (`untrusted`: bounded size and depth, no NaN or infinity), and every id must be an integer
    >= 0: anything else is one line naming where it is."""
    label = str(tokenizer_json)
    data = Fields(parse_json(read_text(tokenizer_json, "tokenizer.json", MAX_TOKENIZER_BYTES), label), "", label,
                  missing_is_empty=False)
    if not data.has("model"):
        raise data.missing("model", " (the tokenizer's vocabulary); re-save the tokenizer with save_pretrained")
    model = data.mapping("model")
    vocab = model.get("vocab") or {}
    # WordLevel, BPE and WordPiece map token -> id; Unigram lists [token, score] pairs, ids by position
    if isinstance(vocab, dict):
        ids = [_token_id(label, value, "model.vocab", token) for token, value in vocab.items()]
    elif isinstance(vocab, list):
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise model.wrong("vocab", "a mapping of tokens to ids or a list of [token, score] pairs", vocab,
                          "; re-save the tokenizer with save_pretrained")
    for index, token in enumerate(data.sequence("added_tokens", None, item=dict) or []):
        if "id" not in token:
            raise data.missing(f"added_tokens[{index}].id", "; re-save the tokenizer with save_pretrained")
        ids.append(_token_id(label, token["id"], f"added_tokens[{index}].id"))
    return max(ids) if ids else None


def _token_id(label: str, value: object, where: str, token: object = None) -> int:
    """`value`, an id of tokenizer.json at `where` (of `token`, in a vocabulary), if it is an integer >= 0."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    where += "" if token is None else f"[{brief(token)}]"
    raise ConversionError(f"{label}: {where} should be a token id (an integer >= 0), got {describe(value)}; the file "
                          "is corrupt, re-save the tokenizer with save_pretrained.")


def check_fits_vocabulary(files: list[Path], vocab_size: int) -> None:
    """Token ids beyond the embedding would fail at the first generation: refuse such a tokenizer now."""
    for path in files:
        if path.name == "tokenizer.json" and (largest := largest_token_id(path)) is not None and largest >= vocab_size:
            raise ConversionError(f"{clip(path)} has token ids up to {largest}, but the model's vocab_size is "
                                  f"{vocab_size}: it is another model's tokenizer; pass the tokenizer the model was "
                                  "trained with.")


def tokenizer_to_copy(writer: FormatEntry, source: Path, tokenizer: str | Path | None, vocab_size: int) -> list[Path]:
    """The tokenizer files a conversion copies into its output (formats whose layout holds a tokenizer), checked."""
    if writer.output is None or not writer.output.tokenizer:
        if tokenizer is not None:
            holding = [entry.name for entry in FORMAT_CATALOGUE if entry.output is not None and entry.output.tokenizer]
            raise ConversionError(f"a tokenizer is copied into Hugging Face folders only (--to "
                                  f"{' or '.join(holding)}), not --to {writer.name}; leave the tokenizer option out.")
        return []
    files = find_tokenizer(source, None if tokenizer is None else Path(tokenizer))
    check_fits_vocabulary(files, vocab_size)
    return files


def copy_tokenizer(files: list[Path], out_dir: Path) -> None:
    """Copies `files` into `out_dir` under their names, each checked again as it is opened (`_file_inside`)."""
    for path in files:
        expected = _file_inside(path)
        source = os.open(path.resolve(), _READ_FLAGS)
        try:
            status = os.fstat(source)
            if expected is None or (status.st_dev, status.st_ino) != (expected.st_dev, expected.st_ino):
                raise ConversionError(f"tokenizer file {clip(path)} changed while it was copied; copy it again.")
            os.set_blocking(source, True)
            target = os.open(out_dir / path.name, _CREATE_FLAGS, 0o666)
            with open(source, "rb", closefd=False) as reader, open(target, "wb") as writer:
                shutil.copyfileobj(reader, writer)
        finally:
            os.close(source)


__all__ = [
    "ADD_TOKENIZER_HINT",
    "TOKENIZER_FILES",
    "VOCABULARY_FILES",
    "check_fits_vocabulary",
    "copy_tokenizer",
    "find_tokenizer",
    "tokenizer_files",
    "tokenizer_to_copy",
]
