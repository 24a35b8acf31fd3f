"""flash_attn_with_kvcache on the GPU against an fp32 reference, flash-attn's 2x rule.

Each sequence's keys are read back from the cache (``reference_decode.cache_sequences``) and
attended by ``reference.attention_dense`` in fp32 (the reference) and in the input dtype
(PyTorch's own low-precision error). Cache slots past each sequence's length, and pages no
sequence uses, hold NaN: a kernel that reads one fails.
"""

import math

import pytest
import torch

import flash_tile
from flash_tile import reference, reference_decode

pytestmark = pytest.mark.gpu


def _cache(batch, capacity, kv_heads, head_dim, v_head_dim, dtype, page_size, seqlens, gen,
           leftpad=None, table_tail=None):
    """(k_cache, v_cache, block_table): random keys from each sequence's left pad (0 without
    ``leftpad``) to its length, NaN elsewhere; paged caches get shuffled pages plus unused NaN
    pages, and with ``table_tail`` that entry (no valid page) in the table past each
    sequence's last page."""
    starts = leftpad or [0] * batch
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    if page_size is None:
        k, v = rand(batch, capacity, kv_heads, head_dim), rand(batch, capacity, kv_heads,
                                                               v_head_dim)
        pos = torch.arange(capacity, device="cuda")[None, :, None, None]
        stale = (pos >= torch.tensor(seqlens, device="cuda")[:, None, None, None]) | (
            pos < torch.tensor(starts, device="cuda")[:, None, None, None])
        return k.masked_fill(stale, math.nan), v.masked_fill(stale, math.nan), None
    per_seq = -(-capacity // page_size)
    pages = batch * per_seq + 3  # some never used
    k, v = (rand(pages, page_size, kv_heads, d) for d in (head_dim, v_head_dim))
    table = torch.randperm(pages, generator=gen, device="cuda")[:batch * per_seq]
    table = table.view(batch, per_seq).to(torch.int32)
    used = torch.zeros(pages, page_size, dtype=torch.bool, device="cuda")
    for b, n in enumerate(seqlens):
        flat = used[table[b].long()].flatten()
        flat[starts[b]:n] = True
        used[table[b].long()] = flat.view(per_seq, page_size)
    k = k.masked_fill(~used[..., None, None], math.nan)
    v = v.masked_fill(~used[..., None, None], math.nan)
    if table_tail is not None:
        blocks = torch.arange(per_seq, device="cuda")[None, :]
        needed = -(-torch.tensor(seqlens, device="cuda")[:, None] // page_size)
        table = table.masked_fill(blocks >= needed, table_tail)
    return k, v, table


def _check(q, k_cache, v_cache, out, lse, seqlens, window=(-1, -1), softcap=0.0,
           alibi_slopes=None, batch_idx=None, block_table=None, sinks=None, leftpad=None,
           attn_mask=None):
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    seqs = reference_decode.cache_sequences(k_cache, v_cache, lengths, batch_idx, block_table,
                                            leftpad)
    masks = [None] * len(seqs)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(q.shape[0], 1, q.shape[1], attn_mask.shape[-1])
        masks = reference_decode.cache_masks(attn_mask, lengths, leftpad)
    for b, (k, v) in enumerate(seqs):
        qb = q[b:b + 1].transpose(1, 2)
        diag = k.shape[2] - q.shape[1]
        slopes = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[2])[
            b:b + 1]
        args = dict(diag_offset=diag, window=window, softcap=softcap, alibi_slopes=slopes,
                    sinks=sinks, attn_mask=masks[b])
        if k.shape[2] == 0:  # no key at all: zeros and +inf (or the sink), as flash-attn
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            if lse is not None and sinks is None:
                assert bool((lse[b] == math.inf).all())
            elif lse is not None:
                torch.testing.assert_close(lse[b], sinks[:, None].expand_as(lse[b]))
            continue
        ref, ref_lse = reference.attention_dense(qb.float(), k.float(), v.float(),
                                                 return_lse=True, **args)
        low = reference.attention_dense(qb, k, v, **args)
        report = reference.check_error(out[b:b + 1].transpose(1, 2), ref, low)
        assert report["ok"], (b, report)
        if lse is not None:  # fp32 against the fp32 reference's, +inf where no key is seen
            torch.testing.assert_close(lse[b:b + 1], ref_lse, rtol=1e-4, atol=1e-4)


def _run(batch=3, q_len=1, heads=8, kv_heads=2, head_dim=128, v_head_dim=None, capacity=300,
         seqlens=None, page_size=None, dtype=torch.bfloat16, num_splits=0, seed=0,
         table_tail=None, **kw):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v_head_dim = v_head_dim or head_dim
    seqlens = seqlens or [int(x) for x in torch.randint(
        1, capacity + 1, (batch,), generator=gen, device="cuda")]
    k_cache, v_cache, table = _cache(batch, capacity, kv_heads, head_dim, v_head_dim, dtype,
                                     page_size, seqlens, gen, table_tail=table_tail)
    q = torch.randn(batch, q_len, heads, head_dim, generator=gen, device="cuda").to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                  block_table=table, num_splits=num_splits,
                                                  return_softmax_lse=True, **kw)
    _check(q, k_cache, v_cache, out, lse, seqlens, kw.get("window_size", (-1, -1))
           if not kw.get("causal") else (kw.get("window_size", (-1, -1))[0], 0),
           kw.get("softcap", 0.0), kw.get("alibi_slopes"), None, table, kw.get("sinks"))


@pytest.mark.parametrize("q_len", [1, 2, 7, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_contiguous(q_len, group, causal):
    _run(q_len=q_len, heads=2 * group, kv_heads=2, causal=causal,
         seqlens=[0, 1, 203] if q_len == 1 else None, capacity=max(300, q_len))


@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 48, 64, 100, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_paged(page_size, q_len):
    """Every page size: 64-key steps of one page load (64, 256), of two or four joined (32;
    16 and 48 = 3 * 16), or gathered by row (1, 8, 100 = 25 * 4). The table's entries past
    each sequence's pages hold -1 (vLLM's padding) and are never used."""
    _run(q_len=q_len, page_size=page_size, capacity=1000, seqlens=[1, 17, 999], causal=True,
         table_tail=-1)


@pytest.mark.parametrize("page_size", [8, 16, 256])
@pytest.mark.parametrize("head_dim,v_head_dim", [(80, 80), (256, 256), (64, 32)])
def test_paged_head_dims(page_size, head_dim, v_head_dim):
    """Gathered, joined and whole-page loads with padded tiles (D = 80), D = 256 and Dv != D;
    table entries past each sequence's pages out of range."""
    _run(q_len=2, page_size=page_size, head_dim=head_dim, v_head_dim=v_head_dim,
         capacity=700, seqlens=[699, 130, 5], causal=True, table_tail=2**30)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dims(head_dim, dtype):
    _run(head_dim=head_dim, dtype=dtype, q_len=3, causal=True)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("page_size", [None, 16])
def test_every_split_count_agrees(num_splits, page_size):
    _run(batch=2, capacity=2000, seqlens=[1999, 113], num_splits=num_splits, q_len=2,
         causal=True, page_size=page_size)


@pytest.mark.parametrize("page_size", [None, 64])
def test_one_sequence_of_a_long_cache(page_size):
    """Batch 1 against a 16k cache (GQA 32/8), the case the chosen split count is for: the
    heuristic splits it over the SMs (``num_splits=0``)."""
    _run(batch=1, heads=32, kv_heads=8, capacity=16384, seqlens=[16383], page_size=page_size,
         causal=True)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_size", [None, 64])
def test_sinks(num_splits, page_size):
    """gpt-oss's decode: sinks with GQA 8, split or not, paged or not, one sequence with an
    empty cache (its LSE is the sink's)."""
    sinks = torch.randn(16, device="cuda")
    _run(batch=3, heads=16, kv_heads=2, head_dim=64, capacity=700, seqlens=[0, 1, 699],
         page_size=page_size, num_splits=num_splits, q_len=2, causal=True, sinks=sinks)


def test_features():
    slopes = torch.rand(8, device="cuda")
    _run(q_len=5, window_size=(40, 0), softcap=30.0, alibi_slopes=slopes, capacity=500)
    _run(q_len=5, window_size=(7, 3), capacity=500, page_size=64)
    _run(q_len=1, head_dim=128, v_head_dim=64, capacity=500)


@pytest.mark.parametrize("page_size", [None, 8, 16, 64])
@pytest.mark.parametrize("q_len,group,num_splits", [(1, 8, 0), (1, 1, 1), (4, 4, 3)])
@pytest.mark.parametrize("capacity", [256, 203])
def test_attn_mask(page_size, q_len, group, num_splits, capacity):
    """A mask over cache positions (what a Transformers static cache passes), causal, with a
    left pad and a query row that sees nothing: over 16-byte rows (read as uint8) and ragged
    ones (bool), contiguous and paged (gathered, joined and whole-page steps), split or not,
    one query row packed with its group or four rows."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    seqlens, leftpad = [capacity, 1, 150], [0, 0, 20]
    k_cache, v_cache, table = _cache(3, capacity, 2, 128, 128, torch.bfloat16, page_size,
                                     seqlens, gen, leftpad)
    width = capacity if table is None else table.shape[1] * page_size
    mask = torch.rand(3, 1, q_len, width, generator=gen, device="cuda") > 0.3
    mask[0, 0, -1] = False  # the last query row of sequence 0 sees no key
    q = torch.randn(3, q_len, 2 * group, 128, generator=gen, device="cuda").to(torch.bfloat16)
    lens, pads = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (seqlens, leftpad))
    out, lse = flash_tile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads, block_table=table,
        causal=True, num_splits=num_splits, return_softmax_lse=True, attn_mask=mask)
    assert bool((lse[0, :, -1] == math.inf).all())
    again = flash_tile.flash_attn_with_kvcache(  # a second call of the signature: same bits
        q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads, block_table=table,
        causal=True, num_splits=num_splits, return_softmax_lse=True, attn_mask=mask)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    _check(q, k_cache, v_cache, out, lse, seqlens, (-1, 0), block_table=table, leftpad=pads,
           attn_mask=mask)


def test_attn_mask_with_features():
    """The mask beside a window, softcap, ALiBi and sinks, in four splits on 16-key pages
    (the full path: ALiBi calls keep no plan)."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    seqlens = [500, 37, 1]
    k_cache, v_cache, table = _cache(3, 512, 2, 64, 64, torch.bfloat16, 16, seqlens, gen)
    mask = torch.rand(3, 1, 2, table.shape[1] * 16, generator=gen, device="cuda") > 0.2
    q = torch.randn(3, 2, 8, 64, generator=gen, device="cuda").to(torch.bfloat16)
    slopes, sinks = torch.rand(8, device="cuda"), torch.randn(8, device="cuda")
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse = flash_tile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=table, window_size=(100, 0),
        softcap=20.0, alibi_slopes=slopes, sinks=sinks, num_splits=4, return_softmax_lse=True,
        attn_mask=mask)
    _check(q, k_cache, v_cache, out, lse, seqlens, (100, 0), 20.0, slopes, block_table=table,
           sinks=sinks, attn_mask=mask)


@pytest.mark.parametrize("shape", ["keys", "rows"])
def test_attn_mask_broadcasts(shape):
    """One mask for every sequence ([L]) or one row per sequence for every query row
    ([B, 1, 1, L], Transformers' form) with an append: the same as the mask expanded."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    seqlens, cap = [90, 300, 7], 320
    k_cache, v_cache, _ = _cache(3, cap, 2, 64, 64, torch.float16, None, seqlens, gen)
    mask = torch.rand((cap,) if shape == "keys" else (3, 1, 1, cap), generator=gen,
                      device="cuda") > 0.5
    q = torch.randn(3, 2, 8, 64, generator=gen, device="cuda").to(torch.float16)
    k_new, v_new = (torch.randn(3, 2, 2, 64, generator=gen, device="cuda").to(torch.float16)
                    for _ in range(2))
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                             cache_seqlens=lens, attn_mask=mask)
    _check(q, k_cache, v_cache, out, None, [n + 2 for n in seqlens], attn_mask=mask)


@pytest.mark.parametrize("v_dim", [64, 32])
def test_append_then_attend(v_dim):
    """New rows written at cache_seqlens, then attended, contiguous and paged; Dv = D and
    Dv != D (the append writes V's rows at their own width)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, cap, kvh, d, new = 2, 600, 2, 64, 3
    seqlens = [10, 400]
    for page_size in (None, 16):
        k_cache, v_cache, table = _cache(batch, cap, kvh, d, v_dim, torch.bfloat16, page_size,
                                         seqlens, gen)
        q = torch.randn(batch, new, 8, d, generator=gen, device="cuda").to(torch.bfloat16)
        k_new, v_new = (torch.randn(batch, new, kvh, dim, generator=gen, device="cuda").to(
            torch.bfloat16) for dim in (d, v_dim))
        lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        out = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                 cache_seqlens=lens, block_table=table,
                                                 causal=True)
        grown = [n + new for n in seqlens]
        seqs = reference_decode.cache_sequences(k_cache, v_cache, torch.tensor(grown), None, table)
        for b, (k, v) in enumerate(seqs):  # the new rows landed where they belong
            assert torch.equal(k[0, :, seqlens[b]:].transpose(0, 1), k_new[b])
            assert torch.equal(v[0, :, seqlens[b]:].transpose(0, 1), v_new[b])
        _check(q, k_cache, v_cache, out, None, grown, (-1, 0), block_table=table)
        assert torch.equal(lens.cpu(), torch.tensor(seqlens, dtype=torch.int32))  # unchanged


def test_no_cache_seqlens_reads_every_cache_row():
    """cache_seqlens=None: every sequence holds the cache's whole capacity (flash-attn)."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    k_cache, v_cache, _ = _cache(2, 203, 2, 64, 64, torch.bfloat16, None, [203, 203], gen)
    q = torch.randn(2, 3, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    out, lse = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True,
                                                  return_softmax_lse=True)
    _check(q, k_cache, v_cache, out, lse, [203, 203], (-1, 0))


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_chunked_prefill(page_size):
    """A prompt's chunk of 64 rows against a paged cache (gathered, joined and whole-page
    loads at Lq past the decode's few rows); one sequence shorter than the chunk, whose first
    rows see no key."""
    _run(q_len=64, page_size=page_size, capacity=1000, seqlens=[40, 333, 999], causal=True,
         table_tail=-1)


def test_cache_batch_idx():
    gen = torch.Generator(device="cuda").manual_seed(7)
    seqlens = [50, 5, 120, 77]
    k_cache, v_cache, _ = _cache(4, 128, 2, 64, 64, torch.float16, None, seqlens, gen)
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 4, 64, generator=gen, device="cuda").to(torch.float16)
    lens = torch.tensor([seqlens[2], seqlens[0]], dtype=torch.int32, device="cuda")
    out = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                             cache_batch_idx=idx)
    _check(q, k_cache, v_cache, out, None, lens.tolist(), batch_idx=idx)


def test_cuda_graph_replays_growing_caches():
    """One decode step (append + attend) captured once and replayed over three steps, the
    cache lengths growing in place between replays."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch, cap, kvh, d = 2, 512, 2, 128
    seqlens = [100, 37]
    k_cache, v_cache, table = _cache(batch, cap, kvh, d, d, torch.bfloat16, 64, seqlens, gen)
    q = torch.empty(batch, 1, 8, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.empty(batch, 1, kvh, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")

    def step():
        return flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                  cache_seqlens=lens, block_table=table,
                                                  causal=True)

    for t in (q, k_new, v_new):
        t.normal_(generator=gen)
    step()  # compile and warm up outside the capture
    lens += 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
        graph.replay()
        lens += 1
        grown = [int(n) for n in lens.tolist()]
        _check(q, k_cache, v_cache, out, None, grown, (-1, 0), block_table=table)


def test_torch_compile_matches_eager():
    """A decode step (append + attend) under torch.compile(fullgraph=True) gives eager's output
    and leaves the caches as eager does."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    seqlens = [77, 300]
    k_cache, v_cache, table = _cache(2, 512, 2, 128, 128, torch.bfloat16, 64, seqlens, gen)
    q = torch.randn(2, 1, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k_new, v_new = (torch.randn(2, 1, 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
                    for _ in range(2))
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")

    def step(k_cache, v_cache):
        return flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                  cache_seqlens=lens, block_table=table,
                                                  causal=True)

    eager_caches = (k_cache.clone(), v_cache.clone())
    expected = step(*eager_caches)
    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True)(k_cache, v_cache)
    assert torch.equal(compiled, expected)
    assert torch.equal(k_cache.nan_to_num(), eager_caches[0].nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), eager_caches[1].nan_to_num())


def test_group_of_six_heads_append_with_batch_idx_and_an_int_length():
    """6 query heads per KV head (the tile pads the group to 8), new rows appended into the
    cache rows cache_batch_idx names, at one length given as an int."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    k_cache, v_cache, _ = _cache(3, 256, 2, 64, 64, torch.bfloat16, None, [40, 40, 40], gen)
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 2, 12, 64, generator=gen, device="cuda").to(torch.bfloat16)
    k_new, v_new = (torch.randn(2, 2, 2, 64, generator=gen, device="cuda").to(torch.bfloat16)
                    for _ in range(2))
    out, lse = flash_tile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                  cache_seqlens=40, cache_batch_idx=idx,
                                                  causal=True, return_softmax_lse=True)
    assert torch.equal(k_cache[2, 40:42], k_new[0]) and torch.equal(v_cache[0, 40:42], v_new[1])
    _check(q, k_cache, v_cache, out, lse, [42, 42], (-1, 0), batch_idx=idx)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (30, 2)])
def test_leftpad(page_size, num_splits, window):
    """Left-padded sequences (cache_leftpad): keys from the pad on, NaN before it; a sequence
    padded to its end sees no key. Causal, windows and ALiBi count from the pad."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    seqlens, leftpad = [300, 1, 170, 399, 64], [37, 1, 0, 250, 63]
    k_cache, v_cache, table = _cache(5, 400, 2, 128, 128, torch.bfloat16, page_size, seqlens,
                                     gen, leftpad)
    q = torch.randn(5, 3, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    lens, pads = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (seqlens, leftpad))
    slopes = torch.rand(8, device="cuda") if window == (30, 2) else None
    out, lse = flash_tile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads, block_table=table,
        window_size=window, alibi_slopes=slopes, num_splits=num_splits,
        return_softmax_lse=True)
    _check(q, k_cache, v_cache, out, lse, seqlens, window, alibi_slopes=slopes,
           block_table=table, leftpad=pads)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("q_len, new_len, causal, rotary_dim",
                         [(3, 3, True, 128), (4, 1, False, 64), (1, 3, True, 64),
                          (2, 0, False, 128), (4, 1, True, 64)])
def test_rotary_append_then_attend(interleaved, page_size, q_len, new_len, causal,
                                   rotary_dim):
    """The fused rotary embedding: the new keys land in the cache rotated at their positions,
    q is rotated at cache_seqlens (+ its row when causal, past the new keys where q has
    more rows than they), as ``reference_decode.rotary_embedding`` does; with left pads, a
    group of 6 heads, and no new rows (q alone rotated)."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    batch, cap, kvh, heads, d = 3, 512, 2, 12, 128
    seqlens, leftpad = [0, 250, 509 - new_len], [0, 20, 100]
    k_cache, v_cache, table = _cache(batch, cap, kvh, d, d, torch.bfloat16, page_size, seqlens,
                                     gen, leftpad)
    q = torch.randn(batch, q_len, heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    k_new, v_new = (torch.randn(batch, new_len, kvh, d, generator=gen, device="cuda").to(
        torch.bfloat16) for _ in range(2))
    rows = cap + max(0, q_len - new_len)  # q's rows step past the new keys' positions
    angle = torch.rand(rows, rotary_dim // 2, generator=gen, device="cuda") * 2 * math.pi
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    lens, pads = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (seqlens, leftpad))
    q_before = q.clone()
    out = flash_tile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        cache_leftpad=pads, block_table=table, causal=causal, rotary_interleaved=interleaved)
    assert torch.equal(q, q_before)  # q is read, not rotated in place
    base = lens.long()[:, None]
    k_ro = reference_decode.rotary_embedding(
        k_new, cos, sin, base + torch.arange(new_len, device="cuda"), interleaved)
    q_ro = reference_decode.rotary_embedding(
        q, cos, sin, base + (torch.arange(q_len, device="cuda") if causal else 0), interleaved)
    grown = [n + new_len for n in seqlens]
    seqs = reference_decode.cache_sequences(k_cache, v_cache, torch.tensor(grown), None, table)
    for b, (k, v) in enumerate(seqs):  # the rotated keys landed where they belong
        torch.testing.assert_close(k[0, :, seqlens[b]:].transpose(0, 1), k_ro[b])
        assert torch.equal(v[0, :, seqlens[b]:].transpose(0, 1), v_new[b])
    _check(q_ro, k_cache, v_cache, out, None, grown, (-1, 0) if causal else (-1, -1),
           block_table=table, leftpad=pads)


def test_caches_past_2_31_elements():
    """Five cache rows of 2**29 elements (10 GiB of K and V): the last row starts at offset
    2**31. Without cache_batch_idx the decode runs in two 32-bit launches (3 + 2 sequences);
    with it, in one launch of the 64-bit kernel (which launches, ``test_decode.py`` checks on
    meta tensors; here the results of both). NaN outside the sequences, as elsewhere."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    seqlens = [100, 5000, 1000, 77, 300]
    caches = []
    for _ in range(2):
        cache = torch.full((5, 2**20, 4, 128), math.nan, device="cuda", dtype=torch.bfloat16)
        for b, n in enumerate(seqlens):
            cache[b, :n] = torch.randn(n, 4, 128, generator=gen, device="cuda")
        caches.append(cache)
    q = torch.randn(5, 2, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse = flash_tile.flash_attn_with_kvcache(q, *caches, cache_seqlens=lens, causal=True,
                                                  return_softmax_lse=True)
    _check(q, *caches, out, lse, seqlens, (-1, 0))
    idx = torch.tensor([4, 0, 3], dtype=torch.int32, device="cuda")
    out, lse = flash_tile.flash_attn_with_kvcache(q[:3], *caches, cache_seqlens=lens[idx.long()],
                                                  cache_batch_idx=idx, causal=True,
                                                  return_softmax_lse=True)
    _check(q[:3], *caches, out, lse, [seqlens[i] for i in idx.tolist()], (-1, 0),
           batch_idx=idx)
