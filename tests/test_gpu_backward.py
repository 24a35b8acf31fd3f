"""The backward on a GPU, in both forms (the one pass, Hopper's default at D = 256, and the
deterministic two passes): gradients against an fp32 reference with flash-attn's 3x rule,
determinism, the custom-op contract (opcheck, torch.compile) and a small training run."""

import math

import pytest
import torch

import flash_tile
from flash_tile.reference import attention_dense, check_error

pytestmark = pytest.mark.gpu

# (batch, heads, kv_heads, Lq, Lk, head_dim, v_head_dim, causal, window, softcap, alibi)
CASES = [
    ((1, 1, 1, 1, 1, 64, 64), False, (-1, -1), 0.0, False),
    ((2, 3, 3, 17, 17, 64, 64), True, (-1, -1), 0.0, False),
    ((1, 2, 2, 113, 203, 128, 128), True, (-1, -1), 0.0, False),
    ((2, 2, 2, 203, 113, 128, 128), True, (-1, -1), 0.0, False),  # rows that see no key
    ((2, 8, 2, 256, 256, 64, 64), True, (-1, -1), 0.0, False),    # GQA 4
    ((1, 8, 1, 200, 300, 128, 128), False, (-1, -1), 0.0, False),  # MQA
    ((1, 4, 4, 300, 300, 64, 64), True, (64, -1), 0.0, False),    # sliding window
    ((1, 4, 4, 257, 257, 128, 128), True, (-1, -1), 30.0, False),  # softcap
    ((2, 4, 2, 130, 190, 64, 64), True, (-1, -1), 0.0, True),     # ALiBi, GQA
    ((1, 2, 2, 77, 99, 72, 40), False, (-1, -1), 0.0, False),     # odd head dims, Dv != D
    ((1, 2, 2, 1024, 1024, 128, 128), True, (-1, -1), 0.0, False),
    ((1, 2, 1, 150, 150, 256, 256), True, (-1, -1), 0.0, False),  # D = 256, MQA
]


def _inputs(shape, dtype):
    batch, heads, kv_heads, q_len, k_len, d, dv = shape

    def randn(*s):
        return torch.randn(*s, device="cuda", dtype=dtype).requires_grad_()

    return randn(batch, q_len, heads, d), randn(batch, k_len, kv_heads, d), \
        randn(batch, k_len, kv_heads, dv)


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_gradients(case, dtype, backward_form):
    shape, causal, window, softcap, alibi = case
    q, k, v = _inputs(shape, dtype)
    slopes = torch.rand(shape[0], shape[1], device="cuda") * 0.2 if alibi else None
    dout = torch.randn(shape[0], shape[3], shape[1], shape[6], device="cuda", dtype=dtype)
    eff_window = (window[0], 0) if causal else window
    offset = shape[4] - shape[3]

    def ours(q, k, v):
        return flash_tile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                          softcap=softcap, alibi_slopes=slopes)

    def dense(q, k, v):  # [B, L, H, D] in and out, as flash_attn_func
        out = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              offset, eff_window, softcap, slopes)
        return out.transpose(1, 2)

    got = _grads(ours, q, k, v, dout)
    ref = _grads(dense, q.float(), k.float(), v.float(), dout.float())  # fp32 leaves and grads
    low = _grads(dense, q, k, v, dout)
    for name, g, r, p, factor in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
        report = check_error(g, r, p, factor)
        assert report["ok"], f"{name}: {report}"


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7]], ids=["ragged", "gqa", "softcap"])
def test_gradients_through_lse(case, backward_form):
    """A loss on both outputs, as ring attention's merge makes: dLSE shifts Delta (in the one
    pass, in its preprocess)."""
    shape, causal, window, softcap, _ = case
    q, k, v = _inputs(shape, torch.bfloat16)
    dout = torch.randn(shape[0], shape[3], shape[1], shape[6], device="cuda",
                       dtype=torch.bfloat16)
    dlse = torch.randn(shape[0], shape[1], shape[3], device="cuda")
    offset, eff_window = shape[4] - shape[3], ((window[0], 0) if causal else window)

    def grads(fn, q, k, v):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(q, k, v)
        torch.autograd.backward((out, lse), (dout.to(out.dtype), dlse))
        return lse.detach(), q.grad, k.grad, v.grad

    def ours(q, k, v):
        return flash_tile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                          softcap=softcap, return_lse=True)

    def dense(q, k, v):
        out, lse = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   None, offset, eff_window, softcap, return_lse=True)
        return out.transpose(1, 2), lse

    got = grads(ours, q, k, v)
    ref = grads(dense, q.float(), k.float(), v.float())
    low = grads(dense, q, k, v)
    # The LSE is fp32 on both sides: held to fp32's tolerance, not to bf16 torch's error.
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-3)
    for name, g, r, p in zip(("dq", "dk", "dv"), got[1:], ref[1:], low[1:]):
        report = check_error(g, r, p, 3)
        assert report["ok"], f"{name}: {report}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_is_bitwise_and_the_default_agrees(head_dim, backward_form):
    """``deterministic=True`` (the two passes) gives the same bits five times over, whatever
    the default; the default (under ``backward_form``, the one pass, whose dQ is summed in
    another order) meets flash-attn's rule against the fp32 reference as well."""
    q, k, v = _inputs((2, 8, 2, 300, 300, head_dim, head_dim), torch.bfloat16)
    dout = torch.randn(2, 300, 8, head_dim, device="cuda", dtype=torch.bfloat16)

    def run(deterministic):
        return _grads(lambda *t: flash_tile.flash_attn_func(*t, causal=True,
                                                            deterministic=deterministic),
                      q, k, v, dout)

    first = run(True)
    for _ in range(4):
        for a, b in zip(first, run(True)):
            assert torch.equal(a, b)
    def dense(q, k, v):
        return attention_dense(*(t.transpose(1, 2) for t in (q, k, v)), None, 0,
                               (-1, 0)).transpose(1, 2)

    ref = _grads(dense, q.float(), k.float(), v.float(), dout.float())
    low = _grads(dense, q, k, v, dout)
    for got in (first, run(False)):
        for name, g, r, p, factor in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
            report = check_error(g, r, p, factor)
            assert report["ok"], f"{name}: {report}"


def test_deterministic_algorithms_switch_runs_the_two_passes(backward_form, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` keeps SDPA's backward to the two passes
    (no dQ accumulator is allocated), bitwise reproducible, where the default is the one
    pass."""
    from flash_tile import _launch

    allocated = []
    accumulator = _launch.dq_accumulator
    monkeypatch.setattr(_launch, "dq_accumulator",
                        lambda q: allocated.append(q.shape) or accumulator(q))
    q, k, v = (t.transpose(1, 2) for t in _inputs((1, 4, 4, 257, 257, 64, 64),
                                                     torch.float16))
    dout = torch.randn_like(q)

    def run(q, k, v):
        return flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.use_deterministic_algorithms(True)
    try:
        first, second = _grads(run, q, k, v, dout), _grads(run, q, k, v, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not allocated
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    _grads(run, q, k, v, dout)
    assert bool(allocated) == (backward_form == "one_pass")


def test_more_than_2_31_elements(backward_form):
    """q, out, dout and dq of [1, 1100, 16384, 128] (2.3e9 elements; K and V 1024 heads, GQA
    16) take the backward's 64-bit entry points: the last group's gradients, whose rows past
    1024 lie beyond element 2**31, against the fp32 reference."""
    q = torch.randn(1, 1100, 16384, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1100, 1024, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    got = _grads(lambda *qkv: flash_tile.flash_attn_func(*qkv, causal=True), q, k, v, dout)
    heads, group = slice(16368, 16384), slice(1023, 1024)
    got = (got[0][:, :, heads], got[1][:, :, heads], got[2][:, :, group], got[3][:, :, group])
    sub = (q[:, :, heads], k[:, :, group], v[:, :, group], dout[:, :, heads])
    del q, k, v, dout

    def dense(q, k, v):
        out = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0,
                              (-1, 0))
        return out.transpose(1, 2)

    ref = _grads(dense, *(t.float() for t in sub))
    low = _grads(dense, *sub)
    for name, g, r, p, factor in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
        report = check_error(g, r, p, factor)
        assert report["ok"], f"{name}: {report}"


def _check_against_sdpa(q, k, v, dout, **kwargs):
    """flash_tile's SDPA drop-in against torch's with the same keyword arguments, gradients
    included: the fp32 reference (an additive mask widened too) and torch's own error in the
    inputs' dtype, flash-attn's 3x rule. Returns ours (out, dq, dk, dv)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = kwargs.get("attn_mask")
    wide = dict(kwargs, attn_mask=mask.float()) if mask is not None and \
        mask.dtype != torch.bool else kwargs
    got = _grads(lambda *t: flash_tile.scaled_dot_product_attention(*t, **kwargs), q, k, v,
                 dout)
    ref = _grads(lambda *t: sdpa(*t, **wide), q.float(), k.float(), v.float(), dout.float())
    low = _grads(lambda *t: sdpa(*t, **kwargs), q, k, v, dout)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref, low):
        report = check_error(g, r, p, 3)
        assert report["ok"], f"{name}: {report}"
    return got


@pytest.mark.parametrize("k_len", [150, 160, 512])  # ragged; multiples of 16 (TMA-aligned)
@pytest.mark.parametrize("kind", ["bool", "bool-full", "additive"])
def test_sdpa_function_gradients_with_mask(kind, k_len, backward_form):
    """Bool masks broadcast over heads or full, and an additive one, at ragged and 16-aligned
    key lengths (a bool mask read through TMA was misread, see _launch.kernel_mask), under
    both backward forms."""
    q = torch.randn(2, 4, 150, 64, device="cuda", dtype=torch.float16).requires_grad_()
    k, v = (torch.randn(2, 4, k_len, 64, device="cuda", dtype=torch.float16).requires_grad_()
            for _ in range(2))
    if kind == "additive":
        mask = torch.randn(2, 4, 150, k_len, device="cuda", dtype=torch.float16)
    else:
        mask = torch.rand(2, 1 if kind == "bool" else 4, 150, k_len, device="cuda") > 0.3
    dout = torch.randn(2, 4, 150, 64, device="cuda", dtype=torch.float16)
    _check_against_sdpa(q, k, v, dout, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_gradients_with_a_per_head_mask_under_gqa(kind, backward_form):
    """A mask of its own for every query head while K and V have fewer heads (enable_gqa): the
    dK/dV programs walk a KV head's query group, each head under its own mask rows, which a
    mask broadcast over heads cannot tell apart."""
    q = torch.randn(2, 6, 77, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 113, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    if kind == "additive":
        mask = torch.randn(2, 6, 77, 113, device="cuda", dtype=torch.bfloat16)
    else:
        mask = torch.rand(2, 6, 77, 113, device="cuda") > 0.3
    dout = torch.randn(2, 6, 77, 64, device="cuda", dtype=torch.bfloat16)
    _check_against_sdpa(q, k, v, dout, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("q_len,k_len", [(113, 203), (203, 113)])
def test_sdpa_is_causal_is_top_left_in_the_backward(q_len, k_len, backward_form):
    """torch's ``is_causal`` is aligned top-left (query i sees keys j <= i), not bottom-right
    as flash_attn_func's: with Lq != Lk the backward's band must be torch's too. With Lq > Lk
    the rows past the last key see every key; with Lq < Lk the keys past the last row get
    zero dK and dV."""
    q = torch.randn(1, 4, q_len, 128, device="cuda", dtype=torch.float16).requires_grad_()
    k, v = (torch.randn(1, 4, k_len, 128, device="cuda", dtype=torch.float16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(1, 4, q_len, 128, device="cuda", dtype=torch.float16)
    got = _check_against_sdpa(q, k, v, dout, is_causal=True)
    if k_len > q_len:
        assert not got[2][:, :, q_len:].any() and not got[3][:, :, q_len:].any()


@pytest.mark.parametrize("pool", ["rows", "heads"])
def test_pooled_losses(pool, backward_form):
    """A loss of the output summed over its rows (or heads), whose gradient autograd hands
    the backward as an expand (stride 0): the backward reads a dense copy, and the gradients
    hold to the 3x rule."""
    q, k, v = _inputs((2, 4, 2, 113, 203, 64, 64), torch.bfloat16)
    dim = 1 if pool == "rows" else 2

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        fn(*leaves).sum(dim).float().square().sum().backward()
        return [t.grad for t in leaves]

    def ours(q, k, v):
        return flash_tile.flash_attn_func(q, k, v, causal=True)

    def dense(q, k, v):
        return attention_dense(*(t.transpose(1, 2) for t in (q, k, v)), diag_offset=90,
                               window=(-1, 0)).transpose(1, 2)

    got, ref, low = grads(ours, torch.bfloat16), grads(dense, torch.float32), \
        grads(dense, torch.bfloat16)
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, low):
        report = check_error(g, r, p, 3)
        assert report["ok"], f"{name}: {report}"


def test_opcheck():
    """The forward and the backward op (with sinks and a dLSE, q a [B, L, H, D] layout's
    transpose as the public functions pass it) against torch.library's checks: the fakes'
    shapes, strides and dtypes are the real ones', and the registration is sound."""
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16).requires_grad_()
               for _ in range(3))
    torch.library.opcheck(torch.ops.flash_tile.attention_forward,
                          (q, k, v, None, None, 0.125, 0.0, 0, -1, 0, True))
    q, k, v = (torch.randn(1, 100, 2, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
               for _ in range(3))
    sinks = torch.randn(2, device="cuda")
    out, lse = torch.ops.flash_tile.attention_forward(q, k, v, None, None, 0.125, 0.0, 0, -1,
                                                      0, True, 0.0, 0, sinks)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.flash_tile.attention_backward,
                          (dout, q, k, v, out, lse, dlse, None, None, 0.125, 0.0, 0, -1, 0,
                           0.0, 0, sinks))


class _Block(torch.nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(self.attention(q, k, v).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


_VOCAB = 256


def _model(attention):
    """Embedding, three _Blocks and a head, the same weights for every call (seed 0)."""
    torch.manual_seed(0)
    dim = 256
    layers = [_Block(dim, 4, attention) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Embedding(_VOCAB, dim), *layers,
                               torch.nn.Linear(dim, _VOCAB)).cuda()


def _data():
    return torch.randint(0, _VOCAB, (8, 129), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))


def _step(run, data):
    """One bf16-autocast forward and backward of next-token cross-entropy; the loss."""
    with torch.autocast("cuda", torch.bfloat16):
        logits = run(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 data[:, 1:].flatten())
    loss.backward()
    return loss.item()


def _train(attention, steps, compile_model=False):
    model, data = _model(attention), _data()
    run = torch.compile(model, fullgraph=True) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(_step(run, data))
        opt.step()
    return losses


def _flash(q, k, v):
    return flash_tile.flash_attn_func(q, k, v, causal=True)


def _sdpa(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def test_training_matches_sdpa():
    """A 3-layer causal transformer memorising random tokens: the same loss curve."""
    ours, theirs = _train(_flash, 300), _train(_sdpa, 300)
    assert ours[-1] < 0.5 * ours[0]  # it learns
    for step in (50, 150, 299):
        assert math.isclose(ours[step], theirs[step], rel_tol=0.05, abs_tol=0.05), step


def test_torch_compile_fullgraph():
    """Compiled whole (the custom ops in the graph), the model gets the eager path's
    gradients: each block's QKV projection is reached only through attention's dQ, dK and dV,
    so a wrong backward shows there. Then it trains."""
    eager, compiled, data = _model(_flash), _model(_flash), _data()
    _step(eager, data)
    _step(torch.compile(compiled, fullgraph=True), data)
    for i in (1, 2, 3):
        got, want = compiled[i].qkv.weight.grad, eager[i].qkv.weight.grad
        assert ((got - want).norm() / want.norm()).item() < 0.05, i
    losses = _train(_flash, 20, compile_model=True)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("entry", ["flash_attn_func", "scaled_dot_product_attention"])
def test_no_query_rows(entry):
    """Lq = 0 (legal in torch's SDPA and flash-attn): an empty output, no launch, and zero
    gradients for k and v (poisoned with NaN first, so a gradient left unwritten fails)."""
    q, k, v = _inputs((2, 4, 2, 0, 37, 64, 64), torch.bfloat16)
    if entry == "scaled_dot_product_attention":
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert out.shape == (2, 4, 0, 64)
    else:
        out, lse = flash_tile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert bool((k.grad == 0).all()) and bool((v.grad == 0).all())


@pytest.mark.parametrize("form", ["qkvpacked", "kvpacked"])
@pytest.mark.parametrize("batch,q_len,k_len,window,softcap", [
    (2, 1, 1, (-1, -1), 0.0), (2, 17, 17, (-1, -1), 0.0), (1, 113, 203, (32, -1), 20.0)],
    ids=["L1", "L17", "L113-203-window-softcap"])
def test_packed_forms(form, batch, q_len, k_len, window, softcap, monkeypatch):
    """The packed forms read their packs in place (the first launch gets the pack's own
    memory) and give the pack's gradient, against the fp32 reference with the 3x rule.
    qkvpacked: [B, L, 3, H, D] (Lq = Lk, so only the equal-length cases); kvpacked: q
    [B, Lq, H, D] and [B, Lk, 2, H_kv, D], GQA 2."""
    from flash_tile import _launch

    if form == "qkvpacked" and q_len != k_len:
        pytest.skip("qkvpacked takes one length")
    first = []  # the data pointers of the first launch's q, k and v (the forward's)
    launch = _launch.ct.launch
    monkeypatch.setattr(_launch.ct, "launch", lambda stream, grid, kernel, args, **a: (
        None if first else first.extend(t.data_ptr() for t in args[:3]),
        launch(stream, grid, kernel, args, **a)))
    heads, kv_heads, dim = 4, (4 if form == "qkvpacked" else 2), 64
    q = torch.randn(batch, q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    pack = torch.randn(batch, k_len, 3 if form == "qkvpacked" else 2, kv_heads, dim,
                       device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(batch, q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(causal=True, window_size=window, softcap=softcap)

    def ours(q, pack):
        if form == "qkvpacked":
            return flash_tile.flash_attn_qkvpacked_func(pack, **kwargs)
        return flash_tile.flash_attn_kvpacked_func(q, pack, **kwargs)

    def dense(q, pack):  # the pack unbound, [B, L, H, D] in and out
        parts = pack.unbind(2)
        q, k, v = parts if form == "qkvpacked" else (q, *parts)
        out = attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              k_len - q_len, (window[0], 0), softcap)
        return out.transpose(1, 2)

    def grads(fn, q, pack):
        q, pack = (t.detach().clone().requires_grad_() for t in (q, pack))
        out = fn(q, pack)
        out.backward(dout.to(out.dtype))
        grad_q = q.grad if form == "kvpacked" else torch.zeros(0)
        return out.detach(), grad_q, pack.grad, (q.data_ptr(), pack.data_ptr())

    got = grads(ours, q, pack)
    q_ptr, pack_ptr = got[3]
    slot = kv_heads * dim * pack.element_size()  # bytes from one part of a row to the next
    expected = ((pack_ptr, pack_ptr + slot, pack_ptr + 2 * slot) if form == "qkvpacked" else
                (q_ptr, pack_ptr, pack_ptr + slot))
    assert tuple(first) == expected
    ref = grads(dense, q.float(), pack.float())
    low = grads(dense, q, pack)
    for name, g, r, p, factor in zip(("out", "dq", "dpack"), got[:3], ref[:3], low[:3],
                                     (2, 3, 3)):
        if g.numel():
            report = check_error(g, r, p, factor)
            assert report["ok"], f"{form} {name}: {report}"


def test_no_keys():
    """Lk = 0: out 0 and an LSE of +inf (flash-attn's), zeros from the SDPA drop-in (torch's),
    a zero dq, all without a launch (the outputs are NaN-poisoned first)."""
    q, k, v = _inputs((2, 4, 2, 33, 0, 64, 64), torch.bfloat16)
    out, lse = flash_tile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert bool((out == 0).all()) and bool((lse == torch.inf).all())
    out.sum().backward()
    assert bool((q.grad == 0).all())
    sdpa = flash_tile.scaled_dot_product_attention(*(t.detach().transpose(1, 2)
                                                     for t in (q, k, v)), enable_gqa=True)
    assert sdpa.shape == (2, 4, 33, 64) and bool((sdpa == 0).all())
