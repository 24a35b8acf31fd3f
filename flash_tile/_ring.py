"""The ring of ``flash_tile.distributed``: the steps of one rank's ring (the K/V shard passed
on while the step's local calls run), the merge of partial outputs through their LSEs, the
backward that walks the ring again with the dK/dV sums one step behind, and the dense and
packed pairings of query and key chunks. ``flash_tile.distributed``'s module docstring has
the algorithm; the public functions are there.
"""

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist


def _exchange(sends, receives, group, step):
    """Start sending ``sends`` to the rank ``step`` places on in the ring and receiving
    ``receives`` from the rank ``step`` places back; the works to wait on."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    peer_to, peer_from = ((dist.get_global_rank(group or dist.group.WORLD, (rank + d) % world))
                          for d in (step, -step))
    ops = [dist.P2POp(dist.isend, t, peer_to, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer_from, group) for t in receives]
    return dist.batch_isend_irecv(ops)


def _pass_on(tensors, group):
    """Start sending ``tensors`` to the next rank; (what the previous rank sends, the
    transfer to ``_wait`` for before reading it: its works and the tensors in flight, kept
    alive until then)."""
    sends = [t.contiguous() for t in tensors]
    receives = [torch.empty_like(t) for t in sends]
    return receives, (_exchange(sends, receives, group, 1), sends)


def _wait(transfer):
    for work in transfer[0]:
        work.wait()


@dataclasses.dataclass(frozen=True)
class LocalAttention:
    """The local attention the distributed forms run, a forward and its backward without
    autograd, so that the ring can hand the backward the merged output and LSE.

    Dense (``ring_flash_attn_func``), on [B, H, L, D] views (K/V with fewer heads under GQA),
    query row i seeing key j iff i + diag_offset - left <= j <= i + diag_offset + right:
    ``forward(q, k, v, diag_offset, window, scale, softcap, dropout_p, seed)`` -> (out [B, H,
    Lq, Dv] in q's dtype, LSE [B, H, Lq] fp32 at least, natural log, +inf where a row sees no
    key); ``backward(dout, q, k, v, out, lse, diag_offset, window, scale, softcap, dropout_p,
    seed, dlse)`` -> (dq, dk, dv), P recomputed from the given LSE (the whole row's, not the
    call's), Delta from the given output and the LSE's gradient ``dlse`` (None where nothing
    differentiates through the LSE; else the forward's LSE layout).

    Varlen (``ring_flash_attn_varlen_func``), on packed [total, H, D] sequences with the same
    offsets for queries and keys: ``forward(q, k, v, cu_seqlens, max_seqlen, causal, scale,
    softcap, dropout_p, seed)`` -> (out [total, H, Dv], LSE [H, total]) and
    ``backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, softcap,
    dropout_p, seed, dlse)`` -> (dq, dk, dv).

    The seam through which the CPU tests run the float64 reference twins."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _band_meets(diag_offset, length, window):
    """Whether some query row i of a [length] chunk sees some key j of a [length] chunk, row i
    seeing j iff i + diag_offset - left <= j <= i + diag_offset + right (-1: unbounded)."""
    left, right = window
    lowest = 0 if right < 0 else max(0, -diag_offset - right)  # first row with a key <= end
    highest = length - 1 if left < 0 else min(length - 1, length - 1 - diag_offset + left)
    return lowest <= highest


def _merge(parts, wide):
    """(out [..., Dv], LSE [...]) in ``wide`` (fp32 at least) from partial (out, lse) pairs
    over disjoint keys, weighted by exp(lse_part - lse); an LSE of +inf (no key seen) weighs
    nothing, and a row no part saw gets zeros and +inf."""
    lses = torch.stack([torch.where(torch.isposinf(lse), -math.inf, lse).to(wide)
                        for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(top == -math.inf, 0.0, top)  # rows that saw no key at all
    weights = torch.exp(lses - top)  # [n, ...]
    total = weights.sum(dim=0)
    out = sum(w[..., None] * o.to(wide) for w, (o, _) in zip(weights, parts))
    out = out / torch.where(total == 0.0, 1.0, total)[..., None]
    return out, torch.where(total == 0.0, math.inf, top + torch.log(total))


class _Ring:
    """One rank's ring over zigzag shards split in two halves (an early and a late chunk):
    which (query half, key half) pairs meet when the K/V shard of rank ``owner`` is here,
    and the local calls on them, with the halves' output and LSE laid out alike (the LSE as
    the output without its last dimension; ``lse_for_backward`` lays a merged one, or its
    gradient, out as the local backward takes it). ``draw_seed(dropout_p)`` draws each
    call's dropout seed. Subclasses: ``_DenseRing``, ``_VarlenRing``."""

    def __init__(self, group, local, draw_seed, scale, softcap, dropout_p):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this rank is not a member of the process group it was given")
        self.group, self.local, self.draw_seed = group, local, draw_seed
        self.scale, self.softcap, self.dropout_p = scale, softcap, dropout_p
        self.positions = (self.rank, 2 * self.world - 1 - self.rank)
        self.seeds = {}  # (step, query half, key half) -> the forward's dropout seed

    def owner_positions(self, owner):
        return owner, 2 * self.world - 1 - owner


def _walk(ring, shard):
    """The ring's W steps: yields (step, the K/V shard held, its halves, the (query half, key
    half, band) pairs that meet on it), the shard on its way to the next rank while the
    caller's step runs, and waited for before the next."""
    for step in range(ring.world):
        last = step + 1 == ring.world
        if not last:
            following, transfer = _pass_on(shard, ring.group)
        yield (step, shard, [ring.halves(t) for t in shard],
               ring.pairs((ring.rank - step) % ring.world))
        if not last:
            _wait(transfer)
            shard = following


def _ring_forward(ring, q, k, v):
    """The ring's forward (``flash_tile.distributed``'s docstring): this rank's (out, LSE) per
    query half, out in q's dtype and the LSE in fp32 at least. Each step's partial results
    merge into the running ones in that precision at once, so a rank holds one step's
    partials, not the whole ring's."""
    wide = torch.promote_types(q.dtype, torch.float32)
    queries = ring.halves(q)
    merged = [None, None]
    for step, shard, (keys, values), pairs in _walk(ring, (k, v)):
        parts = ([], [])
        for i, j, band in pairs:
            seed = ring.seeds[step, i, j] = ring.draw_seed(ring.dropout_p)
            got = ring.attend(q if i is None else queries[i], *(
                shard if j is None else (keys[j], values[j])), band, seed)
            if i is None:  # the whole query shard: its output and LSE by halves
                for half, part in enumerate(zip(*(ring.halves(t) for t in got))):
                    parts[half].append(part)
            else:
                parts[i].append(got)
        for i in (0, 1):
            if parts[i]:
                merged[i] = _merge(parts[i] if merged[i] is None else [merged[i], *parts[i]],
                                   wide)
    # A query half always meets its own chunk's keys (the diagonal): both halves are merged.
    return [(out.to(q.dtype), lse) for out, lse in merged]


def _ring_backward(ring, dout, q, k, v, outs, lses, dlses):
    """The ring's backward: each step's pairs take the merged output and LSE (so P is the
    whole row's) and the LSE's gradient (``dlses``: None where nothing differentiates
    through it), dQ sums locally in fp32, and each K/V shard's dK/dV sum in fp32 travels
    one step behind the shard, so that after W steps it reaches its owner. The K/V transfer
    runs beside a step's calls; the sums' beside the next step's."""
    wide = torch.promote_types(q.dtype, torch.float32)
    # Each query half's tensors, and (index None, made where a call first needs them) the
    # whole shard's.
    rows = {i: (d, x, outs[i], lses[i], dlses[i])
            for i, (d, x) in enumerate(zip(ring.halves(dout), ring.halves(q)))}
    dq_all = torch.zeros_like(q, dtype=wide)
    dq = {None: dq_all, **dict(enumerate(ring.halves(dq_all)))}
    incoming = None
    for step, shard, (keys, values), pairs in _walk(ring, (k, v)):
        part = [torch.zeros_like(t, dtype=wide) for t in shard]  # dK, dV of this shard
        dk = {None: part[0], **dict(enumerate(ring.halves(part[0])))}
        dv = {None: part[1], **dict(enumerate(ring.halves(part[1])))}
        for i, j, band in pairs:
            if i not in rows:
                rows[None] = (dout, q, ring.join(outs), ring.join_for_backward(lses),
                              None if dlses[0] is None else ring.join_for_backward(dlses))
            d, x, out, lse, dlse = rows[i]
            got = ring.attend_backward(d, x, *(shard if j is None else (keys[j], values[j])),
                                       out, lse, band, ring.seeds[step, i, j], dlse)
            for acc, g in zip((dq[i], dk[j], dv[j]), got):
                acc += g
        if incoming is not None:  # the sums of the ranks before, one step behind the shard
            _wait(incoming[1])
            for mine, before in zip(part, incoming[0]):
                mine += before
        if ring.world > 1:  # on to the next rank, which holds this shard at the next step
            incoming = _pass_on(part, ring.group)
    if incoming is not None:  # the last step's sums, sent on to their owner (the next rank)
        _wait(incoming[1])
        part = incoming[0]
    return dq_all.to(q.dtype), part[0].to(k.dtype), part[1].to(v.dtype)


def refuse_second_order() -> None:
    """Raise where autograd runs a ring's backward to build a graph (``create_graph=True``:
    grad mode is on in the backward), before any work: the local backwards' kernels return
    tensors without a graph, so a loss of the gradients would miss its second-order terms
    silently."""
    if torch.is_grad_enabled():
        raise NotImplementedError("ring attention has no second derivative: its backward ran "
                                  "with create_graph=True; differentiate a loss of its "
                                  "gradients elsewhere, or call backward without "
                                  "create_graph")


class _RingAttention(torch.autograd.Function):
    """The ring's output shard and its LSE (as the output without its last dimension),
    differentiable in q, k and v through either (``_ring_backward``)."""

    @staticmethod
    def forward(ctx, ring, q, k, v):
        outs, lses = zip(*_ring_forward(ring, q, k, v))
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, *outs, *lses)
        ctx.set_materialize_grads(False)
        return ring.join(outs), ring.join(lses)

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_second_order()
        q, k, v, *rest = ctx.saved_tensors
        ring = ctx.ring
        if dout is None:  # only the LSE reaches the loss
            dout = torch.zeros_like(ring.join(rest[:2]))
        # The LSEs (and their gradients) in the local backward's layout, once for every step
        # that reads them (here, not in the forward: a call without a backward would copy
        # them for nothing).
        lses = [ring.lse_for_backward(x) for x in rest[2:]]
        dlses = ((None, None) if dlse is None else
                 [ring.lse_for_backward(x) for x in ring.halves(dlse)])
        dq, dk, dv = _ring_backward(ring, dout, q, k, v, rest[:2], lses, dlses)
        return None, dq, dk, dv


class _DenseRing(_Ring):
    """The ring over [B, L_local, H, D] shards: a query chunk against a key chunk at their
    global places, the band placed by ``diag_offset``; a band (diag_offset, window) a call.
    Without a window (causal or not) a step's pairs join into fewer, larger calls (``pairs``
    names a whole shard by the half None)."""

    def __init__(self, group, local, draw_seed, scale, softcap, dropout_p, chunk, window):
        super().__init__(group, local, draw_seed, scale, softcap, dropout_p)
        self.chunk, self.window = chunk, window

    def halves(self, t):
        return t.split(self.chunk, dim=1)

    def join(self, halves):
        return torch.cat(halves, dim=1)

    @staticmethod
    def join_for_backward(lses):
        return torch.cat(lses, dim=2)  # the halves' [B, H, chunk] LSEs, as one call's

    def pairs(self, owner):
        """The calls of the step that holds ``owner``'s shard: (query half, key half, band),
        a half None for the whole shard. Without a window every row of a whole-shard call
        sees what its chunk pairs would: non-causal, everything (one call); causal, on the
        diagonal step the early chunks' triangle and the late queries against the whole
        shard (the shard's keys in order, their early chunk all before the late queries),
        on the others the whole query shard against the early keys (an owner before this
        rank) or the late queries against the whole key shard (an owner after it), all
        visible."""
        everything = (0, (-1, -1))
        if self.window == (-1, -1):
            return [(None, None, everything)]
        if self.window == (-1, 0):
            if owner == self.rank:
                return [(0, 0, (0, self.window)), (1, None, (self.chunk, self.window))]
            return [(None, 0, everything) if owner < self.rank else (1, None, everything)]
        return [(i, j, ((qp - kp) * self.chunk, self.window))
                for i, qp in enumerate(self.positions)
                for j, kp in enumerate(self.owner_positions(owner))
                if _band_meets((qp - kp) * self.chunk, self.chunk, self.window)]

    def attend(self, q, k, v, band, seed):
        out, lse = self.local.forward(*(t.transpose(1, 2) for t in (q, k, v)), *band,
                                      self.scale, self.softcap, self.dropout_p, seed)
        return out.transpose(1, 2), lse.transpose(1, 2)

    @staticmethod
    def lse_for_backward(lse):
        return lse.transpose(1, 2).contiguous()  # [B, H, chunk], as the forward returns it

    def attend_backward(self, dout, q, k, v, out, lse, band, seed, dlse):
        grads = self.local.backward(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse,
                                    *band, self.scale, self.softcap, self.dropout_p, seed,
                                    dlse)
        return [g.transpose(1, 2) for g in grads]



class _VarlenRing(_Ring):
    """The ring over packed zigzag shards whose rows were reordered
    (``distributed._ring_varlen``): every
    sequence's early half first, then every late half; one varlen call a (query half, key
    half) pair over every sequence at once."""

    def __init__(self, group, local, draw_seed, scale, softcap, dropout_p, cu, max_seqlen,
                 causal, device):
        super().__init__(group, local, draw_seed, scale, softcap, dropout_p)
        self.causal, self.early_rows = causal, (cu[-1] - cu[0]) // 2
        # Each half of the reordered rows packs every sequence's half, at offsets cu // 2.
        self.half_cu = torch.tensor([c // 2 for c in cu], dtype=torch.int32, device=device)
        self.half_max = max(1, max_seqlen // 2)

    def halves(self, t):  # slices, not split: an empty batch still has two (empty) halves
        return t[:self.early_rows], t[self.early_rows:]

    def join(self, halves):
        return torch.cat(halves)

    def pairs(self, owner):
        # Skipped: a key chunk wholly after the query chunk; causal: the same chunk.
        return [(i, j, self.causal and kp == qp) for i, qp in enumerate(self.positions)
                for j, kp in enumerate(self.owner_positions(owner))
                if not (self.causal and kp > qp)]

    def attend(self, q, k, v, causal, seed):
        out, lse = self.local.forward(q, k, v, self.half_cu, self.half_max, causal,
                                      self.scale, self.softcap, self.dropout_p, seed)
        return out, lse.transpose(0, 1)  # the LSE as out's [total, H]

    @staticmethod
    def lse_for_backward(lse):
        return lse.transpose(0, 1).contiguous()  # [H, total], as the forward returns it

    def attend_backward(self, dout, q, k, v, out, lse, causal, seed, dlse):
        return self.local.backward(dout, q, k, v, out, lse, self.half_cu, self.half_max,
                                   causal, self.scale, self.softcap, self.dropout_p, seed, dlse)
