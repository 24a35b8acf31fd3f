"""The forward as a torch custom op, so that torch.compile and fake tensors see one opaque call.

The op takes [B, H, L, D] views (any strides with a unit last stride) and returns the output
as [B, H, Lq, D] whose memory is laid out as [B, Lq, H, D] (flash-attn's layout, and what
torch's own flash backend returns), plus the LSE [B, H, Lq] fp32 when asked (else an empty
tensor). The variant is the default of the device's architecture (``flash_tile.variants``).
"""

import torch

from flash_tile import variants
from flash_tile._validate import device_properties
from flash_tile._launch import launch_forward


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
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool, causal_offset: int,
                      return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _empty_outputs(q, v, return_lse)
    config = variants.default_config(device_properties(q.device)[0])
    launch_forward(q, k, v, out, lse if return_lse else None, scale, causal, causal_offset,
                   config)
    return out, lse


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, scale, causal, causal_offset, return_lse):
    return _empty_outputs(q, v, return_lse)
