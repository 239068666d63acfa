"""What the checkpoint converter offers, as plain data: its formats, dtypes and size units.

This is where a checkpoint format is registered, once: its name and one-line description (for `--help`), the
functions that read and write it (named as "module:function" under `hybrid_linear_models.conversion`, imported only
when a conversion starts), and the files its writer creates (which `--force` relies on to recognise a folder it may
replace). Standard library only: `hybrid-linear-convert --help` and argument errors answer from this module without
importing torch and transformers (seconds), and `hybrid_linear_models.conversion.formats` builds its registry from
the same entries, so the command line and the registry cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes by name; the API maps them to torch.dtype
DEFAULT_MAX_SHARD_SIZE = "5GB"
SIZE_BASE = 1000  # decimal units everywhere (progress bar, summary, --max-shard-size "5GB"), as in transformers


# What `save_pretrained` of a transformers tokenizer writes (slow and fast kinds): the files the converter copies into
# a folder whose layout holds a tokenizer, when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
)


@dataclass(frozen=True)
class OutputLayout:
    """The folder a format's writer creates, file by file: `--force` replaces a folder only when it holds the marker
    and no name outside these, so a file the converter does not write is never removed.

    `marker`: the file that identifies the folder; `marker_fields`: keys it (JSON) must hold with these values, empty
    to require only the file. `files`: every fixed name the writer may write (some only for some checkpoints, like
    the index of a sharded one). `shards`: a regular expression matching the whole name of each numbered weight
    file. `tokenizer`: the converter copies a tokenizer (`TOKENIZER_FILES`) into the folder. `remote_code`: the
    writer ships the package's modeling sources for `trust_remote_code`; their names follow from the package's files,
    so the registry (`hybrid_linear_models.conversion.formats`) adds them to `files`.
    """

    marker: str
    files: tuple[str, ...]
    shards: str | None = None
    marker_fields: dict[str, str] = field(default_factory=dict)
    tokenizer: bool = False
    remote_code: bool = False

    def writes(self, name: str) -> bool:
        """Whether the converter may create a file called `name` in this folder."""
        return (name in self.files or (self.tokenizer and name in TOKENIZER_FILES)
                or (self.shards is not None and re.fullmatch(self.shards, name) is not None))


@dataclass(frozen=True)
class FormatEntry:
    """One checkpoint format. `read`, `target_rows` and `write` name functions as "module:function" in
    `hybrid_linear_models.conversion` (see `formats.py` for their signatures); a format needs `read` to be read, and
    `target_rows`, `write` and `output` to be written. `keeps_extra_tensors`: its writer keeps the tensors a reader
    carries beside the model's (Qwen3-Next's multi-token prediction head); other formats refuse such a source.
    `model_types`: the config.json `model_type` values of the folders it reads (so that another reader, handed such
    a folder, can name the right `--from`). `source_marker`: the file every folder it reads holds (which the command
    line checks before it imports the converters)."""

    name: str
    description: str
    read: str | None = None
    target_rows: str | None = None
    write: str | None = None
    output: OutputLayout | None = None
    keeps_extra_tensors: bool = False
    model_types: tuple[str, ...] = ()
    source_marker: str = "config.json"

    @property
    def can_read(self) -> bool:
        return self.read is not None

    @property
    def can_write(self) -> bool:
        return self.write is not None and self.target_rows is not None and self.output is not None

    @property
    def roles(self) -> str:
        """"read", "write" or "read/write", as --help shows them."""
        return "/".join(role for role, able in (("read", self.can_read), ("write", self.can_write)) if able)


_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards and their index
_HF_SHARDS = r"model-\d{5}-of-\d{5}\.safetensors"  # save_pretrained's shard names

FORMAT_CATALOGUE: tuple[FormatEntry, ...] = (
    FormatEntry(
        "hf", "this project's Hugging Face folder (config.json with auto_map, safetensors shards, remote code)",
        model_types=("hybrid_linear",),
        read="hf:read_hf", target_rows="name_maps:build_hf_rows", write="hf:write_hf",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "hybrid_linear"},
            files=("config.json", "generation_config.json", "README.md", *_HF_WEIGHTS,
                   "extra_tensors.safetensors"),  # carried tensors the model does not load (mtp.* without MTP layers)
            shards=_HF_SHARDS, tokenizer=True, remote_code=True,
        ),
        keeps_extra_tensors=True,
    ),
    FormatEntry(
        "fast_llm",
        "Fast-LLM's export format: metadata.yaml + model_{n}.safetensors with '{parameter}/weights' tensors",
        read="fast_llm.checkpoint:read_fast_llm", target_rows="fast_llm.checkpoint:fast_llm_rows",
        write="fast_llm.checkpoint:write_fast_llm", source_marker="metadata.yaml",
        output=OutputLayout(marker="metadata.yaml", files=("metadata.yaml",), shards=r"model_\d+\.safetensors"),
    ),
    FormatEntry(
        "fla",
        "fla's Hugging Face models: config.json with model_type gated_deltanet (attn layers too) or kda, safetensors",
        model_types=("gated_deltanet", "kda"),
        read="fla.checkpoint:read_fla", target_rows="fla.checkpoint:fla_rows", write="fla.checkpoint:write_fla",
        output=OutputLayout(marker="config.json", files=("config.json", *_HF_WEIGHTS), shards=_HF_SHARDS,
                            tokenizer=True),
    ),
    FormatEntry(
        "fast_llm_distributed",
        "Fast-LLM's training-state format, single rank: metadata.yaml + rank_0.safetensors",
        read="fast_llm.distributed:read_fast_llm_distributed", source_marker="metadata.yaml",
    ),
    FormatEntry(
        "apriel2",
        "Fast-LLM's Hugging Face export (model_type apriel2_text): config.json + safetensors",
        model_types=("apriel2_text",),
        read="apriel2.checkpoint:read_apriel2", target_rows="apriel2.checkpoint:apriel2_rows",
        write="apriel2.checkpoint:write_apriel2",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "apriel2_text"},
            files=("config.json", *_HF_WEIGHTS), shards=_HF_SHARDS, tokenizer=True,
        ),
    ),
    FormatEntry(
        "qwen3_next",
        "transformers' Qwen3-Next folder (Qwen3NextForCausalLM; hub layout, per-expert MoE tensors, the mtp.* head)",
        model_types=("qwen3_next",),
        read="qwen3_next.checkpoint:read_qwen3_next", target_rows="qwen3_next.checkpoint:qwen3_next_rows",
        write="qwen3_next.checkpoint:write_qwen3_next",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "qwen3_next"},
            files=("config.json", "generation_config.json", *_HF_WEIGHTS), shards=_HF_SHARDS, tokenizer=True,
        ),
        keeps_extra_tensors=True,
    ),
    FormatEntry(
        "kimi_linear",
        "Kimi-Linear's folder (KimiLinearForCausalLM, hub layout), read as transformers runs it: MLA without RoPE, "
        "absent config fields at KimiLinearConfig's defaults",
        model_types=("kimi_linear",),
        read="kimi_linear.checkpoint:read_kimi_linear", target_rows="kimi_linear.checkpoint:kimi_linear_rows",
        write="kimi_linear.checkpoint:write_kimi_linear",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "kimi_linear"},
            files=("config.json", "generation_config.json", *_HF_WEIGHTS), shards=_HF_SHARDS, tokenizer=True,
        ),
    ),
)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _shown(value: object, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_size(text: str | int) -> int:
    """Bytes in "5GB" (decimal, as in transformers), "500MiB" (binary), "1.5G" or a plain integer; ValueError (one
    line saying how to write it) for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"cannot read size {_shown(text)}; write it like 5GB, 500MB or 2GiB.")
        unit = (match.group(2) or "").upper().removesuffix("B")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {_shown(text)} must be positive.")
    return size


def format_size(nbytes: int) -> str:
    """`nbytes` in a human decimal unit: "812 B", "45.3 kB", "1.2 MB", "14.90 GB"."""
    size = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < SIZE_BASE:
            break
        size /= SIZE_BASE
    else:
        unit = "TB"
    if unit == "B":
        return f"{int(size)} B"
    return f"{size:.2f} {unit}" if unit in ("GB", "TB") else f"{size:.1f} {unit}"


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "DTYPE_NAMES",
    "FORMAT_CATALOGUE",
    "SIZE_BASE",
    "TOKENIZER_FILES",
    "FormatEntry",
    "OutputLayout",
    "format_size",
    "parse_size",
]
