"""Call plans (``flash_tile._plans``) on a GPU: the second inference call of a signature runs
the plan the first one left, on its own fresh inputs, and matches the fp32 reference
(``reference.check_error``'s rule); calls a plan must not serve take the full path.

Each test starts from no plans, and proves that a call used its plan by making the full
path's first step fail once the plan exists.
"""

import math

import pytest
import torch

import flash_tile
from flash_tile import _validate, autotune, reference, reference_decode
from flash_tile.reference import attention_dense, check_error

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_plans(monkeypatch):
    monkeypatch.setattr(autotune, "plans", {})
    monkeypatch.setattr(autotune, "sighted", set())


def _full_path_fails(monkeypatch):
    """From now on the full path's checks fail: a call that succeeds ran a plan."""
    def fail(*args, **kwargs):
        pytest.fail("the full path ran where a plan should have")
    monkeypatch.setattr(_validate, "check_dropout", fail)
    monkeypatch.setattr(_validate, "check_dtypes", fail)


def _check(out, q, k, v, **features):
    """out [B, H, Lq, Dv] against the fp32 reference of [B, H, L, D] q, k, v."""
    ref = attention_dense(q.float(), k.float(), v.float(), **features)
    low = attention_dense(q, k, v, **features)
    report = check_error(out, ref, low)
    assert report["ok"], report


# (batch, heads, kv_heads, Lq, Lk, head_dim)
SHAPES = [(1, 1, 1, 1, 17, 64), (2, 4, 2, 113, 203, 128), (1, 2, 2, 203, 113, 64),
          (3, 8, 1, 64, 64, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("causal,window,softcap,return_lse", [
    (False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True), (False, (32, 8), 30.0, False)])
def test_flash_attn_func_plan(shape, causal, window, softcap, return_lse, monkeypatch):
    batch, heads, kv_heads, q_len, k_len, head_dim = shape
    dims = [(q_len, heads), (k_len, kv_heads), (k_len, kv_heads)]
    for call in range(3):
        q, k, v = (torch.randn(batch, n, h, head_dim, device="cuda", dtype=torch.bfloat16)
                   for n, h in dims)
        result = flash_tile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            softcap=softcap, return_lse=return_lse)
        out, lse = result if return_lse else (result, None)
        assert out.shape == (batch, q_len, heads, head_dim) and out.is_contiguous()
        right = 0 if causal else window[1]
        features = dict(diag_offset=k_len - q_len, window=(window[0], right), softcap=softcap)
        bhld = [t.transpose(1, 2) for t in (q, k, v)]
        _check(out.transpose(1, 2), *bhld, **features)
        if return_lse:
            _, ref_lse = attention_dense(*(t.float() for t in bhld), return_lse=True,
                                         **features)
            torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
        if call == 0:
            assert len(autotune.plans) == 1
            _full_path_fails(monkeypatch)


def test_sdpa_plan(monkeypatch):
    for call in range(3):
        q, k, v = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.float16)
                   for n in (17, 203, 203))
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.shape == (2, 4, 17, 64)
        _check(out, q, k, v, window=(-1, 0))  # torch's top-left causal
        if call == 0:
            assert len(autotune.plans) == 1
            _full_path_fails(monkeypatch)


@pytest.mark.parametrize("page_size,num_splits", [(None, 0), (64, 0), (None, 1)])
def test_kvcache_plan_appends_and_attends(page_size, num_splits, monkeypatch):
    """Three decode steps of one signature, the cache growing by one appended row each: the
    second and third run the plan (its arrays by address: the append's, the decode's and,
    split or not, the outputs'), and each step sees every key appended so far. The third
    runs under another tuner setting: a decode plan holds no tuned choice, so its key leaves
    the tuner's environment out."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, capacity, heads, kv_heads, dim = 2, 256, 8, 2, 128
    seqlens = [40, 97]
    k_cache = torch.randn(batch, capacity, kv_heads, dim, generator=gen, device="cuda")
    v_cache = torch.randn(batch, capacity, kv_heads, dim, generator=gen, device="cuda")
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    table = None
    if page_size is not None:  # the same keys, paged in a shuffled order
        per_seq = capacity // page_size
        order = torch.randperm(batch * per_seq, generator=gen, device="cuda")
        table = order.view(batch, per_seq).to(torch.int32)
        pages_k = torch.empty(batch * per_seq, page_size, kv_heads, dim, device="cuda",
                              dtype=torch.bfloat16)
        pages_v = torch.empty_like(pages_k)
        pages_k[order] = k_cache.reshape(batch * per_seq, page_size, kv_heads, dim)
        pages_v[order] = v_cache.reshape(batch * per_seq, page_size, kv_heads, dim)
        dense_k, dense_v = k_cache, v_cache
        k_cache, v_cache = pages_k, pages_v
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    for step in range(3):
        q = torch.randn(batch, 1, heads, dim, generator=gen, device="cuda").bfloat16()
        k_new, v_new = (torch.randn(batch, 1, kv_heads, dim, generator=gen,
                                    device="cuda").bfloat16() for _ in range(2))
        out, lse = flash_tile.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
            causal=True, num_splits=num_splits, return_softmax_lse=True)
        if page_size is not None:  # the dense copy follows the append
            for b in range(batch):
                dense_k[b, seqlens[b]], dense_v[b, seqlens[b]] = k_new[b, 0], v_new[b, 0]
        keys, values = (k_cache, v_cache) if page_size is None else (dense_k, dense_v)
        for b in range(batch):
            n = seqlens[b] + 1
            qb, kb, vb = (t[b:b + 1, :n].transpose(1, 2) for t in (q, keys, values))
            features = dict(diag_offset=n - 1, window=(-1, 0))
            _check(out[b:b + 1].transpose(1, 2), qb, kb, vb, **features)
            _, ref_lse = attention_dense(qb.float(), kb.float(), vb.float(), return_lse=True,
                                         **features)
            torch.testing.assert_close(lse[b:b + 1], ref_lse, rtol=1e-4, atol=1e-4)
        seqlens = [n + 1 for n in seqlens]
        lens += 1
        if step == 0:
            assert len(autotune.plans) == 1
            _full_path_fails(monkeypatch)
        if step == 1:
            monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    assert len(autotune.plans) == 1


def _fp8_cache(k, v, cu_k, gen):
    """Packed k, v rounded to float8_e4m3fn with power-of-two descales (k: one factor, 0-d;
    v: one a (sequence, key/value head), [B, H_kv]), so that the dequantized rows are exact
    in bfloat16: (k8, v8, k_descale, v_descale, dequantized k, dequantized v)."""
    batch, kv_heads = len(cu_k) - 1, v.shape[1]
    k_descale = torch.tensor(2.0**-6, device="cuda")
    v_descale = 2.0 ** -torch.randint(5, 7, (batch, kv_heads), generator=gen,
                                      device="cuda").float()
    k8 = (k.float() / k_descale).to(torch.float8_e4m3fn)
    rows = v_descale[torch.repeat_interleave(torch.arange(batch, device="cuda"),
                                             cu_k.diff())][..., None]
    v8 = (v.float() / rows).to(torch.float8_e4m3fn)
    return k8, v8, k_descale, v_descale, (k8.float() * k_descale).to(k.dtype), \
        (v8.float() * rows).to(v.dtype)


@pytest.mark.parametrize("form", ["packed", "seqused_k", "paged", "paged_fa3", "paged_fp8"])
def test_varlen_plan(form, monkeypatch, request):
    """flash_attn_varlen_func's plan, packed or against pages (16-key pages, a shuffled
    table), with seqused_k (FA3's paged form without cu_seqlens_k), and against an FP8
    cache's pages (its descales fresh tensors each call): a signature's second call makes
    the plan, the later ones run it, each call with its own sequences (the same totals, other
    lengths, so a plan that read an earlier call's offsets would fail) and each sequence
    against the fp32 reference on its own keys."""
    if form == "paged_fp8":
        request.getfixturevalue("hopper_or_newer")
    gen = torch.Generator(device="cuda").manual_seed(5)
    for call in range(4):
        # The sequences' lengths rotate: the totals stay, the offsets move.
        lengths_q = ([17, 0, 113, 1] * 2)[call:call + 4]
        lengths_k = ([40, 5, 203, 1] * 2)[call:call + 4]
        counts_k = ([33, 0, 150, 1] * 2)[call:call + 4]
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda") for n in (lengths_q, lengths_k))
        used = torch.tensor(counts_k, dtype=torch.int32, device="cuda")
        fa3 = form in ("seqused_k", "paged_fa3")
        q = torch.randn(int(cu_q[-1]), 4, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(int(cu_k[-1]), 2, 64, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        kw = dict(causal=True, seqused_k=used if fa3 else None)
        if form == "paged_fp8":  # the reference reads the dequantized keys and values
            k8, v8, kw["k_descale"], kw["v_descale"], k, v = _fp8_cache(k, v, cu_k, gen)
            *pages, table = reference_decode.paged_layout(k8.float(), v8.float(), cu_k, 16,
                                                          fill=math.nan)
            pages = [p.to(torch.float8_e4m3fn) for p in pages]
            out = flash_tile.flash_attn_varlen_func(q, *pages, cu_q, cu_k, 113, 203,
                                                    block_table=table, **kw)
        elif form.startswith("paged"):  # shuffled 16-key pages, of one shape every call
            *pages, table = reference_decode.paged_layout(k, v, cu_k, 16, fill=math.nan)
            out = flash_tile.flash_attn_varlen_func(
                q, *pages, cu_q, None if form == "paged_fa3" else cu_k, 113, 203,
                block_table=table, **kw)
        else:
            out = flash_tile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 113, 203, **kw)
        assert out.shape == q.shape
        for _, rows, seq, diag_offset in reference.varlen_sequences(q, k, v, cu_q, cu_k,
                                                                      used if fa3 else None):
            if seq[1].shape[2]:
                _check(out[rows][None].transpose(1, 2), *seq, window=(-1, 0),
                       diag_offset=diag_offset)
        assert len(autotune.plans) == (call >= 1)
        if call == 1:
            _full_path_fails(monkeypatch)


def test_no_plan_where_the_full_path_is_needed():
    """A call that records autograd, runs under autocast or passes a list for its window
    leaves no plan, and a call whose signature differs from a planned one is checked in
    full (here: k in another dtype raises)."""
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    q.requires_grad_()
    out = flash_tile.flash_attn_func(q, k, v)
    assert out.requires_grad and not autotune.plans
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flash_tile.flash_attn_func(q.detach(), k, v)
    flash_tile.flash_attn_func(q.detach(), k, v, window_size=[8, 8])
    assert not autotune.plans
    with torch.no_grad():  # nothing to record: planned
        flash_tile.flash_attn_func(q, k, v)
    assert len(autotune.plans) == 1
    with pytest.raises(ValueError, match="dtype"):
        flash_tile.flash_attn_func(q.detach(), k.half(), v)
    autotune.clear_memory_cache()
    assert not autotune.plans
