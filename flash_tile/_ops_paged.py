"""The varlen forward against paged keys as a torch custom op, with its fake kernel: the PAGED
switch of the forward kernel (``kernels/attention_fwd.py``) behind
``flash_attn_varlen_func(..., block_table=...)``, packed queries of any lengths against the
pages of a KV cache (vLLM's prefill and mixed prefill/decode batches), in q's dtype or an
FP8 cache's float8_e4m3fn.

Forward only, as flash-attn's paged varlen path: no autograd is registered (the public
function raises before launching when a gradient is asked for). The variant is the
architecture's paged forward tile for the head dim (``variants.paged_config``: the default
one where it compiles without spills), never tuned: the autotuner's timing runs would need
pages of their own. K and V are passed as
flash-attn stores them, [num_blocks, page_size, H_kv, D]; q and the output are the packed
[total_q, H, D] tensors' [1, H, total_q, D] views, as the unpaged varlen forward's.

A prefill-like call (``copies``) instead copies its pages into packed rows (the ``unpage``
kernel, the ``flash_tile::unpage`` op) and runs the packed varlen forward on them: the same
output, bit for bit (the VARLEN and PAGED switches differ in where keys are read from, not
in arithmetic).
"""

import torch

from flash_tile import _ops, variants
from flash_tile._launch import MIN_PAGE_LOAD, Varlen, launch_on, needs_int64_index
from flash_tile._ops import op_or_body
from flash_tile._validate import device_properties, kv_descales
from flash_tile.kernels.attention_fwd import UNPAGE_REACH, unpage, unpage_int64

#: A paged call copies its pages (``copies``) when its sequences have on average at least
#: this many queries each: below it the copy's extra pass over the keys costs more than
#: the paged reads it saves. (H100, 2026-12-07: see docs/experiments, paged copy.)
COPY_MIN_QUERIES = 128
#: ... and when the packed rows take at most this many bytes (B * max_seqlen_k rows of K and
#: V), so that a long cache's copy never claims more than a fraction of a GPU's memory.
COPY_MAX_BYTES = 1 << 30
#: Elements of K's or V's tile a program of ``unpage`` copies: 64 keys at D <= 128, 32 at
#: D = 256. 128 keys at D = 128 spilled on sm_80 (12-48 LDL/STL), 64 at D = 256 on sm_8x
#: (18); these none on sm_80-sm_120 (tileiras 13.4, 2026-12-07).
UNPAGE_TILE = 64 * 128


def _paged_varlen_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor | None, seqused_k: torch.Tensor | None,
                       alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                       window_left: int, window_right: int, return_lse: bool,
                       sinks: torch.Tensor | None = None,
                       k_descale: torch.Tensor | None = None,
                       v_descale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: q [total_q, H, D] with a unit last stride, k [num_blocks, page_size,
    H_kv, D] and v [.., Dv] pages with unit last strides, block_table int32 [B, max_blocks];
    sequence b's key count cu_seqlens_k[b + 1] - cu_seqlens_k[b], or seqused_k[b] where
    given. Pages of float8_e4m3fn (an FP8 cache, q float16 or bfloat16) take their
    ``k_descale`` and ``v_descale``, fp32 [B, H_kv] or one element each, None for 1
    (``_validate.kv_descales``; the kernel reads both). No query rows or no pages: nothing to
    launch, the rows as ones that see no key."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _ops._keyless_forward(*_ops._varlen_outputs(q, v, return_lse), return_lse,
                                     sinks, 0)
    config = paged_tile(q, v)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    descales = None
    if k.dtype == torch.float8_e4m3fn:
        descales = (None, *kv_descales(k_descale, v_descale, varlen.batch, k.shape[2],
                                       q.device))
    return _ops.varlen_forward_runner(q, k, v, varlen, alibi_slopes, scale, softcap,
                                      (window_left, window_right), return_lse, sinks=sinks,
                                      descales=descales)(config)


def paged_tile(q: torch.Tensor, v: torch.Tensor) -> variants.TileConfig:
    """The paged forward's variant for q's device and the head dims of q and v."""
    return variants.paged_config(device_properties(q.device)[0],
                                 max(q.shape[-1], v.shape[-1]))


paged_varlen_op = torch.library.custom_op("flash_tile::paged_varlen_forward",
                                          _paged_varlen_impl, mutates_args=(),
                                          device_types="cuda")


@paged_varlen_op.register_fake
def _paged_varlen_fake(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k,
                       alibi_slopes, scale, softcap, window_left, window_right, return_lse,
                       sinks=None, k_descale=None, v_descale=None):
    return _ops._varlen_outputs(q, v, return_lse)


def paged_varlen_attention(*args):
    """(out, lse) of the paged varlen forward, arguments as the
    ``flash_tile::paged_varlen_forward`` op's: the op where something traces the call, else
    its body."""
    return op_or_body(paged_varlen_op, _paged_varlen_impl, args)


def copies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
           max_seqlen_k) -> bool:
    """Whether a paged varlen call on pages in q's dtype copies its pages into packed rows
    first (``unpaged``): q's rows at least ``COPY_MIN_QUERIES`` a sequence on average, and the
    rows within ``COPY_MAX_BYTES``. Host integers only; arguments that are not yet checked
    (this runs before the call's checks) answer False."""
    if (k.dtype != q.dtype or q.dim() != 3 or k.dim() != 4 or v.dim() != 4
            or block_table.dim() != 2 or type(max_seqlen_k) is not int or max_seqlen_k < 1):
        return False
    batch = block_table.shape[0]
    rows = batch * row_stride(max_seqlen_k)
    size = rows * k.shape[2] * (k.shape[3] + v.shape[3]) * k.element_size()
    return 0 < batch * COPY_MIN_QUERIES <= q.shape[0] and size <= COPY_MAX_BYTES


def row_stride(max_seqlen_k: int) -> int:
    """The packed rows of a sequence in the copy: max_seqlen_k rounded up to
    ``UNPAGE_REACH`` (the widest key tile), so that no key tile reads another's rows."""
    return -(-max_seqlen_k // UNPAGE_REACH) * UNPAGE_REACH


def unpage_tiles(page_size: int, head_dim: int) -> tuple[int, int, bool]:
    """(TILE_N, PAGE_N, GATHER) of the copy on pages of ``page_size`` for the larger head dim
    of K and V, as the PAGED forward reads pages (``_launch.paged_spec``): tiles of
    ``UNPAGE_TILE`` elements, joined from loads of the largest power of two that divides the
    page size, or gathered by row where that is below ``MIN_PAGE_LOAD``."""
    tile_n = min(UNPAGE_TILE // variants.tile_width(head_dim), UNPAGE_REACH)  # (which it
    # divides, as it does each sequence's rows)
    page_n = min(page_size & -page_size, tile_n)
    gather = page_n < MIN_PAGE_LOAD
    return tile_n, 0 if gather else page_n, gather


def unpage_workspace(k: torch.Tensor, v: torch.Tensor, batch: int, max_seqlen_k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The copy's outputs: k_rows [B * row_stride, H_kv, D], v_rows [.., Dv], cu_rows int32
    [B + 1], used int32 [B]."""
    rows = batch * row_stride(max_seqlen_k)
    return (k.new_empty(rows, k.shape[2], k.shape[3]), v.new_empty(rows, v.shape[2], v.shape[3]),
            torch.empty(batch + 1, dtype=torch.int32, device=k.device),
            torch.empty(batch, dtype=torch.int32, device=k.device))


def _unpage_impl(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 cu_seqlens_k: torch.Tensor | None, seqused_k: torch.Tensor | None,
                 max_seqlen_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body: the keys and values of sequence b (its key count cu_seqlens_k[b + 1] -
    cu_seqlens_k[b], or seqused_k[b] where given, clipped at max_seqlen_k) from the pages k
    [num_blocks, page_size, H_kv, D] and v [.., Dv] that block_table [B, max_blocks] names,
    copied to rows b * S .. of k_rows [B * S, H_kv, D] and v_rows [.., Dv], S =
    ``row_stride(max_seqlen_k)``, zeros after them up to a multiple of ``UNPAGE_REACH`` rows.
    Returns (k_rows, v_rows, cu_rows, used): cu_rows int32 [B + 1] = b * S and used int32 [B]
    the key counts, the packed call's cu_seqlens_k and seqused_k."""
    batch, (_, page_size, heads_k, dim), dim_v = block_table.shape[0], k.shape, v.shape[3]
    k_rows, v_rows, cu_rows, used = unpage_workspace(k, v, batch, max_seqlen_k)
    tile_n, page_n, gather = unpage_tiles(page_size, max(dim, dim_v))
    views = [t.permute(1, 0, 2).unsqueeze(0) for t in (k_rows, v_rows)]  # [1, H_kv, rows, D]
    kernel = unpage_int64 if needs_int64_index(k, v, k_rows, v_rows) else unpage
    stride = row_stride(max_seqlen_k)
    launch_on(k.device, (stride // tile_n, heads_k, batch), kernel,
              (k, v, block_table, 0 if cu_seqlens_k is None else cu_seqlens_k,
               0 if seqused_k is None else seqused_k, *views, cu_rows, used, max_seqlen_k,
               stride, tile_n, variants.tile_width(dim), variants.tile_width(dim_v), page_n,
               gather, seqused_k is not None))
    return k_rows, v_rows, cu_rows, used


unpage_op = torch.library.custom_op("flash_tile::unpage", _unpage_impl, mutates_args=(),
                                    device_types="cuda")


@unpage_op.register_fake
def _unpage_fake(k, v, block_table, cu_seqlens_k, seqused_k, max_seqlen_k):
    return unpage_workspace(k, v, block_table.shape[0], max_seqlen_k)


def unpaged(*args):
    """(k_rows, v_rows, cu_rows, used) of ``flash_tile::unpage``, arguments as the op's: the
    op where something traces the call, else its body."""
    return op_or_body(unpage_op, _unpage_impl, args)
