"""Host-side helpers of the FP8 forward: quantize to float8_e4m3fn with the descale factors
``flash_attn_func`` takes, and a Hadamard rotation of q and k (incoherent processing).

    q8, q_descale = quantize_fp8(q, per="head", kv_heads=k.shape[2])
    k8, k_descale = quantize_fp8(k)
    v8, v_descale = quantize_fp8(v)
    out = flash_attn_func(q8, k8, v8, causal=True, q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale)   # bfloat16

Outliers make FP8's per-head scale coarse for every other element; rotating q and k by the
same orthonormal Hadamard matrix H (D x D) spreads an outlier over the whole head dim and
leaves the scores unchanged, (q H)(k H)^T = q k^T, since H H^T = I (FA3's incoherent
processing). ``hadamard_rotate`` does it in torch before quantizing.
"""

import math

import torch

from flash_tile._validate import FP8_DTYPE

#: The largest finite float8_e4m3fn.
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


@torch.no_grad()  # the rounding has no gradient; an FP8 call refuses inputs that need one
def quantize_fp8(x: torch.Tensor, per: str = "head", kv_heads: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale): x [B, L, H, D] (float16, bfloat16 or float32) as float8_e4m3fn with
    x ~= x8 * descale, each scale group's largest magnitude mapped to e4m3's largest finite
    value (448).

    ``per="head"``: one factor per (batch, head), descale float32 [B, H], the shape
    ``flash_attn_func``'s descale arguments take for k and v. For q under GQA/MQA pass
    ``kv_heads`` (the key/value heads): then each group of H / kv_heads query heads shares
    one factor, descale [B, kv_heads], as q_descale must be. ``per="tensor"``: one factor,
    a 0-d float32 descale (``kv_heads`` raises there). A group of zeros gets a factor of 1,
    one of magnitudes too small for a normal float32 factor the smallest normal one (its
    values then round to 0, as they would anyway), so that every factor is positive, as the
    kernels need. A group holding an inf or NaN gets a factor of inf or NaN, which reaches
    the output (nothing is hidden). Neither x8 nor descale requires grad.
    """
    if x.dim() != 4 or not x.is_floating_point() or x.dtype in (FP8_DTYPE, torch.float64):
        raise ValueError("quantize_fp8 takes a [batch, seqlen, heads, head_dim] float16, "
                         f"bfloat16 or float32 tensor, got {x.dtype} of shape "
                         f"{tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8 needs elements to scale, got shape {tuple(x.shape)}")
    batch, length, heads, dim = x.shape
    if per == "tensor":
        if kv_heads is not None:
            raise ValueError("kv_heads groups heads for per=\"head\"; per=\"tensor\" has one "
                             "factor for all of them")
        amax = x.abs().amax().float()
    elif per == "head":
        groups = heads if kv_heads is None else kv_heads
        if groups < 1 or heads % groups:
            raise ValueError(f"kv_heads must divide the {heads} heads, got {kv_heads}")
        grouped = x.reshape(batch, length, groups, heads // groups, dim)
        amax = grouped.abs().amax(dim=(1, 3, 4)).float()  # [B, groups]
    else:
        raise ValueError(f'per must be "head" or "tensor", got {per!r}')
    descale = torch.where(amax == 0, 1.0, (amax / E4M3_MAX).clamp_min(
        torch.finfo(torch.float32).tiny))
    if per == "tensor":
        scale = descale
    else:  # each head's factor, [B, 1, H, 1]
        scale = descale.repeat_interleave(heads // descale.shape[1], dim=1)[:, None, :, None]
    x8 = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return x8, descale


def hadamard_matrix(dim: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order ``dim`` (a power of two): Sylvester's
    construction scaled by 1 / sqrt(dim), symmetric, H H^T = I."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard matrix here needs a power-of-two order, got {dim}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(dtype=dtype, device=device)


def hadamard_rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q H, k H) over the last (head) dim, H = ``hadamard_matrix(D)``, in fp32 and returned
    in the inputs' dtypes: the scores q k^T are unchanged (up to that rounding), while an
    outlier coordinate is spread over all D, so per-head FP8 scales lose less (FA3's
    incoherent processing). Rotate before ``quantize_fp8``; v is not rotated."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and "
                         f"{k.shape[-1]}")
    h = hadamard_matrix(q.shape[-1], torch.float32, q.device)
    return (q.float() @ h).to(q.dtype), (k.float() @ h.to(k.device)).to(k.dtype)
