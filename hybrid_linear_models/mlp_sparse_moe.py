"""Sparse mixture-of-experts MLP, Qwen3-Next's (`Qwen3NextSparseMoeBlock`), with its module and parameter names.

For a token x (a row of the pre-MLP normed hidden states, width H), with E experts, top-k routing and expert width I:

    logits = W_r x                                   router `gate.weight` (E, H)
    p      = softmax(logits) in float32              over the E experts
    (w, e) = top-k of p                              the k largest probabilities and their experts
    w      = w / sum(w)                              only when `norm_topk_prob`
    y      = sum_j w_j * down_e_j( act(gate_e_j x) * up_e_j x )
           + sigmoid(w_s . x) * down_s( act(gate_s x) * up_s x )      shared expert and its gate, when
                                                                        shared_expert_intermediate_size > 0

Weights as transformers stores them: `experts.gate_up_proj` (E, 2I, H), the gate's rows first then the up's, and
`experts.down_proj` (E, H, I); `shared_expert.{gate,up,down}_proj` and `shared_expert_gate` (1, H) are Linear layers.
The router's probabilities are rounded to the hidden dtype after the top-k (Qwen3-Next's rounding point), and the
router logits are the first output of `HybridLinearTopKRouter`, which the model records (`output_router_logits`).
A decoding step (one token per row, or few rows: `fused_projections.stacks_projections`) with no gradient computes
the router's logits and the shared expert gate's as one product of their stacked weights [W_r; w_s] (shared rows, no
copy: `derived_weights.SharedRows`; one GEMV in a captured step), and hands the router its logits: every output is
the same dot product as apart, and the router's module still runs (hooks and the recorded logits see it).
A long prompt without gradients is routed once, whole, then runs its experts and shared part a chunk of tokens at a
time with each chunk's routes (`token_chunks`): their intermediates (k x T x 2I values for the experts) are held for
one chunk, and every token goes to the experts it goes to unchunked. Both MoE MLPs (this one and Kimi's) do so
through `RoutedMoeBlock`.

The experts run through transformers' experts machinery (`use_experts_implementation`), chosen by the model config's
`_experts_implementation` (`from_pretrained(..., experts_implementation=...)`, `model.set_experts_implementation`):
- "grouped_mm_gather" (this package's default, experts_grouped_gather.py): transformers' grouped_mm with the token
  permutations as gathers (no scatter in the backward) and the routing weight applied before down_proj; faster than
  both of transformers' on the CPU (benchmarks/bench_moe.py);
- "grouped_mm" (transformers' default): the (token, expert) pairs sorted by expert, one grouped GEMM per projection
  (torch.nn.functional.grouped_mm: a CPU kernel in torch >= 2.9, CUDA SM80+);
- "batched_mm": each pair multiplies by its own gathered expert matrix (bmm); memory k*E-fold, for tiny batches;
- "eager" (this class's own forward): transformers' loop over the experts that received tokens, one host sync.
The first three keep everything on the device with shapes that depend only on the token count, so a CUDA graph can
capture them; the captured decoding step runs "grouped_mm_gather" when the model's choice is "eager"
(`graph_safe_experts_implementation`).

Expert parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=n, ep_size=n))`, or
`fsdp_size=n, ep_size=n`): the registration's `expert_parallel_plan` is transformers' Qwen3-Next one. Each rank holds
E / n whole experts (its `num_experts` becomes E / n, its expert ids local), and transformers' dispatch brings them
their tokens: "all_reduce" hands every rank the whole batch with the routes to other ranks' experts given the sentinel
id E / n and weight 0, and sums the ranks' outputs (every implementation here skips or zeroes those routes exactly, so
the sum is the unsharded y up to the order of the k-term sum); "all_to_all" sends each rank only its own routes. A
num_experts that n does not divide is refused at load (`check_expert_parallel_size`); CUDA-graph decoding captures only
the all-reduce dispatch (`graph_capturable_expert_dispatch`).

Each field may vary per layer (per_layer_config): num_experts, num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size (0: no shared expert and no gate), norm_topk_prob, hidden_act.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation

from . import experts_routed
from .derived_weights import SharedRows
from .experts_grouped_gather import CUDA_GROUPED_MM_GRAPH_DTYPES
from .experts_grouped_gather import NAME as GROUPED_MM_GATHER
from .fused_projections import is_plain_linear, stacks_projections
from .mlp_dense import GatedMLP
from .mlp_registry import MLPS, ConfigField, MlpSpec, register
from .moe_inference_ops import add_gated, route_top_k, sum_routes
from .shown_values import brief
from .tensor_parallel_heads import device_mesh
from .token_chunks import chunks_apply, token_chunked

# The experts implementations this module offers (transformers' names and ours); the first is the model's default.
EXPERTS_IMPLEMENTATIONS = (GROUPED_MM_GATHER, "grouped_mm", "batched_mm", "eager")
# the implementations a captured CUDA graph can run (no host synchronisation)
GRAPH_SAFE_EXPERTS_IMPLEMENTATIONS = (GROUPED_MM_GATHER, "grouped_mm", "batched_mm")


def graph_safe_experts_implementation(requested: str | None, dtype: torch.dtype | None = None,
                                      device_type: str = "cpu") -> str:
    """The experts implementation a captured one-token step runs for a model configured with `requested`, whose
    experts hold `dtype` on a `device_type` device (CUDA's grouped GEMM syncs with the host outside
    CUDA_GROUPED_MM_GRAPH_DTYPES: batched_mm there, one bmm per pair)."""
    safe = requested if requested in GRAPH_SAFE_EXPERTS_IMPLEMENTATIONS else GROUPED_MM_GATHER
    if device_type == "cuda" and safe != "batched_mm" and dtype not in CUDA_GROUPED_MM_GRAPH_DTYPES:
        return "batched_mm"
    return safe


@contextmanager
def graph_safe_experts(config: Any, dtype: torch.dtype | None = None, device_type: str = "cpu") -> Iterator[None]:
    """Inside: the model config's experts implementation is a graph-safe one for experts of `dtype` on
    `device_type` (the eager loop's host-read expert list would be frozen into a captured graph, and its sync refused
    during capture); restored on exit."""
    requested = getattr(config, "_experts_implementation", None)
    safe = graph_safe_experts_implementation(requested, dtype, device_type)
    if safe == requested:
        yield
        return
    config._experts_implementation_internal = safe
    try:
        yield
    finally:
        config._experts_implementation_internal = requested


def graph_capturable_expert_dispatch(distributed: Any) -> bool:
    """Whether a CUDA graph can capture the model's experts, given the config's `distributed_config` (None without
    one): False when they are expert parallel with a token dispatch that reads its split sizes on the host
    (transformers' "all_to_all", which "auto" also picks when the ranks of the expert group hold different batches,
    ep_size != tp_size); decoding then runs eagerly."""
    if distributed is None or getattr(distributed, "ep_size", 1) <= 1:
        return True
    dispatch = distributed.ep_implementation
    return dispatch == "all_reduce" or (dispatch == "auto" and distributed.ep_size == distributed.tp_size)


class HybridLinearTopKRouter(nn.Module):
    """Softmax over the experts in float32, then top-k; (logits, top-k weights, top-k experts). The model records the
    logits of every router of this class or a subclass (`output_router_logits`)."""

    balanced_by_aux_loss = True  # its logits count in the load-balancing loss (moe_load_balancing.py)

    def __init__(self, settings: Any):
        super().__init__()
        self.top_k = settings.num_experts_per_tok
        self.num_experts = settings.num_experts
        self.norm_topk_prob = settings.norm_topk_prob
        self.hidden_dim = settings.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states: torch.Tensor, logits: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`logits`: F.linear(hidden_states, weight) where the caller computed it (stacked with another product of the
        same rows: the sparse MoE block's decoding step), else computed here."""
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight) if logits is None else logits  # (tokens, E)
        # (tokens, k) each; one kernel at inference on a GPU (moe_inference_ops)
        top_weights, top_experts = route_top_k(router_logits, self.top_k, normalize=self.norm_topk_prob)
        return router_logits, top_weights, top_experts


@use_experts_implementation
class HybridLinearExperts(nn.Module):
    """E gated experts stored as 3-D tensors (transformers' layout). Built as (config, settings): `config` is the
    model's (its `_experts_implementation` picks the forward, and follows `set_experts_implementation`), `settings`
    the layer's resolved config (its sizes)."""

    fp8_layout = "experts"  # under an FP8 quantization_config, fp8_layers replaces it by its Fp8Experts

    def __init__(self, config: Any, settings: Any | None = None):
        super().__init__()
        settings = config if settings is None else settings
        self.num_experts = settings.num_experts
        self.hidden_dim = settings.hidden_size
        self.intermediate_dim = settings.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[settings.hidden_act]

    def route_rows(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor | None:
        """A decoding step's experts, [T, k, H]: each (token, slot) route's weighted output, one GEMV launch a
        projection on a GPU, for the caller to sum (`experts_routed`); None where that does not apply (more routes,
        not a GPU, gradients, expert parallelism, or hooks on this module, which its forward would run)."""
        if getattr(self, "_is_expert_parallel", False) or self._forward_hooks or self._forward_pre_hooks:
            return None
        return experts_routed.route_rows(self, hidden_states, top_k_index, top_k_weights)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The "eager" implementation: a loop over the experts that received tokens (their list read on the host)."""
        output = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # (E + 1, k, tokens): which (slot, token) pairs each expert serves; index E is expert parallelism's
            # sentinel for pairs routed to another rank's experts, skipped
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = (expert_mask[: self.num_experts].sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
        # no expert hit (expert parallelism: every route of the batch goes to other ranks): expert 0 on no rows, so
        # the output stays in the graph of the inputs and weights, as on the ranks that have work: the dispatch's
        # backward collectives (all-reduce of the inputs' gradients) then run on every rank
        for expert in hit or [0]:
            slot, token = torch.where(expert_mask[expert])
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out = F.linear(self.act_fn(gate) * up, self.down_proj[expert]) * top_k_weights[token, slot, None]
            output.index_add_(0, token, out.to(output.dtype))
        return output


class HybridLinearSharedExpert(GatedMLP):
    """The shared expert: a gated MLP every token goes through, down(act(gate(x)) * up(x)), of width `width`
    (default: shared_expert_intermediate_size); the dense MLP's module (one GEMM for gate and up in a decoding step)."""

    def __init__(self, settings: Any, width: int | None = None):
        width = settings.shared_expert_intermediate_size if width is None else width
        super().__init__(settings.hidden_size, width, settings.hidden_act, bias=False)


class RoutedMoeBlock(nn.Module):
    """A router, the routed experts and an optional shared part, [..., H] -> [..., H]: what every MoE MLP type has in
    common; each states its router (`router_class`), builds its shared part (`build_shared`) and says how that part
    adds to the experts' output (`add_shared`)."""

    router_class: type[nn.Module]

    def __init__(self, config: Any, layer_idx: int | None = None):
        """config: the model's (its experts implementation); the layer reads its sizes from
        config.per_layer_config[layer_idx] (from `config` itself when layer_idx is None: a standalone block)."""
        super().__init__()
        settings = config if layer_idx is None else config.per_layer_config[layer_idx]
        self.initializer_range = getattr(settings, "initializer_range", 0.02)  # the router's and experts' init std
        self.gate = self.router_class(settings)
        self.experts = HybridLinearExperts(config, settings)
        self.build_shared(settings)

    def build_shared(self, settings: Any) -> None:
        raise NotImplementedError

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [tokens, H] (or each token's k rows [tokens, k, H], to sum) plus the shared
        part's for x = hidden_states [..., H] as rows. It is given hidden_states too, as the shared experts' gated MLP
        sees a decoding step in its [batch, 1, H] shape."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, routing_weights, selected_experts = self.gate(x)
        if chunks_apply(x.shape[0]):
            # a long prompt without gradients: routed once, its experts and shared part a chunk of tokens at a time
            # (token_chunks), each chunk with its tokens' routes
            return token_chunked(self._experts_and_shared, x, selected_experts, routing_weights).reshape(shape)
        return self._experts_and_shared(x, selected_experts, routing_weights, hidden_states).reshape(shape)

    def _experts_and_shared(self, x: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor,
                            hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output plus the shared part's, [tokens, H], for the rows x and their routes. Experts
        that give each route's row (a decoding step's: `_routed`) leave their sum to `add_shared`."""
        return self.add_shared(self._routed(x, selected_experts, routing_weights), x,
                               x if hidden_states is None else hidden_states)

    def _routed(self, x: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' output: [tokens, H], or each route's row [tokens, k, H] from experts whose class gives
        them (`route_rows`, looked up on the class: a wrapper's forward is not skipped)."""
        route_rows = getattr(type(self.experts), "route_rows", None)
        out = route_rows(self.experts, x, selected_experts, routing_weights) if route_rows is not None else None
        return out if out is not None else self.experts(x, selected_experts, routing_weights)


class HybridLinearSparseMoeBlock(RoutedMoeBlock):
    """Qwen3-Next's: softmax top-k router, routed experts, optional sigmoid-gated shared expert."""

    router_class = HybridLinearTopKRouter

    def build_shared(self, settings: Any) -> None:
        self.shared_expert = self.shared_expert_gate = None
        if settings.shared_expert_intermediate_size > 0:
            self.shared_expert = HybridLinearSharedExpert(settings)
            self.shared_expert_gate = nn.Linear(settings.hidden_size, 1, bias=False)
        self._router_and_gate = SharedRows()  # [W_r; w_s]: a decoding step's one product (module docstring)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        both = self._router_and_gate_logits(hidden_states)
        if both is None:
            return super().forward(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        experts = self.gate.num_experts
        _, routing_weights, selected_experts = self.gate(x, logits=both[:, :experts])
        routed = self._routed(x, selected_experts, routing_weights)
        shared = self.shared_expert(hidden_states).reshape(x.shape)
        return add_gated(routed, both[:, experts:], shared).reshape(hidden_states.shape)

    def _router_and_gate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """A decoding step's router logits and shared-expert gate logit [tokens, E + 1], one product of the stacked
        weights; None where they stay apart: a forward of more rows, gradients or a compiler, no shared expert, a
        router of another class or with input hooks or a sharded weight, a gate that is not a plain bias-less Linear
        (peft's LoRA wraps it; hooks), or weights of two dtypes or devices."""
        router, gate = self.gate, self.shared_expert_gate
        if (gate is None or type(router) is not HybridLinearTopKRouter or not stacks_projections(hidden_states)
                or torch.is_grad_enabled() or torch.compiler.is_compiling()):
            return None
        if (router._forward_pre_hooks or "forward" in vars(router) or device_mesh(router.weight) is not None
                or not is_plain_linear(gate) or gate.bias is not None):
            return None
        if (router.weight.dtype != gate.weight.dtype or router.weight.device != gate.weight.device
                or router.weight.shape[1] != gate.weight.shape[1]):
            return None
        weight = self._router_and_gate.get([router.weight, gate.weight])
        return F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]), weight)

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return sum_routes(routed)
        # routed + sigmoid(gate) * shared: one kernel at inference on a GPU (moe_inference_ops), which sums routed
        # experts' rows [tokens, k, H] first where they come unsummed
        return add_gated(routed, self.shared_expert_gate(x), self.shared_expert(hidden_states).reshape(x.shape))


def check_expert_parallel_size(config: Any, ep_size: int) -> None:
    """Expert parallelism over `ep_size` ranks holds num_experts / ep_size whole experts per rank: a ValueError naming
    the first MoE layer (any MLP type with a `num_experts` field: the plan's patterns match every `experts` module by
    name) whose num_experts it does not divide (checked before transformers shards anything)."""
    if ep_size <= 1:
        return
    for index, mlp_type in enumerate(config.mlp_types):
        if "num_experts" not in MLPS[mlp_type].fields:
            continue
        num_experts = config.per_layer_config[index].num_experts
        if num_experts % ep_size:
            raise ValueError(
                f"Expert parallelism over ep_size={ep_size} ranks (the world size of the expert group) needs layer "
                f"{index}'s num_experts divisible by {ep_size}, got num_experts={brief(num_experts)}; use an ep_size "
                f"that divides it, or a num_experts that ep_size divides (per_layer_config[{index}].num_experts or "
                "num_experts).")


def sparse_moe_parameter_count(settings: Any) -> int:
    """The weights of one layer's sparse MoE MLP (the configuration's size bound)."""
    hidden, experts, width, shared = (settings.hidden_size, settings.num_experts, settings.moe_intermediate_size,
                                      settings.shared_expert_intermediate_size)
    return experts * hidden + 3 * experts * width * hidden + (3 * shared * hidden + hidden if shared > 0 else 0)


def init_sparse_moe_weights(block: RoutedMoeBlock) -> None:
    """Qwen3-Next's initialisation of what the generic init does not reach: the router and the 3-D expert weights
    drawn from N(0, initializer_range); the shared expert's Linear layers get the generic init. (transformers'
    `init` functions skip tensors loaded from a checkpoint.)"""
    from transformers import initialization as init

    std = block.initializer_range
    init.normal_(block.gate.weight, mean=0.0, std=std)
    if isinstance(block.experts, HybridLinearExperts):  # FP8 experts (fp8_layers) initialise themselves
        init.normal_(block.experts.gate_up_proj, mean=0.0, std=std)
        init.normal_(block.experts.down_proj, mean=0.0, std=std)


def _relation_problems(s: Any, prefix: str) -> list[str]:
    if isinstance(s.num_experts_per_tok, int) and isinstance(s.num_experts, int) and (
            s.num_experts_per_tok > s.num_experts):
        return [f"{prefix}num_experts_per_tok={s.num_experts_per_tok} exceeds num_experts={s.num_experts}; route "
                "each token to at most num_experts experts (lower num_experts_per_tok or add experts)"]
    return []


# The experts' 3-D weights, for peft's `LoraConfig(target_parameters=...)` (one rank-r update per expert); LoRA's
# `target_modules` reach the shared expert's projections (lora_targets below).
LORA_TARGET_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")

# ---------------------------------------------------------------------------------------------------- registration

register(MlpSpec(
    mlp_type="sparse_moe", mlp_layer_type="sparse", title="sparse mixture of experts",
    fields={
        "num_experts": ConfigField(kind="size", default=64, doc="routed experts of each sparse MoE layer."),
        "num_experts_per_tok": ConfigField(kind="size", default=8,
                                           doc="experts each token is routed to (the top-k of its router's scores)."),
        "moe_intermediate_size": ConfigField(kind="size", default=512, doc="width of each routed expert's MLP."),
        "shared_expert_intermediate_size": ConfigField(
            kind="size_or_zero", default=512,
            doc="width of the shared expert every token goes through, with its sigmoid gate (0: none)."),
        "norm_topk_prob": ConfigField(kind="bool", default=True,
                                      doc="renormalise the top-k routing probabilities to sum to 1."),
        "hidden_act": MLPS["dense"].fields["hidden_act"],
    },
    module_class=HybridLinearSparseMoeBlock, parameter_count=sparse_moe_parameter_count,
    relation_problems=_relation_problems, init_weights=init_sparse_moe_weights,
    # transformers' Qwen3-Next plan: experts split along their width on every rank ("packed_colwise" splits the gate
    # and up halves of gate_up_proj alike), their partial outputs summed by "moe_tp_experts"; router replicated
    tensor_parallel_plan={
        "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise", "experts": "moe_tp_experts",
        "shared_expert.gate_proj": "colwise", "shared_expert.up_proj": "colwise", "shared_expert.down_proj": "rowwise",
    },
    # expert parallelism (DistributedConfig(tp_size=n, ep_size=n)), transformers' Qwen3-Next plan: each rank holds
    # E / n whole experts ("grouped_gemm" splits dim 0 and sets the module's num_experts to E / n), reached through
    # "ep_dispatch_experts" (routes to other ranks' experts masked and the outputs all-reduced, or the tokens
    # exchanged all-to-all: DistributedConfig.ep_implementation); these replace the experts' tensor-parallel entries,
    # the router and the shared expert keep theirs
    expert_parallel_plan={
        "experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm", "experts": "ep_dispatch_experts",
    },
    lora_targets=("gate_proj", "up_proj", "down_proj"),
    describe=lambda s: (f"{s.num_experts} experts of {s.moe_intermediate_size}, top-{s.num_experts_per_tok}"
                        + (f", shared expert of {s.shared_expert_intermediate_size}"
                           if s.shared_expert_intermediate_size else "")),
))


__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "GRAPH_SAFE_EXPERTS_IMPLEMENTATIONS",
    "LORA_TARGET_PARAMETERS",
    "HybridLinearExperts",
    "HybridLinearSharedExpert",
    "HybridLinearSparseMoeBlock",
    "HybridLinearTopKRouter",
    "RoutedMoeBlock",
    "check_expert_parallel_size",
    "graph_capturable_expert_dispatch",
    "graph_safe_experts",
    "graph_safe_experts_implementation",
    "init_sparse_moe_weights",
    "sparse_moe_parameter_count",
]
