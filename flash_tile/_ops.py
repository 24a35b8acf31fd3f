"""The forward as a torch custom op, so that torch.compile and fake tensors see one opaque call.

The op takes [B, H, L, D] views (any strides with a unit last stride; K/V may have fewer heads,
GQA) and returns the output as [B, H, Lq, Dv] whose memory is laid out as [B, Lq, H, Dv]
(flash-attn's layout, and what torch's own flash backend returns), plus the LSE [B, H, Lq] fp32
when asked (else an empty tensor). The variant is the default of the device's architecture and
head dim (``flash_tile.variants``).
"""

import torch

from flash_tile import variants
from flash_tile._launch import launch_forward
from flash_tile._validate import device_properties


def _empty_outputs(q: torch.Tensor, v: torch.Tensor, return_lse: bool):
    batch, heads, q_len, _ = q.shape
    v_dim = v.shape[-1]
    out = torch.empty_strided((batch, heads, q_len, v_dim),
                              (q_len * heads * v_dim, v_dim, heads * v_dim, 1),
                              dtype=q.dtype, device=q.device)
    lse_shape = (batch, heads, q_len) if return_lse else (0,)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("flash_tile::attention_forward", mutates_args=(), device_types="cuda")
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      alibi_slopes: torch.Tensor | None, attn_mask: torch.Tensor | None,
                      scale: float, softcap: float, diag_offset: int, window_left: int,
                      window_right: int, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _empty_outputs(q, v, return_lse)
    head_dim = max(q.shape[-1], v.shape[-1])
    config = variants.default_config(device_properties(q.device)[0], head_dim)
    launch_forward(q, k, v, out, lse if return_lse else None, alibi_slopes, attn_mask, scale,
                   softcap, diag_offset, (window_left, window_right), config)
    return out, lse


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset,
                            window_left, window_right, return_lse):
    return _empty_outputs(q, v, return_lse)
