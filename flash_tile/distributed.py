"""Context parallelism: attention over a sequence sharded across the ranks of a
torch.distributed process group, forward and backward.

Each rank holds a shard of the sequence in the zigzag order of Llama 3's context parallelism
and ring-flash-attn: the sequence is cut into 2W chunks for W ranks and rank r holds chunks r
and 2W - 1 - r, one after the other, so that under a causal mask every rank has the same
work (an early chunk, which sees few keys, with a late one, which sees many).
``zigzag_shard`` and ``zigzag_unshard`` map a whole sequence to shards and back.

The keys and values are all-gathered (``_GatherShards``, differentiable: in the backward their
gradients come back to their owners by a reduce-scatter, or an all-reduce where the backend
has none, as gloo) and each local query chunk
attends to all of them in one kernel call, its causal or window band placed by its global
position (``diag_offset``), so no partial outputs need merging and the result is the
unsharded attention's up to summation order. This is Llama 3's all-gather form of context
parallelism, not a ring of point-to-point sends: it holds the whole K/V on every rank (small
under GQA), and it does not overlap the gather with the kernels. Which of the two forms is
faster at a given size was not measured (no machine with two GPUs has run this).

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
    right; returns the output [B, H, Lq, Dv], differentiable. The seam ``ring_flash_attn_func``
    takes as ``attention``: the CPU tests put the float64 reference there."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out, _ = attention_forward(q, k, v, None, None, scale, softcap, diag_offset, window[0],
                               window[1], needs_grad, dropout_p, _dropout_seed(dropout_p))
    return out


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, dropout_p=0.0, *,
                         attention=kernel_attention):
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
        attention: the local attention (``kernel_attention``: flash_tile's kernels); a
            function of (q, k, v, diag_offset, window, scale, softcap, dropout_p) on [B, H,
            L, D] tensors, the seam through which tests run the float64 reference.

    Returns:
        This rank's shard of the output, [B, L_local, H, Dv] in q's dtype. Gradients reach
        q, k and v of every rank (dK/dV summed back to their owners); the local backward is
        ``flash_attn_func``'s default form, so under ``torch.use_deterministic_algorithms(True)``
        the two-pass one (bitwise reproducible locally).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    if q.shape[1] != k.shape[1] or k.shape[1] % 2:
        raise ValueError(f"each rank's shard must hold two equal chunks of queries and of "
                         f"keys: got {q.shape[1]} queries and {k.shape[1]} keys")
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

    chunk = q.shape[1] // 2
    # The whole K and V in sequence order, [B, H_kv, L, D] views for the local calls.
    k_all, v_all = (zigzag_unshard(list(gather_shards(t, group).chunk(world, dim=1)))
                    .transpose(1, 2) for t in (k, v))
    outs = []
    for piece, position in zip(q.split(chunk, dim=1), (rank, 2 * world - 1 - rank)):
        # Global rows [position * chunk, ...) against keys [0, L): offset by the first row.
        outs.append(attention(piece.transpose(1, 2), k_all, v_all, position * chunk,
                              (left, right), scale, softcap, dropout_p).transpose(1, 2))
    return torch.cat(outs, dim=1)
