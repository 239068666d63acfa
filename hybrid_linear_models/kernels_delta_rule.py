"""Pure-PyTorch delta-rule kernels: Gated DeltaNet (one decay per head) and Kimi Delta Attention (one per channel).

Both mixers run the same recurrence on a float32 state S of shape [dk, dv] per value head:

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with g_t a scalar per head (GDN, broadcast over dk) or a vector over dk (KDA).

The chunked form (training and prefill) splits the sequence into chunks of C tokens. Inside a chunk, with G_t the
log-decay accumulated since the chunk start and S0 the state entering it, the updates u solve a unit lower triangular
system (the WY representation of the delta rule):

    (I + diag(beta) A_kk) [U0 | W] = diag(beta) [V | K exp(G)],      u = U0 - W S0

with A_kk[t, j] = sum_d k_t,d k_j,d exp(G_t,d - G_j,d) for j < t. All of this is batched over every chunk at once;
only the passage of the state between chunks is sequential, an affine recurrence with one small matmul per chunk:

    S_next = (diag(exp(G_last)) - K_end^T W) S0 + K_end^T U0,          K_end = K exp(G_last - G)

after which the outputs of all chunks follow in one batch: o = (Q exp(G) - A_qk W) S0 + A_qk U0.

No exponent is ever positive beyond a bounded, checked range, so nothing overflows whatever the decay (see
`_channel_decay_products`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# 32 measured ~10% faster than 64 on CPU (fewer [C, C] passes per token; the state scan has more steps)
DEFAULT_CHUNK_SIZE = 32
# Diagonal blocks of the triangular inverse are solved directly, then merged with matmuls.
_INVERSE_BLOCK = 16
# Largest log-decay range factorised as exp(G_i - r) * exp(r - G_j): exp(80) ~ 5.5e34 is finite in float32.
_FACTOR_RANGE_LIMIT = 80.0
# Diagonal blocks smaller than this are never factorised: they are expanded exactly over channels instead.
_MIN_FACTOR_BLOCK = 8
# Chunks are processed in groups whose [C, C] temporaries hold about this many floats (256 KiB: cache sized).
_GROUP_FLOATS = 1 << 16


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla and transformers' Qwen3-Next define it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _unit_lower_inverse(strict_lower: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(I + N)^-1 for strictly lower triangular N [..., C, C]: diagonal blocks solved directly, then merged block
    row by block row with matmuls (T_i,<i = -T_ii N_i,<i T_<i,<i). Written into `out` when given."""
    C = strict_lower.shape[-1]
    s = math.gcd(C, _INVERSE_BLOCK)
    nb = C // s
    eye = torch.eye(s, dtype=strict_lower.dtype, device=strict_lower.device)
    diag = torch.stack([strict_lower[..., i * s : (i + 1) * s, i * s : (i + 1) * s] + eye for i in range(nb)], dim=-3)
    diag_inv = torch.linalg.solve_triangular(diag, eye.expand_as(diag), upper=False, unitriangular=True)
    inv = torch.empty_like(strict_lower) if out is None else out
    for i in range(nb):
        rows = slice(i * s, (i + 1) * s)
        inv[..., rows, rows] = diag_inv[..., i, :, :]
        inv[..., rows, (i + 1) * s :] = 0.0
        if i:
            torch.matmul(-diag_inv[..., i, :, :], strict_lower[..., rows, : i * s] @ inv[..., : i * s, : i * s],
                         out=inv[..., rows, : i * s])
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
    d_G = (_rowdot(d_a_qk, a_qk) + _rowdot(d_a_kk, a_kk) - _rowdot(d_a_qk, a_qk, dim=-2)
           - _rowdot(d_a_kk, a_kk, dim=-2))
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


class _ChunkDeltaRule(torch.autograd.Function):
    """The chunked recurrence on prepared chunk tensors, with a hand-written backward.

    q, k: [NC, R, Hk, 1, C, dk]; v: [NC, R, Hk, r, C, dv]; g, beta: [NC, R, Hk, r, C] (g may have a trailing dk).
    Returns o [NC, R, Hk, r, C, dv] and the final states [N, Hv, dk, dv].

    Forward, per chunk with entering state S:  V = U0 - W S;  o = Q_g S + A_qk V;  S' = gamma S + K_end^T V.
    Backward mirrors it: the state gradient runs through the chunks in reverse (dS = Q'^T dO + M^T dS',
    Q' = Q_g - A_qk W, M = gamma - K_end^T W), then each chunk's gradients follow in one batch. For the triangular
    solve X = T R with T = (I + diag(beta) A_kk)^-1: dR = T^T dX and d(diag(beta) A_kk) = -(dR X^T) below the diagonal.

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
    def forward(ctx, q, k, v, g, beta, initial_state, layout):
        NC, R, Hk, r, C, dv = v.shape
        dk, M = q.shape[-1], R * Hk * r
        per_channel = g.dim() == 6
        o, entering = torch.empty_like(v), v.new_empty(NC, M, dk, dv)
        inverse, solved = v.new_empty(*v.shape[:-1], C), v.new_empty(*v.shape[:-1], dv + dk)
        query_of_state, transition = v.new_empty(*v.shape[:-1], dk), v.new_empty(NC, M, dk, dk)
        # the per-head decay products are kept for the backward (the per-channel ones are recomputed there)
        kept_products = None if per_channel else v.new_empty(3, *v.shape[:-1], C)  # A_qk, A_kk, decay
        segments = _Segments(layout, initial_state, (M, dk, dv), v)
        finals = [None] * len(segments.last)
        state = None
        for grp in _ChunkDeltaRule._groups(v):
            G = g[grp].cumsum(dim=4)
            decay = _Decays(G, per_channel, dk)
            if per_channel:
                a_qk, a_kk = _channel_decay_products(q[grp], k[grp], G)
            else:
                a_qk, a_kk, _ = _scalar_decay_products(q[grp], k[grp], G, out=kept_products[:, grp])
            beta_col = beta[grp].unsqueeze(-1)
            _unit_lower_inverse(a_kk * beta_col, out=inverse[grp])
            rhs = v.new_empty(*v[grp].shape[:-1], dv + dk)  # beta [V | K exp(G)]
            torch.mul(v[grp], beta_col, out=rhs[..., :dv])
            torch.mul(k[grp], decay.start * beta_col, out=rhs[..., dv:])
            sol = solved[grp]
            torch.matmul(inverse[grp], rhs, out=sol)  # [U0 | W]
            to_state = (k[grp] * decay.end).transpose(-1, -2) @ sol  # [K_end^T U0 | K_end^T W]
            step = transition[grp].view(to_state.shape[:-1] + (dk,))  # diag(gamma) - K_end^T W
            torch.neg(to_state[..., dv:], out=step).diagonal(dim1=-2, dim2=-1).add_(decay.chunk)
            injection = to_state[..., :dv].flatten(1, 3)
            states = []  # kept as separate tensors and stacked once: writing each into a slot costs a copy
            for j, n in enumerate(range(grp.start, grp.stop)):
                if n in segments.first:
                    state = segments.initial(segments.first[n])
                states.append(state)
                state = torch.baddbmm(injection[j], transition[n], state)
                if n in segments.last:
                    finals[segments.last[n]] = state
            torch.stack(states, out=entering[grp])
            intra = a_qk @ sol  # [A_qk U0 | A_qk W]
            torch.mul(q[grp], decay.start, out=query_of_state[grp]).sub_(intra[..., dv:])
            out = o[grp]
            torch.matmul(query_of_state[grp].flatten(1, 3), entering[grp], out=out.view(out.shape[0], M, C, dv))
            out.add_(intra[..., :dv])

        ctx.layout = layout
        ctx.has_initial = initial_state is not None
        ctx.save_for_backward(q, k, v, g, beta, inverse, solved, entering, query_of_state, transition, kept_products)
        return o, segments.gather(finals)

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, inverse, solved, entering, query_of_state, transition, kept_products = ctx.saved_tensors
        layout = ctx.layout
        NC, R, Hk, r, C, dv = v.shape
        dk, M = q.shape[-1], R * Hk * r
        per_channel = g.dim() == 6
        d_out = d_out.contiguous()  # arrives as a permuted view of the caller's layout
        d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_g, d_beta = torch.empty_like(g), torch.empty_like(beta)
        segments = _Segments(layout, d_final, (M, dk, dv), v)
        d_initial = [None] * len(segments.first)
        d_state = None
        for grp in _ChunkDeltaRule._groups(v, reverse=True):
            qg, kg, vg, beta_g, d_o = q[grp], k[grp], v[grp], beta[grp], d_out[grp]
            G = g[grp].cumsum(dim=4)
            decay = _Decays(G, per_channel, dk)
            if per_channel:
                with torch.enable_grad():
                    q_, k_, G_ = (x.detach().requires_grad_() for x in (qg, kg, G))
                    a_qk_graph, a_kk_graph = _channel_decay_products(q_, k_, G_)
                a_qk, a_kk = a_qk_graph.detach(), a_kk_graph.detach()
            else:
                a_qk, a_kk, decay_matrix = kept_products[:, grp].unbind(0)
            sol = solved[grp]
            u_free, w = sol[..., :dv], sol[..., dv:]
            q_start, k_start, k_end = qg * decay.start, kg * decay.start, kg * decay.end

            # state gradients, last chunk first: dS_enter = Q'^T dO + M^T dS_leave
            from_output = (query_of_state[grp].transpose(-1, -2) @ d_o).flatten(1, 3)
            transition_t = transition[grp].transpose(-1, -2)
            d_leaving = [None] * (grp.stop - grp.start)  # gradient of the state leaving each chunk
            for j in range(grp.stop - grp.start - 1, -1, -1):
                n = grp.start + j
                if n in segments.last:
                    d_state = segments.initial(segments.last[n])
                d_leaving[j] = d_state
                d_state = torch.baddbmm(from_output[j], transition_t[j], d_state)
                if n in segments.first:
                    d_initial[segments.first[n]] = d_state
            d_leaving = torch.stack(d_leaving).view(*vg.shape[:4], dk, dv)
            state_t = entering[grp].view(*vg.shape[:4], dk, dv).transpose(-1, -2)

            new_values = u_free - w @ state_t.transpose(-1, -2)  # V
            d_new_values = a_qk.transpose(-1, -2) @ d_o + k_end @ d_leaving
            d_q_start = d_o @ state_t
            d_a_qk = d_o @ new_values.transpose(-1, -2)
            d_k_end = new_values @ d_leaving.transpose(-1, -2)
            d_solved = torch.cat([d_new_values, -(d_new_values @ state_t)], dim=-1)
            d_rhs = inverse[grp].transpose(-1, -2) @ d_solved
            d_lower = (d_rhs @ sol.transpose(-1, -2)).tril_(-1).neg_()  # d(diag(beta) A_kk)
            beta_col = beta_g.unsqueeze(-1)
            d_beta[grp] = (_rowdot(d_lower, a_kk) + _rowdot(d_rhs[..., :dv], vg) + _rowdot(d_rhs[..., dv:], k_start))
            d_a_kk = d_lower.mul_(beta_col)
            d_v[grp] = d_rhs[..., :dv] * beta_col
            d_k_start = d_rhs[..., dv:].mul_(beta_col)

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
            d_q[grp] = d_qg + gram_q
            d_k[grp] = d_kg + gram_k

        d_initial_state = segments.gather(d_initial) if ctx.has_initial else None
        return d_q, d_k, d_v, d_g, d_beta, d_initial_state, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (which lets tests separate rounding from errors)."""
    return torch.promote_types(x.dtype, torch.float32)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32 (or float64) copies, optional L2 norm of q and k, query scale."""
    dtype = compute_dtype(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
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
