"""Kimi-Linear checkpoints (transformers' `kimi_linear`, the hub layout): `config` maps its config.json to ours and
back, `parameters` its tensor names (both layouts), `checkpoint` reads and writes the folder."""

from .checkpoint import kimi_linear_rows, read_kimi_linear, write_kimi_linear
from .config import hybrid_config_to_kimi, kimi_to_hybrid_config

__all__ = ["read_kimi_linear", "write_kimi_linear", "kimi_linear_rows", "hybrid_config_to_kimi",
           "kimi_to_hybrid_config"]
