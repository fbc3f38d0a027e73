"""The gated delta rule (the linear attention of Qwen3-Next and Qwen3.5) and the depthwise
causal convolution in front of it.

Layouts: q, k [B, S, H, Dk], v [B, S, H, Dv], g (log decay, <= 0) and beta [B, S, H]; the
recurrent state is [B, H, Dk, Dv] as transformers keeps it. Per head and position t, with
q_t, k_t L2-normalised (``use_qk_l2norm``) and q_t scaled by ``scale`` (1/sqrt(Dk) by default):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

Three implementations, selected per device type in llmflow.kernels.dispatch:

- ``reference_gated_delta_rule``: transformers' ``torch_chunk_gated_delta_rule`` (chunks of
  64, a triangular solve per chunk, a Python loop over chunks), ported, differentiated by
  autograd, which keeps every intermediate of every chunk. Packed documents run as one call
  per document.
- ``torch_gated_delta_rule`` (CPU, NPU, and CUDA without ``fla``): the same chunked forward as
  an autograd function with a hand-written backward (``_ChunkGatedDelta``). Forward and
  backward work on segments of ``SEGMENT_CHUNKS`` chunks, so their temporaries are bounded by
  a segment; for backward it keeps its inputs (as given, in their dtype) and the state
  entering every chunk (fp32, B x H x ceil(S/64) x Dk x Dv) and recomputes everything else
  a segment at a time. Packed documents are laid out with each document padded on the right
  to a multiple of 64 positions (g = 0, beta = 0, q = k = v = 0, so padding changes neither a
  real position nor the state) and the state is set to zero at the chunk where a document
  starts, which equals separate calls per document. Up to ``RECURRENT_MAX_LEN`` positions
  (decoding) it runs the per-token recurrence instead, differentiated by autograd.
  All arithmetic is fp32 whatever the input dtype; the output has the input dtype.
- CUDA with ``fla`` (flash-linear-attention) importable and bf16/fp16 input:
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, its Triton kernels (fp32
  accumulation), packed documents through ``cu_seqlens`` with the rows flattened into one.
  fp32 input on CUDA takes the torch path (some fla releases refuse fp32).
  torch_npu documents no gated delta rule operator, so the NPU runs the torch path.

``causal_conv1d``: x [B, S, D] (channels last, as the projection produces it), weight [D, K]
(the checkpoint's ``conv1d.weight`` [D, 1, K] squeezed), state [B, D, K-1] (the K-1 inputs
before x, transformers' conv-state layout). Computed in the weight's dtype and returned in
x's, as transformers does.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

CHUNK = 64
"""Positions per chunk of the chunked form (transformers' and fla's default)."""
SEGMENT_CHUNKS = 4
"""Chunks whose intra-chunk quantities the torch path computes at once (bounds its temporaries)."""
RECURRENT_MAX_LEN = 16
"""Sequences up to this length (decoding steps) run the per-token recurrence on the torch path."""
L2NORM_EPS = 1e-6
"""transformers' and fla's eps of the in-kernel q/k L2 norm: x / sqrt(sum(x^2) + eps)."""


# ----------------------------------------------------------------------------- documents


def _boundaries(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool, True where a document starts after position 0."""
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def _document_starts(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``_boundaries``, or None when no row has a boundary (one document per row)."""
    if document_ids is None or document_ids.shape[1] < 2:
        return None
    starts = _boundaries(document_ids)
    return starts if bool(starts.any()) else None


def _document_spans(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) positions of its documents in order."""
    spans = []
    for row in document_ids.tolist():
        bounds = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]
        spans.append(list(itertools.pairwise(bounds)))
    return spans


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


# ----------------------------------------------------------------------------- reference


def _chunk_reference(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """transformers' ``torch_chunk_gated_delta_rule`` for one sequence per row, fp32;
    (output [B, S, H, Dv] fp32, final state [B, H, Dk, Dv] fp32)."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    g = g.cumsum(dim=-1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    if initial_state is None:
        state = q.new_zeros(batch, heads, dk, dv)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(u)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).contiguous(), state


def reference_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' chunked formula, through autograd; one call per packed document (the
    first document of a row starts from the row's ``initial_state``, the row's final state is
    its last document's)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _document_starts(document_ids) is None:
        out, state = _chunk_reference(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
        return out.to(q.dtype), state if output_final_state else None
    rows, states = [], []
    for b, spans in enumerate(_document_spans(document_ids)):
        pieces = []
        for i, (start, end) in enumerate(spans):
            first = initial_state[b:b + 1] if initial_state is not None and i == 0 else None
            piece, state = _chunk_reference(*(x[b:b + 1, start:end] for x in (q, k, v, g, beta)), scale, first,
                                            use_qk_l2norm)
            pieces.append(piece)
        rows.append(torch.cat(pieces, dim=1))
        states.append(state)
    return torch.cat(rows).to(q.dtype), torch.cat(states) if output_final_state else None


# ----------------------------------------------------------------------------- torch path: recurrence


def _recurrent(q, k, v, g, beta, scale, initial_state, starts, use_qk_l2norm):
    """The per-token recurrence (transformers' ``torch_recurrent_gated_delta_rule``), fp32,
    with the state zeroed where ``starts`` [B, S] marks a new document."""
    batch, length, heads, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    keep = None if starts is None else (~starts).float()
    outs = []
    for t in range(length):
        if keep is not None:
            state = state * keep[:, t, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        delta = (v[:, t] - (state * k_t.unsqueeze(-1)).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=1), state


# ----------------------------------------------------------------------------- torch path: chunked


def _segment(x: torch.Tensor, start: int, end: int, chunks: int) -> torch.Tensor:
    """Positions [start, end) of x [B, S, H(, D)] as fp32 [chunks, B*H, CHUNK(, D)] (chunk-major,
    so that one chunk of every row and head is contiguous), zero-padded at the end."""
    part = x[:, start:end].float()
    pad = chunks * CHUNK - (end - start)
    batch, heads = x.shape[0], x.shape[2]
    if x.dim() == 4:
        part = F.pad(part, (0, 0, 0, 0, 0, pad)).view(batch, chunks, CHUNK, heads, -1)
        return part.permute(1, 0, 3, 2, 4).reshape(chunks, batch * heads, CHUNK, x.shape[-1])
    part = F.pad(part, (0, 0, 0, pad)).view(batch, chunks, CHUNK, heads)
    return part.permute(1, 0, 3, 2).reshape(chunks, batch * heads, CHUNK)


def _unsegment(x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[chunks, B*H, CHUNK(, D)] -> [B, length, H(, D)] (the inverse of ``_segment``), a view."""
    chunks, bh = x.shape[:2]
    if x.dim() == 4:
        x = x.view(chunks, batch, bh // batch, CHUNK, x.shape[-1]).permute(1, 0, 3, 2, 4)
        return x.flatten(1, 2)[:, :length]
    return x.view(chunks, batch, bh // batch, CHUNK).permute(1, 0, 3, 2).flatten(1, 2)[:, :length]


@functools.cache
def _masks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(strictly upper, strictly lower) [CHUNK, CHUNK] bool masks and the fp32 identity."""
    ones = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device)
    return ones.triu(1), ones.tril(-1), torch.eye(CHUNK, device=device)


class _Intra:
    """The intra-chunk quantities of a segment (shapes [n, BH, C, ...]); the chunk recurrence
    is S' = lam S + kd^T (u - w S), o = qd S + attn (u - w S), where [u w] = T [v*beta x],
    T = (I + strictly_lower(system))^-1."""

    def __init__(self, q, k, v, g, beta, scale, use_qk_l2norm):
        upper, _, eye = _masks(q.device)
        if use_qk_l2norm:
            self.q_rstd = torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
            self.k_rstd = torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
            q, k = q * self.q_rstd, k * self.k_rstd
        self.qn, self.kn = q, k  # the normalised q and k (q before the scale)
        self.v, self.beta = v, beta
        gc = g.cumsum(-1)
        self.gamma = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
        self.egc = gc.exp().unsqueeze(-1)
        self.tail = (gc[..., -1:] - gc).exp_().unsqueeze(-1)
        self.lam = gc[..., -1].exp()
        self.qs = q * scale
        self.kb = k * beta.unsqueeze(-1)
        self.kk = self.kb @ k.transpose(-1, -2)
        self.system = self.kk * self.gamma
        self.t = torch.linalg.solve_triangular(self.system, eye, upper=False, unitriangular=True)
        self.x = self.kb * self.egc
        self.u = self.t @ (v * beta.unsqueeze(-1))
        self.w = self.t @ self.x
        self.scores = self.qs @ k.transpose(-1, -2)
        self.attn = self.scores * self.gamma
        self.qd = self.qs * self.egc
        self.kd = k * self.tail


class _ChunkGatedDelta(torch.autograd.Function):
    """The chunked gated delta rule over rows of whole sequences, ``keep`` [chunks, B*H] (or
    None) zeroing the state entering a chunk where a packed document starts.

    Saves its inputs as given and the fp32 state entering every chunk; backward recomputes
    the intra-chunk quantities a segment at a time and runs the chunk recurrence backwards:
        dvn = attn^T dO + kd dS',  dS = qd^T dO + lam dS' - w^T dvn
    then differentiates the intra-chunk quantities (through T^T for the triangular system)
    down to q, k, v, g, beta and the initial state."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, keep, scale, use_qk_l2norm):
        batch, length, heads, dk = k.shape
        dv = v.shape[-1]
        chunks = -(-length // CHUNK)
        bh = batch * heads
        resets = set() if keep is None else set((keep == 0).any(1).nonzero().flatten().tolist())
        state = (q.new_zeros(bh, dk, dv, dtype=torch.float32) if initial_state is None
                 else initial_state.reshape(bh, dk, dv).float().clone())
        states = q.new_empty(chunks, bh, dk, dv, dtype=torch.float32)
        out = q.new_empty(batch, length, heads, dv)
        for c0 in range(0, chunks, SEGMENT_CHUNKS):
            n = min(SEGMENT_CHUNKS, chunks - c0)
            start, end = c0 * CHUNK, min((c0 + n) * CHUNK, length)
            it = _Intra(*(_segment(x, start, end, n) for x in (q, k, v, g, beta)), scale, use_qk_l2norm)
            vn = torch.empty_like(it.u)
            kd_t = it.kd.transpose(-1, -2)
            for j in range(n):
                if c0 + j in resets:
                    state = state * keep[c0 + j, :, None, None]
                states[c0 + j] = state
                torch.baddbmm(it.u[j], it.w[j], state, alpha=-1, out=vn[j])
                state = torch.baddbmm(state * it.lam[j, :, None, None], kd_t[j], vn[j])
            o = torch.baddbmm(it.attn.flatten(0, 1) @ vn.flatten(0, 1), it.qd.flatten(0, 1),
                              states[c0:c0 + n].flatten(0, 1))
            out[:, start:end] = _unsegment(o.view(n, bh, CHUNK, dv), batch, end - start)
        ctx.save_for_backward(q, k, v, g, beta, states, keep)
        ctx.scale, ctx.use_qk_l2norm, ctx.resets = scale, use_qk_l2norm, resets
        ctx.has_initial_state = initial_state is not None
        ctx.set_materialize_grads(False)
        return out, state.reshape(batch, heads, dk, dv)

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        q, k, v, g, beta, states, keep = ctx.saved_tensors
        batch, length, heads, dk = k.shape
        dv = v.shape[-1]
        chunks, bh = states.shape[:2]
        d_state = (q.new_zeros(bh, dk, dv, dtype=torch.float32) if grad_state is None
                   else grad_state.reshape(bh, dk, dv).float())
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        for c0 in reversed(range(0, chunks, SEGMENT_CHUNKS)):
            n = min(SEGMENT_CHUNKS, chunks - c0)
            start, end = c0 * CHUNK, min((c0 + n) * CHUNK, length)
            it = _Intra(*(_segment(x, start, end, n) for x in (q, k, v, g, beta)), ctx.scale, ctx.use_qk_l2norm)
            s_in = states[c0:c0 + n]
            vn = it.u - it.w @ s_in
            if grad_out is None:
                d_o = vn.new_zeros(n, bh, CHUNK, dv)
            else:
                d_o = _segment(grad_out, start, end, n)
            # The chunk recurrence backwards: d_vn and the gradient of each chunk's leaving state.
            attn_do = it.attn.transpose(-1, -2) @ d_o
            qd_do = it.qd.transpose(-1, -2) @ d_o
            w_t = it.w.transpose(-1, -2)
            d_vn = torch.empty_like(vn)
            d_s_out = torch.empty_like(s_in)
            for j in reversed(range(n)):
                d_s_out[j] = d_state
                torch.baddbmm(attn_do[j], it.kd[j], d_state, out=d_vn[j])
                d_state = torch.baddbmm(qd_do[j].add_(d_state * it.lam[j, :, None, None]), w_t[j], d_vn[j], alpha=-1)
                if c0 + j in ctx.resets:
                    d_state = d_state * keep[c0 + j, :, None, None]
            _intra_backward(it, s_in, vn, d_o, d_vn, d_s_out, ctx.scale, ctx.use_qk_l2norm, grads, batch, start, end)
        d_initial = d_state.reshape(batch, heads, dk, dv) if ctx.has_initial_state else None
        return (*grads, d_initial, None, None, None)


def _intra_backward(it, s_in, vn, d_o, d_vn, d_s_out, scale, use_qk_l2norm, grads, batch, start, end):
    """Gradients of one segment's q, k, v, g, beta from those of its chunk recurrence,
    written into ``grads`` at positions [start, end)."""
    _, lower, _ = _masks(vn.device)
    d_qd = d_o @ s_in.transpose(-1, -2)
    d_attn = d_o @ vn.transpose(-1, -2)
    d_kd = vn @ d_s_out.transpose(-1, -2)
    d_lam = (s_in * d_s_out).sum((-1, -2))
    d_w = -(d_vn @ s_in.transpose(-1, -2))
    # [u w] = T [v*beta x] with T = (I + L)^-1, L = strictly_lower(system): the right-hand
    # side's gradient is T^T [d_u d_w], L's is -(T^T d_[u w]) [u w]^T = -d_rhs [u w]^T.
    t_t = it.t.transpose(-1, -2)
    d_vb = t_t @ d_vn
    d_x = t_t @ d_w
    d_system = (d_vb @ it.u.transpose(-1, -2)).add_(d_x @ it.w.transpose(-1, -2)).neg_().masked_fill_(~lower, 0.0)
    d_kk = d_system * it.gamma  # of kb @ k^T
    d_qk = d_attn * it.gamma  # of qs @ k^T
    e = (d_system * it.kk).add_(d_attn * it.scores).mul_(it.gamma)  # d gamma * gamma
    d_gc = e.sum(-1) - e.sum(-2)
    d_kb = torch.baddbmm((d_x * it.egc).flatten(0, 1), d_kk.flatten(0, 1), it.kn.flatten(0, 1)).view_as(d_x)
    d_k = d_kk.transpose(-1, -2) @ it.kb + d_qk.transpose(-1, -2) @ it.qs + d_kd * it.tail
    d_qs = d_qk @ it.kn + d_qd * it.egc
    kd_term = (d_kd * it.kd).sum(-1)
    d_gc = d_gc + (d_qd * it.qd).sum(-1) + (d_x * it.x).sum(-1) - kd_term
    d_gc[..., -1] += kd_term.sum(-1) + d_lam * it.lam
    d_beta = (d_kb * it.kn).sum(-1) + (d_vb * it.v).sum(-1)
    d_k = d_k + d_kb * it.beta.unsqueeze(-1)
    d_v = d_vb * it.beta.unsqueeze(-1)
    d_g = d_gc.flip(-1).cumsum(-1).flip(-1)
    d_q = d_qs * scale
    if use_qk_l2norm:  # y = x r, r = rsqrt(|x|^2 + eps): dx = r (dy - y (y . dy))
        d_q = it.q_rstd * (d_q - it.qn * (it.qn * d_q).sum(-1, keepdim=True))
        d_k = it.k_rstd * (d_k - it.kn * (it.kn * d_k).sum(-1, keepdim=True))
    for grad, d in zip(grads, (d_q, d_k, d_v, d_g, d_beta)):
        grad[:, start:end] = _unsegment(d, batch, end - start)


def _chunk_aligned_layout(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Every row's documents, each padded on the right to a multiple of CHUNK positions, rows
    padded to the longest: (source [B*L] flat index into [B*S] + one zero row at B*S, target
    [B*S] flat index into [B*L], keep [B, L/CHUNK] 0 at the chunks where a document after a
    row's first starts, L)."""
    batch, length = document_ids.shape
    device = document_ids.device
    new = _boundaries(document_ids)
    new[:, 0] = True
    new = new.flatten()
    doc = new.cumsum(0) - 1  # document of every token
    starts = new.nonzero().flatten()  # flat position of every document's first token
    lengths = torch.diff(starts, append=starts.new_tensor([batch * length]))
    row = starts // length
    padded = (lengths + CHUNK - 1) // CHUNK * CHUNK
    before = padded.cumsum(0) - padded  # padded positions of the documents before, all rows
    first_doc = doc[torch.arange(batch, device=device) * length]
    start_in_row = before - before[first_doc][row]
    row_len = torch.zeros(batch, dtype=padded.dtype, device=device).index_add_(0, row, padded)
    padded_len = int(row_len.max())
    position = torch.arange(batch * length, device=device)
    target = row[doc] * padded_len + start_in_row[doc] + position - starts[doc]
    source = torch.full((batch * padded_len,), batch * length, dtype=torch.long, device=device)
    source[target] = position
    keep = torch.ones(batch, padded_len // CHUNK, dtype=torch.float32, device=device)
    later = starts % length != 0
    keep.view(-1)[(row * (padded_len // CHUNK) + start_in_row // CHUNK)[later]] = 0.0
    return source, target, keep, padded_len


def torch_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked form with its hand-written backward (the recurrence up to
    RECURRENT_MAX_LEN positions); see the module docstring."""
    batch, length, heads, _ = k.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    starts = _document_starts(document_ids)
    if length <= RECURRENT_MAX_LEN:
        out, state = _recurrent(q, k, v, g, beta, scale, initial_state, starts, use_qk_l2norm)
        return out.to(q.dtype), state if output_final_state else None
    if starts is None:
        out, state = _ChunkGatedDelta.apply(q, k, v, g, beta, initial_state, None, scale, use_qk_l2norm)
        return out, state if output_final_state else None
    source, target, keep, padded_len = _chunk_aligned_layout(document_ids)

    def packed(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(batch * length, *x.shape[2:])
        flat = torch.cat((flat, flat.new_zeros(1, *x.shape[2:])))
        return flat[source].view(batch, padded_len, *x.shape[2:])

    keep = keep.repeat_interleave(heads, dim=0).t().contiguous()
    out, state = _ChunkGatedDelta.apply(*(packed(x) for x in (q, k, v, g, beta)), initial_state, keep, scale,
                                        use_qk_l2norm)
    out = out.reshape(batch * padded_len, heads, -1)[target].view(batch, length, heads, -1)
    return out, state if output_final_state else None


# ----------------------------------------------------------------------------- CUDA: fla


@functools.cache
def _fla_chunk():
    """fla's ``chunk_gated_delta_rule``, or None where flash-linear-attention is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _cu_seqlens(document_ids: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """fla's cumulative document ends over the rows flattened into one, starting with 0."""
    new = (torch.zeros(batch, length, dtype=torch.bool, device=device) if document_ids is None
           else _boundaries(document_ids))
    new[:, 0] = True
    starts = new.flatten().nonzero().flatten()
    return torch.cat((starts, starts.new_tensor([batch * length])))


def _fla_gated_delta_rule(chunk, q, k, v, g, beta, scale, document_ids, initial_state, output_final_state,
                          use_qk_l2norm):
    batch, length = q.shape[:2]
    cu_seqlens = _cu_seqlens(document_ids, batch, length, q.device)
    first = (cu_seqlens[:-1] % length == 0).nonzero().flatten()  # each row's first document
    last = torch.cat((first[1:], first.new_tensor([len(cu_seqlens) - 1]))) - 1  # each row's last
    state = None
    if initial_state is not None:
        state = initial_state.new_zeros(len(cu_seqlens) - 1, *initial_state.shape[1:]).index_copy(0, first,
                                                                                                  initial_state)
    flat = (x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta))
    out, final = chunk(*flat, scale=scale, initial_state=state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens)
    return out.reshape(batch, length, *out.shape[2:]), final[last] if output_final_state else None


def fused_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla on CUDA in bf16/fp16 where it is importable, else ``torch_gated_delta_rule``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and _fla_chunk() is not None:
        return _fla_gated_delta_rule(_fla_chunk(), q, k, v, g, beta, scale, document_ids, initial_state,
                                     output_final_state, use_qk_l2norm)
    return torch_gated_delta_rule(q, k, v, g, beta, scale=scale, document_ids=document_ids,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  use_qk_l2norm=use_qk_l2norm)


# ----------------------------------------------------------------------------- causal conv1d


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"causal_conv1d: activation {activation!r}: expected 'silu', 'swish' or None")


def _conv_final_state(x: torch.Tensor, width: int, document_ids: torch.Tensor | None,
                      state: torch.Tensor | None) -> torch.Tensor:
    """The K-1 inputs before the next position, [B, D, K-1]: the last of each row's last
    document, zeros before its start (or the given state where the last document is the first)."""
    batch, length, dim = x.shape
    front = x.new_zeros(batch, width - 1, dim) if state is None else state.transpose(1, 2).to(x.dtype)
    tail = torch.cat((front, x), dim=1)[:, length:]
    starts = _document_starts(document_ids)
    if starts is not None:
        positions = torch.arange(length, device=x.device)
        last_start = torch.where(starts, positions, 0).amax(1, keepdim=True)  # [B, 1]
        token = torch.arange(length - width + 1, length, device=x.device)  # tail positions in x
        tail = tail * ((token >= last_start) | (last_start == 0)).unsqueeze(-1).to(tail.dtype)
    return tail.transpose(1, 2).contiguous()


def reference_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    document_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
    state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.conv1d`` over each document on its own, left-padded with zeros (the first
    document of a row with ``state``)."""
    batch, length, dim = x.shape
    width = weight.shape[1]
    spans = [[(0, length)]] * batch if document_ids is None else _document_spans(document_ids)
    rows = []
    for b, row_spans in enumerate(spans):
        pieces = []
        for i, (start, end) in enumerate(row_spans):
            piece = x[b:b + 1, start:end].transpose(1, 2).to(weight.dtype)
            front = (state[b:b + 1].to(weight.dtype) if state is not None and i == 0
                     else piece.new_zeros(1, dim, width - 1))
            out = F.conv1d(torch.cat((front, piece), -1), weight.unsqueeze(1), bias, groups=dim)
            pieces.append(_activate(out, activation).to(x.dtype))
        rows.append(torch.cat(pieces, -1))
    final = _conv_final_state(x, width, document_ids, state) if output_final_state else None
    return torch.cat(rows).transpose(1, 2), final


@functools.cache
def _causal_conv1d_fn():
    """causal-conv1d's ``causal_conv1d_fn``, or None where it is not importable."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


def _cuda_conv_kernel(x: torch.Tensor, width: int, state: torch.Tensor | None):
    """causal-conv1d's function where it takes this call (CUDA, no state, width 2 to 4), else None."""
    if x.device.type != "cuda" or state is not None or not 2 <= width <= 4:
        return None
    return _causal_conv1d_fn()


def fused_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    document_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
    state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """causal-conv1d's CUDA kernel (documents through ``seq_idx``) where it is importable and
    takes the call (CUDA, no state, width 2 to 4); else one ``F.conv1d`` over every row with
    each document preceded by K-1 zeros (the row's first by ``state``)."""
    batch, length, dim = x.shape
    width = weight.shape[1]
    _activate(x[:0], activation)  # validates the name
    final = _conv_final_state(x, width, document_ids, state) if output_final_state else None
    fn = _cuda_conv_kernel(x, width, state)
    if fn is not None:
        seq_idx = None
        if document_ids is not None:
            seq_idx = _boundaries(document_ids).cumsum(1, dtype=torch.int32)
        out = fn(x.to(weight.dtype).transpose(1, 2), weight, bias, seq_idx=seq_idx,
                 activation=None if activation is None else "silu")
        return out.transpose(1, 2).to(x.dtype), final
    front = x.new_zeros(batch, width - 1, dim) if state is None else state.transpose(1, 2).to(x.dtype)
    starts = _document_starts(document_ids)
    if starts is None:
        padded = torch.cat((front, x), dim=1)
        index = None
    else:
        # Row layout [front, doc 0, K-1 zeros, doc 1, ...]: token t sits at t + (K-1) (doc index + 1).
        shift = (starts.cumsum(1) + 1) * (width - 1)
        target = (torch.arange(length, device=x.device) + shift)  # [B, S] in the padded row
        padded_len = int(target[:, -1].max()) + 1
        source = torch.full((batch, padded_len), batch * length + batch * (width - 1), dtype=torch.long,
                            device=x.device)
        rows = torch.arange(batch, device=x.device).unsqueeze(1)
        source[rows.expand(batch, length), target] = rows * length + torch.arange(length, device=x.device)
        source[:, :width - 1] = batch * length + rows * (width - 1) + torch.arange(width - 1, device=x.device)
        flat = torch.cat((x.reshape(batch * length, dim), front.reshape(batch * (width - 1), dim),
                          x.new_zeros(1, dim)))
        padded = flat[source]
        index = target - (width - 1)
    out = F.conv1d(padded.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=dim)
    out = _activate(out, activation).to(x.dtype).transpose(1, 2)
    if index is not None:
        out = out.gather(1, index.unsqueeze(-1).expand(batch, length, dim))
    return out, final
