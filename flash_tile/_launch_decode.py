"""Builds the grids and argument tuples of the KV-cache path's kernels and launches them:
the append (with the rotary embedding), the split-KV decode and the combine
(``kernels/attention_decode.py``). As ``flash_tile._launch`` for the forward and backward,
this is the one place that knows their parameter order: the JIT launches here and the
ahead-of-time compiles in ``flash_tile.aot`` take their compile-time constants from
``DecodeSpec``. Callers pass checked tensors (``flash_tile.kvcache``).
"""

import functools
import math
from dataclasses import dataclass

import torch

from flash_tile._arrays import Array, contiguous
from flash_tile._launch import (ABSENT, _placeholder, _with_hints, kernel_mask,
                                launch_on, needs_int64_index)
from flash_tile.kernels.attention_decode import (attention_decode, attention_decode_int64,
                                                 cache_append, cache_append_int64,
                                                 decode_combine)
from flash_tile.decode_variants import DecodeConfig
from flash_tile.variants import tile_width


@dataclass(frozen=True)
class DecodeSpec:
    """The compile-time constants of one decode kernel instance, in the kernel's order."""

    num_splits: int
    tile_lq: int
    tile_g: int
    tile_n: int
    tile_d: int
    tile_dv: int
    mask_left: bool
    mask_right: bool
    softcap: bool
    alibi: bool
    paged: bool
    page_n: int
    gather: bool
    batch_idx: bool
    store_lse: bool
    sinks: bool = False
    leftpad: bool = False
    attn_mask: bool = False

    def constants(self) -> tuple:
        return (self.num_splits, self.tile_lq, self.tile_g, self.tile_n, self.tile_d,
                self.tile_dv, self.mask_left, self.mask_right, self.softcap, self.alibi,
                self.paged, self.page_n, self.gather, self.batch_idx, self.num_splits > 1,
                self.store_lse, self.sinks, self.leftpad, self.attn_mask)


@functools.cache
def decode_tiles(q_len: int, group: int, page_size: int | None, config: DecodeConfig,
                 int64_index: bool = False) -> tuple[int, int, int, int, bool]:
    """(TILE_LQ, TILE_G, TILE_N, PAGE_N, GATHER): the group's heads padded to a power of two,
    as many query rows with them as make ``config.rows`` packed rows (at least 16: the
    smallest tensor-core tile), and the keys a step: ``config.tile_n`` on a contiguous cache,
    ``config.paged_tile_n`` on pages, each step joined from loads of PAGE_N keys (the largest
    power of two that divides the page size, at most the step). Pages where that is below
    ``config.min_page_load`` (sizes 1-8, odd multiples of them) are gathered by row
    (GATHER), ``config.gather_tile_n`` keys a step. The 64-bit kernel (``int64_index``)
    takes ``config.tile_n`` keys a step from pages that hold such steps: on the H200's 16 GiB
    caches 256-key pages read 1.33x faster in 128-key steps than in 64-key ones
    (docs/experiments/evidence/2026-12-04-decode-pages-h200.md, section 4)."""
    tile_g = tile_width(group, 1)
    tile_lq = min(tile_width(q_len, 1), max(config.rows // tile_g, 1))
    tile_lq = max(tile_lq, 16 // min(tile_g, 16))
    if page_size is None:
        return tile_lq, tile_g, config.tile_n, config.tile_n, False
    tile_n = config.paged_tile_n
    if int64_index and page_size % config.tile_n == 0:
        tile_n = config.tile_n
    page_n = min(page_size & -page_size, tile_n)
    if page_n < config.min_page_load or tile_n // page_n > config.max_page_loads:
        return tile_lq, tile_g, config.gather_tile_n, config.gather_tile_n, True
    return tile_lq, tile_g, tile_n, page_n, False


def decode_splits(num_splits: int, batch: int, kv_heads: int, q_tiles: int, key_tiles: int,
                  sms: int, config: DecodeConfig, split_elements: int) -> int:
    """The split count: ``num_splits`` when given (> 0), capped at the key tiles, at
    ``config.max_splits`` and at as many splits as keep the partials below 2**31 elements
    (``split_elements`` a split: B Lq H Dv; the workspace is indexed in 32 bits); else as
    many splits as keep the grid within one wave of ``config.ctas_per_sm`` programs per SM
    (a grid that already fills a wave, or nearly, is not split: a second, part-filled wave
    cost more than it hid), each split keeping at least ``config.min_tiles_per_split`` key
    tiles, under the same caps, rounded down to a power of two: the count is a compile-time
    constant of the kernels, and a cache that grows through a generation then compiles at
    most seven decode kernels, not one per count."""
    cap = min(config.max_splits, (2**31 - 1) // split_elements)
    if num_splits > 0:
        return max(1, min(num_splits, key_tiles, cap))
    programs = batch * kv_heads * q_tiles
    want = sms * config.ctas_per_sm // programs
    splits = max(1, min(want, key_tiles // config.min_tiles_per_split, cap))
    return 1 << (splits.bit_length() - 1)


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor | None, seqlens_k: torch.Tensor,
                  batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                  window: tuple[int, int], new_len: int, num_splits: int,
                  config: DecodeConfig, sinks: torch.Tensor | None = None,
                  leftpad: torch.Tensor | None = None,
                  kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
                  attn_mask: torch.Tensor | None = None) -> int:
    """Launch the decode (and, with more than one split, the combine) on q's current stream.

    q [B, Lq, H, D]; k_cache [Bc, L_cache, H_kv, D] and v_cache [.., Dv] in flash-attn's
    layout, or pages [num_blocks, page_size, H_kv, D] with ``block_table`` [B, max_blocks]
    int32; out [B, Lq, H, Dv] in q's dtype; lse [B, H, Lq] fp32 or None; sequence b has
    seqlens_k[b] + ``new_len`` keys (seqlens_k [B] int32); batch_idx [B] int32 or None;
    alibi_slopes [B, H] fp32 or None. ``window`` (left, right) as ``launch_forward``, aligned
    bottom-right per sequence.
    ``num_splits`` 0 picks the split count (``decode_splits``); ``sinks`` [H] fp32 or None,
    as ``launch_forward``'s; ``leftpad`` [B] int32 or None, the cache row of each sequence's
    first key (its keys are rows leftpad[b] .. seqlens_k[b] + new_len - 1); ``kv_descale``
    the (k, v) descale factors [B, H_kv] fp32 of float8_e4m3fn caches, None for caches in q's
    dtype; ``attn_mask`` [B, 1, Lq, L] bool (L the cache's capacity: the keys each query row
    may see, shared by the heads; passed as ``_launch.kernel_mask`` makes it) or None.
    Returns the split count.
    """
    plan = decode_plan(q, k_cache, v_cache, lse is not None, batch_idx, block_table,
                       alibi_slopes, softcap, window, num_splits, config, sinks, leftpad,
                       attn_mask is not None)
    if plan is not None:
        plan.launch(q, k_cache, v_cache, out, lse, seqlens_k, batch_idx, block_table,
                    alibi_slopes, scale, softcap, window, new_len, sinks, leftpad, kv_descale,
                    attn_mask)
        return plan.splits
    # A contiguous cache of 2**31 elements or more: launches of fewer sequences keep 32-bit
    # indices.
    k_cache, v_cache = batch_rows(k_cache, v_cache, q.shape[0], None, None)
    chunk = int32_batch_rows(k_cache, v_cache)
    splits = 0
    for b0 in range(0, q.shape[0], chunk):
        rows = slice(b0, b0 + chunk)
        splits = launch_decode(
            q[rows], k_cache[rows], v_cache[rows], out[rows],
            None if lse is None else lse[rows], seqlens_k[rows], None, None,
            None if alibi_slopes is None else alibi_slopes[rows], scale, softcap, window,
            new_len, num_splits, config, sinks, None if leftpad is None else leftpad[rows],
            None if kv_descale is None else tuple(d[rows] for d in kv_descale),
            None if attn_mask is None else attn_mask[rows])
    return splits


def batch_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int,
               batch_idx: torch.Tensor | None, block_table: torch.Tensor | None) -> tuple:
    """The caches as the append and the decode index them: a contiguous cache without
    cache_batch_idx holds sequence b in row b, so its rows past the batch are never read nor
    written, and are cut off before the 32/64-bit choice (both kernels then make the same)."""
    if block_table is None and batch_idx is None and k_cache.shape[0] > batch:
        return k_cache[:batch], v_cache[:batch]
    return k_cache, v_cache


def decode_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                store_lse: bool, batch_idx: torch.Tensor | None,
                block_table: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                softcap: float, window: tuple[int, int], num_splits: int, config: DecodeConfig,
                sinks: torch.Tensor | None = None, leftpad: torch.Tensor | None = None,
                attn_mask: bool = False) -> "_DecodePlan | None":
    """The plan ``launch_decode`` launches for these arrays (arguments as its), valid for
    every call of their signature (``attn_mask`` whether a mask is given); None where the
    batch must be split into launches that 32-bit offsets reach (a contiguous cache of 2**31
    elements or more)."""
    paged = block_table is not None
    k_cache, v_cache = batch_rows(k_cache, v_cache, q.shape[0], batch_idx, block_table)
    int64_index = needs_int64_index(k_cache, v_cache)
    if not paged and batch_idx is None and int64_index and \
            0 < int32_batch_rows(k_cache, v_cache) < q.shape[0]:
        return None
    return _decode_plan(q.shape, k_cache.shape, v_cache.shape[3],
                        block_table.shape[1] if paged else None, num_splits,
                        (window[0] >= 0, window[1] >= 0, softcap > 0.0,
                         alibi_slopes is not None, batch_idx is not None, store_lse,
                         sinks is not None, leftpad is not None, attn_mask),
                        int64_index, config, _sm_count(q.device))


def int32_batch_rows(*caches: torch.Tensor) -> int:
    """How many leading cache rows (sequences) of contiguous [Bc, L_cache, H_kv, D] caches a
    launch can take with every element offset below 2**31, 0 where one row alone reaches it.
    A cache past 2**31 elements then runs in launches of that many sequences on the 32-bit
    kernel, which read the H200's 16 GiB grid rows 1.1x faster than the 64-bit one
    (2026-12-02, bench/results/decode-h200.md at 9ad8d76: 0.90-0.92x cuDNN there)."""
    rows = []
    for cache in caches:
        inner = sum((n - 1) * st for n, st in zip(cache.shape[1:], cache.stride()[1:]))
        room = 2**31 - 1 - inner  # row offsets (r - 1) * stride(0) must stay below it
        rows.append(0 if room <= 0 else (room - 1) // max(cache.stride(0), 1) + 1)
    return min(rows)


@dataclass(frozen=True)
class _Partials:
    """The split-KV partials of one plan in one fp32 workspace of ``elements``
    (``decode_workspace``): the outputs [S, B, Lq, H, Dv], then from ``lse_offset`` bytes on
    (a multiple of 256: the LSEs keep the 16-byte alignment the kernels are compiled for, with
    room to spare) the LSEs [S, B, Lq, H]; passed by address (``_arrays.Array``) in the layouts
    the decode ([.., H_kv, G, ..]) and the combine read: one allocation and four small dicts
    a call, where two allocations and two views took about 7 us of host time on a 2-core CPU
    host (2026-12-07)."""

    elements: int
    lse_offset: int
    decode_out: tuple
    decode_lse: tuple
    combine_out: tuple
    combine_lse: tuple


def _partials(splits: int, out_view: tuple) -> _Partials:
    """The workspace of ``splits`` partials of an output viewed as ``out_view`` [B, Lq, H_kv,
    G, Dv]."""
    outputs = splits * math.prod(out_view)
    lse_offset = -(-outputs * 4 // 256) * 256
    lse_elements = splits * math.prod(out_view[:4])
    batch, q_len, kv_heads, group, v_head_dim = out_view
    heads = kv_heads * group
    return _Partials(lse_offset // 4 + lse_elements, lse_offset,
                     contiguous((splits, *out_view), torch.float32),
                     contiguous((splits, *out_view[:4]), torch.float32),
                     contiguous((splits, batch, q_len, heads, v_head_dim), torch.float32),
                     contiguous((splits, batch, q_len, heads), torch.float32))


@dataclass(frozen=True)
class _DecodePlan:
    """What a decode launch takes from its arguments' shapes and switches, worked out once
    per signature (``_decode_plan``): the host's time per call is the cost of decode at
    small batch."""

    splits: int
    grid: tuple[int, int, int]
    kernel: object
    constants: tuple
    combine_constants: tuple
    q_view: tuple[int, int, int, int, int]  # [B, Lq, H_kv, G, D]
    out_view: tuple[int, int, int, int, int]  # [B, Lq, H_kv, G, Dv]
    pdl: bool  # the config's programmatic dependent launch
    int64_index: bool  # the caches need 64-bit offsets (the append's choice too)
    partials: _Partials | None  # with more than one split

    def launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor | None, seqlens_k: torch.Tensor,
               batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
               alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
               window: tuple[int, int], new_len: int, sinks: torch.Tensor | None = None,
               leftpad: torch.Tensor | None = None,
               kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
               attn_mask: torch.Tensor | None = None) -> None:
        """The decode (and, with more than one split, the combine) of a call with this plan's
        signature, on q's current stream; arguments as ``launch_decode``'s."""
        self.launch_arrays(self.arrays(q, k_cache, v_cache, out, lse, seqlens_k, batch_idx,
                                       block_table, alibi_slopes, sinks, leftpad, kv_descale,
                                       attn_mask),
                           out, lse, scale, softcap, window, new_len, q.device)

    def arrays(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor | None, seqlens_k: torch.Tensor,
               batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
               alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
               leftpad: torch.Tensor | None = None,
               kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
               attn_mask: torch.Tensor | None = None) -> tuple:
        """The decode kernel's array arguments of a call but its split partials, as the kernel
        reads them: q, k_cache, v_cache, out, lse, seqlens_k, batch_idx, block_table,
        alibi_slopes, sinks, leftpad, attn_mask, k_descale, v_descale; ``ABSENT`` where a
        switch leaves one unread, and for out and the LSE under a split (the combine writes
        those)."""
        batch, q_len, kv_heads, group, _ = self.q_view
        k_cache, v_cache = batch_rows(k_cache, v_cache, batch, batch_idx, block_table)
        split = self.splits > 1
        return (q.view(*self.q_view), k_cache, v_cache,
                ABSENT if split else out.view(*self.out_view),
                ABSENT if split or lse is None else lse.view(batch, kv_heads, group, q_len),
                seqlens_k, ABSENT if batch_idx is None else batch_idx,
                ABSENT if block_table is None else block_table,
                ABSENT if alibi_slopes is None else alibi_slopes.view(batch, kv_heads, group),
                ABSENT if sinks is None else sinks.view(kv_heads, group),
                ABSENT if leftpad is None else leftpad,
                ABSENT if attn_mask is None else kernel_mask(attn_mask),
                *(kv_descale or (ABSENT, ABSENT)))

    def launch_arrays(self, arrays: tuple, out, lse, scale: float, softcap: float,
                      window: tuple[int, int], new_len: int, device: torch.device) -> None:
        """The decode (and the combine) on ``device``'s current stream with ``arrays``
        (``arrays()``'s, or the same arrays by address), the combine writing ``out`` and
        ``lse`` (tensors or ``_arrays.Array``; lse None without one)."""
        batch, q_len, kv_heads, group, _ = self.q_view
        split = self.splits > 1
        if split:  # the kernel writes the partials; the combine, out and lse
            parts = self.partials
            workspace = decode_workspace(parts.elements, device)  # held past both launches
            out_split = workspace.data_ptr()
            lse_split = out_split + parts.lse_offset
            partials = (Array(parts.decode_out, out_split), Array(parts.decode_lse, lse_split))
        else:
            partials = (ABSENT, ABSENT)
        args = (*arrays[:5], *partials, *arrays[5:], float(scale), float(softcap),
                int(window[0]), int(window[1]), int(new_len), *self.constants)
        # Under pdl both launches may start while their predecessor on the stream (the
        # append, any kernel of the caller's, the decode) finishes: each kernel waits for it
        # before its first read (ct.grid_dependency_control_wait).
        launch_on(device, self.grid, self.kernel, args, programmatic_dependent_launch=self.pdl)
        if split:
            launch_on(device, (q_len, kv_heads * group, batch), decode_combine,
                      (Array(parts.combine_out, out_split), Array(parts.combine_lse, lse_split),
                       out, ABSENT if lse is None else lse, *self.combine_constants),
                      programmatic_dependent_launch=self.pdl)


@functools.cache
def _decode_plan(q_shape: tuple, cache_shape: tuple, v_head_dim: int,
                 table_blocks: int | None, num_splits: int, switches: tuple,
                 int64_index: bool, config: DecodeConfig, sms: int) -> _DecodePlan:
    """The decode launch's plan for q [B, Lq, H, D], a cache [.., page_size or L_cache,
    H_kv, D] (paged when ``table_blocks``, the block table's width, is given), the
    ``num_splits`` asked for and the DecodeSpec ``switches`` (mask_left, mask_right, softcap,
    alibi, batch_idx, store_lse, sinks, leftpad, attn_mask)."""
    batch, q_len, heads, head_dim = q_shape
    kv_heads = cache_shape[2]
    group = heads // kv_heads
    paged = table_blocks is not None
    tile_lq, tile_g, tile_n, page_n, gather = decode_tiles(
        q_len, group, cache_shape[1] if paged else None, config, int64_index)
    q_tiles = -(-q_len // tile_lq)
    capacity = table_blocks * cache_shape[1] if paged else cache_shape[1]
    splits = decode_splits(num_splits, batch, kv_heads, q_tiles, -(-capacity // tile_n), sms,
                           config, batch * q_len * heads * v_head_dim)
    (mask_left, mask_right, softcap, alibi, batch_idx, store_lse, sinks, leftpad,
     attn_mask) = switches
    spec = DecodeSpec(splits, tile_lq, tile_g, tile_n, tile_width(head_dim),
                      tile_width(v_head_dim), mask_left, mask_right, softcap, alibi, paged,
                      page_n, gather, batch_idx, store_lse, sinks, leftpad, attn_mask)
    return _DecodePlan(splits, (splits * q_tiles, kv_heads, batch),
                       _decode_kernel(config, int64_index), spec.constants(),
                       (tile_width(splits, 1), tile_width(v_head_dim), store_lse),
                       (batch, q_len, kv_heads, group, head_dim),
                       (batch, q_len, kv_heads, group, v_head_dim), config.pdl,
                       int64_index,
                       _partials(splits, (batch, q_len, kv_heads, group, v_head_dim))
                       if splits > 1 else None)


def decode_workspace(elements: int, device: torch.device) -> torch.Tensor:
    """The split partials' fp32 workspace (``_Partials``), from torch's caching allocator (a
    graph capture gets it from its own pool)."""
    return torch.empty(elements, dtype=torch.float32, device=device)


def rotated_q_workspace(q: torch.Tensor) -> torch.Tensor:
    """The rotated q [B, Lq, H, D] the rotary append writes whole and the decode reads."""
    return torch.empty_like(q)


@dataclass(frozen=True)
class Rotary:
    """The rotary embedding the append applies: cos/sin [L_ro, rotary_dim / 2] in q's dtype,
    GPT-J's interleaved pairs or GPT-NeoX's halves, and the query rows' position step (1 for
    a causal or windowed call, 0: every row at the cache's length)."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    q_step: int


def launch_cache_append(k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor, batch_idx: torch.Tensor | None,
                        block_table: torch.Tensor | None, q: torch.Tensor | None = None,
                        q_rot: torch.Tensor | None = None, rotary: Rotary | None = None,
                        kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
                        int64_index: bool | None = None) -> None:
    """Write k_new/v_new [B, L_new, H_kv, D / Dv] into the caches (layouts as
    ``launch_decode``) at position cache_seqlens[b] of each sequence b, on the current stream
    of their device. With ``rotary`` the keys are rotated at their positions on the way, and
    q [B, Lq, H, D] is rotated into q_rot (its shape) in the same launch; k_new and v_new may
    then be None (no new rows: q alone is rotated). Into float8_e4m3fn caches, rows in q's
    dtype are divided by ``kv_descale`` ((k, v) [B, H_kv] fp32) and rounded; e4m3 rows are
    stored as they are. ``int64_index`` whether the caches need 64-bit offsets
    (``needs_int64_index``), where the caller knows it (a decode plan); None: worked out
    here."""
    launch_on(k_cache.device, *append_launch(k_new, v_new, k_cache, v_cache, cache_seqlens,
                                             batch_idx, block_table, q, q_rot, rotary,
                                             kv_descale, int64_index))


#: The append kernel's arrays, in ``append_launch``'s order (its arguments' first 13).
APPEND_ARRAYS = ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "batch_idx",
                 "block_table", "q", "q_rot", "rotary_cos", "rotary_sin", "k_descale",
                 "v_descale")


def append_launch(k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                  batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                  q: torch.Tensor | None = None, q_rot: torch.Tensor | None = None,
                  rotary: Rotary | None = None,
                  kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
                  int64_index: bool | None = None) -> tuple:
    """(grid, kernel, args) of the append, arguments as ``launch_cache_append``'s: what it
    passes to ``ct.launch``, the arrays first (``APPEND_ARRAYS``; q and q_rot as their
    [B, Lq, H_kv, G, D] views)."""
    device, kv_heads, head_dim = k_cache.device, k_cache.shape[2], k_cache.shape[3]
    new_len = 0 if k_new is None else k_new.shape[1]
    batch = q.shape[0] if k_new is None else k_new.shape[0]
    k_cache, v_cache = batch_rows(k_cache, v_cache, batch, batch_idx, block_table)
    if int64_index is None:
        int64_index = needs_int64_index(k_cache, v_cache)
    if k_new is None:  # typed as the cache: the append's store must compile, never runs
        k_new = v_new = _placeholder(device, 4, k_cache.dtype)
    rows, group = new_len, 1
    rotary_args = (ABSENT, ABSENT, ABSENT, ABSENT, 0, 0)
    if rotary is not None:
        rows, group = max(new_len, q.shape[1]), q.shape[2] // kv_heads
        shape = (batch, q.shape[1], kv_heads, group, head_dim)
        rotary_args = (q.view(shape), q_rot.view(shape), rotary.cos, rotary.sin,
                       2 * rotary.cos.shape[1], rotary.q_step)
    return ((rows, kv_heads, batch), cache_append_int64 if int64_index else cache_append,
            (k_new, v_new, k_cache, v_cache, cache_seqlens,
             ABSENT if batch_idx is None else batch_idx,
             ABSENT if block_table is None else block_table,
             *rotary_args[:4], *(kv_descale or (ABSENT, ABSENT)), new_len,
             *rotary_args[4:], tile_width(head_dim),
             tile_width(v_cache.shape[3]), tile_width(group, 1), block_table is not None,
             batch_idx is not None, rotary is not None,
             rotary is not None and rotary.interleaved))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _decode_kernel(config: DecodeConfig, int64_index: bool = False):
    """The decode entry point (32- or 64-bit indexing of the caches) with ``config``'s
    compiler hints, made once per pair."""
    kernel = attention_decode_int64 if int64_index else attention_decode
    return _with_hints(kernel, tuple(config.hints().items()))
