"""Attention against a KV cache (decode, speculative decoding, chunked prefill) in cuTile.

Maths. As ``attention_fwd``: for query row i of a sequence whose cache holds k_len keys,
o_i = sum_j softmax_j(s_ij) v_j over the keys j that row i sees, with the same scores (scale,
SOFTCAP, ALIBI) and the same online softmax in log2 units. Decode differs in its work split:

- GQA packed into M. The G = H / H_kv query heads that share a key/value head, and TILE_LQ of
  the Lq query rows, form one [TILE_LQ * TILE_G, D] tile, row r being query row
  r // TILE_G of head r % TILE_G of the group (FA3's pack_gqa, FlashInfer's GQA decode): at
  Lq = 1 the tensor cores still get 16 rows (a group of 8 heads takes two query rows, the
  second past Lq and never stored), and each K/V tile is read once per group, not per head.
- Split-KV. The keys a query tile sees are cut into NUM_SPLITS contiguous runs of key tiles,
  one program each, so that a batch of one long sequence still fills the GPU. Under SPLIT each
  program stores its normalised partial output o_s and its partial LSE lse_s (natural log)
  to a float32 workspace, and ``decode_combine`` merges them:

      lse = log sum_s exp(lse_s),     o = sum_s exp(lse_s - lse) o_s.

  A split that sees no key stores lse_s = -inf and o_s = 0, which add nothing. Without SPLIT
  the program writes the output and the LSE itself.

Masking. Causal and windows are aligned bottom-right per sequence, as flash-attn's
``flash_attn_with_kvcache``: row i of Lq sees key j iff j < k_len and

    i + k_len - Lq - window_left <= j        (when MASK_LEFT)
    j <= i + k_len - Lq + window_right       (when MASK_RIGHT; causal: window_right = 0)

Under LEFTPAD sequence b's keys start at cache row LeftPad[b] (flash-attn's ``cache_leftpad``):
its keys are rows LeftPad[b] .. k_len - 1, k_len counting the pad. The kernel works in cache
rows throughout: with key j' = j - LeftPad[b] and k_len' = k_len - LeftPad[b] counted from the
first key, i + k_len' - Lq - window_left <= j' is i + k_len - Lq - window_left <= j (and so
for the right bound and ALiBi's distance), so the pad is one more lower bound, j >= LeftPad[b],
and the key tiles wholly before it are skipped.

FP8 cache. K and V may be float8_e4m3fn with Q in float16 or bfloat16 (what serving engines
keep: half the bytes a step reads), standing for KDescale[b, h] k8 and VDescale[b, h] v8 per
(sequence, key/value head). Each tile is widened after its load (exact: every e4m3 value is
a float16 and a bfloat16): K to Q's dtype, V to float16 (one case aside, below; one
conversion on sm_90, where bfloat16 takes three), and P V runs in float16 with P scaled by
2^8 (softmax_step's P_LOG2_SCALE, m_i running 8 below the row max: the output's 1 / l_i
cancels it and the LSE is unchanged), so that float16's range loses only weights under
2^-32 of their row's max and rounds P to 11 bits, where bfloat16 kept 8. With bfloat16 Q at
Dv > 128 V widens to bfloat16 and P runs unscaled in it: float16 there spilled and cost
1.25-1.30x the step. The key descale joins the softmax scale once per program (so softcap,
the LSE and the masks see the dequantized scores) and the value descale
multiplies the output (each split's, before the combine, which is linear in them). No switch:
the cache's dtype is a compile-time fact.
``cache_append`` writes new rows given in Q's dtype as x / descale rounded to e4m3 (saturating
at +-448), and new rows given in e4m3 as they are (rotated under ROTARY: the rotation is
linear, so it commutes with the descale).

Under ATTN_MASK a boolean mask shared by the heads, Mask [B, 1, Lq, L] (L the cache's
capacity, True = attend, as torch's SDPA; bool, or its uint8 view where TMA can read the
rows), hides more keys: row i sees key j only where Mask[b, 0, i, j] also holds. It is what a
Transformers static cache passes each step (the slots not yet written, a left-padded
batch's pad): the decode takes it on the device, with no sync and no count of the keys. Each
step loads its [TILE_LQ, TILE_N] piece once for the group and repeats it over the group's
packed rows. The masked keys' V rows are read as they are, so they must be finite (a cache
that is zero-filled, as Transformers' are).

A row that sees no key gets an output of 0 and an LSE of +inf, as the forward. Under SINKS
the head's sink starts split 0's running max and sum (as the forward's SINKS switch), so that
the combine counts it once; a row that sees no key then gets 0 and an LSE of the sink.

Layout. Q [B, Lq, H_kv, G, D] (flash-attn's [B, Lq, H, D] with its heads split, a view);
K [Bc, L_cache, H_kv, D] and V [Bc, L_cache, H_kv, Dv] (flash-attn's cache as it is: the tile
loads take its axes in the order they need, so the host passes no view), or under PAGED the
pages [num_blocks, page_size, H_kv, D] with BlockTable [B, max_blocks] int32 giving sequence
b's page of keys [p * page_size, (p + 1) * page_size), any page size: a key tile of TILE_N
keys joins TILE_N // PAGE_N tile loads of PAGE_N keys (PAGE_N divides the page size, so each
lies in one page), or under GATHER (pages without such a load) its rows are gathered, each
from its page.
SeqLensK [B] int32 plus the scalar new_len is each sequence's key count, BatchIdx [B] int32
(under BATCH_IDX) the cache row of sequence b. Out [B, Lq, H_kv, G, Dv] in Q's dtype and Lse
[B, H_kv, G, Lq] fp32 (flash-attn's [B, H, Lq]); the SPLIT workspace OutSplit [NUM_SPLITS, B,
Lq, H_kv, G, Dv] and LseSplit [NUM_SPLITS, B, Lq, H_kv, G], fp32. D and Dv need not be powers
of two: tiles are zero-padded by the loads and clipped by the stores, as in the forward.

``cache_append`` writes new keys and values into the cache at each sequence's length before
the attention reads it: one program per (new row, key/value head, sequence). Under ROTARY it
rotates the new keys on the way (rotary embedding at their cache positions) and writes the
rotated queries to QRot, which the decode then reads: column d < R (R = rotary_dim) of a row at
position t becomes

    x_d cos(t, f(d)) -/+ x_partner(d) sin(t, f(d))      (minus when d is its pair's first),

with pairs (2f, 2f + 1) under INTERLEAVED (GPT-J) and (f, f + R/2) otherwise (GPT-NeoX), cos
and sin [L_ro, R/2] given; the columns from R on pass through. Computed in fp32, rounded once.
"""

import math

import cuda.tile as ct

from ._pages import kv_tile, page_rows
from ._tiles import (FP8_P_LOG2_SCALE, LN_2, LOG2_E, NO_MASK, ZERO, ConstBool, ConstInt,
                     descale, keep_tile, log2_scores, sink_start, softmax_step)

NEG_INF = ct.PaddingMode.NEG_INF


def _cache_row(BatchIdx, batch, BATCH_IDX: ConstBool):
    """The cache's batch row of sequence ``batch``."""
    if BATCH_IDX:
        return ct.load(BatchIdx, (batch,), shape=()).item()
    return batch


def split_key_tiles(first_row, last_row, k_len, k_lo, diag_offset, window_left, window_right,
                    split, TILE_N: ConstInt, NUM_SPLITS: ConstInt, MASK_LEFT: ConstBool,
                    MASK_RIGHT: ConstBool, LEFTPAD: ConstBool):
    """Split ``split``'s run [n_start, n_end) of the key tiles that some query row from
    first_row to last_row sees (and, under LEFTPAD, that reach past the pad's last row
    k_lo - 1), the runs cut evenly into NUM_SPLITS, the last ones possibly empty. Plain
    integer code: the CPU twin (``flash_tile.reference_decode``) walks the same runs."""
    n_lo = 0
    if MASK_LEFT:
        n_lo = max(min(first_row + diag_offset - window_left, k_len), 0) // TILE_N
    if LEFTPAD:
        n_lo = max(n_lo, k_lo // TILE_N)
    n_hi = ct.cdiv(k_len, TILE_N)
    if MASK_RIGHT:
        n_hi = ct.cdiv(max(min(last_row + diag_offset + window_right + 1, k_len), 0), TILE_N)
    per_split = ct.cdiv(max(n_hi - n_lo, 0), NUM_SPLITS)
    n_start = n_lo + split * per_split
    return n_start, min(n_start + per_split, n_hi)


def _per_row(head_values, TILE_LQ: ConstInt, TILE_G: ConstInt):
    """A [1, TILE_G] tile of per-head values as one per packed row, [TILE_LQ * TILE_G, 1]."""
    return ct.broadcast_to(head_values, (TILE_LQ, TILE_G)).reshape((TILE_LQ * TILE_G, 1))


def _mask_rows(Mask, batch, tile_q, j, TILE_LQ: ConstInt, TILE_G: ConstInt,
               TILE_N: ConstInt):
    """Under ATTN_MASK: which keys of key tile j each packed row may see, [TILE_LQ * TILE_G,
    TILE_N] (or [1, TILE_N] when TILE_LQ is 1, which broadcasts): the [TILE_LQ, TILE_N] piece
    of Mask [B, 1, Lq, L] for query tile ``tile_q``, repeated over the group's heads. Rows past
    Lq and keys past L read False."""
    mask = keep_tile(Mask, batch, 0, tile_q, j, TILE_LQ, TILE_N, False)
    if TILE_LQ == 1:
        return mask
    return ct.broadcast_to(mask.reshape((TILE_LQ, 1, TILE_N)),
                           (TILE_LQ, TILE_G, TILE_N)).reshape((TILE_LQ * TILE_G, TILE_N))


def _slopes(Slopes, batch, kv_head, TILE_LQ: ConstInt, TILE_G: ConstInt, ALIBI: ConstBool):
    """The ALiBi slope of each packed row, [TILE_LQ * TILE_G, 1] (0.0 without ALIBI)."""
    if not ALIBI:
        return 0.0
    slope = ct.load(Slopes, index=(batch, kv_head, 0), shape=(1, 1, TILE_G), padding_mode=ZERO)
    return _per_row(slope.reshape((1, TILE_G)), TILE_LQ, TILE_G)


def _attend_kv_tile(q, kv, rows, band, tile_q, j, m_i, l_i, acc, TILES, FEATURES,
                    LEFTPAD: ConstBool, Mask, ATTN_MASK: ConstBool):
    """One online-softmax step over key tile j; returns (m_i, l_i, acc). Every tile is
    masked (the band, and k_len): the cost of decode is the K/V read. V's rows past k_len
    (and under LEFTPAD before the first key) are zeroed too: a stale cache may hold NaN there,
    and the zero probabilities of those keys would still make 0 * NaN = NaN in P V. Only in
    the tile that k_len (or the pad) cuts: the branch is the same for the whole CTA (j is a
    scalar), and the select in every step cost 8-24% of the GB/s on the H200 (2026-12-02,
    occupancy 2, B 1-128, L 4k-128k)."""
    K, V, _, _, batch, _, _, k_lo, _ = kv
    TILE_LQ, TILE_G, TILE_N, TILE_D, TILE_DV, PAGED, PAGE_N, GATHER, P_LOG2_SCALE = TILES
    TILE_M = TILE_LQ * TILE_G
    pages = None
    if GATHER:  # once for K and V
        pages = page_rows(kv, j, TILE_N)
    # An FP8 cache's K in q's dtype (its descale is in the scale): [D, N]
    k_t = kv_tile(K, kv, j, pages, TILE_N, TILE_D, PAGED, PAGE_N, GATHER, True, q.dtype)
    s = ct.mma(q, k_t, ct.zeros((TILE_M, TILE_N), ct.float32))
    offs_k = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
    # K stands in for log2_scores' Mask, never read: the decode's FEATURES carry NO_MASK
    # there, its own [B, 1, Lq, L] mask applies below through its packed rows' view.
    s, factor, _ = log2_scores(s, rows, offs_k, K, tile_q, j, band, TILE_M, TILE_N, True,
                               FEATURES, False, True)
    if ATTN_MASK:
        s = ct.where(_mask_rows(Mask, batch, tile_q, j, TILE_LQ, TILE_G, TILE_N), s, -math.inf)
    cut = (j + 1) * TILE_N > band[0]
    if LEFTPAD:
        padded = j * TILE_N < k_lo
        if padded:
            s = ct.where(offs_k >= k_lo, s, -math.inf)
        cut = cut | padded
    # Every tile is masked (GUARD).
    m_new, p, alpha, l_i = softmax_step(s, factor, m_i, l_i, True, P_LOG2_SCALE, True)
    # An FP8 cache's V (its descale multiplies the output) in float16: one conversion from
    # e4m3 on sm_90 where bfloat16 takes three, and P keeps 11 bits; P unscaled (bfloat16 q
    # at Dv > 128, ``_decode_impl``) keeps q's dtype. [N, DV]
    v = kv_tile(V, kv, j, pages, TILE_N, TILE_DV, PAGED, PAGE_N, GATHER, False,
                ct.float16 if P_LOG2_SCALE else q.dtype)
    if cut:
        rows_v = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]  # V's keys
        v = ct.where((rows_v < band[0]) & (rows_v >= k_lo), v, 0.0).astype(v.dtype)
    acc = ct.mma(p.astype(v.dtype), v, acc * alpha)
    return m_new, l_i, acc


def _decode_impl(Q, K, V, Out, Lse, OutSplit, LseSplit, SeqLensK, BatchIdx, BlockTable, Slopes,
                 Sinks, LeftPad, Mask, KDescale, VDescale, qk_scale, softcap, window_left,
                 window_right, new_len, NUM_SPLITS: ConstInt, TILE_LQ: ConstInt, TILE_G: ConstInt,
                 TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt, MASK_LEFT: ConstBool,
                 MASK_RIGHT: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool,
                 PAGED: ConstBool, PAGE_N: ConstInt, GATHER: ConstBool, BATCH_IDX: ConstBool,
                 SPLIT: ConstBool, STORE_LSE: ConstBool, SINKS: ConstBool, LEFTPAD: ConstBool,
                 ATTN_MASK: ConstBool):
    """Split bid(0) % NUM_SPLITS of query tile bid(0) // NUM_SPLITS, key/value head bid(1),
    sequence bid(2)."""
    TILE_M = TILE_LQ * TILE_G
    # Programmatic dependent launch (sm_90+): the combine may be scheduled while this grid's
    # last programs run, and this grid while the append's do; each waits for its
    # predecessor's writes before its first read (a no-op launched without the attribute).
    ct.grid_dependency_control_launch_dependents()
    ct.grid_dependency_control_wait()
    split = ct.bid(0) % NUM_SPLITS
    tile_q = ct.bid(0) // NUM_SPLITS
    kv_head = ct.bid(1)
    batch = ct.bid(2)
    q_len = Q.shape[1]
    k_len = ct.load(SeqLensK, (batch,), shape=()).item() + new_len
    diag_offset = k_len - q_len
    cache_row = _cache_row(BatchIdx, batch, BATCH_IDX)
    page_size = K.shape[1]
    if K.dtype != Q.dtype:  # an FP8 cache: the scores are those of KDescale * k8
        qk_scale = qk_scale * descale(KDescale, batch, kv_head)

    q = ct.load(Q, index=(batch, tile_q, kv_head, 0, 0), shape=(1, TILE_LQ, 1, TILE_G, TILE_D),
                padding_mode=ZERO).reshape((TILE_M, TILE_D))
    # Packed row r is query row tile_q * TILE_LQ + r // TILE_G.
    offs_q = tile_q * TILE_LQ + ct.arange(TILE_M, dtype=ct.int32)[:, None] // TILE_G
    band = (k_len, qk_scale, softcap, diag_offset, window_left, window_right)
    # An FP8 cache's P V runs in float16 on P scaled by 2**P_LOG2_SCALE (``_attend_kv_tile``),
    # but with bfloat16 q at Dv > 128 in bfloat16 on P as it is: there the float16 tiles took
    # sm_90 from 148 to 254 LDL/STL and the step 1.25-1.30x the time (H100, 2026-12-07).
    P_LOG2_SCALE = 0
    if V.dtype != Q.dtype and (Q.dtype == ct.float16 or TILE_DV <= 128):
        P_LOG2_SCALE = FP8_P_LOG2_SCALE
    TILES = (TILE_LQ, TILE_G, TILE_N, TILE_D, TILE_DV, PAGED, PAGE_N, GATHER, P_LOG2_SCALE)
    FEATURES = (MASK_LEFT, MASK_RIGHT, False, SOFTCAP, ALIBI, NO_MASK, False)
    rows = (batch, kv_head, offs_q, _slopes(Slopes, batch, kv_head, TILE_LQ, TILE_G, ALIBI), 0)

    # The key tiles some row of this query tile sees, then this split's share of them.
    first_row = tile_q * TILE_LQ
    k_lo = 0
    if LEFTPAD:
        k_lo = ct.load(LeftPad, (batch,), shape=()).item()
    n_start, n_end = split_key_tiles(first_row, min(first_row + TILE_LQ, q_len) - 1, k_len,
                                     k_lo, diag_offset, window_left, window_right, split,
                                     TILE_N, NUM_SPLITS, MASK_LEFT, MASK_RIGHT, LEFTPAD)

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((TILE_M, 1), dtype=ct.float32)
    if SINKS:
        if split == 0:  # the sink joins one split's softmax; the combine counts it once
            sink = ct.load(Sinks, index=(kv_head, 0), shape=(1, TILE_G), padding_mode=ZERO)
            m_i, l_i = sink_start(_per_row(sink * LOG2_E, TILE_LQ, TILE_G), TILE_M, 1,
                                  P_LOG2_SCALE)
    acc = ct.zeros((TILE_M, TILE_DV), dtype=ct.float32)
    # What every key tile's loads read: the caches, where the sequence's keys are (its cache
    # row, or its pages), and its bounds.
    kv = (K, V, BlockTable, cache_row, batch, kv_head, page_size, k_lo, k_len)
    for j in range(n_start, n_end):
        m_i, l_i, acc = _attend_kv_tile(q, kv, rows, band, tile_q, j, m_i, l_i, acc, TILES,
                                        FEATURES, LEFTPAD, Mask, ATTN_MASK)

    empty = l_i == 0.0
    inv_l = 1.0 / ct.where(empty, 1.0, l_i)
    if V.dtype != Q.dtype:  # an FP8 cache: the values are VDescale * v8
        inv_l = inv_l * descale(VDescale, batch, kv_head)
    out = acc * inv_l  # [TILE_M, TILE_DV], 0 where empty
    lse = m_i * LN_2 + ct.log(l_i)  # -inf where empty
    if SPLIT:
        ct.store(OutSplit, index=(split, batch, tile_q, kv_head, 0, 0),
                 tile=out.reshape((1, 1, TILE_LQ, 1, TILE_G, TILE_DV)))
        ct.store(LseSplit, index=(split, batch, tile_q, kv_head, 0),
                 tile=lse.reshape((1, 1, TILE_LQ, 1, TILE_G)))
    else:
        ct.store(Out, index=(batch, tile_q, kv_head, 0, 0),
                 tile=out.astype(Out.dtype).reshape((1, TILE_LQ, 1, TILE_G, TILE_DV)))
        if STORE_LSE:
            lse = ct.where(empty, math.inf, lse).reshape((TILE_LQ, TILE_G))
            ct.store(Lse, index=(batch, kv_head, 0, tile_q),
                     tile=ct.permute(lse, (1, 0)).reshape((1, 1, TILE_G, TILE_LQ)))


def _rotary_lanes(rotary_dim, TILE_D: ConstInt, INTERLEAVED: ConstBool):
    """For the columns d of a [1, TILE_D] row: (d, the column d is paired with, its frequency
    f(d), whether d is its pair's first, whether d rotates (d < rotary_dim))."""
    d = ct.arange(TILE_D, dtype=ct.int32)[None, :]
    if INTERLEAVED:  # pairs (2f, 2f + 1)
        first = (d & 1) == 0
        partner = d ^ 1
        freq = d >> 1
    else:  # pairs (f, f + R/2)
        half = rotary_dim // 2
        first = d < half
        partner = ct.where(first, d + half, d - half)
        freq = ct.where(first, d, d - half)
    return d, partner, freq, first, d < rotary_dim


def _rotate(x, x_partner, pos, Cos, Sin, lanes):
    """Rows x [R, TILE_D] at positions ``pos`` ([R, 1] or a scalar) rotated, fp32; x_partner
    holds each column's pair partner (0 where it does not rotate). Cos/Sin gather 1 and 0 for
    the columns that pass through."""
    _, _, freq, first, rotates = lanes
    cos = ct.gather(Cos, (pos, freq), mask=rotates, padding_value=1.0).astype(ct.float32)
    sin = ct.gather(Sin, (pos, freq), mask=rotates).astype(ct.float32)
    x_partner = x_partner.astype(ct.float32)
    return x.astype(ct.float32) * cos + ct.where(first, -x_partner, x_partner) * sin


def _to_cache(x, Cache, New, Descale, batch, kv_head):
    """A new row x (of New's dtype, or fp32 after a rotation) as the cache stores it: into
    an FP8 cache from a wider dtype as x / descale rounded to e4m3 (the conversion
    saturates), otherwise rounded to the cache's dtype (e4m3 rows rotated in fp32 go back
    unscaled: the rotation is linear)."""
    if Cache.dtype == ct.float8_e4m3fn:
        if New.dtype != Cache.dtype:  # rows in Q's dtype: quantized by the cache's factor
            x = x.astype(ct.float32) * (1.0 / descale(Descale, batch, kv_head))
    return x.astype(Cache.dtype)


def _append_impl(KNew, VNew, K, V, CacheSeqLens, BatchIdx, BlockTable, Q, QRot, Cos, Sin,
                 KDescale, VDescale, new_len, rotary_dim, q_step, TILE_D: ConstInt,
                 TILE_DV: ConstInt, TILE_G: ConstInt, PAGED: ConstBool, BATCH_IDX: ConstBool,
                 ROTARY: ConstBool, INTERLEAVED: ConstBool):
    """Row bid(0) of KNew/VNew of key/value head bid(1) of sequence bid(2) into the cache
    (rotated under ROTARY), and under ROTARY query row bid(0) of the head's group into QRot."""
    ct.grid_dependency_control_launch_dependents()  # the decode waits for these writes
    i = ct.bid(0)
    kv_head = ct.bid(1)
    batch = ct.bid(2)
    seqlen = ct.load(CacheSeqLens, (batch,), shape=()).item()
    if i < new_len:
        pos = seqlen + i
        row = _cache_row(BatchIdx, batch, BATCH_IDX)
        if PAGED:
            page_size = K.shape[1]
            row = ct.load(BlockTable, (batch, pos // page_size), shape=()).item()
            pos = pos % page_size
        if ROTARY:
            lanes = _rotary_lanes(rotary_dim, TILE_D, INTERLEAVED)
            k = _rotate(ct.gather(KNew, (batch, i, kv_head, lanes[0])),
                        ct.gather(KNew, (batch, i, kv_head, lanes[1]), mask=lanes[4]),
                        seqlen + i, Cos, Sin, lanes).reshape((1, 1, 1, TILE_D))
        else:
            k = ct.load(KNew, index=(batch, i, kv_head, 0), shape=(1, 1, 1, TILE_D),
                        padding_mode=ZERO)
        ct.store(K, index=(row, pos, kv_head, 0),
                 tile=_to_cache(k, K, KNew, KDescale, batch, kv_head))
        v = ct.load(VNew, index=(batch, i, kv_head, 0), shape=(1, 1, 1, TILE_DV),
                    padding_mode=ZERO)
        ct.store(V, index=(row, pos, kv_head, 0),
                 tile=_to_cache(v, V, VNew, VDescale, batch, kv_head))
    if ROTARY:
        if i < Q.shape[1]:
            lanes = _rotary_lanes(rotary_dim, TILE_D, INTERLEAVED)
            heads = ct.arange(TILE_G, dtype=ct.int32)[:, None]
            q = _rotate(ct.gather(Q, (batch, i, kv_head, heads, lanes[0])),
                        ct.gather(Q, (batch, i, kv_head, heads, lanes[1]), mask=lanes[4]),
                        seqlen + i * q_step, Cos, Sin, lanes)  # [TILE_G, TILE_D]
            ct.store(QRot, index=(batch, i, kv_head, 0, 0),
                     tile=q.astype(QRot.dtype).reshape((1, 1, 1, TILE_G, TILE_D)))


@ct.kernel
def attention_decode(Q, K, V, Out, Lse, OutSplit, LseSplit, SeqLensK, BatchIdx, BlockTable,
                     Slopes, Sinks, LeftPad, Mask, KDescale, VDescale, qk_scale: float,
                     softcap: float, window_left: int, window_right: int, new_len: int,
                     NUM_SPLITS: ConstInt, TILE_LQ: ConstInt, TILE_G: ConstInt,
                     TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt,
                     MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool, SOFTCAP: ConstBool,
                     ALIBI: ConstBool, PAGED: ConstBool, PAGE_N: ConstInt, GATHER: ConstBool,
                     BATCH_IDX: ConstBool, SPLIT: ConstBool, STORE_LSE: ConstBool,
                     SINKS: ConstBool, LEFTPAD: ConstBool, ATTN_MASK: ConstBool):
    """Grid (NUM_SPLITS * cdiv(Lq, TILE_LQ), H_kv, B). Out and Lse are written without SPLIT,
    OutSplit and LseSplit with it; Slopes [B, H_kv, G] fp32 is read under ALIBI, BatchIdx
    under BATCH_IDX, BlockTable under PAGED (steps of TILE_N keys joined from loads of
    PAGE_N, or gathered by row under GATHER); the window bounds under their MASK_ switch.
    Sequence b has SeqLensK[b] + new_len keys (the cache's length before an append of
    new_len rows, or its whole length with new_len = 0). Under SINKS, Sinks [H_kv, G] fp32
    holds each query head's sink logit; under LEFTPAD, LeftPad [B] int32 the cache row of each
    sequence's first key; under ATTN_MASK, Mask [B, 1, Lq, L] bool or uint8 the keys each
    query row may see (shared by the heads). KDescale and VDescale [B, H_kv] fp32 are read
    when the caches are float8_e4m3fn (Q float16 or bfloat16)."""
    _decode_impl(Q, K, V, Out, Lse, OutSplit, LseSplit, SeqLensK, BatchIdx, BlockTable, Slopes,
                 Sinks, LeftPad, Mask, KDescale, VDescale, qk_scale, softcap, window_left,
                 window_right, new_len, NUM_SPLITS, TILE_LQ, TILE_G, TILE_N, TILE_D, TILE_DV,
                 MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, PAGED, PAGE_N, GATHER, BATCH_IDX, SPLIT,
                 STORE_LSE, SINKS, LEFTPAD, ATTN_MASK)


@ct.kernel
def attention_decode_int64(Q, K: ct.IndexedWithInt64, V: ct.IndexedWithInt64, Out, Lse,
                           OutSplit, LseSplit, SeqLensK, BatchIdx, BlockTable, Slopes, Sinks,
                           LeftPad, Mask, KDescale, VDescale, qk_scale: float, softcap: float,
                           window_left: int, window_right: int, new_len: int,
                           NUM_SPLITS: ConstInt,
                           TILE_LQ: ConstInt, TILE_G: ConstInt, TILE_N: ConstInt,
                           TILE_D: ConstInt, TILE_DV: ConstInt, MASK_LEFT: ConstBool,
                           MASK_RIGHT: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool,
                           PAGED: ConstBool, PAGE_N: ConstInt, GATHER: ConstBool,
                           BATCH_IDX: ConstBool, SPLIT: ConstBool, STORE_LSE: ConstBool,
                           SINKS: ConstBool, LEFTPAD: ConstBool, ATTN_MASK: ConstBool):
    """``attention_decode`` with 64-bit shapes and strides for the caches, for caches of 2**31
    elements or more (the launcher picks it); the same body."""
    _decode_impl(Q, K, V, Out, Lse, OutSplit, LseSplit, SeqLensK, BatchIdx, BlockTable, Slopes,
                 Sinks, LeftPad, Mask, KDescale, VDescale, qk_scale, softcap, window_left,
                 window_right, new_len, NUM_SPLITS, TILE_LQ, TILE_G, TILE_N, TILE_D, TILE_DV,
                 MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, PAGED, PAGE_N, GATHER, BATCH_IDX, SPLIT,
                 STORE_LSE, SINKS, LEFTPAD, ATTN_MASK)


@ct.kernel
def decode_combine(OutSplit, LseSplit, Out, Lse, TILE_S: ConstInt, TILE_DV: ConstInt,
                   STORE_LSE: ConstBool):
    """Grid (Lq, H, B): merge the NUM_SPLITS partial outputs of query row bid(0) of head bid(1)
    of sequence bid(2). OutSplit [S, B, Lq, H, Dv] and LseSplit [S, B, Lq, H] fp32 (the decode
    workspace with its heads merged); Out [B, Lq, H, Dv], Lse [B, H, Lq] fp32 (under
    STORE_LSE). TILE_S >= S: the padded splits read lse = -inf and weigh nothing."""
    ct.grid_dependency_control_wait()  # the decode's partials (a PDL launch's successor)
    row = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    lse_s = ct.load(LseSplit, index=(0, batch, row, head), shape=(TILE_S, 1, 1, 1),
                    padding_mode=NEG_INF).reshape((TILE_S, 1))
    lse_max = ct.max(lse_s, axis=0, keepdims=True)  # [1, 1]
    empty = lse_max == -math.inf
    weight = ct.exp(lse_s - ct.where(empty, 0.0, lse_max))  # [TILE_S, 1], 0 for empty splits
    total = ct.sum(weight, axis=0, keepdims=True)
    o_s = ct.load(OutSplit, index=(0, batch, row, head, 0), shape=(TILE_S, 1, 1, 1, TILE_DV),
                  padding_mode=ZERO).reshape((TILE_S, TILE_DV))
    out = ct.sum(o_s * weight, axis=0, keepdims=True) / ct.where(empty, 1.0, total)
    ct.store(Out, index=(batch, row, head, 0),
             tile=out.astype(Out.dtype).reshape((1, 1, 1, TILE_DV)))
    if STORE_LSE:
        lse = ct.where(empty, math.inf, lse_max + ct.log(total))
        ct.store(Lse, index=(batch, head, row), tile=lse.reshape((1, 1, 1)))


@ct.kernel
def cache_append(KNew, VNew, K, V, CacheSeqLens, BatchIdx, BlockTable, Q, QRot, Cos, Sin,
                 KDescale, VDescale, new_len: int, rotary_dim: int, q_step: int, TILE_D: ConstInt,
                 TILE_DV: ConstInt, TILE_G: ConstInt, PAGED: ConstBool, BATCH_IDX: ConstBool,
                 ROTARY: ConstBool, INTERLEAVED: ConstBool):
    """Grid (L_new, H_kv, B), under ROTARY (max(L_new, Lq), H_kv, B): row bid(0) < new_len of
    KNew/VNew [B, L_new, H_kv, D / Dv] (placeholders when L_new = 0) into the cache
    (flash-attn's layout: [Bc, L_cache, H_kv, D], or pages [num_blocks, page_size, H_kv, D]
    under PAGED) at position CacheSeqLens[b] + bid(0) of sequence b. Under ROTARY the key row
    is rotated at that position, and query row bid(0) of Q [B, Lq, H_kv, G, D] (TILE_G >= G)
    at CacheSeqLens[b] + bid(0) * q_step (q_step 1 for a causal or windowed call, 0
    otherwise: flash-attn's rule) into QRot of Q's shape;
    Cos/Sin [L_ro, rotary_dim / 2] in Q's dtype. Into a float8_e4m3fn cache, rows of a wider
    dtype are divided by KDescale/VDescale [B, H_kv] fp32 (read then only) and rounded."""
    _append_impl(KNew, VNew, K, V, CacheSeqLens, BatchIdx, BlockTable, Q, QRot, Cos, Sin,
                 KDescale, VDescale, new_len, rotary_dim, q_step, TILE_D, TILE_DV, TILE_G, PAGED,
                 BATCH_IDX, ROTARY, INTERLEAVED)


@ct.kernel
def cache_append_int64(KNew, VNew, K: ct.IndexedWithInt64, V: ct.IndexedWithInt64,
                       CacheSeqLens, BatchIdx, BlockTable, Q, QRot, Cos, Sin, KDescale,
                       VDescale, new_len: int, rotary_dim: int, q_step: int, TILE_D: ConstInt,
                       TILE_DV: ConstInt, TILE_G: ConstInt, PAGED: ConstBool,
                       BATCH_IDX: ConstBool, ROTARY: ConstBool, INTERLEAVED: ConstBool):
    """``cache_append`` with 64-bit shapes and strides for the caches; the same body."""
    _append_impl(KNew, VNew, K, V, CacheSeqLens, BatchIdx, BlockTable, Q, QRot, Cos, Sin,
                 KDescale, VDescale, new_len, rotary_dim, q_step, TILE_D, TILE_DV, TILE_G, PAGED,
                 BATCH_IDX, ROTARY, INTERLEAVED)
