"""What `AutoTokenizer.from_pretrained(folder)` does for this model family when the folder's tokenizer_config.json
names no tokenizer class (or the folder has no tokenizer at all), with the package imported.

transformers would fall back to its generic fast tokenizer, and for a folder without tokenizer files (a converted
checkpoint: training checkpoints seldom hold one) it fails with "Couldn't instantiate the backend tokenizer ...
install sentencepiece or tiktoken", which sends the reader the wrong way. This loader says what is missing and how to
add it, and otherwise returns transformers' own generic tokenizer, so nothing of this package is saved with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TokenizersBackend

from .shown_values import clip

# A folder holds a tokenizer when it has one of these (tokenizer_config.json alone names a class but no vocabulary).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
ADD_TOKENIZER_HINT = ("save the tokenizer the model was trained with into it (tokenizer.save_pretrained(FOLDER)), or "
                      "convert again with --tokenizer TOKENIZER_DIR")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    return any((Path(folder) / name).is_file() for name in VOCABULARY_FILES)


class HybridLinearTokenizer(TokenizersBackend):
    """Registered with AutoTokenizer for HybridLinearConfig; only its `from_pretrained` is ever used."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> TokenizersBackend:
        folder = Path(pretrained_model_name_or_path)
        if folder.is_dir() and not has_tokenizer(folder):
            raise OSError(f"{clip(folder)} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}): {ADD_TOKENIZER_HINT}.")
        return TokenizersBackend.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


__all__ = ["ADD_TOKENIZER_HINT", "VOCABULARY_FILES", "HybridLinearTokenizer", "has_tokenizer"]
