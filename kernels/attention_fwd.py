"""Flash-attention forward in cuTile.

Maths. For one (batch, head) and a query row i, with scores

    s_ij = scale * q_i . k_j                                     (plain)
    s_ij = softcap * tanh(scale * q_i . k_j / softcap)           (SOFTCAP)
    s_ij += -slope * |i + diag_offset - j|                       (ALIBI)
    s_ij += mask_ij,  or s_ij = -inf where not mask_ij           (ATTN_MASK additive / bool)

over the keys j that row i sees,

    o_i   = sum_j softmax_j(s_ij) v_j
    lse_i = log sum_j exp(s_ij)            (natural log, fp32)

computed without materialising S: one program owns TILE_M query rows and walks the key/value
tiles of TILE_N rows. Per key tile it forms S = Q K^T on tensor cores (fp32 accumulate) and
updates the online softmax of FlashAttention (Dao et al. 2022, Alg. 1; FA2's deferred division):

    m_new = max(m_i, rowmax(S'))                 S' = the scores in log2 units (below)
    p     = exp2(S' - m_new)                     [TILE_M, TILE_N]
    alpha = exp2(m_i - m_new)                    [TILE_M, 1]
    l_i   = l_i * alpha + rowsum(p)
    acc   = acc * alpha + p V                    [TILE_M, TILE_DV]

and divides by l_i once at the end. Under DROPOUT each p_ij also gets a keep bit z_ij
(``_tiles.dropout_keep``): l_i sums p as above (dropout acts after the softmax), acc sums
z * p V, and the output is scaled by 1 / (1 - dropout_p) (``dropout_scale``).
S' = s * log2(e): for plain scores the factor scale * log2(e) is applied after the row max
(one multiply per row) and folded into the exp2 argument (one FMA per score). The stored LSE
is converted back to natural log.

Layout. Q [B, H, Lq, D], K [B, H_kv, Lk, D], V [B, H_kv, Lk, Dv], Out [B, H, Lq, Dv],
Lse [B, H, Lq] fp32, Slopes [B, H] fp32, Mask [B, H, Lq, Lk] bool or uint8 (nonzero =
attend) or float (stride-0 broadcast dims are read in place). Any strides: the torch side
passes flash-attn's [B, L, H, D] tensors as transposed views. K is loaded as a
[TILE_D, TILE_N] tile through a permuted load (under VARLEN a loaded [TILE_N, TILE_D] tile
of the sequence's rows is permuted), so no transpose of K is stored. H is a
multiple of H_kv (GQA/MQA): query head h reads key/value head h // (H / H_kv), in place. D
and Dv need not be powers of two: the tiles are TILE_D >= D and TILE_DV >= Dv wide and
zero-padded by the loads, so the padding adds 0 to every dot product and the padded output
columns are never stored.

Varlen (VARLEN). The sequences of a batch packed one after another: Q, Out [1, H, total_q,
D], K, V [1, H_kv, total_k, D], Lse [1, H, total_q], and CuSeqQ, CuSeqK int32 [B + 1] their
cumulative lengths. The grid is flattened over the sequences' tiles, (total_q // TILE_M + B,
H, 1): each program finds its sequence b and tile by a binary search of CuSeqQ
(``_tiles.program_tile``; at most one idle program a sequence), reads b's bounds (scalar
loads), loads its tiles through views that step one row at a time (a sequence starts at any
row; the loads stay TMA on sm_90), masks the sequence's ragged end and stores a whole tile
through the same kind of view, its ragged last tile through an ``Array.slice`` view clipped
to its rows; diag_offset = k_len - q_len per sequence
(flash-attn's varlen rule: bottom-right). ALiBi slopes and the dropout hash
take b as the batch index and the sequence's own rows and columns.

Paged keys (PAGED, under VARLEN). Packed queries against keys in pages (flash-attn's
``block_table``, vLLM's prefill and mixed batches): K [num_blocks, page_size, H_kv, D] and V
[num_blocks, page_size, H_kv, Dv] as flash-attn stores them, BlockTable [B, max_blocks] int32
naming sequence b's page of keys [p * page_size, (p + 1) * page_size); sequence b's key count
is CuSeqK[b + 1] - CuSeqK[b], or SeqUsedK[b] under SEQUSED_K (FA3's form, CuSeqK not read).
A key tile of TILE_N keys joins TILE_N // PAGE_N tile loads of PAGE_N keys (PAGE_N a power of
two dividing the page size), or under GATHER its rows are gathered each from its page
(``_pages``, the decode's loads). A tile load waits on its block-table entry: under
PAGE_AHEAD the unmasked steps' entries are read one step ahead, while the step before
computes. The keys past k_len in the last tile are real rows of some page: masked like any
ragged end, and their V rows zeroed (a page's unwritten slots may hold NaN, and 0 * NaN
would reach the output). Not with FP8; but the pages may be an FP8 cache,
float8_e4m3fn K and V standing for d_k k8 and d_v v8 (KDescale, VDescale) with Q in
float16 or bfloat16, as the decode's: each tile is widened to Q's dtype after its load
(exactly), d_k joins the softmax scale and d_v multiplies the output with 1 / l_i.

Sinks (SINKS). A learnt logit sink_h per head (gpt-oss) joins every row's softmax as a key
with no value: l_i gains exp(sink_h - m_i) and the output sums the keys alone. The running
max and sum start from it (m_i = sink_h log2(e), l_i = 1; under FP8's scaled P m_i = sink_h
log2(e) - 8, l_i = 2^8) instead of (-inf, 0), so it costs nothing in the K-loop; the stored
LSE includes it.

FP8 (FP8). Q, K and V in float8_e4m3fn with fp32 descale factors d_q, d_k, d_v per (batch,
kv head): the inputs stand for d_q q8, d_k k8, d_v v8. S = Q8 K8^T on e4m3 tensor cores
(fp32 accumulate), and d_q d_k joins the softmax scale once per program, so the scores,
softcap, masks and LSE are those of the dequantized inputs. P, the online softmax's weights
scaled by 2^8 into [0, 256] (FA3's Max_offset: unscaled, weights under 2^-10 of their row's
max would round to 0; m_i runs 8 below the max), is rounded to e4m3 (relative error <= 2^-4
above 2^-6, absolute <= 2^-10 below: <= 2^-18 of the row's max) for P V; l_i sums the
unrounded p, but on key steps of FP8_SUM_MIN_N keys or more without a band mask the tensor
core forms l_i too, from the rounded P (P times a ones tile, FP8_SUM_N equal columns), so
that the output there is the average of V under the rounded weights and the LSE theirs
(within -ln(1 - 2^-4) of the exact one); d_v multiplies the output with 1 / l_i (the 2^8
cancels, and the LSE m_i ln 2 + ln l_i is unchanged); the output is bfloat16. Under EXP2_FMA
the exp2 of the last 1 / EXP2_FMA of each unmasked step's columns comes from a quadratic on
the FMA pipe (``_tiles.exp2_fma``, relative error <= 1.73e-3, below P's rounding): on sm_90
the MUFU's exp2 of a 128x256 tile take as long as its two e4m3 matmuls, and the share moved
leaves the MUFU less than theirs. An e4m3 matmul wants both operands K-major, its reduction
axis contiguous in shared memory: Q [.., D] and K^T (loaded from K [.., Lk, D] through the
permuted order) are, V [.., Lk, Dv] is not, so the launcher passes V^T [.., Dv, Lk] and the
tile is read back as [TILE_N, TILE_DV] through the permuted order (``load_keys_major``):
reading V as stored costs a shared-memory transpose on the hot path (sm_90 SASS: 240-390
more instructions, 70-140 STS and 5-6 barriers a program against 1-2; tileiras 13.4,
2026-12-02). ``keys_major_copy`` writes V^T once a call, [TILE_DV, TILE_N] tiles read
through the permuted order: torch's strided copy of the same tensor ran at 0.35 TB/s.

Masking. Row i sees key j iff

    i + diag_offset - window_left <= j        (when MASK_LEFT)
    j <= i + diag_offset + window_right       (when MASK_RIGHT)

Causal is MASK_RIGHT with window_right = 0. flash-attn aligns masks bottom-right
(diag_offset = Lk - Lq); torch SDPA aligns causal top-left (diag_offset = 0). A row that sees
no key gets zeros in Out and +inf in Lse, as flash-attn does, so that exp(s - lse) is 0 for it
in a backward pass.

Key tiles are split into runs per query tile:
  [0, n_start)            wholly left of every row's window: never loaded;
  [n_start, n_inner)      the left window edge: masked;
  [n_inner, n_outer)      visible to every row: no mask is built or applied;
  [n_outer, n_end)        the diagonal band, right window edge and/or ragged end: masked;
  [n_end, ...)            wholly right of every row's window: never loaded.
"""

import math

import cuda.tile as ct

from ._pages import kv_tile, page_numbers, page_rows
from ._tiles import (FP8_P_LOG2_SCALE, LN_2, LOG2_E, NO_MASK, ZERO, ConstBool, ConstInt,
                     descale, dropout_keep, fp8_sum_mma, heaviest_first, load_keys_major,
                     load_seq_rows, log2_scores, program_tile, query_rows, sequence_bounds,
                     sink_start, softmax_step, store_seq_rows, tile_runs)

# FP8's row sum of P on the tensor core (``_attend_kv_tile``) is a matmul against a ones tile
# of this many columns, the narrowest an e4m3 matmul takes on sm_90 (QGMMA 64x8x32).
FP8_SUM_N = 8


def _attend_kv_tile(q, kv, Mask, rows, k_start, tile_m, j, m_i, l_i, acc, ones, band, drop,
                    TILES, MASKED: ConstBool, FEATURES, pages=None):
    """One step of the online softmax over key tile j; returns (m_i, l_i, acc).
    ``rows``, ``band``, ``drop`` and FEATURES as in ``_tiles``, ``kv`` and ``pages`` (the
    step's block-table entries read a step ahead, or None) as in ``_pages``;
    TILES = (TILE_N, TILE_D, TILE_DV, LATENCY_K, LATENCY_V, VARLEN, FP8, SUM_MMA, EXP2_FMA,
    PAGED, PAGE_N, GATHER); under VARLEN the sequence's keys start at row ``k_start`` of K
    (under PAGED in its pages), under FP8 V is V^T; under SUM_MMA l_i is [TILE_M, FP8_SUM_N]
    and ``ones`` the row sum's [TILE_N, FP8_SUM_N] operand (unread otherwise)."""
    batch, _, _, _, drop_rows = rows
    K, V, _, _, _, kv_head, _, _, _ = kv
    (TILE_N, TILE_D, TILE_DV, LATENCY_K, LATENCY_V, VARLEN, FP8, SUM_MMA, EXP2_FMA, PAGED,
     PAGE_N, GATHER) = TILES
    _, _, _, _, _, ATTN_MASK, DROPOUT = FEATURES
    if GATHER:  # each key's page and row, once for K and V
        pages = page_rows(kv, j, TILE_N)
    if PAGED:  # K^T [TILE_D, TILE_N] from the pages (an FP8 cache's in q's dtype)
        k_t = kv_tile(K, kv, j, pages, TILE_N, TILE_D, True, PAGE_N, GATHER, True, q.dtype)
    elif VARLEN:  # a tile at any row: the view steps one row at a time
        k_t = ct.permute(K.tiled_view((1, 1, TILE_N, TILE_D), padding_mode=ZERO,
                                      traversal_steps=(1, 1, 1, TILE_D)).load(
            (0, kv_head, k_start + j * TILE_N, 0), latency=LATENCY_K), (0, 1, 3, 2))
    else:  # K^T straight from K's [.., Lk, D] layout through the permuted load order
        k_t = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, TILE_D, TILE_N),
                      order=(0, 1, 3, 2), padding_mode=ZERO, latency=LATENCY_K)
    s = ct.zeros((q.shape[0], TILE_N), dtype=ct.float32)
    # Under FP8 the tensor core adds into s itself: with use_fast_acc=False tileiras sums in
    # fresh registers and adds those to the zeros, one FADD a score (128 a thread a tile).
    s = ct.mma(q, k_t.reshape((TILE_D, TILE_N)), s, use_fast_acc=FP8)  # raw scores q . k

    # The scores in log2 units; plain ones still owe the factor, applied after the row max.
    offs_k = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]  # [1, TILE_N]
    s, factor, _ = log2_scores(s, rows, offs_k, Mask, tile_m, j, band, q.shape[0], TILE_N,
                               MASKED, FEATURES, False, True)
    # Only a band or an attention mask can leave a row with nothing visible yet; EXP2_FMA
    # (FP8's alone) then stays on the MUFU, whose exp2(-inf) is 0.
    m_new, p, alpha, l_i = softmax_step(s, factor, m_i, l_i, MASKED or ATTN_MASK != NO_MASK,
                                        FP8_P_LOG2_SCALE if FP8 else 0, not SUM_MMA,
                                        EXP2_FMA if FP8 else 0)

    if FP8:  # V^T [.., Dv, Lk] read back as [TILE_N, TILE_DV]: keys contiguous (FP8 below)
        v = load_keys_major(V, batch, kv_head, k_start, j, TILE_N, TILE_DV, VARLEN, LATENCY_V)
    elif PAGED:
        v = kv_tile(V, kv, j, pages, TILE_N, TILE_DV, True, PAGE_N, GATHER, False, q.dtype)
        if MASKED:
            if (j + 1) * TILE_N > band[0]:  # the tile k_len cuts: zero the rows past it
                rows_v = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
                v = ct.where(rows_v < band[0], v, 0.0).astype(v.dtype)
    else:
        v = load_seq_rows(V, batch, kv_head, k_start, j, TILE_N, TILE_DV, VARLEN, LATENCY_V)
    if DROPOUT:  # after the row sum: dropout does not change the normaliser
        p = ct.where(dropout_keep(drop_rows, offs_k, drop[1]), p, 0.0)
    # FP8 (both e4m3): P, scaled into [0, 256] by softmax_step, rounds to e4m3 as it is (FA3's
    # choice), and V^T's keys are the contiguous axis. The tensor core adds into acc itself, as FA3
    # does (its fp32 accumulator keeps fewer mantissa bits): under use_fast_acc=False tileiras sums
    # each tile's P V in fresh registers and adds them to acc, one FADD an output element a tile
    # (with the scores' FADDs, 3,632 sm_90 instructions instead of 3,048 at D = 128, non-causal, no
    # LSE), and the second accumulator spills at Dv = 256 (521 LDL/STL on sm_90's 128x64 tile).
    p = p.astype(v.dtype)
    if SUM_MMA:
        # The row sum of the rounded P on the tensor core too, P times a tile of ones: a few
        # QGMMAs in place of a FADD a score. Summed in fresh registers and added to l_i (not
        # use_fast_acc): added into l_i itself, the tensor core's fewer mantissa bits dropped
        # the small weights of a long row against a large l_i (outputs off by up to 0.34 at
        # 16k keys, against 0.002 summed per tile; H200, 2026-12-05).
        l_i = ct.mma(p, ones, l_i)  # [TILE_M, FP8_SUM_N]
    acc = ct.mma(p, v, acc * alpha, use_fast_acc=FP8)  # [TILE_M, TILE_DV]
    return m_new, l_i, acc


def _attention_fwd_impl(Q, K, V, Out, Lse, Slopes, Mask, CuSeqQ, CuSeqK, Sinks, SeqUsedK,
                        QDescale, KDescale, VDescale, BlockTable, qk_scale, softcap,
                        diag_offset, window_left, window_right, dropout_seed,
                        dropout_threshold, dropout_scale, TILE_M: ConstInt,
                        TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt,
                        MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool,
                        EVEN_N: ConstBool, SOFTCAP: ConstBool, ALIBI: ConstBool,
                        ATTN_MASK: ConstInt, STORE_LSE: ConstBool, DROPOUT: ConstBool,
                        LATENCY_K: ConstInt, LATENCY_V: ConstInt, VARLEN: ConstBool,
                        SINKS: ConstBool, SEQUSED_K: ConstBool, FP8: ConstBool,
                        EXP2_FMA: ConstInt, PAGED: ConstBool, PAGE_N: ConstInt,
                        GATHER: ConstBool, PAGE_AHEAD: ConstBool):
    """The forward for query tile ``heaviest_first`` of head bid(1) of the batch (or, under
    VARLEN, sequence) and tile index of ``program_tile``."""
    # Under VARLEN ``batch`` is the sequence: its rows of the packed [1, H, total, D] arrays,
    # its ALiBi slopes and its dropout hash.
    batch, index = program_tile(CuSeqQ, TILE_M, VARLEN)
    q_start, q_len, k_start, k_len = sequence_bounds(Q, K, CuSeqQ, CuSeqK, SeqUsedK, batch,
                                                     VARLEN, SEQUSED_K, PAGED)
    if VARLEN:
        diag_offset = k_len - q_len  # bottom-right per sequence, flash-attn's varlen rule
    tile_m = heaviest_first(q_len, index, TILE_M)
    if VARLEN:
        if tile_m < 0:  # the flattened grid's idle program past this sequence's tiles
            return
    head = ct.bid(1)
    kv_heads = K.shape[2] if PAGED else K.shape[1]  # pages are [.., page_size, H_kv, D]
    kv_head = head // (Q.shape[1] // kv_heads)  # GQA: the group's shared K/V head
    m_start = tile_m * TILE_M
    P_LOG2_SCALE = FP8_P_LOG2_SCALE if FP8 else 0  # softmax_step's scale of the weights
    if FP8:
        # The scores are q_descale * k_descale * (q8 . k8): the product joins the softmax
        # scale once (softcap and the deferred log2 scale read it from there); v_descale
        # multiplies the output with 1 / l_i. One pair of scalars per (batch, kv head).
        qk_scale = qk_scale * descale(QDescale, batch, kv_head) * \
            descale(KDescale, batch, kv_head)
    elif K.dtype != Q.dtype:  # an FP8 cache (PAGED): the scores are those of d_k k8
        qk_scale = qk_scale * descale(KDescale, batch, kv_head)

    # Loaded once, reused by every key tile.
    q = load_seq_rows(Q, batch, head, q_start, tile_m, TILE_M, TILE_D, VARLEN)
    offs_q = m_start + ct.arange(TILE_M, dtype=ct.int32)[:, None]  # [TILE_M, 1]
    band = (k_len, qk_scale, softcap, diag_offset, window_left, window_right)
    drop = (dropout_seed, dropout_threshold, dropout_scale)
    # SUM_MMA: the tensor core sums each row of P into every column of l_i (FP8_SUM_N of
    # them, the matmul's narrowest), against a tile of ones made here, once (made inside the
    # K-loop it went through shared memory each step). It paid on wide unmasked key steps
    # (FP8_SUM_MIN_N), not on narrower ones nor under a band mask (FP8_SUM_MIN_N's note).
    SUM_MMA = FP8 and fp8_sum_mma(TILE_N, MASK_LEFT or MASK_RIGHT)
    TILES = (TILE_N, TILE_D, TILE_DV, LATENCY_K, LATENCY_V, VARLEN, FP8, SUM_MMA, EXP2_FMA,
             PAGED, PAGE_N, GATHER)
    # What the key tiles' loads read (``_pages``); under PAGED K.shape[1] is the page size.
    kv = (K, V, BlockTable, 0, batch, kv_head, K.shape[1], 0, k_len)
    FEATURES = (MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT)
    rows = query_rows(Slopes, batch, head, Q.shape[1], offs_q, drop, FEATURES)

    SUM_N = FP8_SUM_N if SUM_MMA else 1
    ones = ct.full((TILE_N, SUM_N), 1.0, dtype=V.dtype)
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((TILE_M, SUM_N), dtype=ct.float32)
    if SINKS:  # the running max and sum start from the head's sink
        sink = ct.load(Sinks, index=(head,), shape=(1,)).reshape((1, 1)) * LOG2_E
        m_i, l_i = sink_start(sink, TILE_M, SUM_N, P_LOG2_SCALE)
    acc = ct.zeros((TILE_M, TILE_DV), dtype=ct.float32)

    # Key tiles: row i sees j in [i + diag_offset - left, i + diag_offset + right].
    n_start, n_inner, n_outer, n_end = tile_runs(
        m_start, k_len, diag_offset - window_left, diag_offset + window_right, TILE_M, TILE_N,
        MASK_LEFT, MASK_RIGHT)
    if MASK_LEFT:
        for j in range(n_start, n_inner):
            m_i, l_i, acc = _attend_kv_tile(q, kv, Mask, rows, k_start, tile_m, j, m_i, l_i,
                                            acc, ones, band, drop, TILES, True, FEATURES)
    if PAGE_AHEAD:
        # Each step's block-table entries read a step ahead: a page's tile load waits on its
        # entry, and read in the step a 128-key step's loads took 1.34-1.78x the time (sm_90
        # D = 128 on 256- to 16-key pages, H100, 2026-12-07, docs/experiments).
        # (A sequence of no keys, whose loop is empty, reads its first entry.)
        kv_ahead = (K, V, BlockTable, 0, batch, kv_head, K.shape[1], 0, max(k_len, 1))
        ahead = page_numbers(kv_ahead, n_inner * TILE_N, TILE_N, PAGE_N)
        for j in range(n_inner, n_outer):
            pages_j = ahead
            ahead = page_numbers(kv_ahead, (j + 1) * TILE_N, TILE_N, PAGE_N)
            m_i, l_i, acc = _attend_kv_tile(q, kv, Mask, rows, k_start, tile_m, j, m_i, l_i,
                                            acc, ones, band, drop, TILES, False, FEATURES,
                                            pages_j)
    else:
        for j in range(n_inner, n_outer):
            m_i, l_i, acc = _attend_kv_tile(q, kv, Mask, rows, k_start, tile_m, j, m_i, l_i,
                                            acc, ones, band, drop, TILES, False, FEATURES)
    for j in range(n_outer, n_end):
        m_i, l_i, acc = _attend_kv_tile(q, kv, Mask, rows, k_start, tile_m, j, m_i, l_i, acc,
                                        ones, band, drop, TILES, True, FEATURES)

    if SUM_MMA:  # its columns hold the same sum
        l_i = ct.max(l_i, axis=-1, keepdims=True)
    # Rows that saw no key have l_i = 0 and acc = 0: divide by 1 to return zeros (with a sink
    # they have l_i = 2**P_LOG2_SCALE: the sink took all the weight, and the output is 0 too).
    empty = l_i == 0.0
    inv_l = 1.0 / ct.where(empty, 1.0, l_i)  # [TILE_M, 1]
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    if FP8 or V.dtype != Q.dtype:  # (an FP8 cache: the values are d_v v8)
        inv_l = inv_l * descale(VDescale, batch, kv_head)
    out = (acc * inv_l).astype(Out.dtype).reshape((1, 1, TILE_M, TILE_DV))
    # Under VARLEN clipped at the sequence's last row, not at the packed tensor's.
    store_seq_rows(Out, batch, head, q_start, q_len, tile_m, out, VARLEN)
    if STORE_LSE:
        lse = ct.where(empty, math.inf, m_i * LN_2 + ct.log(l_i))  # [TILE_M, 1]
        store_seq_rows(Lse, batch, head, q_start, q_len, tile_m, lse.reshape((1, 1, TILE_M)),
                       VARLEN)


def _keys_major_copy_impl(V, VT, TILE_N: ConstInt, TILE_DV: ConstInt):
    """V^T's [TILE_DV, TILE_N] tile of keys bid(0), key/value head bid(1), batch bid(2)."""
    index = (ct.bid(2), ct.bid(1), 0, ct.bid(0))
    # The permuted order reads V [.., Lk, Dv] as V^T: the transpose is the load's, so global
    # memory sees only 16-byte loads and stores and the bytes move in shared memory
    # (sm_90: LDG.128, STS.U8, LDS.128, STG.128).
    tile = ct.load(V, index=index, shape=(1, 1, TILE_DV, TILE_N), order=(0, 1, 3, 2),
                   padding_mode=ZERO)
    ct.store(VT, index=index, tile=tile)


@ct.kernel
def attention_fwd(Q, K, V, Out, Lse, Slopes, Mask, CuSeqQ, CuSeqK, Sinks, SeqUsedK,
                  QDescale, KDescale, VDescale, BlockTable, qk_scale: float,
                  softcap: float,
                  diag_offset: int, window_left: int, window_right: int, dropout_seed: int,
                  dropout_threshold: int, dropout_scale: float,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt,
                  MASK_LEFT: ConstBool, MASK_RIGHT: ConstBool, EVEN_N: ConstBool,
                  SOFTCAP: ConstBool, ALIBI: ConstBool, ATTN_MASK: ConstInt,
                  STORE_LSE: ConstBool, DROPOUT: ConstBool, LATENCY_K: ConstInt,
                  LATENCY_V: ConstInt, VARLEN: ConstBool, SINKS: ConstBool,
                  SEQUSED_K: ConstBool, FP8: ConstBool, EXP2_FMA: ConstInt,
                  PAGED: ConstBool, PAGE_N: ConstInt, GATHER: ConstBool,
                  PAGE_AHEAD: ConstBool):
    """Grid (cdiv(Lq, TILE_M), H, B). ``Lse`` is only written when STORE_LSE, ``Slopes`` only
    read when ALIBI, ``Mask`` only when ATTN_MASK; ``softcap`` is only read when SOFTCAP, the
    window bounds only when the matching MASK_ switch is on, the dropout scalars only under
    DROPOUT. LATENCY_K and LATENCY_V (1-10) are the DRAM-latency hints of the K and V tile
    loads, which set how far ahead tileiras issues them. Under VARLEN Q, K, V, Out are packed
    [1, H, total, D] views and Lse [1, H, total_q], CuSeqQ and CuSeqK [B + 1] int32 the
    sequences' cumulative lengths (read only then), the grid (total_q // TILE_M + B, H, 1);
    under SEQUSED_K too, sequence b uses its first SeqUsedK[b] keys ([B] int32). Under
    SINKS, Sinks [H] fp32 holds each head's sink logit (read only then). Under FP8 Q and K
    are float8_e4m3fn, V comes transposed, V^T [B, H_kv, Dv, Lk] e4m3 (packed [1, H_kv, Dv,
    total_k] under VARLEN), Out is bfloat16 and QDescale, KDescale, VDescale [B, H_kv] fp32
    (any strides) hold the q, k and v descale factors (read only then); EXP2_FMA (0, 2 or 4;
    FP8 only) takes the exp2 of the last 1 / EXP2_FMA of each unmasked key step's columns
    from the FMA pipe (``_tiles.exp2_fma``). Under PAGED (with VARLEN, not FP8) K and V are pages
    [num_blocks, page_size, H_kv, D / Dv] and BlockTable [B, max_blocks] int32 each
    sequence's pages (read only then), joined from loads of PAGE_N keys or, under GATHER,
    gathered by row, under PAGE_AHEAD (joined loads only) the unmasked key steps' block-table
    entries read a step ahead; pages of float8_e4m3fn (an FP8 cache) take their factors
    from KDescale and VDescale (QDescale not read). Shapes and strides are 32-bit."""
    _attention_fwd_impl(Q, K, V, Out, Lse, Slopes, Mask, CuSeqQ, CuSeqK, Sinks, SeqUsedK,
                        QDescale, KDescale, VDescale, BlockTable, qk_scale, softcap,
                        diag_offset, window_left, window_right, dropout_seed,
                        dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
                        MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, STORE_LSE,
                        DROPOUT, LATENCY_K, LATENCY_V, VARLEN, SINKS, SEQUSED_K, FP8,
                        EXP2_FMA, PAGED, PAGE_N, GATHER, PAGE_AHEAD)


@ct.kernel
def attention_fwd_int64(Q: ct.IndexedWithInt64, K: ct.IndexedWithInt64,
                        V: ct.IndexedWithInt64, Out: ct.IndexedWithInt64,
                        Lse: ct.IndexedWithInt64, Slopes, Mask: ct.IndexedWithInt64,
                        CuSeqQ, CuSeqK, Sinks, SeqUsedK, QDescale, KDescale, VDescale,
                        BlockTable, qk_scale: float,
                        softcap: float, diag_offset: int,
                        window_left: int, window_right: int, dropout_seed: int,
                        dropout_threshold: int, dropout_scale: float, TILE_M: ConstInt,
                        TILE_N: ConstInt, TILE_D: ConstInt, TILE_DV: ConstInt,
                        MASK_LEFT: ConstBool,
                        MASK_RIGHT: ConstBool, EVEN_N: ConstBool, SOFTCAP: ConstBool,
                        ALIBI: ConstBool, ATTN_MASK: ConstInt, STORE_LSE: ConstBool,
                        DROPOUT: ConstBool, LATENCY_K: ConstInt, LATENCY_V: ConstInt,
                        VARLEN: ConstBool, SINKS: ConstBool, SEQUSED_K: ConstBool,
                        FP8: ConstBool, EXP2_FMA: ConstInt, PAGED: ConstBool,
                        PAGE_N: ConstInt, GATHER: ConstBool,
                        PAGE_AHEAD: ConstBool):
    """``attention_fwd`` with 64-bit shapes and strides, for tensors of 2**31 elements or
    more (the launcher picks it); the same body."""
    _attention_fwd_impl(Q, K, V, Out, Lse, Slopes, Mask, CuSeqQ, CuSeqK, Sinks, SeqUsedK,
                        QDescale, KDescale, VDescale, BlockTable, qk_scale, softcap,
                        diag_offset, window_left, window_right, dropout_seed,
                        dropout_threshold, dropout_scale, TILE_M, TILE_N, TILE_D, TILE_DV,
                        MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, STORE_LSE,
                        DROPOUT, LATENCY_K, LATENCY_V, VARLEN, SINKS, SEQUSED_K, FP8,
                        EXP2_FMA, PAGED, PAGE_N, GATHER, PAGE_AHEAD)


@ct.kernel
def keys_major_copy(V, VT, TILE_N: ConstInt, TILE_DV: ConstInt):
    """V^T for the FP8 forward: V [B, H_kv, Lk, Dv] (any strides) copied to VT [B, H_kv, Dv,
    Lk_pad], Lk_pad >= Lk (the keys past Lk are written as the load pads them, zeros). Grid
    (cdiv(Lk_pad, TILE_N), H_kv, B); TILE_DV >= Dv, the rows past Dv never stored. Shapes and
    strides are 32-bit."""
    _keys_major_copy_impl(V, VT, TILE_N, TILE_DV)


@ct.kernel
def keys_major_copy_int64(V: ct.IndexedWithInt64, VT: ct.IndexedWithInt64, TILE_N: ConstInt,
                          TILE_DV: ConstInt):
    """``keys_major_copy`` with 64-bit shapes and strides (2**31 elements or more)."""
    _keys_major_copy_impl(V, VT, TILE_N, TILE_DV)

