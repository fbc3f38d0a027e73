"""The fused kernels (llmflow.kernels.FUSED) against the reference formulas, forward and
backward, plus the fused linear cross-entropy against F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmflow.kernels as K
from llmflow.kernels import FUSED, REFERENCE, dispatch
from llmflow.kernels.cross_entropy import linear_cross_entropy, token_cross_entropy
from llmflow.kernels.masks import attention_mask, needs_explicit_mask
from llmflow.models.blocks.rotary import rotary_cos_sin

# Max abs difference allowed between two fp32 computations of the same quantity.
FP32_ATOL = 1e-5
# bf16 forward: the paths round in the same places, so they agree to about one bf16 ulp
# of values of magnitude <= 4 (ulp(4) = 2**-5); relative 1e-2 covers larger values.
BF16_ATOL = 2**-5
BF16_RTOL = 1e-2


def close(actual, expected, atol=FP32_ATOL, rtol=0.0):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def run_with_grads(fn, inputs, grad_out_seed=123):
    """fn(*inputs) and the gradients of <out, random> w.r.t. every input."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=gen(grad_out_seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, grad_out)
    return out.detach(), grads


def assert_same_fwd_bwd(fused_fn, ref_fn, inputs, atol=FP32_ATOL):
    out_f, grads_f = run_with_grads(fused_fn, inputs)
    out_r, grads_r = run_with_grads(ref_fn, inputs)
    close(out_f, out_r, atol=atol)
    for i, (gf, gr) in enumerate(zip(grads_f, grads_r)):
        assert gf is not None and gr is not None, f"input {i} got no gradient"
        close(gf, gr, atol=atol)


# ----------------------------------------------------------------------------- dispatch


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Clear the per-device kernel cache around a test so LLMFLOW_KERNELS is re-read."""
    monkeypatch.delenv("LLMFLOW_KERNELS", raising=False)
    dispatch._default_for.cache_clear()
    yield monkeypatch
    monkeypatch.delenv("LLMFLOW_KERNELS", raising=False)
    dispatch._default_for.cache_clear()


def test_cpu_uses_fused_kernels(fresh_dispatch):
    assert K.kernels_for("cpu").name == "fused"
    assert K.kernels_for("cpu") is FUSED


def test_llmflow_kernels_env_forces_reference(fresh_dispatch):
    fresh_dispatch.setenv("LLMFLOW_KERNELS", "reference")
    assert K.kernels_for("cpu") is REFERENCE


def test_llmflow_kernels_env_invalid(fresh_dispatch):
    fresh_dispatch.setenv("LLMFLOW_KERNELS", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        K.kernels_for("cpu")


def test_use_kernels_switches_and_restores(fresh_dispatch):
    assert K.kernels_for("cpu") is FUSED
    with K.use_kernels(REFERENCE):
        assert K.kernels_for("cpu") is REFERENCE
        assert K.kernels_for("cuda") is REFERENCE
        with K.use_kernels(FUSED):
            assert K.kernels_for("cpu") is FUSED
        assert K.kernels_for("cpu") is REFERENCE
    assert K.kernels_for("cpu") is FUSED
    with pytest.raises(RuntimeError, match="boom"), K.use_kernels(REFERENCE):
        raise RuntimeError("boom")
    assert K.kernels_for("cpu") is FUSED


def test_kernel_sets_have_every_op():
    for ks in (FUSED, REFERENCE):
        for op in ("rms_norm", "apply_rotary", "swiglu", "attention", "linear_cross_entropy"):
            assert callable(getattr(ks, op))
    assert FUSED.linear_cross_entropy is linear_cross_entropy


# ----------------------------------------------------------------------------- masks


def test_attention_mask_causal_with_documents():
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    mask = attention_mask(5, 5, torch.device("cpu"), docs)
    T, F_ = True, False
    expected = torch.tensor(
        [
            [
                [T, F_, F_, F_, F_],
                [T, T, F_, F_, F_],
                [F_, F_, T, F_, F_],
                [F_, F_, T, T, F_],
                [F_, F_, T, T, T],
            ],
            [
                [T, F_, F_, F_, F_],
                [F_, T, F_, F_, F_],
                [F_, T, T, F_, F_],
                [F_, F_, F_, T, F_],
                [F_, F_, F_, T, T],
            ],
        ]
    )
    assert mask.dtype == torch.bool
    assert mask.shape == (2, 1, 5, 5)
    assert torch.equal(mask[:, 0], expected)


def test_attention_mask_decode_and_sliding_window():
    # Two queries at positions 3 and 4 of 5 keys, window 2: each sees itself and one before.
    mask = attention_mask(2, 5, torch.device("cpu"), None, sliding_window=2)
    expected = torch.tensor([[False, False, True, True, False], [False, False, False, True, True]])
    assert mask.shape == (1, 1, 2, 5)
    assert torch.equal(mask[0, 0], expected)
    # Plain causal, queries the last 2 of 4 keys.
    mask = attention_mask(2, 4, torch.device("cpu"))
    assert torch.equal(mask[0, 0], torch.tensor([[True, True, True, False], [True, True, True, True]]))


def test_needs_explicit_mask():
    assert not needs_explicit_mask(8, 8, None, None)
    assert not needs_explicit_mask(1, 8, None, None)
    assert not needs_explicit_mask(8, 8, None, 8)
    assert needs_explicit_mask(8, 8, None, 4)
    assert needs_explicit_mask(3, 8, None, None)
    assert needs_explicit_mask(8, 8, torch.zeros(1, 8, dtype=torch.long), None)


# ----------------------------------------------------------------------------- rms_norm / rotary / swiglu


def test_rms_norm_fp32_forward_backward():
    x = torch.randn(2, 5, 32, generator=gen(0)) * 3
    w = 1 + 0.1 * torch.randn(32, generator=gen(1))
    eps = 1e-6
    assert_same_fwd_bwd(lambda x, w: FUSED.rms_norm(x, w, eps), lambda x, w: REFERENCE.rms_norm(x, w, eps), [x, w])
    # and the reference is the formula itself
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    close(FUSED.rms_norm(x, w, eps), ref)


def test_rms_norm_uses_given_eps():
    x = torch.full((1, 4), 1e-3)
    w = torch.ones(4)
    # With eps=1 the output is x / sqrt(mean(x^2) + 1) ~= x; with eps tiny it is ~1.
    close(FUSED.rms_norm(x, w, 1.0), x / torch.sqrt(torch.tensor(1e-6 + 1.0)))
    close(FUSED.rms_norm(x, w, 1e-12), torch.ones(1, 4), atol=1e-4)


def _cos_sin(batch, seq, head_dim, offset=0):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    pos = torch.arange(offset, offset + seq).expand(batch, seq).clone()
    pos[1:] = pos[1:] + 7  # different positions per batch row
    return rotary_cos_sin(inv_freq, pos, torch.float32)


def test_apply_rotary_fp32_forward_backward():
    x = torch.randn(2, 4, 7, 16, generator=gen(2))
    cos, sin = _cos_sin(2, 7, 16)
    assert_same_fwd_bwd(
        lambda x: FUSED.apply_rotary(x, cos, sin), lambda x: REFERENCE.apply_rotary(x, cos, sin), [x]
    )


def test_apply_rotary_is_a_rotation():
    # Position 0 is the identity; rotation preserves the norm of each (i, i + D/2) pair.
    x = torch.randn(1, 2, 5, 8, generator=gen(3))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = rotary_cos_sin(inv_freq, torch.arange(5)[None], torch.float32)
    y = FUSED.apply_rotary(x, cos, sin)
    close(y[:, :, 0], x[:, :, 0])
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2
    close(pair_norm(y), pair_norm(x))


def test_swiglu_fp32_forward_backward():
    gate = torch.randn(2, 5, 24, generator=gen(4)) * 3
    up = torch.randn(2, 5, 24, generator=gen(5))
    assert_same_fwd_bwd(FUSED.swiglu, REFERENCE.swiglu, [gate, up])
    close(FUSED.swiglu(gate, up), gate * torch.sigmoid(gate) * up)


def test_bf16_forward_rms_norm_swiglu_rotary():
    x = (torch.randn(2, 5, 32, generator=gen(6)) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(32, generator=gen(7))).bfloat16()
    out_f, out_r = FUSED.rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6)
    assert out_f.dtype == out_r.dtype == torch.bfloat16
    close(out_f.float(), out_r.float(), atol=BF16_ATOL, rtol=BF16_RTOL)

    gate = (torch.randn(2, 5, 24, generator=gen(8)) * 3).bfloat16()
    up = torch.randn(2, 5, 24, generator=gen(9)).bfloat16()
    out_f, out_r = FUSED.swiglu(gate, up), REFERENCE.swiglu(gate, up)
    assert out_f.dtype == torch.bfloat16
    close(out_f.float(), out_r.float(), atol=BF16_ATOL, rtol=BF16_RTOL)

    q = torch.randn(2, 4, 7, 16, generator=gen(10)).bfloat16()
    cos, sin = _cos_sin(2, 7, 16)
    cos, sin = cos.bfloat16(), sin.bfloat16()
    out_f, out_r = FUSED.apply_rotary(q, cos, sin), REFERENCE.apply_rotary(q, cos, sin)
    assert out_f.dtype == torch.bfloat16
    close(out_f.float(), out_r.float(), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_module_level_ops_dispatch_to_fused_on_cpu():
    x = torch.randn(2, 3, 8, generator=gen(11))
    w = torch.rand(8, generator=gen(12))
    assert torch.equal(K.rms_norm(x, w, 1e-6), FUSED.rms_norm(x, w, 1e-6))
    with K.use_kernels(REFERENCE):
        assert torch.equal(K.rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6))


# ----------------------------------------------------------------------------- attention

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5
SEQ = 10
# Several documents per row, different per row (row 1 starts mid-document-id 3).
DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [3, 3, 4, 4, 4, 4, 4, 5, 6, 6]])


def _qkv(batch, hq, hkv, q_len, kv_len, seed=0):
    g = gen(seed)
    q = torch.randn(batch, hq, q_len, HEAD_DIM, generator=g)
    k = torch.randn(batch, hkv, kv_len, HEAD_DIM, generator=g)
    v = torch.randn(batch, hkv, kv_len, HEAD_DIM, generator=g)
    return q, k, v


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("docs", [False, True], ids=["nodocs", "docs"])
@pytest.mark.parametrize("window", [None, 3, SEQ], ids=["nowin", "win3", "winfull"])
@pytest.mark.parametrize("q_len", [SEQ, 1, 4], ids=["prefill", "decode", "chunk"])
def test_attention_fused_equals_reference(hkv, docs, window, q_len):
    q, k, v = _qkv(2, 4, hkv, q_len, SEQ, seed=hkv * 100 + q_len)
    doc_ids = DOCS if docs else None
    assert_same_fwd_bwd(
        lambda q, k, v: FUSED.attention(q, k, v, SCALE, doc_ids, window),
        lambda q, k, v: REFERENCE.attention(q, k, v, SCALE, doc_ids, window),
        [q, k, v],
    )


def _naive_attention(q, k, v, scale, allowed):
    """Softmax attention with an explicit [Sq, Skv] boolean mask, one head at a time."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = (q[b, h] @ k[b, h // groups].T) * scale
            s = s.masked_fill(~allowed[b], float("-inf"))
            out[b, h] = torch.softmax(s, -1) @ v[b, h // groups]
    return out


@pytest.mark.parametrize("hkv", [4, 2])
def test_reference_attention_matches_naive_formula(hkv):
    q, k, v = _qkv(2, 4, hkv, SEQ, SEQ, seed=7)
    window = 4
    i = torch.arange(SEQ)
    allowed = []
    for b in range(2):
        same = DOCS[b][:, None] == DOCS[b][None, :]
        allowed.append((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window) & same)
    expected = _naive_attention(q, k, v, SCALE, torch.stack(allowed))
    close(REFERENCE.attention(q, k, v, SCALE, DOCS, window), expected)
    close(FUSED.attention(q, k, v, SCALE, DOCS, window), expected)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("kernels", [FUSED, REFERENCE], ids=["fused", "reference"])
def test_attention_with_documents_equals_each_document_alone(kernels, window):
    q, k, v = _qkv(2, 4, 2, SEQ, SEQ, seed=11)
    packed = kernels.attention(q, k, v, SCALE, DOCS, window)
    checked = 0
    for b in range(2):
        for d in DOCS[b].unique():
            idx = (DOCS[b] == d).nonzero().squeeze(1)
            s = slice(int(idx[0]), int(idx[-1]) + 1)
            alone = REFERENCE.attention(q[b : b + 1, :, s], k[b : b + 1, :, s], v[b : b + 1, :, s], SCALE, None, window)
            close(packed[b : b + 1, :, s], alone)
            checked += 1
    assert checked == 8


def test_decode_step_equals_last_row_of_prefill():
    for window in (None, 3):
        q, k, v = _qkv(2, 4, 2, SEQ, SEQ, seed=13)
        full = FUSED.attention(q, k, v, SCALE, DOCS, window)
        for kernels in (FUSED, REFERENCE):
            step = kernels.attention(q[:, :, -1:], k, v, SCALE, DOCS, window)
            close(step, full[:, :, -1:])
            step = kernels.attention(q[:, :, -1:], k, v, SCALE, None, window)
            close(step, FUSED.attention(q, k, v, SCALE, None, window)[:, :, -1:])



@pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
@pytest.mark.parametrize("kernels", [FUSED, REFERENCE], ids=["fused", "reference"])
def test_queries_inside_a_static_buffer_attend_as_at_its_written_end(kernels, sinks):
    """A static KV cache's keys: ``query_start`` t puts the queries at positions t.. of a
    longer buffer whose slots after them hold anything (random here); the output is that of
    the same queries over the buffer cut after them, with documents and a sliding window."""
    heads = torch.randn(4, generator=gen(3)) if sinks else None
    extra = {"sinks": heads} if sinks else {}
    for q_len, start, window in ((1, 5, None), (1, 9, 3), (3, 4, 2), (SEQ, 0, None)):
        q, k, v = _qkv(2, 4, 2, q_len, SEQ + 6, seed=17 + start)
        docs = torch.cat([DOCS, torch.zeros(2, 6, dtype=DOCS.dtype)], dim=1)
        end = start + q_len
        expected = kernels.attention(q, k[:, :, :end], v[:, :, :end], SCALE, docs[:, :end], window, **extra)
        got = kernels.attention(q, k, v, SCALE, docs, window, **extra, query_start=torch.tensor(start))
        close(got, expected)


# ----------------------------------------------------------------------------- linear cross-entropy

N_TOK, HID, VOCAB = 12, 16, 40


def _ce_inputs(n=N_TOK, hid=HID, vocab=VOCAB, seed=0, ignore_frac=0.25):
    g = gen(seed)
    hidden = torch.randn(n, hid, generator=g)
    weight = torch.randn(vocab, hid, generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    return hidden, weight, labels


def _ce_loss_and_grads(fn, hidden, weight, labels, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = fn(h, w, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _torch_ce(h, w, labels, reduction="mean"):
    return F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("chunk_rows", [None, 3, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_loss_value(chunk_rows, reduction):
    hidden, weight, labels = _ce_inputs()
    assert (labels == -100).any() and (labels != -100).any()
    with torch.no_grad():
        expected = _torch_ce(hidden, weight, labels, reduction)
    for h, w in ((hidden, weight), (hidden.requires_grad_(True), weight.requires_grad_(True))):
        got = linear_cross_entropy(h, w, labels, reduction=reduction, chunk_rows=chunk_rows)
        close(got.detach(), expected)
        close(REFERENCE.linear_cross_entropy(h, w, labels, -100, reduction).detach(), expected)


@pytest.mark.parametrize("chunk_rows", [None, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_grads(chunk_rows, reduction):
    hidden, weight, labels = _ce_inputs()
    loss, gh, gw = _ce_loss_and_grads(linear_cross_entropy, hidden, weight, labels, reduction=reduction, chunk_rows=chunk_rows)
    eloss, egh, egw = _ce_loss_and_grads(_torch_ce, hidden, weight, labels, reduction=reduction)
    close(loss, eloss)
    assert gh is not None and gw is not None, "no gradient reached hidden/weight"
    close(gh, egh)
    close(gw, egw)


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_linear_cross_entropy_per_token_values_and_grads(chunk_rows):
    """reduction "none" (preference objectives): every token's loss, and the gradients of a
    weighted sum of them (each token's weight its own, as a sequence-level objective gives)."""
    hidden, weight, labels = _ce_inputs()
    weights = torch.rand(labels.shape, generator=gen(1))

    def weighted(fn, h, w, labels, **kw):
        return (fn(h, w, labels, reduction="none", **kw) * weights).sum()

    loss, gh, gw = _ce_loss_and_grads(lambda *a, **kw: weighted(linear_cross_entropy, *a, **kw), hidden, weight,
                                      labels, chunk_rows=chunk_rows)
    eloss, egh, egw = _ce_loss_and_grads(lambda *a: weighted(_torch_ce, *a), hidden, weight, labels)
    close(loss, eloss)
    close(gh, egh)
    close(gw, egw)
    with torch.no_grad():
        per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_rows=chunk_rows)
    close(per_token, _torch_ce(hidden, weight, labels, "none"))
    assert (per_token[labels == -100] == 0).all()


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_token_cross_entropy_with_entropy(chunk_rows):
    """The per-token losses and their entropies from the same chunks (online RL's loss
    forward): the losses and a weighted sum's gradients as torch's, each kept token's entropy
    as its softmax's, 0 and no gradient at ignored tokens."""
    hidden, weight, labels = _ce_inputs(seed=5)
    weights = torch.rand(labels.shape, generator=gen(2))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, entropy = token_cross_entropy(h, w, labels, with_entropy=True, chunk_rows=chunk_rows)
    assert not entropy.requires_grad
    (loss * weights).sum().backward()
    _, egh, egw = _ce_loss_and_grads(lambda *a: (_torch_ce(*a, "none") * weights).sum(), hidden, weight, labels)
    close(loss.detach(), _torch_ce(hidden, weight, labels, "none"))
    close(h.grad, egh)
    close(w.grad, egw)
    log_probs = torch.log_softmax(hidden @ weight.T, dim=-1)
    expected = torch.where(labels != -100, -(log_probs.exp() * log_probs).sum(-1), 0.0)
    close(entropy, expected)
    assert (h.grad[labels == -100] == 0).all()


def test_token_cross_entropy_of_ignored_tokens_only():
    hidden, weight, _ = _ce_inputs()
    labels = torch.full((N_TOK,), -100)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, entropy = token_cross_entropy(h, w, labels, with_entropy=True)
    loss.sum().backward()
    assert (loss == 0).all() and (entropy == 0).all() and (h.grad == 0).all() and (w.grad == 0).all()


def test_token_cross_entropy_bf16_grads():
    hidden, weight, labels = _ce_inputs(seed=9)
    weights = torch.rand(labels.shape, generator=gen(3))
    h, w = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    (token_cross_entropy(h, w, labels, chunk_rows=5) * weights).sum().backward()
    h2, w2 = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    (F.cross_entropy((h2 @ w2.T).float(), labels, reduction="none") * weights).sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    close(h.grad.float(), h2.grad.float(), atol=1e-2, rtol=2e-2)
    close(w.grad.float(), w2.grad.float(), atol=1e-2, rtol=2e-2)


def test_linear_cross_entropy_whole_sequences_ignored():
    batch, seq = 3, 5
    hidden, weight, labels = _ce_inputs(n=batch * seq, ignore_frac=0.2, seed=3)
    labels = labels.view(batch, seq)
    labels[1] = -100  # the middle sequence is all prompt
    labels[0, 0] = 7
    labels = labels.reshape(-1)
    with torch.no_grad():
        expected = _torch_ce(hidden, weight, labels)
        assert torch.isfinite(expected)
        for chunk_rows in (None, 2, 5):
            close(linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows), expected)


def test_linear_cross_entropy_whole_sequences_ignored_grads():
    batch, seq = 3, 5
    hidden, weight, labels = _ce_inputs(n=batch * seq, ignore_frac=0.2, seed=3)
    labels = labels.view(batch, seq)
    labels[1] = -100
    labels[0, 0] = 7
    labels = labels.reshape(-1)
    _, gh, gw = _ce_loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=5)
    _, egh, egw = _ce_loss_and_grads(_torch_ce, hidden, weight, labels)
    assert gh is not None and gw is not None, "no gradient reached hidden/weight"
    close(gh, egh)
    close(gw, egw)
    assert torch.all(gh[seq : 2 * seq] == 0), "ignored tokens must get zero gradient"


def test_linear_cross_entropy_fully_ignored():
    hidden, weight, _ = _ce_inputs()
    labels = torch.full((N_TOK,), -100)
    with torch.no_grad():
        assert torch.isnan(_torch_ce(hidden, weight, labels, "mean"))  # what we mirror
        for chunk_rows in (None, 3):
            assert torch.isnan(linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows))
            s = linear_cross_entropy(hidden, weight, labels, reduction="sum", chunk_rows=chunk_rows)
            assert s.item() == 0.0


def test_linear_cross_entropy_fully_ignored_sum_grads_are_zero():
    hidden, weight, _ = _ce_inputs()
    labels = torch.full((N_TOK,), -100)
    loss, gh, gw = _ce_loss_and_grads(linear_cross_entropy, hidden, weight, labels, reduction="sum", chunk_rows=3)
    assert loss.item() == 0.0
    assert gh is not None and gw is not None
    assert torch.all(gh == 0) and torch.all(gw == 0)


def test_linear_cross_entropy_under_no_grad():
    hidden, weight, labels = _ce_inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk_rows=3)
        expected = _torch_ce(hidden, weight, labels)
    assert not loss.requires_grad and loss.grad_fn is None
    close(loss, expected)
    assert h.grad is None and w.grad is None


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_linear_cross_entropy_grad_for_one_input_only(which):
    hidden, weight, labels = _ce_inputs(seed=4)
    h = hidden.clone().requires_grad_(which == "hidden")
    w = weight.clone().requires_grad_(which == "weight")
    target = h if which == "hidden" else w
    (grad,) = torch.autograd.grad(linear_cross_entropy(h, w, labels, chunk_rows=3), [target])
    h2, w2 = hidden.clone().requires_grad_(which == "hidden"), weight.clone().requires_grad_(which == "weight")
    (expected,) = torch.autograd.grad(_torch_ce(h2, w2, labels), [h2 if which == "hidden" else w2])
    close(grad, expected)


def test_linear_cross_entropy_upstream_grad_scales():
    hidden, weight, labels = _ce_inputs(seed=5)
    h = hidden.clone().requires_grad_(True)
    (3.0 * linear_cross_entropy(h, weight, labels, chunk_rows=4)).backward()
    h2 = hidden.clone().requires_grad_(True)
    (3.0 * _torch_ce(h2, weight, labels)).backward()
    assert h.grad is not None
    close(h.grad, h2.grad)


@pytest.mark.parametrize("chunk_rows", [None, 3, 7])
def test_linear_cross_entropy_large_vocab_loss(chunk_rows):
    hidden, weight, labels = _ce_inputs(n=20, hid=16, vocab=5000, seed=6, ignore_frac=0.2)
    with torch.no_grad():
        close(linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows), _torch_ce(hidden, weight, labels))


def test_linear_cross_entropy_large_vocab_grads():
    hidden, weight, labels = _ce_inputs(n=20, hid=16, vocab=5000, seed=6, ignore_frac=0.2)
    loss, gh, gw = _ce_loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=3)
    eloss, egh, egw = _ce_loss_and_grads(_torch_ce, hidden, weight, labels)
    close(loss, eloss)
    assert gh is not None and gw is not None
    close(gh, egh)
    close(gw, egw)


def test_linear_cross_entropy_bf16_grads():
    hidden, weight, labels = _ce_inputs(seed=8)
    h = hidden.bfloat16().requires_grad_(True)
    w = weight.bfloat16().requires_grad_(True)
    linear_cross_entropy(h, w, labels, chunk_rows=5).backward()
    h2, w2 = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    F.cross_entropy((h2 @ w2.T).float(), labels).backward()
    assert h.grad is not None and w.grad is not None
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    close(h.grad.float(), h2.grad.float(), atol=1e-2, rtol=2e-2)
    close(w.grad.float(), w2.grad.float(), atol=1e-2, rtol=2e-2)


def test_linear_cross_entropy_rejects_bad_arguments():
    hidden, weight, labels = _ce_inputs()
    with pytest.raises(ValueError, match="reduction='max'"):
        linear_cross_entropy(hidden, weight, labels, reduction="max")
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(hidden, weight, labels[:-1])


def test_dispatched_linear_cross_entropy_equals_torch():
    hidden, weight, labels = _ce_inputs(seed=9)
    with torch.no_grad():
        close(K.linear_cross_entropy(hidden, weight, labels), _torch_ce(hidden, weight, labels))
        close(K.linear_cross_entropy(hidden, weight, labels, reduction="sum"), _torch_ce(hidden, weight, labels, "sum"))
