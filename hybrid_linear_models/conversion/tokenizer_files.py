"""The tokenizer of a converted Hugging Face folder.

A converted folder should be usable as it stands, `AutoTokenizer.from_pretrained(folder)` included, but the checkpoints
being converted rarely hold a tokenizer (Fast-LLM keeps its tokenizer apart from its checkpoints). So the converter
copies the files of a tokenizer folder, the one written by `tokenizer.save_pretrained(...)`: the folder named by the
caller, else the source checkpoint's folder when it holds one. The files are copied unchanged (transformers reads
them without this package); the one check is that the tokenizer's ids fit the model's embedding, which catches the
tokenizer of another model before it produces out-of-range ids at generation time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..shown_values import clip
from ..tokenizer_loading import ADD_TOKENIZER_HINT, VOCABULARY_FILES
from .errors import ConversionError

# What `save_pretrained` of a transformers tokenizer writes (slow and fast kinds); copied when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
)


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files in `folder`, or [] when it holds no tokenizer."""
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return []
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


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


def largest_token_id(tokenizer_json: Path) -> int | None:
    """The largest id in a tokenizer.json (its model's vocabulary and its added tokens), None if it has none."""
    try:
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        vocab = data["model"].get("vocab") or {}
        # WordLevel, BPE and WordPiece map token -> id; Unigram lists [token, score] pairs, ids by position
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if vocab else []
        ids += [token["id"] for token in data.get("added_tokens") or []]
        return max(int(i) for i in ids) if ids else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ConversionError(f"{clip(tokenizer_json)} is not a readable tokenizer.json "
                              f"({type(error).__name__}); re-save the tokenizer with save_pretrained.") from None


def check_fits_vocabulary(files: list[Path], vocab_size: int) -> None:
    """Token ids beyond the embedding would fail at the first generation: refuse such a tokenizer now."""
    for path in files:
        if path.name == "tokenizer.json" and (largest := largest_token_id(path)) is not None and largest >= vocab_size:
            raise ConversionError(f"{clip(path)} has token ids up to {largest}, but the model's vocab_size is "
                                  f"{vocab_size}: it is another model's tokenizer; pass the tokenizer the model was "
                                  "trained with.")


HF_FOLDER_FORMATS = ("hf", "qwen3_next")  # the formats whose folders hold a tokenizer beside the model


def tokenizer_to_copy(to_format: str, source: Path, tokenizer: str | Path | None, vocab_size: int) -> list[Path]:
    """The tokenizer files a conversion copies into its output (Hugging Face folders only), checked."""
    if to_format not in HF_FOLDER_FORMATS:
        if tokenizer is not None:
            raise ConversionError(f"a tokenizer is copied into Hugging Face folders only (--to hf or qwen3_next), "
                                  f"not --to {to_format}; leave the tokenizer option out.")
        return []
    files = find_tokenizer(source, None if tokenizer is None else Path(tokenizer))
    check_fits_vocabulary(files, vocab_size)
    return files


def copy_tokenizer(files: list[Path], out_dir: Path) -> None:
    for path in files:
        shutil.copy2(path, out_dir / path.name)


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
