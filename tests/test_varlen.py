"""Packed variable-length sequences on the CPU: the float64 twins of the forward's and the
backward's VARLEN switches against plain attention (and its autograd) per sequence, the entry
points' checks and their wiring to the launches, and ahead-of-time compiles of the switches
for every architecture."""

import contextlib

import numpy as np
import pytest
import torch

from flash_tile import _launch, _ops, _validate, aot, reference, variants, varlen
from sass_checks import assert_tensor_core_path

LENGTHS_Q = [0, 1, 17, 113, 203, 5]
LENGTHS_K = [3, 1, 40, 113, 150, 0]  # Lq != Lk per sequence; 0 keys: rows see nothing


def _packed(lengths, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(int(cu[-1]), heads, dim, generator=gen, dtype=torch.float64), cu


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0), (7, 9)])
@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)])
def test_twin_equals_plain_attention_per_sequence(window, tiles):
    q, cu_q = _packed(LENGTHS_Q, 4, 16, 0)
    k, cu_k = _packed(LENGTHS_K, 2, 16, 1)
    v, _ = _packed(LENGTHS_K, 2, 8, 2)
    slopes = torch.rand(len(LENGTHS_Q), 4, dtype=torch.float64)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, None, window, 4.0, slopes, *tiles)
    assert out.shape == (q.shape[0], 4, 8) and lse.shape == (4, q.shape[0])
    checked = 0
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        ref, ref_lse = reference.attention_dense(*seq, diag_offset=diag, window=window,
                                                 softcap=4.0, alibi_slopes=slopes[b:b + 1],
                                                 return_lse=True)  # no key: 0 and +inf
        assert torch.allclose(out[rows], ref[0].transpose(0, 1), atol=1e-12)
        assert torch.equal(lse[:, rows].isinf(), ref_lse[0].isinf())
        finite = ~ref_lse[0].isinf()
        assert torch.allclose(lse[:, rows][finite], ref_lse[0][finite], atol=1e-12)
        checked += 1
    assert checked == sum(n > 0 for n in LENGTHS_Q)


def _args(dtype=torch.bfloat16):
    q = torch.randn(20, 4, 64).to(dtype)
    k = torch.randn(30, 2, 64).to(dtype)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    return q, k, k, cu_q, cu_k, 15, 20


@pytest.mark.parametrize("change,error,match", [
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(return_attn_probs=True, dropout_p=0.1), NotImplementedError, "S_dmask"),
    (dict(max_seqlen_q=15.0), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_q=np.array(15.0)), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_k=True), ValueError, "max_seqlen_k"),
    (dict(max_seqlen_k=torch.tensor([20])), ValueError, "max_seqlen_k"),
    (dict(window_size=(3,)), ValueError, "window_size"),
])
def test_bad_arguments_raise_before_launch(change, error, match):
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    kwargs = {"max_seqlen_q": max_q, "max_seqlen_k": max_k, **change}
    with pytest.raises(error, match=match):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kwargs)


def test_bad_shapes_raise_before_launch(monkeypatch):
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    with pytest.raises(ValueError, match="3-D"):
        varlen.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="same dtype"):
        varlen.flash_attn_varlen_func(q.half(), k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="CUDA tensors"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    with pytest.raises(ValueError, match="int32"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:2], max_q, max_k)
    with pytest.raises(ValueError, match=r"seqused_k must have shape \[2\]"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                      seqused_k=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k must be an int32"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                      seqused_k=torch.zeros(2))
    with pytest.raises(ValueError, match="qkv"):
        varlen.flash_attn_varlen_qkvpacked_func(q, cu_q, max_q)
    with pytest.raises(ValueError, match="kv"):
        varlen.flash_attn_varlen_kvpacked_func(q, k, cu_q, cu_k, max_q, max_k)


def test_the_call_reaches_the_launch_as_packed_views(monkeypatch):
    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    monkeypatch.setattr(_ops, "launch_forward", lambda *a: calls.append(a))
    monkeypatch.setattr(varlen, "_dropout_seed", lambda p: 77)  # no CUDA to ask about capture
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    out, lse = varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                             window_size=(8, -1), softcap=5.0, return_lse=True,
                                             dropout_p=0.25)
    (qv, kv, vv, outv, lsev, slopes, mask, scale, softcap, _, window, config, drop,
     packing, sinks, descale) = calls[0]
    assert qv.shape == (1, 4, 20, 64) and kv.shape == (1, 2, 30, 64)
    assert outv.shape == (1, 4, 20, 64) and outv.data_ptr() == out.data_ptr()
    assert lsev.shape == (1, 4, 20) and lsev.data_ptr() == lse.data_ptr()
    assert (slopes, mask, scale, softcap, window) == (None, None, 0.125, 5.0, (8, 0))
    assert config == variants.default_config((9, 0), 64)
    assert drop == _launch.Dropout(0.25, 77)
    assert packing == _launch.Varlen(cu_q, cu_k) and sinks is None and descale is None
    assert out.shape == (20, 4, 64) and lse.shape == (4, 20)


@pytest.mark.parametrize("max_seqlen", [np.int64(15), torch.tensor(15), 0], ids=str)
def test_max_seqlen_takes_what_flash_attns_int_parameter_takes(monkeypatch, max_seqlen):
    """flash-attn passes max_seqlen_q/k to an int parameter, which takes numpy integers and
    0-d integer tensors (and 0, its value when no sequence has keys); the kernels do not read
    it, so the call reaches the launch whatever it is."""
    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    monkeypatch.setattr(_ops, "launch_forward", lambda *a: calls.append(a))
    q, k, v, cu_q, cu_k, _, _ = _args()
    varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen, max_seqlen, causal=True)
    assert len(calls) == 1


def test_max_seqlen_from_item_compiles_without_a_guard(monkeypatch):
    """Under torch.compile(fullgraph=True) with captured scalars, a max_seqlen read with
    ``.item()`` (as Transformers computes it) is an unbacked SymInt: the check takes it
    without comparing it (a comparison could not be traced). Meta tensors for the packed
    inputs, the lengths on the CPU (``.item()`` runs)."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_validate, "check_index_tensor", lambda t, *args: t)
    monkeypatch.setattr(dynamo_config, "capture_scalar_outputs", True)
    torch.compiler.reset()
    q = torch.empty(20, 4, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(30, 2, 64, dtype=torch.bfloat16, device="meta")
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)

    def fn(q, k, cu_q, cu_k):
        max_q, max_k = cu_q.diff().max().item(), cu_k.diff().max().item()
        return varlen.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max_q, max_k, causal=True)

    out = torch.compile(fn, fullgraph=True, backend="eager")(q, k, cu_q, cu_k)
    assert out.shape == q.shape


@pytest.mark.parametrize("empty", ["keys", "queries"])
@pytest.mark.parametrize("sinks", [False, True])
def test_no_keys_or_no_queries_launch_nothing(monkeypatch, empty, sinks):
    """Every sequence without keys (flash-attn 2.8 then returns out 0 and an LSE of +inf,
    max_seqlen_k = 0), or a packing without query rows: out 0 (or empty), the LSE +inf or
    the head's sink, nothing launched forward or backward; dq 0, dk and dv 0, and a sink's
    gradient the sum of its head's dLSE (its row's one term). CPU tensors."""
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    for name in ("launch_forward", "launch_backward"):
        monkeypatch.setattr(_ops, name, lambda *a, name=name: pytest.fail(f"{name} called"))
    total_q, total_k = (17, 0) if empty == "keys" else (0, 9)
    cu_q = torch.tensor([0, 7, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, min(total_k, 4), total_k], dtype=torch.int32)
    q = torch.randn(total_q, 4, 64).bfloat16().requires_grad_()
    k, v = (torch.randn(total_k, 2, 64).bfloat16().requires_grad_() for _ in range(2))
    logits = torch.randn(4).requires_grad_() if sinks else None
    out, lse = varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, total_q, total_k,
                                             causal=True, return_lse=True, sinks=logits)
    assert out.shape == (total_q, 4, 64) and bool((out == 0).all())
    want = (logits.detach()[:, None].expand(4, total_q) if sinks else
            torch.full((4, total_q), torch.inf))
    assert torch.equal(lse.detach(), want)
    dlse = torch.randn(4, total_q)
    torch.autograd.backward((out, lse), (torch.randn_like(out), dlse))
    assert q.grad.shape == q.shape and bool((q.grad == 0).all())
    assert bool((k.grad == 0).all()) and bool((v.grad == 0).all())
    if sinks:
        torch.testing.assert_close(logits.grad, dlse.sum(1))


def test_the_gradient_reaches_the_backward_launch(monkeypatch):
    """With a gradient the forward keeps its LSE, and the backward launches the VARLEN switch
    on the packed views with the forward's arguments; the gradients come back packed."""
    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    monkeypatch.setattr(_ops, "launch_forward", lambda *a: None)
    monkeypatch.setattr(_ops, "launch_backward", lambda *a: calls.append(a))
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    out.backward(torch.ones_like(out))
    args = calls[0]
    dout, qv, _, _, _, lsev, dqv, dkv, dvv = args[:9]
    assert dout.shape == (1, 4, 20, 64) and lsev.shape == (1, 4, 20)
    assert dqv.shape == (1, 4, 20, 64) and dkv.shape == dvv.shape == (1, 2, 30, 64)
    assert args[-2] == _launch.Varlen(cu_q, cu_k) and args[-1] is None
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("first_row", [0, 1, 300])
@pytest.mark.parametrize("tile", [16, 64, 128])
@pytest.mark.parametrize("lengths", [[0], [1], [5, 0, 17, 113, 203, 0, 1], [128] * 9,
                                     [0, 0, 300], [4097, 1, 1023, 64, 0, 17],
                                     [(37 * i) % 300 for i in range(70)]])
def test_flattened_grid_gives_every_tile_one_program(lengths, tile, first_row):
    """The kernels' program map (``program_tile``, twinned by ``reference.varlen_programs``):
    total // tile + B programs, every tile of every sequence exactly once, at most one idle
    program a sequence but the last, a sequence's tiles neighbours in launch order, and no negative
    index, also when the offsets start past row 0 (rows before the first sequence)."""
    cu = [first_row]
    for n in lengths:
        cu.append(cu[-1] + n)
    programs = reference.varlen_programs(cu, tile)
    assert len(programs) == _launch.varlen_grid(cu[-1], tile, 4, len(lengths))[0]
    tiles = [(b, i) for b, i in programs if i < reference.cdiv(lengths[b], tile)]
    assert sorted(tiles) == [(b, i) for b, n in enumerate(lengths)
                             for i in range(reference.cdiv(n, tile))]
    assert tiles == sorted(tiles)  # in order: a sequence's tiles back to back
    idle = [b for b, i in programs if i >= reference.cdiv(lengths[b], tile)]
    # The last sequence also takes the grid's surplus (the rows before the first offset, the
    # rounding of total // tile), so only the others are held to one.
    assert all(idle.count(b) <= 1 for b in range(len(lengths) - 1))
    assert all(i >= 0 for _, i in programs)


def test_varlen_grids_come_from_the_shapes(monkeypatch):
    """The forward's and the backward's grids under VARLEN: the flattened form, built from the
    packed lengths and the sequence count alone (no cu_seqlens read, max_seqlen unused)."""
    launches = []
    monkeypatch.setattr(_launch.ct, "launch", lambda stream, grid, kernel, args: launches.append(
        grid))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: contextlib.nullcontext())
    q = torch.empty(1, 4, 300, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 500, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(6, device="meta", dtype=torch.int32)
    packing = _launch.Varlen(cu, cu)
    config = variants.default_config((9, 0), 64)
    _launch.launch_forward(q, k, k, torch.empty_like(q), None, None, None, 0.1, 0.0, 0,
                           (-1, 0), config, varlen=packing)
    assert launches == [(300 // config.tile_m + 5, 4, 1)]
    launches.clear()
    lse = torch.empty(1, 4, 300, device="meta")
    _launch.launch_backward(q, q, k, k, q, lse, q, k, k, None, None, None, 0.1, 0.0, 0,
                            (-1, 0), config, varlen=packing)
    dq_tile = config.dq_kernel().tile_m
    assert launches[0] == (300 // dq_tile + 5, 4, 1)
    assert launches[1] == (500 // config.tile_n + 5, 2, 1)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (9, 3)])
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)])
def test_backward_twin_equals_autograd_per_sequence(window, tiles):
    q, cu_q = _packed(LENGTHS_Q, 4, 16, 3)
    k, cu_k = _packed(LENGTHS_K, 2, 16, 4)
    v, _ = _packed(LENGTHS_K, 2, 8, 5)
    dout, _ = _packed(LENGTHS_Q, 4, 8, 6)
    slopes = torch.rand(len(LENGTHS_Q), 4, dtype=torch.float64)
    args = (None, window, 3.0, slopes, *tiles)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, *args)
    dq, dk, dv = reference.varlen_tiles_backward(q, k, v, out, lse, dout, cu_q, cu_k, *args)
    seen = torch.zeros(k.shape[0], dtype=torch.bool)
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        leaves = [t.clone().requires_grad_() for t in seq]
        ref = reference.attention_dense(*leaves, diag_offset=diag, window=window, softcap=3.0,
                                        alibi_slopes=slopes[b:b + 1])
        ref.backward(dout[rows][None].transpose(1, 2))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        seen[keys] = True
        for got, leaf in zip((dq[rows], dk[keys], dv[keys]), leaves):
            assert torch.allclose(got, leaf.grad[0].transpose(0, 1), atol=1e-11)
    # Keys of sequences without a query get zero gradients.
    assert torch.equal(dk[~seen], torch.zeros_like(dk[~seen]))


def test_dropout_twin_keys_each_sequence_by_its_own_index():
    """Dropout under VARLEN: sequence b draws the bits of batch index b of a dense call with
    its own rows and columns, in the forward and the backward twins alike."""
    q, cu_q = _packed(LENGTHS_Q, 2, 16, 7)
    k, cu_k = _packed(LENGTHS_K, 2, 16, 8)
    v, _ = _packed(LENGTHS_K, 2, 16, 9)
    dout, _ = _packed(LENGTHS_Q, 2, 16, 10)
    drop = dict(dropout_p=0.3, dropout_seed=1234)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, tile_m=16, tile_n=16, **drop)
    dq, dk, dv = reference.varlen_tiles_backward(q, k, v, out, lse, dout, cu_q, cu_k,
                                                 tile_m=16, tile_n=16, **drop)
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        if seq[1].shape[2] == 0:
            continue
        leaves = [t.clone().requires_grad_() for t in seq]
        ref = reference.attention_dense(*leaves, diag_offset=diag, dropout_batch=b, **drop)
        ref.backward(dout[rows][None].transpose(1, 2))
        assert torch.allclose(out[rows], ref[0].detach().transpose(0, 1), atol=1e-12)
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        for got, leaf in zip((dq[rows], dk[keys], dv[keys]), leaves):
            assert torch.allclose(got, leaf.grad[0].transpose(0, 1), atol=1e-11)
        other = reference.attention_dense(*seq, diag_offset=diag, dropout_batch=b + 1, **drop)
        assert not torch.allclose(out[rows], other[0].transpose(0, 1))


def test_seqused_k_equals_a_packing_of_the_used_keys():
    """seqused_k keeps each sequence's first keys: the twins give what they give on k and v
    re-packed to those keys alone, forward and backward, and zero gradients past them."""
    q, cu_q = _packed(LENGTHS_Q, 4, 16, 11)
    k, cu_k = _packed(LENGTHS_K, 2, 16, 12)
    v, _ = _packed(LENGTHS_K, 2, 16, 13)
    dout, _ = _packed(LENGTHS_Q, 4, 16, 14)
    used = torch.tensor([2, 0, 33, 113, 7, 0], dtype=torch.int32)
    keep = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(cu_k, used)])
    cu_used = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
    args = (None, (-1, 0), 0.0, None, 16, 16)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, *args, seqused_k=used)
    want, want_lse = reference.varlen_tiles(q, k[keep], v[keep], cu_q, cu_used, *args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dq, dk, dv = reference.varlen_tiles_backward(q, k, v, out, lse, dout, cu_q, cu_k, *args,
                                                 seqused_k=used)
    grads = reference.varlen_tiles_backward(q, k[keep], v[keep], want, want_lse, dout, cu_q,
                                            cu_used, *args)
    assert torch.equal(dq, grads[0])
    assert torch.equal(dk[keep], grads[1]) and torch.equal(dv[keep], grads[2])
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[keep] = False
    assert unused.any() and torch.equal(dk[unused], torch.zeros_like(dk[unused]))


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_varlen_switch_compiles_with_tensor_cores(arch):
    """The VARLEN forward for every architecture: tensor cores, no spills, and on the TMA
    architectures the tile loads still through TMA (its row-granular views keep them)."""
    listing = aot.disassemble(aot.compile_forward(arch, dtype="bfloat16", head_dim=128,
                                                  causal=True, varlen=True))
    assert_tensor_core_path(arch, listing, "varlen", forward=True)
    sass = aot.summarize(listing)
    assert sass["local_memory"] == 0, sass
    assert (sass["tma_load"] > 0) == (arch in aot.TMA_ARCHS), sass


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_varlen_backward_compiles_with_tensor_cores(arch):
    """The backward's VARLEN switch (dQ and dK/dV kernels) for every architecture: tensor
    cores and no spills (GQA, causal: the loops of the group and of the band both run)."""
    for name, cubin in aot.compile_backward(arch, dtype="bfloat16", head_dim=128, causal=True,
                                            group=4, varlen=True).items():
        listing = aot.disassemble(cubin)
        assert_tensor_core_path(arch, listing, name)
        assert aot.summarize(listing)["local_memory"] == 0, name
