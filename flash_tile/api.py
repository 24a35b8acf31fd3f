"""Public functions: flash-attn's ``flash_attn_func`` and torch's ``scaled_dot_product_attention``.

Both validate everything before launching (``flash_tile._validate`` lists the errors), reach the
kernel through views (no copies of q, k or v unless their last dim is strided), and run on the
current CUDA stream of the inputs' device.
"""

import math

import torch

from flash_tile import _validate
from flash_tile._ops import attention_forward


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast float32 inputs to the autocast dtype where autocast is on, as torch does for SDPA."""
    device_type = tensors[0].device.type
    if device_type != "cuda" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in tensors)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernel's tiles read rows of D contiguous elements; flash-attn copies in this case too.
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(q, k, v, scale, causal, causal_offset, return_lse):
    """q [B, H, Lq, D], k and v [B, H, Lk, D], already validated."""
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    return attention_forward(q, k, v, scale, causal, causal_offset, return_lse)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False):
    """Attention in flash-attn's layout; a drop-in for ``flash_attn.flash_attn_func``.

    Args:
        q: [B, Lq, H, D] float16 or bfloat16 CUDA tensor.
        k, v: [B, Lk, H, D], same dtype and device as q. Any strides: the [B, H, L, D] <->
            [B, L, H, D] transposes are read in place.
        dropout_p: must be 0.0 (dropout is not supported yet).
        softmax_scale: scale of q.k before the softmax; default 1 / sqrt(D). Must be > 0.
        causal: causal mask aligned to the bottom-right corner of the score matrix, as in
            flash-attn 2.1+: query i sees key j iff j <= i + Lk - Lq. With Lq > Lk the first
            Lq - Lk query rows see no key: their output is 0 and their LSE +inf.
        window_size, softcap, alibi_slopes, return_attn_probs: only their defaults are
            supported yet; anything else raises NotImplementedError.
        deterministic: accepted for compatibility; the forward is deterministic either way.
        return_lse: also return the row log-sum-exp of the scaled scores.

    Returns:
        out [B, Lq, H, D] (contiguous, q's dtype); with ``return_lse`` the tuple
        (out, lse) where lse is [B, H, Lq] float32, natural log.

    Raises:
        ValueError, NotImplementedError, RuntimeError as described in ``flash_tile._validate``,
        before anything is launched.
    """
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p: dropout is not supported yet; pass 0.0")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size: sliding-window attention is not supported yet")
    if softcap != 0.0:
        raise NotImplementedError("softcap: score capping is not supported yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported yet")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs: attention probabilities are not "
                                  "returned; use return_lse=True for the log-sum-exp")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    q, k, v = _autocast(q, k, v)
    _validate.check_dtypes(q, k, v)
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, "
                         f"{k.shape[0]} and {v.shape[0]}")
    _validate.check_lengths(k.shape[1], v.shape[1])
    _validate.check_heads(q.shape[2], k.shape[2], v.shape[2])
    _validate.check_head_dims(q.shape[3], k.shape[3], v.shape[3])
    scale = _validate.check_scale(
        softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3]))
    _validate.check_device(q, k, v)
    _validate.check_grad(q, k, v)

    q_len, k_len = q.shape[1], k.shape[1]
    out, lse = _forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, causal,
                        k_len - q_len, return_lse)
    out = out.transpose(1, 2)  # [B, Lq, H, D], contiguous
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Attention in torch's layout; a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
    on the cases it supports.

    Args:
        query: [..., Lq, D] float16 or bfloat16 CUDA tensor with at least 3 dims: [B, H, L, D]
            as usual, [B, L, D] (one head), or more leading batch dims.
        key, value: [..., Lk, D] with the same leading dims as query (no broadcasting).
        attn_mask: must be None (masks are not supported yet).
        dropout_p: must be 0.0 (dropout is not supported yet).
        is_causal: causal mask aligned to the top-left corner, as torch defines it: query i
            sees key j iff j <= i. This differs from ``flash_attn_func`` (bottom-right) when
            Lq != Lk.
        scale: scale of q.k before the softmax; default 1 / sqrt(D). Must be > 0.
        enable_gqa: accepted; grouped heads (fewer key/value heads) are not supported yet and
            raise NotImplementedError.

    Returns:
        [..., Lq, D] in query's dtype. Under ``torch.autocast`` float32 inputs are cast to the
        autocast dtype first, as torch does.
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: attention masks are not supported yet")
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p: dropout is not supported yet; pass 0.0")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims [..., seqlen, head_dim], got "
                             f"shape {tuple(t.shape)}")
    query, key, value = _autocast(query, key, value)
    _validate.check_dtypes(query, key, value)
    lead = query.shape[:-2]
    if query.dim() == 3:
        # [B, L, D]: one head per batch entry.
        q, k, v = query[:, None], key[:, None], value[:, None]
    else:
        if not (key.shape[:-3] == value.shape[:-3] == query.shape[:-3]):
            raise ValueError("query, key and value must have the same batch dims, got "
                             f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError("query, key and value must have the same batch dims, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    _validate.check_lengths(k.shape[2], v.shape[2])
    _validate.check_heads(q.shape[1], k.shape[1], v.shape[1])
    _validate.check_head_dims(q.shape[3], k.shape[3], v.shape[3])
    scale = _validate.check_scale(scale if scale is not None else 1.0 / math.sqrt(q.shape[3]))
    _validate.check_device(q, k, v)
    _validate.check_grad(query, key, value)

    out, _ = _forward(q, k, v, scale, is_causal, 0, False)
    return out.reshape(*lead, *out.shape[-2:])
