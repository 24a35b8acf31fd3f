"""flash_attn_varlen_func with a block_table, on the CPU: the oracle that re-packs a paged
call's keys, the entry point's checks, its wiring to the forward's PAGED switch (pages passed
as they are, the table and the key counts), how each page size is read, and ahead-of-time
compiles of the switch for every architecture."""

import dataclasses

import pytest
import torch

from flash_tile import _launch, _ops, _ops_paged, _validate, aot, reference_decode, variants, varlen
from sass_checks import assert_tensor_core_path

LENGTHS_K = [3, 0, 40, 17]


def _paged(page_size=16, heads=4, kv_heads=2, dim=64, dtype=torch.bfloat16, seed=0):
    """(q [20, H, D], k and v pages, block table, cu_seqlens_q, cu_seqlens_k, the packed k
    and v the pages hold): sequence b's keys written to shuffled pages
    (``reference_decode.paged_layout``, NaN in the slots no key fills)."""
    gen = torch.Generator().manual_seed(seed)
    cu_k = torch.tensor([0, *torch.tensor(LENGTHS_K).cumsum(0).tolist()], dtype=torch.int32)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, dim, generator=gen).to(dtype)
            for _ in range(2))
    pages = reference_decode.paged_layout(k, v, cu_k, page_size, gen, fill=float("nan"),
                                          spare_pages=2)
    q = torch.randn(20, heads, dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0, 5, 5, 19, 20], dtype=torch.int32)
    return q, *pages, cu_q, cu_k, k, v


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_repacked_pages_are_the_sequences_keys(page_size):
    """The GPU tests' oracle: pages read back through the table are the packed keys, and
    key counts below the sequences' lengths keep each one's first keys."""
    _, k_pages, v_pages, table, _, cu_k, k, v = _paged(page_size)
    got_k, got_v, got_cu = reference_decode.packed_pages(k_pages, v_pages, table, cu_k.diff())
    assert torch.equal(got_k, k) and torch.equal(got_v, v) and torch.equal(got_cu, cu_k)
    firsts = torch.tensor([2, 0, 31, 1], dtype=torch.int32)
    got_k, _, got_cu = reference_decode.packed_pages(k_pages, v_pages, table, firsts)
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_k[:-1].tolist(),
                                                              firsts.tolist())])
    assert torch.equal(got_k, k[keep]) and got_cu.tolist() == [0, 2, 2, 33, 34]


def _call(monkeypatch, **change):
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    q, k_pages, v_pages, table, cu_q, cu_k, _, _ = _paged()
    args = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=14, max_seqlen_k=40, block_table=table)
    args.update(change)
    return varlen.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("change,error,match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p > 0 with block_table"),
    (dict(return_attn_probs=True, dropout_p=0.1), NotImplementedError, "S_dmask"),
    (dict(k_descale=torch.ones(1)), ValueError, "float8_e4m3fn caches only"),
    (dict(q_descale=torch.ones(1)), NotImplementedError, "float8_e4m3fn q"),
    (dict(q=torch.randn(20, 4, 64).to(torch.float8_e4m3fn)), NotImplementedError,
     "float8_e4m3fn q"),
    (dict(k=torch.randn(8, 16, 2, 64).to(torch.float8_e4m3fn)), ValueError, "same dtype"),
    (dict(k=torch.randn(8, 16, 2, 64).to(torch.float8_e4m3fn),
          v=torch.randn(8, 16, 2, 64).to(torch.float8_e4m3fn), k_descale=torch.ones(4, 3)),
     ValueError, r"k_descale must have shape \[4, 2\]"),
    (dict(block_table=torch.zeros(4, 3, dtype=torch.int64)), ValueError,
     "block_table must be an int32"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError,
     r"block_table must have shape \[4, 3\]"),
    (dict(block_table=torch.zeros(4, dtype=torch.int32)), ValueError, "max_blocks"),
    (dict(block_table=torch.zeros(4, 0, dtype=torch.int32)), ValueError, "no columns"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k .* or seqused_k"),
    (dict(k=torch.randn(40, 2, 64).bfloat16()), ValueError, "pages"),
    (dict(v=torch.randn(7, 16, 2, 64).bfloat16()), ValueError, "must agree"),
    (dict(v=torch.randn(8, 16, 2, 128).bfloat16()[..., ::2]), ValueError,
     "unit last stride"),
    (dict(q=torch.randn(20, 4, 64).half()), ValueError, "same dtype"),
    (dict(q=torch.randn(20, 3, 64).bfloat16()), ValueError, "heads"),
    (dict(seqused_k=torch.zeros(4, dtype=torch.int64)), ValueError, "seqused_k must be"),
    (dict(max_seqlen_k=2.5), ValueError, "max_seqlen_k"),
])
def test_bad_paged_arguments_raise_before_launch(monkeypatch, change, error, match):
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(error, match=match):
        _call(monkeypatch, **change)


def test_a_gradient_raises_before_launch(monkeypatch):
    """No backward through pages (flash-attn's paged varlen has none): asked for by q, k or
    v, or by the sinks, it raises rather than returning an output without one."""
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: pytest.fail("launched"))
    q, k_pages, v_pages, *_ = _paged()
    for change in (dict(q=q.requires_grad_()), dict(k=k_pages.requires_grad_()),
                   dict(v=v_pages.requires_grad_()),
                   dict(sinks=torch.zeros(4, requires_grad=True))):
        with pytest.raises(NotImplementedError, match="no backward"):
            _call(monkeypatch, **change)


@pytest.mark.parametrize("form", ["cu_seqlens_k", "seqused_k"])
def test_the_call_reaches_the_launch_with_pages_as_they_are(monkeypatch, form):
    """q and the output as packed views, the pages themselves (no copy, no view), the table
    and the key counts in the launch's Varlen, the architecture's paged tile; FA3's form
    (seqused_k, no cu_seqlens_k) passes no cumulative key lengths."""
    calls = []
    monkeypatch.setattr(_ops_paged, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    q, k_pages, v_pages, table, cu_q, cu_k, _, _ = _paged(dim=80)
    used = cu_k.diff() if form == "seqused_k" else None
    out, lse = _call(monkeypatch, q=q, k=k_pages, v=v_pages, block_table=table,
                     cu_seqlens_q=cu_q, cu_seqlens_k=None if used is not None else cu_k,
                     seqused_k=used, causal=True, softcap=3.0, return_lse=True)
    (qv, kv, vv, outv, lsev, slopes, mask, scale, softcap, _, window, config, dropout, varlen,
     sinks, descales), _ = calls[0]
    assert qv.shape == (1, 4, 20, 80) and outv.data_ptr() == out.data_ptr()
    assert kv is k_pages and vv is v_pages and lsev.shape == (1, 4, 20)
    assert (slopes, mask, softcap, window) == (None, None, 3.0, (-1, 0))
    assert scale == pytest.approx(80 ** -0.5)
    assert config == variants.paged_config((9, 0), 80)
    assert dropout == _launch.NO_DROPOUT and sinks is None and descales is None
    assert varlen == _launch.Varlen(cu_q, None if used is not None else cu_k, used, table)
    assert out.shape == (20, 4, 80) and lse.shape == (4, 20)


def test_an_fp8_cache_reaches_the_launch_with_its_descale_factors(monkeypatch):
    """float8_e4m3fn pages with bfloat16 q: the pages as they are, a bfloat16 output, and the
    launch's (q, k, v) descales: none for q, k_descale (per sequence and key/value head) as
    given, v_descale (None) a stride-0 view of 1; before Hopper a RuntimeError, before any
    launch."""
    calls = []
    monkeypatch.setattr(_ops_paged, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    q, k_pages, v_pages, table, cu_q, cu_k, _, _ = _paged()
    k8, v8 = (t.to(torch.float8_e4m3fn) for t in (k_pages, v_pages))
    k_descale = torch.rand(4, 2) + 0.5
    out = _call(monkeypatch, q=q, k=k8, v=v8, k_descale=k_descale)
    (qv, kv, vv, *_, (q_factors, k_factors, v_factors)), _ = calls[0]
    assert kv is k8 and vv is v8 and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert q_factors is None and k_factors is k_descale
    assert v_factors.stride() == (0, 0) and torch.equal(v_factors, torch.ones(4, 2))
    # The op itself, given one factor of the two (the kernel reads both): the other is 1.
    _ops_paged._paged_varlen_impl(q, k8, v8, table, cu_q, cu_k, None, None, 0.1, 0.0, -1, 0,
                                  False, None, None, torch.tensor(0.25))
    (*_, (_, k_factors, v_factors)), _ = calls[-1]
    assert torch.equal(k_factors, torch.ones(4, 2)) and torch.equal(v_factors, 0.25 * k_factors)
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((8, 9), "L40S"))
    with pytest.raises(RuntimeError, match="needs 9.0"):
        _call(monkeypatch, q=q, k=k8, v=v8, k_descale=k_descale)
    assert len(calls) == 2


@pytest.mark.parametrize("page_size,tile_n,page_n", [
    (16, 128, 16), (48, 128, 16), (64, 64, 64), (256, 128, 128), (512, 64, 64),
    (1, 128, 0), (8, 64, 0), (24, 128, 0), (33, 64, 0)])
def test_page_loads_by_page_size(page_size, tile_n, page_n):
    """Tile loads of the largest power of two that divides the page size, at most the key
    tile, down to MIN_PAGE_LOAD keys; below it (page_n 0) the rows are gathered. A config's
    page_ahead holds for joined loads alone, and never without pages."""
    plain = _launch.ForwardSpec(64, tile_n, 64, 64, False, True, True, False, False, 0, True,
                                False, 2, 2, page_ahead=True)
    packing = _launch.Varlen(torch.zeros(3), torch.zeros(3),
                             block_table=torch.zeros(2, 1, dtype=torch.int32))
    spec = packing.spec(plain, page_size)
    assert (spec.paged, spec.page_n, spec.gather) == (True, page_n, page_n == 0)
    assert spec.varlen and not spec.even_n and spec.page_ahead == (page_n > 0)
    unpaged = _launch.Varlen(torch.zeros(3), torch.zeros(3)).spec(plain, page_size)
    assert unpaged.paged is False and unpaged.page_ahead is False


def test_paged_tiles_narrow_only_where_the_default_spilled():
    """``variants.paged_config``: the default tile but on sm_100 at D = 256 and sm_120 at
    D <= 128 (64x32 there); sm_90's at D = 128 reads its block-table entries a step ahead."""
    for capability, dim in (((8, 0), 128), ((9, 0), 64), ((9, 0), 256), ((10, 0), 128),
                            ((12, 0), 256)):
        assert variants.paged_config(capability, dim) == \
            variants.default_config(capability, dim)
    assert variants.paged_config((9, 0), 128) == dataclasses.replace(
        variants.default_config((9, 0), 128), page_ahead=True)
    for capability, dim in (((10, 0), 256), ((12, 0), 64), ((12, 0), 128)):
        assert variants.paged_config(capability, dim) == variants.PAGED_NARROW


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_paged_switch_compiles_with_tensor_cores(arch):
    """The PAGED forward for every architecture on its paged tile (``variants.paged_config``)
    on 16-key pages (a key tile joined from tile loads of 16 keys): tensor cores, no spills
    but sm_90's 14,
    the page loads through TMA where there is TMA; gathered rows (1-key pages) on the sm_80
    and sm_90 families (sm_90's through the 64-bit entry point, as pages of a cache of 2**31
    elements or more take), and D = 256 on sm_100 and sm_120, FA3's form (seqused_k, no
    cu_seqlens_k): tensor cores, no spills."""
    listing = aot.disassemble(aot.compile_forward(arch, dtype="bfloat16", head_dim=128,
                                                  causal=True, varlen=True, page_size=16))
    assert_tensor_core_path(arch, listing, "paged", forward=True)
    sass = aot.summarize(listing)
    # sm_90's tile reads its block-table entries a step ahead (``page_ahead``): eight a step
    # on 16-key pages, which spill 14 LDL/STL and still ran the call in 0.56x the time.
    assert sass["local_memory"] == (14 if arch == "sm_90" else 0), sass
    assert (sass["tma_load"] > 0) == (arch in aot.TMA_ARCHS), sass
    # (head dim, page size, 64-bit indexing: the pages of a large cache)
    more = {"sm_80": (128, 1, False), "sm_90": (128, 1, True), "sm_100": (256, 16, False),
            "sm_120": (256, 16, False)}
    if arch in more:
        dim, page_size, int64_index = more[arch]
        listing = aot.disassemble(aot.compile_forward(
            arch, dtype="bfloat16", head_dim=dim, causal=True, varlen=True, seqused_k=True,
            page_size=page_size, int64_index=int64_index))
        assert_tensor_core_path(arch, listing, (dim, page_size), forward=True)
        assert aot.summarize(listing)["local_memory"] == 0


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
def test_fp8_cache_compiles_on_the_inputs_tensor_cores(arch):
    """An FP8 cache's e4m3 pages with bfloat16 q (Hopper and newer, where tileiras takes
    e4m3 arrays): both matmuls on the architecture's bfloat16 tensor-core op (the tiles are
    widened after their load; no e4m3 matmul), page loads through TMA, no spills, on 16-key
    pages at D = 128."""
    listing = aot.disassemble(aot.compile_forward(arch, dtype="bfloat16", head_dim=128,
                                                  causal=True, varlen=True, page_size=16,
                                                  kv_dtype="float8_e4m3fn"))
    assert_tensor_core_path(arch, listing, "fp8 cache", forward=True)
    sass = aot.summarize(listing)
    assert sass["local_memory"] == 0 and sass["tma_load"] > 0, sass


@pytest.mark.parametrize("kv_dtype,page_size", [("bfloat16", 16), ("float16", 16),
                                                ("float8_e4m3fn", None)])
def test_aot_kv_dtype_is_an_fp8_cache_of_pages(kv_dtype, page_size):
    """``kv_dtype`` names an FP8 cache's pages alone: another dtype (a lossy widening the
    launcher never makes) or no pages raise."""
    with pytest.raises(ValueError, match="kv_dtype"):
        aot.forward_signature("bfloat16", 64, 64, (-1, 0), False, False, None, False, True,
                              variants.paged_config((9, 0), 64), varlen=True,
                              page_size=page_size, kv_dtype=kv_dtype)
