"""Apriel2, Fast-LLM's own Hugging Face export (model_type "apriel2_text", `Apriel2ForCausalLM`):

- `config.py`: config.json -> `HybridLinearConfig` (named blocks -> defaults + `per_layer_config`; which of
  Apriel2's modeling defaults the conversion assumes, and what it refuses);
- `config_writer.py`: `HybridLinearConfig` -> config.json, as Fast-LLM's exporter writes it;
- `parameters.py`: Apriel2's tensor names <-> the canonical layout;
- `checkpoint.py`: the `apriel2` format, read and written.
"""

from .checkpoint import apriel2_rows, read_apriel2, write_apriel2
from .config import apriel2_to_hybrid_config
from .config_writer import hybrid_config_to_apriel2
from .parameters import build_apriel2_rows

__all__ = ["read_apriel2", "write_apriel2", "apriel2_rows", "apriel2_to_hybrid_config", "hybrid_config_to_apriel2",
           "build_apriel2_rows"]
