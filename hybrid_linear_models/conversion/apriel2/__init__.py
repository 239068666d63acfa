"""Apriel2, Fast-LLM's own Hugging Face export (model_type "apriel2_text", `Apriel2ForCausalLM`):

- `config.py`: config.json <-> `HybridLinearConfig` (named blocks -> defaults + `per_layer_config`; which of
  Apriel2's modeling defaults the conversion assumes, and what it refuses);
- `parameters.py`: Apriel2's tensor names <-> the canonical layout;
- `checkpoint.py`: the `apriel2` format, read.
"""

from .checkpoint import read_apriel2
from .config import apriel2_to_hybrid_config
from .parameters import build_apriel2_rows

__all__ = ["read_apriel2", "apriel2_to_hybrid_config", "build_apriel2_rows"]
