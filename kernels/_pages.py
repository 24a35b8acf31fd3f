"""Paged K/V: the key tiles of a sequence whose keys lie in pages of a cache, shared by the
decode (``attention_decode``, its PAGED and GATHER switches) and the forward's PAGED switch
(``attention_fwd``: packed queries against paged keys, flash-attn's ``block_table`` of
``flash_attn_varlen_func``).

Layout. A cache [rows, page_size, H_kv, C] as flash-attn stores it (K with C = D, V with
C = Dv): contiguous, one row per sequence (the decode's cache rows), or pages, with
BlockTable [B, max_blocks] int32 naming sequence b's page of keys [p * page_size,
(p + 1) * page_size). A key tile of N keys is, as each caller wants it, K^T [C, N]
(KEYS_LAST, the left side of S = Q K^T) or V [N, C], zero-padded past C.

- Joined loads (PAGED): N // PAGE_N tile loads of PAGE_N keys, PAGE_N a power of two that
  divides the page size (each load lies in one page), joined along the keys by ``ct.cat``.
- Gathered rows (GATHER, pages where such a load would be too small): each key's row read
  from its page by ``ct.gather``.

Every helper takes the sequence's ``kv`` tuple (cuTile unpacks it at compile time):

    kv = (K, V, BlockTable, cache_row, batch, kv_head, page_size, k_lo, k_len)

cache_row the contiguous cache's row of the sequence, k_len its key count, k_lo its first
key (the decode's LEFTPAD; 0 otherwise). Keys at or past k_len read real rows of some page
(the sequence's last, or page 0): the callers mask their scores and zero their V rows.
"""

import cuda.tile as ct

from ._tiles import ZERO, ConstBool, ConstInt


def page_rows(kv, j, TILE_N: ConstInt):
    """Under GATHER: for the keys of key tile j, their page (from the block table) and their
    row in it, [TILE_N] each. Keys at or past k_len take page 0 (every cache has it): the
    table's entries past a sequence's pages need not be valid, and those keys are masked."""
    _, _, BlockTable, _, batch, _, page_size, _, k_len = kv
    keys = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)
    page = ct.gather(BlockTable, (batch, keys // page_size), mask=keys < k_len)
    return page, keys % page_size


def tile_load(A, row, kv_head, tile, N: ConstInt, COLS: ConstInt, KEYS_LAST: ConstBool):
    """Key tile ``tile`` of N keys of K (as K^T, [COLS, N]) or of V ([N, COLS]) in cache row
    (or page) ``row`` of a [row, key, head, column] cache: one tile load. K's tile is
    transposed on chip: the sm_86-sm_120 SASS is that of a load in permuted order, which on
    sm_80 (no TMA) spilled up to 1,593 LDL/STL (tileiras 13.4, 2026-12-05)."""
    if KEYS_LAST:
        return ct.transpose(ct.load(A, index=(row, tile, kv_head, 0), shape=(1, N, 1, COLS),
                                    padding_mode=ZERO).reshape((N, COLS)))
    return ct.load(A, index=(row, tile, kv_head, 0), shape=(1, N, 1, COLS),
                   padding_mode=ZERO).reshape((N, COLS))


def page_load(A, kv, start, PAGE_N: ConstInt, COLS: ConstInt, KEYS_LAST: ConstBool):
    """The PAGE_N keys from key ``start`` on (PAGE_N divides the page size: one page holds
    them) as one tile load of the page the block table names. A start past the sequence's
    last key reads that key's page instead: the table's entries past a sequence's pages need
    not be valid, and those keys are masked."""
    _, _, BlockTable, _, batch, kv_head, page_size, _, k_len = kv
    start = min(start, k_len - 1)
    page = ct.load(BlockTable, (batch, start // page_size), shape=()).item()
    return tile_load(A, page, kv_head, (start % page_size) // PAGE_N, PAGE_N, COLS, KEYS_LAST)


def joined_load(A, kv, start, N: ConstInt, PAGE_N: ConstInt, COLS: ConstInt,
                KEYS_LAST: ConstBool):
    """Keys start .. start + N - 1 as N // PAGE_N page loads joined in halves (``ct.cat``
    along the keys' axis). The recursion unrolls at compile time: N and PAGE_N are
    constants."""
    if N == PAGE_N:
        return page_load(A, kv, start, PAGE_N, COLS, KEYS_LAST)
    axis = 1 if KEYS_LAST else 0
    return ct.cat((joined_load(A, kv, start, N // 2, PAGE_N, COLS, KEYS_LAST),
                   joined_load(A, kv, start + N // 2, N // 2, PAGE_N, COLS, KEYS_LAST)), axis)


def page_numbers(kv, start, N: ConstInt, PAGE_N: ConstInt):
    """The block-table entries ``joined_load`` reads for keys start .. start + N - 1, as a
    tuple, read apart from the loads so that a loop reads a step's entries a step ahead
    (``joined_from``). The caller's k_len is at least 1."""
    if N == PAGE_N:
        _, _, BlockTable, _, batch, _, page_size, _, k_len = kv
        first = min(start, k_len - 1)
        return (ct.load(BlockTable, (batch, first // page_size), shape=()).item(),)
    return (page_numbers(kv, start, N // 2, PAGE_N)
            + page_numbers(kv, start + N // 2, N // 2, PAGE_N))


def joined_from(A, kv, pages, start, N: ConstInt, PAGE_N: ConstInt, COLS: ConstInt,
                KEYS_LAST: ConstBool):
    """``joined_load`` from the block-table entries ``pages`` (``page_numbers`` of the same
    keys) read earlier. Kept apart from ``joined_load``, which reads each entry just before
    its load: with ``joined_load`` as this form on ``page_numbers`` read in the step, the
    decode compiled the same, but the forward's masked steps on 16-key pages spilled 50
    LDL/STL instead of 14 (sm_90, D = 128, tileiras 13.4, 2026-12-08)."""
    _, _, _, _, _, kv_head, page_size, _, k_len = kv
    if N == PAGE_N:
        first = min(start, k_len - 1)
        return tile_load(A, pages[0], kv_head, (first % page_size) // PAGE_N, PAGE_N, COLS,
                         KEYS_LAST)
    half = N // PAGE_N // 2
    axis = 1 if KEYS_LAST else 0
    return ct.cat((joined_from(A, kv, pages[:half], start, N // 2, PAGE_N, COLS, KEYS_LAST),
                   joined_from(A, kv, pages[half:], start + N // 2, N // 2, PAGE_N, COLS,
                               KEYS_LAST)), axis)


def kv_tile(A, kv, j, pages, TILE_N: ConstInt, COLS: ConstInt, PAGED: ConstBool,
            PAGE_N: ConstInt, GATHER: ConstBool, KEYS_LAST: ConstBool, DTYPE):
    """Key tile j of K (as K^T, [COLS, TILE_N]) or of V ([TILE_N, COLS]) in DTYPE: an FP8
    cache's e4m3 tile is widened after its load (exactly: every e4m3 value is a float16 and
    a bfloat16), a tile of A's own dtype is as loaded.

    - Contiguous: one tile load from the sequence's cache row.
    - PAGED: TILE_N // PAGE_N tile loads of PAGE_N keys from the pages the block table
      names, joined (``joined_load``; ``joined_from`` where ``pages`` holds their
      ``page_numbers``, read a step ahead). Joined loads of 16-key pages read 1.34-1.84x the
      GB/s of rows gathered from them (H200, 2026-12-04, docs/experiments).
    - GATHER (pages of other sizes): the TILE_N rows gathered from their pages (``pages``,
      ``page_rows``), 16 bytes a thread (cp.async on sm_80+), the columns past A's width
      read as 0."""
    _, _, _, cache_row, _, kv_head, _, _, _ = kv
    if GATHER:
        page, row = pages
        col = ct.arange(COLS, dtype=ct.int32)
        if KEYS_LAST:
            page, row, col = page[None, :], row[None, :], col[:, None]
        else:
            page, row, col = page[:, None], row[:, None], col[None, :]
        tile = ct.gather(A, (page, row, kv_head, col), mask=col < A.shape[3],
                         check_bounds=False)
    elif not PAGED:
        tile = tile_load(A, cache_row, kv_head, j, TILE_N, COLS, KEYS_LAST)
    elif pages is None:
        tile = joined_load(A, kv, j * TILE_N, TILE_N, PAGE_N, COLS, KEYS_LAST)
    else:  # the step's block-table entries, read a step ahead by the caller
        tile = joined_from(A, kv, pages, j * TILE_N, TILE_N, PAGE_N, COLS, KEYS_LAST)
    if A.dtype != DTYPE:
        tile = tile.astype(DTYPE)
    return tile
