"""The backward's CPU tile twin against autograd through float64 attention."""

import math

import pytest
import torch

from flash_tile.reference import (attention_dense, attention_tiles, attention_tiles_backward,
                                  visible_keys)

# (batch, heads, kv_heads, Lq, Lk, head_dim, v_head_dim, window, softcap, alibi, mask)
CASES = [
    ((1, 1, 1, 1, 1, 16, 16), (-1, -1), 0.0, False, None),
    ((2, 2, 2, 17, 17, 32, 32), (-1, 0), 0.0, False, None),
    ((1, 4, 2, 113, 203, 24, 40), (-1, 0), 0.0, False, None),    # bottom-right causal, GQA
    ((1, 2, 2, 203, 113, 16, 16), (-1, 0), 0.0, False, None),    # rows that see no key
    ((1, 4, 1, 70, 90, 32, 32), (20, 5), 0.0, False, None),      # window, MQA
    ((2, 2, 2, 64, 64, 16, 16), (-1, -1), 3.0, False, None),     # softcap
    ((1, 4, 2, 50, 77, 16, 8), (-1, 0), 2.0, True, None),        # softcap + ALiBi
    ((2, 2, 2, 40, 60, 16, 16), (-1, -1), 0.0, False, "bool"),   # boolean mask, empty row
    ((1, 2, 1, 40, 60, 16, 16), (-1, -1), 0.0, True, "additive"),
    ((1, 4, 2, 0, 17, 16, 16), (-1, 0), 0.0, False, None),       # no query rows
    ((2, 2, 1, 9, 0, 16, 8), (-1, -1), 0.0, False, None),        # no keys
]


def _autograd_reference(q, k, v, scale, offset, window, softcap, slopes, mask, dout, dlse):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_dense(q, k, v, scale, offset, window, softcap, slopes, mask,
                               return_lse=True)
    torch.autograd.backward((out, lse), (dout, torch.zeros_like(lse) if dlse is None else dlse))
    return out.detach(), q.grad, k.grad, v.grad


def _mask(kind, batch, heads, q_len, k_len, gen):
    """None, a boolean mask broadcast over heads with query row 2 hidden, or an additive one
    broadcast over batch and query rows."""
    if kind == "bool":
        mask = torch.rand(batch, 1, q_len, k_len, generator=gen) > 0.3
        mask[..., 2, :] = False
        return mask
    if kind == "additive":
        return torch.randn(1, heads, 1, k_len, generator=gen, dtype=torch.float64)
    return None


# The backward's tilings: (tile_m, tile_n, dq_tile_m, dq_tile_n, one_pass), the dQ pass's
# tiles None where they are the dK/dV pass's; the one-pass form sums dQ in the dK/dV walk.
TILINGS = {"16x16": (16, 16, None, None, False), "16x32": (16, 32, None, None, False),
           "32x16": (32, 16, None, None, False), "16x32-dq32x16": (16, 32, 32, 16, False),
           "16x32-one-pass": (16, 32, None, None, True)}


@pytest.mark.parametrize("lse_grad", [False, True], ids=["dout", "dout+dlse"])
@pytest.mark.parametrize("tiling", sorted(TILINGS))
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_backward_twin_matches_autograd(case, tiling, lse_grad):
    (batch, heads, kv_heads, q_len, k_len, d, dv), window, softcap, alibi, mask_kind = case
    gen = torch.Generator().manual_seed(q_len * 7 + k_len)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(batch, heads, q_len, d), randn(batch, kv_heads, k_len, d), \
        randn(batch, kv_heads, k_len, dv)
    dout = randn(batch, heads, q_len, dv)
    dlse = randn(batch, heads, q_len) if lse_grad else None  # as when ring attention merges
    slopes = torch.rand(batch, heads, generator=gen, dtype=torch.float64) * 0.3 if alibi else None
    mask = _mask(mask_kind, batch, heads, q_len, k_len, gen)
    scale, offset = 0.8 / math.sqrt(d), k_len - q_len
    tile_m, tile_n, dq_tile_m, dq_tile_n, one_pass = TILINGS[tiling]
    out, lse = attention_tiles(q, k, v, scale, offset, window, softcap, slopes, mask,
                               tile_m, tile_n)
    grads = attention_tiles_backward(q, k, v, out, lse, dout, scale, offset, window, softcap,
                                     slopes, mask, tile_m, tile_n, dlse, dq_tile_m=dq_tile_m,
                                     dq_tile_n=dq_tile_n, one_pass=one_pass)
    ref_out, *ref_grads = _autograd_reference(q, k, v, scale, offset, window, softcap, slopes,
                                              mask, dout, dlse)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert grad.shape == ref.shape, name
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-9, msg=name)
    # Rows that see no key have zero gradient.
    empty = ~visible_keys(q_len, k_len, offset, window).any(dim=-1)
    assert (grads[0][:, :, empty] == 0).all()


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[6], CASES[7], CASES[8]],
                         ids=["gqa", "window-mqa", "softcap-alibi", "bool-mask",
                              "alibi-additive-mask"])
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_backward_twin_with_dropout_matches_autograd(case, p):
    """dV and dP see the dropped, rescaled probabilities and dS the undropped ones: the twin
    against autograd through the dense reference with the same keep bits."""
    (batch, heads, kv_heads, q_len, k_len, d, dv), window, softcap, alibi, mask_kind = case
    gen = torch.Generator().manual_seed(q_len + 5 * k_len)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(batch, heads, q_len, d), randn(batch, kv_heads, k_len, d), \
        randn(batch, kv_heads, k_len, dv)
    dout = randn(batch, heads, q_len, dv)
    slopes = torch.rand(batch, heads, generator=gen, dtype=torch.float64) * 0.3 if alibi else None
    mask = _mask(mask_kind, batch, heads, q_len, k_len, gen)
    scale, offset, seed = 0.8 / math.sqrt(d), k_len - q_len, 31337
    out, lse = attention_tiles(q, k, v, scale, offset, window, softcap, slopes, mask, 16, 32,
                               dropout_p=p, dropout_seed=seed)
    grads = attention_tiles_backward(q, k, v, out, lse, dout, scale, offset, window, softcap,
                                     slopes, mask, 16, 32, dropout_p=p, dropout_seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention_dense(*leaves, scale, offset, window, softcap, slopes, mask,
                              dropout_p=p, dropout_seed=seed)
    ref_out.backward(dout)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-10, atol=1e-10)
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-9, atol=1e-9, msg=name)
