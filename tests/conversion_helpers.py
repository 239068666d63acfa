"""What the converter tests share: the Fast-LLM fixtures and their logits tolerance, reading a folder as the converter
does (the reader, then the conversion plan, which checks names, dtypes and shapes), the one-line refusal a bad folder
must give, and a folder whose files are written back before each fuzzing example changes one."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_linear_models.conversion import ConversionError
from hybrid_linear_models.conversion.formats import get_format
from hybrid_linear_models.conversion.pipeline import plan_conversion

FAST_LLM_FIXTURES = Path(__file__).parent / "fixtures" / "fast_llm"
FIXTURE_NAMES = ["hybrid_attn_gdn_kda", "kda_attn"]
# Fast-LLM's reference logits come from its torch.compile'd CPU path; its own eager run differs from them by up to
# 4.3e-6 (fixtures README), and our kernels sum in another order: 1e-4 absolute on logits of std 1 leaves room for
# that while any mapping mistake (a swapped norm, a wrong GDN row order) moves logits by O(0.1-1).
FIXTURE_LOGITS_TOLERANCE = 1e-4


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder`."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrites the folder's config.json after `edit` changed it in place."""
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Reading:
    """Reading a folder as `--from from_format` does, then planning the conversion to `to_format`."""

    from_format: str
    to_format: str = "hf"

    def read_and_plan(self, folder: Path, to_format: str | None = None) -> None:
        source = get_format(self.from_format, "read").read(folder)
        plan_conversion(source, get_format(to_format or self.to_format, "write").target_rows(source.config))

    def refused(self, folder: Path, *fragments: str) -> str:
        """The refusal's message: one non-empty line holding every fragment."""
        with pytest.raises(ConversionError) as caught:
            self.read_and_plan(folder)
        message = str(caught.value)
        assert message and "\n" not in message, message
        for fragment in fragments:
            assert fragment in message, message
        return message

    def outcome(self, folder: Path, messages: list[str] | None = None) -> str:
        """"read", or "refused" with one ConversionError line (kept in `messages`); any other exception escapes."""
        try:
            self.read_and_plan(folder)
        except ConversionError as error:
            message = str(error)
            assert message and "\n" not in message, message  # one line
            if messages is not None:
                messages.append(message)
            return "refused"
        return "read"


class FuzzFolder:
    """A checkpoint folder whose files are written back from their originals before each example changes one."""

    def __init__(self, path: Path):
        self.path = path
        self.originals = {file.name: file.read_bytes() for file in path.iterdir() if file.is_file()}

    def original(self, name: str) -> bytes:
        return self.originals[name]

    def with_file(self, name: str, content: str | bytes) -> Path:
        for other, data in self.originals.items():
            if other != name:
                (self.path / other).write_bytes(data)
        (self.path / name).write_bytes(content.encode() if isinstance(content, str) else content)
        return self.path


def edit_tensors(folder: Path, edit: Callable[[dict], None], file: str = "model.safetensors") -> None:
    """Rewrites the safetensors `file` of an HF-style folder after `edit(tensors)` (tensors by name, changed in
    place): a missing, extra, reshaped or retyped tensor for the hardening tests."""
    tensors = load_file(folder / file)
    edit(tensors)
    save_file(tensors, folder / file, metadata={"format": "pt"})
