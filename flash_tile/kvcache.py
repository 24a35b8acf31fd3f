"""``flash_attn_with_kvcache``: attention against a KV cache (decode, speculative decoding,
chunked prefill), contiguous or paged, with the new keys and values appended in place.

The call validates everything checkable without a device sync, then launches (through the
``flash_tile::kvcache_attention`` custom op where torch.compile traces) cuTile kernels on the
current stream (``kernels/attention_decode.py``): the append of the new rows (with the
rotary embedding), the split-KV decode, and the combine of the splits; a contiguous cache
of 2**31 elements or more takes a decode and a combine per group of sequences that 32-bit
offsets reach. It reads nothing back to the host and allocates only its outputs, the split
workspace and under rotary the rotated q (torch's caching allocator), so a step captures in a
CUDA graph and replays with new values in a ``cache_seqlens`` tensor (an int length is made
into a tensor at the call, and so is fixed in a captured graph).
"""

import math
import operator

import torch

from flash_tile import _plans, _validate
from flash_tile._interop import accepts_cupy
from flash_tile.api import _unit_last_stride
from flash_tile._ops_decode import kvcache_attention


def _seqlens(cache_seqlens, batch: int, capacity: int, new_len: int, device) -> torch.Tensor:
    """cache_seqlens as an int32 [B] tensor on ``device``: an int is broadcast (one small
    fill) after checking that it and the ``new_len`` appended rows fit the capacity; None
    means every sequence fills the cache's capacity."""
    if isinstance(cache_seqlens, torch.Tensor):
        return _validate.check_index_tensor(cache_seqlens, "cache_seqlens", (batch,), device)
    if isinstance(cache_seqlens, bool):
        raise ValueError("cache_seqlens must be an int or an int32 tensor, got a bool")
    length = capacity if cache_seqlens is None else operator.index(cache_seqlens)
    if not 0 <= length <= capacity - new_len:
        raise ValueError(f"cache_seqlens={length} with {new_len} new rows does not fit the "
                         f"cache's capacity of {capacity}")
    return torch.full((batch,), length, dtype=torch.int32, device=device)


def _run_plan(plan: tuple, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
              block_table, sinks, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved,
              return_lse, kv_descale, attn_mask):
    """A checked call's result by its plan (the decode plan, whether new rows are appended,
    and the normalised scale, softcap, window and rotary step); ``attn_mask`` as
    ``_validate.check_decode_mask`` returns it."""
    decode, new_rows, scale, softcap, left, right, q_step = plan
    out, lse = _plans.run_kvcache(
        decode, q, k_cache, v_cache, k if new_rows else None, v if new_rows else None,
        cache_seqlens, cache_batch_idx, block_table, scale, softcap, left, right,
        bool(return_lse), sinks, cache_leftpad, rotary_cos, rotary_sin,
        bool(rotary_interleaved), q_step, kv_descale, attn_mask)
    return (out, lse) if return_lse else out


@accepts_cupy
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, sinks=None, k_descale=None,
                            v_descale=None, attn_mask=None):
    """Attention of q against a KV cache; a drop-in for ``flash_attn.flash_attn_with_kvcache``.

    Args:
        q: [B, Lq, H, D] float16 or bfloat16 CUDA tensor, Lq >= 1 (one decode step, a few
            speculative tokens, or a chunk of a prompt), D from 1 to 256.
        k_cache, v_cache: the cache in q's dtype, or both float8_e4m3fn (an FP8 cache, see
            k_descale), either contiguous-by-sequence [B_cache, L_cache, H_kv, D] (v: Dv),
            or paged [num_blocks, page_size, H_kv, D] when ``block_table`` is given; H a
            multiple of H_kv (GQA/MQA). Unit last stride.
        k, v: optional new keys/values [B, L_new, H_kv, D / Dv], written into the cache in
            place at positions cache_seqlens[b] .. cache_seqlens[b] + L_new - 1 before the
            attention reads it (so it attends to cache_seqlens + L_new keys). In q's dtype;
            into an FP8 cache they are stored as x / descale rounded to e4m3 (saturating at
            +-448), or may be given in float8_e4m3fn already (stored as they are).
        rotary_cos, rotary_sin: optional [L_ro, rotary_dim / 2] in q's dtype, L_ro at least
            the cache's capacity (plus Lq - L_new where q has more rows than k and rows
            step), rotary_dim even and at most D: the rotary embedding of the
            first rotary_dim columns of q and of the new k (so k and v must be given), fused
            into the append. The new key at cache position p is rotated at position p; query
            row i at cache_seqlens[b] + i when the call is causal or windowed (a window bound
            below the capacity), else every row at cache_seqlens[b] (flash-attn's rule). The
            rotated keys are what the cache stores; q itself is left as it was.
        rotary_interleaved: True rotates pairs of columns (2f, 2f + 1) (GPT-J), False pairs
            (f, f + rotary_dim / 2) (GPT-NeoX, Llama).
        cache_leftpad: optional [B] int32: sequence b's keys start at cache position
            cache_leftpad[b] (left-padded batches); the positions before it never weigh in
            (their values are zeroed), but the key step holding the first key is read
            whole, so with a block_table the pages of the pad it reaches must be valid ones.
            Causal alignment, windows and ALiBi count keys from that start, as flash-attn's.
        cache_seqlens: int or [B] int32 tensor: the keys already in each sequence's cache
            (None: the whole cache, L_cache or max_blocks * page_size); with cache_leftpad
            the end of its keys (the pad counted), where new rows are written.
        cache_batch_idx: optional [B] int32: the cache row of each sequence (contiguous
            caches only).
        block_table: optional [B, max_blocks] int32: sequence b's key p lives in page
            block_table[b, p // page_size] at row p % page_size. Pages need not be contiguous
            or ordered; any page size works. Steps of 64 keys load pages as tiles where a
            page holds 16 keys or a multiple of 16 (1, 2 or 4 loads a step); other sizes are
            gathered by row, slower (H200: 16-key pages read at about half the GB/s of a
            contiguous cache, 1-key pages about a third: bench/results/decode-h200.md).
        softmax_scale: default 1 / sqrt(D).
        causal, window_size: aligned bottom-right per sequence, as flash-attn: with k_len =
            cache_seqlens[b] + L_new, query row i sees key j iff
            i + k_len - Lq - left <= j <= i + k_len - Lq + right (causal: right = 0).
        softcap: > 0 caps the scaled scores with softcap * tanh(s / softcap).
        alibi_slopes: [H] or [B, H] float32, bias -slope * |i + k_len - Lq - j|.
        num_splits: 0 (or less) picks the number of key splits from B, H_kv, Lq and the
            cache's capacity so that the GPU's SMs fill (``_launch_decode.decode_splits``);
            1 disables splitting; a count is capped at the key tiles, at 64 and where the
            split partials (fp32 [S, B, Lq, H, Dv]) would reach 2**31 elements; any count
            gives the same result within rounding.
        return_softmax_lse: also return the LSE.
        sinks: [H] float32 sink logits, as ``flash_attn_func``'s (the LSE includes them; a
            row that sees no key gets 0 and the sink as its LSE).
        k_descale, v_descale: an FP8 cache's dequantization factors (FA3's names): its keys
            stand for k_descale[b, h] * k8 and its values for v_descale[b, h] * v8, each a
            float32 [B, H_kv] tensor (b the sequence of q, not its cache row under
            cache_batch_idx) or of one element (per tensor); None is 1. Only with an FP8
            cache, which the decode widens tile by tile, exactly (K to q's dtype, V to
            float16 and P V in float16, but for bfloat16 q at Dv > 128 V to bfloat16):
            the softmax runs as for a q-dtype cache while a step reads half the bytes.
            ``flash_tile.quantize_fp8(cache)`` makes such a cache with [B_cache, H_kv]
            factors, one per cache row: with ``cache_batch_idx`` (or B_cache > B) pass
            ``kd[cache_batch_idx]`` (or ``kd[:B]``); ``per="tensor"`` gives one factor, as a
            paged cache needs. The factors must be positive and finite (not checked:
            reading them would sync). FP8 q is not supported (NotImplementedError).
        attn_mask: optional bool tensor [B, 1, Lq, L] or any shape that broadcasts to it, L
            the cache's capacity (L_cache, or max_blocks * page_size): query row i of
            sequence b sees cache position j only where attn_mask[b, 0, i, j] is True, on
            top of cache_seqlens, cache_leftpad, causal and the window (a flash_tile
            extension: what a Transformers static cache passes, and what lets such a step
            run without reading its lengths back). One mask for all heads. Read on the
            device only; the V rows of masked positions below cache_seqlens must be finite
            (0 * NaN is NaN), as in a zero-filled cache.

    Returns:
        out [B, Lq, H, Dv] in q's dtype; with ``return_softmax_lse`` the pair (out, lse), lse
        [B, H, Lq] float32, natural log, +inf (and out 0) for rows that see no key.

    Not checked (checking would need a device sync): that every block_table entry a sequence
    uses is a valid page, that cache_batch_idx entries are valid rows, and that the entries
    of a cache_seqlens tensor plus L_new fit the capacity (an int is checked), and that
    sequences that append do not share the rows they write (repeated cache_batch_idx entries,
    or pages two block_table rows name: their appends race, as in flash-attn); a
    cache_leftpad entry past its sequence's end leaves the sequence no key (out 0, LSE +inf,
    or the sink's logit with sinks). Violating them reads or writes outside the cache (an
    illegal-address error, or another sequence's keys). Forward only: no gradients; inputs
    are not cast under ``torch.autocast`` (a cache is written in place, so it cannot be a
    cast copy). q, k and v with a strided last dim are copied (as flash-attn does); the
    caches must have a unit last stride. Caches of 2**31 elements or more run
    in launches of as many sequences as 32-bit offsets reach (contiguous caches without
    cache_batch_idx) or are indexed in 64 bits (the rest); q or new k/v that large raise
    NotImplementedError.
    """
    # A call of a seen signature skips the checks (flash_tile._plans): its arguments were
    # checked and normalised when the signature was first seen, and are kept as its plan.
    plan_key = None
    if isinstance(cache_seqlens, torch.Tensor) and alibi_slopes is None and (
            sinks is None or isinstance(sinks, torch.Tensor) and sinks.is_contiguous()):
        optional = (k, v, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin,
                    sinks, k_descale, v_descale, attn_mask)
        plan_key = _plans.key("kvcache", (q, k_cache, v_cache, cache_seqlens, *[
            t for t in optional if t is not None]), (
            tuple([t is None for t in optional]), softmax_scale, causal, window_size, softcap,
            rotary_interleaved, num_splits, return_softmax_lse), tuned=False)
        plan = _plans.find(plan_key)
        if plan is not None:
            kv_descale = None
            if k_cache.dtype == _validate.FP8_DTYPE:  # the signature fixes the cache's dtype
                kv_descale = _validate.kv_descales(k_descale, v_descale, q.shape[0],
                                                   k_cache.shape[2], q.device)
            if attn_mask is not None:  # of the checked shape: its view for the kernel
                attn_mask = _validate.decode_mask_view(attn_mask, q.shape[0], q.shape[1])
            return _run_plan(plan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             block_table, sinks, cache_leftpad, rotary_cos, rotary_sin,
                             rotary_interleaved, return_softmax_lse, kv_descale, attn_mask)
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("q must be [batch, seqlen, heads, head_dim] and the caches 4-D, got "
                         f"shapes {tuple(q.shape)}, {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, q_len, heads, head_dim = q.shape
    if q_len == 0 or batch == 0:
        raise ValueError(f"q has shape {tuple(q.shape)}: give at least one sequence and one "
                         "query row, as flash-attn")
    new = (k, v) if k is not None or v is not None else ()
    if new and (k is None or v is None):
        raise ValueError("pass both k and v (the new keys and values), or neither")
    kv_descale = _validate.check_kv_cache_dtypes(q, k_cache, v_cache, new, k_descale,
                                                 v_descale)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree but for the head dim, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _validate.check_heads(heads, k_cache.shape[2], v_cache.shape[2])
    _validate.check_head_dims(head_dim, k_cache.shape[3], v_cache.shape[3])
    scale = _validate.check_scale(1.0 / math.sqrt(head_dim) if softmax_scale is None
                                  else softmax_scale)
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0
    softcap = _validate.check_softcap(softcap)
    device = _validate.check_device(q, k_cache, v_cache, *new)
    if kv_descale is not None:
        _validate.check_fp8_capability(device, "an FP8 KV cache")
    if alibi_slopes is not None:
        alibi_slopes = _validate.check_alibi_slopes(alibi_slopes, batch, heads)
        _validate.check_device(q, alibi_slopes)
    if sinks is not None:
        sinks = _validate.check_sinks(sinks, heads, device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride (as flash-attn requires: "
                             "it is written in place)")
    if q.stride(-1) != 1 or any(t.stride(-1) != 1 for t in new):
        # copied, as flash-attn's wrapper does; such a call takes the full path every time
        # (a plan keeps no copy)
        q = _unit_last_stride(q)
        if new:
            k, v = new = tuple(map(_unit_last_stride, new))
        plan_key = None
    if block_table is not None:
        _validate.check_block_table(block_table, batch, k_cache.shape[1], cache_batch_idx,
                                    device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            cache_batch_idx = _validate.check_index_tensor(cache_batch_idx, "cache_batch_idx",
                                                           (batch,), device)
        elif k_cache.shape[0] < batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences for a batch of "
                             f"{batch}: pass cache_batch_idx or a larger cache")
        capacity = k_cache.shape[1]
    new_len = 0
    if new:
        new_len = _validate.check_new_kv(k, v, batch, k_cache, v_cache, capacity,
                                         cache_seqlens is not None)
    num_splits = _validate.check_num_splits(num_splits)
    if cache_leftpad is not None:
        cache_leftpad = _validate.check_index_tensor(cache_leftpad, "cache_leftpad", (batch,),
                                                     device)
    if attn_mask is not None:
        attn_mask = _validate.check_decode_mask(attn_mask, batch, q_len, capacity, device)
    _validate.check_decode_index(q, v_cache.shape[-1], *new,
                                 *(() if attn_mask is None else (attn_mask,)))
    q_step = 0
    if rotary_cos is not None or rotary_sin is not None:
        q_step = int(0 <= left < capacity or 0 <= right < capacity)
        # q rows past the new ones sit at positions past the appended keys
        _validate.check_rotary(rotary_cos, rotary_sin, q, capacity + q_step * max(
            q_len - new_len, 0), bool(new))
    seqlens = _seqlens(cache_seqlens, batch, capacity, new_len, device)  # an int: a fill

    if plan_key is not None:
        decode = _plans.kvcache(q, k_cache, v_cache, cache_batch_idx, block_table, softcap,
                                left, right, num_splits, bool(return_softmax_lse), sinks,
                                cache_leftpad, attn_mask is not None)
        if decode is not None:  # this call runs the plan it leaves, as later ones will
            plan = (decode, bool(new_len), scale, softcap, left, right, q_step)
            _plans.keep(plan_key, plan)
            return _run_plan(plan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             block_table, sinks, cache_leftpad, rotary_cos, rotary_sin,
                             rotary_interleaved, return_softmax_lse, kv_descale, attn_mask)
    out, lse = kvcache_attention(q, k_cache, v_cache, k if new_len else None,
                                 v if new_len else None, seqlens, cache_batch_idx, block_table,
                                 alibi_slopes, scale, softcap, left, right, num_splits,
                                 bool(return_softmax_lse), sinks, cache_leftpad,
                                 rotary_cos, rotary_sin, bool(rotary_interleaved), q_step,
                                 *(kv_descale or (None, None)), attn_mask)
    return (out, lse) if return_softmax_lse else out
