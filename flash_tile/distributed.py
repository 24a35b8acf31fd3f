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
  ``isend``/``irecv`` (``_RingPass``: the transfer is started before the step's kernels and
  waited for after them; under NCCL the wait is a stream dependency, so the transfer runs
  beside the kernels). Each (query chunk, key chunk) pair whose causal or window band meets is
  one kernel call with its band placed by the chunks' global positions (``diag_offset``) and
  returns its output and LSE; a query chunk's partial outputs merge through their LSEs in
  fp32 (the same sum as one call over all keys, in another order). Under a causal mask the
  zigzag order gives every rank two chunk pairs a step. The backward is autograd's: each call's
  own backward (the kernels take the LSE's gradient), and each ``_RingPass`` sends its shard's
  gradient back to the rank it came from, so dK and dV travel back around the ring to their
  owners. Each rank holds two K/V shards at a time.
- ``"all_gather"``: Llama 3's form. The keys and values are all-gathered (``_GatherShards``,
  differentiable: in the backward their gradients come back to their owners by a
  reduce-scatter, or an all-reduce where the backend has none, as gloo) and each local query
  chunk attends to all of them in one kernel call, so nothing needs merging. It holds the
  whole K/V on every rank (small under GQA) and does not overlap the gather with the kernels.

Which form is faster at a given size was not measured (no machine with two GPUs has run
either).

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

import math
import os

import torch
import torch.distributed as dist

from flash_tile import _validate
from flash_tile._ops import attention_forward
from flash_tile.api import _autocast, _dropout_seed

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


class _GatherShards(torch.autograd.Function):
    """Every rank's shard [B, L_local, ...] concatenated in rank order along dim 1; the
    backward sums each shard's gradient over the ranks and hands it to its owner.
    (``torch.distributed.nn.functional.all_gather`` sends non-contiguous gradients through
    gloo's all-to-all as they lie in memory: wrong gradients, torch 2.13.)"""

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
        parts = [p.contiguous() for p in grad.chunk(world, dim=1)]
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = torch.empty_like(parts[rank])
            dist.reduce_scatter(mine, parts, group=ctx.group)
            return mine, None
        total = grad.contiguous()  # gloo has no reduce-scatter: sum everything, keep ours
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(world, dim=1)[rank], None


def gather_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's [B, L_local, ...] shard of ``group`` concatenated in rank order along dim
    1, differentiable (the gradient of each shard returns to its owner, summed)."""
    return _GatherShards.apply(x, group)


def _exchange(sends, receives, group, step):
    """Start sending ``sends`` to the rank ``step`` places on in the ring and receiving
    ``receives`` from the rank ``step`` places back; the works to wait on."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    peer_to, peer_from = ((dist.get_global_rank(group or dist.group.WORLD, (rank + d) % world))
                          for d in (step, -step))
    ops = [dist.P2POp(dist.isend, t, peer_to, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer_from, group) for t in receives]
    return dist.batch_isend_irecv(ops)


class _RingPass(torch.autograd.Function):
    """The previous rank's ``tensors`` (each rank sends its own to the next), differentiable.
    The forward only starts the transfer and appends (works, tensors in flight) to
    ``pending``: wait on every work there before reading the outputs. The backward sends each
    output's gradient back to the previous rank and returns what the next rank sent back."""

    @staticmethod
    def forward(ctx, group, pending, *tensors):
        ctx.group = group
        sends = [t.contiguous() for t in tensors]
        receives = [torch.empty_like(t) for t in sends]
        pending.append((_exchange(sends, receives, group, 1), sends))
        return tuple(receives)

    @staticmethod
    def backward(ctx, *grads):
        sends = [g.contiguous() for g in grads]  # unused outputs arrive as zeros
        receives = [torch.empty_like(g) for g in sends]
        for work in _exchange(sends, receives, ctx.group, -1):
            work.wait()
        return (None, None, *receives)


class _DependOn(torch.autograd.Function):
    """``x`` itself, with ``others`` as inputs whose gradient is zero: a K/V shard that no
    chunk pair of this rank reads still has its ``_RingPass`` backward run, in step with the
    other ranks' (a rank that skipped it would leave its neighbours waiting)."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.others = [(t.shape, t.dtype, t.device) for t in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.others))


def _band_meets(diag_offset, length, window):
    """Whether some query row i of a [length] chunk sees some key j of a [length] chunk, row i
    seeing j iff i + diag_offset - left <= j <= i + diag_offset + right (-1: unbounded)."""
    left, right = window
    lowest = 0 if right < 0 else max(0, -diag_offset - right)  # first row with a key <= end
    highest = length - 1 if left < 0 else min(length - 1, length - 1 - diag_offset + left)
    return lowest <= highest


def _merge(parts, dtype):
    """One output [B, H, L, Dv] in ``dtype`` from partial (out, lse) pairs over disjoint keys,
    weighted by exp(lse_part - lse) in fp32; an LSE of +inf (no key seen) weighs nothing."""
    lses = torch.stack([torch.where(torch.isposinf(lse), -math.inf, lse) for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(top == -math.inf, 0.0, top)  # rows that saw no key at all
    weights = torch.exp(lses - top)  # [n, B, H, L]
    total = weights.sum(dim=0)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts))
    return (out / torch.where(total == 0.0, 1.0, total)[..., None]).to(dtype)


def _ring(q, k, v, group, window, scale, softcap, dropout_p, attention):
    """The ring form (module docstring) on validated shards; this rank's output shard."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[1] // 2
    queries = [c.transpose(1, 2) for c in q.split(chunk, dim=1)]  # [B, H, chunk, D]
    positions = (rank, 2 * world - 1 - rank)  # the zigzag chunks' places in the sequence
    parts, idle, shard = ([], []), [], (k, v)
    for step in range(world):
        pending = []
        if step + 1 < world:  # on its way to the next rank while this step's kernels run
            following = _RingPass.apply(group, pending, *shard)
        owner = (rank - step) % world
        keys, values = ([c.transpose(1, 2) for c in t.split(chunk, dim=1)] for t in shard)
        read = False
        for i, q_position in enumerate(positions):
            for j, k_position in enumerate((owner, 2 * world - 1 - owner)):
                offset = (q_position - k_position) * chunk
                if _band_meets(offset, chunk, window):
                    parts[i].append(attention(queries[i], keys[j], values[j], offset, window,
                                              scale, softcap, dropout_p))
                    read = True
        if not read:
            idle.extend(shard)
        for works, _ in pending:
            for work in works:
                work.wait()
        if step + 1 < world:
            shard = following
    # A query chunk that saw no key chunk at all (only under a window): zeros, as the kernels.
    outs = [_merge(p, q.dtype) if p else queries[i].new_zeros(
                (*queries[i].shape[:3], v.shape[3])) for i, p in enumerate(parts)]
    out = torch.cat([o.transpose(1, 2) for o in outs], dim=1)
    return _DependOn.apply(out, *idle) if idle else out


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


def kernel_attention(q, k, v, diag_offset, window, scale, softcap, dropout_p):
    """The local attention: flash_tile's kernels on [B, H, L, D] views (K/V with fewer heads
    under GQA), query row i seeing key j iff i + diag_offset - left <= j <= i + diag_offset +
    right; returns (out [B, H, Lq, Dv] in q's dtype, LSE [B, H, Lq] fp32, +inf where a row
    sees no key), both differentiable. The seam ``ring_flash_attn_func`` takes as
    ``attention``: the CPU tests put the float64 reference there."""
    return attention_forward(q, k, v, None, None, scale, softcap, diag_offset, window[0],
                             window[1], True, dropout_p, _dropout_seed(dropout_p))


COMMUNICATIONS = ("ring", "all_gather")


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, dropout_p=0.0, *,
                         communication="ring", attention=kernel_attention):
    """Attention over a sequence sharded across ``group`` (default: the world), in
    flash-attn's layout, forward and backward.

    Args:
        q: this rank's zigzag shard [B, L_local, H, D] of the queries (``zigzag_shard``:
            chunks rank and 2W - 1 - rank of the sequence cut in 2W), fp16 or bf16;
            k, v: the same shards [B, L_local, H_kv, D / Dv] of the keys and values. Every
            rank holds the same L_local = L / W.
        causal, window_size: as ``flash_attn_func`` on the whole sequence (L queries against
            L keys: bottom-right and top-left agree); rows and keys keep their global
            positions.
        softmax_scale, softcap, dropout_p: as ``flash_attn_func`` (dropout's pattern depends
            on the shard's local positions, so it differs from an unsharded call's).
        communication: ``"ring"`` (K/V shards passed around the ring, overlapped with the
            kernels; two shards held at a time) or ``"all_gather"`` (the whole K/V gathered
            on every rank, one kernel call a query chunk); the module docstring has both.
        attention: the local attention (``kernel_attention``: flash_tile's kernels); a
            function of (q, k, v, diag_offset, window, scale, softcap, dropout_p) on [B, H,
            L, D] tensors returning (out, LSE), the seam through which tests run the float64
            reference.

    Returns:
        This rank's shard of the output, [B, L_local, H, Dv] in q's dtype. Gradients reach
        q, k and v of every rank (dK/dV summed back to their owners); the local backward is
        ``flash_attn_func``'s default form, so under ``torch.use_deterministic_algorithms(True)``
        the two-pass one (bitwise reproducible locally).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    if q.shape[1] != k.shape[1] or k.shape[1] % 2:
        raise ValueError(f"each rank's shard must hold two equal chunks of queries and of "
                         f"keys: got {q.shape[1]} queries and {k.shape[1]} keys")
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}, got "
                         f"{communication!r}")
    if q.is_cuda:
        q, k, v = _autocast(q, k, v)
        _validate.check_dtypes(q, k, v)
    dropout_p = _validate.check_dropout(dropout_p)
    left, right = _validate.check_window(window_size)
    if causal:
        right = 0
    scale = _validate.check_scale(softmax_scale if softmax_scale is not None
                                  else 1.0 / math.sqrt(q.shape[3]))
    softcap = _validate.check_softcap(softcap)
    if communication == "ring":
        return _ring(q, k, v, group, (left, right), scale, softcap, dropout_p, attention)

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[1] // 2
    # The whole K and V in sequence order, [B, H_kv, L, D] views for the local calls.
    k_all, v_all = (zigzag_unshard(list(gather_shards(t, group).chunk(world, dim=1)))
                    .transpose(1, 2) for t in (k, v))
    outs = []
    for piece, position in zip(q.split(chunk, dim=1), (rank, 2 * world - 1 - rank)):
        # Global rows [position * chunk, ...) against keys [0, L): offset by the first row.
        out, _ = attention(piece.transpose(1, 2), k_all, v_all, position * chunk, (left, right),
                           scale, softcap, dropout_p)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1)
