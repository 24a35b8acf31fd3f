"""Attention sinks on the GPU: output, LSE and gradients (the sinks' included) against an
fp32 reference with a sink column, flash-attn's 2x / 3x rules, crossed with causal, windows,
GQA, softcap, dropout, varlen and the SDPA body with a mask; the backward deterministic."""

import pytest
import torch

import flash_tile
from flash_tile import api, reference, varlen

pytestmark = pytest.mark.gpu

SEED = 737373
# (batch, heads, kv_heads, Lq, Lk, head_dim, causal, window, softcap, dropout_p)
CASES = [
    ((1, 1, 1, 1, 1, 64), False, (-1, -1), 0.0, 0.0),
    ((2, 8, 1, 203, 203, 64), True, (-1, -1), 0.0, 0.0),     # GQA 8 as gpt-oss (64/8)
    ((1, 8, 2, 113, 250, 128), True, (-1, -1), 0.0, 0.0),    # bottom-right causal, Lq != Lk
    ((1, 4, 4, 250, 113, 64), True, (-1, -1), 0.0, 0.0),     # rows that see no key
    ((2, 8, 2, 300, 300, 64), True, (127, -1), 0.0, 0.0),    # gpt-oss's banded layers
    ((1, 4, 2, 257, 257, 128), False, (-1, -1), 30.0, 0.0),  # softcap
    ((1, 4, 4, 160, 160, 64), True, (-1, -1), 0.0, 0.2),     # dropout
    ((1, 2, 2, 77, 99, 256), False, (-1, -1), 0.0, 0.0),
]


def _grads(fn, inputs, dout, dlse, dtype):
    leaves = [t.detach().to(dtype if t.is_floating_point() and i < 3 else t.dtype)
              .requires_grad_() for i, t in enumerate(inputs)]
    out, lse = fn(*leaves)
    torch.autograd.backward((out, lse), (dout.to(out.dtype), dlse))
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def _check(got, ref, low):
    """out (2x), then dq, dk, dv and dsinks (3x); the LSE to fp32 rounding (the inputs are
    rounded to the low dtype first, so only the computation differs)."""
    torch.testing.assert_close(got[1], ref[1], rtol=1e-3, atol=1e-3)
    for name, g, r, lo, factor in zip(("out", "dq", "dk", "dv", "dsinks"), got[:1] + got[2:],
                                      ref[:1] + ref[2:], low[:1] + low[2:], (2, 3, 3, 3, 3)):
        report = reference.check_error(g, r, lo, factor)
        assert report["ok"], f"{name}: {report}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_flash_attn_func_with_sinks(case, dtype, monkeypatch, backward_form):
    (batch, heads, kv_heads, q_len, k_len, d), causal, window, softcap, p = case
    monkeypatch.setattr(api, "_dropout_seed", lambda dropout_p: SEED)
    gen = torch.Generator(device="cuda").manual_seed(q_len * 3 + k_len)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = (randn(batch, q_len, heads, d).to(dtype), randn(batch, k_len, kv_heads, d).to(dtype),
              randn(batch, k_len, kv_heads, d).to(dtype), randn(heads) * 2)
    dout, dlse = randn(batch, q_len, heads, d), randn(batch, heads, q_len)
    eff = (window[0], 0) if causal else window

    def ours(q, k, v, sinks):
        return flash_tile.flash_attn_func(q, k, v, p, None, causal, window, softcap,
                                          return_lse=True, sinks=sinks)

    def dense(q, k, v, sinks):
        out, lse = reference.attention_dense(*(t.transpose(1, 2) for t in (q, k, v)), None,
                                             k_len - q_len, eff, softcap, return_lse=True,
                                             dropout_p=p, dropout_seed=SEED, sinks=sinks)
        return out.transpose(1, 2), lse

    got = _grads(ours, inputs, dout, dlse, dtype)
    _check(got, _grads(dense, inputs, dout, dlse, torch.float32),
           _grads(dense, inputs, dout, dlse, dtype))


@pytest.mark.parametrize("alibi,v_dim", [(True, 64), (False, 40), (True, 40)],
                         ids=["alibi", "dv40", "alibi-dv40"])
def test_sinks_with_alibi_and_dv_not_d(alibi, v_dim, backward_form):
    """Sinks beside the switches the CASES leave out: ALiBi (its bias joins the scores the
    sink competes with) and Dv != D (the sink has no value: dV's width is V's); GQA 2,
    bottom-right causal, Lq != Lk."""
    gen = torch.Generator(device="cuda").manual_seed(v_dim + alibi)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = (randn(2, 130, 4, 64).bfloat16(), randn(2, 190, 2, 64).bfloat16(),
              randn(2, 190, 2, v_dim).bfloat16(), randn(4) * 2)
    dout, dlse = randn(2, 130, 4, v_dim), randn(2, 4, 130)
    slopes = torch.rand(2, 4, generator=gen, device="cuda") * 0.2 if alibi else None

    def ours(q, k, v, sinks):
        return flash_tile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                          return_lse=True, sinks=sinks)

    def dense(q, k, v, sinks):
        out, lse = reference.attention_dense(*(t.transpose(1, 2) for t in (q, k, v)),
                                             diag_offset=190 - 130, window=(-1, 0),
                                             alibi_slopes=slopes, return_lse=True,
                                             sinks=sinks)
        return out.transpose(1, 2), lse

    got = _grads(ours, inputs, dout, dlse, torch.bfloat16)
    _check(got, _grads(dense, inputs, dout, dlse, torch.float32),
           _grads(dense, inputs, dout, dlse, torch.bfloat16))


@pytest.mark.parametrize("tail", [False, True], ids=["covered", "uncovered-tail"])
def test_varlen_with_sinks(monkeypatch, backward_form, tail):
    """Packed causal sequences with sinks (no key, no query, Lq != Lk), each against its own
    reference. With ``tail`` the offsets stop 64 query rows short of q's end: rows that no
    sequence covers, whose outputs the forward leaves unwritten (NaN from the tests'
    allocators), must not reach dsinks (a product 0 * NaN there made it NaN)."""
    monkeypatch.setattr(varlen, "_dropout_seed", lambda dropout_p: SEED)
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths_q, lengths_k = [17, 0, 203, 1, 64], [40, 9, 203, 30, 0]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 8, 64, generator=gen, device="cuda").bfloat16().float()
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=gen, device="cuda").bfloat16().float()
            for _ in range(2))
    sinks = torch.randn(8, generator=gen, device="cuda")
    dout = torch.randn_like(q)
    if tail:  # the last sequence (64 queries, no keys) dropped from the offsets
        cu_q, cu_k = cu_q[:-1], cu_k[:-1]
    covered = int(cu_q[-1])

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        s = sinks.detach().clone().requires_grad_()
        out = fn(*leaves, s)
        out.backward(dout.to(out.dtype))
        return (out.detach(), *(t.grad for t in leaves), s.grad)

    def ours(q, k, v, s):
        return flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 203, 203, causal=True,
                                                 sinks=s)

    def dense(q, k, v, s):
        out = torch.zeros(q.shape[0], 8, 64, dtype=q.dtype, device="cuda")
        pieces = []
        for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
            if seq[1].shape[2] == 0:
                continue  # no key: zeros, nothing flows
            o = reference.attention_dense(*seq, diag_offset=diag, window=(-1, 0), sinks=s)
            pieces.append((rows, o[0].transpose(0, 1)))
        return out.index_put([torch.cat([torch.arange(r.start, r.stop, device="cuda")
                                         for r, _ in pieces])],
                             torch.cat([o for _, o in pieces]))

    got, ref, low = run(ours, torch.bfloat16), run(dense, torch.float32), \
        run(dense, torch.bfloat16)
    for name, g, r, lo, factor in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, low,
                                      (2, 3, 3, 3, 3)):
        if name in ("out", "dq"):  # the covered query rows
            g, r, lo = g[:covered], r[:covered], lo[:covered]
        report = reference.check_error(g, r, lo, factor)
        assert report["ok"], f"{name}: {report}"


def test_sdpa_body_with_a_mask_and_sinks():
    """Transformers' path for gpt-oss: a boolean mask (padding) and sinks together."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(2, 4, 150, 64, generator=gen, device="cuda")
    k, v = (torch.randn(2, 2, 150, 64, generator=gen, device="cuda") for _ in range(2))
    mask = torch.ones(2, 1, 150, 150, dtype=torch.bool, device="cuda").tril()
    mask[1, ..., :20] = False  # left padding
    sinks = torch.randn(4, generator=gen, device="cuda")
    got = api._sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.0, False, None, True,
                    sinks=sinks)
    ref = reference.attention_dense(q, k, v, attn_mask=mask, sinks=sinks)
    low = reference.attention_dense(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask,
                                    sinks=sinks)
    report = reference.check_error(got, ref, low)
    assert report["ok"], report


def test_sinks_gradient_is_deterministic():
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 512, 8, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 512, 1, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    sink_logits = torch.randn(8, generator=gen, device="cuda")

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sinks = sink_logits.clone().requires_grad_()
        flash_tile.flash_attn_func(*leaves, causal=True, sinks=sinks).backward(dout)
        return [t.grad for t in leaves] + [sinks.grad]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
