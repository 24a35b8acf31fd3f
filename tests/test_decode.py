"""The decode path on the CPU: the float64 twin of its split and combine against plain
attention, the split and tile choices, the launches a call makes, and ahead-of-time compiles
of its kernels for every architecture (the input checks: ``test_decode_checks.py``)."""

import math
from dataclasses import replace

import pytest
import torch

import flash_tile
from flash_tile import (_launch, _launch_decode, _validate, aot, decode_variants, reference,
                        reference_decode, variants)


def _contiguous(batch, capacity, kv_heads, head_dim, v_head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, capacity, kv_heads, head_dim, generator=gen, dtype=torch.float64),
            torch.randn(batch, capacity, kv_heads, v_head_dim, generator=gen,
                        dtype=torch.float64))


def _q(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _dense(q, seqs, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Plain attention per sequence, bottom-right aligned: the twin's oracle."""
    outs, lses = [], []
    for b, (k, v) in enumerate(seqs):
        qb = q[b:b + 1].transpose(1, 2).double()
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1].double()
        o, lse = reference.attention_dense(qb, k, v, diag_offset=k.shape[2] - q.shape[1],
                                           window=window, softcap=softcap,
                                           alibi_slopes=slopes, return_lse=True)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("tile_lq,tile_n", [(1, 16), (4, 32), (16, 128)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (20, 0), (9, 4)])
def test_split_and_combine_equal_plain_attention(num_splits, tile_lq, tile_n, window):
    batch, q_len, heads, kv_heads, d, dv = 3, 7, 6, 2, 16, 8
    k_cache, v_cache = _contiguous(batch, 203, kv_heads, d, dv)
    seqlens = torch.tensor([0, 1, 203], dtype=torch.int32)  # 0: every row sees nothing
    seqs = reference_decode.cache_sequences(k_cache, v_cache, seqlens)
    q = torch.randn(batch, q_len, heads, d, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    slopes = torch.rand(batch, heads, dtype=torch.float64)
    out, lse = reference_decode.decode_tiles_reference(q, seqs, None, window, 5.0, slopes,
                                                       tile_lq, tile_n, num_splits)
    ref_out, ref_lse = _dense(q[1:], seqs[1:], window, 5.0, slopes[1:])
    assert torch.allclose(out[1:], ref_out, rtol=1e-10, atol=1e-12)
    assert torch.equal(lse[1:].isinf(), ref_lse.isinf())
    finite = ~ref_lse.isinf()
    assert torch.allclose(lse[1:][finite], ref_lse[finite], rtol=1e-10, atol=1e-12)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == math.inf).all())


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_split_and_combine_count_the_sink_once(num_splits):
    """Sinks join split 0 (empty or not) and the combine counts them once: plain attention
    with a sink column, rows that see no key get 0 and the sink as their LSE."""
    batch, q_len, heads, kv_heads, d = 3, 5, 6, 2, 16
    k_cache, v_cache = _contiguous(batch, 150, kv_heads, d, d, seed=4)
    seqlens = torch.tensor([0, 1, 150], dtype=torch.int32)
    seqs = reference_decode.cache_sequences(k_cache, v_cache, seqlens)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch, q_len, heads, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    out, lse = reference_decode.decode_tiles_reference(q, seqs, None, (-1, 0), tile_lq=2,
                                                       tile_n=16, num_splits=num_splits,
                                                       sinks=sinks)
    for b, (k, v) in enumerate(seqs[1:], start=1):
        ref, ref_lse = reference.attention_dense(q[b:b + 1].transpose(1, 2), k, v,
                                                 diag_offset=k.shape[2] - q_len,
                                                 window=(-1, 0), return_lse=True, sinks=sinks)
        assert torch.allclose(out[b:b + 1], ref.transpose(1, 2), rtol=1e-10, atol=1e-12)
        assert torch.allclose(lse[b:b + 1], ref_lse, rtol=1e-10, atol=1e-12)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.allclose(lse[0], sinks[:, None].expand(heads, q_len), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("tile_lq,tile_n", [(1, 16), (4, 32)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (20, 3)])
@pytest.mark.parametrize("extras", [False, True])
def test_split_and_combine_hide_the_masked_keys(num_splits, tile_lq, tile_n, window, extras):
    """ATTN_MASK: a [B, 1, Lq, L] mask over cache positions, cut to each sequence's keys (a
    left pad included), hides keys in every split as plain attention with that mask does,
    alone or with softcap, ALiBi and sinks (``extras``); a row whose keys are all hidden gets
    0 and +inf (the sink's LSE with sinks)."""
    batch, q_len, heads, kv_heads, d = 3, 5, 6, 2, 16
    k_cache, v_cache = _contiguous(batch, 113, kv_heads, d, d, seed=7)
    seqlens = torch.tensor([1, 60, 113], dtype=torch.int32)
    leftpad = torch.tensor([0, 9, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(8)
    mask = torch.rand(batch, 1, q_len, 113, generator=gen) > 0.4
    mask[2, 0, 3] = False  # a row that sees nothing
    seqs = reference_decode.cache_sequences(k_cache, v_cache, seqlens, leftpad=leftpad)
    masks = reference_decode.cache_masks(mask, seqlens, leftpad)
    q = torch.randn(batch, q_len, heads, d, generator=gen, dtype=torch.float64)
    softcap, slopes, sinks = 0.0, None, None
    if extras:
        softcap = 5.0
        slopes = torch.rand(batch, heads, generator=gen, dtype=torch.float64)
        sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    # The twin in cache rows, as the kernel (the pad hidden, its whole tiles skipped); the
    # reference on the keys past the pad.
    out, lse = reference_decode.decode_tiles_reference(
        q, reference_decode.cache_sequences(k_cache, v_cache, seqlens), None, window, softcap,
        slopes, tile_lq, tile_n, num_splits, sinks,
        reference_decode.cache_masks(mask, seqlens), leftpad)
    for b, (k, v) in enumerate(seqs):
        ref, ref_lse = reference.attention_dense(
            q[b:b + 1].transpose(1, 2), k, v, diag_offset=k.shape[2] - q_len, window=window,
            softcap=softcap, alibi_slopes=None if slopes is None else slopes[b:b + 1],
            attn_mask=masks[b], return_lse=True, sinks=sinks)
        assert torch.allclose(out[b:b + 1], ref.transpose(1, 2), rtol=1e-10,
                              atol=1e-12), b
        assert torch.equal(lse[b:b + 1].isinf(), ref_lse.isinf()), b
        finite = ~ref_lse.isinf()
        assert torch.allclose(lse[b:b + 1][finite], ref_lse[finite], rtol=1e-10,
                              atol=1e-12), b
    assert torch.equal(out[2, 3], torch.zeros_like(out[2, 3]))
    hidden = lse[2, :, 3]
    assert (torch.allclose(hidden, sinks, rtol=1e-10, atol=1e-12) if extras else
            bool((hidden == math.inf).all()))


def test_paged_and_contiguous_caches_hold_the_same_sequences():
    batch, capacity, page = 3, 96, 16
    k_cache, v_cache = _contiguous(batch, capacity, 2, 8, 8)
    per_seq = capacity // page
    table = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(2))
    table = table.view(batch, per_seq).to(torch.int32)
    k_pages = torch.empty(batch * per_seq, page, 2, 8, dtype=torch.float64)
    v_pages = torch.empty_like(k_pages)
    for b in range(batch):
        for p in range(per_seq):
            k_pages[table[b, p]] = k_cache[b, p * page:(p + 1) * page]
            v_pages[table[b, p]] = v_cache[b, p * page:(p + 1) * page]
    lens = torch.tensor([5, 96, 33], dtype=torch.int32)
    paged = reference_decode.cache_sequences(k_pages, v_pages, lens, None, table)
    for (k1, v1), (k2, v2) in zip(reference_decode.cache_sequences(k_cache, v_cache, lens),
                                  paged):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    picked = reference_decode.cache_sequences(k_cache, v_cache, lens[:2], idx)
    assert torch.equal(picked[0][0][0], k_cache[2, :5].transpose(0, 1))


def test_tiles_pack_the_group_and_fit_the_pages():
    config = decode_variants.DECODE_DEFAULT
    tiles = _launch_decode.decode_tiles
    assert tiles(1, 8, None, config) == (2, 8, 128, 128, False)  # 16 packed rows at least
    assert tiles(1, 1, None, config) == (16, 1, 128, 128, False)
    assert tiles(64, 4, None, config) == (4, 4, 128, 128, False)  # config.rows rows
    # pages: 64-key steps of 1, 2 or 4 page loads; pages without a 16-key load gathered
    assert tiles(3, 6, 256, config) == (2, 8, 64, 64, False)
    assert tiles(1, 8, 64, config)[2:] == (64, 64, False)
    assert tiles(1, 8, 32, config)[2:] == (64, 32, False)
    assert tiles(1, 8, 16, config)[2:] == (64, 16, False)
    assert tiles(1, 8, 48, config)[2:] == (64, 16, False)  # 48 = 3 * 16
    for page_size in (1, 8, 100):
        assert tiles(1, 8, page_size, config)[2:] == (64, 64, True)
    narrow = replace(config, paged_tile_n=128)  # 16-key loads would take 8 a step
    assert tiles(1, 8, 16, narrow)[2:] == (64, 64, True)
    assert tiles(1, 8, 32, narrow)[2:] == (128, 32, False)
    # the 64-bit kernel: 128-key steps where the pages hold them
    assert tiles(1, 8, 256, config, True)[2:] == (128, 128, False)
    assert tiles(1, 8, 64, config, True)[2:] == (64, 64, False)


def test_splits_fill_the_gpu_and_respect_the_caps():
    config = decode_variants.DECODE_DEFAULT

    def splits(num_splits, batch, kv_heads, key_tiles):  # 132 SMs, 2**20-element partials
        return _launch_decode.decode_splits(num_splits, batch, kv_heads, 1, key_tiles, 132,
                                            config, 2**20)

    # B = 1, 8 KV heads, a 128k cache: 33 splits make 264 programs for 132 SMs at 2 a SM;
    # rounded down to a power of two (one compile per power, as a cache grows).
    assert splits(0, 1, 8, 1024) == 32
    assert splits(0, 128, 8, 1024) == 1  # full already
    assert splits(0, 32, 8, 1024) == 1  # 256 of 264: no split
    assert splits(0, 8, 8, 1024) == 4  # 256 programs in 4
    # One key tile a split at least.
    assert splits(0, 1, 1, 6) == 4
    assert splits(0, 1, 1, 10**6) == config.max_splits
    assert splits(5, 1, 8, 1024) == 5  # the caller's count
    assert splits(5, 1, 8, 2) == 2  # never more than tiles
    assert splits(1000, 1, 8, 10**6) == config.max_splits


def test_split_partials_and_outputs_stay_below_2_31_elements():
    """The split partials [S, B, Lq, H, Dv] fp32 index in 32 bits: a plan takes no more
    splits than keep them below 2**31 elements (8 x 2048 x 32 x 128 = 2**26 a split: 31 of
    the 64 asked); an output of 2**31 elements (Dv > D) raises before any launch."""
    config = decode_variants.DECODE_DEFAULT
    switches = (False, True, False, False, False, True, False, False, False)

    def splits(q_len, num_splits):
        return _launch_decode._decode_plan((8, q_len, 32, 128), (8, 2**16, 8, 128), 128, None,
                                           num_splits, switches, False, config, 132).splits

    assert splits(2048, 64) == 31 and splits(2**16, 4) == 1 and splits(16, 64) == 64
    # The heuristic's 32 splits (B = 1, a 128k cache) under a cap of 5: 4, a power of two.
    assert _launch_decode.decode_splits(0, 1, 8, 1, 1024, 132, config, 2**31 // 5) == 4
    q = torch.empty(1, 2**10, 2**14, 64, device="meta", dtype=torch.bfloat16)  # 2**30
    _validate.check_decode_index(q, 64)
    with pytest.raises(NotImplementedError, match="its output"):
        _validate.check_decode_index(q, 128)
    mask = torch.empty(1, 1, 2**11, 2**20, device="meta", dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="the mask"):
        _validate.check_decode_index(q[:, :1], 64, mask)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_reference_turns_each_pair_by_its_angle(interleaved):
    """``reference_decode.rotary_embedding`` against the complex form: pair (a, b) at position
    t and frequency f is a + ib times exp(i angle[t, f]); columns past rotary_dim pass
    through."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 20, generator=gen, dtype=torch.float64)
    angle = torch.rand(50, 6, generator=gen, dtype=torch.float64) * 2 * math.pi
    pos = torch.tensor([[0, 7, 49], [3, 3, 10]])
    out = reference_decode.rotary_embedding(x, angle.cos(), angle.sin(), pos, interleaved)
    rot = x[..., :12]
    pairs = (torch.stack((rot[..., 0::2], rot[..., 1::2]), -1) if interleaved else
             torch.stack((rot[..., :6], rot[..., 6:]), -1))
    turn = torch.polar(torch.ones((), dtype=torch.float64), angle[pos])[:, :, None]
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
    expect = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
    torch.testing.assert_close(out[..., :12], expect)
    assert torch.equal(out[..., 12:], x[..., 12:])


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_decode_kernels_compile_with_tensor_cores(arch):
    """Split decode, combine and append compile for every architecture; the decode's two
    matmuls run on tensor cores. At 16 packed rows tileiras 13.4 picks the warp-level HMMA on
    every architecture (sm_90's wgmma and sm_100's tcgen05 take 64 rows and more). Paged
    steps load pages as tiles (through TMA where there is one: one load a step for 256-key
    pages, four for 16-key ones), and 8-key pages are gathered by row with cp.async
    (LDGSTS), 16 bytes a thread. No spills, but for 4 LDL/STL on sm_100 joining 16-key pages
    at D = 128 (with softcap; without it sm_90 spills 22: docs/experiments/evidence/
    2026-12-04-decode-pages-h200.md)."""
    tiled = aot.compile_decode(arch, page_size=256, splits=4, softcap=True)
    assert set(tiled) == {"decode", "combine", "append"}
    tma_loads = {}
    for page_size, head_dim in ((256, 128), (16, 128), (16, 256), (8, 128), (8, 256)):
        cubins = tiled if page_size == 256 else aot.compile_decode(
            arch, page_size=page_size, splits=4, softcap=True, head_dim=head_dim)
        listing = aot.disassemble(cubins["decode"])
        sass = aot.summarize(listing)
        spills = 4 if (arch, page_size, head_dim) == ("sm_100", 16, 128) else 0
        assert sass["tensor_core"] > 0 and sass["local_memory"] == spills, (page_size, sass)
        assert " HMMA." in listing
        tma_loads[page_size, head_dim] = sass["tma_load"]
        if page_size == 8:
            assert "LDGSTS.E.BYPASS.128" in listing
    if arch in aot.TMA_ARCHS:  # Q and K, V: 2 + 2 * 4 page loads at 16-key pages
        assert tma_loads[16, 128] > tma_loads[256, 128] > tma_loads[8, 128] > 0, tma_loads
    else:
        assert not any(tma_loads.values()), tma_loads
    if arch == "sm_90":  # contiguous, one split: no combine, K/V through TMA
        single = aot.compile_decode(arch, splits=1, group=4, q_len=4, head_dim=256)
        assert set(single) == {"decode", "append"}
        assert aot.summarize(aot.disassemble(single["decode"]))["tma_load"] > 0


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_fp8_cache_compiles(arch, q_dtype):
    """The decode of an FP8 cache widens its tiles with the e4m3 unpack (F2FP ... E4M3) and
    keeps its tensor cores, without spills; P V runs in float16 whatever q's dtype at
    D = 128 (with bfloat16 q, Q K^T alone is a bfloat16 HMMA); the append that quantizes
    rotated rows into it has none either (sm_90 and newer: tileiras 13.4 compiles no e4m3 code
    below)."""
    cubins = aot.compile_decode(arch, q_dtype, page_size=64, splits=4, fp8_cache=True,
                                rotary="neox")
    listing = aot.disassemble(cubins["decode"])
    decode, append = aot.summarize(listing), aot.summarize(aot.disassemble(cubins["append"]))
    assert decode["tensor_core"] > 0 and decode["local_memory"] == 0, decode
    assert ".E4M3.UNPACK" in listing
    fp16_mma, bf16_mma = listing.count("HMMA.16816.F32 "), listing.count("HMMA.16816.F32.BF16 ")
    # float16 P V; with bfloat16 q, Q K^T (as many matmuls) in bfloat16
    assert fp16_mma > 0 and bf16_mma == (fp16_mma if q_dtype == "bfloat16" else 0)
    assert append["local_memory"] == 0, append


def test_fp8_cache_keeps_bfloat16_p_v_at_wide_values():
    """With bfloat16 q at Dv > 128 an FP8 cache's P V stays in bfloat16, P unscaled (float16
    tiles there took sm_90 from 148 to 254 LDL/STL and 1.25-1.30x the step time on an H100,
    2026-12-07): every matmul a bfloat16 one."""
    listing = aot.disassemble(aot.compile_decode("sm_90", "bfloat16", head_dim=256, splits=4,
                                                 fp8_cache=True)["decode"])
    assert listing.count("HMMA.16816.F32 ") == 0
    assert listing.count("HMMA.16816.F32.BF16 ") > 0


@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_fp8_cache_with_sinks_compiles(q_dtype):
    """Under SINKS an FP8 cache's rows start from the sink shifted by P's scale (m_i 8 below
    it, l_i = 2^8): sm_90 compiles it without spills, on its tensor cores."""
    cubins = aot.compile_decode("sm_90", q_dtype, splits=4, fp8_cache=True, sinks=True)
    decode = aot.summarize(aot.disassemble(cubins["decode"]))
    assert decode["tensor_core"] > 0 and decode["local_memory"] == 0, decode


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
def test_leftpad_and_rotary_compile(arch, rotary):
    """The LEFTPAD decode and the rotary append (a group of 6 heads, D = 80: padded tiles)
    compile without spills; the decode keeps its tensor cores."""
    cubins = aot.compile_decode(arch, head_dim=80, group=6, q_len=3, splits=2, leftpad=True,
                                rotary=rotary)
    decode, append = (aot.summarize(aot.disassemble(cubins[n])) for n in ("decode", "append"))
    assert decode["tensor_core"] > 0 and decode["local_memory"] == 0, decode
    assert append["local_memory"] == 0, append


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_masked_decode_compiles(arch):
    """ATTN_MASK (a mask over 16-byte rows, as its uint8 view) on a contiguous cache and on
    16-key pages, 4 query rows of a group of 4: tensor cores, and no spill the same kernel
    without the mask does not have (sm_90 joins 16-key pages without softcap with 22
    LDL/STL either way: test_decode_kernels_compile_with_tensor_cores)."""
    for page_size in (None, 16):
        plain, masked = (aot.summarize(aot.disassemble(aot.compile_decode(
            arch, page_size=page_size, q_len=4, group=4, splits=2, attn_mask=mask)["decode"]))
            for mask in (False, True))
        assert masked["tensor_core"] > 0, (page_size, masked)
        assert masked["local_memory"] <= plain["local_memory"], (page_size, plain, masked)


def test_fake_kvcache_op_shapes():
    """The op's fake kernel, run on meta tensors (``register_fake`` serves the Meta key)."""
    q = torch.empty(3, 2, 8, 64, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(4, 100, 2, 64, device="meta", dtype=torch.bfloat16)
    v_cache = torch.empty(4, 100, 2, 32, device="meta", dtype=torch.bfloat16)
    lens = torch.empty(3, device="meta", dtype=torch.int32)
    out, lse = torch.ops.flash_tile.kvcache_attention(
        q, k_cache, v_cache, None, None, lens, None, None, None, 0.125, 0.0, -1, 0, 0, True)
    assert out.shape == (3, 2, 8, 32) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 8, 2) and lse.dtype == torch.float32


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_traces_into_one_graph(paged, masked, monkeypatch):
    """torch.compile(fullgraph=True) through flash_attn_with_kvcache: the checks and the
    ``flash_tile::kvcache_attention`` op (which declares the caches it appends to as mutated)
    in one graph, a mask (a static cache's [B, 1, 1, L]) among the op's inputs. Meta tensors
    stand in for CUDA ones (the device check is stubbed)."""
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(node for node in gm.graph.nodes if "kvcache_attention" in str(node.target))
        return gm

    def step(q, k_cache, v_cache, k, v, lens, table, mask):
        return flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                  block_table=table, causal=True,
                                                  attn_mask=mask)

    meta = dict(device="meta", dtype=torch.float16)
    q = torch.empty(2, 1, 8, 64, **meta)
    caches = [torch.empty(16 if paged else 2, 64, 2, 64, **meta) for _ in range(2)]
    new = [torch.empty(2, 1, 2, 64, **meta) for _ in range(2)]
    lens = torch.empty(2, device="meta", dtype=torch.int32)
    table = torch.empty(2, 8, device="meta", dtype=torch.int32) if paged else None
    mask = torch.empty(2, 1, 1, 512 if paged else 64, device="meta", dtype=torch.bool)
    torch.compiler.reset()
    out = torch.compile(step, fullgraph=True, backend=backend)(q, *caches, *new, lens, table,
                                                               mask if masked else None)
    assert out.shape == (2, 1, 8, 64)
    assert len(ops) == 1, ops
    assert (ops[0].args[-1] is not None) == masked, ops[0].args


@pytest.mark.parametrize("arch,page_size", [("sm_90", None), ("sm_90", 64), ("sm_80", None)])
def test_int64_entry_points_compile(arch, page_size):
    """Caches of 2**31 elements or more take the _int64 decode and append kernels (64-bit
    shapes and strides of K and V); the launcher's choice is ``needs_int64_index``."""
    cubins = aot.compile_decode(arch, page_size=page_size, splits=2, int64_index=True)
    sass = aot.summarize(aot.disassemble(cubins["decode"]))
    assert sass["tensor_core"] > 0, sass
    assert set(cubins) == {"decode", "combine", "append"}
    big = torch.empty(2**31 + 1, dtype=torch.bfloat16, device="meta")
    assert _launch.needs_int64_index(big.view(1, -1, 1, 1))


def test_decode_table_marks_the_paged_target(monkeypatch):
    """bench_decode's table of the committed H200 results: each row's `paged` cell is its
    slowest page size over the contiguous cache, and the row says `paged < 0.95x` exactly
    when that is below 0.95."""
    import json
    import pathlib

    bench = pathlib.Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))
    import bench_decode

    saved = json.loads((bench / "results" / "decode-h200.json").read_text())
    text = bench_decode.table(saved["rows"], saved["machine"]["read_bandwidth_gbps"])
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(lines) == len(saved["rows"]) + 1  # the header, then a line a row
    for r, line in zip(saved["rows"], lines[1:]):
        assert line.startswith(f"| {r['batch']} | {r['seqlen']} |"), line
        worst = min(r["paged_ratio"].values())
        assert f"| {worst:.2f}x |" in line, (worst, line)
        assert ("paged < 0.95x" in line) == (worst < 0.95), line
    # A row whose flash_tile or cuDNN measurement failed gets no verdict, never "met".
    why = "failed: No available kernel. Aborting execution."
    gbps = {name: x for name, x in saved["rows"][0]["gbps"].items() if name != "sdpa_efficient"}
    unmeasured = dict(saved["rows"][0], ratio_vs_cudnn=None, fraction_of_bandwidth=None,
                      paged_ratio={}, cache_mib=64.0, gbps=gbps,
                      skipped={"sdpa_efficient": why})
    text = bench_decode.table([unmeasured], 4000.0)
    line = [line for line in text.splitlines() if line.startswith("| ")][-1]
    assert line.endswith("| not measured: vs cuDNN, bandwidth |"), line
    assert "met" not in line.split("|")[-2]
    # A backend that ran on no row is named under the table, with its reason.
    assert text.endswith(f"No column: sdpa_efficient (not measured on any row: {why}).")
    host = bench_decode.host_verdict({"flash_attn_with_kvcache": 53.4,
                                      "flash_attn_with_kvcache, one split": 19.0,
                                      "ct.launch": 8.0})
    assert host.endswith("missed: flash_attn_with_kvcache 53.4 us.")
    assert bench_decode.host_verdict({"ct.launch": 8.0}).endswith(
        "not measured: no public call timed.")


def test_decode_variants_parse_their_configs_and_tabulate(monkeypatch):
    """bench_decode_variants: --configs are DecodeConfig fields (anything else raises before
    any GPU work); calls are timed in turn, round after round, each keeping its best
    (``bench_decode.best_of_rounds``, the device timer stubbed); the plan calls it makes bind
    to the launcher's signatures; the table gives each variant's ratio, or says it was
    skipped."""
    import inspect
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    import bench_decode_variants as bdv

    configs = bdv.parse_configs(['{"num_worker_warps": 8}', '{"occupancy": 1}'])
    assert configs == [{"num_worker_warps": 8}, {"occupancy": 1}]
    for bad in ('{"warps": 8}', "[8]", "{}"):
        with pytest.raises(ValueError, match="DecodeConfig fields"):
            bdv.parse_configs([bad])
    import bench_decode

    times, order = iter([3.0, 2.0, 1.0, 4.0, 2.5, 5.0]), []
    monkeypatch.setattr(bench_decode, "device_ms", lambda call: order.append(call) or next(times))
    assert bench_decode.best_of_rounds({"a": "A", "b": "B"}) == {"a": 1.0, "b": 2.0}
    assert order == ["A", "B"] * bench_decode.ROUNDS  # in turn, round after round
    inspect.signature(_launch_decode.decode_plan).bind(
        *[None] * 10, decode_variants.DecodeConfig())
    inspect.signature(_launch_decode._DecodePlan.launch).bind(None, *[None] * 13)
    rows = [dict(batch=8, seqlen=8192, heads=32, kv_heads=8, q_len=1, page_size=page,
                 us={"default": 20.5, '{"num_worker_warps": 8}': 18.0},
                 ratio={"default": 1.0, '{"num_worker_warps": 8}': 0.878},
                 skipped={'{"occupancy": 1}': "failed: no"}) for page in (None, 16)]
    lines = [line for line in bdv.variants_table(rows, configs).splitlines()
             if line.startswith("| 8 ")]
    assert lines == ["| 8 | 8192 | 32/8 | 1 | - | 20.5 | 0.878 | skipped |",
                     "| 8 | 8192 | 32/8 | 1 | 16 | 20.5 | 0.878 | skipped |"]
