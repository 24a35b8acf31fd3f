"""Context parallelism on the CPU: 2 and 4 processes over gloo run ``ring_flash_attn_func``
in both its communications (the ring of point-to-point passes and the all-gather) with the
float64 twins standing in for the kernels (the ``LocalAttention`` seam: the dense reference
forward and the backward kernels' twin, which recomputes P from the merged LSE the ring's
backward hands it); each rank's output shard and its shards' gradients must equal those of
unsharded attention on the whole sequence, by autograd. (A run on GPUs, through NCCL and
the kernels, needs a machine with two GPUs; one-rank cases run on one.)"""

import inspect
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_tile import _ops, _ring, distributed, reference

# (causal, window, softcap, heads, kv_heads). The narrow windows leave whole steps of the
# ring with no chunk pair on some ranks (at 4 ranks chunks are 8 rows).
CASES = [(True, (-1, -1), 0.0, 4, 2), (False, (-1, -1), 0.0, 4, 4),
         (True, (12, -1), 0.0, 4, 1), (False, (5, 9), 3.0, 2, 2), (True, (3, -1), 0.0, 2, 1),
         (False, (0, 2), 0.0, 2, 2)]
BATCH, LENGTH, DIM = 2, 64, 16


def _forward(q, k, v, diag_offset, window, scale, softcap, dropout_p, seed):
    """The dense seam's float64 forward: plain attention with its LSE (+inf where a row sees
    no key, as the kernels')."""
    assert dropout_p == 0.0
    return reference.attention_dense(q, k, v, scale, diag_offset, window, softcap,
                                     return_lse=True)


def _backward(dout, q, k, v, out, lse, diag_offset, window, scale, softcap, dropout_p, seed,
              dlse=None):
    """The dense seam's float64 backward: the backward kernels' twin, P recomputed from the
    LSE it is given (the merged one), Delta shifted by the LSE's gradient."""
    return reference.attention_tiles_backward(q, k, v, out, lse, dout, scale, diag_offset,
                                              window, softcap, dlse=dlse)


REFERENCE = distributed.LocalAttention(_forward, _backward)


def _inputs(heads, kv_heads):
    """q, k, v, dout [B, L, H, D] and dlse [B, H, L] in float64."""
    gen = torch.Generator().manual_seed(7)

    def randn(h):
        return torch.randn(BATCH, LENGTH, h, DIM, generator=gen, dtype=torch.float64)

    return (randn(heads), randn(kv_heads), randn(kv_heads), randn(heads),
            torch.randn(BATCH, heads, LENGTH, generator=gen, dtype=torch.float64))


def _worker(rank, world, path, communication):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for (causal, window, softcap, heads, kv_heads), lse_loss in itertools.product(
                CASES, (False, True)):
            q, k, v, dout, dlse = _inputs(heads, kv_heads)
            # The unsharded reference on every rank, by autograd; a loss on the LSE as well
            # (ring attention's merges make one) or on the output alone.
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            eff = (window[0], 0) if causal else window
            ref, ref_lse = reference.attention_dense(*(t.transpose(1, 2) for t in leaves),
                                                     None, 0, eff, softcap, return_lse=True)
            ref = ref.transpose(1, 2)
            torch.autograd.backward((ref, ref_lse) if lse_loss else ref,
                                    (dout, dlse) if lse_loss else dout)
            # This rank's shards through the sharded function.
            shards = [distributed.zigzag_shard(t, rank, world).clone().requires_grad_()
                      for t in (q, k, v)]
            out, lse = distributed.ring_flash_attn_func(
                *shards, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                attention=REFERENCE, communication=communication)
            dout_shard = distributed.zigzag_shard(dout, rank, world)
            dlse_shard = distributed.zigzag_shard(dlse, rank, world, dim=2)
            torch.autograd.backward((out, lse) if lse_loss else out,
                                    (dout_shard, dlse_shard) if lse_loss else dout_shard)
            torch.testing.assert_close(out, distributed.zigzag_shard(ref.detach(), rank, world))
            torch.testing.assert_close(lse, distributed.zigzag_shard(ref_lse.detach(), rank,
                                                                     world, dim=2))
            for got, leaf in zip(shards, leaves):
                torch.testing.assert_close(got.grad, distributed.zigzag_shard(leaf.grad, rank,
                                                                              world))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("communication", distributed.COMMUNICATIONS)
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_attention_equals_the_unsharded(world, communication, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), communication), nprocs=world,
             join=True)


VARLEN_LENGTHS = [24, 0, 8, 40, 16]  # multiples of 2W for W = 2 and 4, one empty sequence
# (causal, softcap, heads, kv_heads)
VARLEN_CASES = [(True, 0.0, 4, 2), (False, 0.0, 2, 2), (True, 2.5, 2, 1)]


def _varlen_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, softcap, dropout_p,
                    seed=0):
    """The varlen seam's float64 forward: each sequence through the dense reference."""
    assert dropout_p == 0.0
    cu = cu_seqlens.tolist()
    assert max_seqlen >= max(b - a for a, b in zip(cu, cu[1:]))
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        if a == b:
            continue
        out, lse = reference.attention_dense(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                             scale, 0, (-1, 0) if causal else (-1, -1),
                                             softcap, return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, softcap,
                     dropout_p, seed, dlse=None):
    """The varlen seam's float64 backward: the varlen backward kernels' twin."""
    return reference.varlen_tiles_backward(q, k, v, out, lse, dout, cu_seqlens, cu_seqlens,
                                           scale, (-1, 0) if causal else (-1, -1), softcap,
                                           dlse=dlse)


VARLEN_REFERENCE = distributed.LocalAttention(_varlen_forward, _varlen_backward)


def _varlen_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        cu = torch.tensor([0, *VARLEN_LENGTHS]).cumsum(0).to(torch.int32)
        for causal, softcap, heads, kv_heads in VARLEN_CASES:
            gen = torch.Generator().manual_seed(11)
            total = int(cu[-1])
            q, k, v, dout = (torch.randn(total, h, DIM, generator=gen, dtype=torch.float64)
                             for h in (heads, kv_heads, kv_heads, heads))
            dlse = torch.randn(heads, total, generator=gen, dtype=torch.float64)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = _varlen_forward(*leaves, cu, max(VARLEN_LENGTHS), causal,
                                           DIM ** -0.5, softcap, 0.0)
            torch.autograd.backward((ref, ref_lse), (dout, dlse))
            shards = [distributed.zigzag_shard_varlen(t, cu, rank, world).clone()
                      .requires_grad_() for t in (q, k, v)]
            local_cu = cu // world
            out, lse = distributed.ring_flash_attn_varlen_func(
                *shards, local_cu, max(VARLEN_LENGTHS) // world, causal=causal,
                softcap=softcap, return_lse=True, attention=VARLEN_REFERENCE)

            def shard(x):  # [H, total] by rows
                return distributed.zigzag_shard_varlen(x.transpose(0, 1), cu, rank,
                                                       world).transpose(0, 1)

            torch.autograd.backward((out, lse), (
                distributed.zigzag_shard_varlen(dout, cu, rank, world), shard(dlse)))
            torch.testing.assert_close(
                out, distributed.zigzag_shard_varlen(ref.detach(), cu, rank, world))
            torch.testing.assert_close(lse, shard(ref_lse.detach()))
            for got, leaf in zip(shards, leaves):
                torch.testing.assert_close(
                    got.grad, distributed.zigzag_shard_varlen(leaf.grad, cu, rank, world))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_varlen_attention_equals_the_unsharded(world, tmp_path):
    mp.spawn(_varlen_worker, args=(world, str(tmp_path / "rendezvous")), nprocs=world,
             join=True)


def test_varlen_shards_and_their_checks():
    x = torch.arange(48)
    assert distributed.zigzag_shard_varlen(x, [0, 16, 16, 48], 1, 2).tolist() == [
        *range(4, 12), *range(24, 40)]
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 4"):
        distributed.zigzag_shard_varlen(x, [0, 18, 48], 0, 2)
    with pytest.raises(ValueError, match="from 0 to the packed length 48"):
        distributed.zigzag_shard_varlen(x, [0, 16, 40], 0, 2)
    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="multiple of 2 \\(a shard holds two halves"):
        distributed.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 3, 10]), 7)
    with pytest.raises(ValueError, match="same packed rows"):
        distributed.ring_flash_attn_varlen_func(q, q[:8], q[:8], torch.tensor([0, 10]), 10)


def test_zigzag_shards_round_trip():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [distributed.zigzag_shard(x, r, 3) for r in range(3)]
    assert torch.equal(shards[0][0, :, 0], torch.tensor([0, 1, 2, 3, 20, 21, 22, 23]) * 3)
    assert torch.equal(distributed.zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="multiple of"):
        distributed.zigzag_shard(x, 0, 5)


def test_band_meets_where_a_key_is_visible():
    """The ring skips a (query chunk, key chunk) pair exactly when no row sees a key."""
    for length in (1, 4, 7):
        for offset in range(-10, 11):
            for window in [(-1, -1), (-1, 0), (0, 0), (2, -1), (0, 3), (3, 1)]:
                expected = bool(reference.visible_keys(length, length, offset, window).any())
                assert _ring._band_meets(offset, length, window) == expected


def test_bad_communication_is_refused_before_any_transfer():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="communication must be one of"):
        distributed.ring_flash_attn_func(q, q, q, communication="broadcast")
    with pytest.raises(ValueError, match="two equal chunks"):
        distributed.ring_flash_attn_func(q, q[:, :6], q[:, :6])


def test_bad_shapes_are_refused_before_any_transfer():
    """The ring entry points check what flash_attn_func and flash_attn_varlen_func check
    (here on CPU tensors, before any process group is touched): GQA heads, V's length,
    the batch, head dims."""
    q, kv = torch.randn(1, 8, 6, 16), torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match="multiple"):  # 6 query heads over 4 K/V heads
        distributed.ring_flash_attn_func(q, kv, kv)
    with pytest.raises(ValueError, match="same sequence length"):  # V shorter than K
        distributed.ring_flash_attn_func(q, q, q[:, :4])
    with pytest.raises(ValueError, match="batch"):
        distributed.ring_flash_attn_func(q, q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="head dim"):
        distributed.ring_flash_attn_func(q, q[..., :8], q)
    # CPU tensors for the kernels: refused as flash_attn_func refuses them (no process group
    # exists here: a transfer would raise something else)
    with pytest.raises(ValueError, match="CUDA"):
        distributed.ring_flash_attn_func(*(t.bfloat16() for t in (kv, kv, kv)))
    with pytest.raises(ValueError, match="CUDA"):
        distributed.ring_flash_attn_varlen_func(*(torch.randn(8, 2, 16).bfloat16()
                                                  for _ in range(3)), torch.tensor([0, 8]), 8)
    packed, cu = torch.randn(8, 6, 16), torch.tensor([0, 8])
    with pytest.raises(ValueError, match="multiple"):
        distributed.ring_flash_attn_varlen_func(packed, packed[:, :4], packed[:, :4], cu, 8)
    with pytest.raises(ValueError, match="head dim"):
        distributed.ring_flash_attn_varlen_func(packed, packed[..., :8], packed, cu, 8)


SEED = 5  # a dropout seed unlike every other argument


def test_kernel_seams_hand_the_ops_their_arguments_in_order(monkeypatch):
    """``kernel_attention`` and ``varlen_kernel_attention`` call flash_tile's ops (whose bodies
    need a GPU) with their arguments in the ops' order: the ops are stood in for by the
    float64 twins, which read every argument by the op body's own parameter name."""
    def bound(body, args):
        arguments = inspect.signature(body).bind(*args).arguments
        assert arguments.get("alibi_slopes") is None
        assert arguments.get("return_lse", True) and arguments["dropout_p"] == 0.0
        assert arguments["dropout_seed"] == SEED  # a swap with dropout_p would fail above
        return arguments, (arguments["window_left"], arguments["window_right"])

    def forward(*args):
        a, window = bound(_ops._forward_impl, args)
        return reference.attention_dense(a["q"], a["k"], a["v"], a["scale"], a["diag_offset"],
                                         window, a["softcap"], return_lse=True)

    def backward(*args):
        a, window = bound(_ops._backward_impl, args)
        return (*reference.attention_tiles_backward(
            a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], a["scale"],
            a["diag_offset"], window, a["softcap"], dlse=a["dlse"]), None)

    def varlen_forward(*args):
        a, window = bound(_ops._varlen_forward_impl, args)
        assert torch.equal(a["cu_seqlens_q"], a["cu_seqlens_k"])
        return reference.varlen_tiles(a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                      a["cu_seqlens_k"], a["scale"], window, a["softcap"])

    def varlen_backward(*args):
        a, window = bound(_ops._varlen_backward_impl, args)
        return (*reference.varlen_tiles_backward(
            a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], a["cu_seqlens_q"],
            a["cu_seqlens_k"], a["scale"], window, a["softcap"], dlse=a["dlse"]), None)

    for name, fake in (("attention_forward", forward), ("_backward_impl", backward),
                       ("varlen_attention", varlen_forward),
                       ("_varlen_backward_impl", varlen_backward)):
        monkeypatch.setattr(distributed, name, fake)
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64)
                     for shape in ((2, 4, 24, 16), (2, 2, 40, 16), (2, 2, 40, 8), (2, 4, 24, 8)))
    band = (9, (5, 3), 0.3, 2.0, 0.0)  # diag_offset, window, scale, softcap, dropout_p
    out, lse = distributed.kernel_attention.forward(q, k, v, *band, SEED)
    want_out, want_lse = _forward(q, k, v, *band, SEED)
    torch.testing.assert_close((out, lse), (want_out, want_lse))
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    for given in (None, dlse):  # the LSE's gradient reaches the op as its dlse
        for got, want in zip(distributed.kernel_attention.backward(dout, q, k, v, out, lse,
                                                                   *band, SEED, given),
                             _backward(dout, q, k, v, out, lse, *band, SEED, given)):
            torch.testing.assert_close(got, want)

    cu = torch.tensor([0, 7, 7, 24], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k[:, :, :24], v[:, :, :24], dout)]
    band = (cu, 17, True, 0.3, 2.0, 0.0)  # cu_seqlens, max_seqlen, causal, scale, softcap, p
    out, lse = distributed.varlen_kernel_attention.forward(*packed[:3], *band, SEED)
    torch.testing.assert_close((out, lse), _varlen_forward(*packed[:3], *band, SEED))
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    for given in (None, dlse):
        for got, want in zip(
                distributed.varlen_kernel_attention.backward(packed[3], *packed[:3], out, lse,
                                                             *band, SEED, given),
                _varlen_backward(packed[3], *packed[:3], out, lse, *band, SEED, given)):
            torch.testing.assert_close(got, want)


def _seed_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        calls = {"forward": [], "backward": []}

        def pair(q, k, diag_offset):  # the same in the forward and the backward
            return diag_offset, q.data_ptr(), k.sum().item()

        def forward(q, k, v, diag_offset, window, scale, softcap, dropout_p, seed):
            calls["forward"].append((pair(q, k, diag_offset), seed))
            return _forward(q, k, v, diag_offset, window, scale, softcap, 0.0, seed)

        def backward(dout, q, k, v, out, lse, diag_offset, window, scale, softcap, dropout_p,
                     seed, dlse):
            calls["backward"].append((pair(q, k, diag_offset), seed))
            return _backward(dout, q, k, v, out, lse, diag_offset, window, scale, softcap, 0.0,
                             seed, dlse)

        q, k, v, dout = (distributed.zigzag_shard(t, rank, world).requires_grad_()
                         for t in _inputs(2, 2)[:4])
        # Every rank draws the same seeds (ranks seeded alike); _rank_seed folds the rank in.
        draws = itertools.count(1)
        distributed._dropout_seed = lambda p: next(draws)
        # A window wide enough that every chunk pair meets (4 calls a step), then causal
        # (its pairs joined: 2 calls on the diagonal step, 1 on the others).
        for arguments, count in ((dict(window_size=(40, 40)), 4 * world),
                                 (dict(causal=True), world + 1)):
            calls["forward"].clear()
            calls["backward"].clear()
            out = distributed.ring_flash_attn_func(
                q, k, v, dropout_p=0.25, attention=distributed.LocalAttention(forward, backward),
                **arguments)
            out.backward(dout.detach())
            seeds = [seed for _, seed in calls["forward"]]
            assert len(calls["forward"]) == count and len(set(seeds)) == len(seeds)
            assert len({p for p, _ in calls["forward"]}) == count  # the calls told apart
            assert sorted(calls["backward"]) == sorted(calls["forward"])
            everyone = [None] * world
            dist.all_gather_object(everyone, seeds)
            assert len({s for rank_seeds in everyone for s in rank_seeds}) == count * world
    finally:
        dist.destroy_process_group()


def test_ring_backward_reuses_each_pairs_dropout_seed(tmp_path):
    """Under dropout every local call (a chunk pair, or pairs joined in one call) draws a
    seed of its own, and the ring's backward hands each call's backward the seed its forward
    drew (the dropout pattern is a function of it)."""
    mp.spawn(_seed_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def _group_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        # gather_shards leaves the gradient autograd hands it alone: another function of
        # the same output gets it unsummed.
        x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
        w = torch.zeros(2, 4 * world, 3, dtype=torch.float64, requires_grad=True)
        (distributed.gather_shards(x) + w).sum().backward()
        assert torch.equal(w.grad, torch.ones_like(w)) and torch.equal(
            x.grad, torch.full_like(x, world))
        # A bf16 shard's gradient is summed over the ranks in fp32 and comes back in bf16.
        scales = [torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(r),
                              dtype=torch.bfloat16) for r in range(world)]
        y = torch.randn(2, 4, 3, dtype=torch.bfloat16, requires_grad=True)
        summed, all_reduce = [], dist.all_reduce
        dist.all_reduce = lambda t, **kw: summed.append(t.dtype) or all_reduce(t, **kw)
        try:
            (distributed.gather_shards(y) * scales[rank]).sum().backward()
        finally:
            dist.all_reduce = all_reduce
        assert summed == [torch.float32] and y.grad.dtype == torch.bfloat16
        expect = sum(t.float() for t in scales).chunk(world, dim=1)[rank].to(torch.bfloat16)
        assert torch.equal(y.grad, expect)
        # A backward that builds a graph (create_graph=True) is refused in both forms: the
        # local backwards' gradients carry no graph of their own.
        q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        for communication in distributed.COMMUNICATIONS:
            out = distributed.ring_flash_attn_func(q, k, v, causal=True, attention=REFERENCE,
                                                   communication=communication)
            with pytest.raises(NotImplementedError, match="second derivative"):
                torch.autograd.grad(out.square().sum(), q, create_graph=True)
        # A rank outside the group it is given is told so, before any transfer.
        first = dist.new_group([0])
        q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
        for communication in distributed.COMMUNICATIONS:
            if rank == 0:
                continue
            with pytest.raises(ValueError, match="not a member"):
                distributed.ring_flash_attn_func(q, q, q, group=first, attention=REFERENCE,
                                                 communication=communication)
    finally:
        dist.destroy_process_group()


def test_gather_gradients_and_groups(tmp_path):
    mp.spawn(_group_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def test_multicast_stays_off():
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        assert os.environ.get(name) == value, name


def _assert_bf16_close(got, expect, rel):
    """``got`` within ``rel`` of ``expect`` element by element, plus ``rel`` times expect's
    RMS (an absolute floor at the tensors' own scale, where a fixed one would be as large as
    the values): the same kernels on the same rows, summed in another order."""
    scale = expect.float().square().mean().sqrt().item()
    torch.testing.assert_close(got, expect, rtol=rel, atol=rel * scale)


def _gpu_worker(rank, world, path, length, causal, communication, window=(-1, -1)):
    import conftest  # the spawned process: the ops' outputs start as NaN here too

    conftest.poison_outputs()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        import flash_tile

        gen = torch.Generator(device="cuda").manual_seed(length)
        q, k, v, dout = (torch.randn(1, length, h, 128, generator=gen, device="cuda",
                                     dtype=torch.bfloat16) for h in (16, 4, 4, 16))
        dlse = torch.randn(1, 16, length, generator=gen, device="cuda")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        whole, whole_lse = flash_tile.flash_attn_func(*leaves, causal=causal,
                                                      window_size=window, return_lse=True)
        torch.autograd.backward((whole, whole_lse), (dout, dlse))
        shards = [distributed.zigzag_shard(t, rank, world).clone().requires_grad_()
                  for t in (q, k, v)]
        out, lse = distributed.ring_flash_attn_func(*shards, causal=causal, window_size=window,
                                                    return_lse=True,
                                                    communication=communication)
        torch.autograd.backward((out, lse), (distributed.zigzag_shard(dout, rank, world),
                                             distributed.zigzag_shard(dlse, rank, world, 2)))
        _assert_bf16_close(out, distributed.zigzag_shard(whole.detach(), rank, world), 2e-2)
        # fp32 both: the merge of the pairs' LSEs against the one call's
        torch.testing.assert_close(lse, distributed.zigzag_shard(whole_lse.detach(), rank,
                                                                 world, 2), rtol=1e-4, atol=1e-4)
        for got, leaf in zip(shards, leaves):
            _assert_bf16_close(got.grad, distributed.zigzag_shard(leaf.grad, rank, world), 5e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs (NCCL between them)")
@pytest.mark.parametrize("communication", distributed.COMMUNICATIONS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [8192, 32768])
def test_two_gpus_equal_one(length, causal, communication, tmp_path):
    mp.spawn(_gpu_worker, args=(2, str(tmp_path / "rendezvous"), length, causal,
                                communication), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("communication", distributed.COMMUNICATIONS)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)),
                                           (True, (300, -1))])
def test_one_rank_ring_equals_one_call(causal, window, communication, tmp_path):
    """Both forms on one rank (NCCL, no transfers) against one flash_attn_func call. The
    ring: its two chunks' kernel calls with their LSEs, the merge and the ring's backward
    (each pair's backward kernel on the merged output and LSE, the sums in fp32); the window
    leaves rows of the late chunk with no key in one of its pairs (LSE +inf). The all-gather:
    the gather, one kernel call a chunk and NCCL's reduce-scatter of the fp32 gradients."""
    mp.spawn(_gpu_worker, args=(1, str(tmp_path / "rendezvous"), 4096, causal, communication,
                                window), nprocs=1, join=True)


def _gpu_varlen_worker(rank, world, path, causal):
    import conftest

    conftest.poison_outputs()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        import flash_tile

        lengths = [4096, 1024, 0, 2048 + 512]
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        gen = torch.Generator(device="cuda").manual_seed(5)
        q, k, v, dout = (torch.randn(int(cu[-1]), h, 128, generator=gen, device="cuda",
                                     dtype=torch.bfloat16) for h in (16, 4, 4, 16))
        dlse = torch.randn(16, int(cu[-1]), generator=gen, device="cuda")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        whole, whole_lse = flash_tile.flash_attn_varlen_func(
            *leaves, cu, cu, max(lengths), max(lengths), causal=causal, return_lse=True)
        torch.autograd.backward((whole, whole_lse), (dout, dlse))
        shards = [distributed.zigzag_shard_varlen(t, cu, rank, world).clone().requires_grad_()
                  for t in (q, k, v)]

        def by_rows(x):  # a [H, total] LSE's rows of this rank's shard
            return distributed.zigzag_shard_varlen(x.transpose(0, 1), cu, rank,
                                                   world).transpose(0, 1)

        out, lse = distributed.ring_flash_attn_varlen_func(
            *shards, cu // world, max(lengths) // world, causal=causal, return_lse=True)
        torch.autograd.backward((out, lse), (
            distributed.zigzag_shard_varlen(dout, cu, rank, world), by_rows(dlse)))
        _assert_bf16_close(out, distributed.zigzag_shard_varlen(whole.detach(), cu, rank,
                                                                 world), 2e-2)
        torch.testing.assert_close(lse, by_rows(whole_lse.detach()), rtol=1e-4, atol=1e-4)
        for got, leaf in zip(shards, leaves):
            _assert_bf16_close(got.grad, distributed.zigzag_shard_varlen(leaf.grad, cu, rank,
                                                                         world), 5e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ring_equals_one_call(world, causal, tmp_path):
    """The varlen ring through the kernels against one flash_attn_varlen_func call on the
    whole packed batch: on one rank (its half-sequence calls, the merge, the ring's backward)
    and, given two GPUs, across them."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPU(s)")
    mp.spawn(_gpu_varlen_worker, args=(world, str(tmp_path / "rendezvous"), causal),
             nprocs=world, join=True)
