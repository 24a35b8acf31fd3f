"""The CPU tile reference against torch SDPA in float64, and its tile schedule."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_tile.reference import attention_tiles, cdiv, check_error, kv_tile_ranges

# (batch, heads, Lq, Lk, head_dim): lengths 1, 17, 64, 113/203, 1023/1024, Lq != Lk both ways.
SHAPES = [
    (1, 1, 1, 1, 64),
    (3, 2, 17, 17, 64),
    (1, 2, 64, 64, 128),
    (3, 1, 113, 203, 64),
    (1, 2, 203, 113, 128),
    (1, 1, 1, 203, 64),
    (1, 1, 203, 1, 64),
    (1, 1, 1023, 1024, 64),
    (1, 1, 1024, 1023, 64),
]


def _inputs(batch, heads, q_len, k_len, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen, dtype=torch.float64)
               for n in (q_len, k_len, k_len))
    return q, k, v


def _sdpa_bottom_right(q, k, v, scale):
    """torch SDPA with flash-attn's bottom-right causal mask as an explicit boolean mask."""
    q_len, k_len = q.shape[2], k.shape[2]
    rows = torch.arange(q_len)[:, None]
    cols = torch.arange(k_len)[None, :]
    mask = cols <= rows + (k_len - q_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.nan_to_num(0.0)  # rows with no visible key: SDPA gives NaN, flash-attn gives 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiles", [(64, 64), (16, 32), (32, 16)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_matches_sdpa(shape, tiles):
    q, k, v = _inputs(*shape, seed=sum(shape))
    scale = 0.7 / math.sqrt(shape[-1])
    tile_m, tile_n = tiles

    out, lse = attention_tiles(q, k, v, scale, causal=False, tile_m=tile_m, tile_n=tile_n)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=scale),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, torch.logsumexp(scale * q @ k.transpose(-1, -2), dim=-1),
                               rtol=1e-10, atol=1e-10)

    # Top-left alignment is SDPA's is_causal.
    out, _ = attention_tiles(q, k, v, scale, causal=True, causal_offset=0,
                             tile_m=tile_m, tile_n=tile_n)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   scale=scale),
                               rtol=1e-10, atol=1e-10)

    # Bottom-right alignment is flash-attn's causal.
    q_len, k_len = shape[2], shape[3]
    out, lse = attention_tiles(q, k, v, scale, causal=True, causal_offset=k_len - q_len,
                               tile_m=tile_m, tile_n=tile_n)
    torch.testing.assert_close(out, _sdpa_bottom_right(q, k, v, scale), rtol=1e-10, atol=1e-10)
    empty_rows = max(q_len - k_len, 0)
    assert torch.isinf(lse[..., :empty_rows]).all() and (lse[..., :empty_rows] > 0).all()
    assert torch.isfinite(lse[..., empty_rows:]).all()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(2, 2, 33, 47, 64, seed=3)
    out, _ = attention_tiles(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-10, atol=1e-10)


def test_large_scores_do_not_overflow():
    # Scores of several hundred: exp without the running max would overflow float64.
    q, k, v = _inputs(1, 1, 70, 130, 64, seed=5)
    out, _ = attention_tiles(q * 30, k * 30, v, causal=True, tile_m=16, tile_n=16)
    ref = F.scaled_dot_product_attention(q * 30, k * 30, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("q_len,k_len,offset", [(256, 256, 0), (128, 512, 384), (512, 128, -384),
                                                 (200, 300, 100), (64, 64, 0)])
@pytest.mark.parametrize("tile_m,tile_n", [(64, 64), (128, 64), (64, 32)])
def test_tile_schedule_skips_and_masks_exactly(q_len, k_len, offset, tile_m, tile_n):
    """Every tile the schedule drops is invisible, every unmasked one wholly visible, and
    every tile with both visible and hidden scores is masked."""
    for m_start in range(0, q_len, tile_m):
        n_full, n_end = kv_tile_ranges(m_start, tile_m, tile_n, k_len, True, offset)
        rows = torch.arange(m_start, m_start + tile_m)[:, None]
        for j in range(cdiv(k_len, tile_n)):
            cols = torch.arange(j * tile_n, (j + 1) * tile_n)[None, :]
            visible = (cols <= rows + offset) & (cols < k_len)
            if j >= n_end:
                assert not visible.any(), (m_start, j)
            elif j < n_full:
                assert visible.all(), (m_start, j)
            else:
                assert visible.any() and not visible.all(), (m_start, j)


def test_causal_skips_the_upper_triangle():
    """Square causal attention over T tiles visits T(T+1)/2 key tiles, not T^2."""
    tiles = 16
    visited = sum(kv_tile_ranges(m * 64, 64, 64, tiles * 64, True, 0)[1] for m in range(tiles))
    assert visited == tiles * (tiles + 1) // 2


def test_tolerance_rule_can_fail():
    gen = torch.Generator().manual_seed(11)
    ref = torch.randn(2, 3, 50, 64, generator=gen)
    pt = ref.to(torch.float16)
    assert check_error(pt, ref, pt)["ok"]
    wrong = pt.clone()
    wrong[0, 0, 0, 0] += 0.05
    assert not check_error(wrong, ref, pt)["ok"]
    assert not check_error(torch.full_like(pt, math.nan), ref, pt)["ok"]
