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
"""

import torch

from flash_tile import _ops, variants
from flash_tile._launch import Varlen
from flash_tile._ops import op_or_body
from flash_tile._validate import device_properties, kv_descales


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
