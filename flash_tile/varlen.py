"""``flash_attn_varlen_func`` and its packed forms: attention over packed sequences of
different lengths, forward and backward, through the VARLEN switch of the forward and backward
kernels (``kernels/attention_fwd.py``, ``kernels/attention_bwd.py``): each program reads its
sequence's bounds from the cumulative lengths, so nothing is padded and nothing is read back
on the host. With a ``block_table`` the keys lie in the pages of a KV cache (the forward's
PAGED switch; forward only, as flash-attn's).
"""

import math

import torch

from flash_tile import _plans, _validate
from flash_tile._launch import Varlen
from flash_tile._interop import accepts_cupy
from flash_tile._ops import varlen_attention
from flash_tile._ops_fp8 import fp8_varlen_attention
from flash_tile._ops_paged import paged_tile, paged_varlen_attention
from flash_tile.api import (PACKED, _check_packed, _checked_inputs, _dropout_seed, _needs_grad,
                            _unit_last_stride)


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


def _checked_packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     window_size, softcap, seqused_k, alibi_slopes, sinks, paged=False):
    """The checks the packed and the paged calls share: (device, batch, (left, right),
    softcap, seqused_k, alibi_slopes, sinks) checked. ``paged``: k and v are pages, so
    cu_seqlens_k (None where seqused_k gives the key counts) bounds no packed rows."""
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0
    softcap = _validate.check_softcap(softcap)
    device = _validate.check_device(q, k, v)
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else 0
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], batch, device)
    if cu_seqlens_k is not None or not paged:
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", 0 if paged else k.shape[0], batch,
                          device)
    if seqused_k is not None:
        seqused_k = _validate.check_index_tensor(seqused_k, "seqused_k", (batch,), device)
    if alibi_slopes is not None:
        alibi_slopes = _validate.check_alibi_slopes(alibi_slopes, batch, q.shape[1])
        _validate.check_device(q, alibi_slopes)
    if sinks is not None:
        sinks = _validate.check_sinks(sinks, q.shape[1], device)
    return device, batch, (left, right), softcap, seqused_k, alibi_slopes, sinks


def _planned(entry: str, q, k, v, sequences: Varlen, arguments: tuple, max_seqlen_q,
             max_seqlen_k, tuned: bool = True, kv_descales: tuple = (None, None)):
    """(plan key, (out, lse) or None) of a plain inference call of ``entry`` on q, k, v,
    ``sequences``' arrays and an FP8 cache's ``kv_descales`` (k_descale, v_descale; their
    presence must be in ``arguments``): the outputs where a plan was kept for its key
    (max_seqlen_q/k, which the key leaves out, still checked), None where the full path must
    run (it makes the plan from the key's second sighting: ``_plans.sighted``)."""
    scales = tuple(t for t in kv_descales if t is not None)
    arrays = _plans.call_arrays(sequences)
    plan_key = _plans.key(entry, (q, k, v, *arrays, *scales), arguments, tuned)
    plan = _plans.find(plan_key)
    if plan is None:
        return plan_key, None
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    if k.dtype == torch.float8_e4m3fn:  # an FP8 cache: its factors' tensors (1's for None),
        # read in the layouts of the first call's views (the key holds their metadata)
        arrays += tuple(_validate.one_factor(q.device) if t is None else t for t in kv_descales)
    return plan_key, _plans.run_varlen(plan, q, k, v, arrays)


def _check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    _validate.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _validate.check_max_seqlen("max_seqlen_k", max_seqlen_k)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, seqused_k, return_lse, sinks=None, descales=(None, None, None)):
    """flash_attn_varlen_func on [total, H, D] tensors (possibly views of packed ones);
    ``descales`` the FP8 forward's (q_descale, k_descale, v_descale). A plain inference call
    of a seen signature runs its plan (``flash_tile._plans``)."""
    if return_attn_probs:  # flash-attn 2's (out, lse, S_dmask): S_dmask empty, no dropout
        _validate.check_attn_probs(dropout_p)
        out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, False, seqused_k, True, sinks,
                           descales)
        return out, lse, q.new_empty((0,))
    plan_key = None
    if dropout_p == 0.0 and alibi_slopes is None and sinks is None and \
            all(d is None for d in descales):
        plan_key, planned = _planned(
            "varlen", q, k, v, Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k),
            (seqused_k is None, softmax_scale, causal, window_size, softcap, return_lse),
            max_seqlen_q, max_seqlen_k)
        if planned is not None:
            return planned if return_lse else planned[0]
    dropout_p = _validate.check_dropout(dropout_p)
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    q, k, v, fp8 = _checked_inputs(q, k, v, PACKED, names)
    scale = _check_packed(q, k, v, softmax_scale, empty_keys=not fp8)
    device, batch, (left, right), softcap, seqused_k, alibi_slopes, sinks = _checked_packing(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
        softcap, seqused_k, alibi_slopes, sinks)
    in_place = q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # (a plan reads them so)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    if fp8:
        _validate.check_fp8_call(device, dropout_p, q, k, v, sinks)
        factors = _validate.fp8_descales(batch, k.shape[1], device, **names)
        out, lse = fp8_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *factors,
                                        alibi_slopes, scale, softcap, left, right, return_lse,
                                        sinks, seqused_k)
        return (out, lse) if return_lse else out
    needs_grad = _needs_grad(_validate.check_grad(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                                  alibi_slopes=alibi_slopes), sinks)
    if not needs_grad and in_place and _plans.sighted(plan_key):
        out, lse, plan = _plans.varlen(q, k, v, Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k),
                                       scale, softcap, (left, right), bool(return_lse))
        _plans.keep(plan_key, plan)
        return (out, lse) if return_lse else out
    # The backward recomputes P from the LSE: compute it whenever a gradient will be needed.
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, scale,
                                softcap, left, right,
                                return_lse or needs_grad, dropout_p, _dropout_seed(dropout_p),
                                sinks, seqused_k, bool(deterministic))
    return (out, lse) if return_lse else out


def _check_pages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The shapes of q [total_q, H, D] and of the pages k [num_blocks, page_size, H_kv, D],
    v [.., Dv], read in place (unit last strides); their dtypes are ``_paged``'s to check."""
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"with block_table, q must be [total_q, heads, head_dim] and k, v "
                         f"pages [num_blocks, page_size, heads_k, head_dim], got shapes "
                         f"{list(q.shape)}, {list(k.shape)} and {list(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v pages must agree in (num_blocks, page_size, heads_k), got "
                         f"{list(k.shape)} and {list(v.shape)}")
    _validate.check_heads(q.shape[1], k.shape[2], v.shape[2])
    _validate.check_head_dims(q.shape[2], k.shape[3], v.shape[3])
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v pages must have a unit last stride (a cache is read in "
                         "place, never copied)")


def _paged(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           return_attn_probs, seqused_k, return_lse, sinks, descales):
    """flash_attn_varlen_func with a block table: packed q against paged k and v (the
    forward's PAGED switch), forward only; a plain call of a seen signature (pages in q's
    dtype or an FP8 cache's) runs its plan (``flash_tile._plans``)."""
    if return_attn_probs:
        _validate.check_attn_probs(dropout_p)
        out, lse = _paged(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, False, seqused_k, True, sinks, descales)
        return out, lse, q.new_empty((0,))
    q_descale, k_descale, v_descale = descales
    plan_key = None
    if dropout_p == 0.0 and alibi_slopes is None and sinks is None and q_descale is None:
        plan_key, planned = _planned(
            "paged_varlen", q, k, v, Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table),
            (cu_seqlens_k is None, seqused_k is None, k_descale is None, v_descale is None,
             softmax_scale, causal, window_size, softcap, return_lse), max_seqlen_q,
            max_seqlen_k, tuned=False, kv_descales=(k_descale, v_descale))
        if planned is not None:
            return planned if return_lse else planned[0]
    if q.dtype == torch.float8_e4m3fn or q_descale is not None:
        raise NotImplementedError("block_table with float8_e4m3fn q (q_descale): the paged "
                                  "varlen forward runs its matmuls in q's dtype, float16 or "
                                  "bfloat16; an FP8 cache (float8_e4m3fn pages with k_descale "
                                  "and v_descale) takes such q")
    if _validate.check_dropout(dropout_p) > 0.0:
        raise NotImplementedError("dropout_p > 0 with block_table: the paged varlen forward "
                                  "has no backward (as flash-attn's), so nothing would train "
                                  "through the dropout; pass dropout_p=0")
    _check_pages(q, k, v)
    if _needs_grad(_validate.check_grad(q, k, v, alibi_slopes=alibi_slopes), sinks):
        raise NotImplementedError("block_table: the paged varlen forward has no backward (as "
                                  "flash-attn's); call it under torch.no_grad() or detach "
                                  "q, k, v and the sinks")
    scale = _validate.check_scale(1.0 / math.sqrt(q.shape[2]) if softmax_scale is None
                                  else softmax_scale)
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("block_table: give the sequences' key counts as cu_seqlens_k "
                         "(int32 [B + 1]) or seqused_k (int32 [B])")
    device, batch, (left, right), softcap, seqused_k, alibi_slopes, sinks = _checked_packing(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
        softcap, seqused_k, alibi_slopes, sinks, paged=True)
    _validate.check_block_table(block_table, batch, k.shape[1], None, device)
    kv_descale = _validate.check_kv_cache_dtypes(q, k, v, (), k_descale, v_descale, batch,
                                                 "flash_attn_varlen_func with block_table")
    if kv_descale is not None:
        _validate.check_fp8_capability(device, "an FP8 cache")
    if q.stride(-1) == 1 and _plans.sighted(plan_key):
        out, lse, plan = _plans.varlen(q, k, v, Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                       block_table), scale, softcap,
                                       (left, right), bool(return_lse), paged_tile(q, v),
                                       kv_descale)
        _plans.keep(plan_key, plan)
        return (out, lse) if return_lse else out
    out, lse = paged_varlen_attention(_unit_last_stride(q), k, v, block_table, cu_seqlens_q,
                                      cu_seqlens_k, seqused_k, alibi_slopes, scale, softcap,
                                      left, right, return_lse, sinks,
                                      *(kv_descale or (None, None)))
    return (out, lse) if return_lse else out


@accepts_cupy
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           seqused_k=None, return_lse=False, sinks=None, q_descale=None,
                           k_descale=None, v_descale=None):
    """Attention over packed sequences; a drop-in for flash-attn 2.8's
    ``flash_attn_varlen_func``, forward and backward (and FA3's FP8 forward).

    Args:
        q: [total_q, H, D] float16, bfloat16 or float8_e4m3fn CUDA tensor, the sequences'
            queries one after another, D from 1 to 256; k: [total_k, H_kv, D] and v:
            [total_k, H_kv, Dv] likewise (GQA: H a multiple of H_kv). Any strides (a strided
            last dim is copied).
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on q's device: sequence b is rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (and likewise of k, v). Equal
            consecutive offsets are a sequence of length 0.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths, as flash-attn's
            signature has them (ints, numpy integers, 0-d integer tensors, or a
            torch.compile SymInt such as ``.item()`` of the lengths' max); not otherwise used:
            the kernels' grid is flattened over every sequence's tiles and comes from the
            packed lengths, so the value is never compared (a new longest length is not a new
            torch.compile graph).
        dropout_p: as ``flash_attn_func``; the pattern is keyed by each sequence's own
            (sequence, head, row, column), so it does not depend on the packing's offsets.
        causal, window_size: aligned bottom-right per sequence, as flash-attn: row i of a
            sequence with q_len queries and k_len keys sees key j iff
            i + k_len - q_len - left <= j <= i + k_len - q_len + right (causal: right = 0).
        softmax_scale, softcap: as ``flash_attn_func``; alibi_slopes [H] or [B, H] fp32 (one
            row per sequence).
        deterministic: the two-pass backward, bitwise reproducible, as ``flash_attn_func``'s
            (otherwise the one-pass form where it is the default: Hopper at head dims above
            128; its dQ's last bits vary).
        seqused_k: optional int32 [B] on q's device (FA3's): sequence b uses only the first
            seqused_k[b] of its cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (a cache row
            partly filled); its band aligns bottom-right to them, and the unused keys get zero
            gradients.
        return_attn_probs: (out, lse, S_dmask) with S_dmask empty, as ``flash_attn_func``'s
            (flash-attn 2's form; dropout_p > 0 then raises NotImplementedError).
        block_table: optional int32 [B, max_blocks] on q's device: k and v are then the
            pages of a KV cache, [num_blocks, page_size, H_kv, D] and [.., Dv] (any page
            size; unit last strides, read in place), sequence b's key p in page
            block_table[b, p // page_size] at row p % page_size, as flash-attn's and vLLM's.
            Its key count is cu_seqlens_k[b + 1] - cu_seqlens_k[b] or, FA3's form,
            seqused_k[b] (cu_seqlens_k may then be None). Forward only (as flash-attn's: a
            gradient asked for raises NotImplementedError, as does dropout_p > 0). Pages in
            q's dtype, or an FP8 cache: float8_e4m3fn pages with k_descale and v_descale
            (positive, [B, H_kv] or one element, None for 1; not checked: a device sync),
            q float16 or bfloat16 (Hopper and newer;
            the tiles are widened to q's dtype after their load, exactly, the factors applied
            to the scores and the output; float8_e4m3fn q raises NotImplementedError).
            Pages whose size has a power-of-two factor of 16
            or more load as tiles; others (1-8, odd multiples of them) are gathered by row.
            Not checked (a device sync): that the entries a sequence uses name valid pages;
            entries past them are not read, and the slots of a last page past the sequence's
            keys may hold anything (NaN included: their scores are masked, their V rows
            zeroed). Inputs are not cast under ``torch.autocast`` (the pages are read in
            place, as ``flash_attn_with_kvcache``'s cache): q must have the pages' dtype.
        return_lse: also return the LSE (differentiable, as ``flash_attn_func``'s).
        sinks: [H] float32 sink logits, as ``flash_attn_func``'s (the same for every sequence;
            the LSE includes them).
        q_descale, k_descale, v_descale: the FP8 forward's factors, as ``flash_attn_func``'s,
            [B, H_kv] with one row per sequence, or one element; bfloat16 output, no
            backward. With ``block_table``, k_descale and v_descale alone: an FP8 cache's.

    Gradients flow to q, k, v and the sinks (not alibi_slopes) through the backward's
    VARLEN switch.

    Returns:
        out [total_q, H, Dv] in q's dtype; with ``return_lse`` (out, lse [H, total_q] fp32,
        natural log, +inf for rows that see no key); with ``return_attn_probs`` (either
        way) (out, lse, S_dmask), S_dmask empty.

    The offsets may start past row 0 and end before the last row: rows that no sequence
    covers are left unwritten (their gradients too). Not checked (it would need a device
    sync): that the offsets are monotone and within [0, total_q] / [0, total_k] (with
    ``block_table``, cu_seqlens_k gives key counts only, within the sequence's pages), and that
    seqused_k[b] lies in [0, the sequence's keys] (more reads the next sequence's keys).
    Offsets past the ends read padding or other sequences' rows; offsets that decrease give
    wrong results (the kernels' search for each program's sequence assumes them monotone).
    The rows of q, k, v (and of the output gradient) just past a sequence's end (the keys
    past seqused_k[b], the next sequence's first rows, rows no sequence covers) must hold
    finite values: a tile that runs past the end reads them, and although their weights are
    exactly zero, a NaN or inf there makes 0 * NaN = NaN in the sequence's output and
    gradients (the decode kernel and the paged forward zero such rows; the packed varlen
    kernels do not yet).
    """
    if block_table is not None:
        return _paged(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, seqused_k, return_lse, sinks,
                      (q_descale, k_descale, v_descale))
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, seqused_k, return_lse, sinks,
                   (q_descale, k_descale, v_descale))


@accepts_cupy
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False,
                                     sinks=None, q_descale=None, k_descale=None,
                                     v_descale=None):
    """``flash_attn_varlen_func`` on a packed qkv [total, 3, H, D] (fp16, bf16 or, with the
    descales, float8_e4m3fn), read in
    place (its gradient comes back in the same layout), with one cu_seqlens int32 [B + 1] and
    max_seqlen for queries and keys; the output is [total, H, D]. causal and windows align
    bottom-right per sequence (here the same as top-left: Lq = Lk). Other arguments and the
    results as ``flash_attn_varlen_func``."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be [total, 3, heads, head_dim], got shape "
                         f"{tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, None, return_lse, sinks,
                   (q_descale, k_descale, v_descale))


@accepts_cupy
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, return_lse=False,
                                    sinks=None, q_descale=None, k_descale=None,
                                    v_descale=None):
    """``flash_attn_varlen_func`` on q [total_q, H, D] and a packed kv [total_k, 2, H_kv, D]
    (fp16, bf16 or, with the descales, float8_e4m3fn), read in place, with cu_seqlens_q /
    cu_seqlens_k int32 [B + 1]; the output is [total_q, H, D]. causal and windows align
    bottom-right per sequence. Other arguments and the results as
    ``flash_attn_varlen_func``."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [total, 2, heads, head_dim], got shape "
                         f"{tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, None, return_lse, sinks,
                   (q_descale, k_descale, v_descale))
