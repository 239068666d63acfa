"""Kimi-Linear's mixture-of-experts MLP (`mlp_types` entry "kimi_moe"): DeepSeek-V3 routing, as transformers'
`KimiLinearMoE` / `KimiLinearTopkRouter`, with its module, parameter and buffer names so checkpoints map one to one.

For a token x (a row of the pre-MLP normed hidden states, width H), with E experts in G = n_group groups of E / G,
top-k routing, expert width I:

    logits = W_r x                                  router `gate.weight` (E, H), in float32 (or the wider input dtype)
    s      = sigmoid(logits)                        each expert's affinity, independent of the others (no softmax)
    c      = s + b                                  b = `gate.e_score_correction_bias` (E,): steers the CHOICE only
    group score_g = sum of the 2 largest c in group g           (transformers' and DeepSeek-V3's rule)
    kept groups   = the topk_group best groups; c of the experts in the other groups set to -inf
    e      = top-k of c                             the k chosen experts
    w      = s[e]                                   their weights come from s, never from b
    w      = w / (sum(w) + 1e-20)                   only when `norm_topk_prob`
    w      = routed_scaling_factor * w
    y      = sum_j w_j * down_e_j( act(gate_e_j x) * up_e_j x )
           + down_s( act(gate_s x) * up_s x )       the shared experts: one ungated MLP of width I * n_shared_experts
                                                     (0: none)

Why the bias: Kimi-Linear / DeepSeek-V3 balance the experts' load without an auxiliary loss. Training adjusts b
outside the optimizer (raising it for under-used experts, lowering it for over-used ones), so it changes which experts
a token reaches but not how much each contributes. It is therefore a buffer here, as in transformers: saved and
loaded with the checkpoint, created in float32, never returned by `parameters()` (an optimizer leaves it alone), and
set to zeros by a fresh initialisation. The router weight is created in float32 as well (transformers keeps both in
float32 when loading bf16/fp16 checkpoints, `_keep_in_fp32_modules_strict`); the routing math runs in float32 whatever
the hidden dtype (float64 models route in float64), and the weights it returns stay in that dtype, as transformers'.

Router logits and the auxiliary loss: with `output_router_logits`, the router's logits (pre-sigmoid, float32) are
recorded like the sparse MoE's (the router is a `HybridLinearTopKRouter`), in layer order. The load-balancing
auxiliary loss (`aux_loss`, moe_load_balancing.py, a softmax-router loss) does not count these layers: Kimi-Linear has
no auxiliary loss (transformers' KimiLinearForCausalLM returns none), its balance comes from the bias. A model whose
MoE layers are all "kimi_moe" returns `aux_loss` None and adds nothing to the loss.

The routing is a fixed sequence of device ops (sigmoid, max, topk, scatter, masked_fill, gather) with shapes set by
the token count: no host synchronisation, so a captured CUDA-graph decoding step routes every token afresh (a group's
score is two maxes, not a topk: the same floats at a third of the CPU time). Where every group is kept
(Kimi-Linear-48B-A3B: one group), the routing after the logits is `moe_inference_ops.route_top_k`: one kernel at
inference on a GPU, these ops elsewhere. The experts are the sparse MoE's
(`HybridLinearExperts`: transformers' experts implementations grouped_mm / batched_mm / eager and this package's
grouped_mm_gather, the default), the captured step running a graph-safe one.

Kimi-Linear's first dense layers (`first_k_dense_replace`) are simply `mlp_types` entries: "dense" for the first k
layers, "kimi_moe" after. Each field may vary per layer (per_layer_config): num_experts, num_experts_per_tok,
moe_intermediate_size, norm_topk_prob, hidden_act (shared with "sparse_moe" / "dense"), and n_group, topk_group,
routed_scaling_factor, n_shared_experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .derived_weights import DerivedWeight
from .kernels_gemv import linear_widened
from .mlp_registry import MLPS, ConfigField, MlpSpec, register
from .mlp_sparse_moe import (
    HybridLinearSharedExpert,
    HybridLinearTopKRouter,
    RoutedMoeBlock,
    init_sparse_moe_weights,
)
from .moe_inference_ops import add_gated, route_top_k, sum_routes

NORM_EPSILON = 1e-20  # added to the sum of the chosen weights before dividing (transformers' KimiLinearTopkRouter)
GROUP_SCORE_EXPERTS = 2  # a group's score: the sum of its best 2 corrected scores (DeepSeek-V3, transformers)


def _sum_of_two_largest(grouped: torch.Tensor) -> torch.Tensor:
    """grouped [..., n] -> the sum of its 2 largest entries along the last dim, [...]: topk(2).values.sum(-1), the
    same floats (the largest plus the largest of the rest, a tie counted twice as topk does), as a max, a one-element
    mask and a second max: a third of topk's CPU time (one pass per max over a row of n, no partial sort)."""
    first, where = grouped.max(dim=-1, keepdim=True)
    second = grouped.scatter(-1, where, float("-inf")).amax(dim=-1, keepdim=True)
    return (first + second).squeeze(-1)


class HybridLinearKimiMoeRouter(HybridLinearTopKRouter):
    """Sigmoid scores, bias-corrected grouped top-k choice; (logits, top-k weights, top-k experts). A top-k router
    (recorded as the sparse MoE's is), its weights and choice as the module docstring gives them."""

    balanced_by_aux_loss = False  # Kimi-Linear balances by e_score_correction_bias (module docstring)

    def __init__(self, settings: Any):
        super().__init__(settings)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        self.num_group, self.topk_group = settings.n_group, settings.topk_group
        self.routed_scaling_factor = settings.routed_scaling_factor
        self._cast_weight = DerivedWeight()

    def _float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The router weight in `dtype` (float32 at least): kept between no-grad steps when it must be cast (a bf16
        model's router), so a decoding step does not cast it again (one kernel per MoE layer and step)."""
        if self.weight.dtype == dtype:
            return self.weight
        return self._cast_weight.get([self.weight], lambda: self.weight.to(dtype), tag=dtype)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        # (tokens, E): in a captured decoding step one GEMV reads the bf16 rows and the float32 weight (kernels_gemv)
        router_logits = linear_widened(hidden_states.reshape(-1, self.hidden_dim), self._float_weight(dtype))
        if self.topk_group >= self.num_group:  # every group kept: one kernel at inference on a GPU (moe_inference_ops)
            top_weights, top_experts = route_top_k(
                router_logits, self.top_k, sigmoid=True, normalize=self.norm_topk_prob,
                bias=self.e_score_correction_bias, eps=NORM_EPSILON, scale=self.routed_scaling_factor)
            return router_logits, top_weights, top_experts
        scores = router_logits.sigmoid()
        # only the choice's indices are used: computed outside autograd (no graph kept for it)
        choice = scores.detach() + self.e_score_correction_bias.to(dtype)
        if self.topk_group < self.num_group:  # (always here: all groups kept took route_top_k above)
            grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            group_scores = _sum_of_two_largest(grouped)  # (tokens, G)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            kept_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~kept_mask[..., None], float("-inf")).view(-1, self.num_experts)
        top_experts = choice.topk(self.top_k, dim=-1).indices  # (tokens, k)
        top_weights = scores.gather(1, top_experts)
        if self.norm_topk_prob:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + NORM_EPSILON)
        return router_logits, top_weights * self.routed_scaling_factor, top_experts


class HybridLinearKimiMoeBlock(RoutedMoeBlock):
    """Kimi-Linear's: the sigmoid, bias-corrected grouped router, routed experts, optional ungated shared experts."""

    router_class = HybridLinearKimiMoeRouter

    def build_shared(self, settings: Any) -> None:
        self.shared_experts = None
        if settings.n_shared_experts > 0:
            width = settings.moe_intermediate_size * settings.n_shared_experts
            self.shared_experts = HybridLinearSharedExpert(settings, width)

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return sum_routes(routed)
        # routed + shared: one kernel at inference on a GPU (moe_inference_ops), which sums routed rows [tokens, k, H]
        # first where they come unsummed
        return add_gated(routed, None, self.shared_experts(hidden_states).reshape(x.shape))


def kimi_moe_parameter_count(settings: Any) -> int:
    """The weights of one layer's Kimi MoE MLP (the configuration's size bound): router and its bias, experts, shared
    experts."""
    hidden, experts, width = settings.hidden_size, settings.num_experts, settings.moe_intermediate_size
    return experts * (hidden + 1) + 3 * experts * width * hidden + 3 * settings.n_shared_experts * width * hidden


def init_kimi_moe_weights(block: HybridLinearKimiMoeBlock) -> None:
    """transformers' KimiLinear initialisation of what the generic init does not reach: the router and the 3-D expert
    weights from N(0, initializer_range), the correction bias zeros; the shared experts' Linear layers get the generic
    init. (transformers' `init` functions skip tensors loaded from a checkpoint.)"""
    from transformers import initialization as init

    init_sparse_moe_weights(block)  # the router and experts as Qwen3-Next's
    init.zeros_(block.gate.e_score_correction_bias)


def _relation_problems(s: Any, prefix: str) -> list[str]:
    """The groups must split the experts evenly, keep at most all groups, score each by 2 experts when some are
    dropped, and hold at least the top-k experts."""
    experts, top_k, groups, kept = s.num_experts, s.num_experts_per_tok, s.n_group, s.topk_group
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (experts, top_k, groups, kept)):
        return []  # (each field's own check names it)
    if experts % groups:
        return [f"{prefix}n_group={groups} does not divide num_experts={experts}; the experts form n_group equal "
                "groups: choose an n_group that divides num_experts"]
    if kept > groups:
        return [f"{prefix}topk_group={kept} exceeds n_group={groups}; a token keeps at most every group: lower "
                "topk_group"]
    per_group = experts // groups
    if kept < groups and per_group < GROUP_SCORE_EXPERTS:
        return [f"{prefix}n_group={groups} leaves {per_group} expert per group, and a group's score is the sum of its "
                f"best {GROUP_SCORE_EXPERTS}: use at most num_experts / 2 = {experts // 2} groups (or topk_group = "
                "n_group)"]
    if top_k > kept * per_group:
        return [f"{prefix}num_experts_per_tok={top_k} exceeds the {kept * per_group} experts of the topk_group={kept} "
                f"groups a token keeps ({per_group} per group); lower num_experts_per_tok or raise topk_group"]
    return []


def _describe(s: Any) -> str:
    groups = f", top-{s.topk_group} of {s.n_group} groups" if s.topk_group < s.n_group else ""
    shared = f", {s.n_shared_experts} shared expert(s)" if s.n_shared_experts else ""
    return (f"{s.num_experts} experts of {s.moe_intermediate_size}, top-{s.num_experts_per_tok}{groups} (sigmoid, "
            f"bias-corrected choice, scale {s.routed_scaling_factor}){shared}")


# ---------------------------------------------------------------------------------------------------- registration

_SPARSE = MLPS["sparse_moe"].fields  # the expert fields both MoE MLPs read, declared once

register(MlpSpec(
    mlp_type="kimi_moe", mlp_layer_type="sparse", title="Kimi-Linear mixture of experts",
    fields={
        **{name: _SPARSE[name] for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                            "norm_topk_prob")},
        "n_group": ConfigField(kind="size", default=1,
                               doc="groups the kimi_moe experts are split into for grouped top-k routing."),
        "topk_group": ConfigField(kind="size", default=1,
                                  doc="groups a token's kimi_moe experts are chosen from (the best by top-2 score)."),
        "routed_scaling_factor": ConfigField(kind="positive_number", default=1.0,
                                             doc="factor on the kimi_moe routing weights (after renormalisation)."),
        "n_shared_experts": ConfigField(
            kind="size_or_zero", default=1,
            doc="kimi_moe shared experts, one ungated MLP of n_shared_experts * moe_intermediate_size (0: none)."),
        "hidden_act": MLPS["dense"].fields["hidden_act"],
    },
    module_class=HybridLinearKimiMoeBlock, parameter_count=kimi_moe_parameter_count,
    relation_problems=_relation_problems, init_weights=init_kimi_moe_weights,
    # transformers' KimiLinear plan (as the sparse MoE's): experts split along their width on every rank, partial
    # outputs summed by "moe_tp_experts"; router and its bias replicated
    tensor_parallel_plan={
        "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise", "experts": "moe_tp_experts",
        "shared_experts.gate_proj": "colwise", "shared_experts.up_proj": "colwise",
        "shared_experts.down_proj": "rowwise",
    },
    lora_targets=("gate_proj", "up_proj", "down_proj"),
    describe=_describe,
))


__all__ = ["HybridLinearKimiMoeBlock", "HybridLinearKimiMoeRouter", "init_kimi_moe_weights",
           "kimi_moe_parameter_count"]
