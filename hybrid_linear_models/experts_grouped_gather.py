"""The "grouped_mm_gather" experts implementation: transformers' grouped_mm experts with permutations that are gathers
both ways, registered in transformers' experts interface (`ALL_EXPERTS_FUNCTIONS`) under that name.

The routed computation is, for the S = tokens * k (token, expert) pairs sorted by expert (a stable sort of the flat
top-k experts; `order` lists the pairs in sorted order, `inverse` is its inverse permutation):

    xs = x[order // k]                              each pair's token row, grouped by expert
    ys = down_e( act(gate_e xs) * up_e xs * w[order] )   one grouped GEMM per projection (offsets: cumulative
                                                          counts); the routing weight applied before down_proj
    out[t] = sum_j  ys[inverse][t * k + j]

transformers' grouped_mm writes the same math with advanced indexing (`x[perm // k]`, `w[perm]`, `out[inv_perm]`),
whose backward is an accumulating index_put (a scatter, slow on CPU: a fifth of the MoE step there). Here each
permutation is a custom autograd function whose backward is the inverse gather (`index_select` by the inverse
permutation, then a sum over the k copies of each token for x): no scatter, no atomics, deterministic. On the CPU the
un-permutation and the sum over each token's k experts are one `index_add` (deterministic there; its backward is a
gather), which saves the [S, H] un-permuted copy; for the same reason the gradient of x (the sum of its k gathered
copies' gradients) is one `index_add` there too.
benchmarks/bench_moe.py measures it against transformers' grouped_mm and eager in the same run (it is kept because it
is faster there, CPU and CUDA); the numbers differ from theirs only by summation order inside the GEMMs.

Expert parallelism (transformers' "ep_dispatch_experts" with "grouped_gemm" weights, mlp_sparse_moe.py's plan): this
rank holds num_experts = E / ranks experts, numbered locally. transformers' all-reduce dispatch hands every rank the
whole batch with the routes to other ranks' experts marked by the sentinel id num_experts and weight 0; the sort puts
those pairs last, past offsets[-1], so the grouped GEMMs skip them, and because those kernels leave the rows they skip
unwritten (in the forward output and in the input gradient), the sentinel rows are zeroed on both sides of each GEMM
(`keep`): their contribution to the output, and to every gradient (hidden states, routing weights, experts), is then
exactly zero, and the all-reduce of the ranks' partial outputs sums each token's k expert outputs. (The all-to-all
dispatch sends this rank only its own pairs, top-1 with local ids and unit weights: no sentinel.)

No host synchronisation on CUDA (sort, searchsorted and gathers stay on the device, shapes depend on the token
count only), so a CUDA graph can capture it, as transformers' grouped_mm, for bfloat16 weights: torch's CUDA grouped
GEMM takes no other dtype under torch.compile, and transformers' fallback for the others reads the group offsets on
the host. So under torch.compile (as `generate` compiles a static-cache step, with CUDA graphs, when this package's
own graph decoding is off) experts of another dtype on CUDA run transformers' batched_mm, which has no host sync.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_mm

NAME = "grouped_mm_gather"
# the dtypes torch's CUDA grouped GEMM runs on the device alone, also under torch.compile; other dtypes go through a
# fallback that reads the group offsets on the host (refused inside a CUDA graph)
CUDA_GROUPED_MM_GRAPH_DTYPES = (torch.bfloat16,)
HOST_SYNCED_DEVICE_TYPES = ("cuda",)  # the devices where that fallback syncs (tests add "cpu" to check the switch)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped_mm kernels take


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [S, in] @ weight[e].T for the rows of each expert e (weight [E, out, in]); float64 (the tests' exact
    comparisons), which torch's grouped_mm refuses, goes through transformers' per-expert fallback."""
    weight = weight.transpose(1, 2)
    if rows.dtype in _GROUPED_MM_DTYPES:
        return _grouped_mm(rows, weight, offsets)
    return torch.ops.transformers.grouped_mm_fallback(rows, weight.to(rows.dtype), offs=offsets)


class _GatherRows(torch.autograd.Function):
    """x.index_select(0, index), where `index` takes every row of x exactly `copies` times (a permutation of the rows
    of x repeated `copies` times, row r's copies at positions r * copies ... in `inverse`'s numbering). Backward:
    the gradient gathered back by `inverse`, then summed over each row's copies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(index, inverse)
        ctx.copies, ctx.rows = copies, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, inverse = ctx.saved_tensors
        if ctx.copies > 1 and grad.device.type == "cpu":
            # the sum over each row's copies as one index_add into [rows, ...] (deterministic on the CPU, as the
            # forward's un-permutation): half the time of the gather, which writes a [S, ...] copy and reads it back
            return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add(0, index, grad), None, None, None
        grad = grad.index_select(0, inverse)
        if ctx.copies > 1:
            grad = grad.view(ctx.rows, ctx.copies, *grad.shape[1:]).sum(1)
        return grad, None, None, None


def _zero_rows(rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """rows with the rows where `keep` [S, 1] is False set to 0 (its backward zeroes their gradient); `keep` None:
    rows unchanged."""
    return rows if keep is None else rows.masked_fill(~keep, 0.0)


def expert_offsets(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The int32 end of each expert's run in the sorted expert ids (grouped_mm's offsets): offsets[e] = the number of
    ids <= e, a binary search on the device (bincount reads its length on the host: no CUDA graph could capture it).
    Ids of num_experts or above (expert parallelism's sentinel) lie past offsets[-1]."""
    ends = torch.arange(num_experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, ends, right=True, out_int32=True)


def grouped_mm_gather_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output [tokens, H] for hidden_states [tokens, H], top_k_index / top_k_weights [tokens, k]."""
    if (torch.compiler.is_compiling() and hidden_states.device.type in HOST_SYNCED_DEVICE_TYPES
            and self.gate_up_proj.dtype not in CUDA_GROUPED_MM_GRAPH_DTYPES):  # (module docstring, last paragraph)
        return ALL_EXPERTS_FUNCTIONS["batched_mm"](self, hidden_states, top_k_index, top_k_weights)
    tokens, k = top_k_index.shape
    num_experts = self.num_experts  # this rank's experts under expert parallelism
    flat = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offsets = expert_offsets(sorted_experts, num_experts)
    # expert parallelism: the sorted pairs past offsets[-1] are the sentinel tail, which the grouped GEMMs skip and
    # leave unwritten (forward rows and input-gradient rows); zeroed before and after each GEMM
    keep = (sorted_experts < num_experts).unsqueeze(-1) if getattr(self, "_is_expert_parallel", False) else None
    token_of = order // k  # the token of each sorted pair
    selected = _GatherRows.apply(hidden_states, token_of, inverse, k)  # [S, H], grouped by expert
    projected = _zero_rows(_grouped_linear(_zero_rows(selected, keep), self.gate_up_proj, offsets), keep)  # [S, 2I]
    weights = _GatherRows.apply(top_k_weights.reshape(-1, 1), order, inverse, 1)  # [S, 1]
    # the routing weight scales the expert's input to down_proj (I wide) rather than its output (H wide): the same
    # product by linearity, a quarter of the elementwise work at Qwen3-Next's I = H / 4
    gated = _zero_rows(self._apply_gate(projected) * weights.to(projected.dtype), keep)
    projected = _zero_rows(_grouped_linear(gated, self.down_proj, offsets), keep)  # [S, H]
    if projected.device.type == "cpu":
        # each token's k rows summed into it in place (index_add: deterministic on the CPU, and its backward a
        # gather), without the [S, H] un-permuted copy
        return torch.zeros_like(hidden_states).index_add(0, token_of, projected.to(hidden_states.dtype))
    # CUDA: index_add would accumulate by atomics (order-dependent, in the output's dtype); the un-permutation as a
    # gather, then the sum over each token's k rows in float32 for bf16 (as transformers' grouped_mm)
    weighted = _GatherRows.apply(projected, inverse, order, 1)  # back in (token, slot) order
    return weighted.view(tokens, k, -1).sum(1, dtype=torch.float32).to(hidden_states.dtype)


def register_grouped_mm_gather() -> None:
    """Adds NAME to transformers' experts implementations (what `experts_implementation=` accepts)."""
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_mm_gather_experts_forward)


register_grouped_mm_gather()

__all__ = ["NAME", "grouped_mm_gather_experts_forward", "register_grouped_mm_gather"]
