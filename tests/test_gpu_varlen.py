"""flash_attn_varlen_func on the GPU, forward and backward, against an fp32 reference computed
per sequence with flash-attn's rules (2x output, 3x gradients), each sequence checked on its
own rows; the packed forms, dropout, the custom op's contract, torch.compile and CUDA-graph
capture."""

import math

import pytest
import torch

import flash_tile
from conftest import VARIANTS_CAPABILITY
from flash_tile import _launch, _ops, autotune, reference, variants, varlen

pytestmark = pytest.mark.gpu

SEED = 515151


def _packed(lengths, heads, dim, dtype, gen):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    rows = torch.randn(int(cu[-1]), heads, dim, generator=gen, device="cuda").to(dtype)
    return rows, cu


def _inputs(lengths_q, lengths_k, heads, kv_heads, dim, v_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, cu_q = _packed(lengths_q, heads, dim, dtype, gen)
    k, cu_k = _packed(lengths_k, kv_heads, dim, dtype, gen)
    v, _ = _packed(lengths_k, kv_heads, v_dim, dtype, gen)
    dout, _ = _packed(lengths_q, heads, v_dim, dtype, gen)
    return q, k, v, dout, cu_q, cu_k


def _reference(q, k, v, dout, cu_q, cu_k, dtype, features, seqused_k=None):
    """Packed (out, dq, dk, dv) of ``attention_dense`` run on each sequence alone in
    ``dtype``, by autograd; ``features(b)`` gives sequence b's keyword arguments."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dtype, device="cuda")
    loss = 0.0
    for b, rows, seq, diag in reference.varlen_sequences(*leaves, cu_q, cu_k, seqused_k):
        if seq[1].shape[2] == 0:
            continue  # no key: zero output and gradients
        o = reference.attention_dense(*seq, diag_offset=diag, **features(b))[0].transpose(0, 1)
        out[rows] = o.detach()
        loss = loss + (o * dout[rows].to(dtype)).sum()
    if torch.is_tensor(loss):
        loss.backward()
    return (out, *(torch.zeros_like(t) if t.grad is None else t.grad for t in leaves))


def _ours(q, k, v, dout, cu_q, cu_k, max_q, max_k, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_tile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, **kwargs)
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


def _check_per_sequence(got, ref, low, cu_q, cu_k):
    """Each sequence's output rows and gradient rows under the 2x/3x rule; keys that no
    query sees must get exactly zero gradients, queries that see no key zero rows."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        for i, (name, where, factor) in enumerate((("out", rows, 2), ("dq", rows, 3),
                                                   ("dk", keys, 3), ("dv", keys, 3))):
            g, r = got[i][where], ref[i][where]
            if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
                assert torch.equal(g, torch.zeros_like(g)), (b, name)
                continue
            report = reference.check_error(g, r, low[i][where], factor)
            assert report["ok"], (b, name, report)


def _features(causal, window, softcap=0.0, slopes=None, dropout_p=0.0):
    window = (window[0], 0) if causal else window

    def features(b):
        return dict(window=window, softcap=softcap,
                    alibi_slopes=None if slopes is None else slopes[b:b + 1],
                    dropout_p=dropout_p, dropout_seed=SEED, dropout_batch=b)
    return features


LENGTHS = [
    ([0, 1, 17, 113, 203, 1023, 4097], [0, 1, 17, 113, 203, 1023, 4097]),  # Lq = Lk
    ([5, 1, 40, 113, 130, 0], [3, 60, 40, 250, 0, 70]),  # Lq != Lk; no key; no query
    ([300], [300]),                                      # batch 1
]


@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "ragged", "one"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                            (True, (64, -1)), (False, (20, 9))],
                         ids=["full", "causal", "causal-window", "window"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_and_backward_against_each_sequence(lengths, causal, window, dtype,
                                                     backward_form):
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, 8, 2, 128, 128, dtype, len(lengths[0]))
    max_q, max_k = max(lengths[0]), max(lengths[1])
    got = _ours(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window)
    features = _features(causal, window)
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, dtype, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (20, 5)), (True, (30, -1))])
def test_seqused_k(causal, window, backward_form):
    """Each sequence uses only its first seqused_k[b] keys (FA3's): output and gradients as
    attention on those keys alone (the band, causal or a window, aligned to them), zero
    gradients past them."""
    lengths = ([5, 1, 40, 113, 130], [30, 60, 40, 250, 9])
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, 8, 2, 64, 64, torch.bfloat16, 10)
    used = torch.tensor([30, 0, 17, 113, 9], dtype=torch.int32, device="cuda")
    got = _ours(q, k, v, dout, cu_q, cu_k, 130, 250, causal=causal, window_size=window,
                seqused_k=used)
    features = _features(causal, window)
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features, used)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features, used)
    cu_used = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    keep = torch.cat([torch.arange(int(s), int(s) + int(n), device="cuda")
                      for s, n in zip(cu_k, used)])
    unused = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    unused[keep] = False
    for g in got[2:]:  # dk, dv past the used keys
        assert torch.equal(g[unused], torch.zeros_like(g[unused]))
    # Per sequence on the used keys: the ones kept, re-packed as their own offsets.
    pick = [got[0], got[1], got[2][keep], got[3][keep]]
    _check_per_sequence(pick, [ref[0], ref[1], ref[2][keep], ref[3][keep]],
                        [low[0], low[1], low[2][keep], low[3][keep]], cu_q, cu_used)


@pytest.mark.parametrize("causal", [False, True])
def test_offsets_that_start_past_row_zero(causal, backward_form):
    """Offsets need not start at row 0 (nor end at the last row): rows before the first
    sequence and after the last belong to none. Each sequence's results are its own; the
    flattened grid gives the rows before the first sequence no programs (under the one pass
    a program there would add a stray dQ into the first sequence's rows)."""
    lengths = ([300, 130, 17, 203, 1, 40], [200, 130, 50, 203, 9, 40])
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, 4, 2, 128, 128, torch.bfloat16, 11)
    cu_q, cu_k = cu_q[1:-1], cu_k[1:-1]  # from row 300 (200 for keys) to 40 rows short
    got = _ours(q, k, v, dout, cu_q, cu_k, 203, 203, causal=causal)
    features = _features(causal, (-1, -1))
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


GUARD = 64  # NaN rows on each side of a guarded view


def _guarded(shape, dtype, dim=0):
    """(a NaN-filled buffer, the view of ``shape`` inside it): GUARD rows of the buffer
    along ``dim`` on each side, and along a last ``dim`` a few more to keep the buffer's rows
    16-byte aligned, as the ops' own fp32 LSE rows are where TMA stores them."""
    width = shape[dim] + 2 * GUARD
    width += -width % 8
    buffer = torch.full((*shape[:dim], width, *shape[dim + 1:]), math.nan, dtype=dtype,
                        device="cuda")
    return buffer, buffer.narrow(dim, GUARD, shape[dim])


def _only_sequence_rows_written(buffer, cu, dim=0):
    """Rows cu[0] .. cu[-1] (along ``dim``) of the view inside ``buffer`` are written (no
    NaN left); every other row of the buffer, the view's rows outside the sequences and the
    guards, is still all NaN."""
    rows = torch.arange(buffer.shape[dim], device=buffer.device)
    inside = (rows >= GUARD + cu[0]) & (rows < GUARD + cu[-1])
    nan = torch.isnan(buffer.float()).movedim(dim, 0).flatten(1)
    assert not bool(nan[inside].any()) and bool(nan[~inside].all())


@pytest.mark.parametrize("causal", [False, True])
def test_clipped_stores_write_only_their_sequences(causal, backward_form):
    """The varlen kernels' stores are clipped to each sequence (tile views of the packed
    arrays made per sequence at run time, TMA stores on sm_90): the output, LSE and gradients
    are views inside NaN-filled buffers, the offsets start past row 0 and end short of the
    last row, and after the forward and the backward only the sequences' rows have changed.
    (compute-sanitizer's memcheck cannot vouch for these stores: it flags the tensor maps
    they write at run time into a driver-owned region as out-of-bounds atomics.)"""
    lengths = ([300, 130, 17, 203, 1, 40], [200, 130, 50, 203, 9, 40])
    heads, kv_heads, dim = 4, 2, 128
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, heads, kv_heads, dim, dim, torch.bfloat16, 12)
    cu_q, cu_k = cu_q[1:-1], cu_k[1:-1]
    (out_buffer, out), (dq_buffer, dq) = (_guarded(q.shape, q.dtype) for _ in range(2))
    (dk_buffer, dk), (dv_buffer, dv) = (_guarded(k.shape, k.dtype) for _ in range(2))
    lse_buffer, lse = _guarded((heads, q.shape[0]), torch.float32, dim=1)
    capability = torch.cuda.get_device_capability()
    window, scale = ((-1, 0) if causal else (-1, -1)), dim ** -0.5
    packing = _launch.Varlen(cu_q, cu_k)
    _launch.launch_forward(*_ops._packed(q, k, v, out), lse[None], None, None, scale, 0.0, 0,
                           window, variants.default_config(capability, dim), varlen=packing)
    _launch.launch_backward(*_ops._packed(dout, q, k, v, out), lse[None],
                            *_ops._packed(dq, dk, dv), None, None, None, scale, 0.0, 0, window,
                            variants.default_backward_config(capability, dim, plain=True),
                            varlen=packing)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for buffer, cu, axis in ((out_buffer, cu_q, 0), (lse_buffer, cu_q, 1), (dq_buffer, cu_q, 0),
                             (dk_buffer, cu_k, 0), (dv_buffer, cu_k, 0)):
        _only_sequence_rows_written(buffer, cu, axis)


def test_lse_and_rows_without_keys():
    q, k, v, _, cu_q, cu_k = _inputs(*LENGTHS[1], 4, 4, 64, 64, torch.bfloat16, 1)
    with torch.no_grad():
        out, lse = flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 250,
                                                     causal=True, return_lse=True)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        if seq[1].shape[2] == 0:
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert bool((lse[:, rows] == math.inf).all())
            continue
        _, ref_lse = reference.attention_dense(*(t.float() for t in seq), diag_offset=diag,
                                               window=(-1, 0), return_lse=True)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_the_lse(causal, backward_form):
    """A loss on the output and on the LSE, as ring attention's merge makes: dLSE shifts
    Delta in the varlen backward, each sequence's rows by their own (GQA, Lq != Lk)."""
    q, k, v, dout, cu_q, cu_k = _inputs([1, 17, 113, 203], [5, 17, 150, 203], 4, 2, 64, 64,
                                        torch.bfloat16, 7)
    dlse = torch.randn(4, q.shape[0], device="cuda")
    window = (-1, 0) if causal else (-1, -1)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        torch.autograd.backward((out, lse), (dout.to(out.dtype), dlse.to(lse.dtype)))
        return lse.detach(), (out.detach(), *(t.grad for t in leaves))

    def ours(q, k, v):
        return flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 203, 203, causal=causal,
                                                 return_lse=True)

    def dense(q, k, v):  # each sequence alone, joined back in packed order
        outs, lses = [], []
        for _, _, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
            o, lse = reference.attention_dense(*seq, diag_offset=diag, window=window,
                                               return_lse=True)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    got_lse, got = grads(ours, torch.bfloat16)
    ref_lse, ref = grads(dense, torch.float32)
    _, low = grads(dense, torch.bfloat16)
    # The LSE is fp32 on both sides: held to fp32's tolerance, not to bf16 torch's error.
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-4, atol=1e-3)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


@pytest.mark.parametrize("dim,v_dim,heads,kv_heads", [(64, 64, 8, 1), (80, 48, 4, 4),
                                                      (256, 256, 4, 2), (16, 16, 6, 3)])
def test_softcap_alibi_head_dims_and_groups(dim, v_dim, heads, kv_heads, backward_form):
    lengths = ([17, 203, 64, 1], [40, 203, 64, 9])
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, heads, kv_heads, dim, v_dim,
                                        torch.bfloat16, dim)
    slopes = torch.rand(len(lengths[0]), heads, device="cuda") * 0.3
    got = _ours(q, k, v, dout, cu_q, cu_k, 203, 203, causal=True, softcap=20.0,
                alibi_slopes=slopes)
    features = _features(True, (-1, -1), 20.0, slopes)
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


def test_many_sequences():
    gen = torch.Generator().manual_seed(64)
    lengths_q = torch.randint(0, 300, (64,), generator=gen).tolist()
    lengths_k = torch.randint(1, 400, (64,), generator=gen).tolist()
    q, k, v, dout, cu_q, cu_k = _inputs(lengths_q, lengths_k, 4, 2, 64, 64, torch.bfloat16, 2)
    got = _ours(q, k, v, dout, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    features = _features(True, (-1, -1))
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_keys_each_sequence_by_its_own_index(causal, monkeypatch, backward_form):
    monkeypatch.setattr(varlen, "_dropout_seed", lambda dropout_p: SEED)
    lengths = ([113, 1, 203, 40], [150, 77, 203, 40])
    q, k, v, dout, cu_q, cu_k = _inputs(*lengths, 4, 2, 64, 64, torch.bfloat16, 3)
    got = _ours(q, k, v, dout, cu_q, cu_k, 203, 203, causal=causal, dropout_p=0.2)
    features = _features(causal, (-1, -1), dropout_p=0.2)
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)


def test_packed_forms_equal_the_unpacked_call():
    lengths = [17, 203, 64]
    q, _, _, dout, cu, _ = _inputs(lengths, lengths, 4, 4, 64, 64, torch.float16, 4)
    qkv = torch.randn(q.shape[0], 3, 4, 64, device="cuda", dtype=torch.float16)
    want = _ours(*qkv.unbind(1), dout, cu, cu, 203, 203, causal=True)
    leaf = qkv.clone().requires_grad_()
    out = flash_tile.flash_attn_varlen_qkvpacked_func(leaf, cu, 203, causal=True)
    out.backward(dout)
    assert torch.equal(out, want[0])
    assert torch.equal(leaf.grad, torch.stack(want[1:], 1))
    leaves = qkv[:, 0].clone().requires_grad_(), qkv[:, 1:].clone().requires_grad_()
    out = flash_tile.flash_attn_varlen_kvpacked_func(*leaves, cu, cu, 203, 203, causal=True)
    out.backward(dout)
    assert torch.equal(out, want[0]) and torch.equal(leaves[0].grad, want[1])
    assert torch.equal(leaves[1].grad, torch.stack(want[2:], 1))


def test_backward_is_deterministic(backward_form):
    """``deterministic=True``: the same bits on every run, whatever the default form; the
    default agrees with it within rounding."""
    q, k, v, dout, cu_q, cu_k = _inputs(*LENGTHS[0], 8, 2, 128, 128, torch.bfloat16, 5)
    runs = [_ours(q, k, v, dout, cu_q, cu_k, 4097, 4097, causal=True, deterministic=True)
            for _ in range(3)]
    for a, b, c in zip(*runs):
        assert torch.equal(a, b) and torch.equal(a, c)
    default = _ours(q, k, v, dout, cu_q, cu_k, 4097, 4097, causal=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), default, runs[0]):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 8 * 2**-8 * scale, name


def test_opcheck():
    q, k, v, _, cu_q, cu_k = _inputs([17, 40], [30, 50], 2, 2, 64, 64, torch.float16, 6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_tile.varlen_forward,
                          (q, k, v, cu_q, cu_k, None, 0.125, 0.0, -1, 0, True))


def test_torch_compile_fullgraph_matches_eager():
    q, k, v, dout, cu_q, cu_k = _inputs(*LENGTHS[1], 4, 2, 64, 64, torch.bfloat16, 7)

    def step(q, k, v, cu_q, cu_k):
        return flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 250, causal=True)

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu_q, cu_k)
        out.backward(dout)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cuda_graph_replays_new_lengths():
    """Captured once, replayed after the inputs and the cumulative lengths change in place
    (same totals and bounds): the launch reads cu_seqlens on the device, never on the host."""
    first = _inputs([100, 28, 0, 72], [64, 100, 30, 56], 4, 2, 64, 64, torch.bfloat16, 8)
    second = _inputs([50, 50, 90, 10], [150, 50, 25, 25], 4, 2, 64, 64, torch.bfloat16, 9)
    static = [t.clone() for t in first]

    def call():
        q, k, v, _, cu_q, cu_k = static
        return flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 150, causal=True)

    with torch.no_grad():
        call()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for inputs in (second, first):
            for dst, src in zip(static, inputs):
                dst.copy_(src)
            graph.replay()
            q, k, v, _, cu_q, cu_k = inputs
            want = flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 150,
                                                     causal=True)
            assert torch.equal(out, want)


def test_autotune_tunes_varlen_classes_on_their_written_rows(tmp_path, monkeypatch):
    """With tuning on, a varlen forward and backward are tuned as classes of their own (the
    packing's mean length), every registered candidate checked against the default on the
    rows the sequences cover: the packing below leaves 40 rows of q and k past the last
    sequence, which the kernels never write, and no candidate may be rejected for them. The
    winners' results pass the per-sequence check."""
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(tmp_path))
    autotune.clear_memory_cache()
    lengths = [17, 203, 1023, 0, 513]
    q, k, v, dout, cu_q, cu_k = _inputs(lengths + [40], lengths + [40], 4, 2, 64, 64,
                                        torch.bfloat16, SEED)
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]  # the last 40 rows belong to no sequence
    got = _ours(q, k, v, dout, cu_q, cu_k, 1023, 1023, causal=True)
    [path] = tmp_path.glob("autotune-*.json")
    entries = autotune.Cache(path).entries
    assert sorted(key.split("|")[0] for key in entries) == ["bwd", "fwd"]
    for key, entry in entries.items():
        assert "|varlen|q512|k512" in key  # 1796 rows over 5 sequences: mean 359
        assert len(entry["results"]) > 1
        rejected = [name for name, r in entry["results"].items() if isinstance(r, str)]
        assert not [r for r in rejected if "differs" in entry["results"][r]], entry
    features = _features(True, (-1, -1))
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)
    autotune.clear_memory_cache()


def test_cli_tune_varlen_fills_the_classes_a_packing_looks_up(tmp_path, monkeypatch, capsys):
    """``flash-tile tune --varlen --backward`` tunes the forward and backward classes of its
    equal-length packing; a ragged packing of another mean in the same bucket (and of other
    heads count, same head dim and group) then finds them: it adds no class to the cache."""
    from flash_tile.cli import main

    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(tmp_path))
    autotune.clear_memory_cache()
    assert main(["tune", "--varlen", "--backward", "--dtypes", "bf16", "--head-dims", "64",
                 "--lengths", "300", "--causal", "yes", "--tokens", "2400",
                 "--width", "256"]) == 0
    [path] = tmp_path.glob("autotune-*.json")
    tuned = set(autotune.Cache(path).entries)
    assert sorted(key.split("|")[0] for key in tuned) == ["bwd", "fwd"]
    assert all("|varlen|q512|k512" in key for key in tuned), tuned
    autotune.clear_memory_cache()
    lengths = [17, 500, 283]  # 800 rows over 3 sequences: mean 266, bucket 512
    q, k, v, dout, cu_q, cu_k = _inputs(lengths, lengths, 2, 2, 64, 64, torch.bfloat16, SEED)
    got = _ours(q, k, v, dout, cu_q, cu_k, 500, 500, causal=True)
    assert set(autotune.Cache(path).entries) == tuned
    features = _features(True, (-1, -1))
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)
    autotune.clear_memory_cache()


# Every registered variant may now run a varlen class (the tuner picks among them): each one,
# forward and backward, on ragged packings.
VARIANT_CASES = [(backward, d, c) for backward in (False, True) for d in (64, 128)
                 for c in variants.candidates(VARIANTS_CAPABILITY, d, backward)]


@pytest.mark.parametrize("backward,dim,config", VARIANT_CASES,
                         ids=[f"{'bwd' if b else 'fwd'}-d{d}-"
                              f"{autotune.describe(c).replace(' ', '-')}"
                              for b, d, c in VARIANT_CASES])
def test_every_registered_variant_under_varlen(backward, dim, config, monkeypatch):
    """The pass under test launches ``config`` (the other its default), causal with Lq != Lk
    per sequence, empty sequences and ragged ends; checked per sequence."""
    choose = _ops._choose

    def pinned(is_backward, *args, **kwargs):
        return config if is_backward == backward else choose(is_backward, *args, **kwargs)

    monkeypatch.setattr(_ops, "_choose", pinned)
    q, k, v, dout, cu_q, cu_k = _inputs(*LENGTHS[1], 4, 2, dim, dim, torch.bfloat16, dim)
    got = _ours(q, k, v, dout, cu_q, cu_k, 130, 250, causal=True)
    features = _features(True, (-1, -1))
    ref = _reference(q, k, v, dout, cu_q, cu_k, torch.float32, features)
    low = _reference(q, k, v, dout, cu_q, cu_k, torch.bfloat16, features)
    _check_per_sequence(got, ref, low, cu_q, cu_k)
