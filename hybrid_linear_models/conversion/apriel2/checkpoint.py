"""The `apriel2` format, read: a Hugging Face folder written by Fast-LLM's Apriel2 exporter (`config.json` with
model_type "apriel2_text", `model.safetensors` or shards with `model.safetensors.index.json`). Its modeling sources
(`modeling_apriel2.py`, which needs CUDA kernels) are not read or needed: the converted folder runs everywhere."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConversionError
from ..hf import _open_weights
from ..pipeline import SourceCheckpoint, TensorCensus, check_tensor_sizes
from ..safetensors_io import SafetensorsTensors
from ..untrusted import parse_json, read_text
from .config import BLOCK_PREFIX, CONFIG_FILE, apriel2_to_hybrid_config, check_model_type
from .parameters import build_apriel2_rows, unused_mixer_prefixes

FORMAT_NAME = "apriel2"


def read_apriel2(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; an Apriel2 checkpoint is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not an Apriel2 checkpoint: it has no {CONFIG_FILE}.{hint}")
    data = parse_json(read_text(config_path, "JSON"), str(config_path))
    check_model_type(data, str(config_path))  # the right format at all? before the weights
    files, _ = _open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), BLOCK_PREFIX)
    model = apriel2_to_hybrid_config(data, census)
    check_tensor_sizes(model.config, census, str(config_path))
    unused = unused_mixer_prefixes(model.stochastic)
    skipped = sorted(key for key in files if key.startswith(unused)) if unused else []
    for key in skipped:  # supernet mixers not used at inference: deliberately not converted
        del files[key]
    return SourceCheckpoint(FORMAT_NAME, path, model.config, SafetensorsTensors(files),
                            build_apriel2_rows(model.config, model.stochastic), skipped)


__all__ = ["read_apriel2", "FORMAT_NAME"]
