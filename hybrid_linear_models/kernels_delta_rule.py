"""Pure-PyTorch delta-rule kernels: Gated DeltaNet (one decay per head) and Kimi Delta Attention (one per channel).

Both mixers run the same recurrence on a float32 state S of shape [dk, dv] per value head:

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with g_t a scalar per head (GDN, broadcast over dk) or a vector over dk (KDA).

The chunked form (training and prefill) splits the sequence into chunks of C tokens. Inside a chunk, with G_t the
log-decay accumulated since the chunk start and S0 the state entering it, the updates u solve a unit lower triangular
system (the WY representation of the delta rule):

    (I + diag(beta) A_kk) [U0 | W] = diag(beta) [V | K exp(G)],      u = U0 - W S0

with A_kk[t, j] = sum_d k_t,d k_j,d exp(G_t,d - G_j,d) for j < t. All of this is batched over every chunk at once;
only the passage of the state between chunks is sequential, two small matmuls per chunk:

    u = U0 - W S0,          S_next = diag(exp(G_last)) S0 + K_end^T u,          K_end = K exp(G_last - G)

after which the outputs of all chunks follow in one batch: o = Q exp(G) S0 + A_qk u.

No exponent is ever positive beyond a bounded, checked range, so nothing overflows whatever the decay (see
`_channel_decay_products`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# 32 measured faster than 16 or 64 on CPU: the state scan's work per token does not depend on C, the [C, C] work
# grows with it, and smaller chunks cost more small operations
DEFAULT_CHUNK_SIZE = 32
# Diagonal blocks of the triangular inverse are solved directly, then merged with matmuls.
_INVERSE_BLOCK = 16
# Largest log-decay range factorised as exp(G_i - r) * exp(r - G_j): exp(80) ~ 5.5e34 is finite in float32.
_FACTOR_RANGE_LIMIT = 80.0
# Diagonal blocks smaller than this are never factorised: they are expanded exactly over channels instead.
_MIN_FACTOR_BLOCK = 8
# Chunks are processed in groups whose [C, C] temporaries hold about this many floats (256 KiB: cache sized).
_GROUP_FLOATS = 1 << 16
# Added to the squared norm of q and k before the L2 normalisation (fla's l2norm default, which its chunked kernels take).
L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla and transformers' Qwen3-Next define it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _unit_lower_inverse(strict_lower: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(I + N)^-1 for strictly lower triangular N [..., C, C]: diagonal blocks solved directly, then merged block
    row by block row with matmuls (T_i,<i = -T_ii N_i,<i T_<i,<i). Written into `out` when given.

    Matmul operands are made contiguous first: batched matmuls of strided blocks run one matrix at a time."""
    C = strict_lower.shape[-1]
    s = math.gcd(C, _INVERSE_BLOCK)
    nb = C // s
    eye = torch.eye(s, dtype=strict_lower.dtype, device=strict_lower.device)
    diag = torch.stack([strict_lower[..., i * s : (i + 1) * s, i * s : (i + 1) * s] for i in range(nb)]).add_(eye)
    diag_inv = torch.linalg.solve_triangular(diag, eye.expand_as(diag), upper=False, unitriangular=True).contiguous()
    inv = torch.empty_like(strict_lower) if out is None else out
    for i in range(nb):
        rows = slice(i * s, (i + 1) * s)
        inv[..., rows, rows] = diag_inv[i]
        inv[..., rows, (i + 1) * s :] = 0.0
        if i:
            known = diag_inv[0] if i == 1 else inv[..., : i * s, : i * s].contiguous()
            below = strict_lower[..., rows, : i * s].contiguous() @ known
            inv[..., rows, : i * s] = (diag_inv[i] @ below).neg_()
    return inv


class ChunkLayout:
    """Maps token tensors [B, T, H, ...] to chunks [NC, R, H, C, ...] and back.

    Without `cu_seqlens` each of the B rows is one sequence (R = B). With `cu_seqlens` (B = 1) every document starts
    its own chunk, so no chunk mixes two documents; the last chunk of each document is padded with zeros, which the
    recurrence treats as a no-op (k = v = 0, beta = 0, g = 0). The chunks then form one row (R = 1) and the state is
    reset at the first chunk of each document. Documents are never padded to the longest one.
    """

    def __init__(self, batch: int, seq_len: int, chunk_size: int, cu_seqlens: torch.Tensor | None, device):
        self.chunk_size = chunk_size
        self.seq_len = seq_len
        if cu_seqlens is None:
            self.rows = batch
            self.num_chunks = max(1, math.ceil(seq_len / chunk_size))
            self.segment_starts = [0]
            self.segment_ends = [self.num_chunks]
            self.gather_index = None
            return
        bounds = cu_seqlens.tolist()
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        chunks_per_doc = [max(1, math.ceil(length / chunk_size)) for length in lengths]
        self.rows = 1
        self.num_chunks = sum(chunks_per_doc)
        self.segment_ends = torch.tensor(chunks_per_doc).cumsum(0).tolist()
        self.segment_starts = [0] + self.segment_ends[:-1]
        # chunk slot -> token index (seq_len is an appended zero row), and token -> chunk slot
        docs = torch.arange(len(lengths), device=device)
        slot_doc = torch.repeat_interleave(docs, torch.tensor(chunks_per_doc, device=device) * chunk_size)
        first_slot = torch.tensor(self.segment_starts, device=device) * chunk_size
        offset = torch.arange(self.num_chunks * chunk_size, device=device) - first_slot[slot_doc]
        start = torch.tensor(bounds[:-1], device=device)
        valid = offset < torch.tensor(lengths, device=device)[slot_doc]
        self.gather_index = torch.where(valid, start[slot_doc] + offset, torch.full_like(offset, seq_len))
        self.scatter_index = torch.nonzero(valid).squeeze(1)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, *rest] -> [NC, R, H, C, *rest], contiguous, zero padded."""
        C, NC = self.chunk_size, self.num_chunks
        if self.gather_index is None:
            pad = NC * C - x.shape[1]
            if pad:
                x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
            x = x.reshape(x.shape[0], NC, C, *x.shape[2:])
        else:
            flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
            x = flat.index_select(0, self.gather_index).reshape(1, NC, C, *x.shape[2:])
        return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()

    def empty_chunks(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped like the chunk tensor `like` ([NC, R, Hk, r, C, *rest]), stored token by
        token when no documents are packed: gradients going back through `to_chunks` then need no copy."""
        if self.gather_index is not None:
            return torch.empty_like(like)
        NC, R, Hk, r, C, *rest = like.shape
        return like.new_empty(R, NC, C, Hk, r, *rest).permute(1, 0, 3, 4, 2, *range(5, like.dim()))

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[NC, R, H, C, *rest] -> [B, T, H, *rest]."""
        x = x.permute(1, 0, 3, 2, *range(4, x.dim()))
        x = x.reshape(x.shape[0], -1, *x.shape[3:])
        if self.gather_index is None:
            return x[:, : self.seq_len]
        return x[0].index_select(0, self.scatter_index).unsqueeze(0)


def _scalar_decay_products(q, k, G, out: torch.Tensor | None = None):
    """A_qk[i, j] (j <= i) and A_kk[i, j] (j < i) for one decay per head, and the decay matrix exp(G_i - G_j).
    G is [..., C]; q and k are [..., C, dk] at key-head level, broadcast against the value heads of G. With `out`
    ([3, ..., C, C]) the three are written there."""
    C = G.shape[-1]
    a_qk, a_kk, decay = out.unbind(0) if out is not None else (None, None, None)
    upper = torch.ones(C, C, dtype=torch.bool, device=G.device).triu(1)
    decay = torch.sub(G.unsqueeze(-1), G.unsqueeze(-2), out=decay).masked_fill_(upper, float("-inf")).exp_()
    qk_kk = torch.cat([q, k], dim=-2) @ k.transpose(-1, -2)  # shared by the value heads of a key head
    a_qk = torch.mul(qk_kk[..., :C, :], decay, out=a_qk)
    a_kk = torch.mul(qk_kk[..., C:, :], decay, out=a_kk).tril_(-1)
    return a_qk, a_kk, decay


def _diagonal_block_size(G: torch.Tensor) -> tuple[int, bool]:
    """Largest block size (dividing C, >= _MIN_FACTOR_BLOCK) whose log-decay range fits the factorisation, and
    whether it does fit (else the smallest size is expanded exactly)."""
    C = G.shape[-2]
    size = C
    while True:
        blocks = G.unflatten(-2, (C // size, size))
        if (blocks[..., 0, :] - blocks[..., -1, :]).max().item() <= _FACTOR_RANGE_LIMIT:
            return size, True
        if size // 2 < _MIN_FACTOR_BLOCK or size % 2:
            return size, False
        size //= 2


def _channel_decay_products(q, k, G):
    """A_qk[i, j] = sum_d q_i,d k_j,d exp(G_i,d - G_j,d) for j <= i, and A_kk the same with k_i for j < i.

    q, k: [..., C, d] (broadcastable against G), G: [..., C, d], non-increasing along C. The C x C products are
    split into diagonal blocks, factorised through the block's first position when its decay range allows it (else
    expanded exactly over channels), and off-diagonal rows, factorised through the position just before the row block
    (both factors then have exponents <= 0).
    """
    C = G.shape[-2]
    s, factorise = _diagonal_block_size(G)
    nb = C // s
    dev = G.device
    blocks = lambda x: x.unflatten(-2, (nb, s))  # noqa: E731  [..., nb, s, d]
    qb, kb, Gb = blocks(q), blocks(k), blocks(G)
    rows = torch.cat([qb, kb], dim=-2)  # [..., nb, 2s, d]
    lower_incl = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    if factorise:
        first = Gb[..., :1, :]
        rows_scaled = rows * torch.cat([Gb - first] * 2, dim=-2).exp()
        diag = rows_scaled @ (kb * (first - Gb).exp()).transpose(-1, -2)  # [..., nb, 2s, s]
        diag = diag.masked_fill(~torch.cat([lower_incl, lower_incl], dim=0), 0.0)
    else:
        rel = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~lower_incl[:, :, None], float("-inf"))
        diag = torch.einsum("...id,...ijd->...ij", rows, torch.cat([kb.unsqueeze(-3) * rel.exp()] * 2, dim=-3))
    diag_qk, diag_kk = diag[..., :s, :], diag[..., s:, :].tril(-1)
    eye_blocks = torch.eye(nb, dtype=G.dtype, device=dev)[:, None, :, None]  # (I, i, J, j)

    def embed_diagonal(d):
        return (d.unsqueeze(-2) * eye_blocks).reshape(*d.shape[:-3], C, C)

    if nb == 1:
        return embed_diagonal(diag_qk), embed_diagonal(diag_kk)

    ref = G[..., s - 1 : C - 1 : s, :]  # [..., nb-1, d]: G just before row blocks 1..nb-1
    row_scale = (Gb[..., 1:, :, :] - ref.unsqueeze(-2)).exp()  # [..., nb-1, s, d]
    col_scale = (ref.unsqueeze(-2) - G.unsqueeze(-3)).clamp(max=0).exp()  # [..., nb-1, C, d]
    off = (rows[..., 1:, :, :] * torch.cat([row_scale] * 2, dim=-2)) @ (k.unsqueeze(-3) * col_scale).transpose(-1, -2)
    before_block = torch.arange(C, device=dev) < (torch.arange(1, nb, device=dev)[:, None, None] * s)
    off = off.masked_fill(~before_block, 0.0)  # [..., nb-1, 2s, C]

    def assemble(off_rows, d):
        zero_block = off_rows.new_zeros(*off_rows.shape[:-3], 1, s, C)
        full = torch.cat([zero_block, off_rows], dim=-3).reshape(*off_rows.shape[:-3], C, C)
        return full + embed_diagonal(d)

    return assemble(off[..., :s, :], diag_qk), assemble(off[..., s:, :], diag_kk)


class _Decays:
    """Decay factors of a group of chunks from the accumulated log-decay G ([..., C] or [..., C, dk]), shaped to
    multiply [..., C, dk] rows: from the chunk start to each token, from each token to the chunk end, and over the
    whole chunk ([..., dk])."""

    def __init__(self, G: torch.Tensor, per_channel: bool, dk: int):
        if per_channel:
            self.start, self.end, self.chunk = G.exp(), (G[..., -1:, :] - G).exp(), G[..., -1, :].exp()
        else:
            self.start = G.exp().unsqueeze(-1)
            self.end = (G[..., -1:] - G).exp().unsqueeze(-1)
            self.chunk = G[..., -1:].exp().expand(*G.shape[:-1], dk)


def _rowdot(x: torch.Tensor, y: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """sum(x * y) over `dim`, without materialising the product."""
    return torch.linalg.vecdot(x, y, dim=dim)


def _scalar_decay_products_backward(q, k, decay, a_qk, a_kk, d_a_qk, d_a_kk):
    """Gradients of `_scalar_decay_products` (q, k at key-head level, value heads on dim 3): dq, dk, dG."""
    p_qk = _rowdot(d_a_qk, decay, dim=3).unsqueeze(3)  # summed over the value heads of each key head
    p_kk = _rowdot(d_a_kk, decay, dim=3).unsqueeze(3)
    d_q = p_qk @ k
    d_k = p_qk.transpose(-1, -2) @ q + (p_kk + p_kk.transpose(-1, -2)) @ k
    # each entry carries exp(G_i - G_j): its weight goes to G_i and comes off G_j
    weight = torch.mul(d_a_qk, a_qk).addcmul_(d_a_kk, a_kk)
    d_G = weight.sum(-1) - weight.sum(-2)
    return d_q, d_k, d_G


class _Segments:
    """Where the sequences start and end among the chunks, and the value each starts from."""

    def __init__(self, layout: ChunkLayout, per_segment: torch.Tensor | None, size: int, like: torch.Tensor):
        self.first = dict(zip(layout.segment_starts, range(len(layout.segment_starts))))
        self.last = {end - 1: i for i, end in enumerate(layout.segment_ends)}
        self.layout, self.per_segment, self.size, self.like = layout, per_segment, size, like

    def initial(self, segment: int) -> torch.Tensor:
        M, dk, dv = self.size
        if self.per_segment is None:
            return self.like.new_zeros(M, dk, dv)
        if self.layout.gather_index is None:
            return self.per_segment.reshape(M, dk, dv)
        return self.per_segment[segment]

    def gather(self, values: list[torch.Tensor]) -> torch.Tensor:
        M, dk, dv = self.size
        return torch.cat([x.view(-1, M // self.layout.rows, dk, dv) for x in values])


def _forward_scan(w: torch.Tensor, k_end: torch.Tensor, gamma: torch.Tensor, state: torch.Tensor | None, grp: slice,
                  segments: _Segments, finals: list, entering: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
    """The states entering the chunks of a group and their new values, chunk by chunk: V = U0 - W S and
    S' = gamma S + K_end^T V.

    w [n, M, C, dk], k_end [n, M, C, dk], gamma [n, M, dk or 1, 1]; new_values[grp] ([NC, M, C, dv]) holds U0 and is
    made V in place. Each state is computed in its slot of entering ([NC, M, dk, dv]). Returns the state leaving the
    group."""
    per_chunk = zip(w.unbind(), k_end.transpose(-1, -2).unbind(), gamma.unbind(), new_values[grp].unbind())
    for n, (w_n, k_end_t, decay, values) in zip(range(grp.start, grp.stop), per_chunk):
        if n in segments.first:
            state = entering[n].copy_(segments.initial(segments.first[n]))
        values.baddbmm_(w_n, state, alpha=-1)
        last = n in segments.last  # the state leaving a sequence is its final state, not the next chunk's
        state = torch.mul(state, decay, out=None if last else entering[n + 1]).baddbmm_(k_end_t, values)
        if last:
            finals[segments.last[n]] = state
    return state


def _backward_scan(from_state: torch.Tensor, w: torch.Tensor, k_end: torch.Tensor, gamma: torch.Tensor,
                   d_state: torch.Tensor | None, grp: slice, segments: _Segments, d_initial: list,
                   d_values: torch.Tensor, d_leaving: torch.Tensor) -> torch.Tensor:
    """The forward scan's gradients, last chunk first: dV = A_qk^T dO + K_end dS', dS = gamma dS' + Q_g^T dO - W^T dV.

    from_state [n, M, dk, dv] is Q_g^T dO; d_values ([n, M, C, dv]) holds A_qk^T dO and is made dV in place. The
    gradients of the states leaving the chunks are computed in their slots of d_leaving ([n, M, dk, dv]). Returns the
    gradient of the state entering the group."""
    per_chunk = list(zip(from_state.unbind(), w.transpose(-1, -2).unbind(), k_end.unbind(), gamma.unbind(),
                         d_values.unbind()))
    slots = d_leaving.unbind()
    for j in range(len(per_chunk) - 1, -1, -1):
        d_s_out, w_t, k_end_n, decay, d_v = per_chunk[j]
        n = grp.start + j
        if n in segments.last:
            d_state = segments.initial(segments.last[n])
        if n in segments.last or j == len(per_chunk) - 1:
            d_state = slots[j].copy_(d_state)
        d_v.baddbmm_(k_end_n, d_state)
        first = n in segments.first  # the gradient entering a sequence is its initial state's, not a chunk's
        d_state = torch.addcmul(d_s_out, d_state, decay, out=None if first or j == 0 else slots[j - 1])
        d_state.baddbmm_(w_t, d_v, alpha=-1)
        if first:
            d_initial[segments.first[n]] = d_state
    return d_state


class _ChunkDeltaRule(torch.autograd.Function):
    """The chunked recurrence on prepared chunk tensors, with a hand-written backward.

    q, k: [NC, R, Hk, 1, C, dk]; v: [NC, R, Hk, r, C, dv]; g, beta: [NC, R, Hk, r, C] (g may have a trailing dk).
    Returns o [NC, R, Hk, r, C, dv] and the final states [N, Hv, dk, dv].

    Forward, per chunk with entering state S:  V = U0 - W S;  S' = gamma S + K_end^T V;  o = Q_g S + A_qk V.
    Backward mirrors it: the state gradient runs through the chunks in reverse (dV = A_qk^T dO + K_end dS',
    dS = gamma dS' + Q_g^T dO - W^T dV), then each chunk's gradients follow in one batch. The triangular solve is
    differentiated as V = T diag(beta) (V_in - K_start S) with T = (I + diag(beta) A_kk)^-1, so U0 and W need no
    gradients of their own: with dR = T^T dV, d(diag(beta) A_kk) = -(dR V^T) below the diagonal.

    Chunks are processed in groups small enough for their [C, C] temporaries to stay in cache, the state carried from
    group to group.
    """

    @staticmethod
    def _groups(v: torch.Tensor, reverse: bool = False) -> list[slice]:
        NC, R, Hk, r, C = v.shape[:5]
        step = max(1, _GROUP_FLOATS // (R * Hk * r * C * C))
        groups = [slice(n, min(NC, n + step)) for n in range(0, NC, step)]
        return groups[::-1] if reverse else groups

    @staticmethod
    def _gamma(decay: _Decays, per_channel: bool, M: int) -> torch.Tensor:
        """The chunk decay shaped to scale states [n, M, dk, dv]: [n, M, dk, 1], or [n, M, 1, 1] per head."""
        gamma = decay.chunk if per_channel else decay.chunk[..., :1]
        return gamma.reshape(gamma.shape[0], M, -1, 1)

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, layout):
        NC, R, Hk, r, C, dv = v.shape
        dk, M = q.shape[-1], R * Hk * r
        per_channel = g.dim() == 6
        o, new_values, entering = torch.empty_like(v), torch.empty_like(v), v.new_empty(NC, M, dk, dv)
        inverse, w = v.new_empty(*v.shape[:-1], C), v.new_empty(*v.shape[:-1], dk)
        # the per-head decay products are kept for the backward (the per-channel ones are recomputed there)
        kept_products = None if per_channel else v.new_empty(3, *v.shape[:-1], C)  # A_qk, A_kk, decay
        segments = _Segments(layout, initial_state, (M, dk, dv), v)
        finals = [None] * len(segments.last)
        state = None
        for grp in _ChunkDeltaRule._groups(v):
            n = grp.stop - grp.start
            G = g[grp].cumsum(dim=4)
            decay = _Decays(G, per_channel, dk)
            if per_channel:
                a_qk, a_kk = _channel_decay_products(q[grp], k[grp], G)
            else:
                a_qk, a_kk, _ = _scalar_decay_products(q[grp], k[grp], G, out=kept_products[:, grp])
            beta_col = beta[grp].unsqueeze(-1)
            inv = _unit_lower_inverse(a_kk * beta_col, out=inverse[grp])
            torch.matmul(inv, v[grp] * beta_col, out=new_values[grp])  # U0, made V by the scan
            torch.matmul(inv, k[grp] * (decay.start * beta_col), out=w[grp])
            k_end = k[grp] * decay.end
            gamma = _ChunkDeltaRule._gamma(decay, per_channel, M)
            state = _forward_scan(w[grp].flatten(1, 3), k_end.flatten(1, 3), gamma, state, grp, segments, finals,
                                  entering, new_values.view(NC, M, C, dv))
            out = o[grp]
            torch.matmul(a_qk, new_values[grp], out=out)
            q_start = (q[grp] * decay.start).view(n * M, C, dk)
            out.view(n * M, C, dv).baddbmm_(q_start, entering[grp].view(n * M, dk, dv))

        ctx.layout = layout
        ctx.has_initial = initial_state is not None
        ctx.save_for_backward(q, k, v, g, beta, inverse, w, entering, new_values, kept_products)
        return o, segments.gather(finals)

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, inverse, w, entering, new_values, kept_products = ctx.saved_tensors
        layout = ctx.layout
        NC, R, Hk, r, C, dv = v.shape
        dk, M = q.shape[-1], R * Hk * r
        per_channel = g.dim() == 6
        d_q, d_k, d_v, d_g, d_beta = (layout.empty_chunks(x) for x in (q, k, v, g, beta))
        segments = _Segments(layout, d_final, (M, dk, dv), v)
        d_initial = [None] * len(segments.first)
        d_state = None
        for grp in _ChunkDeltaRule._groups(v, reverse=True):
            qg, kg, vg, beta_g = q[grp], k[grp], v[grp], beta[grp]
            d_o = d_out[grp].contiguous()  # d_out arrives as a permuted view of the caller's layout
            G = g[grp].cumsum(dim=4)
            decay = _Decays(G, per_channel, dk)
            if per_channel:
                with torch.enable_grad():
                    q_, k_, G_ = (x.detach().requires_grad_() for x in (qg, kg, G))
                    a_qk_graph, a_kk_graph = _channel_decay_products(q_, k_, G_)
                a_qk, a_kk = a_qk_graph.detach(), a_kk_graph.detach()
            else:
                a_qk, a_kk, decay_matrix = kept_products[:, grp].unbind(0)
            values = new_values[grp]
            q_start, k_start, k_end = qg * decay.start, kg * decay.start, kg * decay.end

            d_new_values = a_qk.transpose(-1, -2) @ d_o  # completed by the scan
            d_leaving = vg.new_empty(*vg.shape[:4], dk, dv)
            d_state = _backward_scan(
                (q_start.transpose(-1, -2) @ d_o).flatten(1, 3), w[grp].flatten(1, 3), k_end.flatten(1, 3),
                _ChunkDeltaRule._gamma(decay, per_channel, M), d_state, grp, segments, d_initial,
                d_new_values.flatten(1, 3), d_leaving.flatten(1, 3))
            state_t = entering[grp].view(*vg.shape[:4], dk, dv).transpose(-1, -2)

            d_q_start = d_o @ state_t
            d_a_qk = d_o @ values.transpose(-1, -2)
            d_k_end = values @ d_leaving.transpose(-1, -2)
            # V = T diag(beta) (V_in - K_start S): with d_rhs = T^T dV, d(diag(beta) A_kk) = -(d_rhs V^T) below the
            # diagonal, d(beta V_in) = d_rhs and d(beta K_start) = -d_rhs S^T
            d_rhs = inverse[grp].transpose(-1, -2) @ d_new_values
            d_lower = (d_rhs @ values.transpose(-1, -2)).tril_(-1)  # -d(diag(beta) A_kk)
            d_rhs_k = d_rhs @ state_t  # -d(beta K_start)
            beta_col = beta_g.unsqueeze(-1)
            d_beta[grp] = _rowdot(d_rhs, vg) - _rowdot(d_lower, a_kk) - _rowdot(d_rhs_k, k_start)
            d_a_kk = d_lower.mul_(-beta_col)
            torch.mul(d_rhs, beta_col, out=d_v[grp])
            d_k_start = d_rhs_k.mul_(-beta_col)

            # every decay factor is exp(G_i - G_j) or exp(G_i): dG_i = sum over its channels of x_i * dx_i
            # (per channel for KDA, summed over the channels for GDN)
            from_state = _rowdot(d_leaving, state_t.transpose(-1, -2)) * decay.chunk  # d(gamma) gamma, [.., dk]
            if per_channel:
                d_k_end_part = d_k_end * k_end
                d_G = d_q_start * q_start + d_k_start * k_start - d_k_end_part
                d_G_last = d_k_end_part.sum(-2) + from_state
                gram_q, gram_k, gram_G = torch.autograd.grad((a_qk_graph, a_kk_graph), (q_, k_, G_), (d_a_qk, d_a_kk))
            else:
                d_k_end_part = _rowdot(d_k_end, k_end)
                d_G = _rowdot(d_q_start, q_start) + _rowdot(d_k_start, k_start) - d_k_end_part
                d_G_last = d_k_end_part.sum(-1) + from_state.sum(-1)
                gram_q, gram_k, gram_G = _scalar_decay_products_backward(qg, kg, decay_matrix, a_qk, a_kk,
                                                                         d_a_qk, d_a_kk)
            d_qg = (d_q_start * decay.start).sum(3, keepdim=True)
            d_kg = (d_k_start * decay.start + d_k_end * decay.end).sum(3, keepdim=True)
            d_G += gram_G
            d_G.narrow(4, C - 1, 1).add_(d_G_last.unsqueeze(4))  # the last position carries the chunk decay
            d_g[grp] = d_G.flip(4).cumsum(4).flip(4)
            torch.add(d_qg, gram_q, out=d_q[grp])
            torch.add(d_kg, gram_k, out=d_k[grp])

        d_initial_state = segments.gather(d_initial) if ctx.has_initial else None
        return d_q, d_k, d_v, d_g, d_beta, d_initial_state, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (which lets tests separate rounding from errors)."""
    return torch.promote_types(x.dtype, torch.float32)


class _ScaledL2Norm(torch.autograd.Function):
    """scale * l2_normalize(x) in one pass, with a two-pass backward: dx = scale r dy - scale r^3 x (x . dy), where
    r = (|x|^2 + eps)^-1/2 (autograd through the plain expression takes about four times as many passes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        inv_norm = torch.rsqrt(_rowdot(x, x).unsqueeze(-1) + L2_NORM_EPS)
        ctx.save_for_backward(x, inv_norm)
        ctx.scale = scale
        return x * (inv_norm * scale)

    @staticmethod
    def backward(ctx, d_y):
        x, inv_norm = ctx.saved_tensors
        scaled = inv_norm * ctx.scale
        along_x = scaled * inv_norm.square() * _rowdot(x, d_y).unsqueeze(-1)
        return torch.mul(d_y, scaled).addcmul_(x, along_x, value=-1), None


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32 (or float64) copies, optional L2 norm of q and k, query scale."""
    dtype = compute_dtype(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        return _ScaledL2Norm.apply(q, scale), _ScaledL2Norm.apply(k, 1.0), v, g, beta
    return q * scale, k, v, g, beta


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked delta rule. q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g: [B, T, Hv] (per-head decay) or
    [B, T, Hv, dk] (per-channel decay); beta: [B, T, Hv]. Inputs are assumed validated (`hybrid_linear_models.ops`)."""
    out_dtype = v.dtype
    batch, seq_len, key_heads = q.shape[:3]
    groups = v.shape[2] // key_heads
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    layout = ChunkLayout(batch, seq_len, chunk_size, cu_seqlens, q.device)
    # [NC, R, Hk, 1, C, dk] for key-head tensors, [NC, R, Hk, groups, C, ...] for value-head tensors
    q, k = (layout.to_chunks(x).unsqueeze(3) for x in (q, k))
    v, g, beta = (layout.to_chunks(x).unflatten(2, (key_heads, groups)) for x in (v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(v.dtype)
    o, final_state = _ChunkDeltaRule.apply(q, k, v, g, beta, initial_state, layout)
    o = layout.from_chunks(o.flatten(2, 3)).to(out_dtype)
    return o, (final_state if output_final_state else None)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token delta rule for decoding (a few tokens per sequence, no packing)."""
    out_dtype = v.dtype
    per_channel = g.dim() == 4
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    state = initial_state.to(q.dtype) if initial_state is not None else q.new_zeros(batch, heads, dk, dv)
    decay = g.exp().unsqueeze(-1)  # rows of the state: [B, T, H, dk, 1] or [B, T, H, 1, 1]
    if not per_channel:
        decay = decay.unsqueeze(-1)
    outputs = []
    for t in range(seq_len):
        state = state * decay[:, t]
        k_t = k[:, t].unsqueeze(-2)  # [B, H, 1, dk]
        u = (v[:, t] - (k_t @ state).squeeze(-2)) * beta[:, t].unsqueeze(-1)
        state = state + k_t.transpose(-1, -2) @ u.unsqueeze(-2)
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    o = torch.stack(outputs, dim=1).to(out_dtype)
    return o, (state if output_final_state else None)
