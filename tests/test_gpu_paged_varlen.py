"""flash_attn_varlen_func with a block_table on the GPU (the forward's PAGED switch): packed
queries against the shuffled pages of a cache, every way a page is read (tile loads joined per
key tile, gathered rows), against an fp32 reference on each sequence's keys re-packed
(``reference_decode.packed_pages``) under flash-attn's 2x rule, and equal to the unpaged call
on the same tiles. The pages' unwritten slots hold NaN and the table's unused entries point
nowhere: neither may reach an output."""

import math

import pytest
import torch

import flash_tile
from conftest import opcheck_fp8
from flash_tile import _launch, _ops, reference, reference_decode, variants

pytestmark = pytest.mark.gpu

#: Pages that no table entry names, beside a packing's own: a page index read by mistake
#: lands on NaN rows.
SPARE_PAGES = 3
#: The table's entries past a sequence's pages: no page at all.
NO_PAGE = 2**30

LENGTHS_Q = [5, 1, 40, 113, 130, 0, 203, 17]
LENGTHS_K = [3, 60, 40, 250, 0, 70, 203, 17]  # Lq != Lk, a sequence without keys, Lq = Lk


def _rows(lengths, heads, dim, dtype, gen):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    return torch.randn(int(cu[-1]), heads, dim, generator=gen, device="cuda").to(dtype), cu


def _pages(k, v, cu_k, page_size, gen):
    """Packed k, v laid into shuffled pages of ``page_size`` keys (SPARE_PAGES more, and the
    slots past each sequence's keys, left NaN) and the block table naming them, one entry
    more than the longest sequence needs (NO_PAGE past each sequence's pages)."""
    return reference_decode.paged_layout(k, v, cu_k, page_size, gen, fill=math.nan,
                                         spare_pages=SPARE_PAGES, no_page=NO_PAGE)


def _inputs(heads, kv_heads, dim, v_dim, dtype, page_size, seed, lengths_k=LENGTHS_K):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, cu_q = _rows(LENGTHS_Q, heads, dim, dtype, gen)
    k, cu_k = _rows(lengths_k, kv_heads, dim, dtype, gen)
    v, _ = _rows(lengths_k, kv_heads, v_dim, dtype, gen)
    return q, k, v, cu_q, cu_k, _pages(k, v, cu_k, page_size, gen)


def _check(out, lse, q, k, v, cu_q, cu_k, dtype, **features):
    """Each sequence's output rows under the 2x rule against fp32, its LSE against fp32's;
    rows without keys 0 (or the sink's weight alone) with an LSE of +inf (or the sink)."""
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        slopes = features.get("alibi_slopes")
        kw = dict(features, alibi_slopes=None if slopes is None else slopes[b:b + 1],
                  diag_offset=diag, return_lse=True)
        ref, ref_lse = reference.attention_dense(*(t.float() for t in seq), **kw)
        low, _ = reference.attention_dense(*(t.to(dtype) for t in seq), **kw)
        report = reference.check_error(out[rows], ref[0].transpose(0, 1),
                                       low[0].transpose(0, 1).float())
        assert report["ok"], (b, report)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16, 48, 64, 256],
                         ids=["gathered", "16", "48", "64", "256"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (20, 9))], ids=["full", "causal", "window"])
def test_pages_against_each_sequence(page_size, causal, window):
    q, k, v, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(8, 2, 128, 128, torch.bfloat16,
                                                             page_size, page_size)
    out, lse = flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 203, 250,
                                                 causal=causal, window_size=window,
                                                 block_table=table, return_lse=True)
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    _check(out, lse, q, k, v, cu_q, cu_k, torch.bfloat16,
           window=(window[0], 0) if causal else window)


def _scores(feature: str, softcap: float, gen) -> tuple[dict, dict]:
    """(the reference's features, the call's arguments) of a causal call with ``feature``'s
    scores: softcap (at ``softcap``), ALiBi slopes per sequence or sinks, for 4 heads; other
    features leave them plain."""
    features, call = dict(window=(-1, 0)), dict(causal=True)
    if feature == "softcap":
        features["softcap"] = call["softcap"] = softcap
    elif feature == "alibi":
        slopes = torch.rand(len(LENGTHS_Q), 4, generator=gen, device="cuda")
        features["alibi_slopes"] = call["alibi_slopes"] = slopes
    elif feature == "sinks":
        features["sinks"] = call["sinks"] = torch.randn(4, generator=gen, device="cuda")
    return features, call


@pytest.mark.parametrize("feature", ["softcap", "alibi", "sinks", "seqused_k",
                                     "seqused_k_and_cu", "dims", "float16"])
@pytest.mark.parametrize("page_size", [2, 32, 33])
def test_pages_with_each_feature(feature, page_size):
    """Each feature of the varlen forward through pages: softcap, ALiBi, sinks, FA3's
    seqused_k without cu_seqlens_k and with it (seqused_k read, cu_seqlens_k's counts not),
    head dims that are not powers of two (D 80, Dv 48, GQA 4:1), float16; on gathered pages
    of a power of two (2) and of an odd size (33: rows found by division), and loaded ones."""
    dims = (80, 48) if feature == "dims" else (64, 64)
    kv_heads = 1 if feature == "dims" else 2
    dtype = torch.float16 if feature == "float16" else torch.bfloat16
    q, k, v, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(4, kv_heads, *dims, dtype,
                                                             page_size, 7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    features, call = _scores(feature, 6.0, gen)
    cu_call, key_counts = cu_k, cu_k.diff()
    if feature.startswith("seqused_k"):  # each sequence's first keys, its band aligned to them
        key_counts = (key_counts * 2) // 3
        call["seqused_k"] = key_counts.to(torch.int32)
        cu_call = cu_k if feature == "seqused_k_and_cu" else None
    out, lse = flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_call, 203, 250,
                                                 block_table=table, return_lse=True, **call)
    k_used, v_used, cu_used = reference_decode.packed_pages(k_pages, v_pages, table,
                                                            key_counts.to(torch.int32))
    _check(out, lse, q, k_used, v_used, cu_q, cu_used, dtype, **features)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_pages_equal_the_unpaged_call(page_size, causal):
    """The same tiles over the same keys, from pages or packed: the same scores, the same
    online softmax, bit for bit (both on the architecture's paged tile)."""
    q, k, v, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(8, 2, 128, 128, torch.bfloat16,
                                                             page_size, 3)
    config = variants.paged_config(torch.cuda.get_device_capability(), 128)
    window = (-1, 0) if causal else (-1, -1)
    out, lse = _ops._varlen_outputs(q, v, True)
    _launch.launch_forward(*_ops._packed(q, k, v, out), lse[None], None, None, 128 ** -0.5,
                           0.0, 0, window, config, varlen=_launch.Varlen(cu_q, cu_k))
    paged, paged_lse = flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 203,
                                                         250, causal=causal, return_lse=True,
                                                         block_table=table)
    assert torch.equal(paged, out) and torch.equal(paged_lse, lse)



def _fp8_pages(k, v, cu_k, page_size, gen, descales):
    """k, v quantized to float8_e4m3fn with ``descales`` ((k, v): each [B, H_kv], one row a
    sequence, or 0-d), laid into shuffled pages (``_pages``: NaN in the unwritten slots), and
    the dequantized k, v [total_k, H_kv, D] fp32 those pages stand for."""
    sequence = torch.repeat_interleave(torch.arange(len(cu_k) - 1, device="cuda"), cu_k.diff())
    quantized, dequantized = [], []
    for x, d in zip((k, v), descales):
        rows = (d[sequence] if d.dim() else d.expand(x.shape[0], x.shape[1]))[..., None]
        x8 = (x.float() / rows).to(torch.float8_e4m3fn)
        quantized.append(x8.float())  # laid out in fp32: exact, NaN slots included
        dequantized.append(x8.float() * rows)
    *pages, table = _pages(*quantized, cu_k, page_size, gen)
    return *(t.to(torch.float8_e4m3fn) for t in pages), table, *dequantized


@pytest.mark.usefixtures("hopper_or_newer")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_an_fp8_cache(page_size, dim):
    """float8_e4m3fn pages (an FP8 cache) with bfloat16 q and descale factors per (sequence,
    key/value head): against fp32 on the dequantized keys and values under the 2x rule,
    causal, GQA 4:1, a bfloat16 output."""
    gen = torch.Generator(device="cuda").manual_seed(dim + page_size)
    q, k, v, cu_q, cu_k, _ = _inputs(8, 2, dim, dim, torch.bfloat16, page_size, 11)
    # |x| / descale stays inside e4m3's 448 for N(0, 1) rows.
    descales = [(1.0 + torch.rand(len(LENGTHS_K), 2, generator=gen, device="cuda")) / 64
                for _ in range(2)]
    k_pages, v_pages, table, k_deq, v_deq = _fp8_pages(k, v, cu_k, page_size, gen, descales)
    out, lse = flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 203, 250,
                                                 causal=True, block_table=table,
                                                 return_lse=True, k_descale=descales[0],
                                                 v_descale=descales[1])
    assert out.dtype == torch.bfloat16
    _check(out, lse, q, k_deq, v_deq, cu_q, cu_k, torch.bfloat16, window=(-1, 0))


@pytest.mark.usefixtures("hopper_or_newer")
@pytest.mark.parametrize("feature", ["softcap", "alibi", "sinks", "window", "float16",
                                     "one_factor"])
def test_an_fp8_cache_with_each_feature(feature):
    """The FP8 cache with each feature whose maths meets the descale: softcap (applied to the
    dequantized score), ALiBi and sinks (added unscaled), a two-sided window, float16 q, and
    one factor for the whole cache (k_descale 0-d, v_descale None: 1); on odd gathered pages
    of 33 keys at D = 128."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    dtype = torch.float16 if feature == "float16" else torch.bfloat16
    q, k, v, cu_q, cu_k, _ = _inputs(4, 2, 128, 128, dtype, 33, 13)
    if feature == "one_factor":
        descales = [torch.tensor(1 / 50, device="cuda"), torch.tensor(1.0, device="cuda")]
        v = v / 8  # inside e4m3's range with a factor of 1
        call = dict(k_descale=descales[0])
    else:
        descales = [(1.0 + torch.rand(len(LENGTHS_K), 2, generator=gen, device="cuda")) / 64
                    for _ in range(2)]
        call = dict(k_descale=descales[0], v_descale=descales[1])
    k_pages, v_pages, table, k_deq, v_deq = _fp8_pages(k, v, cu_k, 33, gen, descales)
    features, scores = _scores(feature, 4.0, gen)
    call.update(scores)
    if feature == "window":
        features["window"] = call["window_size"] = (30, 7)
        call["causal"] = False
    out, lse = flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 203, 250,
                                                 block_table=table, return_lse=True, **call)
    assert out.dtype == dtype
    _check(out, lse, q, k_deq, v_deq, cu_q, cu_k, dtype, **features)


def test_no_pages_and_rows_without_keys():
    """Sequences without keys read no page (rows 0, LSE +inf); a call whose cache holds no
    page at all launches nothing and returns the same."""
    q, k, v, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(4, 2, 64, 64, torch.bfloat16,
                                                             16, 5, [0] * len(LENGTHS_K))
    for pages in ((k_pages, v_pages), (k_pages[:0], v_pages[:0])):
        out, lse = flash_tile.flash_attn_varlen_func(q, *pages, cu_q, cu_k, 203, 0,
                                                     block_table=table, return_lse=True)
        assert torch.equal(out, torch.zeros_like(out))
        assert bool((lse == math.inf).all())


def test_compiles_into_a_graph_and_captures():
    """torch.compile(fullgraph=True) traces the op; a CUDA graph of it replays the call."""
    q, k, v, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(4, 2, 64, 64, torch.bfloat16,
                                                             64, 9)

    def call(q):
        return flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 203, 250,
                                                 causal=True, block_table=table)
    want = call(q)
    assert torch.equal(torch.compile(call, fullgraph=True)(q), want)
    graph, static_q = torch.cuda.CUDAGraph(), q.clone()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        got = call(static_q)
    static_q.copy_(torch.flip(q, (0,)))
    graph.replay()
    assert torch.equal(got, call(static_q)) and not torch.equal(got, want)


def test_opcheck():
    q, _, _, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(2, 2, 64, 64, torch.float16, 16,
                                                             6)
    torch.library.opcheck(torch.ops.flash_tile.paged_varlen_forward,
                          (q, k_pages, v_pages, table, cu_q, cu_k, None, None, 0.125, 0.0, -1,
                           0, True))


@pytest.mark.usefixtures("hopper_or_newer")
def test_opcheck_on_an_fp8_cache():
    """The paged op's contract on an FP8 cache: a stride-0 k factor, v's None (1)."""
    q, _, _, cu_q, cu_k, (k_pages, v_pages, table) = _inputs(2, 2, 64, 64, torch.float16, 16,
                                                             6)
    k8, v8 = (t.to(torch.float8_e4m3fn) for t in (k_pages, v_pages))
    k_descale = torch.tensor(0.5, device="cuda").expand(cu_q.shape[0] - 1, 2)
    opcheck_fp8(torch.ops.flash_tile.paged_varlen_forward,
                (q, k8, v8, table, cu_q, cu_k, None, None, 0.125, 0.0, -1, 0, True, None,
                 k_descale, None))
