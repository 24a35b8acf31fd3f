"""Builds the grids and argument tuples of the forward and backward kernels and launches them
(the KV-cache decode's: ``flash_tile._launch_decode``).

This is the one place that knows the kernels' parameter order: the JIT launches here and the
ahead-of-time compiles in ``flash_tile.aot`` both take their compile-time constants from
``ForwardSpec`` (``constants`` for the forward, ``dq_constants`` and ``dkdv_constants`` for
the backward, ``preprocess_constants`` and ``convert_constants`` for the one-pass form's small
kernels). Callers pass checked tensors; the choices made here from the arrays a launch
really gets are 32- or 64-bit indexing (``needs_int64_index``) and a boolean mask's form
(``kernel_mask``).
"""

import functools
from dataclasses import dataclass, replace

import cuda.tile as ct
import torch

from flash_tile.kernels._tiles import ADDITIVE_MASK, BOOL_MASK, NO_MASK, dropout_threshold
from flash_tile.kernels.attention_bwd import (
    attention_bwd_dkdv, attention_bwd_dkdv_int64, attention_bwd_dq, attention_bwd_dq_convert,
    attention_bwd_dq_convert_int64, attention_bwd_dq_int64, attention_bwd_preprocess,
    attention_bwd_preprocess_int64)
from flash_tile.kernels.attention_fwd import (attention_fwd, attention_fwd_int64,
                                              keys_major_copy, keys_major_copy_int64)
from flash_tile.variants import TileConfig, tile_width


@dataclass(frozen=True)
class ForwardSpec:
    """The compile-time constants of one forward kernel instance, in the kernel's order."""

    tile_m: int
    tile_n: int
    tile_d: int
    tile_dv: int
    mask_left: bool
    mask_right: bool
    even_n: bool
    softcap: bool
    alibi: bool
    attn_mask: int  # NO_MASK, BOOL_MASK or ADDITIVE_MASK
    store_lse: bool  # the forward's alone
    dropout: bool
    latency_k: int  # the forward's alone, as latency_v and varlen
    latency_v: int
    varlen: bool = False  # packed sequences bounded by cumulative lengths
    sinks: bool = False  # a learnt sink logit per head joins each row's softmax
    seqused_k: bool = False  # under varlen, each sequence uses only its first keys
    fp8: bool = False  # e4m3 q, k and V^T with descale factors; the forward's alone
    exp2_fma: int = 0  # under fp8, the share of the exp2 on the FMA pipe (TileConfig's)
    paged: bool = False  # under varlen, the keys in pages (the forward's alone, as page_n)
    page_n: int = 0  # keys a page load (0 under gather)
    gather: bool = False  # paged keys gathered by row (pages a load of MIN_PAGE_LOAD misses)
    page_ahead: bool = False  # joined page loads' table entries a step ahead (TileConfig's)

    def _shared(self) -> tuple:
        return (self.tile_m, self.tile_n, self.tile_d, self.tile_dv, self.mask_left,
                self.mask_right, self.even_n, self.softcap, self.alibi, self.attn_mask)

    def constants(self) -> tuple:
        return (*self._shared(), self.store_lse, self.dropout, self.latency_k, self.latency_v,
                self.varlen, self.sinks, self.seqused_k, self.fp8, self.exp2_fma, self.paged,
                self.page_n, self.gather, self.page_ahead)

    def _backward_shared(self) -> tuple:
        """The forward's switches but STORE_LSE and the schedule fields."""
        return (*self._shared(), self.dropout)

    def dq_constants(self, lse_grad: bool) -> tuple:
        """The dQ kernel's: the backward's switches, whether it reads dLSE for Delta, VARLEN,
        SINKS (the dQ kernel forms the sinks' gradient), SEQUSED_K."""
        return (*self._backward_shared(), lse_grad, self.varlen, self.sinks, self.seqused_k)

    def dkdv_constants(self, group: int, group_inner: bool, dq_accum: bool = False) -> tuple:
        """The dK/dV kernel's: the backward's switches, the GQA group size and loop order,
        VARLEN, SEQUSED_K, and DQ_ACCUM (the one-pass form adds dQ into an accumulator)."""
        return (*self._backward_shared(), group, group_inner, self.varlen, self.seqused_k,
                dq_accum)

    def preprocess_constants(self, lse_grad: bool) -> tuple:
        """The one-pass preprocess kernel's: TILE_M, TILE_DV, LSE_GRAD, VARLEN, SINKS."""
        return (self.tile_m, self.tile_dv, lse_grad, self.varlen, self.sinks)

    def convert_constants(self) -> tuple:
        """The one-pass dQ convert kernel's: TILE_M, TILE_D, SOFTCAP, VARLEN."""
        return (self.tile_m, self.tile_d, self.softcap, self.varlen)


#: The fewest keys a paged forward loads from a page at once: pages whose size has a smaller
#: power-of-two factor (1-8, odd multiples of them) are gathered by row, as the decode's
#: (``decode_variants.DecodeConfig.min_page_load``).
MIN_PAGE_LOAD = 16


@dataclass(frozen=True)
class Varlen:
    """Packed sequences: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
    of q (and its keys likewise of k and v), int32 [B + 1] on q's device; the grids are
    flattened over every sequence's tiles (``varlen_grid``), so no longest length is needed
    and nothing is read back. With ``seqused_k`` (int32 [B]) sequence b uses only the first
    seqused_k[b] of its keys. With ``block_table`` (int32 [B, max_blocks], the forward's
    alone) k and v are pages [num_blocks, page_size, H_kv, D] and sequence b's keys lie in the
    pages its row names; cu_seqlens_k may then be None when seqused_k gives the key counts."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    def spec(self, spec: ForwardSpec, page_size: int = 0) -> ForwardSpec:
        """``spec`` under VARLEN: every sequence has a ragged end, so no EVEN_N; with a block
        table, keys in pages of ``page_size`` (``paged_spec``)."""
        return varlen_spec(spec, self.seqused_k is not None,
                            None if self.block_table is None else page_size)


@functools.cache
def varlen_spec(spec: ForwardSpec, seqused_k: bool, page_size: int | None) -> ForwardSpec:
    """``spec`` under VARLEN (with SEQUSED_K where ``seqused_k``; keys in pages of
    ``page_size`` where given), as ``Varlen.spec`` and the AOT signatures make it; made once
    per set of arguments: its two ``dataclasses.replace`` were a fifth of a paged call's host
    time under cProfile (2026-12-07, CPU host, launches stubbed)."""
    spec = replace(spec, even_n=False, varlen=True, seqused_k=seqused_k)
    return (replace(spec, page_ahead=False) if page_size is None
            else paged_spec(spec, page_size))


def paged_spec(spec: ForwardSpec, page_size: int) -> ForwardSpec:
    """``spec`` with its keys in pages of ``page_size``: each key tile joined from loads of
    the largest power of two that divides the page size (at most the tile), or gathered by
    row where that is below ``MIN_PAGE_LOAD``; the config's ``page_ahead`` kept for joined
    loads alone."""
    page_n = min(page_size & -page_size, spec.tile_n)
    gather = page_n < MIN_PAGE_LOAD
    return replace(spec, paged=True, page_n=0 if gather else page_n, gather=gather,
                   page_ahead=spec.page_ahead and not gather)


@dataclass(frozen=True)
class Dropout:
    """Dropout of the attention probabilities: each is kept with probability 1 - p (and
    scaled by 1 / (1 - p)), decided by a hash of (seed, batch, head, row, column)."""

    p: float
    seed: int  # in [0, 2**31 - 1)

    def scalars(self) -> tuple[int, int, float]:
        """(dropout_seed, dropout_threshold, dropout_scale): the kernels' runtime arguments;
        a hash below the threshold (p * 2**32 of the unsigned 32-bit range, passed as the int32
        of the same bits) drops its score."""
        threshold = dropout_threshold(self.p)
        return int(self.seed), threshold - (threshold >> 31 << 32), 1.0 / (1.0 - self.p)


NO_DROPOUT = Dropout(0.0, 0)


#: The kernels' ATTN_MASK switch by mask name (None: no mask).
MASK_KINDS = {None: NO_MASK, "bool": BOOL_MASK, "additive": ADDITIVE_MASK}


def mask_name(attn_mask: torch.Tensor | None) -> str | None:
    """"bool", "additive" or None: the mask's kind, as ``MASK_KINDS`` and the tuner name it."""
    if attn_mask is None:
        return None
    return "bool" if attn_mask.dtype == torch.bool else "additive"


def mask_kind(attn_mask: torch.Tensor | None) -> int:
    """The kernel's ATTN_MASK switch for a mask tensor (or None)."""
    return MASK_KINDS[mask_name(attn_mask)]


def kernel_mask(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as the kernels take it: a bool mask that TMA can read (unit last stride,
    16-byte aligned base and other strides, so Lk a multiple of 16 for a dense one) as its
    uint8 view (no copy, same strides); bool tiles are never loaded through TMA, which misread
    them (``kernels/_tiles.py``, BOOL_MASK). Otherwise the bool mask stays: without TMA the
    uint8 form spills on sm_90 (38-90 LDL/STL at D 64/128, tileiras 13.4), the bool one not."""
    if attn_mask is not None and attn_mask.dtype == torch.bool and \
            attn_mask.stride(-1) == 1 and attn_mask.data_ptr() % 16 == 0 and \
            all(stride % 16 == 0 for stride in attn_mask.stride()[:-1]):
        return attn_mask.view(torch.uint8)
    return attn_mask


@functools.cache
def forward_spec(config: TileConfig, head_dim: int, v_head_dim: int, even_n: bool,
                 window: tuple[int, int], softcap: bool, alibi: bool, attn_mask: int,
                 store_lse: bool, dropout: bool, sinks: bool = False,
                 fp8: bool = False) -> ForwardSpec:
    """The kernel instance ``config`` gives for these dims and features; ``even_n`` whether
    the key length is a multiple of the config's tile_n (the key length itself is not part of
    the key: a packed batch's total changes every step, and this cache would grow with it).

    ``window`` is (left, right) with -1 for unbounded; causal is a right bound of 0.
    ``attn_mask`` is the ATTN_MASK switch (``mask_kind``); ``fp8`` the FP8 switch, whose
    head-dim tiles are at least 32 wide (the K of an e4m3 tensor-core matmul) and which alone
    reads the config's ``exp2_fma`` (0 otherwise: one kernel instance for the other dtypes).
    Made once per set of arguments.
    """
    left, right = window
    least = 32 if fp8 else 16
    return ForwardSpec(config.tile_m, config.tile_n, tile_width(head_dim, least),
                       tile_width(v_head_dim, least), left >= 0, right >= 0,
                       even_n, softcap, alibi, attn_mask, store_lse,
                       dropout, config.latency_k, config.latency_v, sinks=sinks, fp8=fp8,
                       exp2_fma=config.exp2_fma if fp8 else 0, page_ahead=config.page_ahead)


@functools.cache
def _with_hints(kernel, hints: tuple):
    """``kernel`` with the compiler hints ``hints`` ((name, value) pairs), made once per pair.

    ``replace_hints`` returns a kernel with its own JIT cache, so making one per call would
    recompile (or reload from disk) on every launch; configs that differ only in their tiles
    or switches share one kernel, whose JIT caches each set of constants.
    """
    return kernel.replace_hints(**dict(hints)) if hints else kernel


@functools.cache
def hinted_kernel(config: TileConfig, int64_index: bool = False):
    """The forward entry point (32- or 64-bit indexing) with ``config``'s compiler hints."""
    kernel = attention_fwd_int64 if int64_index else attention_fwd
    return _with_hints(kernel, tuple(config.hints().items()))


# The one-pass preprocess (a row sum of O * dO, memory-bound) at four programs an SM on sm_90:
# without a hint tileiras gave its 64-row tiles 255 registers, one program an SM, 167 us at
# B*L = 16k tokens, H*D = 2048, D = 128 (1.6 TB/s, the zeros then stored too); hinted 64
# registers and 72 us, the whole backward 0.87-0.98x its time at D 64/128, L 1k-16k. Its
# 128-row tiles at D = 256 fill an SM's shared memory either way (no change) [H200,
# 2026-12-04, bf16; the A/B in
# docs/experiments/evidence/2026-12-04-backward-preprocess-ab-h200.md]. Other architectures
# keep tileiras's choice: on sm_80 (no TMA) the hint took D = 256 from 70 to 858 LDL/STL.
PREPROCESS_OCCUPANCY = {"sm_90": 4}


@functools.cache
def _preprocess_kernel(kernel):
    """A one-pass preprocess entry point with ``PREPROCESS_OCCUPANCY``, made once per kernel
    (``_with_hints``'s reason; a ``ct.ByTarget`` is not hashable, so not through it)."""
    return kernel.replace_hints(occupancy=ct.ByTarget(**PREPROCESS_OCCUPANCY))


@functools.cache
def hinted_backward_kernels(config: TileConfig, int64_index: bool = False) -> tuple:
    """The backward's kernels in launch order (32- or 64-bit indexing): (dQ, dK/dV) with
    ``config``'s hints, or in the one-pass form (preprocess with ``PREPROCESS_OCCUPANCY``,
    dK/dV with the config's, dQ convert with tileiras's defaults)."""
    hints = tuple(config.hints().items())
    if config.one_pass:
        preprocess, dkdv, convert = ((attention_bwd_preprocess_int64, attention_bwd_dkdv_int64,
                                      attention_bwd_dq_convert_int64) if int64_index else
                                     (attention_bwd_preprocess, attention_bwd_dkdv,
                                      attention_bwd_dq_convert))
        return _preprocess_kernel(preprocess), _with_hints(dkdv, hints), convert
    kernels = ((attention_bwd_dq_int64, attention_bwd_dkdv_int64) if int64_index else
               (attention_bwd_dq, attention_bwd_dkdv))
    return tuple(_with_hints(kernel, hints) for kernel in kernels)


def delta_workspace(batch: int, heads: int, q_len: int, device: torch.device) -> torch.Tensor:
    """Delta = rowsum(dO * O) - dLSE, fp32 [B, H, Lq]: stored by the dQ (or preprocess)
    kernel for every row of every sequence, so it starts uninitialised. Under varlen the
    dK/dV kernel's last ragged query tile also reads rows no sequence covers, unstored, and
    masks them."""
    return torch.empty((batch, heads, q_len), dtype=torch.float32, device=device)


def dq_accumulator(q: torch.Tensor) -> torch.Tensor:
    """The one-pass backward's fp32 dQ sums, q's shape [B, H, Lq, D], rows padded to a
    multiple of 16 bytes: TMA reduce-adds need 16-byte aligned strides (per-element atomics
    otherwise). Zeroed here, a memset launch: see ``_preprocess_impl`` for why the
    preprocess kernel does not."""
    batch, heads, q_len, head_dim = q.shape
    padded = -(-head_dim // 4) * 4
    return torch.zeros((batch, heads, q_len, padded), dtype=torch.float32,
                       device=q.device)[..., :head_dim]


# Keys per program of ``keys_major``'s copy: a [Dv, 128] tile is 8-32 KB of e4m3, 128-byte
# rows for whole STG.128 runs, and 16k tokens of H_kv * Dv = 2048 make 2048 programs; it ran
# at 3.0-3.4 TB/s on an H200 (2026-12-03), no other width timed.
KEYS_MAJOR_TILE_N = 128


def keys_major_workspace(v: torch.Tensor) -> torch.Tensor:
    """The uninitialised [B, H_kv, Dv, Lk rounded up to 16] buffer ``keys_major`` fills."""
    batch, heads, length, dim = v.shape
    return torch.empty((batch, heads, dim, -(-length // 16) * 16), dtype=v.dtype,
                       device=v.device)


def keys_major(v: torch.Tensor) -> torch.Tensor:
    """V [B, H_kv, Lk, Dv] (any strides) as the FP8 forward reads it: V^T [B, H_kv, Dv, Lk],
    keys contiguous, each row padded to a multiple of 16 keys in memory (TMA's 16-byte row
    alignment; the view's shape stays Lk, so the padding is never read). One copy of V, by
    the ``keys_major_copy`` kernel on ``v``'s current stream: the e4m3 matmul wants P V's
    reduction axis (the keys) contiguous, and transposing each tile in the forward costs
    more (``kernels/attention_fwd.py``, FP8)."""
    batch, heads, length, dim = v.shape
    v_t = keys_major_workspace(v)
    if v_t.numel():
        # The copy writes the padded buffer whole, so that its rows are 16-byte vectors:
        # stores clipped at a ragged Lk went out byte by byte (sm_90 SASS, STG.E.U8).
        kernel = keys_major_copy_int64 if needs_int64_index(v, v_t) else keys_major_copy
        launch_on(v.device, (-(-v_t.shape[3] // KEYS_MAJOR_TILE_N), heads, batch), kernel,
                  (v, v_t, KEYS_MAJOR_TILE_N, tile_width(dim)))
    return v_t[..., :length]


def needs_int64_index(*tensors: torch.Tensor) -> bool:
    """Whether an element offset of any tensor reaches 2**31 (32-bit shapes and strides would
    overflow): those take the 64-bit-index entry point. Every offset lies inside the tensor's
    storage, so a storage of fewer elements settles it with one call (this runs on every
    launch; the exact sum over shape and strides cost ~1.4 us a tensor on a CPU)."""
    exact = torch.compiler.is_compiling()  # torch.compile cannot trace a storage query
    return any((exact or t.untyped_storage().nbytes() // t.element_size() > 2**31 - 1) and
               sum((n - 1) * st for n, st in zip(t.shape, t.stride())) >= 2**31 - 1
               for t in tensors)


def forward_grid(q_len: int, heads: int, batch: int, config: TileConfig) -> tuple:
    """One program per (query tile, head, batch); query tiles of a head are neighbours in
    launch order, so they read the same K/V while it is still in L2."""
    return (ct.cdiv(q_len, config.tile_m), heads, batch)


def varlen_grid(total: int, tile: int, heads: int, batch: int) -> tuple:
    """The flattened grid of ``total`` packed rows in ``batch`` sequences cut into tiles of
    ``tile`` rows (the kernels' ``program_tile``): total // tile + batch programs a head cover
    every sequence's tiles, at most one idle a sequence; a sequence's tiles are neighbours in
    launch order. Built from the shapes alone: no length is read back."""
    return (total // tile + batch, heads, 1)


@functools.cache
def _placeholder(device: torch.device, rank: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # One per device, rank and dtype for the process: never read nor written, so it is safe on
    # any stream; cached as the view itself, because indexing a view out costs microseconds a
    # call.
    return torch.empty((1,) * rank, dtype=dtype, device=device)


#: What a kernel gets for an array its switches leave unread (Lse without STORE_LSE, Slopes
#: without ALIBI, Mask without ATTN_MASK, the cumulative lengths without VARLEN, ...): an int
#: scalar, which ``ct.launch`` takes 0.26-0.59 us faster than an array (H200 hosts,
#: 2026-12-04, docs/experiments/evidence/2026-12-04-launch-host-h200.md); ``flash_tile.aot``
#: types those parameters as int32 scalars alike.
ABSENT = 0


def _or_absent(*arrays) -> tuple:
    """The optional arrays, ``ABSENT`` for each None."""
    return tuple(ABSENT if array is None else array for array in arrays)


def _int64_placeholders(device: torch.device, *arrays) -> tuple:
    """The optional arrays that the 64-bit entry points type as 64-bit indexed (Lse and Mask
    of the forward, dLse, Mask and dQacc of the backward), given as (array or ``ABSENT``,
    rank) pairs: an int cannot take that annotation, so a placeholder array of the rank
    (never read nor written) stands for each ``ABSENT``."""
    return tuple(_placeholder(device, rank) if array is ABSENT else array
                 for array, rank in arrays)


def _cu_seqlens(varlen: "Varlen | None") -> tuple:
    """(CuSeqQ, CuSeqK, SeqUsedK) for a launch: the cumulative lengths and the keys used, or
    ``ABSENT`` (the kernels read them only under VARLEN, and SeqUsedK under SEQUSED_K)."""
    if varlen is None:
        return ABSENT, ABSENT, ABSENT
    return _or_absent(varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k)


#: The raw handle of a device's current stream (what torch's generated code reads); absent
#: from CPU builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: Stream objects by (device index, raw handle), for ``current_stream``.
_streams: dict[tuple[int, int], object] = {}
#: A process that meets more streams than this starts the table over.
MAX_STREAMS = 64


def current_stream(device: torch.device):
    """``device``'s current stream as a torch Stream, as ``torch.cuda.current_stream`` returns
    it, made once per raw stream handle: that call builds a new Stream object each time, 4.6
    us of host time on the H200's host against 4.7 us for a whole ``ct.launch`` of two arrays
    (2026-12-04, docs/experiments/evidence/2026-12-04-launch-host-h200.md); the raw handle is
    a C call."""
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, _raw_stream(index))
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= MAX_STREAMS:
            _streams.clear()
        stream = _streams[key] = torch.cuda.current_stream(device)
    return stream


def launch_on(device: torch.device, grid: tuple, kernel, args: tuple, **attributes) -> None:
    """``ct.launch`` on ``device``'s current stream, under a device guard only where another
    device is current (the guard costs ~2 us of host time a launch, a planned call's tenth).
    A grid with no programs (a call with no query rows) launches nothing: CUDA refuses an
    empty grid."""
    if 0 in grid:
        return
    stream = current_stream(device)
    if device.type == "cuda" and device.index == torch.cuda.current_device():
        ct.launch(stream, grid, kernel, args, **attributes)
    else:
        with torch.cuda.device(device):
            ct.launch(stream, grid, kernel, args, **attributes)


#: The forward kernel's arrays, in ``forward_launch``'s order (its arguments' first 15).
FORWARD_ARRAYS = ("q", "k", "v", "out", "lse", "alibi_slopes", "attn_mask", "cu_seqlens_q",
                  "cu_seqlens_k", "sinks", "seqused_k", "q_descale", "k_descale", "v_descale",
                  "block_table")
#: Where those arguments hold the sequences' arrays, which a planned varlen call passes by
#: address, and an FP8 cache's k and v descale factors, which a planned paged call on one
#: passes so too.
SEQUENCE_SLOTS = tuple(FORWARD_ARRAYS.index(name) for name in
                       ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table"))
CACHE_DESCALE_SLOTS = tuple(FORWARD_ARRAYS.index(name) for name in ("k_descale", "v_descale"))


def forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, scale: float, softcap: float,
                   diag_offset: int, window: tuple[int, int], config: TileConfig,
                   dropout: Dropout = NO_DROPOUT, varlen: Varlen | None = None,
                   sinks: torch.Tensor | None = None,
                   descales: tuple | None = None) -> tuple:
    """(grid, kernel, args) of the forward for these arrays: what ``launch_forward`` passes to
    ``ct.launch``. Arguments as ``launch_forward``."""
    batch, heads, q_len, head_dim = q.shape
    fp8 = q.dtype == torch.float8_e4m3fn  # (else the descales are an FP8 cache's, under pages)
    v_head_dim = v.shape[2] if fp8 else v.shape[3]  # FP8: v is V^T
    spec = forward_spec(config, head_dim, v_head_dim, k.shape[2] % config.tile_n == 0, window,
                        softcap > 0.0, alibi_slopes is not None, mask_kind(attn_mask),
                        lse is not None, dropout.p > 0.0, sinks is not None, fp8)
    attn_mask = kernel_mask(attn_mask)
    int64_index = needs_int64_index(q, k, v, out, *(t for t in (lse, attn_mask)
                                                     if t is not None))
    block_table = None if varlen is None else varlen.block_table
    lse, slopes, attn_mask, sinks, q_descale, k_descale, v_descale, block_table = _or_absent(
        lse, alibi_slopes, attn_mask, sinks, *(descales or (None,) * 3), block_table)
    if int64_index:
        lse, attn_mask = _int64_placeholders(q.device, (lse, 3), (attn_mask, 4))
    cu_q, cu_k, used_k = _cu_seqlens(varlen)
    if varlen is None:
        grid = forward_grid(q_len, heads, batch, config)
    else:
        spec = varlen.spec(spec, k.shape[1])  # under a block table k is the pages
        grid = varlen_grid(q_len, config.tile_m, heads, varlen.batch)
    # (In FORWARD_ARRAYS' order.)
    args = (q, k, v, out, lse, slopes, attn_mask, cu_q, cu_k, sinks, used_k, q_descale,
            k_descale, v_descale, block_table, float(scale),
            float(softcap),
            int(diag_offset), int(window[0]), int(window[1]), *dropout.scalars(),
            *spec.constants())
    return grid, hinted_kernel(config, int64_index), args


def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, scale: float, softcap: float,
                   diag_offset: int, window: tuple[int, int], config: TileConfig,
                   dropout: Dropout = NO_DROPOUT, varlen: Varlen | None = None,
                   sinks: torch.Tensor | None = None,
                   descales: tuple | None = None) -> None:
    """Launch the forward on the current stream of ``q``'s device.

    q [B, H, Lq, D], k [B, H_kv, Lk, D], v [B, H_kv, Lk, Dv] with H a multiple of H_kv;
    out [B, H, Lq, Dv] in q's dtype; lse [B, H, Lq] fp32 or None; alibi_slopes [B, H] fp32 or
    None; attn_mask [B, H, Lq, Lk] bool (True = attend) or additive float, stride-0 broadcast
    dims allowed, or None. Any strides with a unit last stride for q, k, v, out. softcap 0
    means none. Row i sees key j iff i + diag_offset - left <= j <= i + diag_offset + right
    for window = (left, right), -1 leaving that side unbounded (causal: right = 0).
    ``dropout`` (p > 0) drops attention probabilities after the softmax (the LSE is unchanged).
    With ``varlen`` the arrays are packed sequences: q [1, H, total_q, D], k and v
    [1, H_kv, total_k, D / Dv], out [1, H, total_q, Dv], lse [1, H, total_q], alibi_slopes
    [B, H] per sequence; each sequence's band is aligned bottom-right (``diag_offset`` is not
    read) and attn_mask must be None; with ``varlen.block_table`` k and v are instead its
    pages as flash-attn stores them, [num_blocks, page_size, H_kv, D / Dv], in q's dtype or
    float8_e4m3fn (an FP8 cache: ``descales`` then (None, k's, v's factors)). ``sinks`` [H]
    fp32 (or None) is each head's sink logit, which joins every row's softmax without a
    value; the LSE then includes it. With ``descales`` (the q, k and v descale factors, fp32
    [B, H_kv] each, per batch, or sequence, and key/value head; stride-0 views for one
    factor a tensor) and float8_e4m3fn q the FP8 forward: k float8_e4m3fn, v as V^T
    [B, H_kv, Dv, Lk] in float8_e4m3fn (keys contiguous: the layout the e4m3 tensor-core
    matmul reads; packed [1, H_kv, Dv, total_k] under ``varlen``), out bfloat16.
    """
    grid, kernel, args = forward_launch(q, k, v, out, lse, alibi_slopes, attn_mask, scale,
                                        softcap, diag_offset, window, config, dropout, varlen,
                                        sinks, descales)
    launch_on(q.device, grid, kernel, args)


def launch_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor, dlse: torch.Tensor | None,
                    alibi_slopes: torch.Tensor | None, attn_mask: torch.Tensor | None,
                    scale: float, softcap: float, diag_offset: int, window: tuple[int, int],
                    config: TileConfig, dropout: Dropout = NO_DROPOUT,
                    varlen: Varlen | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Launch the backward on the current stream of ``q``'s device.

    Inputs as ``launch_forward``, plus the forward's ``out`` and ``lse`` (natural log) and the
    output gradient ``dout`` [B, H, Lq, Dv] and, when the caller differentiates through the
    LSE, its gradient ``dlse`` [B, H, Lq] fp32 (else None), and the forward's ``dropout``;
    writes dq (q's shape), dk and dv (k's and v's shapes) in the inputs' dtype. Where an
    offset into any of those arrays (or the mask, or the one pass's dQ sums) reaches 2**31,
    the kernels' 64-bit entry points run (``needs_int64_index``). Two forms (``config.one_pass``):
      - two passes, deterministic (no atomics): the dQ kernel on ``config.dq_kernel()``'s
        tiles, which also stores Delta = rowsum(dO * O) - dLSE, then dK/dV on ``config``'s;
      - one pass: a memset of an fp32 dQ accumulator (``dq_accumulator``), a preprocess
        kernel (Delta), dK/dV on ``config``'s tiles adding dQ into the accumulator,
        and a convert kernel writing dq; dq's last bits depend on the order of the adds.
    With ``varlen`` the arrays are packed as ``launch_forward``'s (dlse [1, H, total_q]).
    With ``sinks`` (the forward's) returns their gradient [H] fp32: per-tile shares of the
    kernel that forms Delta, summed here in a fixed order (deterministic); else None.
    """
    dq_acc = dq_accumulator(q) if config.one_pass else None
    arrays = (dout, q, k, v, out, dq, dk, dv, *(() if attn_mask is None else (attn_mask,)),
              *(() if dq_acc is None else (dq_acc,)))
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    delta = delta_workspace(batch, heads, q_len, q.device)
    dq_config = config.dq_kernel()
    spec, dq_spec = (forward_spec(c, head_dim, v.shape[3], k_len % c.tile_n == 0, window,
                                  softcap > 0.0, alibi_slopes is not None,
                                  mask_kind(attn_mask), True, dropout.p > 0.0,
                                  sinks is not None)
                     for c in (config, dq_config))
    if varlen is None:
        q_grid = forward_grid(q_len, heads, batch, dq_config)
        dkdv_grid = (ct.cdiv(k_len, config.tile_n), kv_heads, batch)
    else:
        spec, dq_spec = varlen.spec(spec), varlen.spec(dq_spec)
        q_grid = varlen_grid(q_len, dq_config.tile_m, heads, varlen.batch)
        dkdv_grid = varlen_grid(k_len, config.tile_n, kv_heads, varlen.batch)
    dlse_arg, slopes, attn_mask = _or_absent(dlse, alibi_slopes, kernel_mask(attn_mask))
    cu_q, cu_k, used_k = _cu_seqlens(varlen)
    dsinks = None
    if sinks is not None:
        # One share a program of the Delta-forming grid (packed: batch 1, the flattened grid).
        (dsinks,) = sinks_workspace((batch, heads, q_grid[0]), varlen is not None, q.device)
    sinks_arg, dsinks_arg, dq_acc_arg = _or_absent(sinks, dsinks, dq_acc)
    int64_index = needs_int64_index(*arrays)
    if int64_index:
        dlse_arg, attn_mask, dq_acc_arg = _int64_placeholders(
            q.device, (dlse_arg, 3), (attn_mask, 4), (dq_acc_arg, 4))
    scalars = (float(scale), float(softcap), int(diag_offset), int(window[0]), int(window[1]),
               *dropout.scalars())
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, dq_acc_arg, slopes, attn_mask, cu_q, cu_k,
                 used_k, *scalars,
                 *spec.dkdv_constants(heads // kv_heads, config.group_inner, config.one_pass))
    kernels = hinted_backward_kernels(config, int64_index)
    if config.one_pass:
        preprocess, dkdv, convert = kernels
        launch_on(q.device, q_grid, preprocess,
                  (out, dout, lse, dlse_arg, delta, cu_q, sinks_arg, dsinks_arg,
                   *dq_spec.preprocess_constants(dlse is not None)))
        launch_on(q.device, dkdv_grid, dkdv, dkdv_args)
        launch_on(q.device, q_grid, convert,
                  (dq_acc, dq, cu_q, float(scale), *dq_spec.convert_constants()))
    else:
        dq_kernel, dkdv = kernels
        launch_on(q.device, q_grid, dq_kernel,
                  (q, k, v, out, dout, lse, dlse_arg, delta, dq, slopes, attn_mask, cu_q, cu_k,
                   sinks_arg, dsinks_arg, used_k, *scalars,
                   *dq_spec.dq_constants(dlse is not None)))
        launch_on(q.device, dkdv_grid, dkdv, dkdv_args)
    return None if dsinks is None else dsinks.sum((0, 2))


def sinks_workspace(shape: tuple[int, int, int], varlen: bool,
                    device: torch.device) -> tuple[torch.Tensor]:
    """The shares of the sinks' gradient that the kernel forming Delta stores (the dQ kernel,
    or the one pass's preprocess), fp32 [B, H, query tiles]: every program
    stores its share, or under VARLEN [1, H, programs], where the flattened grid's idle
    programs store nothing, so there it starts as zeros (a memset launch) and elsewhere
    uninitialised."""
    return ((torch.zeros if varlen else torch.empty)(shape, dtype=torch.float32, device=device),)
