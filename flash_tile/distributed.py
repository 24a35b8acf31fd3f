"""Context parallelism: attention over a sequence sharded across the ranks of a
torch.distributed process group, forward and backward.

Each rank holds a shard of the sequence in the zigzag order of Llama 3's context parallelism
and ring-flash-attn: the sequence is cut into 2W chunks for W ranks and rank r holds chunks r
and 2W - 1 - r, one after the other, so that under a causal mask every rank has the same
work (an early chunk, which sees few keys, with a late one, which sees many).
``zigzag_shard`` and ``zigzag_unshard`` map a whole sequence to shards and back.

Two ways to bring every rank the keys and values it needs (``communication=``):

- ``"ring"`` (the default): W steps; at step s each rank attends its two query chunks to the
  K/V shard of rank (rank - s) mod W, while that shard goes on to the next rank by batched
  ``isend``/``irecv`` (started before the step's kernels and waited for after them; under
  NCCL the wait is a stream dependency, so the transfer runs beside the kernels). Each
  (query chunk, key chunk) pair whose causal or window band meets is attended with its band
  placed by the chunks' global positions (``diag_offset``), one kernel call a pair under a
  window; without one a step's pairs join into fewer calls on whole shards (non-causal: one
  call a step; causal: two on the diagonal step, one on the others, the zigzag order giving
  every rank the same work). Each call returns its output and LSE; a query chunk's partial
  outputs merge through their LSEs in fp32 after each step, into a running output and LSE
  (one call's result up to the rounding of each partial to q's dtype and the order of the
  sums). The backward walks the ring again (``flash_tile._ring``, as
  ring-flash-attn's): each pair's backward kernel takes the merged
  output and LSE, so its P is the whole row's; dQ sums locally in fp32, and each shard's
  dK/dV sum, in fp32, follows the shard one step behind, so after W steps it reaches its
  owner. The K/V transfer runs beside a step's kernels and the sums' transfer beside the
  next step's. A rank holds two K/V shards (the one in use, the one arriving), in the forward
  one step's partial outputs and the running merge, and in the backward up to three fp32
  dK/dV sums (this step's, the one arriving, the one still being sent), plus the saved
  shard, output and LSE. The shard's LSE (``return_lse``) is the merged one, and its
  gradient reaches each pair's backward.
- ``"all_gather"``: Llama 3's form. The keys and values are all-gathered (``_GatherShards``,
  differentiable: in the backward their gradients come back to their owners, summed in
  fp32, by a reduce-scatter, or an all-reduce where the backend has none, as gloo) and each
  local query chunk attends to all of them in one kernel call, so nothing needs merging. It
  holds the whole K/V on every rank (small under GQA) and does not overlap the gather with
  the kernels.

Which form is faster at a given size was not measured (no machine with two GPUs has run
either).

Packed variable-length batches (``ring_flash_attn_varlen_func``, ``zigzag_shard_varlen``):
every sequence is cut in 2W chunks and sharded in the same zigzag order, so a rank's packed
shard holds, per sequence, an early and a late chunk. The ring reorders the shards' rows once,
all sequences' early chunks first and then their late ones (K/V travel in that order), and
makes one varlen kernel call per (query half, key half) pair over all sequences at once: under a
causal mask a pair is skipped, run causal (the same chunk) or run in full, as for one
sequence.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` cannot take these
kernels: it swaps in its ring for the three aten SDPA ops (``_scaled_dot_product_flash /
efficient / cudnn_attention``) and flex_attention through DTensor's private op-handler table,
with no public way to add another attention op (torch 2.13), so a model that wants
flash_tile's kernels past one GPU calls this module.

Multi-GPU runs must keep NVLink multicast off; importing this module sets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
in the environment where they are unset (NCCL reads them when a communicator is created, so
import it before the process group's first collective).
"""

import os

import torch
import torch.distributed as dist

from flash_tile import _validate
from flash_tile._ring import (LocalAttention, _DenseRing, _RingAttention, _VarlenRing,
                              refuse_second_order)
from flash_tile._ops import (_backward_impl, _varlen_backward_impl, attention_forward,
                             varlen_attention)
from flash_tile.api import (BLHD, PACKED, _autocast, _check_bhld, _check_layout, _check_packed,
                            _dropout_seed, _unit_last_stride)

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


class _GatherShards(torch.autograd.Function):
    """Every rank's shard [B, L_local, ...] concatenated in rank order along dim 1; the
    backward sums each shard's gradient over the ranks in fp32 at least (as the ring sums its
    dK/dV: a bf16 sum of W terms rounds W - 1 times) and hands it to its owner in the
    gradient's dtype. (``torch.distributed.nn.functional.all_gather`` sends non-contiguous
    gradients through gloo's all-to-all as they lie in memory: wrong gradients, torch 2.13.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        wide = torch.promote_types(grad.dtype, torch.float32)
        if grad.is_cuda:  # NCCL has a reduce-scatter (a group may name no single backend)
            parts = [p.to(wide, memory_format=torch.contiguous_format)
                     for p in grad.chunk(world, dim=1)]
            mine = torch.empty_like(parts[rank])
            dist.reduce_scatter(mine, parts, group=ctx.group)
            return mine.to(grad.dtype), None
        # gloo has no reduce-scatter: sum everything, keep ours (in a copy: autograd's
        # gradient may be handed to other functions too)
        total = grad.to(wide, memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(world, dim=1)[rank].to(grad.dtype), None


def gather_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's [B, L_local, ...] shard of ``group`` concatenated in rank order along dim
    1, differentiable (the gradient of each shard returns to its owner, summed)."""
    return _GatherShards.apply(x, group)


def _kernel_forward(q, k, v, diag_offset, window, scale, softcap, dropout_p, seed):
    return attention_forward(q, k, v, None, None, scale, softcap, diag_offset, window[0],
                             window[1], True, dropout_p, seed)


def _kernel_backward(dout, q, k, v, out, lse, diag_offset, window, scale, softcap, dropout_p,
                     seed, dlse=None):
    # The op's body, as attention_forward runs it in eager mode (the custom op's dispatch costs
    # host time a call, and the ring makes up to 4 W of them).
    return _backward_impl(dout, q, k, v, out, lse, dlse, None, None, scale, softcap,
                          diag_offset, window[0], window[1], dropout_p, seed)[:3]


def _varlen_kernel_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, softcap, dropout_p,
                           seed):
    del max_seqlen  # flash-attn's signature has it; the kernels' grid does not need it
    return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, None, scale, softcap, -1,
                            0 if causal else -1, True, dropout_p, seed)


def _varlen_kernel_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                            softcap, dropout_p, seed, dlse=None):
    del max_seqlen
    return _varlen_backward_impl(dout, q, k, v, out, lse, dlse, cu_seqlens, cu_seqlens, None,
                                 scale, softcap, -1, 0 if causal else -1, dropout_p, seed)[:3]


#: flash_tile's kernels as the local attention (dense and varlen).
kernel_attention = LocalAttention(_kernel_forward, _kernel_backward)
varlen_kernel_attention = LocalAttention(_varlen_kernel_forward, _varlen_kernel_backward)


class _LocalCall(torch.autograd.Function):
    """A dense ``LocalAttention``'s (out, LSE), differentiable in q, k and v through either:
    (local, band, q, k, v), band = (diag_offset, window, scale, softcap, dropout_p, seed)."""

    @staticmethod
    def forward(ctx, local, band, q, k, v):
        out, lse = local.forward(q, k, v, *band)
        ctx.local, ctx.band = local, band
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_second_order()
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        return (None, None, *ctx.local.backward(dout, q, k, v, out, lse, *ctx.band,
                                                None if dlse is None else dlse.contiguous()))


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x`` along ``dim`` (flash-attn's [B, L,
    H, D]: dim 1): chunks rank and 2W - 1 - rank of 2W equal chunks, concatenated. L must be a
    multiple of 2W."""
    chunks = x.chunk(2 * world_size, dim=dim)
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"the sequence length {x.shape[dim]} must be a multiple of "
                         f"2 * world_size = {2 * world_size}")
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from the W ranks' zigzag shards (in rank order)."""
    firsts, lasts = zip(*(s.chunk(2, dim=dim) for s in shards))
    return torch.cat([*firsts, *reversed(lasts)], dim=dim)


def _kernel_inputs(q, k, v):
    """q, k and v as the kernels take them (cast under autocast, a unit last stride), checked
    as the single-GPU functions check them, before any transfer."""
    q, k, v = (_unit_last_stride(t) for t in _autocast(q, k, v))
    _validate.check_dtypes(q, k, v)
    _validate.check_device(q, k, v)
    return q, k, v


def _rank_seed(dropout_p: float) -> int:
    """A dropout seed drawn as the single-GPU calls draw theirs, with this rank folded in:
    ranks seeded alike (one model's initialisation) would otherwise draw the same seed for the
    same call and drop the same local positions on every rank."""
    seed = _dropout_seed(dropout_p)
    return (seed + 1_000_003 * dist.get_rank()) % (2**31 - 1) if seed else 0


def _offsets(cu_seqlens, total: int, multiple: int, why: str) -> list[int]:
    """``cu_seqlens`` (a list or a 1-D integer tensor) as a host list, checked: it runs from 0
    to ``total``, and every sequence's length is a multiple of ``multiple`` (``why`` names
    it in the error)."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the packed length {total}, got "
                         f"{cu[:1]} .. {cu[-1:]}")
    for b, (start, end) in enumerate(zip(cu, cu[1:])):
        if end < start or (end - start) % multiple:
            raise ValueError(f"sequence {b} has length {end - start}: each must be a "
                             f"multiple of {why}")
    return cu


def _chunk_rows(cu: list[int], pieces: int, which: int) -> torch.Tensor:
    """The packed rows of chunk ``which`` of ``pieces`` equal chunks of every sequence."""
    starts, lengths = torch.tensor(cu[:-1]), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    size = lengths // pieces
    first = starts + which * size
    within = torch.arange(int(size.sum())) - torch.repeat_interleave(size.cumsum(0) - size,
                                                                     size)
    return torch.repeat_interleave(first, size) + within


def zigzag_shard_varlen(x: torch.Tensor, cu_seqlens, rank: int,
                        world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of packed sequences x [total, ...] with offsets ``cu_seqlens``
    (int [B + 1], a list or a tensor): for each sequence, chunks rank and 2W - 1 - rank of
    its 2W equal chunks, one after the other, the sequences in order. Every length must be a
    multiple of 2W; the shard's offsets are cu_seqlens // W."""
    cu = _offsets(cu_seqlens, x.shape[0], 2 * world_size,
                  f"2 * world_size = {2 * world_size}")
    local = [c // world_size for c in cu]
    rows = torch.empty(local[-1], dtype=torch.long)
    halves = _chunk_rows(local, 2, 0), _chunk_rows(local, 2, 1)
    for half, chunk in zip(halves, (rank, 2 * world_size - 1 - rank)):
        rows[half] = _chunk_rows(cu, 2 * world_size, chunk)
    return x.index_select(0, rows.to(x.device))


def _ring_varlen(q, k, v, cu, max_seqlen, group, causal, scale, softcap, dropout_p, local):
    """The ring on packed zigzag shards (``ring_flash_attn_varlen_func``): the shards' rows
    reordered once, every sequence's early half first and then every late half (the same
    order on every rank, so the K/V passed around the ring need no reordering); (out
    [total, H, Dv], LSE [H, total]) in the shards' order."""
    ring = _VarlenRing(group, local, _rank_seed, scale, softcap, dropout_p, cu, max_seqlen,
                       causal, q.device)
    order = torch.cat([_chunk_rows(cu, 2, i) for i in (0, 1)]).to(q.device)
    out, lse = _RingAttention.apply(ring, *(t.index_select(0, order) for t in (q, k, v)))
    return (out.new_empty(out.shape).index_copy(0, order, out),
            lse.new_empty(lse.shape).index_copy(0, order, lse).transpose(0, 1))


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=None, causal=False,
                                softmax_scale=None, softcap=0.0, dropout_p=0.0, *,
                                return_lse=False, attention=varlen_kernel_attention):
    """Packed variable-length sequences sharded across ``group`` (default: the world), in
    flash-attn's varlen layout, forward and backward, by the ring (module docstring).

    Args:
        q: this rank's zigzag shard [total_local, H, D] of the packed queries
            (``zigzag_shard_varlen``: for each sequence, chunks rank and 2W - 1 - rank of it
            cut in 2W), fp16 or bf16; k, v: the same shards [total_local, H_kv, D / Dv].
        cu_seqlens: int32 [B + 1], the offsets of the shard's sequences (the whole batch's
            offsets // W; the same on every rank, not checked across them); each local
            length even. Read on the host (a device sync), as the ring gathers each
            sequence's halves.
        max_seqlen: the longest local sequence (an int), as flash-attn's signature has it.
        causal: each sequence's own causal mask (queries and keys of a sequence are equally
            many, so bottom-right and top-left agree); no window, ALiBi or sinks here.
        softmax_scale, softcap, dropout_p: as ``flash_attn_varlen_func``.
        return_lse: also return the shard's rows' LSE over their whole sequences' keys,
            [H, total_local] as ``flash_attn_varlen_func``'s, differentiable.
        attention: the local attention, a ``LocalAttention`` (``varlen_kernel_attention``:
            flash_tile's kernels); the seam through which tests run the float64 twins.

    Returns:
        This rank's shard of the output, [total_local, H, Dv] in q's dtype (with
        ``return_lse`` the tuple (out, lse)); gradients reach q, k and v of every rank
        (dK/dV back around the ring to their owners).
    """
    _check_layout(PACKED, q, k, v)
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k and v must hold the same packed rows, got {q.shape[0]}, "
                         f"{k.shape[0]} and {v.shape[0]}")
    cu = _offsets(cu_seqlens, q.shape[0], 2, "2 (a shard holds two halves of each)")
    # Unlike flash_attn_varlen_func's, the ring reads this value (its half-sequence bound):
    # any int-like (numpy integers too), compared.
    longest = _validate.int_value(max_seqlen)
    if longest is None or longest < 1:
        raise ValueError(f"max_seqlen must be an int >= 1, got {max_seqlen!r}")
    max_seqlen = longest
    scale = _check_packed(q, k, v, softmax_scale)
    if attention is varlen_kernel_attention or q.is_cuda:
        q, k, v = _kernel_inputs(q, k, v)
    dropout_p = _validate.check_dropout(dropout_p)
    softcap = _validate.check_softcap(softcap)
    out, lse = _ring_varlen(q, k, v, cu, max_seqlen, group, causal, scale, softcap, dropout_p,
                            attention)
    return (out, lse) if return_lse else out


COMMUNICATIONS = ("ring", "all_gather")


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, dropout_p=0.0, *,
                         return_lse=False, communication="ring", attention=kernel_attention):
    """Attention over a sequence sharded across ``group`` (default: the world), in
    flash-attn's layout, forward and backward.

    Args:
        q: this rank's zigzag shard [B, L_local, H, D] of the queries (``zigzag_shard``:
            chunks rank and 2W - 1 - rank of the sequence cut in 2W), fp16 or bf16;
            k, v: the same shards [B, L_local, H_kv, D / Dv] of the keys and values. Every
            rank holds the same L_local = L / W (not checked across ranks: that would take a
            collective; a mismatch hangs the transfers or fails in them).
        causal, window_size: as ``flash_attn_func`` on the whole sequence (L queries against
            L keys: bottom-right and top-left agree); rows and keys keep their global
            positions.
        softmax_scale, softcap, dropout_p: as ``flash_attn_func`` (dropout's pattern depends
            on the shard's local positions, so it differs from an unsharded call's).
        return_lse: also return the shard's rows' LSE over the whole sequence's keys,
            [B, H, L_local], fp32 (fp64 for fp64 inputs), differentiable, as
            ``flash_attn_func``'s.
        communication: ``"ring"`` (K/V shards passed around the ring, overlapped with the
            kernels) or ``"all_gather"`` (the whole K/V gathered on every rank, one kernel
            call a query chunk); the module docstring has both.
        attention: the local attention, a ``LocalAttention`` (``kernel_attention``:
            flash_tile's kernels); the seam through which tests run the float64 twins.

    Returns:
        This rank's shard of the output, [B, L_local, H, Dv] in q's dtype (with
        ``return_lse`` the tuple (out, lse)). Gradients reach q, k and v of every rank (dK/dV
        summed back to their owners); the local backward is ``flash_attn_func``'s default
        form, so under ``torch.use_deterministic_algorithms(True)`` the two-pass one (bitwise
        reproducible locally). There is no second derivative: a backward that builds a graph
        (``create_graph=True``) raises NotImplementedError at once, where
        ``flash_attn_func`` raises only when its gradients are differentiated in turn.
    """
    _check_layout(BLHD, q, k, v)
    if q.shape[1] != k.shape[1] or k.shape[1] % 2:
        raise ValueError(f"each rank's shard must hold two equal chunks of queries and of "
                         f"keys: got {q.shape[1]} queries and {k.shape[1]} keys")
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}, got "
                         f"{communication!r}")
    scale = _check_bhld(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale)
    if attention is kernel_attention or q.is_cuda:
        q, k, v = _kernel_inputs(q, k, v)
    dropout_p = _validate.check_dropout(dropout_p)
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0
    softcap = _validate.check_softcap(softcap)
    if communication == "ring":
        ring = _DenseRing(group, attention, _rank_seed, scale, softcap, dropout_p,
                          q.shape[1] // 2, (left, right))
        out, lse = _RingAttention.apply(ring, q, k, v)
        return (out, lse.transpose(1, 2)) if return_lse else out  # lse [B, H, L_local]

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the process group it was given")
    chunk = q.shape[1] // 2
    # The whole K and V in sequence order, [B, H_kv, L, D] views for the local calls.
    k_all, v_all = (zigzag_unshard(list(gather_shards(t, group).chunk(world, dim=1)))
                    .transpose(1, 2) for t in (k, v))
    outs, lses = [], []
    for piece, position in zip(q.split(chunk, dim=1), (rank, 2 * world - 1 - rank)):
        # Global rows [position * chunk, ...) against keys [0, L): offset by the first row.
        out, lse = _LocalCall.apply(attention, (position * chunk, (left, right), scale,
                                                softcap, dropout_p, _rank_seed(dropout_p)),
                                    piece.transpose(1, 2), k_all, v_all)
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=2)) if return_lse else out
