"""Flash-attention forward in cuTile.

Maths. For one (batch, head) and a query row i, with scores s_ij = scale * q_i . k_j,

    o_i   = sum_j softmax_j(s_ij) v_j
    lse_i = log sum_j exp(s_ij)            (natural log, fp32)

computed without materialising S: one program owns TILE_M query rows and walks the key/value
tiles of TILE_N rows. Per key tile it forms S = Q K^T on tensor cores (fp32 accumulate) and
updates the online softmax of FlashAttention (Dao et al. 2022, Alg. 1; FA2's deferred division):

    m_new = max(m_i, rowmax(S) * c)                        c = scale * log2(e)
    p     = exp2(S * c - m_new)                            [TILE_M, TILE_N]
    alpha = exp2(m_i - m_new)                              [TILE_M, 1]
    l_i   = l_i * alpha + rowsum(p)
    acc   = acc * alpha + p V                              [TILE_M, TILE_D]

and divides by l_i once at the end. m_i lives in the log2 domain (the scale is folded into the
exp2 argument, one FMA per score); the stored LSE is converted back to natural log.

Layout. Q [B, H, Lq, D], K [B, H, Lk, D], V [B, H, Lk, D], Out [B, H, Lq, D], Lse [B, H, Lq]
(fp32). Any strides: the torch side passes flash-attn's [B, L, H, D] tensors as transposed views.
K is loaded as a [TILE_D, TILE_N] tile through a permuted load, so no transpose of K is stored.

Causal masking. Query row i sees key j iff j <= i + causal_offset. flash-attn aligns the mask
bottom-right (causal_offset = Lk - Lq); torch SDPA aligns it top-left (causal_offset = 0).
A row that sees no key at all (bottom-right with Lq > Lk) gets zeros in Out and +inf in Lse,
as flash-attn does, so that exp(s - lse) is 0 for it in a backward pass.

Key tiles are split into three runs per query tile:
  [0, n_full)        every score visible: no mask is built or applied;
  [n_full, n_end)    the diagonal band and/or the ragged last tile: masked;
  [n_end, ...)       wholly above the diagonal: never loaded.
"""

import math

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

LOG2_E = 1.4426950408889634
LN_2 = math.log(2.0)

# Zero padding past the ends of Q/K/V: a padded V row must be 0, not NaN, because it meets a
# p of 0 in P V (0 * NaN = NaN); padded K columns are masked, padded Q rows never stored.
ZERO = ct.PaddingMode.ZERO


def _attend_kv_tile(q, K, V, batch, head, j, m_i, l_i, acc, offs_m, k_len, causal_offset,
                    qk_scale_log2,
                    TILE_N: ConstInt, TILE_D: ConstInt,
                    MASKED: ConstBool, CAUSAL: ConstBool, EVEN_N: ConstBool):
    """One step of the online softmax over key tile j; returns the new (m_i, l_i, acc)."""
    # K^T tile straight from K's [.., Lk, D] layout through the permuted load order.
    k_t = ct.load(K, index=(batch, head, 0, j), shape=(1, 1, TILE_D, TILE_N),
                  order=(0, 1, 3, 2), padding_mode=ZERO, latency=2)
    k_t = k_t.reshape((TILE_D, TILE_N))
    s = ct.zeros((q.shape[0], TILE_N), dtype=ct.float32)
    s = ct.mma(q, k_t, s)  # [TILE_M, TILE_N] raw scores q . k, fp32

    if MASKED:
        offs_n = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]  # [1, TILE_N]
        visible = ct.full((q.shape[0], TILE_N), True, dtype=ct.bool_)
        if not EVEN_N:
            visible = visible & (offs_n < k_len)
        if CAUSAL:
            visible = visible & (offs_n <= offs_m + causal_offset)
        s = ct.where(visible, s, -math.inf)

    # The max is taken on raw scores and scaled once per row: the scale is positive.
    m_new = max(m_i, ct.max(s, axis=-1, keepdims=True) * qk_scale_log2)  # [TILE_M, 1]
    m_sub = m_new
    if MASKED:
        # A row with nothing visible yet keeps m = -inf; subtract 0 there instead so that
        # exp2(-inf - -inf) does not make NaN. Interior tiles always have a finite max.
        m_sub = ct.where(m_new == -math.inf, 0.0, m_new)
    p = ct.exp2(s * qk_scale_log2 - m_sub, flush_to_zero=True)  # [TILE_M, TILE_N]
    alpha = ct.exp2(m_i - m_sub, flush_to_zero=True)  # [TILE_M, 1]
    l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)

    v = ct.load(V, index=(batch, head, j, 0), shape=(1, 1, TILE_N, TILE_D),
                padding_mode=ZERO, latency=4)
    v = v.reshape((TILE_N, TILE_D))
    acc = ct.mma(p.astype(v.dtype), v, acc * alpha)  # [TILE_M, TILE_D]
    return m_new, l_i, acc


def _attention_fwd_impl(Q, K, V, Out, Lse, qk_scale, causal_offset,
                        TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt,
                        CAUSAL: ConstBool, EVEN_N: ConstBool, STORE_LSE: ConstBool):
    """The forward for query tile bid(0) of head bid(1) of batch bid(2)."""
    tile_m = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    k_len = K.shape[2]
    m_start = tile_m * TILE_M
    qk_scale_log2 = qk_scale * LOG2_E

    # Loaded once, reused by every key tile.
    q = ct.load(Q, index=(batch, head, tile_m, 0), shape=(1, 1, TILE_M, TILE_D),
                padding_mode=ZERO).reshape((TILE_M, TILE_D))
    offs_m = m_start + ct.arange(TILE_M, dtype=ct.int32)[:, None]  # [TILE_M, 1]

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((TILE_M, 1), dtype=ct.float32)
    acc = ct.zeros((TILE_M, TILE_D), dtype=ct.float32)

    if CAUSAL:
        # The last row of the tile sees keys < m_start + TILE_M + causal_offset; the first row
        # sees every key < m_start + causal_offset + 1. Clamp before dividing: both can be < 0.
        n_end = ct.cdiv(min(max(m_start + TILE_M + causal_offset, 0), k_len), TILE_N)
        n_full = min(max(m_start + causal_offset + 1, 0), k_len) // TILE_N
    else:
        n_end = ct.cdiv(k_len, TILE_N)
        n_full = k_len // TILE_N  # == n_end when EVEN_N

    for j in range(0, n_full):
        m_i, l_i, acc = _attend_kv_tile(q, K, V, batch, head, j, m_i, l_i, acc, offs_m, k_len,
                                        causal_offset, qk_scale_log2, TILE_N, TILE_D,
                                        False, CAUSAL, EVEN_N)
    for j in range(n_full, n_end):
        m_i, l_i, acc = _attend_kv_tile(q, K, V, batch, head, j, m_i, l_i, acc, offs_m, k_len,
                                        causal_offset, qk_scale_log2, TILE_N, TILE_D,
                                        True, CAUSAL, EVEN_N)

    # Rows that saw no key have l_i = 0 and acc = 0: divide by 1 to return zeros.
    empty = l_i == 0.0
    inv_l = 1.0 / ct.where(empty, 1.0, l_i)  # [TILE_M, 1]
    out = (acc * inv_l).astype(Out.dtype).reshape((1, 1, TILE_M, TILE_D))
    ct.store(Out, index=(batch, head, tile_m, 0), tile=out)
    if STORE_LSE:
        lse = ct.where(empty, math.inf, m_i * LN_2 + ct.log(l_i))  # [TILE_M, 1]
        ct.store(Lse, index=(batch, head, tile_m), tile=lse.reshape((1, 1, TILE_M)))


@ct.kernel
def attention_fwd(Q, K, V, Out, Lse, qk_scale: float, causal_offset: int,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt,
                  CAUSAL: ConstBool, EVEN_N: ConstBool, STORE_LSE: ConstBool):
    """Grid (cdiv(Lq, TILE_M), H, B). ``Lse`` is only written when STORE_LSE."""
    _attention_fwd_impl(Q, K, V, Out, Lse, qk_scale, causal_offset,
                        TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, STORE_LSE)
