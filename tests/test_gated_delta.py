"""The gated delta rule and the causal conv1d of Qwen3-Next/Qwen3.5 (llmflow.kernels.gated_delta)
against transformers' torch formulas, a float64 recurrence, separate calls per document and
F.conv1d: forward, gradients, packed documents, decoding, bf16, and the CUDA wrappers'
argument plumbing (fla, causal-conv1d) with stand-ins for the CUDA kernels."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

import llmflow.kernels as K
from llmflow.kernels import FUSED, REFERENCE, gated_delta
from llmflow.kernels.gated_delta import (
    fused_causal_conv1d,
    fused_gated_delta_rule,
    reference_causal_conv1d,
    reference_gated_delta_rule,
    torch_gated_delta_rule,
)

FP32_ATOL = 1e-5
H, DK, DV = 2, 16, 24


def close(actual, expected, atol=FP32_ATOL):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0.0)


def make_inputs(batch, length, seed=0, dtype=torch.float32, state=True):
    """q, k, v, g, beta, initial state (or None) with the model's ranges: g = -exp(A_log) *
    softplus(a + dt_bias) <= 0, beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, H, DK, generator=gen)
    k = torch.randn(batch, length, H, DK, generator=gen)
    v = torch.randn(batch, length, H, DV, generator=gen)
    g = -torch.rand(H, generator=gen).mul(2).exp() * F.softplus(torch.randn(batch, length, H, generator=gen))
    beta = torch.randn(batch, length, H, generator=gen).sigmoid()
    h0 = torch.randn(batch, H, DK, DV, generator=gen) * 0.5 if state else None
    return [x if x is None else x.to(dtype) for x in (q, k, v, g, beta, h0)]


def recurrence64(q, k, v, g, beta, h0=None, scale=None):
    """The gated delta rule token by token in float64 (transformers' recurrent formula)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q, k = hf.l2norm(q), hf.l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0.double()
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, 1), state


def grads_of(fn, inputs, seed=7):
    """fn(*inputs) -> (out, state); out and state and the gradients of a random linear
    function of both w.r.t. every tensor input (None inputs stay None)."""
    leaves = [x if x is None else x.detach().clone().requires_grad_(True) for x in inputs]
    out, state = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    # bf16-valued weights: bf16 and fp32 runs get the same gradient of their output.
    loss = (out.double() * torch.randn(out.shape, generator=gen).bfloat16().double()).sum()
    if state is not None:
        loss = loss + (state.double() * torch.randn(state.shape, generator=gen).bfloat16().double()).sum()
    tensors = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(loss, tensors))
    return out.detach(), None if state is None else state.detach(), [None if x is None else next(grads) for x in leaves]


def fused(q, k, v, g, beta, h0=None, **kwargs):
    return torch_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("length", [1, 5, 17, 64, 100, 130, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_matches_transformers(length, with_state):
    """The torch path (recurrence up to 16 positions, chunked above) and the reference path
    against transformers' recurrent and chunked formulas, output and final state, fp32."""
    q, k, v, g, beta, h0 = make_inputs(2, length, seed=length, state=with_state)
    args = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    expected = [hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **args),
                hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **args)]
    for path in (torch_gated_delta_rule, reference_gated_delta_rule):
        out, state = path(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        for out_hf, state_hf in expected:
            close(out, out_hf)
            close(state, state_hf)
    out, state = torch_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert state is None and out.dtype == torch.float32 and out.shape == (2, length, H, DV)


def test_float64_recurrence_is_transformers_formula():
    q, k, v, g, beta, h0 = make_inputs(2, 40)
    out, state = recurrence64(q, k, v, g, beta, h0)
    out_hf, state_hf = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    close(out_hf, out)
    close(state_hf, state)


def test_scale_and_no_l2norm():
    q, k, v, g, beta, h0 = make_inputs(1, 90)
    k = hf.l2norm(k)
    q = q * 0.3
    out, state = torch_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm=False)
    out_r, state_r = reference_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0,
                                                output_final_state=True, use_qk_l2norm=False)
    close(out, out_r)
    close(state, state_r)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("length", [9, 100, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_gradients_match_float64_recurrence(length, with_state):
    """Output, state and the gradients of q, k, v, g, beta and the initial state of the torch
    path (fp32, hand-written backward) within 1e-5 of autograd through the float64 recurrence."""
    inputs = make_inputs(2, length, seed=10 + length, state=with_state)
    out, state, grads = grads_of(fused, inputs)
    out64, state64, grads64 = grads_of(recurrence64, [x if x is None else x.double() for x in inputs])
    close(out, out64)
    close(state, state64)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads64):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == torch.float32, name
            close(got, want)


def test_gradients_across_segments(monkeypatch):
    """Forward and backward in several segments of chunks (2 chunks each here) equal one segment."""
    inputs = make_inputs(1, 300, seed=3)
    out, state, grads = grads_of(fused, inputs)
    monkeypatch.setattr(gated_delta, "SEGMENT_CHUNKS", 2)
    out2, state2, grads2 = grads_of(fused, inputs)
    close(out2, out)
    close(state2, state)
    for got, want in zip(grads2, grads):
        close(got, want)


def test_gradient_of_output_alone_and_of_state_alone():
    """Backward with only the output used, and with only the final state used (q's gradient
    is then zero)."""
    inputs = [x.requires_grad_(True) for x in make_inputs(1, 70, seed=4)]
    for pick in (0, 1):
        got = torch.autograd.grad(fused(*inputs)[pick].sum(), inputs, allow_unused=True, materialize_grads=True)
        leaves64 = [x.detach().double().requires_grad_(True) for x in inputs]
        want = torch.autograd.grad(recurrence64(*leaves64)[pick].sum(), leaves64, allow_unused=True,
                                   materialize_grads=True)
        for a, b in zip(got, want):
            close(a, b)


def test_backward_keeps_inputs_and_chunk_states_only():
    """What autograd holds for backward of the chunked path: the inputs as given and the
    fp32 state entering every chunk, nothing else."""
    length = 200
    inputs = [x.requires_grad_(True) for x in make_inputs(1, length, state=False)[:5]]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch_gated_delta_rule(*inputs)
    others = [t for t in saved if not any(t is x for x in inputs)]
    assert len(saved) == len(inputs) + 1
    assert len(others) == 1 and others[0].shape == (-(-length // 64), H, DK, DV) and others[0].dtype == torch.float32


# ----------------------------------------------------------------------------- packed documents

DOCS = [[1, 70, 64, 15], [65, 1, 84]]  # per row; lengths 1, a chunk straddler, exact chunks, a tail


def document_ids(docs=DOCS):
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in docs])


def per_document(path):
    """Separate calls per document: the row's initial state into its first, the last one's state out."""

    def run(q, k, v, g, beta, h0=None):
        rows, states = [], []
        for b, row in enumerate(DOCS):
            pieces, start = [], 0
            for i, n in enumerate(row):
                first = h0[b:b + 1] if h0 is not None and i == 0 else None
                piece, state = path(*(x[b:b + 1, start:start + n] for x in (q, k, v, g, beta)),
                                    initial_state=first, output_final_state=True)
                pieces.append(piece)
                start += n
            rows.append(torch.cat(pieces, 1))
            states.append(state)
        return torch.cat(rows), torch.cat(states)

    return run


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_documents_equal_separate_calls(with_state):
    """Packed rows with document_ids (a document of length 1, documents straddling chunk
    boundaries) against separate calls per document: outputs, final states and every gradient;
    the reference path's packing against the same."""
    inputs = make_inputs(2, 150, seed=5, state=with_state)
    ids = document_ids()
    want = grads_of(per_document(torch_gated_delta_rule), inputs)
    for path in (torch_gated_delta_rule, reference_gated_delta_rule):
        got = grads_of(lambda *x, path=path: path(*x[:5], initial_state=x[5], document_ids=ids,
                                                  output_final_state=True), inputs)
        close(got[0], want[0])
        close(got[1], want[1])
        for a, b in zip(got[2], want[2]):
            assert (a is None) == (b is None)
            if a is not None:
                close(a, b)


def test_packed_documents_short_sequence_uses_recurrence():
    """Up to RECURRENT_MAX_LEN positions the recurrence resets the state at document starts."""
    docs = [[1, 3, 6], [10]]
    ids = document_ids(docs)
    q, k, v, g, beta, h0 = make_inputs(2, 10, seed=6)
    out, state = torch_gated_delta_rule(q, k, v, g, beta, document_ids=ids, initial_state=h0, output_final_state=True)
    out_r, state_r = reference_gated_delta_rule(q, k, v, g, beta, document_ids=ids, initial_state=h0,
                                                output_final_state=True)
    close(out, out_r)
    close(state, state_r)
    assert not torch.allclose(out, torch_gated_delta_rule(q, k, v, g, beta, initial_state=h0)[0])


def test_chunk_aligned_layout():
    source, target, keep, padded_len = gated_delta._chunk_aligned_layout(document_ids())
    # Row 0: 1 -> 64, 70 -> 128, 64 -> 64, 15 -> 64 = 320; row 1: 128 + 64 + 128 = 320.
    assert padded_len == 320
    assert keep.tolist() == [[1, 0, 1, 0, 0], [1, 1, 0, 0, 1]]
    assert target[:3].tolist() == [0, 64, 65]
    assert target[150:152].tolist() == [320, 321] and target[215].item() == 320 + 128
    assert torch.equal(source[target], torch.arange(300))
    assert (source == 300).sum() == 2 * 320 - 300


# ----------------------------------------------------------------------------- decoding


def test_decode_steps_continue_a_prefill():
    """A prefill with its final state, then single-token steps with the state, equal one call
    over the whole sequence (and transformers' recurrent step)."""
    q, k, v, g, beta, _ = make_inputs(2, 103, seed=8, state=False)
    full, full_state = K.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    out, state = K.gated_delta_rule(*(x[:, :100] for x in (q, k, v, g, beta)), output_final_state=True)
    outs = [out]
    for t in range(100, 103):
        step = [x[:, t:t + 1] for x in (q, k, v, g, beta)]
        out_hf, state_hf = hf.torch_recurrent_gated_delta_rule(*step, initial_state=state, output_final_state=True,
                                                               use_qk_l2norm_in_kernel=True)
        out, state = K.gated_delta_rule(*step, initial_state=state, output_final_state=True)
        close(out, out_hf)
        close(state, state_hf)
        outs.append(out)
    close(torch.cat(outs, 1), full)
    close(state, full_state)


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("length", [12, 100])
def test_bf16_computed_in_fp32(length):
    """bf16 input: bf16 output and gradients, equal to the fp32 computation on the same
    (bf16-valued) inputs cast to bf16; the final state is fp32."""
    inputs = make_inputs(1, length, seed=9, dtype=torch.bfloat16)
    out, state, grads = grads_of(fused, inputs)
    out32, state32, grads32 = grads_of(fused, [x.float() for x in inputs])
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(out, out32.to(torch.bfloat16))
    close(state, state32)
    for got, want in zip(grads, grads32):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.to(torch.bfloat16))


# ----------------------------------------------------------------------------- causal conv1d

CONV_DIM, WIDTH = 12, 4


def conv_inputs(batch, length, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, CONV_DIM, generator=gen).to(dtype)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen).to(dtype)
    bias = torch.randn(CONV_DIM, generator=gen).to(dtype)
    return x, weight, bias


def conv_per_document(x, weight, bias, docs):
    """F.conv1d on each document, left-padded with K-1 zeros, then silu."""
    rows = []
    for b, row in enumerate(docs):
        start, pieces = 0, []
        for n in row:
            piece = F.pad(x[b:b + 1, start:start + n].transpose(1, 2), (WIDTH - 1, 0))
            pieces.append(F.silu(F.conv1d(piece, weight.unsqueeze(1), bias, groups=CONV_DIM)))
            start += n
        rows.append(torch.cat(pieces, -1))
    return torch.cat(rows).transpose(1, 2)


@pytest.mark.parametrize("docs", [[[40], [40]], [[1, 2, 30, 7], [3, 37]]])
def test_causal_conv1d_matches_conv1d_per_document(docs):
    x, weight, bias = conv_inputs(2, 40)
    ids = document_ids(docs)
    want = conv_per_document(x, weight, bias, docs)
    for path in (fused_causal_conv1d, reference_causal_conv1d, K.causal_conv1d):
        out, state = path(x, weight, bias, document_ids=ids)
        assert state is None
        close(out, want)
    # Gradients of x, weight and bias: the fused path against the per-document convolutions.
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((fused_causal_conv1d(*leaves, document_ids=ids)[0] * grad).sum(), leaves)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    for a, b in zip(got, torch.autograd.grad((conv_per_document(*leaves, docs) * grad).sum(), leaves)):
        close(a, b)


def test_causal_conv1d_decode_state_matches_transformers():
    """A prefill's final state, then steps of one and of two tokens, against transformers'
    causal_conv1d_update (which updates its state in place) and against one call over all."""
    x, weight, bias = conv_inputs(2, 23, seed=2)
    full, _ = fused_causal_conv1d(x, weight, bias)
    out, state = fused_causal_conv1d(x[:, :20], weight, bias, output_final_state=True)
    hf_state = state.clone()
    outs = [out]
    for start, end in ((20, 21), (21, 23)):
        step = x[:, start:end]
        want = hf.causal_conv1d_update(step.transpose(1, 2), hf_state, weight, bias, "silu").transpose(1, 2)
        for path in (fused_causal_conv1d, reference_causal_conv1d):
            got, new_state = path(step, weight, bias, state=state, output_final_state=True)
            close(got, want)
            close(new_state, hf_state)
        out, state = fused_causal_conv1d(step, weight, bias, state=state, output_final_state=True)
        outs.append(out)
    close(torch.cat(outs, 1), full)


def test_causal_conv1d_final_state_of_last_document():
    """The final state holds the last document's last K-1 inputs, zeros before its start;
    with a state and one document per row, the state's tail fills in."""
    x, weight, bias = conv_inputs(2, 10, seed=3)
    ids = document_ids([[8, 2], [10]])
    _, state = fused_causal_conv1d(x, weight, bias, document_ids=ids, output_final_state=True)
    assert torch.equal(state[0], torch.cat((torch.zeros(CONV_DIM, 1), x[0, 8:].T), 1))
    assert torch.equal(state[1], x[1, 7:].T)
    prev = torch.randn(2, CONV_DIM, WIDTH - 1)
    _, state = fused_causal_conv1d(x[:, :1], weight, bias, state=prev, output_final_state=True)
    assert torch.equal(state, torch.cat((prev[:, :, 1:], x[:, :1].transpose(1, 2)), -1))
    _, ref_state = reference_causal_conv1d(x[:, :1], weight, bias, state=prev, output_final_state=True)
    assert torch.equal(ref_state, state)


def test_causal_conv1d_bf16_and_no_activation():
    x, weight, bias = conv_inputs(1, 30, dtype=torch.bfloat16)
    out, _ = fused_causal_conv1d(x, weight, bias, activation=None)
    want = F.conv1d(F.pad(x.transpose(1, 2), (WIDTH - 1, 0)), weight.unsqueeze(1), bias, groups=CONV_DIM)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.transpose(1, 2))
    with pytest.raises(ValueError, match="gelu"):
        fused_causal_conv1d(x, weight, bias, activation="gelu")


# ----------------------------------------------------------------------------- dispatch and CUDA plumbing


def test_dispatch():
    assert FUSED.gated_delta_rule is fused_gated_delta_rule and REFERENCE.gated_delta_rule is reference_gated_delta_rule
    assert FUSED.causal_conv1d is fused_causal_conv1d and REFERENCE.causal_conv1d is reference_causal_conv1d
    q, k, v, g, beta, h0 = make_inputs(2, 150, seed=11)
    ids = document_ids()
    with K.use_kernels(REFERENCE):
        want = K.gated_delta_rule(q, k, v, g, beta, document_ids=ids, initial_state=h0, output_final_state=True)
    got = K.gated_delta_rule(q, k, v, g, beta, document_ids=ids, initial_state=h0, output_final_state=True)
    close(got[0], want[0])
    close(got[1], want[1])


def fake_fla_chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens):
    """fla's chunk_gated_delta_rule contract (B = 1, one initial and final state per
    cu_seqlens sequence) on the reference formula."""
    assert q.shape[0] == 1 and cu_seqlens[0] == 0 and cu_seqlens[-1] == q.shape[1]
    ends = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(itertools.pairwise(ends)):
        out, final = reference_gated_delta_rule(
            *(x[:, start:end] for x in (q, k, v, g, beta)), scale=scale, output_final_state=True,
            initial_state=None if initial_state is None else initial_state[i:i + 1], use_qk_l2norm=use_qk_l2norm_in_kernel)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, 1), torch.cat(finals) if output_final_state else None


def test_fla_plumbing():
    """cu_seqlens from document_ids over the rows flattened, each row's initial state into
    its first document and its final state from its last, with fla's contract stood in for."""
    inputs = make_inputs(2, 150, seed=12)
    ids = document_ids()
    assert gated_delta._cu_seqlens(ids, 2, 150, "cpu").tolist() == [0, 1, 71, 135, 150, 215, 216, 300]
    assert gated_delta._cu_seqlens(None, 2, 150, "cpu").tolist() == [0, 150, 300]
    for docs in (ids, None):
        got = gated_delta._fla_gated_delta_rule(fake_fla_chunk, *inputs[:5], DK**-0.5, docs, inputs[5], True, True)
        want = torch_gated_delta_rule(*inputs[:5], document_ids=docs, initial_state=inputs[5], output_final_state=True)
        close(got[0], want[0])
        close(got[1], want[1])


def test_causal_conv1d_plumbing(monkeypatch):
    """causal-conv1d's call (x [B, D, S] channels last, seq_idx per row's documents) with its
    contract stood in for, as on CUDA."""
    calls = []

    def fake_fn(x, weight, bias=None, seq_idx=None, activation=None):
        calls.append(seq_idx)
        assert x.stride(1) == 1 and activation == "silu"
        docs = [[0] * x.shape[-1]] * x.shape[0] if seq_idx is None else seq_idx.tolist()
        out, _ = reference_causal_conv1d(x.transpose(1, 2), weight, bias, document_ids=torch.tensor(docs))
        return out.transpose(1, 2)

    monkeypatch.setattr(gated_delta, "_cuda_conv_kernel", lambda x, width, state: None if state is not None else fake_fn)
    x, weight, bias = conv_inputs(2, 40)
    docs = [[1, 2, 30, 7], [3, 37]]
    ids = document_ids(docs) + 5
    out, _ = fused_causal_conv1d(x, weight, bias, document_ids=ids)
    assert calls[0].dtype == torch.int32 and calls[0][0].tolist() == [0] + [1] * 2 + [2] * 30 + [3] * 7
    close(out, conv_per_document(x, weight, bias, docs))
