"""The FP8 forward as torch custom ops (dense and varlen), with fake kernels: the FP8 switch
of the forward kernel (``kernels/attention_fwd.py``) behind ``flash_attn_func`` and
``flash_attn_varlen_func`` when q, k and v are ``float8_e4m3fn``.

Forward only: no autograd is registered (the public functions raise before launching when a
gradient is asked for, as FA3 does). The variant is the architecture's FP8 default for the
head dim, the mask's diagonal and, for a dense call, the key length, never tuned
(``variants.fp8_config``). ``q_descale``, ``k_descale``, ``v_descale`` are the fp32
[B, H_kv] views of the descale factors (``_validate.fp8_descales``), read in place; the output
is bfloat16 in flash-attn's layout, the LSE fp32 as the bf16 ops'.
"""

import torch

from flash_tile import variants
from flash_tile._launch import Varlen, keys_major, launch_forward
from flash_tile import _ops
from flash_tile._ops import _packed, op_or_body
from flash_tile._validate import device_properties

OUT_DTYPE = torch.bfloat16


def _config(q: torch.Tensor, v: torch.Tensor, window_right: int,
            key_len: int | None = None) -> variants.TileConfig:
    return variants.fp8_config(device_properties(q.device)[0], max(q.shape[-1], v.shape[-1]),
                               causal=window_right >= 0, key_len=key_len)


def _fp8_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_descale: torch.Tensor, k_descale: torch.Tensor,
                      v_descale: torch.Tensor, alibi_slopes: torch.Tensor | None, scale: float,
                      softcap: float, diag_offset: int, window_left: int, window_right: int,
                      return_lse: bool, sinks: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: q [B, H, Lq, D], k [B, H_kv, Lk, D] e4m3 views with a unit last stride,
    v [B, H_kv, Lk, Dv] e4m3 of any strides: two launches, the keys-major copy of v
    (``keys_major``) and the forward."""
    return fp8_forward(q, k, keys_major(v), (q_descale, k_descale, v_descale), alibi_slopes,
                       scale, softcap, diag_offset, (window_left, window_right), return_lse,
                       _config(q, v, window_right, k.shape[2]), sinks)


def fp8_forward(q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, descales: tuple,
                alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                diag_offset: int, window: tuple[int, int], return_lse: bool, config,
                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the FP8 forward on V^T made already (``keys_major``: v_t [B, H_kv, Dv,
    Lk]) and the (q, k, v) ``descales`` with the tile ``config``: fresh outputs and one launch
    (the op's body, and the benchmarks that time the kernel alone)."""
    out, lse = _ops._forward_outputs(q, v_t.transpose(2, 3), return_lse, OUT_DTYPE)
    launch_forward(q, k, v_t, out, lse if return_lse else None, alibi_slopes, None, scale,
                   softcap, diag_offset, window, config, sinks=sinks, descales=descales)
    return out, lse


fp8_forward_op = torch.library.custom_op("flash_tile::fp8_forward", _fp8_forward_impl,
                                         mutates_args=(), device_types="cuda")


@fp8_forward_op.register_fake
def _fp8_forward_fake(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, scale, softcap,
                      diag_offset, window_left, window_right, return_lse, sinks=None):
    return _ops._forward_outputs(q, v, return_lse, OUT_DTYPE)


def fp8_attention(*args):
    """(out, lse) of the FP8 forward, arguments as the ``flash_tile::fp8_forward`` op's: the
    op where something traces the call, else its body."""
    return op_or_body(fp8_forward_op, _fp8_forward_impl, args)


def _fp8_varlen_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     q_descale: torch.Tensor, k_descale: torch.Tensor,
                     v_descale: torch.Tensor, alibi_slopes: torch.Tensor | None, scale: float,
                     softcap: float, window_left: int, window_right: int, return_lse: bool,
                     sinks: torch.Tensor | None = None,
                     seqused_k: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen op's body: packed q [total_q, H, D], k [total_k, H_kv, D], v [total_k,
    H_kv, Dv] e4m3; the descales [B, H_kv] per sequence."""
    out, lse = _ops._varlen_outputs(q, v, return_lse, OUT_DTYPE)
    q4, k4, v4, out4 = _packed(q, k, v, out)
    launch_forward(q4, k4, keys_major(v4), out4, lse[None] if return_lse else None,
                   alibi_slopes, None, scale, softcap, 0, (window_left, window_right),
                   _config(q, v, window_right),
                   varlen=Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k),
                   sinks=sinks, descales=(q_descale, k_descale, v_descale))
    return out, lse


fp8_varlen_op = torch.library.custom_op("flash_tile::fp8_varlen_forward", _fp8_varlen_impl,
                                        mutates_args=(), device_types="cuda")


@fp8_varlen_op.register_fake
def _fp8_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
                     alibi_slopes, scale, softcap, window_left, window_right, return_lse,
                     sinks=None, seqused_k=None):
    return _ops._varlen_outputs(q, v, return_lse, OUT_DTYPE)


def fp8_varlen_attention(*args):
    """(out, lse) of the FP8 varlen forward, arguments as the ``flash_tile::fp8_varlen_forward``
    op's, dispatched as ``fp8_attention``."""
    return op_or_body(fp8_varlen_op, _fp8_varlen_impl, args)
