"""fla's Hugging Face checkpoints (`save_pretrained` of GatedDeltaNetForCausalLM / KDAForCausalLM): config.json with
model_type "gated_deltanet" or "kda", and `model.safetensors` or shards with `model.safetensors.index.json`."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConversionError
from ..hf import _open_weights
from ..pipeline import SourceCheckpoint, TensorCensus, check_tensor_sizes
from ..safetensors_io import SafetensorsTensors
from ..untrusted import Fields, parse_json, read_text
from .config import fla_to_hybrid_config, model_type_of
from .parameters import build_fla_rows

CONFIG_FILE = "config.json"


def read_fla(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; an fla checkpoint is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not an fla checkpoint: it has no {CONFIG_FILE}.{hint}")
    label = str(config_path)
    data = parse_json(read_text(config_path, "JSON"), label)
    model_type_of(Fields(data, "", label, missing_is_empty=False))  # an fla model at all? before the weights
    files, _ = _open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), "model.layers.")
    config = fla_to_hybrid_config(data, label, census)
    check_tensor_sizes(config, census, label)
    return SourceCheckpoint("fla", path, config, SafetensorsTensors(files), build_fla_rows(config))


__all__ = ["read_fla", "CONFIG_FILE"]
