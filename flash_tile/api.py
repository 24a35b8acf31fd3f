"""Public functions in flash-attn's shapes (``flash_attn_func`` and its packed forms) and torch's
(``scaled_dot_product_attention``).

All of them validate everything before launching (``flash_tile._validate`` lists the errors),
reach the kernel through views (no copies of q, k or v unless their last dim is strided), and
run on the current CUDA stream of the inputs' device. They take torch tensors or CuPy arrays
(``flash_tile._interop``); CuPy inputs get CuPy outputs.
"""

import math

import torch

from flash_tile import _plans, _validate
from flash_tile._interop import accepts_cupy
from flash_tile._ops import attention_forward
from flash_tile._ops_fp8 import fp8_attention


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast floating inputs to the autocast dtype where autocast is on, as torch does for
    SDPA (float32, and float16 or bfloat16 of the other kind; not float64, which torch's
    autocast leaves, nor FP8, which the FP8 entry points take as it is)."""
    device_type = tensors[0].device.type
    if device_type != "cuda" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.dtype in _AUTOCAST_CASTS and t.dtype != dtype else t
                 for t in tensors)


BLHD = "[batch, seqlen, heads, head_dim]"  # flash_attn_func's layout
PACKED = "[total, heads, head_dim]"  # flash_attn_varlen_func's


def _check_layout(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k and v each of ``layout``'s rank (BLHD or PACKED); ValueError naming it if not."""
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def _checked_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                    descales: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(q, k, v, fp8) of flash_attn_func or flash_attn_varlen_func: of ``layout``
    (``_check_layout``); float8_e4m3fn with ``descales`` (q_descale, k_descale and v_descale
    by name) for the FP8 forward (``_validate.check_fp8``), else cast as autocast says and
    checked as the kernels' dtypes."""
    _check_layout(layout, q, k, v)
    fp8 = _validate.check_fp8(q, k, v, **descales)
    if not fp8:
        q, k, v = _autocast(q, k, v)
        _validate.check_dtypes(q, k, v)
    return q, k, v, fp8


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernel's tiles read rows of D contiguous elements; flash-attn copies in this case too.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_bhld(q, k, v, scale, gqa_allowed=True, empty_keys=False):
    """Checks of [B, H, L, D] views common to every entry point (Lk = 0 only with
    ``empty_keys``); returns the softmax scale."""
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, "
                         f"{k.shape[0]} and {v.shape[0]}")
    _validate.check_lengths(k.shape[2], v.shape[2], empty_keys)
    _validate.check_heads(q.shape[1], k.shape[1], v.shape[1], gqa_allowed)
    _validate.check_head_dims(q.shape[3], k.shape[3], v.shape[3])
    return _validate.check_scale(scale if scale is not None else 1.0 / math.sqrt(q.shape[3]))


def _check_packed(q, k, v, scale, empty_keys=False):
    """Checks of packed [total, H, D] tensors common to the varlen entry points (``_check_bhld``'s
    for them, total_k = 0 only with ``empty_keys``); returns the softmax scale."""
    _validate.check_lengths(k.shape[0], v.shape[0], empty_keys)
    _validate.check_heads(q.shape[1], k.shape[1], v.shape[1])
    _validate.check_head_dims(q.shape[2], k.shape[2], v.shape[2])
    return _validate.check_scale(scale if scale is not None else 1.0 / math.sqrt(q.shape[2]))


def _dropout_seed(dropout_p: float) -> int:
    """A seed for the kernels' dropout hash, drawn from torch's default generator, so that
    ``torch.manual_seed`` makes dropout reproducible (0, unused, without dropout).

    The seed is a launch argument, so a CUDA graph would replay one dropout pattern forever:
    dropout under graph capture raises instead."""
    if dropout_p == 0.0:
        return 0
    if torch.cuda.is_current_stream_capturing():  # the inputs are CUDA tensors by now
        raise NotImplementedError("dropout_p > 0 under CUDA-graph capture: the seed is a "
                                  "launch argument, so every replay would drop the same "
                                  "probabilities; capture with dropout_p=0")
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _needs_grad(needs_grad: bool, sinks: torch.Tensor | None) -> bool:
    """Whether a backward is needed: for q, k or v (``check_grad``'s answer) or the sinks."""
    return needs_grad or (sinks is not None and sinks.requires_grad and
                          torch.is_grad_enabled())


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, return_lse, sinks=None,
                descales=(None, None, None)):
    """flash_attn_func on [B, L, H, D] tensors (possibly views of packed ones); ``descales``
    the FP8 forward's (q_descale, k_descale, v_descale). A plain inference call of a seen
    signature runs its plan (``flash_tile._plans``)."""
    if return_attn_probs:  # flash-attn 2's (out, lse, S_dmask): S_dmask empty, no dropout
        _validate.check_attn_probs(dropout_p)
        out, lse = _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, False, True, sinks, descales)
        return out, lse, q.new_empty((0,))
    plan_key = None
    if dropout_p == 0.0 and alibi_slopes is None and sinks is None and \
            descales[0] is None and descales[1] is None and descales[2] is None:
        plan_key = _plans.key("flash_attn", (q, k, v), (softmax_scale, causal, window_size,
                                                         softcap, return_lse))
        plan = _plans.find(plan_key)
        if plan is not None:
            out, lse = _plans.run_forward(plan, q, k, v)
            return (out, lse) if return_lse else out
    dropout_p = _validate.check_dropout(dropout_p)
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    q, k, v, fp8 = _checked_inputs(q, k, v, BLHD, names)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D] views
    scale = _check_bhld(q, k, v, softmax_scale, empty_keys=not fp8)
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0  # causal is a window whose right edge is the diagonal, as in flash-attn
    softcap = _validate.check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _validate.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[1])
    extra = () if alibi_slopes is None else (alibi_slopes,)
    device = _validate.check_device(q, k, v, *extra)
    if sinks is not None:
        sinks = _validate.check_sinks(sinks, q.shape[1], device)
    if fp8:
        _validate.check_fp8_call(device, dropout_p, q, k, v, sinks)
        factors = _validate.fp8_descales(q.shape[0], k.shape[1], device, **names)
        q, k = (_unit_last_stride(t) for t in (q, k))  # v: copied keys-major in any case
        out, lse = fp8_attention(q, k, v, *factors, alibi_slopes, scale, softcap,
                                 k.shape[2] - q.shape[2], left, right, return_lse, sinks)
        out = out.transpose(1, 2)
        return (out, lse) if return_lse else out
    needs_grad = _needs_grad(_validate.check_grad(q, k, v, alibi_slopes=alibi_slopes), sinks)

    if plan_key is not None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        out, lse, plan = _plans.forward(q, k, v, scale, softcap, k.shape[2] - q.shape[2],
                                        left, right, bool(return_lse))
        _plans.keep(plan_key, plan)
        return (out, lse) if return_lse else out
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    # The backward recomputes P from the LSE: compute it whenever a gradient will be needed.
    out, lse = attention_forward(q, k, v, alibi_slopes, None, scale, softcap,
                                 k.shape[2] - q.shape[2], left, right, return_lse or needs_grad,
                                 dropout_p, _dropout_seed(dropout_p), sinks, bool(deterministic))
    out = out.transpose(1, 2)  # [B, Lq, H, Dv], contiguous
    return (out, lse) if return_lse else out


@accepts_cupy
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, sinks=None, q_descale=None,
                    k_descale=None, v_descale=None):
    """Attention in flash-attn's layout; a drop-in for ``flash_attn.flash_attn_func`` (and,
    with float8_e4m3fn inputs, for FA3's FP8 forward).

    Args:
        q: [B, Lq, H, D] float16, bfloat16 or float8_e4m3fn CUDA tensor, D from 1 to 256.
        k: [B, Lk, H_kv, D] and v: [B, Lk, H_kv, Dv], same dtype and device as q; H a multiple
            of H_kv (grouped-query / multi-query attention: each group of H / H_kv query heads
            reads one key/value head in place). Any strides: the [B, H, L, D] <-> [B, L, H, D]
            transposes are read in place.
        dropout_p: probability in [0, 1) of dropping each attention probability (the kept ones
            are scaled by 1 / (1 - dropout_p)), applied on every call as in flash-attn (pass 0
            for evaluation). The pattern is a hash of a seed drawn from torch's default
            generator: ``torch.manual_seed`` makes it reproducible, and the backward reuses it.
        softmax_scale: scale of q.k before the softmax; default 1 / sqrt(D). Must be > 0.
        causal: causal mask aligned to the bottom-right corner of the score matrix, as in
            flash-attn 2.1+: query i sees key j iff j <= i + Lk - Lq.
        window_size: (left, right) sliding window of ints, -1 (any negative, as in flash-attn)
            for an unbounded side: query i sees key
            j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right. With ``causal`` the right
            side is 0. Key tiles outside every row's window are not loaded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (after the scale);
            0 or less: off, as in flash-attn.
        alibi_slopes: [H] or [B, H] float32: adds -slope * |i + Lk - Lq - j| to the scores.
        deterministic: run the two-pass backward, bitwise reproducible (the forward always
            is). Otherwise the backward may run the one-pass form, where it is the default
            (Hopper at head dims above 128, where it measured faster) or the autotuner picks
            it: dQ is then summed by atomic adds in whatever order the programs run, so its
            last bits can differ between runs (dK and dV do not).
            ``torch.use_deterministic_algorithms(True)`` has the same effect. FP8 inputs have
            no backward, so it changes nothing for them.
        return_attn_probs: return (out, lse, S_dmask) as flash-attn 2 does, the way its
            callers get the LSE: lse as with ``return_lse`` (gradients flow through it) and
            S_dmask an empty tensor of q's dtype, as flash-attn's without dropout. With
            dropout_p > 0 it raises NotImplementedError (flash-attn then returns the
            probabilities with their dropout pattern, for testing; these kernels do not
            write them).
        return_lse: also return the row log-sum-exp of the final scores; gradients flow
            through it too (as ring attention needs when it merges partial results).
        sinks: [H] float32 learnt sink logits (gpt-oss's attention sinks), or None: head h's
            sink joins every row's softmax as one more score with no value,
            softmax([s_i1 .. s_iLk, sinks[h]]), so the output sums the keys' weights only
            (less than 1). The LSE returned includes the sink's term; a row that sees no key
            gets an output of 0 and an LSE of sinks[h].
        q_descale, k_descale, v_descale: with float8_e4m3fn q, k and v (the FP8 forward, on
            sm_90 and newer), float32 factors that dequantize them, [B, H_kv] (per batch and
            key/value head, FA3's shape; a query head uses its group's) or of one element
            (per tensor); None means 1. The scores are those of q_descale * q and
            k_descale * k; P is rounded to e4m3 for P V and the output multiplied by
            v_descale. ``flash_tile.quantize_fp8`` makes inputs and factors. The factors
            must be positive and finite: the kernel reads them as they are (checking their
            values would sync), and a zero or negative one gives NaN or wrong rows. The FP8
            output is bfloat16; it has no backward and no dropout (both raise
            NotImplementedError, as FA3).

    Gradients flow to q, k, v and the sinks (not to alibi_slopes) when they require grad:
    dsinks[h] = -sum over batch and rows of p_sink * (dO . O - dLSE). The backward
    is flash_tile's cuTile kernels, recomputing the attention matrix from the saved LSE (see
    ``deterministic``).

    Rows that see no key (bottom-right causal with Lq > Lk, or a window outside [0, Lk)) get
    an output of 0 and an LSE of +inf, as in flash-attn (without sinks). Lq = 0 gives empty
    outputs and zero gradients for k and v, Lk = 0 (bf16/fp16) every row as one that sees
    no key and a zero dq; neither launches anything.

    Returns:
        out [B, Lq, H, Dv] (contiguous, q's dtype; bfloat16 for FP8 inputs); with
        ``return_lse`` the tuple
        (out, lse) where lse is [B, H, Lq] float32, natural log; with ``return_attn_probs``
        (either way) (out, lse, S_dmask), S_dmask empty.

    Raises:
        ValueError, NotImplementedError, RuntimeError as described in ``flash_tile._validate``,
        before anything is launched.
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse, sinks,
                       (q_descale, k_descale, v_descale))


@accepts_cupy
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              return_lse=False, sinks=None, q_descale=None, k_descale=None,
                              v_descale=None):
    """``flash_attn_func`` on a packed qkv of shape [B, L, 3, H, D] (fp16, bf16 or
    float8_e4m3fn), read in place; the output is [B, L, H, D]. Arguments and results as
    ``flash_attn_func``: with Lq = Lk the causal mask is the usual lower triangle.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [batch, seqlen, 3, heads, head_dim], got shape "
                         f"{tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse, sinks,
                       (q_descale, k_descale, v_descale))


@accepts_cupy
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             return_lse=False, sinks=None, q_descale=None, k_descale=None,
                             v_descale=None):
    """``flash_attn_func`` on q [B, Lq, H, D] and a packed kv of shape [B, Lk, 2, H_kv, D]
    (fp16, bf16 or float8_e4m3fn), read in place; the output is [B, Lq, H, D]. Arguments and
    results as ``flash_attn_func``: causal aligns the mask to the bottom-right corner (query
    i sees keys up to i + Lk - Lq), as flash-attn.
    """
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be [batch, seqlen, 2, heads, head_dim], got shape "
                         f"{tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse, sinks,
                       (q_descale, k_descale, v_descale))


@accepts_cupy
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Attention in torch's layout; a drop-in for
    ``torch.nn.functional.scaled_dot_product_attention`` on the cases it supports.

    Args:
        query: [..., H, Lq, D] float16 or bfloat16 CUDA tensor with at least 3 dims: [B, H, L, D]
            as usual, [B, L, D] (one head), or more leading batch dims; D from 1 to 256.
        key: [..., H_kv, Lk, D] and value: [..., H_kv, Lk, Dv] with the same batch dims as query
            (no broadcasting: torch's math path also broadcasts a batch or H_kv of 1, which
            raises here). H_kv < H needs ``enable_gqa=True``, as in torch.
        attn_mask: boolean (True = attend) or additive mask in query's dtype, broadcastable to
            [..., H, Lq, Lk]; broadcast dims are read in place (stride 0), not expanded in
            memory (except that more than one leading batch dim is flattened). Rows that
            attend to nothing (every key False or -inf) return 0, as torch does. The kernels
            take additive masks in base 2 (times log2(e)), where bfloat16's lowest finite
            value (-3.39e38) becomes -inf: a row masked everywhere by it returns 0 too, where
            torch's softmax over equal scores returns the mean of the values.
        dropout_p: dropout probability in [0, 1), applied on every call as torch's function
            does; seeded from torch's default generator (see ``flash_attn_func``).
        is_causal: causal mask aligned to the top-left corner, as torch defines it: query i
            sees key j iff j <= i. This differs from ``flash_attn_func`` (bottom-right) when
            Lq != Lk. Not together with attn_mask, as in torch.
        scale: scale of q.k before the softmax; default 1 / sqrt(D). Must be > 0.
        enable_gqa: allow fewer key/value heads than query heads (H a multiple of H_kv).

    Returns:
        [..., H, Lq, Dv] in query's dtype (empty for Lq = 0 and zeros for Lk = 0, as
        torch's).
        Under ``torch.autocast`` float32 inputs are cast to the autocast dtype first, as
        torch does. Gradients flow to query, key and value (not
        to attn_mask) through flash_tile's backward kernels: the one-pass form where it is
        the default or the autotuner's pick, or under
        ``torch.use_deterministic_algorithms(True)`` the two-pass form, bitwise reproducible
        (see ``flash_attn_func``'s ``deterministic``).
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks=None,
          deterministic=False):
    """``scaled_dot_product_attention``'s body, with ``flash_attn_func``'s ``sinks`` [H]
    and ``deterministic`` (which torch's function has not): for integrations (Transformers'
    gpt-oss, a model asking for deterministic attention) that pass a mask with them. A plain
    inference call on [B, H, L, D] tensors of a seen signature runs its plan
    (``flash_tile._plans``)."""
    plan_key = None
    if attn_mask is None and dropout_p == 0.0 and sinks is None and query.dim() == 4:
        plan_key = _plans.key("sdpa", (query, key, value), (is_causal, scale, enable_gqa))
        plan = _plans.find(plan_key)
        if plan is not None:
            return _plans.run_forward(plan, query, key, value, bhld=True)[0]
    dropout_p = _validate.check_dropout(dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims [..., seqlen, head_dim], got "
                             f"shape {tuple(t.shape)}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError("query, key and value must have the same batch dims, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    query, key, value = _autocast(query, key, value)
    _validate.check_dtypes(query, key, value)
    if attn_mask is not None and attn_mask.is_floating_point():
        (attn_mask,) = _autocast(attn_mask)
    if attn_mask is not None:
        if is_causal:
            raise ValueError("pass either attn_mask or is_causal=True, not both (as torch)")
        attn_mask = _validate.check_attn_mask(attn_mask, query.dtype, (
            *query.shape[:-1], key.shape[-2]))
    lead = query.shape[:-2]
    if query.dim() == 3:
        q, k, v = query[:, None], key[:, None], value[:, None]  # [B, L, D]: one head each
        mask = None if attn_mask is None else attn_mask[:, None]
    else:
        # the leading dims' product, not -1: a reshape of no elements cannot infer it
        q, k, v = (t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:]) for t in (query, key, value))
        mask = None if attn_mask is None else attn_mask.reshape(
            math.prod(attn_mask.shape[:-3]), *attn_mask.shape[-3:])
    scale = _check_bhld(q, k, v, scale, gqa_allowed=enable_gqa, empty_keys=True)
    device = _validate.check_device(q, k, v, *(() if mask is None else (mask,)))
    if sinks is not None:
        sinks = _validate.check_sinks(sinks, q.shape[1], device)
    needs_grad = _needs_grad(_validate.check_grad(q, k, v, attn_mask=mask), sinks)

    right = 0 if is_causal else -1
    if plan_key is not None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        out, _, plan = _plans.forward(q, k, v, scale, 0.0, 0, -1, right, False)
        _plans.keep(plan_key, plan)
        return out.transpose(1, 2)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    out, _ = attention_forward(q, k, v, None, mask, scale, 0.0, 0, -1, right, needs_grad,
                               dropout_p, _dropout_seed(dropout_p), sinks, bool(deterministic))
    return out.reshape(*lead, *out.shape[-2:])
