"""The KV-cache decode (``flash_attn_with_kvcache``) as a torch custom op,
``flash_tile::kvcache_attention``, with its fake kernel: forward only, and declared to mutate
the caches it appends to. As for the other ops, a traced call (torch.compile, export, a
dispatch mode) runs the op and plain eager mode its body (``_ops.op_or_body``); a repeated
eager call of a seen signature skips both and runs its plan (``flash_tile._plans``), which
calls ``append_to_cache`` and the decode plan's launch itself.
"""

import torch

from flash_tile import decode_variants
from flash_tile._launch_decode import (Rotary, launch_cache_append, launch_decode,
                                        rotated_q_workspace)
from flash_tile._ops import op_or_body
from flash_tile._validate import device_properties


def _decode_outputs(q: torch.Tensor, v_head_dim: int, return_lse: bool,
                    op_outputs: bool = True):
    """(out [B, Lq, H, Dv] in q's dtype, lse [B, H, Lq] fp32); without ``return_lse`` the
    lse is an empty tensor where it is one of the op's outputs (``op_outputs``), else None
    (a planned call allocates nothing for it)."""
    batch, q_len, heads, _ = q.shape
    # (q's dtype and device: ``new_empty`` takes 1.9 us of a CPU host's time where
    # ``torch.empty`` with them as keywords takes 2.4, 2026-12-07)
    out = q.new_empty((batch, q_len, heads, v_head_dim))
    if not return_lse and not op_outputs:
        return out, None
    lse_shape = (batch, heads, q_len) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def append_to_cache(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                    cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                    rotary_interleaved: bool, rotary_q_step: int,
                    kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
                    int64_index: bool | None = None, launch=None) -> torch.Tensor:
    """The KV-cache call's append: k/v (when given) into the caches at cache_seqlens, rotated
    under rotary_cos/sin, q rotated with them, quantized by ``kv_descale`` into FP8 caches;
    returns the q to attend with. ``int64_index`` as ``launch_cache_append``'s; ``launch``
    the launcher of its arguments (a planned call's ``_plans.AddressedDecode.append``),
    ``launch_cache_append`` by default."""
    if k is None and rotary_cos is None:
        return q
    rotary = q_rot = None
    if rotary_cos is not None:
        rotary = Rotary(rotary_cos, rotary_sin, rotary_interleaved, rotary_q_step)
        q_rot = rotated_q_workspace(q)
    (launch or launch_cache_append)(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                                    block_table, q, q_rot, rotary, kv_descale, int64_index)
    return q if q_rot is None else q_rot


def decode_config(q: torch.Tensor, v_cache: torch.Tensor) -> decode_variants.DecodeConfig:
    """The decode's tiles for q's device and the wider of the two head dims."""
    return decode_variants.default_decode_config(device_properties(q.device)[0],
                                                 max(q.shape[-1], v_cache.shape[-1]))


def _kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k: torch.Tensor | None, v: torch.Tensor | None, cache_seqlens: torch.Tensor,
                  cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                  window_left: int, window_right: int, num_splits: int,
                  return_lse: bool, sinks: torch.Tensor | None = None,
                  cache_leftpad: torch.Tensor | None = None,
                  rotary_cos: torch.Tensor | None = None,
                  rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                  rotary_q_step: int = 0, k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV-cache op's body: append k/v (when given, rotated with q under rotary_cos/sin)
    into the caches at cache_seqlens, then attend (``flash_tile.kvcache
    .flash_attn_with_kvcache`` checked every argument); k_descale and v_descale [B, H_kv]
    fp32 are given with FP8 caches only, attn_mask [B, 1, Lq, L] as the kernel takes it."""
    out, lse = _decode_outputs(q, v_cache.shape[-1], return_lse)
    new_len = 0 if k is None else k.shape[1]
    kv_descale = None if k_descale is None else (k_descale, v_descale)
    q = append_to_cache(q, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                        block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_q_step,
                        kv_descale)
    launch_decode(q, k_cache, v_cache, out, lse if return_lse else None, cache_seqlens,
                  cache_batch_idx, block_table, alibi_slopes, scale, softcap,
                  (window_left, window_right), new_len, num_splits, decode_config(q, v_cache),
                  sinks, cache_leftpad, kv_descale, attn_mask)
    return out, lse


kvcache_op = torch.library.custom_op("flash_tile::kvcache_attention", _kvcache_impl,
                                     mutates_args=("k_cache", "v_cache"), device_types="cuda")


@kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                  alibi_slopes, scale, softcap, window_left, window_right, num_splits,
                  return_lse, sinks=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                  rotary_interleaved=True, rotary_q_step=0, k_descale=None, v_descale=None,
                  attn_mask=None):
    return _decode_outputs(q, v_cache.shape[-1], return_lse)


def kvcache_attention(*args):
    """(out, lse) of ``flash_attn_with_kvcache``, arguments as the
    ``flash_tile::kvcache_attention`` op's: the op where something traces the call (a graph
    needs it and its fake, which declares the caches mutated by the append), else its body."""
    return op_or_body(kvcache_op, _kvcache_impl, args)
