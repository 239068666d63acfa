"""Qwen3-Next checkpoints (transformers' `qwen3_next`, the hub layout): `config` maps its config.json to ours and
back, `checkpoint` reads and writes the folder (identity names, per-expert MoE tensors stacked, mtp.* carried)."""

from .checkpoint import read_qwen3_next, write_qwen3_next, qwen3_next_rows
from .config import hybrid_config_to_qwen3_next, qwen3_next_to_hybrid_config

__all__ = ["read_qwen3_next", "write_qwen3_next", "qwen3_next_rows", "hybrid_config_to_qwen3_next",
           "qwen3_next_to_hybrid_config"]
