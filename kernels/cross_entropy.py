"""Cross-entropy fused with the output projection, computed a chunk of tokens at a time.

A Qwen-sized vocabulary (151,936) makes full logits the largest tensor of a training step:
[tokens, vocab] in fp32, plus the softmax and its gradient. Here logits exist for one chunk
of tokens at a time; their gradient is folded into the hidden-state and weight gradients
during the forward pass, so the backward pass only scales what is already there.

A final-logit soft cap (Gemma: ``cap * tanh(logits / cap)``) is elementwise, so it applies to
each chunk's logits in fp32, and the logits' gradient is the capped logits' times the cap's
slope, ``1 - tanh^2``.
"""

from __future__ import annotations

import torch

from llmflow.kernels.reference import soft_cap

# Elements of one chunk's fp32 logits (2**26 floats = 256 MiB): ~440 tokens per chunk at
# Qwen's vocabulary, large enough for efficient matmuls (measured fastest on CPU).
CHUNK_LOGIT_ELEMENTS = 2**26


def _chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_LOGIT_ELEMENTS // vocab_size)


def _chunk_log_probs(h: torch.Tensor, weight: torch.Tensor, buffers: dict[str, torch.Tensor],
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_softmax(logits) in fp32, the soft-capped logits in fp32 or None without ``softcap``),
    logits = h @ weight.T, capped when ``softcap`` is set; written into buffers reused across
    chunks: on CPU every fresh allocation of this size is a new mmap paid for in page faults."""
    n = h.shape[0]
    if "logits" not in buffers:
        buffers["logits"] = torch.empty(n, weight.shape[0], dtype=weight.dtype, device=weight.device)
        buffers["log_probs"] = torch.empty(n, weight.shape[0], dtype=torch.float32, device=weight.device)
    logits = torch.matmul(h, weight.t(), out=_leading_rows(buffers["logits"], n))
    capped = None
    if softcap is not None:
        capped = logits = soft_cap(logits.float(), softcap)
    if logits.dtype != torch.float32:
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32), capped
    return torch.ops.aten._log_softmax.out(logits, -1, False, out=_leading_rows(buffers["log_probs"], n)), capped


def _through_cap(grad_logits: torch.Tensor, capped: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """The gradient of the capped logits ``grad_logits`` taken back through the soft cap (in
    place): times d(cap tanh(z / cap))/dz = 1 - tanh^2 = 1 - (capped / cap)^2."""
    if capped is None:
        return grad_logits
    return grad_logits.mul_(1.0 - capped.div_(softcap).square_())


def _leading_rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
    # Only a shorter last chunk takes a slice: a slice is a call of its own to the precision
    # probe, which would record a fresh buffer's uninitialised memory as its input.
    return buffer if buffer.shape[0] == n else buffer[:n]


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """grad_weight (fp32) = or += grad_logits.T @ h."""
    if grad_logits.dtype == torch.float32 and first:
        torch.mm(grad_logits.t(), h, out=grad_weight)
    elif grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), h)
    elif first:  # half precision: matmul in that precision, accumulated in fp32
        grad_weight.copy_(grad_logits.t() @ h)
    else:
        grad_weight.add_(grad_logits.t() @ h)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, chunk_rows, want_grad_h, want_grad_w, softcap):
        # Grad mode is off inside forward, so the caller says which gradients are wanted. The
        # gradients are computed here by hand: the inputs' autograd history is not needed (and
        # views of them would otherwise keep requires_grad depending on how they were made).
        hidden, weight = hidden.detach(), weight.detach()
        grad_hidden = torch.empty_like(hidden) if want_grad_h else None
        # Filled by the first chunk's matmul (no zero-fill pass over a vocab x hidden tensor).
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if want_grad_w else None
        valid = labels != ignore_index
        ignored_rows = (~valid).nonzero().squeeze(1)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            h, y, ok = hidden[start:end], labels[start:end], valid[start:end]
            log_probs, capped = _chunk_log_probs(h, weight, buffers, softcap)
            rows = torch.arange(end - start, device=log_probs.device)
            target = y.clamp(min=0)
            loss -= torch.where(ok, log_probs[rows, target], 0.0).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows.
            grad_logits = log_probs.exp_()
            grad_logits[rows, target] -= 1.0
            in_chunk = ignored_rows[(ignored_rows >= start) & (ignored_rows < end)] - start
            grad_logits.index_fill_(0, in_chunk, 0.0)
            grad_logits = _through_cap(grad_logits, capped, softcap).to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad_logits, h, first=start == 0)
        scale = 1.0 / valid.sum().float() if reduction == "mean" else torch.ones((), device=hidden.device)
        # The gradients are scaled in place in backward: kept on ctx, not saved tensors.
        ctx.grads = (grad_hidden, grad_weight, scale)
        ctx.weight_dtype = weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward can run only once per forward")
        grad_hidden, grad_weight, scale = ctx.grads
        ctx.grads = None
        factor = grad_loss * scale
        dh = grad_hidden.mul_(factor.to(grad_hidden.dtype)) if grad_hidden is not None else None
        dw = grad_weight.mul_(factor).to(ctx.weight_dtype) if grad_weight is not None else None
        return dh, dw, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=..., reduction=...)`` without
    materialising the logits of all tokens at once; with ``softcap``, of the logits capped to
    ``softcap * tanh(logits / softcap)``.

    hidden: [tokens, hidden_size]; weight: [vocab, hidden_size]; labels: [tokens].
    reduction "mean" averages over non-ignored tokens (NaN when there are none, as
    F.cross_entropy); "sum" adds them up (0 when there are none), for callers that
    normalise by a token count across micro-batches or ranks; "none" gives every token's
    loss (0 where ignored), for objectives over sequences such as preference losses.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [tokens, hidden] and labels [tokens], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    if reduction == "none":
        return token_cross_entropy(hidden, weight, labels, ignore_index, chunk_rows=chunk_rows, softcap=softcap)
    rows = chunk_rows or _chunk_rows(weight.shape[0])
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, reduction, rows,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, softcap,
    )


class _TokenLinearCrossEntropy(torch.autograd.Function):
    """Every token's loss [tokens] (0 where its label is ignored) and, as a metric without
    gradient, the entropy of its predicted distribution. Only the rows whose label is kept
    are projected (a prompt's positions, a batch's padding cost nothing). Each token's loss
    has its own gradient weight (the caller's objective weighs sequences), so the gradient
    cannot be folded in during the forward pass as above: backward projects each chunk again,
    once the weights are known, and keeps one chunk's logits alive at a time in either pass."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows, with_entropy, softcap):
        hidden, weight = hidden.detach(), weight.detach()
        kept = (labels != ignore_index).nonzero().squeeze(1)
        rows_kept, targets = hidden.index_select(0, kept), labels.index_select(0, kept)
        loss = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(loss) if with_entropy else None
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, kept.numel(), chunk_rows):
            end = min(start + chunk_rows, kept.numel())
            log_probs, _ = _chunk_log_probs(rows_kept[start:end], weight, buffers, softcap)
            index = kept[start:end]
            loss[index] = -log_probs.gather(1, targets[start:end].unsqueeze(1)).squeeze(1)
            if entropy is not None:
                if "probs" not in buffers:
                    buffers["probs"] = torch.empty(log_probs.shape, dtype=torch.float32, device=log_probs.device)
                probs = torch.exp(log_probs, out=_leading_rows(buffers["probs"], end - start))
                entropy[index] = -probs.mul_(log_probs).sum(-1)
        ctx.rows = (rows_kept, targets, kept, hidden.shape, chunk_rows, softcap)
        ctx.save_for_backward(weight)
        if entropy is None:
            return loss
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, grad_loss, *_entropy_grad):
        rows_kept, targets, kept, shape, chunk_rows, softcap = ctx.rows
        (weight,) = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(shape, dtype=rows_kept.dtype, device=rows_kept.device) if want_h else None
        grad_weight = None
        if want_w:  # filled by the first chunk's matmul unless there is none
            grad_weight = (torch.empty if kept.numel() else torch.zeros)(weight.shape, dtype=torch.float32,
                                                                           device=weight.device)
        weights = grad_loss.index_select(0, kept).float()
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, kept.numel(), chunk_rows):
            end = min(start + chunk_rows, kept.numel())
            h = rows_kept[start:end]
            # d(loss)/d(logits) = softmax - one_hot(target), each row times its loss's gradient.
            log_probs, capped = _chunk_log_probs(h, weight, buffers, softcap)
            grad_logits = log_probs.exp_()
            grad_logits[torch.arange(end - start, device=h.device), targets[start:end]] -= 1.0
            grad_logits = _through_cap(grad_logits.mul_(weights[start:end].unsqueeze(1)), capped, softcap).to(h.dtype)
            if grad_hidden is not None:
                grad_hidden.index_copy_(0, kept[start:end], grad_logits @ weight)
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad_logits, h, first=start == 0)
        dw = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, dw, None, None, None, None, None


def token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                        with_entropy: bool = False, chunk_rows: int | None = None, softcap: float | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every token's cross-entropy of ``hidden @ weight.T`` [tokens] (0 where ignored), a chunk
    of logits at a time; ``with_entropy`` also returns the entropy of each kept token's
    softmax (0 elsewhere), from the same logits, without gradient; ``softcap`` caps the logits
    as ``linear_cross_entropy`` does."""
    rows = chunk_rows or _chunk_rows(weight.shape[0])
    return _TokenLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, rows, with_entropy, softcap)
