"""Flash-attention backward in cuTile: recompute P from the saved LSE, never store it.

Maths (FlashAttention-2, Dao 2023, Alg. 2). With the forward's final scores s_ij (see
``attention_fwd``), p_ij = exp(s_ij - lse_i) and o_i = sum_j p_ij v_j, the gradients of a loss
with output gradient dO are

    Delta_i = sum_d dO_id O_id - dLSE_i     (fp32 [B, H, Lq], by the dQ pass or the preprocess)
    dV_j    = sum_i p_ij dO_i
    dS_ij   = p_ij (dO_i . v_j - Delta_i)              (gradient of the final scores)
    dX_ij   = dS_ij * ds_ij/dx_ij                      (x_ij = q_i . k_j, the raw product)
    dQ_i    = sum_j dX_ij k_j,        dK_j = sum_i dX_ij q_i

and dLSE is the gradient reaching the returned LSE (zero unless the caller differentiates
through it): d lse_i / d s_ij = p_ij, so it enters dS only as a shift of Delta. Here
ds/dx = scale for plain scores and scale * (1 - t_ij^2) with t_ij = tanh(scale x_ij /
softcap) under SOFTCAP; ALiBi and an additive mask do not depend on q or k, so they only shift
s. Where ds/dx is the scale for every score (no SOFTCAP) the steps sum dS, and dQ and dK are
scaled once before their stores: a multiply per output, not per score. P is recomputed per
tile in log2 units as exp2(s' - lse * log2(e)); the forward's +inf LSE of rows that see no key
makes their P exactly 0. Under DROPOUT (FA2's form) the forward's keep bits z_ij are
recomputed from the same hash (``_tiles.dropout_keep``), r = 1 / (1 - p_drop):
dV_j = sum_i r z_ij p_ij dO_i and dS_ij = p_ij (r z_ij dO_i . v_j - Delta_i), Delta from the
dropped output as always.

Two forms share the dK/dV body.

Two passes (deterministic): each sums in registers and stores once, so the result does not
depend on the order programs run in (no atomics):
  - dQ, launched first: one program per (query tile, head, batch) forms its rows' Delta from
    the O and dO tiles (dO it holds for dP anyway), stores it for the other pass, and walks
    the key tiles as the forward does;
  - dK/dV: one program per (key tile, key/value head, batch) walks the query tiles of every
    query head of its GQA group, reading Delta, working on S^T = K Q^T so that P^T and dX^T,
    as computed, are the left operands of dV += P^T dO and dK += dX^T Q (Q and dO are
    transposed as tiles for S^T and dP^T).
The dQ pass recomputes S and dP: seven tile matmuls per pair of tiles in all.

One pass (DQ_ACCUM, FA2's and FA3's form): the launcher zeroes an fp32 dQ accumulator (a
memset), a preprocess kernel stores Delta; the dK/dV kernel also forms dQ_i += dX_ij k_j
(dX^T transposed as a tile: five matmuls per pair) and adds it into the accumulator with a
tiled view's reduce-add, one TMA reduce (UTMAREDG) of the whole tile on sm_90 and sm_100;
a convert kernel scales dQ and casts it to the inputs' dtype. The adds of one dQ tile come
from different programs in whatever order they run, so dQ's last bits vary from run to run
(dK and dV do not). Per pair it adds TILE_M x D fp32 values for 10 TILE_M TILE_N D flops,
so the dK/dV tile wants many keys (TILE_N = 128 halves the traffic of 64).

Both skip the tiles a causal or window band hides and build no mask for the tiles it shows
whole (``_tiles.tile_runs``). The passes may take their own tile shapes (a variant's choice):
a program can own a tall tile of its rows and walk the other side in narrower steps. Under a
causal band both start their heaviest programs first (the dK/dV pass by key tile order, the
dQ pass by taking its query tiles last to first), so the light ones fill the tail of the
launch.

Layout. Q, dQ [B, H, Lq, D]; K, dK [B, H_kv, Lk, D]; V, dV [B, H_kv, Lk, Dv]; Out, dOut
[B, H, Lq, Dv]; Lse (natural log), dLse and Delta [B, H, Lq] fp32; Slopes [B, H]; Mask
[B, H, Lq, Lk]; the one pass's dQacc [B, H, Lq, D] fp32. Any strides, as in the forward.
Under VARLEN the arrays are packed as the
forward's (batch 1, the sequences one after another, CuSeqQ and CuSeqK their offsets) and
both passes work per sequence as the forward does: bounds from the offsets, row-granular tile
views, stores clipped to the sequence, diag_offset = k_len - q_len, early exit past the
sequence's end. A query tile of the dK/dV pass that runs past its sequence holds the next
one's rows: they get lse = +inf and Delta = 0, so their p, dS and contributions are 0, and
their dQ adds are clipped to the sequence as its stores are.

Sinks (SINKS). With the forward's LSE including the sink, P, Delta and every formula above are
unchanged; the sink's own gradient is dsink_h = sum_i dL/dsink = -sum_i p_i,sink Delta_i with
p_i,sink = exp(sink_h - lse_i) (the dLSE term is in Delta). The kernel that forms Delta (the
dQ pass, or the preprocess of the one-pass form) stores each query tile's share; the launcher
sums the shares (a fixed order: deterministic).
"""

import math

import cuda.tile as ct

from ._tiles import (ADDITIVE_MASK, LOG2_E, ZERO, ConstBool, ConstInt, add_seq_rows,
                     dropout_keep, heaviest_first, load_seq_rows, load_seq_vector, log2_scores,
                     program_tile, query_bounds, query_rows, sequence_bounds, store_seq_rows,
                     tile_runs)

# Past the end of the LSE a row must get p = 0: exp2(s - inf) = 0.
POS_INF = ct.PaddingMode.POS_INF


def _probs(s, rows, offs_k, lse_log2, Mask, tile_q, tile_k, band, TILE_Q: ConstInt,
           TILE_K: ConstInt, MASKED: ConstBool, FEATURES, TRANSPOSED: ConstBool):
    """P (or P^T) from the raw products ``s`` and ds/dx; the forward's scores, recomputed.

    Plain scores (no softcap, ALiBi or additive mask) come back from ``log2_scores`` unscaled
    so that the scale and the LSE meet in one expression, which tileiras turns into one FFMA
    a score; in two statements it kept an FMUL and an FADD [sm_90 SASS, tileiras 13.4]."""
    _, _, _, SOFTCAP, ALIBI, ATTN_MASK, _ = FEATURES
    PLAIN = not SOFTCAP and not ALIBI and ATTN_MASK != ADDITIVE_MASK
    s, factor, dscore = log2_scores(s, rows, offs_k, Mask, tile_q, tile_k, band, TILE_Q,
                                    TILE_K, MASKED, FEATURES, TRANSPOSED, PLAIN)
    if PLAIN:
        return ct.exp2(s * factor - lse_log2, flush_to_zero=True), dscore
    return ct.exp2(s - lse_log2, flush_to_zero=True), dscore


def _delta(Out, do, dLse, Delta, batch, head, q_start, q_len, tile_m, TILE_M: ConstInt,
           TILE_DV: ConstInt, LSE_GRAD: ConstBool, VARLEN: ConstBool):
    """Delta of query tile tile_m, stored for the dK/dV pass and returned as [TILE_M, 1]."""
    o = load_seq_rows(Out, batch, head, q_start, tile_m, TILE_M, TILE_DV, VARLEN)
    delta = ct.sum(o.astype(ct.float32) * do.astype(ct.float32), axis=-1)  # [TILE_M]
    if LSE_GRAD:
        dlse = load_seq_vector(dLse, batch, head, q_start, tile_m, TILE_M, ZERO, VARLEN)
        delta = delta - dlse.reshape((TILE_M,))
    store_seq_rows(Delta, batch, head, q_start, q_len, tile_m, delta.reshape((1, 1, TILE_M)),
                   VARLEN)
    return delta.reshape((TILE_M, 1))


def _dsink_share(Sinks, dSinks, lse_log2, delta, offs_q, q_len, batch, head, tile_m,
                 VARLEN: ConstBool):
    """This query tile's share of dsink_h = -sum_i p_i,sink Delta_i (p_i,sink = exp(sink_h -
    lse_i), the sink's probability: the LSE includes it), stored at dSinks[batch, head,
    tile_m], or under VARLEN at dSinks[0, head, program] (one slot per program of the
    flattened grid), for the host to sum in a fixed order. Rows past the end have lse = +inf
    (p = 0); under VARLEN the rows past the sequence are the next one's, or past the last
    sequence rows that no sequence covers, whose output the forward never wrote (Delta and
    the LSE there may be NaN or inf): their products are selected away, as 0 * NaN is NaN."""
    sink = ct.load(Sinks, index=(head,), shape=(1,)).reshape((1, 1)) * LOG2_E
    weighted = ct.exp2(sink - lse_log2, flush_to_zero=True) * delta  # [TILE_M, 1]
    if VARLEN:
        weighted = ct.where(offs_q < q_len, weighted, 0.0)
    share = -ct.sum(weighted, axis=0, keepdims=True).reshape((1, 1, 1))
    if VARLEN:
        ct.store(dSinks, index=(0, head, ct.bid(0)), tile=share)
    else:
        ct.store(dSinks, index=(batch, head, tile_m), tile=share)


def _dkdv_step(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, head, seq, i, dk, dv,
               offs_k, band, drop, TILES, MASKED: ConstBool, FEATURES):
    """Query tile i of one query head against this program's key tile; the new (dk, dv), and
    under DQ_ACCUM the pair's share of dQ added into dQacc. TILES = (TILE_M, TILE_N, TILE_D,
    TILE_DV, VARLEN, DQ_ACCUM), seq = (q_start, q_len, the key tile); the rest as in
    ``_tiles``."""
    TILE_M, TILE_N, TILE_D, TILE_DV, VARLEN, DQ_ACCUM = TILES
    _, _, _, SOFTCAP, _, _, DROPOUT = FEATURES
    _, threshold, keep_scale = drop
    q_start, q_len, tile_n = seq
    q = load_seq_rows(Q, batch, head, q_start, i, TILE_M, TILE_D, VARLEN)
    do = load_seq_rows(dOut, batch, head, q_start, i, TILE_M, TILE_DV, VARLEN)
    lse = load_seq_vector(Lse, batch, head, q_start, i, TILE_M, POS_INF, VARLEN)
    delta = load_seq_vector(Delta, batch, head, q_start, i, TILE_M, ZERO, VARLEN)
    offs_q = i * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[None, :]  # [1, TILE_M]
    if VARLEN and MASKED:  # rows past the sequence are the next one's: give them p = 0, as
        # padding does. Only a masked run holds the sequence's last (ragged) query tile:
        # tile_runs ends the unmasked run at q_len // TILE_M, so its tiles are whole.
        inside = offs_q.reshape((1, 1, TILE_M)) < q_len
        lse = ct.where(inside, lse, math.inf)
        delta = ct.where(inside, delta, 0.0)
    rows = query_rows(Slopes, batch, head, Q.shape[1], offs_q, drop, FEATURES)

    s_t = ct.mma(k, ct.transpose(q), ct.zeros((TILE_N, TILE_M), dtype=ct.float32))
    p_t, dscore = _probs(s_t, rows, offs_k, lse.reshape((1, TILE_M)) * LOG2_E, Mask, i,
                         tile_n, band, TILE_M, TILE_N, MASKED, FEATURES,
                         True)  # [TILE_N, TILE_M]
    dp_t = ct.mma(v, ct.transpose(do), ct.zeros((TILE_N, TILE_M), dtype=ct.float32))
    pz_t = p_t
    if DROPOUT:  # the forward's keep bits, recomputed; dV and dP see the dropped P
        keep_t = dropout_keep(rows[4], offs_k, threshold)  # [TILE_N, TILE_M]
        pz_t = ct.where(keep_t, p_t * keep_scale, 0.0)
        dp_t = ct.where(keep_t, dp_t * keep_scale, 0.0)
    dv = ct.mma(pz_t.astype(do.dtype), do, dv)  # [TILE_N, TILE_DV]
    dx_t = p_t * (dp_t - delta.reshape((1, TILE_M)))  # [TILE_N, TILE_M]
    if SOFTCAP:  # ds/dx varies per score; else it is the scale, applied to dK
        dx_t = dx_t * dscore
    dx_t = dx_t.astype(q.dtype)
    dk = ct.mma(dx_t, q, dk)  # [TILE_N, TILE_D]
    if DQ_ACCUM:  # dQ_i += dX_ij k_j, summed over the key tiles by TMA reduce-adds in fp32
        dq = ct.mma(ct.transpose(dx_t), k, ct.zeros((TILE_M, TILE_D), dtype=ct.float32))
        add_seq_rows(dQacc, batch, head, q_start, q_len, i,
                     dq.reshape((1, 1, TILE_M, TILE_D)), VARLEN)
    return dk, dv


def _dkdv_heads(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head, g_first, seq,
                i, dk, dv, offs_k, band, drop, TILES, MASKED: ConstBool, FEATURES,
                GROUP: ConstInt, HEADS: ConstInt):
    """Query tile i of the HEADS query heads from group member g_first on; the new (dk, dv)."""
    for h in range(HEADS):
        dk, dv = _dkdv_step(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch,
                            kv_head * GROUP + g_first + h, seq, i, dk, dv, offs_k, band, drop,
                            TILES, MASKED, FEATURES)
    return dk, dv


def _dkdv_runs(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head, g_first, seq,
               runs, dk, dv, offs_k, band, drop, TILES, FEATURES, GROUP: ConstInt,
               HEADS: ConstInt):
    """The query tiles the band lets through (masked edges, unmasked middle), each for the
    HEADS query heads from group member g_first on; the new (dk, dv)."""
    i_start, i_inner, i_outer, i_end = runs
    for i in range(i_start, i_inner):
        dk, dv = _dkdv_heads(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head,
                             g_first, seq, i, dk, dv, offs_k, band, drop, TILES, True, FEATURES,
                             GROUP, HEADS)
    for i in range(i_inner, i_outer):
        dk, dv = _dkdv_heads(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head,
                             g_first, seq, i, dk, dv, offs_k, band, drop, TILES, False, FEATURES,
                             GROUP, HEADS)
    for i in range(i_outer, i_end):
        dk, dv = _dkdv_heads(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head,
                             g_first, seq, i, dk, dv, offs_k, band, drop, TILES, True, FEATURES,
                             GROUP, HEADS)
    return dk, dv


def _dkdv_impl(Q, K, V, dOut, Lse, Delta, dK, dV, dQacc, Slopes, Mask, CuSeqQ, CuSeqK,
               SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
               dropout_seed, dropout_threshold, dropout_scale,
               TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt,
               MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool, EVEN_N: ConstBool,
               SOFTCAP: ConstBool, ALIBI: ConstBool, ATTN_MASK: ConstInt, DROPOUT: ConstBool,
               GROUP: ConstInt, GROUP_INNER: ConstBool, VARLEN: ConstBool,
               SEQUSED_K: ConstBool, DQ_ACCUM: ConstBool):
    """dK, dV of key/value head bid(1) for the batch (under VARLEN, sequence) and key tile of
    ``program_tile``, and under DQ_ACCUM its tile pairs' shares of dQ added into the fp32
    dQacc.

    The GROUP query heads sharing the key/value head are summed in place, either head by head
    (each walking the query tiles) or, with GROUP_INNER, all heads per query tile. The two
    orders cost registers differently per architecture: with GROUP 4, head-inner removes
    every dK/dV spill on sm_80 but spills ~3000 LDL/STL on sm_90, where head-outer spills none
    at D=128 [2026-11-30, cuobjdump of tileiras 13.4 cubins].
    """
    batch, tile_n = program_tile(CuSeqK, TILE_N, VARLEN)
    kv_head = ct.bid(1)
    n_start = tile_n * TILE_N
    q_start, q_len, k_start, k_len = sequence_bounds(Q, K, CuSeqQ, CuSeqK, SeqUsedK, batch,
                                                     VARLEN, SEQUSED_K, False)
    if VARLEN:
        diag_offset = k_len - q_len  # bottom-right per sequence, as the forward
        if n_start >= k_len:  # the flattened grid's idle program, or keys past seqused_k
            return
    seq = (q_start, q_len, tile_n)
    band = (k_len, qk_scale, softcap, diag_offset, window_left, window_right)
    drop = (dropout_seed, dropout_threshold, dropout_scale)
    TILES = (TILE_M, TILE_N, TILE_D, TILE_DV, VARLEN, DQ_ACCUM)
    FEATURES = (MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT)
    k = load_seq_rows(K, batch, kv_head, k_start, tile_n, TILE_N, TILE_D, VARLEN)
    v = load_seq_rows(V, batch, kv_head, k_start, tile_n, TILE_N, TILE_DV, VARLEN)
    offs_k = n_start + ct.arange(TILE_N, dtype=ct.int32)[:, None]  # [TILE_N, 1]
    if DQ_ACCUM and VARLEN:
        # Keys past the sequence's (the next one's rows, or unused ones under SEQUSED_K) are
        # not masked where the band shows a tile whole: their dK/dV rows are never stored,
        # but their dX would reach dQ through k. Zero rows add nothing (dX stays finite).
        k = ct.where(offs_k < k_len, k, 0.0).astype(k.dtype)
    dk = ct.zeros((TILE_N, TILE_D), dtype=ct.float32)
    dv = ct.zeros((TILE_N, TILE_DV), dtype=ct.float32)

    # Query tiles: key j is seen by row i iff j - diag_offset - right <= i <= j - diag_offset
    # + left, the forward's band seen from the key side.
    runs = tile_runs(n_start, q_len, -diag_offset - window_right, window_left - diag_offset,
                     TILE_N, TILE_M, MASK_RIGHT, MASK_LEFT)
    if GROUP_INNER:
        dk, dv = _dkdv_runs(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head, 0,
                            seq, runs, dk, dv, offs_k, band, drop, TILES, FEATURES, GROUP,
                            GROUP)
    else:
        for g in range(GROUP):
            dk, dv = _dkdv_runs(k, v, Q, dOut, Lse, Delta, dQacc, Slopes, Mask, batch, kv_head,
                                g, seq, runs, dk, dv, offs_k, band, drop, TILES, FEATURES,
                                GROUP, 1)
    if not SOFTCAP:  # ds/dx is the scale for every score: once here, not per score
        dk = dk * qk_scale
    store_seq_rows(dK, batch, kv_head, k_start, k_len, tile_n,
                   dk.astype(dK.dtype).reshape((1, 1, TILE_N, TILE_D)), VARLEN)
    store_seq_rows(dV, batch, kv_head, k_start, k_len, tile_n,
                   dv.astype(dV.dtype).reshape((1, 1, TILE_N, TILE_DV)), VARLEN)


def _dq_step(q, do, lse_log2, delta, K, V, Mask, rows, kv_head, k_start, tile_m, j, dq, band,
             drop, TILES, MASKED: ConstBool, FEATURES):
    """Key tile j against this program's query tile; returns the new dq. Under VARLEN the
    sequence's keys start at row ``k_start`` of K and V."""
    TILE_M, TILE_N, TILE_D, TILE_DV, VARLEN = TILES
    _, _, _, SOFTCAP, _, _, DROPOUT = FEATURES
    _, threshold, keep_scale = drop
    batch = rows[0]
    k = load_seq_rows(K, batch, kv_head, k_start, j, TILE_N, TILE_D, VARLEN)
    v = load_seq_rows(V, batch, kv_head, k_start, j, TILE_N, TILE_DV, VARLEN)
    offs_k = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]  # [1, TILE_N]
    s = ct.mma(q, ct.transpose(k), ct.zeros((TILE_M, TILE_N), dtype=ct.float32))
    p, dscore = _probs(s, rows, offs_k, lse_log2, Mask, tile_m, j, band, TILE_M, TILE_N, MASKED,
                       FEATURES, False)  # [TILE_M, TILE_N]
    dp = ct.mma(do, ct.transpose(v), ct.zeros((TILE_M, TILE_N), dtype=ct.float32))
    if DROPOUT:  # dP of the dropped P; dS keeps the undropped P
        keep = dropout_keep(rows[4], offs_k, threshold)  # [TILE_M, TILE_N]
        dp = ct.where(keep, dp * keep_scale, 0.0)
    dx = p * (dp - delta)  # [TILE_M, TILE_N]
    if SOFTCAP:  # ds/dx varies per score; else it is the scale, applied to dQ
        dx = dx * dscore
    return ct.mma(dx.astype(k.dtype), k, dq)  # [TILE_M, TILE_D]


def _dq_impl(Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Slopes, Mask, CuSeqQ, CuSeqK, Sinks,
             dSinks, SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
             dropout_seed, dropout_threshold, dropout_scale, TILE_M: ConstInt, TILE_N: ConstInt,
             TILE_D: ConstInt, TILE_DV: ConstInt, MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool,
             EVEN_N: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool, ATTN_MASK: ConstInt,
             DROPOUT: ConstBool, LSE_GRAD: ConstBool, VARLEN: ConstBool, SINKS: ConstBool,
             SEQUSED_K: ConstBool):
    """dQ and Delta of query tile ``heaviest_first`` of head bid(1) for the batch (under
    VARLEN, sequence) and tile index of ``program_tile``."""
    batch, index = program_tile(CuSeqQ, TILE_M, VARLEN)
    q_start, q_len, k_start, k_len = sequence_bounds(Q, K, CuSeqQ, CuSeqK, SeqUsedK, batch,
                                                     VARLEN, SEQUSED_K, False)
    if VARLEN:
        diag_offset = k_len - q_len  # bottom-right per sequence, as the forward
    tile_m = heaviest_first(q_len, index, TILE_M)
    if VARLEN:
        if tile_m < 0:  # the flattened grid's idle program past this sequence's tiles
            return
    head = ct.bid(1)
    kv_head = head // (Q.shape[1] // K.shape[1])
    m_start = tile_m * TILE_M
    band = (k_len, qk_scale, softcap, diag_offset, window_left, window_right)
    drop = (dropout_seed, dropout_threshold, dropout_scale)
    TILES = (TILE_M, TILE_N, TILE_D, TILE_DV, VARLEN)
    FEATURES = (MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT)
    q = load_seq_rows(Q, batch, head, q_start, tile_m, TILE_M, TILE_D, VARLEN)
    do = load_seq_rows(dOut, batch, head, q_start, tile_m, TILE_M, TILE_DV, VARLEN)
    lse = load_seq_vector(Lse, batch, head, q_start, tile_m, TILE_M, POS_INF, VARLEN)
    lse_log2 = lse.reshape((TILE_M, 1)) * LOG2_E
    delta = _delta(Out, do, dLse, Delta, batch, head, q_start, q_len, tile_m, TILE_M, TILE_DV,
                   LSE_GRAD, VARLEN)
    offs_q = m_start + ct.arange(TILE_M, dtype=ct.int32)[:, None]  # [TILE_M, 1]
    rows = query_rows(Slopes, batch, head, Q.shape[1], offs_q, drop, FEATURES)
    dq = ct.zeros((TILE_M, TILE_D), dtype=ct.float32)

    n_start, n_inner, n_outer, n_end = tile_runs(
        m_start, k_len, diag_offset - window_left, diag_offset + window_right, TILE_M, TILE_N,
        MASK_LEFT, MASK_RIGHT)
    for j in range(n_start, n_inner):
        dq = _dq_step(q, do, lse_log2, delta, K, V, Mask, rows, kv_head, k_start, tile_m, j, dq,
                      band, drop, TILES, True, FEATURES)
    for j in range(n_inner, n_outer):
        dq = _dq_step(q, do, lse_log2, delta, K, V, Mask, rows, kv_head, k_start, tile_m, j, dq,
                      band, drop, TILES, False, FEATURES)
    for j in range(n_outer, n_end):
        dq = _dq_step(q, do, lse_log2, delta, K, V, Mask, rows, kv_head, k_start, tile_m, j, dq,
                      band, drop, TILES, True, FEATURES)
    if not SOFTCAP:  # ds/dx is the scale for every score: once here, not per score
        dq = dq * qk_scale
    store_seq_rows(dQ, batch, head, q_start, q_len, tile_m,
                   dq.astype(dQ.dtype).reshape((1, 1, TILE_M, TILE_D)), VARLEN)
    if SINKS:
        # After the K-loop: the share sums over the tile's rows, across warps, and before
        # the loop that sum held every warp back from its first key tile (the dQ kernel
        # took 3.6% longer with sinks on gpt-oss's 128-key band, H200, 2026-12-03).
        _dsink_share(Sinks, dSinks, lse_log2, delta, offs_q, q_len, batch, head, tile_m,
                     VARLEN)


def _preprocess_impl(Out, dOut, Lse, dLse, Delta, CuSeqQ, Sinks, dSinks, TILE_M: ConstInt,
                     TILE_DV: ConstInt, LSE_GRAD: ConstBool, VARLEN: ConstBool,
                     SINKS: ConstBool):
    """The one-pass backward's first kernel: Delta (as the dQ kernel's) and the sinks'
    gradient shares under SINKS (dSinks as the dQ kernel's), for the query tile of head bid(1)
    that ``program_tile`` gives. Grid (cdiv(Lq, TILE_M), H, B), or (total_q // TILE_M + B, H,
    1) under VARLEN. It does not zero the dQ sums: a [TILE_M, D] fp32 tile of zeros, staged
    in shared memory for its TMA store, doubled the kernel's shared memory (66.9 against 34.1
    KB at D = 128, 64 rows)."""
    batch, tile_m = program_tile(CuSeqQ, TILE_M, VARLEN)
    q_start, q_len = query_bounds(Out, CuSeqQ, batch, VARLEN)
    if VARLEN:
        if tile_m * TILE_M >= q_len:  # the flattened grid's idle program
            return
    head = ct.bid(1)
    do = load_seq_rows(dOut, batch, head, q_start, tile_m, TILE_M, TILE_DV, VARLEN)
    delta = _delta(Out, do, dLse, Delta, batch, head, q_start, q_len, tile_m, TILE_M,
                   TILE_DV, LSE_GRAD, VARLEN)
    if SINKS:
        lse = load_seq_vector(Lse, batch, head, q_start, tile_m, TILE_M, POS_INF, VARLEN)
        offs_q = tile_m * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[:, None]  # [TILE_M, 1]
        _dsink_share(Sinks, dSinks, lse.reshape((TILE_M, 1)) * LOG2_E, delta, offs_q, q_len,
                     batch, head, tile_m, VARLEN)


def _dq_convert_impl(dQacc, dQ, CuSeqQ, qk_scale, TILE_M: ConstInt, TILE_D: ConstInt,
                     SOFTCAP: ConstBool, VARLEN: ConstBool):
    """The one-pass backward's last launch: dQ = dQacc * scale (the scale once per element,
    as the dQ kernel's; under SOFTCAP the sums hold ds/dx already) in dQ's dtype, for the
    query tile of head bid(1) that ``program_tile`` gives; grid as the preprocess kernel's."""
    batch, tile_m = program_tile(CuSeqQ, TILE_M, VARLEN)
    q_start, q_len = query_bounds(dQ, CuSeqQ, batch, VARLEN)
    if VARLEN:
        if tile_m * TILE_M >= q_len:
            return
    head = ct.bid(1)
    dq = load_seq_rows(dQacc, batch, head, q_start, tile_m, TILE_M, TILE_D, VARLEN)
    if not SOFTCAP:
        dq = dq * qk_scale
    store_seq_rows(dQ, batch, head, q_start, q_len, tile_m,
                   dq.astype(dQ.dtype).reshape((1, 1, TILE_M, TILE_D)), VARLEN)


@ct.kernel
def attention_bwd_dkdv(Q, K, V, dOut, Lse, Delta, dK, dV, dQacc, Slopes, Mask, CuSeqQ, CuSeqK,
                       SeqUsedK, qk_scale: float, softcap: float, diag_offset: int,
                       window_left: int, window_right: int, dropout_seed: int,
                       dropout_threshold: int, dropout_scale: float, TILE_M: ConstInt,
                       TILE_N: ConstInt,
                       TILE_D: ConstInt, TILE_DV: ConstInt, MASK_LEFT: ConstBool,
                       MASK_RIGHT: ConstBool, EVEN_N: ConstBool, SOFTCAP: ConstBool,
                       ALIBI: ConstBool, ATTN_MASK: ConstInt, DROPOUT: ConstBool,
                       GROUP: ConstInt, GROUP_INNER: ConstBool, VARLEN: ConstBool,
                       SEQUSED_K: ConstBool, DQ_ACCUM: ConstBool):
    """dK and dV, reading the Delta the dQ (or preprocess) kernel stored. Grid
    (cdiv(Lk, TILE_N), H_kv, B); GROUP = H / H_kv. Under VARLEN the arrays are packed as the
    forward's, CuSeqQ and CuSeqK the sequences' cumulative lengths, the grid flattened over
    the key tiles, (total_k // TILE_N + B, H_kv, 1); under SEQUSED_K sequence b uses its first
    SeqUsedK[b] keys (the others' rows are not stored). Under DQ_ACCUM (the one-pass form) it
    also adds every tile pair's dQ, unscaled (dS k, or dX k under SOFTCAP), into dQacc
    [B, H, Lq, D] fp32, which the launcher zeroed and the convert kernel reads."""
    _dkdv_impl(Q, K, V, dOut, Lse, Delta, dK, dV, dQacc, Slopes, Mask, CuSeqQ, CuSeqK,
               SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
               dropout_seed, dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
               MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT, GROUP,
               GROUP_INNER, VARLEN, SEQUSED_K, DQ_ACCUM)


@ct.kernel
def attention_bwd_dq(Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Slopes, Mask, CuSeqQ, CuSeqK,
                     Sinks, dSinks, SeqUsedK,
                     qk_scale: float, softcap: float, diag_offset: int, window_left: int,
                     window_right: int, dropout_seed: int, dropout_threshold: int,
                     dropout_scale: float, TILE_M: ConstInt, TILE_N: ConstInt,
                     TILE_D: ConstInt, TILE_DV: ConstInt, MASK_LEFT: ConstBool,
                     MASK_RIGHT: ConstBool, EVEN_N: ConstBool, SOFTCAP: ConstBool,
                     ALIBI: ConstBool, ATTN_MASK: ConstInt, DROPOUT: ConstBool,
                     LSE_GRAD: ConstBool, VARLEN: ConstBool, SINKS: ConstBool,
                     SEQUSED_K: ConstBool):
    """dQ, and Delta = rowsum(dO * O) (- dLse under LSE_GRAD) for the dK/dV kernel, which
    must run after it. Grid (cdiv(Lq, TILE_M), H, B); under VARLEN (total_q // TILE_M + B,
    H, 1) over packed arrays, as the forward (SEQUSED_K: SeqUsedK [B] int32 keys of each
    sequence used). Under SINKS (Sinks [H] fp32) it also stores each tile's share of the
    sinks' gradient in dSinks [B, H, cdiv(Lq, TILE_M)] fp32 (under VARLEN [1, H, programs]:
    one slot a program)."""
    _dq_impl(Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Slopes, Mask, CuSeqQ, CuSeqK, Sinks,
             dSinks, SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
             dropout_seed, dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
             MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT, LSE_GRAD, VARLEN,
             SINKS, SEQUSED_K)


@ct.kernel
def attention_bwd_preprocess(Out, dOut, Lse, dLse, Delta, CuSeqQ, Sinks, dSinks,
                             TILE_M: ConstInt, TILE_DV: ConstInt, LSE_GRAD: ConstBool,
                             VARLEN: ConstBool, SINKS: ConstBool):
    """``_preprocess_impl``: Delta and the sinks' shares."""
    _preprocess_impl(Out, dOut, Lse, dLse, Delta, CuSeqQ, Sinks, dSinks, TILE_M, TILE_DV,
                     LSE_GRAD, VARLEN, SINKS)


@ct.kernel
def attention_bwd_dq_convert(dQacc, dQ, CuSeqQ, qk_scale: float, TILE_M: ConstInt,
                             TILE_D: ConstInt, SOFTCAP: ConstBool, VARLEN: ConstBool):
    """``_dq_convert_impl``: dQ from the one pass's fp32 sums."""
    _dq_convert_impl(dQacc, dQ, CuSeqQ, qk_scale, TILE_M, TILE_D, SOFTCAP, VARLEN)


# The 64-bit entry points: the same bodies with 64-bit shapes and strides, for arrays of 2**31
# elements or more (the launcher picks them, as the forward's attention_fwd_int64). cuTile
# keeps 64-bit-indexed arrays off TMA, so the one pass's dQ adds are per-element reductions
# there (REDG), not the tile's TMA reduce-add.

@ct.kernel
def attention_bwd_dkdv_int64(Q: ct.IndexedWithInt64, K: ct.IndexedWithInt64,
                             V: ct.IndexedWithInt64, dOut: ct.IndexedWithInt64,
                             Lse: ct.IndexedWithInt64, Delta: ct.IndexedWithInt64,
                             dK: ct.IndexedWithInt64, dV: ct.IndexedWithInt64,
                             dQacc: ct.IndexedWithInt64, Slopes, Mask: ct.IndexedWithInt64,
                             CuSeqQ, CuSeqK, SeqUsedK, qk_scale: float, softcap: float,
                             diag_offset: int, window_left: int, window_right: int,
                             dropout_seed: int, dropout_threshold: int, dropout_scale: float,
                             TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt,
                             TILE_DV: ConstInt, MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool,
                             EVEN_N: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool,
                             ATTN_MASK: ConstInt, DROPOUT: ConstBool, GROUP: ConstInt,
                             GROUP_INNER: ConstBool, VARLEN: ConstBool, SEQUSED_K: ConstBool,
                             DQ_ACCUM: ConstBool):
    """``attention_bwd_dkdv`` in 64-bit indexing."""
    _dkdv_impl(Q, K, V, dOut, Lse, Delta, dK, dV, dQacc, Slopes, Mask, CuSeqQ, CuSeqK,
               SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
               dropout_seed, dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
               MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT, GROUP,
               GROUP_INNER, VARLEN, SEQUSED_K, DQ_ACCUM)


@ct.kernel
def attention_bwd_dq_int64(Q: ct.IndexedWithInt64, K: ct.IndexedWithInt64,
                           V: ct.IndexedWithInt64, Out: ct.IndexedWithInt64,
                           dOut: ct.IndexedWithInt64, Lse: ct.IndexedWithInt64,
                           dLse: ct.IndexedWithInt64, Delta: ct.IndexedWithInt64,
                           dQ: ct.IndexedWithInt64, Slopes, Mask: ct.IndexedWithInt64, CuSeqQ,
                           CuSeqK, Sinks, dSinks, SeqUsedK, qk_scale: float, softcap: float,
                           diag_offset: int, window_left: int, window_right: int,
                           dropout_seed: int, dropout_threshold: int, dropout_scale: float,
                           TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt,
                           TILE_DV: ConstInt, MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool,
                           EVEN_N: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool,
                           ATTN_MASK: ConstInt, DROPOUT: ConstBool, LSE_GRAD: ConstBool,
                           VARLEN: ConstBool, SINKS: ConstBool, SEQUSED_K: ConstBool):
    """``attention_bwd_dq`` in 64-bit indexing."""
    _dq_impl(Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, Slopes, Mask, CuSeqQ, CuSeqK, Sinks,
             dSinks, SeqUsedK, qk_scale, softcap, diag_offset, window_left, window_right,
             dropout_seed, dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
             MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT, LSE_GRAD, VARLEN,
             SINKS, SEQUSED_K)


@ct.kernel
def attention_bwd_preprocess_int64(Out: ct.IndexedWithInt64, dOut: ct.IndexedWithInt64,
                                   Lse: ct.IndexedWithInt64, dLse: ct.IndexedWithInt64,
                                   Delta: ct.IndexedWithInt64, CuSeqQ, Sinks, dSinks,
                                   TILE_M: ConstInt, TILE_DV: ConstInt, LSE_GRAD: ConstBool,
                                   VARLEN: ConstBool, SINKS: ConstBool):
    """``attention_bwd_preprocess`` in 64-bit indexing."""
    _preprocess_impl(Out, dOut, Lse, dLse, Delta, CuSeqQ, Sinks, dSinks, TILE_M, TILE_DV,
                     LSE_GRAD, VARLEN, SINKS)


@ct.kernel
def attention_bwd_dq_convert_int64(dQacc: ct.IndexedWithInt64, dQ: ct.IndexedWithInt64, CuSeqQ,
                                   qk_scale: float, TILE_M: ConstInt, TILE_D: ConstInt,
                                   SOFTCAP: ConstBool, VARLEN: ConstBool):
    """``attention_bwd_dq_convert`` in 64-bit indexing."""
    _dq_convert_impl(dQacc, dQ, CuSeqQ, qk_scale, TILE_M, TILE_D, SOFTCAP, VARLEN)
