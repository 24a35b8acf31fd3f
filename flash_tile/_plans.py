"""Call plans: the host's fast path for an inference call whose signature was seen before.

Everything a call settles before its launches (the checks, the variant, the grid, the
kernel, every launch argument but the call's own arrays) depends only on its tensors'
metadata (shape, strides, dtype, device), its other arguments and, where a tuner's choice is
in it, the tuner's environment (``autotune.settings``). The public functions run every check
and choice on a signature's first call and keep the outcome as a plan, keyed by that
signature: for the forward a
``ForwardPlan`` (a later call allocates its outputs and launches it, nothing
else), for ``flash_attn_varlen_func`` (packed or paged) a ``VarlenPlan`` (the same, the
sequences' arrays by address too), for ``flash_attn_with_kvcache`` its checked arguments and
an ``AddressedDecode`` (a later call launches the append and the decode plan, its arrays by
address). On an
H200's host that took a ``flash_attn_func`` call from 85 to 33-44 us and a decode step from
122 to 67-68 us, torch's SDPA taking 18-25 us (2026-12-03,
docs/experiments/evidence/2026-12-03-launch-plans-h200.md). A key is only made where that is
sound: plain tensors (no tensor subclass) on a CUDA device in eager mode (no torch.compile
or other tracer, no dispatch mode), no autograd to record (no input needs its gradient, or
grad mode is off) and autocast off.
The callers add their own conditions (for the forwards: no ALiBi, mask, sinks or dropout,
nothing in FP8 but a paged call's FP8 cache, unit last strides); every other call takes the
full path each time, as does a call whose key is new.

The plans live in ``autotune.plans`` beside the choices they were made from, and
``autotune.clear_memory_cache`` forgets both.
"""

import torch

from flash_tile import _launch_decode, _ops, _ops_decode, autotune
from flash_tile._arrays import TYPESTRS, Array, layout
from flash_tile._launch import (ABSENT, CACHE_DESCALE_SLOTS, NO_DROPOUT, SEQUENCE_SLOTS, Varlen,
                                forward_launch, launch_on)
from flash_tile.variants import TileConfig

#: A process that meets more signatures than this starts its plans over.
MAX_PLANS = 1024


class ForwardPlan:
    """A forward launch with everything but its q, k, v, out and LSE settled: the grid, the
    kernel and the rest of the argument tuple (``ABSENT`` ints, scalars, constants) that
    ``forward_launch`` built for one call signature, the layouts of the five arrays as the
    kernel reads them (``_arrays.layout``), and the outputs' (shape, strides) for
    ``torch.empty_strided``, as the planned call had them: out [B, Lq, H, Dv] contiguous
    (``out``) or, the same memory, as its [B, H, Lq, Dv] view (``out_bhld``: SDPA's layout,
    which the kernel writes), and the LSE [B, H, Lq] contiguous or None. Valid for every
    call of that signature (the same shapes, strides, dtypes, device and scalars) without
    ALiBi, a mask, varlen, sinks, dropout or FP8, whose arrays or seeds change from call to
    call (``flash_tile._plans``)."""

    __slots__ = ("grid", "kernel", "tail", "layouts", "device", "dtype", "out", "out_bhld",
                 "lse", "no_lse")

    def __init__(self, grid: tuple, kernel, args: tuple, out: torch.Tensor,
                 lse: torch.Tensor | None):
        self.grid, self.kernel, self.tail = grid, kernel, args[5:]
        # (None for e4m3 pages, which only a VarlenPlan passes, as tensors)
        self.layouts = tuple(layout(t) if t.dtype in TYPESTRS else None for t in args[:4]) + \
            (None if lse is None else layout(lse),)
        self.device, self.dtype = out.device, out.dtype
        # The first call's own outputs (``_ops._forward_outputs``), as later ones allocate them.
        self.out_bhld = tuple(out.shape), out.stride()
        self.out = tuple(out.transpose(1, 2).shape), out.transpose(1, 2).stride()
        self.lse = None if lse is None else (tuple(lse.shape), lse.stride())
        # What a call without an LSE passes: ABSENT, or the 64-bit entry point's placeholder.
        self.no_lse = args[4] if lse is None else None

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None) -> None:
        """``launch_forward`` of the planned call on these arrays, each passed by address in
        the plan's layout (``_arrays.Array``): q, k, v and out as the call's [B, L, H, D]
        tensors or their [B, H, L, D] views alike. Their layouts are not read: the caller
        vouches for them (a call whose plan key equals the planned call's)."""
        q_layout, k_layout, v_layout, out_layout, lse_layout = self.layouts
        launch_on(self.device, self.grid, self.kernel,
                  (Array(q_layout, q.data_ptr()), Array(k_layout, k.data_ptr()),
                   Array(v_layout, v.data_ptr()), Array(out_layout, out.data_ptr()),
                   self.no_lse if lse is None else Array(lse_layout, lse.data_ptr()),
                   *self.tail))


def forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, scale: float, softcap: float, diag_offset: int,
                 window: tuple[int, int], config: TileConfig) -> ForwardPlan:
    """The plan of a plain forward (no ALiBi, mask, varlen, sinks, dropout or FP8) with these
    arrays and scalars, arguments as ``launch_forward``'s; out must be laid out as
    [B, Lq, H, Dv] (the plan's outputs are)."""
    grid, kernel, args = forward_launch(q, k, v, out, lse, None, None, scale, softcap,
                                        diag_offset, window, config)
    return ForwardPlan(grid, kernel, args, out, lse)


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.get_device()


def key(entry: str, tensors: tuple, arguments: tuple, tuned: bool = True) -> tuple | None:
    """The plan key of a call of ``entry`` on ``tensors`` with the other ``arguments`` (which
    decide everything but the tensors' metadata), or None where the call must take the full
    path (see the module's docstring). ``tuned``: the plan holds a tuner's choice, so the
    tuner's environment is part of the key (two ``os.environ`` reads, 1 us of a decode step's
    10-16 us of Python on a CPU host; the decode's tiles are the architecture's default)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return None
    if type(tensors[0]) is not torch.Tensor or tensors[0].get_device() < 0:
        return None  # not a CUDA call: the full path says what is wrong with it
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return None
    if torch.is_autocast_enabled("cuda"):
        return None
    if tuned:
        return (entry, *map(_tensor_key, tensors), *arguments, autotune.settings())
    return (entry, *map(_tensor_key, tensors), *arguments)


def find(plan_key: tuple | None):
    """The plan kept for ``plan_key``, or None (no key, a new one, or an unhashable
    argument, such as a list for a window, which then takes the full path every call)."""
    if plan_key is None:
        return None
    try:
        return autotune.plans.get(plan_key)
    except TypeError:
        return None


def sighted(plan_key: tuple | None) -> bool:
    """Whether ``plan_key`` was met before, recording it if not: a varlen call plans from a
    signature's second call, since a serving batch's packing (its totals in the key) may
    change every call, and a plan a call would only fill and clear the store."""
    if plan_key is None:
        return False
    try:
        if plan_key in autotune.sighted:
            return True
        if len(autotune.sighted) >= MAX_PLANS:
            autotune.sighted.clear()
        autotune.sighted.add(plan_key)
    except TypeError:  # an unhashable argument: never planned
        pass
    return False


def keep(plan_key: tuple | None, plan) -> None:
    """Keep ``plan`` (None: nothing to keep) for later calls with ``plan_key``."""
    if plan_key is None or plan is None:
        return
    if len(autotune.plans) >= MAX_PLANS:
        autotune.plans.clear()
    try:
        autotune.plans[plan_key] = plan
    except TypeError:
        pass


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
            diag_offset: int, window_left: int, window_right: int, return_lse: bool):
    """A plain inference forward (no ALiBi, mask, sinks or dropout; nothing to differentiate)
    on checked [B, H, L, D] views, as ``_ops._forward_impl`` runs it, and its plan:
    (out, lse, plan) with out [B, Lq, H, Dv] (the layout flash-attn returns), lse [B, H, Lq]
    fp32 or None, and plan a ``ForwardPlan`` for later calls of the same signature
    (``run_forward``), or None where the choice is not final (empty inputs, or a capture:
    ``_ops.choice_is_final``). With no keys the op's body answers (it launches nothing)."""
    if k.shape[2] == 0:
        out, lse = _ops._forward_impl(q, k, v, None, None, scale, softcap, diag_offset,
                                      window_left, window_right, return_lse)
        return out.transpose(1, 2), lse if return_lse else None, None
    window = (window_left, window_right)
    run = _ops.forward_runner(q, k, v, None, None, scale, softcap, diag_offset, window,
                              return_lse)
    config, final = _ops._choose_final(False, q, k, v, window, softcap, None, None, 0.0, run)
    out, lse = _ops._forward_outputs(q, v, return_lse)
    lse = lse if return_lse else None
    plan = forward_plan(q, k, v, out, lse, scale, softcap, diag_offset, window, config)
    plan.launch(q, k, v, out, lse)
    return out.transpose(1, 2), lse, plan if final and _ops.choice_is_final(q, k) else None


class VarlenPlan(ForwardPlan):
    """A ``ForwardPlan`` of a packed (or paged) inference forward: the sequences' arrays
    (``_launch.SEQUENCE_SLOTS``: cu_seqlens_q, cu_seqlens_k, seqused_k, the block table, those
    the planned call passed) and an FP8 cache's descale factors
    (``_launch.CACHE_DESCALE_SLOTS``) go by address as well, in the planned call's layouts;
    the outputs are the packed [1, H, total_q, Dv] and [1, H, total_q] views the kernel
    writes. An FP8 cache's float8_e4m3fn pages go as the tensors themselves: the interface
    has no type string for e4m3 (``_arrays.TYPESTRS``)."""

    __slots__ = ("call_layouts",)

    def __init__(self, grid: tuple, kernel, args: tuple, out: torch.Tensor,
                 lse: torch.Tensor | None):
        super().__init__(grid, kernel, args, out, lse)
        self.call_layouts = tuple((i, layout(args[i]))
                                  for i in (*SEQUENCE_SLOTS, *CACHE_DESCALE_SLOTS)
                                  if isinstance(args[i], torch.Tensor))
        # Every call passes its own: the first call's tensors are not kept alive.
        passed = {slot for slot, _ in self.call_layouts}
        self.tail = tuple(ABSENT if i + 5 in passed else arg for i, arg in enumerate(self.tail))

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, arrays: tuple = ()) -> None:
        """``ForwardPlan.launch`` with ``arrays``, the call's arrays of the plan's slots in
        their order (cu_seqlens_q, then those of cu_seqlens_k, seqused_k, the block table and
        the descale factors the planned call had)."""
        tail = list(self.tail)
        for (slot, slot_layout), t in zip(self.call_layouts, arrays, strict=True):
            tail[slot - 5] = Array(slot_layout, t.data_ptr())
        q_layout, k_layout, v_layout, out_layout, lse_layout = self.layouts
        launch_on(self.device, self.grid, self.kernel,
                  (Array(q_layout, q.data_ptr()),
                   k if k_layout is None else Array(k_layout, k.data_ptr()),
                   v if v_layout is None else Array(v_layout, v.data_ptr()),
                   Array(out_layout, out.data_ptr()),
                   self.no_lse if lse is None else Array(lse_layout, lse.data_ptr()), *tail))


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: Varlen, scale: float,
           softcap: float, window: tuple[int, int], return_lse: bool,
           config: TileConfig | None = None, kv_descale: tuple | None = None):
    """A plain inference forward of packed sequences (no ALiBi, sinks, dropout or FP8 q) on
    checked [total, H, D] tensors with unit last strides (k and v pages under
    ``sequences.block_table``, with ``kv_descale`` their (k, v) [B, H_kv] fp32 factor views
    where they are an FP8 cache), as the varlen op's body runs it (the paged op's with its
    ``config``, which is then never tuned), and its plan: (out [total_q, H, Dv], lse
    [H, total_q] or None, a ``VarlenPlan`` for ``run_varlen`` or None where the choice is not
    final). No query rows or no keys: the op's body answers (it launches nothing)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        out, lse = _ops._keyless_forward(*_ops._varlen_outputs(q, v, return_lse), return_lse,
                                         None, 0)
        return out, lse if return_lse else None, None
    final = True  # a config given (the paged tile) is never tuned
    if config is None:
        run = _ops.varlen_forward_runner(q, k, v, sequences, None, scale, softcap, window,
                                         return_lse)
        config, final = _ops._choose_final(
            False, q, k, v, window, softcap, None, None, 0.0, run, batch=sequences.batch,
            written=_ops._varlen_written(sequences.cu_seqlens_q, sequences.cu_seqlens_k,
                                         False))
    out, lse = _ops._varlen_outputs(q, v, return_lse)
    views = _ops.varlen_views(q, k, v, out, lse, sequences, return_lse)
    descales = None if kv_descale is None else (None, *kv_descale)
    plan = VarlenPlan(*forward_launch(*views, None, None, scale, softcap, 0, window, config,
                                      NO_DROPOUT, sequences, None, descales), *views[3:])
    plan.launch(q, k, v, out, views[4], call_arrays(sequences, kv_descale or ()))
    keep = final and _ops.choice_is_final(q, k)
    return out, lse if return_lse else None, plan if keep else None


def call_arrays(sequences: Varlen, kv_descale: tuple = ()) -> tuple:
    """The arrays of ``VarlenPlan``'s slots, in order: the sequences' (those given), then an
    FP8 cache's k and v descale factors (``kv_descale``, as tensors of the planned call's
    metadata: their first call's views, or the tensors the views were made of)."""
    return tuple(t for t in (sequences.cu_seqlens_q, sequences.cu_seqlens_k,
                             sequences.seqused_k, sequences.block_table)
                 if t is not None) + tuple(kv_descale)


def run_varlen(plan: VarlenPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               arrays: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [total_q, H, Dv], lse [H, total_q] or None) of a planned varlen forward on q, k,
    v and ``arrays`` (``call_arrays``') of a call with the plan's signature: fresh outputs,
    one launch."""
    # The kernel's [1, total_q, H, Dv] and [1, H, total_q] layouts without the leading 1.
    (shape, strides), device = plan.out, plan.device
    out = torch.empty_strided(shape[1:], strides[1:], dtype=plan.dtype, device=device)
    lse = None if plan.lse is None else torch.empty_strided(*(x[1:] for x in plan.lse),
                                                            dtype=torch.float32, device=device)
    plan.launch(q, k, v, out, lse, arrays)
    return out, lse


def outputs(plan, bhld: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fresh outputs of a planned forward: out [B, Lq, H, Dv], contiguous, or with ``bhld``
    its [B, H, Lq, Dv] view (SDPA's layout), and the LSE [B, H, Lq] fp32 where the plan
    stores one, else None. ``torch.empty_strided`` takes about 1.6 us of a CPU host's time
    where ``torch.empty`` with its keywords takes 2.2-2.4 and a transpose 1.5 more
    (2026-12-07)."""
    shape, strides = plan.out_bhld if bhld else plan.out
    out = torch.empty_strided(shape, strides, dtype=plan.dtype, device=plan.device)
    return out, (None if plan.lse is None else
                 torch.empty_strided(*plan.lse, dtype=torch.float32, device=plan.device))


def run_forward(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bhld: bool = False):
    """(out, lse or None) of a planned forward (``forward``'s plan) on the q, k and v of a
    call with the plan's signature, as [B, L, H, D] tensors or [B, H, L, D] views alike (the
    launch reads their addresses): fresh outputs (``outputs``: out [B, Lq, H, Dv], or its
    [B, H, Lq, Dv] view with ``bhld``), one launch."""
    out, lse = outputs(plan, bhld)
    plan.launch(q, k, v, out, lse)
    return out, lse


def kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
            softcap: float, window_left: int, window_right: int, num_splits: int,
            return_lse: bool, sinks: torch.Tensor | None = None,
            cache_leftpad: torch.Tensor | None = None, attn_mask: bool = False):
    """The decode plan (``_launch_decode.decode_plan``) of a checked KV-cache call without
    ALiBi, as an ``AddressedDecode`` (its arrays by address from the second call on), for
    ``run_kvcache`` on this call and later ones of its signature; None where none is kept
    (the batch runs in launches that 32-bit offsets reach)."""
    plan = _launch_decode.decode_plan(q, k_cache, v_cache, return_lse, cache_batch_idx,
                                      block_table, None, softcap, (window_left, window_right),
                                      num_splits, _ops_decode.decode_config(q, v_cache), sinks,
                                      cache_leftpad, attn_mask)
    return None if plan is None else AddressedDecode(plan)


class AddressedDecode:
    """A decode plan (``_launch_decode.decode_plan``) and its append for the calls of one
    ``flash_attn_with_kvcache`` signature (``key``: the shapes, strides and dtypes of every
    array), passing each array by address (``_arrays.Array``) in the layout the kernels read
    on the signature's first call: no views of q, out, the LSE or the sinks, no DLPack export
    inside ``ct.launch``, and the append's grid and constants worked out once. A signature
    with a mask or an FP8 cache launches its tensors on every call (e4m3 has no type string
    cuTile reads; a mask's form, ``_launch.kernel_mask``, depends on its address). On a
    2-core CPU host with a stub driver a planned step took 0.88-0.96x the host time it took
    with tensors (2026-12-07, docs/experiments/evidence/2026-12-07-decode-arrays-cpu.md)."""

    __slots__ = ("plan", "layouts", "output_layouts", "append_layouts", "append_tail")

    def __init__(self, plan):
        self.plan = plan
        # Per array slot (``_DecodePlan.arrays``', ``_launch_decode.APPEND_ARRAYS``) its
        # layout or None where ABSENT, recorded on the first call; () for a signature of
        # tensors.
        self.layouts = self.append_layouts = None
        self.output_layouts = None  # out's and the LSE's, for a split step's combine
        self.append_tail = None  # the append's grid, kernel and arguments past its arrays

    @property
    def out_view(self) -> tuple:
        return self.plan.out_view

    @property
    def int64_index(self) -> bool:
        return self.plan.int64_index

    def launch(self, q, k_cache, v_cache, out, lse, seqlens_k, batch_idx, block_table,
               alibi_slopes, scale, softcap, window, new_len, sinks=None, leftpad=None,
               kv_descale=None, attn_mask=None) -> None:
        """The decode plan's ``launch`` (arguments as ``_launch_decode.launch_decode``'s) for
        a call of the signature; its arrays' layouts are not read after the first call: the
        caller vouches for them (a call whose plan key equals the first's)."""
        plan = self.plan
        if not self.layouts:  # None: the signature's first call; (): one of tensors
            arrays = plan.arrays(q, k_cache, v_cache, out, lse, seqlens_k, batch_idx,
                                 block_table, alibi_slopes, sinks, leftpad, kv_descale,
                                 attn_mask)
            if self.layouts is None:
                # (the by-address launch below passes ABSENT for these four)
                layouts = _layouts(arrays, (out, lse), alibi_slopes is None and
                                   attn_mask is None and kv_descale is None)
                if layouts and plan.splits > 1:
                    self.output_layouts = (layout(out), None if lse is None else layout(lse))
                self.layouts = layouts
            plan.launch_arrays(arrays, out, lse, scale, softcap, window, new_len, q.device)
            return
        # Slot by slot: a loop over (layout, tensor) pairs cost a step 1.06-1.09x the host time
        # (docs/experiments/evidence/2026-12-07-decode-arrays-cpu.md, last section).
        q_, k_, v_, out_, lse_, lens_, idx_, table_, _, sinks_, leftpad_, *_ = self.layouts
        arrays = (Array(q_, q.data_ptr()), Array(k_, k_cache.data_ptr()),
                  Array(v_, v_cache.data_ptr()),
                  ABSENT if out_ is None else Array(out_, out.data_ptr()),
                  ABSENT if lse_ is None else Array(lse_, lse.data_ptr()),
                  Array(lens_, seqlens_k.data_ptr()),
                  ABSENT if idx_ is None else Array(idx_, batch_idx.data_ptr()),
                  ABSENT if table_ is None else Array(table_, block_table.data_ptr()),
                  ABSENT, ABSENT if sinks_ is None else Array(sinks_, sinks.data_ptr()),
                  ABSENT if leftpad_ is None else Array(leftpad_, leftpad.data_ptr()),
                  ABSENT, ABSENT, ABSENT)
        if plan.splits > 1:  # the combine writes the call's out and LSE
            out_layout, lse_layout = self.output_layouts
            out = Array(out_layout, out.data_ptr())
            lse = None if lse is None else Array(lse_layout, lse.data_ptr())
        plan.launch_arrays(arrays, out, lse, scale, softcap, window, new_len, q.device)

    def append(self, k_new, v_new, k_cache, v_cache, cache_seqlens, batch_idx, block_table,
               q=None, q_rot=None, rotary=None, kv_descale=None, int64_index=None) -> None:
        """``_launch_decode.launch_cache_append`` (its arguments) for a call of the
        signature, its arrays by address from the second call on (as ``launch``); the
        kernel, ``int64_index``'s choice among them, is the first call's."""
        if not self.append_layouts:  # None: the first call; (): a signature of tensors
            grid, kernel, args = _launch_decode.append_launch(
                k_new, v_new, k_cache, v_cache, cache_seqlens, batch_idx, block_table, q,
                q_rot, rotary, kv_descale, int64_index)
            arrays = args[:len(_launch_decode.APPEND_ARRAYS)]
            if self.append_layouts is None:  # (new rows, no FP8 descales: as passed below)
                self.append_tail = grid, kernel, args[len(arrays):]
                self.append_layouts = _layouts(arrays, (), k_new is not None and
                                               kv_descale is None)
            launch_on(k_cache.device, grid, kernel, args)
            return
        grid, kernel, tail = self.append_tail  # (slot by slot, as ``launch``)
        k_, v_, kc_, vc_, lens_, idx_, table_, q_, rot_, cos_, sin_, *_ = self.append_layouts
        launch_on(k_cache.device, grid, kernel, (
            Array(k_, k_new.data_ptr()), Array(v_, v_new.data_ptr()),
            Array(kc_, k_cache.data_ptr()), Array(vc_, v_cache.data_ptr()),
            Array(lens_, cache_seqlens.data_ptr()),
            ABSENT if idx_ is None else Array(idx_, batch_idx.data_ptr()),
            ABSENT if table_ is None else Array(table_, block_table.data_ptr()),
            ABSENT if q_ is None else Array(q_, q.data_ptr()),
            ABSENT if rot_ is None else Array(rot_, q_rot.data_ptr()),
            ABSENT if cos_ is None else Array(cos_, rotary.cos.data_ptr()),
            ABSENT if sin_ is None else Array(sin_, rotary.sin.data_ptr()),
            ABSENT, ABSENT, *tail))


def _layouts(arrays: tuple, outputs: tuple, addressable: bool) -> tuple:
    """The layout of each of a launch's ``arrays`` (None for ``ABSENT``), or () where they
    cannot all go by address: not ``addressable``, or one of them or of the ``outputs`` of a
    dtype without a type string (``_arrays.TYPESTRS``)."""
    tensors = [a for a in (*arrays, *outputs) if isinstance(a, torch.Tensor)]
    if not addressable or any(t.dtype not in TYPESTRS for t in tensors):
        return ()
    return tuple(layout(a) if isinstance(a, torch.Tensor) else None for a in arrays)


def run_kvcache(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k: torch.Tensor | None, v: torch.Tensor | None, cache_seqlens: torch.Tensor,
                cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                scale: float, softcap: float, window_left: int, window_right: int,
                return_lse: bool, sinks: torch.Tensor | None,
                cache_leftpad: torch.Tensor | None, rotary_cos: torch.Tensor | None,
                rotary_sin: torch.Tensor | None, rotary_interleaved: bool, rotary_q_step: int,
                kv_descale: tuple[torch.Tensor, torch.Tensor] | None = None,
                attn_mask: torch.Tensor | None = None):
    """``_ops_decode._kvcache_impl`` (without ALiBi) of a call with ``plan``'s signature, in eager
    mode: the append (32- or 64-bit as the plan's decode), then the planned decode; (out,
    lse) as the op's, but lse None unless ``return_lse`` (no allocation for it)."""
    out, lse = _ops_decode._decode_outputs(q, plan.out_view[4], return_lse, op_outputs=False)
    q = _ops_decode.append_to_cache(q, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                                    block_table, rotary_cos, rotary_sin, rotary_interleaved,
                                    rotary_q_step, kv_descale, plan.int64_index, plan.append)
    plan.launch(q, k_cache, v_cache, out, lse, cache_seqlens,
                cache_batch_idx, block_table, None, scale, softcap, (window_left, window_right),
                0 if k is None else k.shape[1], sinks, cache_leftpad, kv_descale, attn_mask)
    return out, lse
