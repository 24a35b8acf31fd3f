"""Tile helpers shared by the forward, backward and decode kernels: which tiles a band mask
lets through, the mask, bias and dropout of one tile pair, and the constants they agree on
(the forward and the decode share the online-softmax step).

Masks are written for two index vectors that broadcast against each other: ``offs_q`` holds
query rows and ``offs_k`` key columns, as [M, 1] and [1, N] for a score tile S, or as [1, M]
and [N, 1] for its transpose S^T (the backward's dK/dV kernel). Query row i sees key j iff

    i + diag_offset - window_left <= j        (when MASK_LEFT)
    j <= i + diag_offset + window_right       (when MASK_RIGHT)
    j < k_len                                 (unless EVEN_N)

Dropout keeps score (b, h, i, j) iff hash(seed, b * H + h, i, j) >= threshold, a pure function
of those indices (no RNG state, no stored mask): the backward recomputes the forward's mask
exactly, whatever the tiles. Per query row the state is ``mix32`` (the "lowbias32" integer
finaliser, bijective on 32 bits) chained twice; per score two of its multiply rounds follow:

    row  = mix32(mix32(uint32(i) + uint32(b * H + h) * ROW_MULT) ^ seed)
    x    = (row ^ uint32(j) * COL_MULT) * MIX_MULT_1                     (mod 2**32)
    keep = (x ^ x >> 16) * MIX_MULT_2  >=  threshold                     (unsigned compare)

with threshold = min(round(p * 2**32), 2**32 - 1) (``dropout_threshold``, computed on the
host and passed as the int32 of the same bits); ``flash_tile.reference.dropout_keep`` is its
torch twin.

The per-score part is lowbias32 without its outer xor-shifts: the row state is mixed already,
and the last xor-shift changes only the low 16 bits, which decide a compare against the
threshold only where the 16 bits above them tie with it. It takes 7 integer instructions a
score where the whole finaliser and a 31-bit compare took 12 (sm_90 SASS), and the forward's
D = 64 loop is bound by issue (docs/kernel-internals.md). One multiply alone is not enough: the
keep bits of neighbouring scores then correlate visibly (tests/test_reference.py checks).

The helpers of both kernels pass what is the same for every tile pair of a launch as tuples
(cuTile unpacks them at compile time, so they cost nothing):

    band     = (k_len, qk_scale, softcap, diag_offset, window_left, window_right)
    drop     = (dropout_seed, dropout_threshold, dropout_scale)
    FEATURES = (MASK_LEFT, MASK_RIGHT, EVEN_N, SOFTCAP, ALIBI, ATTN_MASK, DROPOUT)  constants
    rows     = (batch, head, offs_q, slope, drop_rows)      a block of query rows (query_rows)
"""

import math

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

LOG2_E = 1.4426950408889634
LN_2 = math.log(2.0)

# FP8's P is 2**FP8_P_LOG2_SCALE times the weights, in [0, 256] (within e4m3's 448), when it
# is rounded to e4m3 for P V: e4m3 keeps a weight of 2^-9 at the least, so unscaled weights
# more than 2^10 below their row's max would flush to 0 while l_i counts them (a row with one
# dominant key then lost 16-58% of its output's magnitude in the float64 twin at 1k-16k keys,
# 2026-12-05). Scaled, weights down to 2^-18 of the max keep a value. FA3's Max_offset = 8.
# The decode of an FP8 cache scales its float16 P the same way: float16 then loses only
# weights under 2^-32 of their row's max (2^-24 unscaled), and 2^8 is far within its 65504.
FP8_P_LOG2_SCALE = 8

# The FP8 forward sums l_i on the tensor core (the rounded P times a ones tile) on key steps
# at least this wide when no band mask is on; else a FADD a score. On the H200 against the
# FADD sum (2026-12-05, bench_variants.py --dtype fp8 --baseline, interleaved): D = 128's
# 128x256 steps 0.887-0.981x the time non-causal (1k-16k) but 1.007-1.139x causal; D = 64's
# and D = 256's 128-key steps 1.025-1.053x and 1.0-1.037x; on an H100 (2026-12-06, same
# command) D = 128 non-causal 0.915x / 0.906x at 4k / 16k. [tileiras 13.4, cuda-tile 1.7.0;
# docs/experiments/evidence/2026-12-05-fp8-row-sum-h200.md, 2026-12-06-fp8-row-sum-h100.md]
FP8_SUM_MIN_N = 256

# FP8's exp2 on the FMA pipe (``exp2_fma``): on a 128x256 e4m3 step the MUFU's 16 exp2 a
# cycle and SM take as long as the tensor cores' two matmuls of the tile. Adding 1.5 * 2**23
# to |x| < 2**22 rounds x to the nearest integer j, left in the low mantissa bits; 2**f for
# f = x - j in [-0.5, 0.5] is a quadratic fitted for relative error (at most 1.73e-3, against
# e4m3's rounding of P, up to 6.3e-2). The share of each unmasked FP8 step's columns that
# take it is the forward's EXP2_FMA switch (``variants.TileConfig.exp2_fma``).
EXP2_ROUND = 12582912.0
EXP2_C0 = 1.0004426
EXP2_C1 = 0.7034351
EXP2_C2 = 0.2384218

# ATTN_MASK: no mask, a boolean mask (True = attend, as torch), or an additive float mask.
# A boolean mask comes as bool or as its uint8 view (nonzero = attend). TMA loads of bool tiles
# were misread on the H200 (cuda-tile 1.7.0, tileiras 13.4: whenever the mask's rows were
# 16-byte aligned, outputs and gradients off by 0.4-2.4 against torch's 0.003-0.03 in bf16),
# so bool tiles load without TMA; the host passes the uint8 view where rows are aligned, which
# TMA reads right [2026-12-01].
NO_MASK = 0
BOOL_MASK = 1
ADDITIVE_MASK = 2

# Zero padding past the ends of Q/K/V/dO: a padded V or dO row must be 0, not NaN, because it
# meets a p of 0 in a matmul (0 * NaN = NaN); padded head-dim columns must be 0 so that they
# add nothing to a dot product. Padded K rows are masked where they could reach a stored
# value (the forward and dQ); in dK/dV they are never stored. Padded Q rows are never stored
# by the forward and dQ; in dK/dV they are summed in, and add nothing there because their
# LSE is padded with +inf (p = 0) and their Delta and dO with 0.
ZERO = ct.PaddingMode.ZERO


# Odd multipliers that spread row and column indices over 32 bits before mixing, and the two
# of lowbias32's rounds (also the per-score hash's).
ROW_MULT = 0x9E3779B9
COL_MULT = 0x85EBCA77
MIX_MULT_1 = 0x7FEB352D
MIX_MULT_2 = 0x846CA68B


def dropout_threshold(p: float) -> int:
    """The unsigned 32-bit threshold of drop probability ``p`` (a host-side helper: the
    launcher passes its bits as the int32 ``dropout_threshold``); capped so that p just below 1
    still keeps a score."""
    return min(round(p * 2**32), 2**32 - 1)


def mix32(x):
    """lowbias32 (C. Wellons): a bijective avalanche hash of a uint32 tile."""
    x = x ^ (x >> 16)
    x = x * MIX_MULT_1
    x = x ^ (x >> 15)
    x = x * MIX_MULT_2
    return x ^ (x >> 16)


def dropout_rows(seed, batch, head, heads, offs_q):
    """The per-query-row dropout state (uint32, offs_q's shape) of head ``head`` of ``batch``."""
    bh = ct.full((1, 1), batch * heads + head, dtype=ct.int32).astype(ct.uint32)
    seed_u32 = ct.full((1, 1), seed, dtype=ct.int32).astype(ct.uint32)
    return mix32(mix32(offs_q.astype(ct.uint32) + bh * ROW_MULT) ^ seed_u32)


def dropout_keep(rows, offs_k, threshold):
    """Which scores dropout keeps: ``rows`` from ``dropout_rows`` against key columns
    ``offs_k`` (the two broadcast to the tile, S or S^T)."""
    x = (rows ^ (offs_k.astype(ct.uint32) * COL_MULT)) * MIX_MULT_1
    x = (x ^ (x >> 16)) * MIX_MULT_2
    return x >= ct.bitcast(ct.full((1, 1), threshold, dtype=ct.int32), ct.uint32)


def heaviest_first(q_len, index, TILE_M: ConstInt):
    """The query tile of the program with tile index ``index`` (``program_tile``), last to
    first: under a causal band the last query tiles see the most keys, and starting them first
    leaves the light ones to fill the tail of the launch. The count of tiles comes from the
    shape: reading ct.num_blocks(0) instead cost 8 LDL/STL on sm_80 at D=128 with a bool mask
    (tileiras 13.4). Negative past the sequence's tiles (VARLEN)."""
    return ct.cdiv(q_len, TILE_M) - 1 - index


def clamp(x, lo, hi):
    return min(max(x, lo), hi)


def tile_runs(start, other_len, lo_offset, hi_offset,
              TILE: ConstInt, TILE_OTHER: ConstInt, HAS_LO: ConstBool, HAS_HI: ConstBool):
    """Runs of the other side's tiles for the tile of TILE rows at ``start`` of one side,
    where row a of this side sees index b of the other iff a + lo_offset <= b (if HAS_LO) and
    b <= a + hi_offset (if HAS_HI), and b < other_len.

    Returns (t_start, t_inner, t_outer, t_end): tiles [t_start, t_inner) and
    [t_outer, t_end) need a mask, [t_inner, t_outer) are visible to every row, the rest to
    none. The bounds of the first row (lo) and of the last (hi) are the loosest, those of the
    opposite rows the tightest; rows past this side's end count too (they are never stored).
    """
    t_start = 0
    inner_lo = 0  # first index visible to every row
    if HAS_LO:
        t_start = clamp(start + lo_offset, 0, other_len) // TILE_OTHER
        inner_lo = start + TILE - 1 + lo_offset
    t_end = ct.cdiv(other_len, TILE_OTHER)
    inner_hi = other_len  # one past the last index visible to every row
    if HAS_HI:
        t_end = ct.cdiv(clamp(start + TILE + hi_offset, 0, other_len), TILE_OTHER)
        inner_hi = min(start + hi_offset + 1, other_len)
    # Clamp before dividing: the bounds can be negative or past the end.
    t_inner = clamp(ct.cdiv(clamp(inner_lo, 0, other_len), TILE_OTHER), t_start, t_end)
    t_outer = clamp(max(inner_hi, 0) // TILE_OTHER, t_inner, t_end)
    return t_start, t_inner, t_outer, t_end


def visible(offs_q, offs_k, band, SHAPE, FEATURES):
    """Boolean tile of ``SHAPE``: which (query, key) pairs of the broadcast offsets are
    visible."""
    k_len, _, _, diag_offset, window_left, window_right = band
    MASK_LEFT, MASK_RIGHT, EVEN_N, _, _, _, _ = FEATURES
    keep = ct.full(SHAPE, True, dtype=ct.bool_)
    if not EVEN_N:
        keep = keep & (offs_k < k_len)
    if MASK_LEFT:
        keep = keep & (offs_k >= offs_q + diag_offset - window_left)
    if MASK_RIGHT:
        keep = keep & (offs_k <= offs_q + diag_offset + window_right)
    return keep


def query_rows(Slopes, batch, head, heads, offs_q, drop, FEATURES):
    """``rows`` for query rows ``offs_q`` of one head: with them the ALiBi slope ([1, 1], or
    0.0 without ALIBI) and the dropout row state (``dropout_rows``, or 0 without DROPOUT)."""
    _, _, _, _, ALIBI, _, DROPOUT = FEATURES
    slope = 0.0
    if ALIBI:
        slope = ct.load(Slopes, index=(batch, head), shape=(1, 1))  # [1, 1]
    drop_rows = 0
    if DROPOUT:
        drop_rows = dropout_rows(drop[0], batch, head, heads, offs_q)
    return batch, head, offs_q, slope, drop_rows


def alibi_bias_log2(offs_q, offs_k, diag_offset, slope):
    """-slope * |i + diag_offset - j| in log2 units, fp32, for the broadcast offsets."""
    distance = ct.abs(offs_q + diag_offset - offs_k)
    return (slope * -LOG2_E) * distance.astype(ct.float32)


def load_rows(A, batch, head, index, ROWS: ConstInt, COLS: ConstInt, latency=None):
    """The [ROWS, COLS] tile ``index`` of rows of A[batch, head] ([B, H, L, C]), zero-padded;
    ``latency`` the load's DRAM-latency hint (None: tileiras's choice)."""
    tile = ct.load(A, index=(batch, head, index, 0), shape=(1, 1, ROWS, COLS), padding_mode=ZERO,
                   latency=latency)
    return tile.reshape((ROWS, COLS))


def program_tile(CuSeq, TILE: ConstInt, VARLEN: ConstBool):
    """(batch, index): this program's batch (under VARLEN, sequence) and its tile's index
    along the rows that CuSeq [B + 1] int32 cuts into sequences.

    Dense grids are (tiles, heads, B): (bid(2), bid(0)). Under VARLEN the grid is flattened,
    (total // TILE + B, heads, 1): program w = bid(0) walks the sequences' tiles back to back,
    sequence b's from first_b = r_b // TILE + b, r_b = CuSeq[b] - CuSeq[0] its first row
    counted from the first sequence's (the offsets need not start at 0). first_(b+1) -
    first_b = r_(b+1) // TILE - r_b // TILE + 1 >= cdiv(len_b, TILE), so every tile has a
    program and a sequence at most one idle one (index past its tiles: the caller returns),
    where a grid padded to the longest sequence leaves most programs idle (5 in 6 at 64k
    tokens of lengths 64-8192). first_b grows strictly and first_0 = 0, so w's sequence is the
    last b with first_b <= w: a binary search of ceil(log2 B) scalar loads (w past the last
    sequence gets the last one and an index past its tiles; no index is negative). A vector
    search (the offsets loaded or gathered as a tile, a sum or max of first_b <= w as the
    index) makes tileiras 13.4 fail on sm_90 (exit 5, no message; sm_80 and sm_100 compiled)
    [2026-12-03]. Nothing is read on the host: the grid comes from the shapes."""
    if VARLEN:
        w = ct.bid(0)
        base = ct.load(CuSeq, (0,), shape=()).item()
        lo = 0
        hi = CuSeq.shape[0] - 2  # the last sequence
        while lo < hi:  # first_lo <= w, and w's sequence is in [lo, hi]
            mid = (lo + hi + 1) // 2
            first = (ct.load(CuSeq, (mid,), shape=()).item() - base) // TILE + mid
            lo = mid if first <= w else lo
            hi = hi if first <= w else mid - 1
        start = ct.load(CuSeq, (lo,), shape=()).item()
        return lo, w - ((start - base) // TILE + lo)
    return ct.bid(2), ct.bid(0)


def query_bounds(Q, CuSeqQ, batch, VARLEN: ConstBool):
    """(q_start, q_len) of sequence ``batch``: the whole of axis 2 of Q, or under VARLEN its
    rows of the packed Q, read from the cumulative lengths CuSeqQ [B + 1] int32."""
    if VARLEN:
        q_start = ct.load(CuSeqQ, (batch,), shape=()).item()
        return q_start, ct.load(CuSeqQ, (batch + 1,), shape=()).item() - q_start
    return 0, Q.shape[2]


def sequence_bounds(Q, K, CuSeqQ, CuSeqK, SeqUsedK, batch, VARLEN: ConstBool,
                    SEQUSED_K: ConstBool, PAGED: ConstBool):
    """(q_start, q_len, k_start, k_len) of sequence ``batch``: ``query_bounds`` and the same
    for the keys (CuSeqK [B + 1] int32); under SEQUSED_K its first SeqUsedK[b] keys. Under
    PAGED (the forward's keys in pages) k_start is 0, and with SEQUSED_K CuSeqK is not read
    (FA3's paged calls pass no cumulative key lengths)."""
    q_start, q_len = query_bounds(Q, CuSeqQ, batch, VARLEN)
    if VARLEN:
        first = 0 if PAGED and SEQUSED_K else ct.load(CuSeqK, (batch,), shape=()).item()
        if SEQUSED_K:
            k_len = ct.load(SeqUsedK, (batch,), shape=()).item()
        else:
            k_len = ct.load(CuSeqK, (batch + 1,), shape=()).item() - first
        # Under PAGED the keys start in the sequence's first page, not at a packed row.
        return q_start, q_len, 0 if PAGED else first, k_len
    return q_start, q_len, 0, K.shape[2]


def load_seq_rows(A, batch, head, start, index, ROWS: ConstInt, COLS: ConstInt,
                  VARLEN: ConstBool, latency=None):
    """``load_rows`` of one sequence: under VARLEN the tile ``index`` of the rows of the packed
    A[0, head] from row ``start`` on (a sequence starts at any row: the view steps one row at a
    time, which keeps the TMA load; rows past the sequence are the next one's)."""
    if VARLEN:
        tile = A.tiled_view((1, 1, ROWS, COLS), padding_mode=ZERO,
                            traversal_steps=(1, 1, 1, COLS)).load(
            (0, head, start + index * ROWS, 0), latency=latency)
        return tile.reshape((ROWS, COLS))
    return load_rows(A, batch, head, index, ROWS, COLS, latency)


def load_keys_major(A_T, batch, head, start, index, ROWS: ConstInt, COLS: ConstInt,
                    VARLEN: ConstBool, latency=None):
    """``load_seq_rows`` of A [B, H, L, C] given as its transpose A_T [B, H, C, L] (L
    contiguous): the same [ROWS, COLS] tile, read through the permuted load order, so that
    the rows (a matmul's reduction axis when the tile is its right operand) are contiguous in
    shared memory, as an FP8 tensor-core matmul wants both operands."""
    if VARLEN:
        tile = ct.permute(A_T.tiled_view((1, 1, COLS, ROWS), padding_mode=ZERO,
                                         traversal_steps=(1, 1, COLS, 1)).load(
            (0, head, 0, start + index * ROWS), latency=latency), (0, 1, 3, 2))
    else:
        tile = ct.load(A_T, index=(batch, head, index, 0), shape=(1, 1, ROWS, COLS),
                       order=(0, 1, 3, 2), padding_mode=ZERO, latency=latency)
    return tile.reshape((ROWS, COLS))


def descale(Descale, batch, head):
    """Descale[batch, head] of an fp32 [B, H_kv] array (any strides: one factor for every
    (batch, kv head) is a view of zero strides), as a scalar: an FP8 descale factor (the
    forward's q, k, v ones, an FP8 cache's k and v ones in the forward and the decode)."""
    return ct.load(Descale, (batch, head), shape=()).item()


def load_seq_vector(A, batch, head, start, index, ROWS: ConstInt, padding, VARLEN: ConstBool):
    """The [1, 1, ROWS] tile ``index`` of an fp32 [B, H, L] row vector (LSE, Delta), padded
    with ``padding``; under VARLEN counted from row ``start`` of the packed A[0, head]."""
    if VARLEN:
        return A.tiled_view((1, 1, ROWS), padding_mode=padding,
                            traversal_steps=(1, 1, 1)).load((0, head, start + index * ROWS))
    return ct.load(A, index=(batch, head, index), shape=(1, 1, ROWS), padding_mode=padding)


def store_seq_rows(A, batch, head, start, length, index, tile, VARLEN: ConstBool):
    """Store the [1, 1, ROWS, COLS] ``tile`` as tile ``index`` of A[batch, head], or a
    [1, 1, ROWS] tile of an fp32 [B, H, L] row vector (LSE, Delta); under VARLEN into rows
    start .. start + length of the packed A, clipped at the sequence's last row. A whole tile
    goes through a view of the packed A that steps one row at a time (the launch's tensor
    map, as ``load_seq_rows``); only the sequence's ragged last tile is clipped through a
    slice, whose tensor map each program writes at run time (a 128-byte global write and a
    fence before the store)."""
    RANK = len(tile.shape)  # 4 for a tile of rows, 3 for a vector's
    if VARLEN:
        ROWS = tile.shape[2]
        if (index + 1) * ROWS <= length:
            A.tiled_view(tile.shape, traversal_steps=(1, 1, 1, *tile.shape[3:])).store(
                (0, head, start + index * ROWS, 0)[:RANK], tile)
        else:
            A.slice(axis=2, start=start, stop=start + length).tiled_view(tile.shape).store(
                (0, head, index, 0)[:RANK], tile)
    else:
        ct.store(A, index=(batch, head, index, 0)[:RANK], tile=tile)


def add_seq_rows(A, batch, head, start, length, index, tile, VARLEN: ConstBool):
    """Add the [1, 1, ROWS, COLS] ``tile`` into tile ``index`` of A[batch, head] atomically, as
    ``store_seq_rows`` stores it: a tiled view's reduce-add, which tileiras makes one TMA
    reduce (UTMAREDG) where A is 16-byte aligned, and per-element REDs otherwise."""
    if VARLEN:  # one slice a program, its tensor map written once for the whole K-loop
        A.slice(axis=2, start=start, stop=start + length).tiled_view(
            tile.shape).atomic_store_add((0, head, index, 0), tile)
    else:
        A.tiled_view(tile.shape).atomic_store_add((batch, head, index, 0), tile)


def load_mask_tile(Mask, batch, head, tile_q, tile_k, TILE_Q: ConstInt, TILE_K: ConstInt,
                   TRANSPOSED: ConstBool):
    """The [TILE_Q, TILE_K] tile (or its [TILE_K, TILE_Q] transpose) of Mask [B, H, Lq, Lk];
    never through TMA when Mask is bool-typed (see BOOL_MASK), its uint8 view may take it."""
    TMA = Mask.dtype != ct.bool_
    if TRANSPOSED:
        tile = ct.load(Mask, index=(batch, head, tile_k, tile_q), shape=(1, 1, TILE_K, TILE_Q),
                       order=(0, 1, 3, 2), padding_mode=ZERO, allow_tma=TMA)
        return tile.reshape((TILE_K, TILE_Q))
    tile = ct.load(Mask, index=(batch, head, tile_q, tile_k), shape=(1, 1, TILE_Q, TILE_K),
                   padding_mode=ZERO, allow_tma=TMA)
    return tile.reshape((TILE_Q, TILE_K))


def keep_tile(Mask, batch, head, tile_q, tile_k, TILE_Q: ConstInt, TILE_K: ConstInt,
              TRANSPOSED: ConstBool):
    """Which pairs of the tile a boolean Mask lets through, as a bool tile
    (``load_mask_tile``'s): its uint8 view compared with 0, because comparing a bool tile
    spills."""
    keep = load_mask_tile(Mask, batch, head, tile_q, tile_k, TILE_Q, TILE_K, TRANSPOSED)
    if Mask.dtype != ct.bool_:
        keep = keep != 0
    return keep


def log2_scores(s, rows, offs_k, Mask, tile_q, tile_k, band, TILE_Q: ConstInt,
                TILE_K: ConstInt, MASKED: ConstBool, FEATURES, TRANSPOSED: ConstBool,
                DEFER_SCALE: ConstBool):
    """The scores of one tile pair in log2 units from the raw products ``s`` = q . k (or their
    transpose): softcap, ALiBi, the attention mask and, when MASKED, the band (-inf outside).

    Returns (s, factor, dscore), the scores being s * factor. Under DEFER_SCALE plain scores
    (no softcap, ALiBi or additive mask) come back unscaled with factor = scale * log2(e): the
    forward applies it after its row max, one multiply a row (the scale is positive), and
    the backward in the same expression as the LSE; otherwise factor is 1. ``dscore`` is
    ds/dx, the derivative of a score with respect to its raw product q.k, which the backward
    needs: scale * (1 - tanh^2) under SOFTCAP, else the scale.
    """
    batch, head, offs_q, slope, _ = rows
    _, qk_scale, softcap, diag_offset, _, _ = band
    _, _, _, SOFTCAP, ALIBI, ATTN_MASK, _ = FEATURES
    factor = qk_scale * LOG2_E
    dscore = qk_scale
    if SOFTCAP:
        t = ct.tanh(s * (qk_scale / softcap))
        s = t * (softcap * LOG2_E)
        dscore = qk_scale * (1.0 - t * t)
        factor = 1.0
    elif not DEFER_SCALE:
        s = s * factor
        factor = 1.0
    # Under DEFER_SCALE the factor still owed (1.0 after a softcap) is folded into the add;
    # otherwise the scores are scaled already and the add is all there is.
    if ALIBI:
        bias = alibi_bias_log2(offs_q, offs_k, diag_offset, slope)
        if DEFER_SCALE:
            s = s * factor + bias
        else:
            s = s + bias
        factor = 1.0
    if ATTN_MASK == BOOL_MASK:
        s = ct.where(keep_tile(Mask, batch, head, tile_q, tile_k, TILE_Q, TILE_K, TRANSPOSED),
                     s, -math.inf)
    elif ATTN_MASK == ADDITIVE_MASK:
        add = load_mask_tile(Mask, batch, head, tile_q, tile_k, TILE_Q, TILE_K,
                             TRANSPOSED).astype(ct.float32) * LOG2_E
        if DEFER_SCALE:
            s = s * factor + add
        else:
            s = s + add
        factor = 1.0
    if MASKED:
        s = ct.where(visible(offs_q, offs_k, band, s.shape, FEATURES), s, -math.inf)
    return s, factor, dscore


def fp8_sum_mma(TILE_N: ConstInt, BANDED: ConstBool):
    """Whether the FP8 forward sums l_i on the tensor core, from the rounded P (SUM_MMA):
    on key steps of FP8_SUM_MIN_N keys or more with no band mask (a window or causal). One
    rule for the kernel, its float64 twin and their tests."""
    return TILE_N >= FP8_SUM_MIN_N and not BANDED


def exp2_fma(x):
    """2**x of an fp32 tile of finite x <= 126 without the MUFU: x clamped to -126 (2**-126
    stands for anything smaller, 0 once rounded to e4m3), rounded, a quadratic in the rest,
    and the integer part added to the exponent bits."""
    x = ct.maximum(x, -126.0, propagate_nan=True)
    t = x + EXP2_ROUND  # its bits: EXP2_ROUND's plus j, the rounded x
    f = x - (t - EXP2_ROUND)
    p = (EXP2_C2 * f + EXP2_C1) * f + EXP2_C0  # 2**f
    # bits(t) << 23 is j << 23: EXP2_ROUND's own bits shift out.
    bits = ct.bitcast(p, ct.int32) + ct.bitwise_lshift(ct.bitcast(t, ct.int32), 23)
    return ct.bitcast(bits, ct.float32)


def exp2_split(x, EXP2_FMA: ConstInt):
    """2**x of a [M, N] fp32 tile: the last N / EXP2_FMA columns (none when 0; else 2 or 4)
    from ``exp2_fma``, the rest from the MUFU, flushing denormals to 0 (tiles are split in
    halves: their widths stay powers of two)."""
    if EXP2_FMA == 0:
        return ct.exp2(x, flush_to_zero=True)
    rows, cols = x.shape
    half = cols // 2
    hi = ct.extract(x, (0, 1), shape=(rows, half))
    if EXP2_FMA == 2:
        hi = exp2_fma(hi)
    else:
        hi = ct.cat((ct.exp2(ct.extract(hi, (0, 0), shape=(rows, half // 2)),
                             flush_to_zero=True),
                     exp2_fma(ct.extract(hi, (0, 1), shape=(rows, half // 2)))), 1)
    lo = ct.exp2(ct.extract(x, (0, 0), shape=(rows, half)), flush_to_zero=True)
    return ct.cat((lo, hi), 1)


def sink_start(sink_log2, ROWS: ConstInt, SUM_N: ConstInt, P_LOG2_SCALE: ConstInt):
    """(m_i, l_i) of ROWS rows whose online softmax starts from a sink, a score every row sees
    with no value (``sink_log2``, in log2 units, a tile that broadcasts to [ROWS, 1]): m = the
    sink, l = exp2(0) = 1, or under ``softmax_step``'s P_LOG2_SCALE m that far below it and
    l = 2**P_LOG2_SCALE; l_i has SUM_N equal columns (the FP8 forward's tensor-core row sum).
    Once per row, outside the K-loop, instead of (-inf, 0)."""
    if P_LOG2_SCALE != 0:
        sink_log2 = sink_log2 - P_LOG2_SCALE
    m_i = ct.broadcast_to(sink_log2, (ROWS, 1))
    return m_i, ct.full((ROWS, SUM_N), 2.0**P_LOG2_SCALE, dtype=ct.float32)


def softmax_step(s, factor, m_i, l_i, GUARD: ConstBool, P_LOG2_SCALE: ConstInt,
                 ROW_SUM: ConstBool, EXP2_FMA: ConstInt = 0):
    """One step of the online softmax (FlashAttention-2) over a tile of log2 scores s * factor
    (``log2_scores``): (m_new, p, alpha, l_i), the new row max, the tile's exp2 weights, the
    rescale of what came before and the new row sum. The max is taken before the factor is
    applied (it is positive). Under GUARD a row may have seen nothing yet (m = -inf): 0 is
    subtracted there instead, so that exp2(-inf - -inf) does not make NaN; tiles without a
    band or attention mask always have a finite max. m is the row max less P_LOG2_SCALE
    (``FP8_P_LOG2_SCALE``; 0 for the others), so that the weights, and l_i, come out scaled
    by 2**P_LOG2_SCALE (the output's 1 / l_i cancels it, and the LSE m ln 2 + ln l_i is the
    same): the shift rides on the max's multiply, no instruction of its own. Without ROW_SUM
    l_i comes back rescaled only (l_i * alpha): the caller adds the tile's sum (FP8 does it on
    the tensor core, ``attention_fwd``). EXP2_FMA (0, 2 or 4; ``exp2_split``) takes the last
    1 / EXP2_FMA of the weights' columns from the FMA pipe; never under GUARD, where a -inf
    score would come out of its clamp as 2**-126 instead of 0."""
    m_tile = ct.max(s, axis=-1, keepdims=True) * factor  # [ROWS, 1]
    if P_LOG2_SCALE != 0:
        m_tile = m_tile - P_LOG2_SCALE
    m_new = max(m_i, m_tile)
    m_sub = m_new
    if GUARD:
        m_sub = ct.where(m_new == -math.inf, 0.0, m_new)
    p = exp2_split(s * factor - m_sub, 0 if GUARD else EXP2_FMA)
    alpha = ct.exp2(m_i - m_sub, flush_to_zero=True)
    l_i = l_i * alpha
    if ROW_SUM:
        l_i = l_i + ct.sum(p, axis=-1, keepdims=True)
    return m_new, p, alpha, l_i
