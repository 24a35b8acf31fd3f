"""Dropout on the GPU: the kernels' keep bits are the twin's (``reference.dropout_keep``), so
the output and gradients match the fp32 dense reference with the same bits under flash-attn's
rules (2x output, 3x gradients), under both backward forms; ``torch.manual_seed`` reproduces
a call exactly."""

import pytest
import torch

import flash_tile
from flash_tile import api
from flash_tile.reference import attention_dense, check_error

pytestmark = pytest.mark.gpu

SEED = 424242
# (batch, heads, kv_heads, Lq, Lk, head_dim, causal, window)
CASES = [
    (2, 4, 4, 203, 203, 64, True, (-1, -1)),
    (1, 8, 2, 113, 250, 128, False, (-1, -1)),  # GQA, Lq != Lk
    (1, 4, 4, 300, 300, 64, True, (64, -1)),    # sliding window
    (1, 2, 2, 1, 77, 128, False, (-1, -1)),     # one query row
    (1, 4, 2, 150, 150, 256, True, (-1, -1)),   # D = 256 (the one pass's default on sm_90)
]


def _check_grads(ours, dense, inputs, dout):
    """Output and dQ/dK/dV of ``ours`` (bf16) against ``dense`` in fp32 and in bf16, under
    flash-attn's 2x/3x rules."""
    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(dout.to(dtype))
        return (out.detach(), *(t.grad for t in leaves))

    got, ref, low = grads(ours, torch.bfloat16), grads(dense, torch.float32), \
        grads(dense, torch.bfloat16)
    for name, g, r, lo, factor in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
        report = check_error(g, r, lo, factor)
        assert report["ok"], f"{name}: {report}"


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_dropout_matches_the_dense_reference(case, p, monkeypatch, backward_form):
    batch, heads, kv_heads, q_len, k_len, d, causal, window = case
    monkeypatch.setattr(api, "_dropout_seed", lambda dropout_p: SEED)
    q = torch.randn(batch, q_len, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, k_len, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn(batch, q_len, heads, d, device="cuda", dtype=torch.bfloat16)
    eff_window = (window[0], 0) if causal else window

    def ours(q, k, v):
        return flash_tile.flash_attn_func(q, k, v, dropout_p=p, causal=causal,
                                          window_size=window)

    def dense(q, k, v):
        out = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              k_len - q_len, eff_window, dropout_p=p, dropout_seed=SEED)
        return out.transpose(1, 2)

    _check_grads(ours, dense, (q, k, v), dout)


def test_dropout_under_softcap_alibi_and_a_window(monkeypatch):
    """The keep bits act on the probabilities of the softcapped, ALiBi-biased scores inside a
    two-sided window, GQA, Lq != Lk."""
    monkeypatch.setattr(api, "_dropout_seed", lambda dropout_p: SEED)
    batch, heads, kv_heads, q_len, k_len, d, p = 2, 4, 2, 150, 211, 64, 0.2
    q = torch.randn(batch, q_len, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, k_len, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    slopes = torch.rand(batch, heads, device="cuda") * 0.2
    window, softcap = (90, 40), 15.0

    def ours(q, k, v):
        return flash_tile.flash_attn_func(q, k, v, dropout_p=p, window_size=window,
                                          softcap=softcap, alibi_slopes=slopes)

    def dense(q, k, v):
        out = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              k_len - q_len, window, softcap, slopes, dropout_p=p,
                              dropout_seed=SEED)
        return out.transpose(1, 2)

    _check_grads(ours, dense, (q, k, v), dout)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_dropout_under_an_attention_mask(kind, monkeypatch):
    """SDPA's mask and dropout together: the mask shapes the softmax, the keep bits act after
    it. The boolean mask hides query row 5 in every head (its output and gradients are 0)."""
    monkeypatch.setattr(api, "_dropout_seed", lambda dropout_p: SEED)
    q, k, v = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16)
               for n in (130, 177, 177))
    dout = torch.randn_like(q)
    if kind == "bool":
        mask = torch.rand(2, 1, 130, 177, device="cuda") > 0.3
        mask[:, :, 5] = False
    else:
        mask = torch.randn(1, 4, 130, 177, device="cuda", dtype=torch.bfloat16)

    def ours(q, k, v):
        return flash_tile.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)

    def dense(q, k, v):
        ref_mask = mask if kind == "bool" else mask.to(q.dtype)
        return attention_dense(q, k, v, None, 0, (-1, -1), attn_mask=ref_mask, dropout_p=0.3,
                               dropout_seed=SEED)

    _check_grads(ours, dense, (q, k, v), dout)
    if kind == "bool":  # row 5 sees no key: exactly zero, not merely small
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = ours(*leaves)
        out.backward(dout)
        assert (out[:, :, 5] == 0).all() and (leaves[0].grad[:, :, 5] == 0).all()


def test_sdpa_function_dropout_matches_the_dense_reference(monkeypatch):
    monkeypatch.setattr(api, "_dropout_seed", lambda dropout_p: SEED)
    q, k, v = (torch.randn(2, 4, 150, 64, device="cuda", dtype=torch.float16)
               for _ in range(3))
    out = flash_tile.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
    ref = attention_dense(q.float(), k.float(), v.float(), None, 0, (-1, 0), dropout_p=0.25,
                          dropout_seed=SEED)
    low = attention_dense(q, k, v, None, 0, (-1, 0), dropout_p=0.25, dropout_seed=SEED)
    assert check_error(out, ref, low)["ok"]


def test_manual_seed_reproduces_dropout():
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))

    def run(seed):
        torch.manual_seed(seed)
        return flash_tile.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    plain = flash_tile.flash_attn_func(q, k, v, causal=True)
    assert not torch.equal(first, plain)
