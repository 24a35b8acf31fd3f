"""The kernels' CPU twin: the same tiles, the same online softmax and backward, in float64.

Read it beside ``kernels/``: ``kv_tile_runs`` and ``q_tile_runs`` call the kernels' own
``tile_runs`` (plain integer code, so it runs on the host too) for which tiles to skip, take
unmasked or mask; ``attention_tiles`` is the forward's K-loop and ``attention_tiles_backward``
the dK/dV and dQ passes, written with torch on [B, H, TILE_M, TILE_N] blocks (every batch and
head at once); ``dropout_keep`` is the kernels' dropout hash. It is the oracle of the CPU
tests and is itself checked against ``torch.nn.functional.scaled_dot_product_attention`` and
float64 autograd. The KV-cache path's twin (decode splits, caches, rotary) is
``reference_decode``.
"""

import math

import torch

from flash_tile.kernels._tiles import (COL_MULT, EXP2_C0, EXP2_C1, EXP2_C2, FP8_P_LOG2_SCALE,
                                      MIX_MULT_1, MIX_MULT_2, ROW_MULT, dropout_threshold,
                                      fp8_sum_mma, tile_runs)

LOG2_E = 1.0 / math.log(2.0)
_M32 = 0xFFFFFFFF


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def varlen_programs(cu_seqlens: list[int], tile: int) -> list[tuple[int, int]]:
    """(sequence, tile index) of each program of the flattened VARLEN grid, total // tile + B
    programs for offsets that end at row ``total`` = cu_seqlens[-1] (``kernels._tiles.
    program_tile``'s binary search, step by step); an index past its sequence's tiles marks
    an idle program."""
    batch = len(cu_seqlens) - 1
    programs = []
    for w in range(cu_seqlens[-1] // tile + batch):
        lo, hi = 0, batch - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (cu_seqlens[mid] - cu_seqlens[0]) // tile + mid <= w:
                lo = mid
            else:
                hi = mid - 1
        programs.append((lo, w - ((cu_seqlens[lo] - cu_seqlens[0]) // tile + lo)))
    return programs


def kv_tile_runs(m_start: int, tile_m: int, tile_n: int, k_len: int, diag_offset: int = 0,
                 window: tuple[int, int] = (-1, -1)) -> tuple[int, int, int, int]:
    """Key-tile runs (n_start, n_inner, n_outer, n_end) of the query tile at ``m_start``, for
    the forward and the dQ pass. Row i sees key j iff i + diag_offset - left <= j <=
    i + diag_offset + right for window = (left, right), -1 leaving that side unbounded;
    causal is right = 0."""
    left, right = window
    return tile_runs(m_start, k_len, diag_offset - left, diag_offset + right, tile_m, tile_n,
                     left >= 0, right >= 0)


def q_tile_runs(n_start: int, tile_n: int, tile_m: int, q_len: int, diag_offset: int = 0,
                window: tuple[int, int] = (-1, -1)) -> tuple[int, int, int, int]:
    """Query-tile runs of the key tile at ``n_start``, for the dK/dV pass: key j is seen by
    query i iff j - diag_offset - right <= i <= j - diag_offset + left."""
    left, right = window
    return tile_runs(n_start, q_len, -diag_offset - right, left - diag_offset, tile_n, tile_m,
                     right >= 0, left >= 0)


def visible_keys(q_len: int, k_len: int, diag_offset: int = 0,
                 window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """[Lq, Lk] boolean: which keys each query row sees (the mask the tile runs implement)."""
    rows = torch.arange(q_len)[:, None] + diag_offset
    cols = torch.arange(k_len)[None, :]
    left, right = window
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    return visible


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32), in 16-bit halves so that nothing overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' ``mix32`` on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MULT_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MULT_2)
    return x ^ (x >> 16)


def dropout_keep(p: float, seed: int, batch: int, heads: int, q_len: int, k_len: int,
                 device: str | torch.device = "cpu", first_batch: int = 0) -> torch.Tensor:
    """The kernels' dropout keep bits, bool [B, H, Lq, Lk] on ``device``: score (b, h, i, j) is
    kept iff its hash (``kernels/_tiles.py``) clears the threshold of ``p``. A pure function of
    the indices: every tiling, forward or backward, sees the same bits. ``first_batch`` shifts
    the batch index (b + first_batch is hashed): a packed sequence of a varlen batch hashes
    its own index with its own rows and columns."""
    def ar(n, shape):
        return torch.arange(n, device=device, dtype=torch.int64).view(shape)

    bh = ar(batch * heads, (batch, heads, 1, 1)) + first_batch * heads
    rows = _mix32(_mix32((ar(q_len, (1, 1, q_len, 1)) + _mul32(bh, ROW_MULT)) & _M32) ^ seed)
    hashed = _mul32(rows ^ _mul32(ar(k_len, (1, 1, 1, k_len)), COL_MULT), MIX_MULT_1)
    hashed = _mul32(hashed ^ (hashed >> 16), MIX_MULT_2)
    return hashed >= dropout_threshold(p)


def _scores_log2(q_tile, k_tile, scale, softcap, slopes, mask, offs_m, offs_n, diag_offset):
    """The kernels' S' for one tile pair: scores in log2 units, scale, softcap, ALiBi and the
    attention mask applied; and ds/dx, the derivative of the final scores with respect to the
    raw products q.k (the backward needs it). ``slopes`` is [B, H, 1, 1] or None, ``mask`` the
    tile's [B, H, rows, cols] slice of a bool or additive mask, or None."""
    s = q_tile @ k_tile.transpose(-1, -2)  # [B, H, rows, cols] raw scores
    if softcap > 0.0:
        t = torch.tanh(s * scale / softcap)
        s, dscore = softcap * t, scale * (1.0 - t * t)
    else:
        s, dscore = s * scale, scale
    if slopes is not None:
        s = s - slopes * (offs_m + diag_offset - offs_n).abs()
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    return s * LOG2_E, dscore


def round_e4m3(p: torch.Tensor) -> torch.Tensor:
    """p rounded as the FP8 forward rounds P for P V: to fp32, then to float8_e4m3fn (round
    to nearest even, saturating), returned in float64."""
    return p.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)


#: The largest relative error of ``exp2_fma`` (its quadratic's, fitted to 1.73e-3).
EXP2_FMA_ERROR = 1.75e-3


def exp2_fma(x: torch.Tensor) -> torch.Tensor:
    """2**x as the kernels' FMA-pipe exp2 (``_tiles.exp2_fma``) forms it, in float64: x
    clamped to -126 and rounded to the nearest integer j, 2**j times the quadratic in x - j."""
    x = x.clamp(min=-126.0)
    j = torch.round(x)
    f = x - j
    return torch.ldexp((EXP2_C2 * f + EXP2_C1) * f + EXP2_C0, j)


def exp2_split(x: torch.Tensor, share: int) -> torch.Tensor:
    """2**x of a [..., N] tile as ``_tiles.exp2_split``: the last N / share columns (none when
    share is 0) from ``exp2_fma``, the rest exact."""
    p = torch.exp2(x)
    if share:
        first = x.shape[-1] - x.shape[-1] // share
        p[..., first:] = exp2_fma(x[..., first:])
    return p


def _prepare(q, k, v, scale, alibi_slopes, attn_mask):
    """float64 CPU copies with K/V expanded to every query head (GQA), the default scale, and
    slopes and mask broadcast to [B, H, ...]."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.detach().to("cpu", torch.float64).expand(batch, heads)
        slopes = slopes[..., None, None]
    if attn_mask is not None:
        attn_mask = attn_mask.detach().cpu().expand(batch, heads, q_len, k.shape[2])
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(torch.float64)
    return q, k, v, scale, slopes, attn_mask, group


def _tile_scores(q, k, scale, softcap, slopes, attn_mask, m_start, n_start, diag_offset, window,
                 masked):
    """(S' [B, H, rows, cols], ds/dx) of the query tile at m_start and key tile at n_start;
    ``masked`` applies the window/causal band (the kernels' masked runs)."""
    rows, cols = q.shape[2], k.shape[2]
    offs_m = torch.arange(m_start, m_start + rows)[:, None]
    offs_n = torch.arange(n_start, n_start + cols)[None, :]
    mask = None if attn_mask is None else attn_mask[
        :, :, m_start:m_start + rows, n_start:n_start + cols]
    s, dscore = _scores_log2(q, k, scale, softcap, slopes, mask, offs_m, offs_n, diag_offset)
    # The kernels load a zero-padded tile at the ragged ends and mask the padding; here those
    # tiles are simply shorter, so only the band needs a mask.
    if masked:
        hidden = ~visible_keys(rows, cols, m_start + diag_offset - n_start, window)
        s = s.masked_fill(hidden, -math.inf)
    return s, dscore


def attention_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    diag_offset: int = 0, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    attn_mask: torch.Tensor | None = None, tile_m: int = 64,
                    tile_n: int = 64, dropout_p: float = 0.0, dropout_seed: int = 0,
                    dropout_batch: int = 0, sinks: torch.Tensor | None = None,
                    fp8_descale: torch.Tensor | None = None, exp2_fma: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward walking the kernel's tiles, in float64 on the CPU.

    q [B, H, Lq, D], k [B, H_kv, Lk, D], v [B, H_kv, Lk, Dv] with H a multiple of H_kv (any
    dtype and device; computed as float64 on the CPU). Masks as ``kv_tile_runs``: flash-attn's
    causal is window (-1, 0) with diag_offset = Lk - Lq, torch's is_causal the same window with
    diag_offset = 0. ``softcap`` > 0 caps the scaled scores with tanh; ``alibi_slopes`` [B, H]
    subtracts slope * |i + diag_offset - j|; ``attn_mask``, broadcastable to [B, H, Lq, Lk],
    hides keys where False (bool) or is added to the scores (float). ``dropout_p`` > 0 drops
    probabilities after the softmax with ``dropout_keep``'s bits for ``dropout_seed`` (batch
    indices shifted by ``dropout_batch``). ``sinks`` [H] starts each row's running max and sum
    from head h's sink (m = sink * log2(e), l = 1; with ``fp8_descale`` m = sink * log2(e) -
    FP8_P_LOG2_SCALE, l = 2**FP8_P_LOG2_SCALE), as the kernel's SINKS switch does.
    ``fp8_descale`` [3, B, H_kv] (the kernel's FP8 switch: q, k, v are the e4m3 values,
    these their descale factors) dequantizes q and k, scales each tile's P by
    2**FP8_P_LOG2_SCALE and rounds it to e4m3 for P V as the kernel does (from its fp32
    value; l sums the unrounded, scaled P, but the rounded P where the kernel's SUM_MMA does,
    ``_tiles.fp8_sum_mma``) and multiplies the output by v's factor; ``exp2_fma`` (the
    config's, read with ``fp8_descale`` alone) takes the exp2 of the last 1 / exp2_fma of each
    unmasked step's columns from the kernel's FMA-pipe quadratic (``exp2_split``).

    Returns (out [B, H, Lq, Dv], lse [B, H, Lq]) in float64; lse is the natural-log
    log-sum-exp of the final scores, +inf (and out 0) for rows that see no key.
    """
    q, k, v, scale, slopes, attn_mask, group = _prepare(q, k, v, scale, alibi_slopes,
                                                        attn_mask)
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    # p_scale: log2 of the kernel's scale of P (FP8's 8: its running max runs that far below
    # the max, so that P = exp2(s - m) lies in [0, 2**p_scale]).
    v_descale, p_scale = 1.0, 0
    if fp8_descale is not None:  # [3, B, H, 1, 1]: each query head takes its group's
        p_scale = FP8_P_LOG2_SCALE
        descale = fp8_descale.to("cpu", torch.float64).repeat_interleave(group, dim=2)
        q, k, v_descale = q * descale[0, ..., None, None], k * descale[1, ..., None, None], \
            descale[2, ..., None, None]
    rounded_l = fp8_descale is not None and fp8_sum_mma(tile_n, max(window) >= 0)
    out = torch.empty(batch, heads, q_len, v.shape[3], dtype=torch.float64)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float64)
    keep = dropout_keep(dropout_p, dropout_seed, batch, heads, q_len, k_len,
                        first_batch=dropout_batch) if dropout_p > 0.0 else None

    for m_start in range(0, q_len, tile_m):
        q_tile = q[:, :, m_start:m_start + tile_m]  # [B, H, rows, D], rows <= TILE_M
        rows = q_tile.shape[2]
        m_i = torch.full((batch, heads, rows, 1), -math.inf, dtype=torch.float64)
        l_i = torch.zeros(batch, heads, rows, 1, dtype=torch.float64)
        if sinks is not None:
            sink = sinks.detach().to("cpu", torch.float64).view(1, heads, 1, 1) * LOG2_E
            m_i, l_i = torch.zeros_like(m_i) + sink - p_scale, l_i + 2.0**p_scale
        acc = torch.zeros(batch, heads, rows, v.shape[3], dtype=torch.float64)
        n_start, n_inner, n_outer, n_end = kv_tile_runs(m_start, tile_m, tile_n, k_len,
                                                        diag_offset, window)
        for j in range(n_start, n_end):
            k_tile = k[:, :, j * tile_n:(j + 1) * tile_n]  # [B, H, cols, D], cols <= TILE_N
            v_tile = v[:, :, j * tile_n:(j + 1) * tile_n]
            s, _ = _tile_scores(q_tile, k_tile, scale, softcap, slopes, attn_mask, m_start,
                                j * tile_n, diag_offset, window, not n_inner <= j < n_outer)
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True) - p_scale)
            m_sub = torch.where(m_new == -math.inf, 0.0, m_new)
            # under exp2_fma FP8's unmasked steps take part of their exp2 from the FMA pipe
            unmasked = n_inner <= j < n_outer and attn_mask is None
            p = exp2_split(s - m_sub, exp2_fma if fp8_descale is not None and unmasked
                           else 0)  # [B, H, rows, cols]
            alpha = torch.exp2(m_i - m_sub)  # [B, H, rows, 1]
            if rounded_l:
                p = round_e4m3(p)
            l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
            if keep is not None:
                p = p * keep[:, :, m_start:m_start + rows, j * tile_n:(j + 1) * tile_n]
            if fp8_descale is not None:
                p = round_e4m3(p)
            acc = acc * alpha + p @ v_tile
            m_i = m_new
        empty = l_i == 0.0
        out[:, :, m_start:m_start + rows] = (acc / torch.where(empty, 1.0, l_i) / (1 - dropout_p)
                                             * v_descale)
        lse_tile = torch.where(empty, math.inf, m_i * math.log(2.0) + torch.log(l_i))
        lse[:, :, m_start:m_start + rows] = lse_tile[..., 0]
    return out, lse


def attention_tiles_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                             scale: float | None = None, diag_offset: int = 0,
                             window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None,
                             attn_mask: torch.Tensor | None = None, tile_m: int = 64,
                             tile_n: int = 64, dlse: torch.Tensor | None = None,
                             dropout_p: float = 0.0, dropout_seed: int = 0,
                             dropout_batch: int = 0, dq_tile_m: int | None = None,
                             dq_tile_n: int | None = None,
                             sinks: torch.Tensor | None = None,
                             one_pass: bool = False) -> tuple[torch.Tensor, ...]:
    """The backward kernels' twin: (dq, dk, dv) in float64, recomputing P tile by tile from
    ``lse`` (the forward's, natural log) as ``kernels/attention_bwd.py`` does.

    Arguments as ``attention_tiles`` plus the forward's ``out`` [B, H, Lq, Dv] and ``lse``
    [B, H, Lq], the output gradient ``dout`` [B, H, Lq, Dv] and optionally the LSE's
    gradient ``dlse`` [B, H, Lq], which only shifts Delta, and the forward's dropout (dV sums
    the dropped, rescaled P; dP = dO V^T is masked by the same keep bits and rescaled; dS
    multiplies it by the undropped P). dK/dV are computed per key tile
    over the query tiles the band lets through (``q_tile_runs``) and summed over each GQA
    group, on ``tile_m`` x ``tile_n`` (a key tile of tile_n rows, query steps of tile_m); dQ
    per query tile over ``kv_tile_runs``, on ``dq_tile_m`` x ``dq_tile_n`` when given (as
    ``TileConfig``'s, None taking tile_m / tile_n); under ``one_pass`` (the one-pass form,
    ``TileConfig.one_pass``) dQ is instead summed inside the dK/dV walk, each pair's
    dS K added to its query rows as the kernel's reduce-adds do. With ``sinks`` [H] (the
    forward's, its LSE including them) also returns dsinks [H] = -sum over batch and rows of
    exp(sink - lse) * Delta, as the dQ kernel's shares sum.
    """
    q, k, v, scale, slopes, attn_mask, group = _prepare(q, k, v, scale, alibi_slopes, attn_mask)
    out, lse, dout = (t.detach().to("cpu", torch.float64) for t in (out, lse, dout))
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    delta = (dout * out).sum(dim=-1)  # [B, H, Lq], as the dQ kernel forms it
    if dlse is not None:
        delta = delta - dlse.detach().to("cpu", torch.float64)
    lse_log2 = lse * LOG2_E
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # The keep bits scaled by 1 / (1 - p), or None without dropout.
    zr = None
    if dropout_p > 0.0:
        keep = dropout_keep(dropout_p, dropout_seed, batch, heads, q_len, k_len,
                            first_batch=dropout_batch)
        zr = keep.to(torch.float64) / (1 - dropout_p)

    def dropped(x, rows, cols):
        """x [B, H, rows, cols] as dropout leaves it (x itself without dropout)."""
        return x if zr is None else x * zr[:, :, rows, cols]

    def probs(rows, cols, masked):
        """P [B, H, rows, cols] and ds/dx for one tile pair, from the saved LSE."""
        s, dscore = _tile_scores(q[:, :, rows], k[:, :, cols], scale, softcap, slopes,
                                 attn_mask, rows.start, cols.start, diag_offset, window, masked)
        return torch.exp2(s - lse_log2[:, :, rows, None]), dscore

    def dx(p, dscore, rows, cols):
        """dS * ds/dx, the gradient of the raw products q.k of one tile pair, under softcap;
        else dS, ds/dx being the scale, which dQ and dK take once at the end, as the
        kernels do."""
        dp = dropped(dout[:, :, rows] @ v[:, :, cols].transpose(-1, -2), rows, cols)
        ds = p * (dp - delta[:, :, rows, None])
        return ds * dscore if softcap > 0.0 else ds

    for n_start in range(0, k_len, tile_n):  # dK/dV: one key tile, its query tiles
        i_start, i_inner, i_outer, i_end = q_tile_runs(n_start, tile_n, tile_m, q_len,
                                                       diag_offset, window)
        keys = slice(n_start, n_start + tile_n)
        for i in range(i_start, i_end):
            rows = slice(i * tile_m, (i + 1) * tile_m)
            p, dscore = probs(rows, keys, not i_inner <= i < i_outer)
            dv[:, :, keys] += dropped(p, rows, keys).transpose(-1, -2) @ dout[:, :, rows]
            ds = dx(p, dscore, rows, keys)
            dk[:, :, keys] += ds.transpose(-1, -2) @ q[:, :, rows]
            if one_pass:  # the reduce-add of this pair's share of dQ
                dq[:, :, rows] += ds @ k[:, :, keys]
    dq_m, dq_n = dq_tile_m or tile_m, dq_tile_n or tile_n
    for m_start in range(0, 0 if one_pass else q_len, dq_m):  # dQ: a query tile, its keys
        n_first, n_inner, n_outer, n_end = kv_tile_runs(m_start, dq_m, dq_n, k_len,
                                                        diag_offset, window)
        rows = slice(m_start, m_start + dq_m)
        for j in range(n_first, n_end):
            cols = slice(j * dq_n, (j + 1) * dq_n)
            p, dscore = probs(rows, cols, not n_inner <= j < n_outer)
            dq[:, :, rows] += dx(p, dscore, rows, cols) @ k[:, :, cols]
    if softcap == 0.0:
        dq, dk = dq * scale, dk * scale
    # Each key/value head's gradient is the sum over the query heads of its group.
    kv_shape = (batch, heads // group, group, k_len)
    grads = (dq, dk.view(*kv_shape, dk.shape[-1]).sum(2),
             dv.view(*kv_shape, dv.shape[-1]).sum(2))
    if sinks is None:
        return grads
    sink = sinks.detach().to("cpu", torch.float64).view(1, heads, 1)
    return (*grads, -(torch.exp(sink - lse) * delta).sum((0, 2)))


def varlen_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, scale: float | None = None,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, tile_m: int = 64,
                 tile_n: int = 64, dropout_p: float = 0.0, dropout_seed: int = 0,
                 sinks: torch.Tensor | None = None,
                 seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's VARLEN switch in float64: each packed sequence through
    ``attention_tiles`` on its own rows, its band aligned bottom-right (diag_offset =
    k_len - q_len, flash-attn's varlen rule), its dropout bits those of batch index b with
    the sequence's own rows and columns. q [total_q, H, D], k [total_k, H_kv, D], v
    [total_k, H_kv, Dv], cu_seqlens [B + 1]; alibi_slopes [B, H] or None; ``sinks`` [H] as
    ``attention_tiles``', ``seqused_k`` as ``varlen_sequences``'. Returns (out [total_q, H,
    Dv], lse [H, total_q]) in float64, as
    flash_attn_varlen_func lays them out; zero rows for queries that see no key, with an LSE
    of +inf (or of the sink)."""
    heads = q.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, q.shape[0]), math.inf, dtype=torch.float64)
    for b, rows, seq, diag_offset in varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      seqused_k):
        if seq[1].shape[2] == 0:  # rows that see no key: zeros, +inf or the sink
            if sinks is not None:
                lse[:, rows] = sinks.detach().to("cpu", torch.float64)[:, None]
            continue
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1]
        o, l_ = attention_tiles(*seq, scale, diag_offset, window, softcap, slopes,
                                tile_m=tile_m, tile_n=tile_n, dropout_p=dropout_p,
                                dropout_seed=dropout_seed, dropout_batch=b, sinks=sinks)
        out[rows] = o[0].transpose(0, 1)
        lse[:, rows] = l_[0]
    return out, lse


def varlen_tiles_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          scale: float | None = None, window: tuple[int, int] = (-1, -1),
                          softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                          tile_m: int = 64, tile_n: int = 64, dropout_p: float = 0.0,
                          dropout_seed: int = 0, sinks: torch.Tensor | None = None,
                          seqused_k: torch.Tensor | None = None,
                          dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The backward's VARLEN switch in float64: each packed sequence through
    ``attention_tiles_backward`` on its own rows (bottom-right band, its own dropout bits:
    the hash sees the sequence's index as the batch and its own rows and columns). Packed
    layouts as ``varlen_tiles`` (out, dout [total_q, H, Dv], lse and dlse, the LSE's
    gradient or None, [H, total_q]); returns
    (dq, dk, dv) in float64, zero for keys no query sees (and past ``seqused_k``), and with
    ``sinks`` dsinks [H]
    summed over the sequences (rows without keys add nothing: their output is 0)."""
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    dsinks = torch.zeros(q.shape[1], dtype=torch.float64)
    cu_k = cu_seqlens_k.tolist()
    for b, rows, seq, diag_offset in varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      seqused_k):
        if seq[1].shape[2] == 0:
            continue  # no key: nothing flows anywhere
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1]
        out_b, dout_b = (t[rows][None].transpose(1, 2) for t in (out, dout))
        grads = attention_tiles_backward(
            *seq, out_b, lse[None, :, rows], dout_b, scale, diag_offset, window, softcap, slopes,
            tile_m=tile_m, tile_n=tile_n, dlse=None if dlse is None else dlse[None, :, rows],
            dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_batch=b, sinks=sinks)
        keys = slice(cu_k[b], cu_k[b] + seq[1].shape[2])
        for grad, packed, where in zip(grads, (dq, dk, dv), (rows, keys, keys)):
            packed[where] = grad[0].transpose(0, 1)
        if sinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def varlen_sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     seqused_k: torch.Tensor | None = None):
    """(b, rows, (q_b, k_b, v_b), diag_offset) for each packed sequence b with a query row:
    ``rows`` the slice of its rows in q (and in the output), the three as [1, H, L, D] views
    (k_b and v_b empty where it has no key; with ``seqused_k`` [B] its first seqused_k[b]
    keys), diag_offset = k_len - q_len (bottom-right)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[b])
        if q1 > q0:
            seq = tuple(t[None].transpose(1, 2) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            yield b, slice(q0, q1), seq, (k1 - k0) - (q1 - q0)


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    diag_offset: int = 0, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    attn_mask: torch.Tensor | None = None, return_lse: bool = False,
                    dropout_p: float = 0.0, dropout_seed: int = 0, dropout_batch: int = 0,
                    sinks: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax(S) V in q's dtype and device (the fp32 GPU reference), S as in
    ``attention_tiles`` with the same layout and conventions; rows that see no key return 0.
    With ``return_lse`` also the natural-log LSE [B, H, Lq] (+inf where no key is seen), which
    autograd differentiates like the kernels' LSE. Dropout as ``attention_tiles``; ``sinks``
    [H] joins each row's softmax as one more column with no value (differentiable)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2)  # [B, H, Lq, Lk]
    s = softcap * torch.tanh(s * scale / softcap) if softcap > 0.0 else s * scale
    q_len, k_len = q.shape[-2], k.shape[-2]
    if alibi_slopes is not None:
        rows = torch.arange(q_len, device=q.device)[:, None] + diag_offset
        cols = torch.arange(k_len, device=q.device)[None, :]
        slopes = alibi_slopes.to(s.dtype).expand(q.shape[0], q.shape[1])[..., None, None]
        s = s - slopes * (rows - cols).abs()
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(s.dtype)
    visible = visible_keys(q_len, k_len, diag_offset, window).to(q.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:  # the sink's column: in the softmax, not in the output
        sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        scores = torch.cat([s, sink], dim=-1)
        p = torch.softmax(scores, dim=-1)[..., :-1]
        lse = torch.logsumexp(scores, dim=-1)
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: NaN -> 0
    if dropout_p > 0.0:
        keep = dropout_keep(dropout_p, dropout_seed, q.shape[0], q.shape[1], q_len, k_len,
                            q.device, dropout_batch)
        p = p * keep / (1 - dropout_p)
    out = p.to(v.dtype) @ v
    if not return_lse:
        return out
    if sinks is not None:
        return out, lse
    empty = ~visible.any(dim=-1)  # [B or 1, H or 1, Lq]
    # Zero the empty rows' scores first so that their (unused) LSE has a zero gradient.
    lse = torch.logsumexp(s.masked_fill(empty[..., None], 0.0), dim=-1)
    return out, torch.where(empty, math.inf, lse)


def check_error(out: torch.Tensor, out_ref: torch.Tensor, out_pt: torch.Tensor,
                factor: float = 2.0, atol: float = 1e-5) -> dict:
    """flash-attn's tolerance rule, applied to a low-precision result.

    ``out`` passes when its max error against the fp32 reference ``out_ref`` is at most
    ``factor`` times the max error of PyTorch's own low-precision result ``out_pt`` against
    the same reference, plus twice the rounding of ``out``'s dtype at the reference's
    magnitude (flash-attn uses 2 for outputs, 3 for gradients), plus ``atol``: where the
    reference is exactly 0 (dQ with a single key) both terms are 0 and fp32 summation order
    alone leaves ~1e-7. Infinities (an LSE's empty rows) must match exactly. PyTorch's own
    result must be finite elsewhere (an overflow there would make any error pass): else the
    check fails, saying so. Returns the numbers and "ok".
    """
    dtype, ref = out.dtype, out_ref.float()
    inf = ref.isinf()
    if not torch.equal(inf, out.float().isinf()) or not torch.equal(out.float()[inf], ref[inf]):
        return {"ok": False, "max_err": math.inf, "max_err_torch": math.nan, "floor": 0.0}
    ref, out, out_pt = (t.float().masked_fill(inf, 0.0) for t in (ref, out, out_pt))
    floor = ((ref + 0.3 - 0.3).to(dtype).float() - ref).abs().max().item()
    err = (out - ref).abs().max().item()
    err_pt = (out_pt - ref).abs().max().item()
    if not math.isfinite(err_pt):
        return {"ok": False, "max_err": err, "max_err_torch": err_pt, "floor": floor,
                "why": "PyTorch's low-precision result is not finite: no bound to hold to"}
    ok = err <= factor * err_pt + 2 * floor + atol and not out.isnan().any().item()
    return {"ok": ok, "max_err": err, "max_err_torch": err_pt, "floor": floor}


def outlier_inputs(batch: int, length: int, heads: int, head_dim: int, seed: int = 0,
                   device: str = "cpu") -> torch.Tensor:
    """FA3's accuracy inputs (its Table 3): N(0, 1) with 0.1% of the entries N(0, 10),
    [B, L, H, D] bf16, from a generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, length, heads, head_dim)
    x = torch.randn(shape, generator=g, device=device)
    outliers = torch.rand(shape, generator=g, device=device) < 1e-3
    return torch.where(outliers, 10 * torch.randn(shape, generator=g, device=device),
                       x).bfloat16()


def peaked_inputs(batch: int, q_len: int, k_len: int, heads: int, head_dim: int,
                  margin: float = 10.0, seed: int = 0, device: str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), [B, L, H, D] bf16, where key 0 scores about ``margin`` (natural log, at the
    default scale) above the other keys in every query row, as a first token that draws most
    of the attention does: every other key's weight is then about exp(-margin) of the row's
    max, the weights that FP8's rounding of P must not lose."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, 1, heads, head_dim)
    u = torch.randn(shape, generator=g, device=device)
    q = u + 0.3 * torch.randn(batch, q_len, heads, head_dim, generator=g, device=device)
    k = torch.randn(batch, k_len, heads, head_dim, generator=g, device=device)
    # q . k_0 / sqrt(D) = c |u|^2 / sqrt(D) ~ margin for |u|^2 ~ D.
    k[:, :1] = u * (margin / math.sqrt(head_dim))
    # Values with a common part (mean 1), as real values have: weights lost from the many
    # small keys then show in the output instead of averaging out.
    v = 1.0 + torch.randn(batch, k_len, heads, head_dim, generator=g, device=device)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()
