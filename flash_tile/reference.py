"""The forward kernel's CPU twin: the same tiles, the same online softmax, in float64.

Read it beside ``kernels/attention_fwd.py``: ``kv_tile_ranges`` is the kernel's choice of which
key tiles to skip, which to take unmasked and which to mask; ``attention_tiles`` is its K-loop,
written with torch on [B, H, TILE_M, TILE_N] blocks (every batch and head at once). It is the
oracle of the CPU tests and is itself checked against ``torch.nn.functional.
scaled_dot_product_attention``.
"""

import math

import torch

LOG2_E = 1.0 / math.log(2.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_tile_ranges(m_start: int, tile_m: int, tile_n: int, k_len: int, causal: bool,
                   causal_offset: int) -> tuple[int, int]:
    """(n_full, n_end) for the query tile starting at row ``m_start``.

    Key tiles [0, n_full) are wholly visible to every row of the query tile (no mask),
    [n_full, n_end) need a mask (diagonal band or ragged end), and tiles from n_end on are
    wholly invisible and skipped. Row i sees key j iff j <= i + causal_offset when causal.
    """
    if causal:
        n_end = cdiv(min(max(m_start + tile_m + causal_offset, 0), k_len), tile_n)
        n_full = min(max(m_start + causal_offset + 1, 0), k_len) // tile_n
    else:
        n_end = cdiv(k_len, tile_n)
        n_full = k_len // tile_n
    return n_full, n_end


def attention_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = False, causal_offset: int = 0, tile_m: int = 64,
                    tile_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward walking the kernel's tiles, in float64 on the CPU.

    q [B, H, Lq, D], k and v [B, H, Lk, D] (any dtype and device; computed as float64 on the
    CPU). Row i sees key j iff j <= i + causal_offset when ``causal`` (flash-attn's
    bottom-right alignment is causal_offset = Lk - Lq, torch's top-left is 0).

    Returns (out [B, H, Lq, D], lse [B, H, Lq]) in float64; lse is the natural-log
    log-sum-exp of the scaled scores, +inf (and out 0) for rows that see no key.
    """
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qk_scale_log2 = scale * LOG2_E
    out = torch.empty(batch, heads, q_len, v.shape[3], dtype=torch.float64)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float64)

    for m_start in range(0, q_len, tile_m):
        q_tile = q[:, :, m_start:m_start + tile_m]  # [B, H, rows, D], rows <= TILE_M
        rows = q_tile.shape[2]
        offs_m = torch.arange(m_start, m_start + rows)[:, None]  # [rows, 1]
        m_i = torch.full((batch, heads, rows, 1), -math.inf, dtype=torch.float64)
        l_i = torch.zeros(batch, heads, rows, 1, dtype=torch.float64)
        acc = torch.zeros(batch, heads, rows, v.shape[3], dtype=torch.float64)
        n_full, n_end = kv_tile_ranges(m_start, tile_m, tile_n, k_len, causal, causal_offset)
        for j in range(n_end):
            n_start = j * tile_n
            k_tile = k[:, :, n_start:n_start + tile_n]  # [B, H, cols, D], cols <= TILE_N
            v_tile = v[:, :, n_start:n_start + tile_n]
            s = q_tile @ k_tile.transpose(-1, -2)  # [B, H, rows, cols] raw scores
            # The kernel loads a zero-padded tile at the ragged end and masks the padding;
            # here that tile is simply shorter, so only the causal band needs a mask.
            if causal and j >= n_full:
                offs_n = torch.arange(n_start, n_start + k_tile.shape[2])[None, :]
                s = s.masked_fill(offs_n > offs_m + causal_offset, -math.inf)
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True) * qk_scale_log2)
            m_sub = torch.where(m_new == -math.inf, 0.0, m_new)
            p = torch.exp2(s * qk_scale_log2 - m_sub)  # [B, H, rows, cols]
            alpha = torch.exp2(m_i - m_sub)  # [B, H, rows, 1]
            l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ v_tile
            m_i = m_new
        empty = l_i == 0.0
        out[:, :, m_start:m_start + rows] = acc / torch.where(empty, 1.0, l_i)
        lse_tile = torch.where(empty, math.inf, m_i * math.log(2.0) + torch.log(l_i))
        lse[:, :, m_start:m_start + rows] = lse_tile[..., 0]
    return out, lse


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = False, causal_offset: int = 0) -> torch.Tensor:
    """Plain softmax(scale * Q K^T) V in q's dtype and device (the fp32 GPU reference).

    Same layout and causal convention as ``attention_tiles``; rows that see no key return 0.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(cols > rows + causal_offset, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
    return p @ v


def check_error(out: torch.Tensor, out_ref: torch.Tensor, out_pt: torch.Tensor,
                factor: float = 2.0) -> dict:
    """flash-attn's tolerance rule, applied to a low-precision result.

    ``out`` passes when its max error against the fp32 reference ``out_ref`` is at most
    ``factor`` times the max error of PyTorch's own low-precision result ``out_pt`` against
    the same reference, plus twice the rounding of ``out``'s dtype at the reference's
    magnitude (flash-attn uses 2 for outputs, 3 for gradients). Returns the numbers and "ok".
    """
    ref = out_ref.float()
    floor = ((ref + 0.3 - 0.3).to(out.dtype).float() - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    err_pt = (out_pt.float() - ref).abs().max().item()
    ok = err <= factor * err_pt + 2 * floor and not out.isnan().any().item()
    return {"ok": ok, "max_err": err, "max_err_torch": err_pt, "floor": floor}
