"""The forward and backward as torch custom ops, with fake kernels and autograd, so that
torch.compile, fake tensors and autograd each see one opaque call; and the eager path to the
same implementation. ``kvcache_attention`` is the KV-cache decode's op (forward only; it
mutates the caches it appends to), reached the same way.

``attention_forward`` is what the public functions call: the custom op
``flash_tile::attention_forward`` where something traces the call (torch.compile, export,
make_fx, a dispatch mode, tensor subclasses); in plain eager mode the op's own body, inside
a ``torch.autograd.Function`` with the same context and backward when a gradient is needed.
All run the same code and launch the same kernels; the eager path only skips the
dispatcher's work for a Python custom op, which costs more than the small problems' kernels
do (H200 host, 2026-12-01, commit e164690: 84 / 170 us per call through the op without / with
a gradient, 48 / 68 us eager; docs/experiments/evidence/2026-12-01-launch-h200-e164690.md).

``attention_forward`` takes [B, H, L, D] views (any strides with a unit last stride; K/V may
have fewer heads, GQA) and returns the output as [B, H, Lq, Dv] whose memory is laid out as
[B, Lq, H, Dv] (flash-attn's layout, and what torch's own flash backend returns), plus the LSE
[B, H, Lq] fp32 when ``return_lse`` (else an empty tensor; the public functions ask for it
whenever a gradient will be needed, since the backward recomputes P from it).
``attention_backward`` returns dQ, dK, dV laid out as their inputs where those are contiguous,
else as [B, L, H, D]; it takes the LSE's gradient too (None when nothing differentiates through
the LSE). The variants are the autotuner's choice among the registered variants of the
device's architecture and head dim, or their default with ``FLASH_TILE_AUTOTUNE=0``
(``flash_tile.autotune``).
"""

import torch

from flash_tile import autotune, variants
from flash_tile._launch import (NO_DROPOUT, Dropout, launch_backward, launch_cache_append,
                                launch_decode, launch_forward, mask_name)
from flash_tile._validate import device_properties


def _empty_blhd(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, H, L, D] tensor whose memory is laid out as [B, L, H, D]."""
    batch, heads, length, dim = shape
    return torch.empty_strided(shape, (length * heads * dim, dim, heads * dim, 1),
                               dtype=like.dtype, device=like.device)


def _forward_outputs(q: torch.Tensor, v: torch.Tensor, return_lse: bool):
    batch, heads, q_len, _ = q.shape
    out = _empty_blhd((batch, heads, q_len, v.shape[-1]), q)
    lse_shape = (batch, heads, q_len) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _gradient_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient for ``t``: laid out as ``t`` where that is contiguous (autograd
    copies a leaf's gradient whose strides differ from the leaf's, three copies a backward for
    [B, H, L, D] inputs), else as [B, L, H, D] (flash-attn's layout, and that of a transposed
    [B, L, H, D] input)."""
    return torch.empty_like(t) if t.is_contiguous() else _empty_blhd(t.shape, t)


def _backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return _gradient_like(q), _gradient_like(k), _gradient_like(v)


def forward_runner(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, window,
                   return_lse, dropout=NO_DROPOUT):
    """``run(config)``: fresh outputs (out, and the LSE or an empty tensor), one forward launch
    with ``config``; what the op launches and the autotuner times. Arguments as the op's."""
    def run(config):
        out, lse = _forward_outputs(q, v, return_lse)
        launch_forward(q, k, v, out, lse if return_lse else None, alibi_slopes, attn_mask,
                       scale, softcap, diag_offset, window, config, dropout)
        return out, lse
    return run


def backward_runner(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale, softcap,
                    diag_offset, window, dropout=NO_DROPOUT):
    """``run(config)``: fresh (dq, dk, dv), one backward launch with ``config``, as
    ``forward_runner``."""
    def run(config):
        dq, dk, dv = _backward_outputs(q, k, v)
        launch_backward(dout, q, k, v, out, lse, dq, dk, dv, dlse, alibi_slopes, attn_mask,
                        scale, softcap, diag_offset, window, config, dropout)
        return dq, dk, dv
    return run


def _class_fields(q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p) -> tuple:
    """What a call's problem class depends on beyond the pass and the GPU, in the order of
    ``autotune.problem_key``'s arguments (lengths already bucketed)."""
    return (q.dtype, q.shape[-1], v.shape[-1], autotune.length_bucket(q.shape[2]),
            autotune.length_bucket(k.shape[2]), q.shape[1] // k.shape[1], window, softcap > 0.0,
            alibi_slopes is not None, mask_name(attn_mask), dropout_p > 0.0)


def problem_key(backward: bool, q, k, v, window, softcap, alibi_slopes, attn_mask,
                dropout_p) -> str:
    """The autotuner's problem class of a call with these (op-level) arguments."""
    return autotune.problem_key(backward, device_properties(q.device)[0], *_class_fields(
        q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p))


def _choose(backward: bool, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p,
            run):
    """The tile variant for this call: the architecture's default for its class (plain scores
    or not: ``variants.default_backward_config``), or the autotuner's pick among the
    registered candidates (``flash_tile.autotune``). After the first call of a
    problem class the answer comes from ``autotune.decided``, a dict hit of a few
    microseconds: this runs on every call."""
    fields = _class_fields(q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p)
    problem = (backward, q.device, *fields, autotune.settings())
    config = autotune.decided.get(problem)
    if config is None:
        capability = device_properties(q.device)[0]
        plain = variants.is_plain(*fields[-4:])  # softcap, ALiBi, mask name, dropout
        configs = variants.candidates(capability, max(q.shape[-1], v.shape[-1]), backward,
                                      plain)
        config = configs[0]
        if autotune.enabled() and len(configs) > 1:
            key = autotune.problem_key(backward, capability, *fields)
            config = autotune.choose(key, q.device, configs, run)
        if not torch.cuda.is_current_stream_capturing():  # untuned under capture: ask again
            autotune.decided[problem] = config
    return config


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  alibi_slopes: torch.Tensor | None, attn_mask: torch.Tensor | None,
                  scale: float, softcap: float, diag_offset: int, window_left: int,
                  window_right: int, return_lse: bool, dropout_p: float = 0.0,
                  dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's body: choose the variant, allocate, launch."""
    window = (window_left, window_right)
    run = forward_runner(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, window,
                         return_lse, Dropout(dropout_p, dropout_seed))
    return run(_choose(False, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, run))


forward_op = torch.library.custom_op("flash_tile::attention_forward", _forward_impl,
                                     mutates_args=(), device_types="cuda")


@forward_op.register_fake
def _attention_forward_fake(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset,
                            window_left, window_right, return_lse, dropout_p=0.0,
                            dropout_seed=0):
    return _forward_outputs(q, v, return_lse)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                   alibi_slopes: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, scale: float, softcap: float,
                   diag_offset: int, window_left: int, window_right: int,
                   dropout_p: float = 0.0, dropout_seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's body: choose the variant, allocate, launch."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    window = (window_left, window_right)
    run = backward_runner(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale,
                          softcap, diag_offset, window, Dropout(dropout_p, dropout_seed))
    return run(_choose(True, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, run))


backward_op = torch.library.custom_op("flash_tile::attention_backward", _backward_impl,
                                      mutates_args=(), device_types="cuda")


@backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale,
                             softcap, diag_offset, window_left, window_right, dropout_p=0.0,
                             dropout_seed=0):
    return _backward_outputs(q, k, v)


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, left, right, _, dropout_p,
     dropout_seed) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_mask)
    ctx.scale, ctx.softcap, ctx.diag_offset = scale, softcap, diag_offset
    ctx.window, ctx.dropout = (left, right), (dropout_p, dropout_seed)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, run_backward):
    """The gradients of the forward's 13 inputs (q, k, v's; None for the rest), by
    ``run_backward``: the backward op under torch.compile, its body in eager mode."""
    q, k, v, out, lse, alibi_slopes, attn_mask = ctx.saved_tensors
    if dout is None:  # only the LSE reaches the loss
        dout = torch.zeros_like(out)
    if lse.numel() == 0:
        raise RuntimeError("flash_tile: the forward ran without its LSE, so it has no backward; "
                           "call it through flash_tile's public functions")
    dq, dk, dv = run_backward(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, ctx.scale,
                              ctx.softcap, ctx.diag_offset, *ctx.window, *ctx.dropout)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def _op_backward(ctx, dout, dlse):
    return _backward(ctx, dout, dlse, backward_op)


forward_op.register_autograd(_op_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The forward op's body and autograd, without the custom op's dispatch (eager mode)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, _backward_impl)


def _seen_by_a_tracer(*tensors: torch.Tensor) -> bool:
    """Whether anything but plain eager execution sees this call: torch.compile or export, a
    dispatch mode (make_fx, FakeTensorMode, FlopCounterMode) or a tensor subclass (fake,
    functional, distributed tensors). Those get the custom op, which they can trace and fake;
    the body would launch kernels on their tensors."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or
            any(type(t) is not torch.Tensor for t in tensors))


def attention_forward(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset,
                      window_left, window_right, return_lse, dropout_p=0.0, dropout_seed=0):
    """(out, lse) with autograd, arguments as the ``flash_tile::attention_forward`` op's: the
    op where something traces the call (``_seen_by_a_tracer``: a graph needs the op, its fake
    and its registered autograd), else the same body through ``_EagerAttention`` where q, k or
    v needs its gradient, and the body alone where none does (inference)."""
    args = (q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, window_left,
            window_right, return_lse, dropout_p, dropout_seed)
    if _seen_by_a_tracer(q, k, v):
        return forward_op(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(*args)
    return _forward_impl(*args)  # nothing to differentiate: no autograd node to build


def _decode_outputs(q: torch.Tensor, v_head_dim: int, return_lse: bool):
    """(out [B, Lq, H, Dv] in q's dtype, lse [B, H, Lq] fp32 or an empty tensor)."""
    batch, q_len, heads, _ = q.shape
    out = torch.empty((batch, q_len, heads, v_head_dim), dtype=q.dtype, device=q.device)
    lse_shape = (batch, heads, q_len) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k: torch.Tensor | None, v: torch.Tensor | None, cache_seqlens: torch.Tensor,
                  cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                  window_left: int, window_right: int, num_splits: int,
                  return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV-cache op's body: append k/v (when given) into the caches at cache_seqlens, then
    attend (``flash_tile.kvcache.flash_attn_with_kvcache`` checked every argument)."""
    out, lse = _decode_outputs(q, v_cache.shape[-1], return_lse)
    new_len = 0 if k is None else k.shape[1]
    if new_len:
        launch_cache_append(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table)
    config = variants.default_decode_config(device_properties(q.device)[0],
                                            max(q.shape[-1], v_cache.shape[-1]))
    launch_decode(q, k_cache, v_cache, out, lse if return_lse else None, cache_seqlens,
                  cache_batch_idx, block_table, alibi_slopes, scale, softcap,
                  (window_left, window_right), new_len, num_splits, config)
    return out, lse


kvcache_op = torch.library.custom_op("flash_tile::kvcache_attention", _kvcache_impl,
                                     mutates_args=("k_cache", "v_cache"), device_types="cuda")


@kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                  alibi_slopes, scale, softcap, window_left, window_right, num_splits,
                  return_lse):
    return _decode_outputs(q, v_cache.shape[-1], return_lse)


def kvcache_attention(*args):
    """(out, lse) of ``flash_attn_with_kvcache``, arguments as the
    ``flash_tile::kvcache_attention`` op's: the op where something traces the call (a graph
    needs it and its fake, which declares the caches mutated by the append), else its body."""
    q, k_cache, v_cache = args[:3]
    if _seen_by_a_tracer(q, k_cache, v_cache):
        return kvcache_op(*args)
    return _kvcache_impl(*args)
