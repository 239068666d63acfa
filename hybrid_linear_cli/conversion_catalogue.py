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


@dataclass(frozen=True)
class OutputLayout:
    """The folder a format's writer creates: a marker file that identifies it and every file name it may contain.

    `marker_fields`: keys the marker file (JSON) must hold with these values; empty to require only the file.
    `files`: regular expressions, each matching a whole file name.
    """

    marker: str
    files: tuple[str, ...]
    marker_fields: dict[str, str] = field(default_factory=dict)

    def writes(self, name: str) -> bool:
        """Whether the writer may create a file called `name`."""
        return any(re.fullmatch(pattern, name) for pattern in self.files)


@dataclass(frozen=True)
class FormatEntry:
    """One checkpoint format. `read`, `target_rows` and `write` name functions as "module:function" in
    `hybrid_linear_models.conversion` (see `formats.py` for their signatures); a format needs `read` to be read, and
    `target_rows`, `write` and `output` to be written. `keeps_extra_tensors`: its writer keeps the tensors a reader
    carries beside the model's (Qwen3-Next's multi-token prediction head); other formats refuse such a source.
    `model_types`: the config.json `model_type` values of the folders it reads (so that another reader, handed such
    a folder, can name the right `--from`)."""

    name: str
    description: str
    read: str | None = None
    target_rows: str | None = None
    write: str | None = None
    output: OutputLayout | None = None
    keeps_extra_tensors: bool = False
    model_types: tuple[str, ...] = ()

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


_TOKENIZER_FILES = (  # the usual tokenizer files, which an HF export may carry beside the model
    r"tokenizer\.json", r"tokenizer_config\.json", r"special_tokens_map\.json", r"tokenizer\.model", r"vocab\.json",
    r"merges\.txt", r"added_tokens\.json", r"chat_template\.jinja",
)

FORMAT_CATALOGUE: tuple[FormatEntry, ...] = (
    FormatEntry(
        "hf", "this project's Hugging Face folder (config.json with auto_map, safetensors shards, remote code)",
        read="hf:read_hf", target_rows="name_maps:build_hf_rows", write="hf:write_hf",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "hybrid_linear"},
            files=(r"config\.json", r"generation_config\.json", r"README\.md", r"model\.safetensors",
                   r"model-\d{5}-of-\d{5}\.safetensors", r"model\.safetensors\.index\.json",
                   r"[a-z_][a-z0-9_]*\.py",  # the modeling sources shipped as remote code
                   r"extra_tensors\.safetensors",  # carried tensors the model does not load (Qwen3-Next's mtp.*)
                   *_TOKENIZER_FILES),
        ),
        keeps_extra_tensors=True,
    ),
    FormatEntry(
        "fast_llm",
        "Fast-LLM's export format: metadata.yaml + model_{n}.safetensors with '{parameter}/weights' tensors",
        read="fast_llm.checkpoint:read_fast_llm", target_rows="fast_llm.checkpoint:fast_llm_rows",
        write="fast_llm.checkpoint:write_fast_llm",
        output=OutputLayout(marker="metadata.yaml", files=(r"metadata\.yaml", r"model_\d+\.safetensors")),
    ),
    FormatEntry(
        "fla",
        "fla's Hugging Face models: config.json with model_type gated_deltanet (attn layers too) or kda, safetensors",
        model_types=("gated_deltanet", "kda"),
        read="fla.checkpoint:read_fla", target_rows="fla.checkpoint:fla_rows", write="fla.checkpoint:write_fla",
        output=OutputLayout(marker="config.json", files=(r"config\.json", r"model\.safetensors",
                                                         r"model-\d{5}-of-\d{5}\.safetensors",
                                                         r"model\.safetensors\.index\.json")),
    ),
    FormatEntry(
        "fast_llm_distributed",
        "Fast-LLM's training-state format, single rank: metadata.yaml + rank_0.safetensors",
        read="fast_llm.distributed:read_fast_llm_distributed",
    ),
    FormatEntry(
        "apriel2",
        "Fast-LLM's Hugging Face export (model_type apriel2_text): config.json + safetensors",
        model_types=("apriel2_text",),
        read="apriel2.checkpoint:read_apriel2", target_rows="apriel2.checkpoint:apriel2_rows",
        write="apriel2.checkpoint:write_apriel2",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "apriel2_text"},
            files=(r"config\.json", r"model\.safetensors", r"model-\d{5}-of-\d{5}\.safetensors",
                   r"model\.safetensors\.index\.json"),
        ),
    ),
    FormatEntry(
        "qwen3_next",
        "transformers' Qwen3-Next folder (Qwen3NextForCausalLM; hub layout, per-expert MoE tensors, mtp.* kept)",
        model_types=("qwen3_next",),
        read="qwen3_next.checkpoint:read_qwen3_next", target_rows="qwen3_next.checkpoint:qwen3_next_rows",
        write="qwen3_next.checkpoint:write_qwen3_next",
        output=OutputLayout(
            marker="config.json", marker_fields={"model_type": "qwen3_next"},
            files=(r"config\.json", r"generation_config\.json", r"model\.safetensors",
                   r"model-\d{5}-of-\d{5}\.safetensors", r"model\.safetensors\.index\.json", *_TOKENIZER_FILES),
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
            files=(r"config\.json", r"generation_config\.json", r"model\.safetensors",
                   r"model-\d{5}-of-\d{5}\.safetensors", r"model\.safetensors\.index\.json", *_TOKENIZER_FILES),
        ),
    ),
)


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
    "FormatEntry",
    "OutputLayout",
    "format_size",
]
