"""The CPU tile reference against torch SDPA in float64, and its tile schedule."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_tile.reference import (attention_dense, attention_tiles, cdiv, check_error,
                                  dropout_keep, kv_tile_runs, q_tile_runs, visible_keys)

# (batch, heads, kv_heads, Lq, Lk, head_dim, v_head_dim): lengths 1, 17, 64, 113/203,
# 1023/1024, Lq != Lk both ways, GQA ratios 1, 2, 4 and all (MQA), odd head dims.
SHAPES = [
    (1, 1, 1, 1, 1, 64, 64),
    (3, 2, 2, 17, 17, 64, 64),
    (1, 4, 2, 64, 64, 128, 128),
    (3, 4, 1, 113, 203, 40, 40),
    (1, 2, 2, 203, 113, 72, 24),
    (1, 8, 2, 1, 203, 8, 8),
    (1, 1, 1, 203, 1, 160, 160),
    (1, 2, 1, 1023, 1024, 64, 64),
    (1, 1, 1, 1024, 1023, 256, 256),
    (2, 4, 2, 0, 17, 32, 32),  # no query rows
    (2, 2, 1, 9, 0, 32, 16),   # no keys: every row sees none
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (37, -1), (16, 0), (5, 70), (300, 300)]


def _inputs(batch, heads, kv_heads, q_len, k_len, head_dim, v_head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, k_len, v_head_dim, generator=gen, dtype=torch.float64)
    return q, k, v


def _sdpa(q, k, v, scale, mask=None, bias=None):
    """torch SDPA (math, float64) with an explicit boolean mask and/or additive bias; rows with
    no visible key give NaN there and 0 in flash-attn's convention."""
    if bias is not None:
        mask = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.nan_to_num(0.0)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("tiles", [(64, 64), (16, 32), (32, 16)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_matches_sdpa(shape, tiles):
    q, k, v = _inputs(*shape, seed=sum(shape))
    q_len, k_len = shape[3], shape[4]
    scale = 0.7 / math.sqrt(shape[5])
    tile_m, tile_n = tiles

    out, lse = attention_tiles(q, k, v, scale, tile_m=tile_m, tile_n=tile_n)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale), rtol=1e-10, atol=1e-10)
    k_full = k.repeat_interleave(shape[1] // shape[2], dim=1)
    ref_lse = torch.logsumexp(scale * q @ k_full.transpose(-1, -2), -1)
    # torch's LSE of no keys is -inf; flash-attn's (and these kernels') is +inf.
    ref_lse = ref_lse.masked_fill(ref_lse == -math.inf, math.inf)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)

    # Top-left causal is SDPA's is_causal.
    out, _ = attention_tiles(q, k, v, scale, window=(-1, 0), tile_m=tile_m, tile_n=tile_n)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    # Bottom-right causal (flash-attn's): the first Lq - Lk rows see nothing.
    out, lse = attention_tiles(q, k, v, scale, diag_offset=k_len - q_len, window=(-1, 0),
                               tile_m=tile_m, tile_n=tile_n)
    mask = visible_keys(q_len, k_len, k_len - q_len, (-1, 0))
    torch.testing.assert_close(out, _sdpa(q, k, v, scale, mask), rtol=1e-10, atol=1e-10)
    empty_rows = max(q_len - k_len, 0)
    assert torch.isinf(lse[..., :empty_rows]).all() and (lse[..., :empty_rows] > 0).all()
    assert torch.isfinite(lse[..., empty_rows:]).all()


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("shape", SHAPES[2:6], ids=SHAPE_IDS[2:6])
def test_sliding_window(shape, window):
    q, k, v = _inputs(*shape, seed=7)
    q_len, k_len = shape[3], shape[4]
    offset = k_len - q_len
    mask = visible_keys(q_len, k_len, offset, window)
    out, lse = attention_tiles(q, k, v, 0.3, diag_offset=offset, window=window,
                               tile_m=32, tile_n=16)
    torch.testing.assert_close(out, _sdpa(q, k, v, 0.3, mask), rtol=1e-10, atol=1e-10)
    empty = ~mask.any(dim=-1)
    assert torch.isinf(lse[..., empty]).all() and torch.isfinite(lse[..., ~empty]).all()


@pytest.mark.parametrize("shape", SHAPES[1:6], ids=SHAPE_IDS[1:6])
def test_softcap_and_alibi(shape):
    q, k, v = _inputs(*shape, seed=9)
    batch, heads, q_len, k_len = shape[0], shape[1], shape[3], shape[4]
    scale, softcap, offset = 1.0 / math.sqrt(shape[5]), 2.5, k_len - q_len
    slopes = torch.rand(batch, heads, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(1)) * 0.3
    rows = torch.arange(q_len)[:, None] + offset
    cols = torch.arange(k_len)[None, :]
    bias = -slopes[..., None, None] * (rows - cols).abs()  # [B, H, Lq, Lk]
    k_full = k.repeat_interleave(heads // shape[2], dim=1)
    v_full = v.repeat_interleave(heads // shape[2], dim=1)
    capped = softcap * torch.tanh(scale * q @ k_full.transpose(-1, -2) / softcap)
    for window in [(-1, -1), (-1, 0)]:
        mask = visible_keys(q_len, k_len, offset, window)
        logits = (capped + bias).masked_fill(~mask, -math.inf)
        ref = torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v_full
        out, lse = attention_tiles(q, k, v, scale, diag_offset=offset, window=window,
                                   softcap=softcap, alibi_slopes=slopes, tile_m=16, tile_n=32)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        ref_lse = torch.logsumexp(logits, dim=-1)
        ref_lse = torch.where(ref_lse == -math.inf, math.inf, ref_lse)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(attention_dense(q, k, v, scale, offset, window, softcap,
                                                   slopes), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES[1:6], ids=SHAPE_IDS[1:6])
def test_attention_masks(shape):
    """Bool and additive masks broadcast from smaller shapes, fully masked rows included."""
    q, k, v = _inputs(*shape, seed=13)
    batch, heads, q_len, k_len = shape[0], shape[1], shape[3], shape[4]
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(batch, 1, q_len, k_len, generator=gen) > 0.3  # broadcast over heads
    keep[..., 0, :] = False  # a fully masked row
    bias = torch.randn(1, heads, 1, k_len, generator=gen, dtype=torch.float64)
    for mask in (keep, bias):
        out, _ = attention_tiles(q, k, v, 0.5, attn_mask=mask, tile_m=16, tile_n=32)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5,
                                             enable_gqa=q.shape[1] != k.shape[1])
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(attention_dense(q, k, v, 0.5, attn_mask=mask), ref,
                                   rtol=1e-10, atol=1e-10)
    assert (out[:, :, 0] != 0).all()  # additive: the first row is not empty
    out, lse = attention_tiles(q, k, v, 0.5, attn_mask=keep, tile_m=16, tile_n=32)
    assert (out[:, :, 0] == 0).all() and torch.isinf(lse[:, :, 0]).all()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(2, 2, 2, 33, 47, 64, 64, seed=3)
    out, _ = attention_tiles(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-10, atol=1e-10)


def test_large_scores_do_not_overflow():
    # Scores of several hundred: exp without the running max would overflow float64.
    q, k, v = _inputs(1, 1, 1, 70, 130, 64, 64, seed=5)
    out, _ = attention_tiles(q * 30, k * 30, v, window=(-1, 0), tile_m=16, tile_n=16)
    ref = F.scaled_dot_product_attention(q * 30, k * 30, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("q_len,k_len", [(256, 256), (128, 512), (512, 128), (200, 300),
                                         (113, 203), (1, 17)])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("tile_m,tile_n", [(64, 64), (128, 64), (64, 32)])
def test_dkdv_schedule_unmasked_query_tiles_are_whole_and_visible(q_len, k_len, window, tile_m,
                                                                  tile_n):
    """The dK/dV pass's query-tile runs: every tile it drops is invisible to the key tile and
    every unmasked one wholly visible and wholly inside the sequence's q_len rows, which is
    why the VARLEN dK/dV masks the rows past the sequence (the next one's) in the masked runs
    only."""
    offset = k_len - q_len
    visible = visible_keys(cdiv(q_len, tile_m) * tile_m, k_len, offset, window)
    visible[q_len:] = False  # rows past the sequence
    for n_start in range(0, k_len, tile_n):
        i_start, i_inner, i_outer, i_end = q_tile_runs(n_start, tile_n, tile_m, q_len, offset,
                                                       window)
        assert i_outer * tile_m <= q_len or i_outer == i_inner
        for i in range(cdiv(q_len, tile_m)):
            seen = visible[i * tile_m:(i + 1) * tile_m, n_start:n_start + tile_n]
            if not i_start <= i < i_end:
                assert not seen.any(), (n_start, i)
            elif i_inner <= i < i_outer:
                assert seen.all() and (i + 1) * tile_m <= q_len, (n_start, i)


@pytest.mark.parametrize("q_len,k_len", [(256, 256), (128, 512), (512, 128), (200, 300)])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("tile_m,tile_n", [(64, 64), (128, 64), (64, 32)])
def test_tile_schedule_skips_and_masks_exactly(q_len, k_len, window, tile_m, tile_n):
    """Every tile the schedule drops is invisible, every unmasked one wholly visible, and
    every masked one partly visible (or the ragged end)."""
    offset = k_len - q_len
    for m_start in range(0, q_len, tile_m):
        n_start, n_inner, n_outer, n_end = kv_tile_runs(m_start, tile_m, tile_n, k_len, offset,
                                                        window)
        visible_rows = visible_keys(m_start + tile_m, cdiv(k_len, tile_n) * tile_n, offset,
                                    window)[m_start:]
        visible_rows[:, k_len:] = False  # the ragged end's padding
        for j in range(cdiv(k_len, tile_n)):
            visible = visible_rows[:, j * tile_n:(j + 1) * tile_n]
            if not n_start <= j < n_end:
                assert not visible.any(), (m_start, j)
            elif n_inner <= j < n_outer:
                assert visible.all(), (m_start, j)
            else:
                assert not visible.all(), (m_start, j)


def test_causal_skips_the_upper_triangle():
    """Square causal attention over T tiles visits T(T+1)/2 key tiles, not T^2."""
    tiles = 16
    visited = sum(kv_tile_runs(m * 64, 64, 64, tiles * 64, 0, (-1, 0))[3] for m in range(tiles))
    assert visited == tiles * (tiles + 1) // 2


def test_window_cost_grows_with_the_window_not_the_length():
    """A 256-key window over 16k keys visits at most (256 + 64) / 64 + 1 tiles per row tile."""
    for k_len in (4096, 16384):
        counts = {kv_tile_runs(m, 64, 64, k_len, 0, (256, 0))[3]
                  - kv_tile_runs(m, 64, 64, k_len, 0, (256, 0))[0] for m in range(0, k_len, 64)}
        assert max(counts) <= 6


def test_tolerance_rule_can_fail():
    gen = torch.Generator().manual_seed(11)
    ref = torch.randn(2, 3, 50, 64, generator=gen)
    pt = ref.to(torch.float16)
    assert check_error(pt, ref, pt)["ok"]
    wrong = pt.clone()
    wrong[0, 0, 0, 0] += 0.05
    assert not check_error(wrong, ref, pt)["ok"]
    assert not check_error(torch.full_like(pt, math.nan), ref, pt)["ok"]
    # An overflow in PyTorch's own result gives no bound: the check fails, not passes all.
    overflowed = pt.clone()
    overflowed[1, 2, 3, 4] = math.inf
    assert not check_error(wrong + 5, ref, overflowed)["ok"]


@pytest.mark.parametrize("shape", SHAPES[1:6], ids=SHAPE_IDS[1:6])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_twin_matches_dense_dropout(shape, p):
    """Dropout acts on the probabilities after the softmax: the tile twin against softmax, the
    same keep bits and the 1 / (1 - p) scale written densely; the LSE is unchanged."""
    q, k, v = _inputs(*shape, seed=13)
    batch, heads, q_len, k_len = shape[0], shape[1], shape[3], shape[4]
    scale, offset, window, seed = 1.0 / math.sqrt(shape[5]), k_len - q_len, (-1, 0), 987654
    keep = dropout_keep(p, seed, batch, heads, q_len, k_len)
    k_full = k.repeat_interleave(heads // shape[2], dim=1)
    v_full = v.repeat_interleave(heads // shape[2], dim=1)
    logits = (scale * q @ k_full.transpose(-1, -2)).masked_fill(
        ~visible_keys(q_len, k_len, offset, window), -math.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    ref = (probs * keep / (1 - p)) @ v_full
    out, lse = attention_tiles(q, k, v, scale, offset, window, tile_m=16, tile_n=32,
                               dropout_p=p, dropout_seed=seed)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    _, lse_plain = attention_tiles(q, k, v, scale, offset, window, tile_m=16, tile_n=32)
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=0)
    torch.testing.assert_close(attention_dense(q, k, v, scale, offset, window, dropout_p=p,
                                               dropout_seed=seed), ref, rtol=1e-10, atol=1e-10)


def test_dropout_keep_bits_are_a_fair_and_independent_hash():
    batch, heads, q_len, k_len = 2, 4, 256, 256
    for p in (0.1, 0.3, 0.9):
        keep = dropout_keep(p, 2024, batch, heads, q_len, k_len)
        # 524288 bits: the dropped fraction is within 5 standard deviations of p.
        sigma = math.sqrt(p * (1 - p) / keep.numel())
        assert abs((~keep).float().mean().item() - p) < 5 * sigma
    keep = dropout_keep(0.5, 2024, batch, heads, q_len, k_len)
    # Rows, columns, heads, batches and seeds each get their own bits: agreement within 5
    # standard deviations of a half (the neighbour test below looks closer).
    for a, b in [(keep[0, 0, 0], keep[0, 0, 1]), (keep[0, 0, :, 0], keep[0, 0, :, 1]),
                 (keep[0, 0], keep[0, 1]), (keep[0, 0], keep[1, 0]),
                 (keep, dropout_keep(0.5, 2025, batch, heads, q_len, k_len))]:
        agree = (a == b).float().mean().item()
        assert abs(agree - 0.5) < 5 * 0.5 / math.sqrt(a.numel()), agree
    assert torch.equal(keep, dropout_keep(0.5, 2024, batch, heads, q_len, k_len))
    assert dropout_keep(0.0, 7, 1, 1, 64, 64).all()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dropout_keep_bits_of_neighbouring_scores_are_independent(seed):
    """Over 2048 x 2048 bits at p = 0.5: the 16 patterns of 2 x 2 neighbours are equally
    frequent (chi-square, 15 degrees of freedom, under 45: p ~ 1e-4 for fair bits) and bits at
    offsets along rows and columns do not correlate (|z| < 5). A per-score hash of one
    multiply fails both (chi-square 111, z 6.8 at seed 1), which is why the kernels' takes two."""
    keep = dropout_keep(0.5, seed, 1, 6, 2048, 2048)[0, 5].to(torch.int64)
    patterns = (keep[:-1, :-1] * 8 + keep[:-1, 1:] * 4 + keep[1:, :-1] * 2 + keep[1:, 1:])
    counts = torch.bincount(patterns.flatten(), minlength=16).double()
    expected = patterns.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 45
    centred = keep.double() - keep.double().mean()
    for di, dj in [(0, 1), (1, 0), (1, 1), (0, 2), (0, 16), (0, 64), (16, 0), (64, 0)]:
        a, b = centred[:2048 - di, :2048 - dj], centred[di:, dj:]
        z = (a * b).mean().item() / centred.var().item() * math.sqrt(a.numel())
        assert abs(z) < 5, (di, dj, z)


@pytest.mark.parametrize("window,rows", [
    ((1, 0), ["001100", "000110", "000011"]),
    ((2, 1), ["011110", "001111", "000111"]),
    ((-1, 0), ["111100", "111110", "111111"]),
])
def test_window_rule_written_out(window, rows):
    """flash-attn's rule written out by hand for Lq = 3, Lk = 6 (bottom-right: diag_offset
    3): row i sees key j iff i + 3 - left <= j <= i + 3 + right, -1 unbounded. Everything
    else (the twin, the GPU references, the masks built for SDPA) derives from visible_keys,
    so this is where the rule is stated independently."""
    want = torch.tensor([[c == "1" for c in row] for row in rows])
    assert torch.equal(visible_keys(3, 6, 3, window), want)
