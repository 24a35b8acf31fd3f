"""The KV-cache path's CPU twin, beside ``kernels/attention_decode.py``: a cache's sequences
and mask pieces read back as the kernels see them (``cache_sequences``, ``cache_masks``), the
append's rotary embedding (``rotary_embedding``), a paged varlen call's keys re-packed
(``packed_pages``), and the decode's work split in float64
(``decode_tiles_reference``: each split's partial output and LSE from the forward's twin,
``reference.attention_tiles``, then the combine). It is the oracle of the decode's CPU tests
and, with ``reference.attention_dense``, of its GPU tests.
"""

import math

import torch

from flash_tile.kernels.attention_decode import split_key_tiles
from flash_tile.reference import attention_tiles, cdiv


def cache_sequences(k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                    batch_idx: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None,
                    leftpad: torch.Tensor | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Each sequence's keys and values, [1, H_kv, k_len_b, D] pairs, read from a KV cache in
    flash-attn's layout ([Bc, L_cache, H_kv, D], row batch_idx[b] or b) or from its pages
    ([num_blocks, page_size, H_kv, D] through block_table [B, max_blocks]): positions
    leftpad[b] (or 0) to seqlens_k[b] - 1."""
    seqs = []
    for b, (start, k_len) in enumerate(_key_spans(seqlens_k, leftpad)):
        if block_table is None:
            row = b if batch_idx is None else int(batch_idx[b])
            k, v = k_cache[row, :k_len], v_cache[row, :k_len]
        else:
            pages = block_table[b, :cdiv(k_len, k_cache.shape[1])].long()
            k, v = (c[pages].flatten(0, 1)[:k_len] for c in (k_cache, v_cache))
        seqs.append(tuple(t[start:].transpose(0, 1)[None] for t in (k, v)))
    return seqs


def packed_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 key_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values of a paged ``flash_attn_varlen_func`` call re-packed as the unpaged
    call takes them: (k [total_k, H_kv, D], v [total_k, H_kv, Dv], cu_seqlens_k int32
    [B + 1]), sequence b's first key_counts[b] keys read through its block-table row
    (``cache_sequences``)."""
    seqs = cache_sequences(k_pages, v_pages, key_counts, block_table=block_table)
    k, v = (torch.cat([seq[i][0].transpose(0, 1) for seq in seqs]) for i in (0, 1))
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=key_counts.device)
    cu[1:] = key_counts.cumsum(0)
    return k, v, cu


def paged_layout(k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor, page_size: int,
                 generator: torch.Generator | None = None, fill: float = 0.0,
                 spare_pages: int = 0, no_page: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed k [total_k, H_kv, D] and v [.., Dv] laid into the pages of a cache, as a paged
    ``flash_attn_varlen_func`` call reads them (``packed_pages`` undoes it): (k_pages,
    v_pages [num_blocks, page_size, H_kv, D / Dv], block_table int32 [B, max_blocks]).
    Sequence b (rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1]) gets its pages in the shuffled
    order of ``generator``; ``spare_pages`` more pages that no entry names; the slots past
    each sequence's keys and the spare pages hold ``fill``; the table has one column more
    than the longest sequence needs, and its entries past a sequence's pages hold
    ``no_page``."""
    lengths = cu_seqlens_k.diff().tolist()
    counts = [-(-n // page_size) for n in lengths]
    total = sum(counts) + spare_pages
    order = torch.randperm(total, generator=generator, device=generator.device
                           if generator is not None else k.device)
    pages = [t.new_full((total, page_size, *t.shape[1:]), fill) for t in (k, v)]
    table = torch.full((len(lengths), max(counts, default=0) + 1), no_page, dtype=torch.int32,
                       device=k.device)
    first = 0
    for b, (start, n, count) in enumerate(zip(cu_seqlens_k.tolist(), lengths, counts)):
        ids = order[first:first + count].to(k.device)
        table[b, :count] = ids.to(torch.int32)
        for dst, src in zip(pages, (k, v)):
            padded = src.new_full((count * page_size, *src.shape[1:]), fill)
            padded[:n] = src[start:start + n]
            dst[ids] = padded.view(count, page_size, *src.shape[1:])
        first += count
    return (*pages, table)


def cache_masks(attn_mask: torch.Tensor, seqlens_k: torch.Tensor,
                leftpad: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each sequence's part of a KV-cache call's mask, aligned with ``cache_sequences``'s keys:
    attn_mask [B, 1, Lq, L] (bool, cache positions along L) cut to positions leftpad[b] (or
    0) to seqlens_k[b] - 1, [1, 1, Lq, k_len_b] each."""
    return [attn_mask[b:b + 1, :, :, start:k_len]
            for b, (start, k_len) in enumerate(_key_spans(seqlens_k, leftpad))]


def _key_spans(seqlens_k: torch.Tensor, leftpad: torch.Tensor | None) -> list[tuple[int, int]]:
    """Each sequence's keys as cache positions [start, end): from its left pad (0 without
    one, at most its length) to its length."""
    return [(0 if leftpad is None else min(int(leftpad[b]), k_len), k_len)
            for b, k_len in enumerate(seqlens_k.tolist())]


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """flash-attn's rotary embedding of x [B, L, H, D] with row (b, i) at positions[b, i]:
    the first rotary_dim = 2 * cos.shape[1] columns taken as pairs, (2f, 2f + 1) when
    ``interleaved`` (GPT-J), else (f, f + rotary_dim / 2) (GPT-NeoX), each pair (a, b)
    turned into (a cos - b sin, b cos + a sin) at its frequency f; the other columns pass
    through. Computed in float32 (float64 for float64 x) and returned in x's dtype, rounded
    once, as the append kernel does."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[1]
    c, s = (t.to(work)[positions.long()][:, :, None, :] for t in (cos, sin))  # [B, L, 1, R/2]
    rot, rest = x[..., :2 * half].to(work), x[..., 2 * half:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


def decode_tiles_reference(q: torch.Tensor, seqs: list[tuple[torch.Tensor, torch.Tensor]],
                           scale: float | None = None, window: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                           tile_lq: int = 1, tile_n: int = 128, num_splits: int = 1,
                           sinks: torch.Tensor | None = None,
                           masks: list[torch.Tensor] | None = None,
                           leftpad: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's work split in float64 on the CPU: per sequence and query tile of
    ``tile_lq`` rows, the key tiles some row sees cut into ``num_splits`` runs (the kernel's
    own ``split_key_tiles``), each run's partial output and LSE from the forward's twin
    (``attention_tiles``, the same online softmax), then the combine: lse = log sum_s
    exp(lse_s), o = sum_s exp(lse_s - lse) o_s.

    q [B, Lq, H, D] (flash-attn's layout); ``seqs`` from ``cache_sequences``; causal and
    windows bottom-right per sequence (row i sees key j iff i + k_len - Lq - left <= j <=
    i + k_len - Lq + right). ``sinks`` [H] join split 0's softmax (empty or not), as the
    kernel's SINKS switch, so the combine counts them once. ``masks`` (``cache_masks``: each
    sequence's [1, 1, Lq, k_len_b] bool mask, shared by the heads) hide keys as the kernel's
    ATTN_MASK switch. With ``leftpad`` [B] (flash-attn's ``cache_leftpad``) the twin works
    in cache rows as the kernel's LEFTPAD switch does: ``seqs`` and ``masks`` then start at
    cache row 0 (``cache_sequences`` and ``cache_masks`` without ``leftpad``), k_len counts
    the pad, the pad's rows are hidden and the key tiles wholly inside it skipped. Returns
    (out [B, Lq, H, Dv], lse [B, H, Lq]) in float64, lse +inf (or the sink) and out 0 for rows
    that see no key.
    """
    q = q.detach().to("cpu", torch.float64).transpose(1, 2)  # [B, H, Lq, D]
    batch, heads, q_len, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    left, right = window
    out = torch.zeros(batch, heads, q_len, seqs[0][1].shape[-1], dtype=torch.float64)
    lse = torch.full((batch, heads, q_len), math.inf, dtype=torch.float64)
    for b, (k, v) in enumerate(seqs):
        k_len = k.shape[2]
        k_lo = 0 if leftpad is None else min(int(leftpad[b]), k_len)
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, heads)[b:b + 1]
        for m_start in range(0, q_len, tile_lq):
            rows = slice(m_start, min(m_start + tile_lq, q_len))
            parts = []
            for split in range(num_splits):
                n0, n1 = split_key_tiles(m_start, rows.stop - 1, k_len, k_lo, k_len - q_len,
                                         left, right, split, tile_n, num_splits, left >= 0,
                                         right >= 0, leftpad is not None)
                sink = sinks if split == 0 else None
                if n0 >= n1:
                    if sink is not None:  # the sink alone: o_s = 0, lse_s = sink
                        parts.append((torch.zeros_like(out[0, :, rows]),
                                      sink.detach().to("cpu", torch.float64)[:, None]
                                      .expand(heads, rows.stop - rows.start)))
                    continue  # the kernel's empty split: lse -inf, weight 0
                keys = slice(n0 * tile_n, n1 * tile_n)
                mask = None if masks is None else masks[b][:, :, rows, keys]
                if leftpad is not None:  # the pad's rows are keys of no row
                    past_pad = torch.arange(keys.start, min(keys.stop, k_len)) >= k_lo
                    mask = past_pad if mask is None else mask & past_pad
                o_s, lse_s = attention_tiles(
                    q[b:b + 1, :, rows], k[:, :, keys], v[:, :, keys], scale,
                    k_len - q_len + m_start - n0 * tile_n, window, softcap, slopes, mask,
                    tile_m=tile_lq, tile_n=tile_n, sinks=sink)
                parts.append((o_s[0], lse_s[0].masked_fill(lse_s[0] == math.inf, -math.inf)))
            if not parts:
                continue
            lse_all = torch.stack([p[1] for p in parts])  # [S, H, rows]
            lse_max = lse_all.amax(dim=0)
            weight = torch.exp(lse_all - torch.where(lse_max == -math.inf, 0.0, lse_max))
            total = weight.sum(dim=0)
            o = sum(w[..., None] * p[0] for w, p in zip(weight, parts))
            empty = total == 0.0
            out[b, :, rows] = o / torch.where(empty, 1.0, total)[..., None]
            lse[b, :, rows] = torch.where(empty, math.inf, lse_max + torch.log(total))
    return out.transpose(1, 2), lse
