"""Tensors a checkpoint holds beside the model's, kept in our Hugging Face folder without being loaded.

Qwen3-Next checkpoints carry a multi-token-prediction head (`mtp.*`: its own decoder layer, norms and a fusion
projection) that transformers' `Qwen3NextForCausalLM` does not load either (`_keys_to_ignore_on_load_unexpected`) but
serving engines use for speculative decoding. A conversion must not drop it, and `--to qwen3_next` must give it
back. Our folder keeps such tensors in one file of their own, `extra_tensors.safetensors`, which is not listed in
`model.safetensors.index.json`: `from_pretrained` does not read it (no load time, no memory, no warning about
unexpected keys), except into a model built with an MTP head whose tensors it holds exactly
(`from_pretrained(path, num_mtp_layers=1)`: `mtp_head.with_carried_head`), while `--from hf` reads it back and
carries it on. The file's safetensors metadata says where the tensors came from (`carried_from`: the format, e.g.
"qwen3_next") and holds that format's config fields describing them (`carried_fields`: JSON, e.g.
{"mtp_num_hidden_layers": 1}), so the folder's config.json stays our model's.

A model fine-tuned and saved with `save_pretrained` has no such file: the head was not trained with it, so it would
no longer match; convert the original checkpoint again to keep it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..mtp_head import CARRIED_TENSORS_FILE
from .errors import ConversionError
from .pipeline import CarriedTensors, ConversionPlan
from .safetensors_io import FilePlan, SafetensorsFile
from .source_files import is_source_file
from .untrusted import Fields, brief, clip, parse_json

EXTRA_TENSORS_FILE = CARRIED_TENSORS_FILE  # (the model loads a carried MTP head from it: mtp_head)
_ORIGIN_KEY, _FIELDS_KEY = "carried_from", "carried_fields"


def read_extra_tensors(path: Path) -> tuple[SafetensorsFile, CarriedTensors] | None:
    """The folder's extra tensors file and what it carries; None when it has none."""
    file_path = Path(path) / EXTRA_TENSORS_FILE
    if not is_source_file(file_path):  # a FIFO or a folder of that name is refused, not taken for "none"
        return None
    opened = SafetensorsFile(file_path)
    origin = opened.metadata.get(_ORIGIN_KEY)
    if not isinstance(origin, str) or not origin.isidentifier() or len(origin) > 64:
        raise ConversionError(f"{file_path}: its metadata {_ORIGIN_KEY!r} should name the format its tensors come "
                              f"from (like 'qwen3_next'), got {brief(origin)}; the file is corrupt.")
    fields = Fields(parse_json(opened.metadata.get(_FIELDS_KEY, "{}"), f"{file_path} metadata {_FIELDS_KEY!r}"), "",
                    f"{file_path} metadata {_FIELDS_KEY!r}", missing_is_empty=False).data
    keys = tuple(opened.keys())
    if not keys:
        raise ConversionError(f"{file_path} holds no tensors; remove the file.")
    return opened, CarriedTensors(origin, keys, dict(fields))


def extra_tensors_file(plan: ConversionPlan) -> tuple[FilePlan, dict[str, str]] | None:
    """The extra tensors file for a plan's carried tensors (last in the plan) and its metadata; None without any."""
    carried = plan.source.carried
    if carried is None:
        return None
    tensors = tuple((name, info) for name, info in plan.targets if name in set(plan.carried))
    if [name for name, _ in tensors] != list(plan.carried) or plan.targets[-len(tensors):] != list(tensors):
        raise RuntimeError("carried tensors must come last in the plan")
    try:
        fields_text = json.dumps(carried.fields, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"the config fields that describe the carried tensors cannot be written as JSON "
                              f"({clip(str(error), 200)}).") from None
    return FilePlan(EXTRA_TENSORS_FILE, tensors), {_ORIGIN_KEY: carried.origin, _FIELDS_KEY: fields_text}


__all__ = ["EXTRA_TENSORS_FILE", "extra_tensors_file", "read_extra_tensors"]
