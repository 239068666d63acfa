"""Everything this project knows about Fast-LLM, in one place:

- `mixers.py`: one record per Fast-LLM mixer type (`mixer_attention.py`, `mixer_gdn.py`, `mixer_kda.py`): its layer
  types, config reader and writer, parameter table; the rest reads this table; `mlps.py` the same for the block's
  MLP (`mlp_dense.py`; `mlp_moe.py`: Fast-LLM's MoE against our sparse MoE, its layout and what is refused);
- `parameters.py`: Fast-LLM's parameters of the other modules (embeddings, block norms, head; `Parameter` in
  `parameter_spec.py`), written once, serving the name map of both readers and the writer and the `distributed`
  buffer order;
- `config.py`: Fast-LLM's model config (metadata.yaml `config.base_model`) <-> `HybridLinearConfig`, through
  `metadata_fields.py` (typed reads bounded by the stored weights; the sub-configs several mixers share);
- `checkpoint.py`: the `fast_llm` format (metadata.yaml + `model_{n}.safetensors`), read and write;
- `distributed.py`: the `distributed` format (one flat buffer per rank), read only.
"""

from .checkpoint import (
    METADATA_FILE,
    check_metadata_reads_back,
    fast_llm_rows,
    load_metadata,
    metadata_yaml,
    read_fast_llm,
    write_fast_llm,
)
from .config import fast_llm_to_hybrid_config, hybrid_config_to_fast_llm
from .distributed import read_fast_llm_distributed, stage_layout
from .parameters import build_fast_llm_rows

__all__ = ["read_fast_llm", "write_fast_llm", "fast_llm_rows", "load_metadata", "check_metadata_reads_back",
           "metadata_yaml", "METADATA_FILE", "fast_llm_to_hybrid_config", "hybrid_config_to_fast_llm",
           "read_fast_llm_distributed", "stage_layout", "build_fast_llm_rows"]
