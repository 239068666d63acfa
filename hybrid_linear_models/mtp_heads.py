"""The kinds of multi-token-prediction head (`config.mtp_type`): for each, the module the model builds as `mtp` and
the drafters `generate(..., use_mtp=k)` takes (transformers' assisted loop for one row, the batched loop otherwise).
A new kind is its modules plus one entry here (and its name in configuration_hybrid_linear.MTP_TYPES, which the
config checks without importing the modules)."""

from __future__ import annotations

from dataclasses import dataclass

from .mtp_drafting import MtpBatchDrafter, MtpCandidateGenerator
from .mtp_head import HybridLinearMtpHead
from .mtp_parallel_drafting import (
    ParallelMtpBatchDrafter,
    ParallelMtpCandidateGenerator,
)
from .mtp_parallel_heads import HybridLinearParallelMtpHeads


@dataclass(frozen=True)
class MtpKind:
    head: type  # built as head(config, decoder_layer, rotary)
    candidate_generator: type  # transformers' CandidateGenerator: (model, generation_config, logits_processor)
    batch_drafter: type  # speculative_decoding's drafter: (model)


MTP_HEADS = {
    "qwen3_next": MtpKind(HybridLinearMtpHead, MtpCandidateGenerator, MtpBatchDrafter),
    "fast_llm": MtpKind(HybridLinearParallelMtpHeads, ParallelMtpCandidateGenerator, ParallelMtpBatchDrafter),
}

__all__ = ["MTP_HEADS", "MtpKind"]
