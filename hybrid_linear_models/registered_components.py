"""Every mixer and MLP of the family, registered: each component module calls its registry's `register(...)` when
imported, and this module imports them all, so whoever imports it (the configuration, first of all) sees complete
registries. A new mixer or MLP is one module plus one line here.

The registries themselves (`mixer_registry`, `mlp_registry`) import none of their components, which import them for
`register` and their spec types: the imports run one way. The lines are `from .module import name`, the form
transformers follows when it copies a saved folder's remote code (it does not follow `from . import module`).
"""

from .mixer_attention import HybridLinearAttention
from .mixer_gated_deltanet import HybridLinearGatedDeltaNet
from .mixer_kimi_delta import HybridLinearKimiDeltaAttention
from .mixer_mla import HybridLinearMultiHeadLatentAttention
from .mlp_dense import HybridLinearMLP
from .mlp_sparse_moe import HybridLinearSparseMoeBlock
from .mlp_kimi_moe import HybridLinearKimiMoeBlock  # noqa: I001  (registration order: the MoE it builds on first)

__all__ = [
    "HybridLinearAttention",
    "HybridLinearGatedDeltaNet",
    "HybridLinearKimiDeltaAttention",
    "HybridLinearKimiMoeBlock",
    "HybridLinearMLP",
    "HybridLinearMultiHeadLatentAttention",
    "HybridLinearSparseMoeBlock",
]
