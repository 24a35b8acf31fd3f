"""The forward and backward as torch custom ops, with fake kernels and autograd, so that
torch.compile, fake tensors and autograd each see one opaque call; and the eager path to the
same implementation. ``varlen_attention`` is the packed sequences' forward and backward ops
(``flash_tile::varlen_forward`` / ``varlen_backward``), reached the same way; the KV-cache
decode's op is in ``flash_tile._ops_decode`` and the FP8 forward's in ``flash_tile._ops_fp8``.

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
else as [B, L, H, D], and the sinks' gradient (an empty tensor without sinks: an op returns
tensors); it takes the LSE's gradient too (None when nothing differentiates through the LSE).
Sinks (the ops' optional ``sinks``, [H] fp32) do not enter the tuner's problem class: a class
tuned without them launches the same tiles with them. The variants are the autotuner's choice
among the registered variants of the device's architecture and head dim, or their default
with ``FLASH_TILE_AUTOTUNE=0``
(``flash_tile.autotune``).
"""

import torch

from flash_tile import autotune, variants
from flash_tile._launch import (NO_DROPOUT, Dropout, Varlen, launch_backward, launch_forward,
                                mask_name)
from flash_tile._validate import device_properties


def _empty_blhd(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised [B, H, L, D] tensor whose memory is laid out as [B, L, H, D], in
    ``like``'s dtype unless ``dtype`` says otherwise."""
    batch, heads, length, dim = shape
    return torch.empty_strided(shape, (length * heads * dim, dim, heads * dim, 1),
                               dtype=dtype or like.dtype, device=like.device)


def _forward_outputs(q: torch.Tensor, v: torch.Tensor, return_lse: bool,
                     dtype: torch.dtype | None = None):
    """(out [B, H, Lq, Dv] laid out as [B, Lq, H, Dv] in q's dtype or ``dtype`` (the FP8
    forward's bf16), lse [B, H, Lq] fp32 or an empty tensor)."""
    batch, heads, q_len, _ = q.shape
    out = _empty_blhd((batch, heads, q_len, v.shape[-1]), q, dtype)
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
                   return_lse, dropout=NO_DROPOUT, sinks=None):
    """``run(config)``: fresh outputs (out, and the LSE or an empty tensor), one forward launch
    with ``config``; what the op launches and the autotuner times. Arguments as the op's."""
    def run(config):
        out, lse = _forward_outputs(q, v, return_lse)
        launch_forward(q, k, v, out, lse if return_lse else None, alibi_slopes, attn_mask,
                       scale, softcap, diag_offset, window, config, dropout, sinks=sinks)
        return out, lse
    return run


def _dense_dout(dout: torch.Tensor) -> torch.Tensor:
    """The output's gradient as the backward kernels read it: itself where its last stride
    is 1 and no dimension of more than one element has stride 0, else a contiguous copy. A
    broadcast one (autograd's gradient of a sum over the rows or heads is an expand, stride
    0) would hand the kernels' tensor maps a zero stride, which they have not run on."""
    if dout.stride(-1) == 1 and all(st or n == 1 for st, n in zip(dout.stride(), dout.shape)):
        return dout
    return dout.contiguous()


def _no_sinks(device: torch.device) -> torch.Tensor:
    """The sinks' gradient of a call without sinks: an empty tensor (an op returns tensors)."""
    return torch.empty((0,), dtype=torch.float32, device=device)


def _keyless_forward(out: torch.Tensor, lse: torch.Tensor, return_lse: bool,
                     sinks: torch.Tensor | None, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward where no row sees a key (no keys, or no rows): out 0, the LSE +inf or,
    with sinks, each head's sink (the one term of its rows' sums); ``head_dim`` is the LSE's
    head axis."""
    if return_lse and sinks is None:
        lse.fill_(torch.inf)
    elif return_lse:
        lse.copy_(sinks.view([-1 if d == head_dim else 1 for d in range(lse.dim())]))
    return out.zero_(), lse


def _keyless_backward(grads: tuple[torch.Tensor, ...], sinks: torch.Tensor | None,
                      dlse: torch.Tensor | None, row_dims: tuple[int, ...]
                      ) -> tuple[torch.Tensor, ...]:
    """The backward where no row sees a key (no keys, or no rows): zero gradients, and a
    sink, each row's one term there, gets the sum of its head's dLSE (dsinks[h] =
    -sum(p_sink (dO . O - dLSE)) with p_sink = 1, O = 0); ``row_dims`` are dLSE's axes other
    than the head's."""
    dsinks = (_no_sinks(grads[0].device) if sinks is None else torch.zeros_like(sinks)
              if dlse is None else dlse.float().sum(row_dims))
    return (*(g.zero_() for g in grads), dsinks)


def backward_runner(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale, softcap,
                    diag_offset, window, dropout=NO_DROPOUT, sinks=None):
    """``run(config)``: fresh (dq, dk, dv) and the sinks' gradient (empty without sinks), one
    backward launch with ``config``, as ``forward_runner``."""
    def run(config):
        dq, dk, dv = _backward_outputs(q, k, v)
        dsinks = launch_backward(dout, q, k, v, out, lse, dq, dk, dv, dlse, alibi_slopes,
                                 attn_mask, scale, softcap, diag_offset, window, config,
                                 dropout, sinks=sinks)
        return dq, dk, dv, _no_sinks(q.device) if dsinks is None else dsinks
    return run


def _class_fields(q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p,
                  batch: int | None = None) -> tuple:
    """What a call's problem class depends on beyond the pass and the GPU, in the order of
    ``autotune.problem_key``'s arguments (lengths already bucketed). With ``batch`` the
    tensors are packed varlen ones ([total, H, D], ``batch`` sequences) and the lengths are
    the mean per sequence: what decides the tiles of a packing is the typical sequence, and
    the mean is known on the host without reading cu_seqlens."""
    q_len, k_len = ((q.shape[2], k.shape[2]) if batch is None else
                    (q.shape[0] // max(batch, 1), k.shape[0] // max(batch, 1)))
    return (q.dtype, q.shape[-1], v.shape[-1], autotune.length_bucket(q_len),
            autotune.length_bucket(k_len), q.shape[1] // k.shape[1], window, softcap > 0.0,
            alibi_slopes is not None, mask_name(attn_mask), dropout_p > 0.0)


def problem_key(backward: bool, q, k, v, window, softcap, alibi_slopes, attn_mask,
                dropout_p, batch: int | None = None) -> str:
    """The autotuner's problem class of a call with these (op-level) arguments; ``batch``
    for a varlen call's packed tensors, as ``_choose``'s."""
    return autotune.problem_key(backward, device_properties(q.device)[0], *_class_fields(
        q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, batch),
        varlen=batch is not None)


def choice_is_final(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``_choose``'s answer for a call on q and k is kept for its class: not for empty
    inputs (nothing to time) nor under a CUDA-graph capture (nothing may be timed)."""
    return q.numel() != 0 and k.numel() != 0 and not torch.cuda.is_current_stream_capturing()


def _choose(backward: bool, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p,
            run, deterministic: bool = False, batch: int | None = None, written=None):
    """``_choose_final``'s variant alone."""
    return _choose_final(backward, q, k, v, window, softcap, alibi_slopes, attn_mask,
                         dropout_p, run, deterministic, batch, written)[0]


def _choose_final(backward: bool, q, k, v, window, softcap, alibi_slopes, attn_mask,
                  dropout_p, run, deterministic: bool = False, batch: int | None = None,
                  written=None) -> tuple[variants.TileConfig, bool]:
    """(variant, final): final where it is the class's answer from now on (kept in
    ``autotune.decided``; not for a call left untuned: empty, under capture, NaN inputs),
    which a plan may then keep. The variant for this call: the architecture's default for
    its class (plain scores or not, deterministic or not:
    ``variants.default_backward_config``), or the autotuner's pick among the registered
    candidates (``flash_tile.autotune``; a ``deterministic`` backward among the two-pass
    ones). ``batch``: a varlen call packing that many sequences
    (``_class_fields``), tuned as classes of their own; ``written`` as ``autotune.tune``'s.
    A call with no rows (q or k empty) launches the default untimed:
    there is nothing to time. After the first call of a problem class the answer comes from
    ``autotune.decided``, a dict hit of a few microseconds: this runs on every call."""
    fields = _class_fields(q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, batch)
    varlen = batch is not None
    problem = (backward, deterministic, varlen, q.device, *fields, autotune.settings())
    config = autotune.decided.get(problem)
    if config is not None:
        return config, True
    capability = device_properties(q.device)[0]
    plain = variants.is_plain(*fields[-4:])  # softcap, ALiBi, mask name, dropout
    configs = variants.candidates(capability, max(q.shape[-1], v.shape[-1]), backward, plain,
                                  deterministic)
    config, final = configs[0], choice_is_final(q, k)
    empty = q.numel() == 0 or k.numel() == 0
    if autotune.enabled() and len(configs) > 1 and not empty:
        key = autotune.problem_key(backward, capability, *fields, deterministic=deterministic,
                                   varlen=varlen)
        chosen = autotune.choose(key, q.device, configs, run, written)
        config, final = (configs[0], False) if chosen is None else (chosen, final)
    # Untuned (empty, under capture, NaN inputs): the next call of the class asks again.
    if final:
        autotune.decided[problem] = config
    return config, final


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  alibi_slopes: torch.Tensor | None, attn_mask: torch.Tensor | None,
                  scale: float, softcap: float, diag_offset: int, window_left: int,
                  window_right: int, return_lse: bool, dropout_p: float = 0.0,
                  dropout_seed: int = 0, sinks: torch.Tensor | None = None,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's body: choose the variant, allocate, launch. ``deterministic`` is the
    backward's (kept in the autograd context for it); the forward always is."""
    if k.shape[2] == 0:  # no keys: every row as one that sees none; nothing to launch
        return _keyless_forward(*_forward_outputs(q, v, return_lse), return_lse, sinks, 1)
    window = (window_left, window_right)
    run = forward_runner(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, window,
                         return_lse, Dropout(dropout_p, dropout_seed), sinks)
    return run(_choose(False, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, run))


forward_op = torch.library.custom_op("flash_tile::attention_forward", _forward_impl,
                                     mutates_args=(), device_types="cuda")


@forward_op.register_fake
def _attention_forward_fake(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset,
                            window_left, window_right, return_lse, dropout_p=0.0,
                            dropout_seed=0, sinks=None, deterministic=False):
    return _forward_outputs(q, v, return_lse)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                   alibi_slopes: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, scale: float, softcap: float,
                   diag_offset: int, window_left: int, window_right: int,
                   dropout_p: float = 0.0, dropout_seed: int = 0,
                   sinks: torch.Tensor | None = None, deterministic: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's body: choose the variant, allocate, launch; (dq, dk, dv, dsinks).
    ``deterministic`` (or ``torch.use_deterministic_algorithms(True)``) keeps to the two-pass
    kernels, bitwise reproducible; else the one-pass form where it is the default."""
    if q.numel() == 0 or k.shape[2] == 0:  # no query rows (Lq, B or H of 0) or no keys
        return _keyless_backward(_backward_outputs(q, k, v), sinks, dlse, (0, 2))
    dout = _dense_dout(dout)
    dlse = None if dlse is None else dlse.float().contiguous()
    window = (window_left, window_right)
    run = backward_runner(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale,
                          softcap, diag_offset, window, Dropout(dropout_p, dropout_seed), sinks)
    return run(_choose(True, q, k, v, window, softcap, alibi_slopes, attn_mask, dropout_p, run,
                       _deterministic(deterministic)))


def _deterministic(requested: bool) -> bool:
    """Whether a backward must be bitwise reproducible: asked for by the call, or by torch's
    global switch (``torch.use_deterministic_algorithms``), read when the backward runs."""
    return requested or torch.are_deterministic_algorithms_enabled()


backward_op = torch.library.custom_op("flash_tile::attention_backward", _backward_impl,
                                      mutates_args=(), device_types="cuda")


@backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, alibi_slopes, attn_mask, scale,
                             softcap, diag_offset, window_left, window_right, dropout_p=0.0,
                             dropout_seed=0, sinks=None, deterministic=False):
    return (*_backward_outputs(q, k, v),
            _no_sinks(q.device) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, left, right, _, dropout_p,
     dropout_seed, sinks, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_mask, sinks)
    ctx.scale, ctx.softcap, ctx.diag_offset = scale, softcap, diag_offset
    ctx.deterministic = deterministic
    ctx.window, ctx.dropout = (left, right), (dropout_p, dropout_seed)
    ctx.set_materialize_grads(False)


def _saved_lse(lse: torch.Tensor) -> torch.Tensor:
    """The forward's saved LSE, which the backward recomputes P from: an op called without
    ``return_lse`` saved the 1-D empty one (an LSE of no rows keeps its rank) and has no
    backward."""
    if lse.dim() == 1:
        raise RuntimeError("flash_tile: the forward ran without its LSE, so it has no backward; "
                           "call it through flash_tile's public functions")
    return lse


def _backward(ctx, dout, dlse, run_backward):
    """The gradients of the forward's 15 inputs (q, k, v's and the sinks'; None for the
    rest), by ``run_backward``: the backward op under torch.compile, its body in eager mode."""
    q, k, v, out, lse, alibi_slopes, attn_mask, sinks = ctx.saved_tensors
    if dout is None:  # only the LSE reaches the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = run_backward(dout, q, k, v, out, _saved_lse(lse), dlse, alibi_slopes,
                                      attn_mask, ctx.scale, ctx.softcap, ctx.diag_offset,
                                      *ctx.window, *ctx.dropout, sinks, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 10 + (None if sinks is None else dsinks, None)


def _op_backward(ctx, dout, dlse):
    return _backward(ctx, dout, dlse, backward_op)


forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _eager_function(forward_impl, setup_context, backward, backward_impl, backward_op):
    """A ``torch.autograd.Function`` with a forward op's body, context and backward (run by
    ``backward_impl``, the backward op's body), without the custom op's dispatch: what eager
    mode runs where a gradient is needed. A backward that builds a graph (``create_graph``:
    autograd runs it with grad mode on) takes ``backward_op`` instead, which has no backward
    of its own: differentiating the gradients then raises, as under torch.compile, where the
    body's fresh tensors would carry no graph and a second-order term would be silently 0."""
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, dout, dlse):
            run = backward_op if torch.is_grad_enabled() else backward_impl
            return backward(ctx, dout, dlse, run)
    return Eager


_EagerAttention = _eager_function(_forward_impl, _setup_context, _backward, _backward_impl,
                                  backward_op)


def _seen_by_a_tracer(*tensors: torch.Tensor) -> bool:
    """Whether anything but plain eager execution sees this call: torch.compile or export, a
    dispatch mode (make_fx, FakeTensorMode, FlopCounterMode) or a tensor subclass (fake,
    functional, distributed tensors). Those get the custom op, which they can trace and fake;
    the body would launch kernels on their tensors."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or
            any(type(t) is not torch.Tensor for t in tensors))


def attention_forward(q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset,
                      window_left, window_right, return_lse, dropout_p=0.0, dropout_seed=0,
                      sinks=None, deterministic=False):
    """(out, lse) with autograd, arguments as the ``flash_tile::attention_forward`` op's: the
    op where something traces the call (``_seen_by_a_tracer``: a graph needs the op, its fake
    and its registered autograd), else the same body through ``_EagerAttention`` where q, k or
    v needs its gradient, and the body alone where none does (inference)."""
    args = (q, k, v, alibi_slopes, attn_mask, scale, softcap, diag_offset, window_left,
            window_right, return_lse, dropout_p, dropout_seed, sinks, deterministic)
    return _dispatch(forward_op, _EagerAttention, _forward_impl, args, sinks)


def _dispatch(op, eager, impl, args, sinks):
    """Run a forward op on ``args`` (q, k, v first; ``sinks`` among them, or None): the op
    where something traces the call (``_seen_by_a_tracer``: a graph needs the op, its fake and
    its registered autograd), else the same body through the ``eager`` Function where q, k, v
    or the sinks need a gradient, and the body alone where none does (inference)."""
    q, k, v = args[:3]
    if _seen_by_a_tracer(q, k, v):
        return op(*args)
    differentiable = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in differentiable):
        return eager.apply(*args)
    return impl(*args)  # nothing to differentiate: no autograd node to build


# Varlen: packed sequences of flash_attn_varlen_func, q [total_q, H, D], k [total_k, H_kv, D],
# v [total_k, H_kv, Dv], out [total_q, H, Dv], LSE [H, total_q]; the kernels see them as
# [1, H, total, D] views. The variants are tuned as the dense ones, in classes of their own
# keyed by the mean sequence length (``_class_fields``), on the call's own packing.

def _packed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[total, H, D] tensors as the kernels' [1, H, total, D] views (no copies)."""
    return [t.transpose(0, 1)[None] for t in tensors]


def varlen_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, varlen: Varlen, return_lse: bool) -> tuple:
    """(q, k, v, out, lse) as the VARLEN switch reads them: [1, H, total, D] views of the
    packed tensors (k and v as they are, pages, under a block table), the LSE's [1, H,
    total_q] view or None without ``return_lse``."""
    q4, out4 = _packed(q, out)
    k4, v4 = _packed(k, v) if varlen.block_table is None else (k, v)
    return q4, k4, v4, out4, lse[None] if return_lse else None


def _varlen_outputs(q: torch.Tensor, v: torch.Tensor, return_lse: bool,
                    dtype: torch.dtype | None = None):
    """(out [total_q, H, Dv] in q's dtype or ``dtype``, lse [H, total_q] fp32 or an empty
    tensor); v packed [total_k, H_kv, Dv] or pages [num_blocks, page_size, H_kv, Dv]."""
    out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=dtype or q.dtype,
                      device=q.device)
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _varlen_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Uninitialised (dq, dk, dv) in the packed inputs' shapes."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _rows_written(t: torch.Tensor, cu_seqlens: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Packed ``t`` with the rows along ``dim`` that no sequence covers (before cu_seqlens[0],
    from cu_seqlens[-1] on: the kernels leave them unwritten) set to zero in place (``t`` is
    a tuning run's fresh output; no copy), on the device."""
    rows = torch.arange(t.shape[dim], device=t.device)
    covered = (rows >= cu_seqlens[0]) & (rows < cu_seqlens[-1])
    return t.masked_fill_(~covered.view(-1, *[1] * (t.dim() - dim - 1)), 0)


def _varlen_written(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, backward: bool):
    """The tuner's ``written`` for a varlen op's outputs, (out, lse [H, total_q]) or (dq, dk,
    dv, dsinks): their written rows only. Called only while tuning, so the calls pay
    nothing."""
    def written(outputs):
        if not backward:
            out, lse = outputs
            return (_rows_written(out, cu_seqlens_q),
                    _rows_written(lse, cu_seqlens_q, 1) if lse.numel() else lse)
        dq, dk, dv, dsinks = outputs
        return (_rows_written(dq, cu_seqlens_q), _rows_written(dk, cu_seqlens_k),
                _rows_written(dv, cu_seqlens_k), dsinks)
    return written


def varlen_forward_runner(q, k, v, varlen: Varlen, alibi_slopes, scale, softcap, window,
                          return_lse, dropout=NO_DROPOUT, sinks=None, descales=None):
    """``forward_runner`` of the forward's VARLEN switch: q, k, v packed [total, H, D] with
    ``varlen`` their sequences (k, v as pages [num_blocks, page_size, H_kv, D] where
    ``varlen`` has a block table: the PAGED switch, and ``descales`` an FP8 cache's factors
    as ``launch_forward`` takes them); each call fresh (out [total_q, H, Dv], LSE
    [H, total_q] or an empty tensor) and one launch."""
    def run(config):
        out, lse = _varlen_outputs(q, v, return_lse)
        launch_forward(*varlen_views(q, k, v, out, lse, varlen, return_lse), alibi_slopes,
                       None, scale, softcap, 0, window, config, dropout, varlen, sinks,
                       descales)
        return out, lse
    return run


def varlen_backward_runner(dout, q, k, v, out, lse, dlse, varlen: Varlen, alibi_slopes, scale,
                           softcap, window, dropout=NO_DROPOUT, sinks=None):
    """``backward_runner`` of the backward's VARLEN switch: tensors packed as
    ``varlen_forward_runner``'s, lse [H, total_q] and dlse [1, H, total_q] fp32 or None; each
    call fresh (dq, dk, dv, the sinks' gradient), dk and dv zeroed first under ``seqused_k``
    (the kernel does not store the unused keys' rows), and one launch."""
    def run(config):
        dq, dk, dv = _varlen_gradients(q, k, v)
        if varlen.seqused_k is not None:
            dk.zero_()
            dv.zero_()
        dsinks = launch_backward(*_packed(dout, q, k, v, out), lse[None],
                                 *_packed(dq, dk, dv), dlse, alibi_slopes, None, scale,
                                 softcap, 0, window, config, dropout, varlen, sinks)
        return dq, dk, dv, _no_sinks(q.device) if dsinks is None else dsinks
    return run


def _varlen_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         alibi_slopes: torch.Tensor | None, scale: float, softcap: float,
                         window_left: int, window_right: int, return_lse: bool,
                         dropout_p: float = 0.0, dropout_seed: int = 0,
                         sinks: torch.Tensor | None = None,
                         seqused_k: torch.Tensor | None = None, deterministic: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen forward op's body: choose the variant, allocate, launch the forward's
    VARLEN switch (``deterministic`` is the backward's, as ``_forward_impl``'s). No query rows
    or no keys (every sequence empty of them, as flash-attn's max_seqlen_k = 0): nothing to
    launch, the rows as ones that see no key (out 0, LSE +inf or the sink)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _keyless_forward(*_varlen_outputs(q, v, return_lse), return_lse, sinks, 0)
    window, varlen = (window_left, window_right), Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k)
    run = varlen_forward_runner(q, k, v, varlen, alibi_slopes, scale, softcap, window,
                                return_lse, Dropout(dropout_p, dropout_seed), sinks)
    return run(_choose(False, q, k, v, window, softcap, alibi_slopes, None, dropout_p, run,
                       batch=varlen.batch,
                       written=_varlen_written(cu_seqlens_q, cu_seqlens_k, False)))


varlen_forward_op = torch.library.custom_op("flash_tile::varlen_forward", _varlen_forward_impl,
                                            mutates_args=(), device_types="cuda")


@varlen_forward_op.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, scale, softcap,
                         window_left, window_right, return_lse, dropout_p=0.0, dropout_seed=0,
                         sinks=None, seqused_k=None, deterministic=False):
    return _varlen_outputs(q, v, return_lse)


def _varlen_backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, alibi_slopes: torch.Tensor | None,
                          scale: float, softcap: float, window_left: int, window_right: int,
                          dropout_p: float = 0.0, dropout_seed: int = 0,
                          sinks: torch.Tensor | None = None,
                          seqused_k: torch.Tensor | None = None, deterministic: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen backward op's body: choose the variant, allocate, launch; dq, dk, dv in the
    inputs' shapes and the sinks' gradient (empty without sinks), by the backward's VARLEN
    switch. Rows that no sequence covers are left unwritten; with ``seqused_k`` the keys past
    each sequence's used ones get zero gradients (the kernel does not store them). No query
    rows or no keys launch nothing (as the forward): zero gradients, and a sink, each row's
    one term where there are no keys, gets the sum of its head's dLSE."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _keyless_backward(_varlen_gradients(q, k, v), sinks, dlse, (1,))
    dout = _dense_dout(dout)
    dlse = None if dlse is None else dlse.float().contiguous()[None]
    window, varlen = (window_left, window_right), Varlen(cu_seqlens_q, cu_seqlens_k, seqused_k)
    run = varlen_backward_runner(dout, q, k, v, out, lse, dlse, varlen, alibi_slopes, scale,
                                 softcap, window, Dropout(dropout_p, dropout_seed), sinks)
    return run(_choose(True, q, k, v, window, softcap, alibi_slopes, None, dropout_p, run,
                       _deterministic(deterministic), varlen.batch,
                       _varlen_written(cu_seqlens_q, cu_seqlens_k, True)))


varlen_backward_op = torch.library.custom_op("flash_tile::varlen_backward",
                                             _varlen_backward_impl, mutates_args=(),
                                             device_types="cuda")


@varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                          alibi_slopes, scale, softcap,
                          window_left, window_right, dropout_p=0.0, dropout_seed=0,
                          sinks=None, seqused_k=None, deterministic=False):
    return (*_varlen_gradients(q, k, v),
            _no_sinks(q.device) if sinks is None else torch.empty_like(sinks))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, alibi_slopes, scale, softcap, left, right, _, dropout_p,
     dropout_seed, sinks, seqused_k, deterministic) = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi_slopes, sinks, seqused_k)
    ctx.scale, ctx.softcap = scale, softcap
    ctx.window, ctx.dropout = (left, right), (dropout_p, dropout_seed)
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse, run_backward):
    """The gradients of the varlen forward's 16 inputs (q, k, v's and the sinks'; None for
    the rest)."""
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks, seqused_k = ctx.saved_tensors
    if dout is None:  # only the LSE reaches the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = run_backward(dout, q, k, v, out, _saved_lse(lse), dlse, cu_q, cu_k,
                                      alibi_slopes, ctx.scale, ctx.softcap,
                                      *ctx.window, *ctx.dropout, sinks, seqused_k,
                                      ctx.deterministic)
    return (dq, dk, dv) + (None,) * 10 + (None if sinks is None else dsinks, None, None)


def _varlen_op_backward(ctx, dout, dlse):
    return _varlen_backward(ctx, dout, dlse, varlen_backward_op)


varlen_forward_op.register_autograd(_varlen_op_backward, setup_context=_varlen_setup_context)
_EagerVarlen = _eager_function(_varlen_forward_impl, _varlen_setup_context, _varlen_backward,
                               _varlen_backward_impl, varlen_backward_op)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, scale, softcap,
                     window_left, window_right, return_lse, dropout_p=0.0, dropout_seed=0,
                     sinks=None, seqused_k=None, deterministic=False):
    """(out, lse) of ``flash_attn_varlen_func`` with autograd, arguments as the
    ``flash_tile::varlen_forward`` op's (the LSE is needed for a gradient: the public
    function asks for it then); dispatched as ``attention_forward``."""
    return _dispatch(varlen_forward_op, _EagerVarlen, _varlen_forward_impl,
                     (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, scale, softcap,
                      window_left, window_right, return_lse, dropout_p, dropout_seed, sinks,
                      seqused_k, deterministic), sinks)


def op_or_body(op, impl, args: tuple):
    """``op(*args)`` where something traces the call (a graph needs the op and its fake),
    else ``impl(*args)``, the op's body: for the forward-only ops (no autograd to build);
    ``args`` begin with three tensors (q, k, v or q and the caches)."""
    return op(*args) if _seen_by_a_tracer(*args[:3]) else impl(*args)
