"""``flash_attn_varlen_func``: attention over packed sequences of different lengths, the
forward's VARLEN switch (``kernels/attention_fwd.py``).

Not exported from ``flash_tile`` yet: the kernel switch and this entry point are CPU-tested
(the float64 twin, ahead-of-time compiles whose sm_90 SASS keeps the forward's TMA loads and
wgmma) but have not run on a GPU, and the backward has no VARLEN switch yet. Until both land,
a call that needs a gradient, dropout or ``seqused_k`` raises NotImplementedError.
"""

import math

import torch

from flash_tile import _validate, variants
from flash_tile._launch import Varlen, launch_forward


def _check_cu_seqlens(cu: torch.Tensor, name: str, total: int, batch: int,
                      device: torch.device) -> None:
    """int32 [B + 1] on q's device, of the same B for q and k; the values (monotone, from 0 to
    the total) are not read: that would sync."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1], got "
                         f"{getattr(cu, 'shape', type(cu).__name__)}")
    _validate.check_index_tensor(cu, name, (batch + 1,), device)
    if total >= 2**31:
        raise NotImplementedError(f"{total} packed rows: 2**31 or more is not supported")


def _outputs(q: torch.Tensor, v: torch.Tensor, return_lse: bool):
    """(out [total_q, H, Dv] in q's dtype, lse [H, total_q] fp32 or None), uninitialised."""
    out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device) \
        if return_lse else None
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, seqused_k=None,
                           return_lse=False):
    """Attention over packed sequences, flash-attn 2.8's ``flash_attn_varlen_func`` (forward).

    Args:
        q: [total_q, H, D] float16 or bfloat16 CUDA tensor, the sequences' queries one after
            another; k: [total_k, H_kv, D] and v: [total_k, H_kv, Dv] likewise (GQA: H a
            multiple of H_kv). Unit last stride.
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on q's device: sequence b is rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (and likewise of k, v). Equal
            consecutive offsets are a sequence of length 0.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (ints >= 1, from the
            caller, as flash-attn: nothing is read back from the device). A sequence longer
            than max_seqlen_q keeps its first rows unwritten (the grid covers max_seqlen_q
            rows, counted from each sequence's last).
        causal, window_size: aligned bottom-right per sequence, as flash-attn: row i of a
            sequence with q_len queries and k_len keys sees key j iff
            i + k_len - q_len - left <= j <= i + k_len - q_len + right (causal: right = 0).
        softmax_scale, softcap, alibi_slopes ([H] or [B, H] fp32): as ``flash_attn_func``.
        dropout_p, seqused_k, gradients: not supported yet (NotImplementedError).

    Returns:
        out [total_q, H, Dv] in q's dtype; with ``return_lse`` (out, lse [H, total_q] fp32,
        natural log, +inf for rows that see no key).

    Not checked (it would need a device sync): that the offsets are monotone, start at 0 and
    end at total_q / total_k. Offsets past the ends read padding or other sequences' rows.
    """
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs: attention probabilities are not "
                                  "returned; use return_lse=True for the log-sum-exp")
    if seqused_k is not None:
        raise NotImplementedError("seqused_k is not supported yet")
    if _validate.check_dropout(dropout_p) > 0.0:
        raise NotImplementedError("dropout under varlen is not supported yet")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [total, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    _validate.check_dtypes(q, k, v)
    _validate.check_lengths(k.shape[0], v.shape[0])
    _validate.check_heads(q.shape[1], k.shape[1], v.shape[1])
    _validate.check_head_dims(q.shape[2], k.shape[2], v.shape[2])
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    scale = _validate.check_scale(softmax_scale if softmax_scale is not None
                                  else 1.0 / math.sqrt(q.shape[2]))
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0
    softcap = _validate.check_softcap(softcap)
    device = _validate.check_device(q, k, v)
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else 0
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], batch, device)
    _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], batch, device)
    if alibi_slopes is not None:
        alibi_slopes = _validate.check_alibi_slopes(alibi_slopes, batch, q.shape[1])
        _validate.check_device(q, alibi_slopes)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("the varlen backward is not written yet: call under "
                                  "torch.no_grad() or detach the inputs")

    out, lse = _outputs(q, v, return_lse)
    config = variants.default_config(_validate.device_properties(device)[0],
                                     max(q.shape[2], v.shape[2]))
    # [total, H, D] as [1, H, total, D] views: the kernel's packed layout.
    views = [t.transpose(0, 1)[None] for t in (q, k, v, out)]
    launch_forward(*views, None if lse is None else lse[None], alibi_slopes, None, scale,
                   softcap, 0, (left, right), config,
                   varlen=Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q))
    return (out, lse) if return_lse else out
