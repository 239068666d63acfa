"""Checkpoint converters between Fast-LLM and this project's Hugging Face format.

    from hybrid_linear_models.conversion import convert_checkpoint
    convert_checkpoint("ckpt/fast_llm", "export/hf", from_format="fast_llm", to_format="hf")

or on the command line: `hybrid-linear-convert --from fast_llm --to hf SRC DST`.
"""

from .api import ConversionResult, convert_checkpoint, parse_size
from .errors import ConversionError
from .formats import FORMATS, CheckpointFormat, register

__all__ = ["FORMATS", "CheckpointFormat", "ConversionError", "ConversionResult", "convert_checkpoint", "parse_size",
           "register"]
