"""fla's (flash-linear-attention) Hugging Face models, `gated_deltanet` (with its `attn` softmax layers) and `kda`:

- `config.py`: fla's config.json <-> `HybridLinearConfig` (what each field means, what is refused);
- `parameters.py`: fla's parameter names <-> the canonical ones (the GDN projections and convolutions stacked and
  grouped by key head);
- `checkpoint.py`: the `fla` format (config.json + safetensors), read.
"""

from .checkpoint import read_fla
from .config import MODEL_TYPES, fla_to_hybrid_config
from .parameters import build_fla_rows

__all__ = ["read_fla", "fla_to_hybrid_config", "build_fla_rows", "MODEL_TYPES"]
