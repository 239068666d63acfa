"""The load-balancing auxiliary loss of the sparse MoE layers (Switch Transformer eqs. 4-6, as Qwen3-Next's
`load_balancing_loss_func` computes it), from the router logits the model records (`output_router_logits`).

Over the L MoE layers with E experts and top-k routing, and the N counted tokens of each (padding excluded when an
attention mask is given):

    f_e = (1 / (L N)) * sum_layers sum_tokens [e in top-k(softmax(logits))]    the share of assignments to e (sums to k)
    P_e = (1 / (L N)) * sum_layers sum_tokens softmax(logits)_e                  the mean router probability of e
    loss = E * sum_e f_e * P_e

Qwen3-Next pools the layers before the product (f and P are averaged over the layers, not the per-layer losses),
which this keeps. Layers may differ in E or k here (per_layer_config); the layers of each (E, k) are pooled as above
and the groups' losses averaged weighted by their layer counts, which is Qwen3-Next's loss when there is one group.
A batch with no counted token (every row padding) contributes nothing: its loss is 0 (Qwen3-Next's divides 0 by 0).
Everything stays on the device (histograms by scatter_add, no bincount): no host synchronisation.
"""

from __future__ import annotations

import torch


def _pooled_loss(layers: list[torch.Tensor], top_k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Qwen3-Next's loss over layers of one (E, k): E * sum_e f_e * P_e with f, P pooled over the layers."""
    num_experts = layers[0].shape[-1]
    device = layers[0].device
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in layers:
        probabilities = torch.softmax(logits.to(device).float(), dim=-1)
        selected = torch.topk(probabilities, top_k, dim=-1).indices
        weight = torch.ones(probabilities.shape[0], device=device) if mask is None else mask
        assignments = assignments.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(top_k))
        probability_sum = probability_sum + (probabilities * weight[:, None]).sum(0)
        rows = rows + weight.sum()
    rows = rows.clamp(min=1.0)  # no counted token (all padding): f = P = 0, so the loss is 0, not 0/0
    return num_experts * torch.sum((assignments / rows) * (probability_sum / rows))


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: list[int],
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The auxiliary loss (a float32 scalar) from each MoE layer's router logits [tokens, E_layer] (tokens = batch *
    seq_len, in the batch's row order) and its top-k; None when there is no MoE layer. attention_mask [batch, L >=
    seq_len] (1 = real token; its last seq_len columns cover these tokens, as in a cached forward) excludes padding;
    other masks (4-D, dicts) are ignored."""
    if not router_logits:
        return None
    if len(top_k) != len(router_logits):
        raise ValueError(f"load_balancing_loss: {len(router_logits)} router logits but {len(top_k)} top-k values; "
                         "give one top-k per MoE layer.")
    device = router_logits[0].device
    tokens = router_logits[0].shape[0]
    mask = None
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.numel() >= tokens:
        seq_len = tokens // attention_mask.shape[0]
        mask = attention_mask[:, attention_mask.shape[1] - seq_len:].reshape(-1).to(device, torch.float32)
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for logits, k in zip(router_logits, top_k):
        groups.setdefault((logits.shape[-1], k), []).append(logits)
    total = sum(_pooled_loss(layers, k, mask) * len(layers) for (_, k), layers in groups.items())
    return total / len(router_logits)


__all__ = ["load_balancing_loss"]
