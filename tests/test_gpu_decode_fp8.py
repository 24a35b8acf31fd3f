"""flash_attn_with_kvcache with an FP8 (float8_e4m3fn) KV cache and float16/bfloat16 queries,
on a GPU of compute capability 9.0+ (skipped elsewhere, with the reason).

The cache stands for k_descale * k8 and v_descale * v8. The decode widens each tile exactly
(every e4m3 value is a float16 and a bfloat16; K to q's dtype, V to float16, and P V runs in
float16, finer than bfloat16; with bfloat16 q at Dv > 128 V to bfloat16, P V in it), so
against attention of the dequantized cache its error is at most that of a q-dtype cache: the
reference is
``reference.attention_dense`` in fp32 on the dequantized keys and values read back from the
cache, PyTorch's own low-precision error the same in q's dtype, and flash-attn's 2x rule.
Slots past each sequence's length hold NaN (0x7F in e4m3): a kernel that reads one fails.
New rows in q's dtype are stored as x / descale rounded to e4m3, which torch's conversion of
the same quotient gives to within one e4m3 step (the kernel multiplies by 1 / descale).
"""

import math

import pytest
import torch

import flash_tile
from flash_tile import reference, reference_decode

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_or_newer")]

E4M3 = torch.float8_e4m3fn
NAN_E4M3 = 0x7F


def _fp8_cache(batch, capacity, kv_heads, head_dim, page_size, seqlens, gen, per):
    """(k8, v8, k_descale, v_descale, block_table): caches quantized with
    ``flash_tile.quantize_fp8`` (``per`` "head": [B, H_kv] factors; paged caches take
    "tensor"), the slots no sequence uses set to NaN."""
    rows = batch if page_size is None else batch * -(-capacity // page_size) + 3
    length = capacity if page_size is None else page_size
    k, v = (torch.randn(rows, length, kv_heads, head_dim, generator=gen, device="cuda")
            * scale for scale in (1.0, 3.0))
    (k8, kd), (v8, vd) = (flash_tile.quantize_fp8(t, per) for t in (k, v))
    table = None
    if page_size is None:
        pos = torch.arange(capacity, device="cuda")[None, :]
        stale = pos >= torch.tensor(seqlens, device="cuda")[:, None]  # [B, L]
    else:
        per_seq = -(-capacity // page_size)
        table = torch.randperm(rows, generator=gen, device="cuda")[:batch * per_seq]
        table = table.view(batch, per_seq).to(torch.int32)
        stale = torch.ones(rows, page_size, dtype=torch.bool, device="cuda")
        for b, n in enumerate(seqlens):
            flat = stale[table[b].long()].flatten()
            flat[:n] = False
            stale[table[b].long()] = flat.view(per_seq, page_size)
    for t in (k8, v8):
        t.view(torch.uint8).masked_fill_(stale[..., None, None], NAN_E4M3)
    return k8, v8, kd, vd, table


def _dequantized(k8, v8, kd, vd):
    """The caches as the values they stand for, fp32 (per-head factors by cache row)."""
    def scale(d):
        return d.reshape(()) if d.numel() == 1 else d[:, None, :, None]
    return k8.float() * scale(kd), v8.float() * scale(vd)


def _check(q, k_deq, v_deq, out, lse, seqlens, table, window=(-1, -1), batch_idx=None,
           leftpad=None, alibi_slopes=None, **features):
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    seqs = reference_decode.cache_sequences(k_deq, v_deq, lengths, batch_idx, table, leftpad)
    for b, (k, v) in enumerate(seqs):
        qb = q[b:b + 1].transpose(1, 2)
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1]
        args = dict(diag_offset=k.shape[2] - q.shape[1], window=window, alibi_slopes=slopes,
                    **features)
        ref, ref_lse = reference.attention_dense(qb.float(), k, v, return_lse=True, **args)
        low = reference.attention_dense(qb, k.to(q.dtype), v.to(q.dtype), **args)
        report = reference.check_error(out[b:b + 1].transpose(1, 2), ref, low)
        assert report["ok"], (b, report)
        if lse is not None:
            torch.testing.assert_close(lse[b:b + 1], ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("page_size", [None, 64, 256])
@pytest.mark.parametrize("q_len, causal", [(1, False), (4, True), (17, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_matches_the_dequantized_cache(page_size, q_len, causal, dtype):
    """Contiguous caches with per-(sequence, head) factors, paged ones with a per-tensor
    factor; GQA 8/2, split or not (num_splits 0 picks), causal bottom-right. A second call
    of the same signature runs the kept plan and gives the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    batch, capacity, kv_heads, heads, d = 3, 700, 2, 8, 128
    seqlens = [1, 203, 700]
    per = "head" if page_size is None else "tensor"
    k8, v8, kd, vd, table = _fp8_cache(batch, capacity, kv_heads, d, page_size, seqlens, gen,
                                       per)
    q = torch.randn(batch, q_len, heads, d, generator=gen, device="cuda").to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")

    def call():
        return flash_tile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                                  block_table=table, causal=causal,
                                                  return_softmax_lse=True, k_descale=kd,
                                                  v_descale=vd)
    out, lse = call()
    assert out.dtype == dtype
    k_deq, v_deq = _dequantized(k8, v8, kd, vd)
    _check(q, k_deq, v_deq, out, lse, seqlens, table, (-1, 0) if causal else (-1, -1))
    again, _ = call()
    assert torch.equal(again, out)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_at_wide_values(page_size, dtype):
    """D = Dv = 256: with bfloat16 q the decode's P V stays in bfloat16 (P unscaled), with
    float16 q in float16 on the scaled P; both against the dequantized cache, split."""
    gen = torch.Generator(device="cuda").manual_seed(37)
    batch, capacity, kv_heads, heads, d = 2, 640, 2, 4, 256
    seqlens = [17, 640]
    k8, v8, kd, vd, table = _fp8_cache(batch, capacity, kv_heads, d, page_size, seqlens, gen,
                                       "head" if page_size is None else "tensor")
    q = torch.randn(batch, 1, heads, d, generator=gen, device="cuda").to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse = flash_tile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                                  block_table=table, causal=True,
                                                  return_softmax_lse=True, k_descale=kd,
                                                  v_descale=vd, num_splits=2)
    _check(q, *_dequantized(k8, v8, kd, vd), out, lse, seqlens, table, (-1, 0))


def test_fp8_cache_with_every_feature():
    """cache_batch_idx (the factors follow the sequence, not its cache row), left pads,
    softcap, ALiBi, sinks, a group of 4 heads, 3 query rows causal, 3 splits."""
    gen = torch.Generator(device="cuda").manual_seed(43)
    batch, capacity, kv_heads, heads, d, q_len = 3, 400, 2, 8, 64, 3
    seqlens, pads = [3, 203, 400], [0, 17, 100]
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")  # sequence b's cache row
    k8, v8, _, _, _ = _fp8_cache(batch, capacity, kv_heads, d, None, [400] * batch, gen, "head")
    kd, vd = (torch.rand(batch, kv_heads, generator=gen, device="cuda") + 0.5 for _ in range(2))
    q = torch.randn(batch, q_len, heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    slopes = torch.rand(batch, heads, generator=gen, device="cuda") * 0.1
    sinks = torch.randn(heads, generator=gen, device="cuda")
    lens, leftpad = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (seqlens, pads))
    out, lse = flash_tile.flash_attn_with_kvcache(
        q, k8, v8, cache_seqlens=lens, cache_batch_idx=rows, cache_leftpad=leftpad,
        causal=True, softcap=30.0, alibi_slopes=slopes, sinks=sinks, num_splits=3,
        return_softmax_lse=True, k_descale=kd, v_descale=vd)
    k_deq, v_deq = torch.empty_like(k8, dtype=torch.float32), torch.empty_like(
        v8, dtype=torch.float32)
    for b, r in enumerate(rows.tolist()):  # sequence b's row, with sequence b's factors
        k_deq[r], v_deq[r] = (t[r].float() * f[b][None, :, None] for t, f in ((k8, kd),
                                                                             (v8, vd)))
    _check(q, k_deq, v_deq, out, lse, seqlens, None, (-1, 0), rows.cpu(), leftpad.cpu(),
           slopes, softcap=30.0, sinks=sinks)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_cache_without_descale_and_every_split_count(num_splits):
    """No factors given means 1 (FA3's default): the cache's e4m3 values are the keys."""
    gen = torch.Generator(device="cuda").manual_seed(37)
    k8, v8, _, _, _ = _fp8_cache(2, 500, 1, 64, None, [113, 500], gen, "head")
    q = torch.randn(2, 1, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([113, 500], dtype=torch.int32, device="cuda")
    out = flash_tile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                             num_splits=num_splits)
    _check(q, k8.float(), v8.float(), out, None, [113, 500], None)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("rotary", [False, True])
def test_append_quantizes_new_rows(page_size, rotary):
    """New k/v in q's dtype land in the FP8 cache as x / descale in e4m3 (rotated first under
    rotary), within one e4m3 step of torch's rounding of the same quotient; new rows already
    in e4m3 land bit for bit; then the step attends to them."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    batch, capacity, kv_heads, heads, d, new_len = 2, 256, 2, 4, 128, 3
    seqlens = [17, 200]
    per = "head" if page_size is None else "tensor"
    k8, v8, kd, vd, table = _fp8_cache(batch, capacity, kv_heads, d, page_size, seqlens, gen,
                                       per)
    q = torch.randn(batch, 1, heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    k_new, v_new = (torch.randn(batch, new_len, kv_heads, d, generator=gen, device="cuda")
                    .to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    rot = {}
    if rotary:
        angle = torch.rand(capacity, d // 2, generator=gen, device="cuda") * 2 * math.pi
        rot = dict(rotary_cos=angle.cos().to(torch.bfloat16),
                   rotary_sin=angle.sin().to(torch.bfloat16), rotary_interleaved=False)
    out = flash_tile.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=lens,
                                             block_table=table, k_descale=kd, v_descale=vd,
                                             **rot)
    k_want = k_new
    q_at = q
    if rotary:
        positions = lens.long()[:, None] + torch.arange(new_len, device="cuda")
        k_want = reference_decode.rotary_embedding(k_new.float(), rot["rotary_cos"],
                                                   rot["rotary_sin"], positions, False)
        q_at = reference_decode.rotary_embedding(q, rot["rotary_cos"], rot["rotary_sin"],
                                                 lens.long()[:, None], False)
    grown = [n + new_len for n in seqlens]
    k_deq, v_deq = _dequantized(k8, v8, kd, vd)
    seqs = reference_decode.cache_sequences(k_deq, v_deq, torch.tensor(grown), None, table)
    for b, (k, v) in enumerate(seqs):
        for got, new, d_ in ((k, k_want, kd), (v, v_new, vd)):
            factor = d_.reshape(()) if d_.numel() == 1 else d_[b][:, None]  # [H_kv, 1]
            got = got[0, :, seqlens[b]:].transpose(0, 1)  # [L_new, H_kv, D]
            want = (new[b].float() / factor).clamp(-448, 448).to(E4M3).float() * factor
            step = want.abs().clamp_min(2.0 ** -6 * factor) * 2.0 ** -3  # one e4m3 step
            assert bool(((got - want).abs() <= step).all()), b
    _check(q_at, k_deq, v_deq, out, None, grown, table)

    # rows already in e4m3 are stored as they are
    k_new8, v_new8 = (t.float().clamp(-448, 448).to(E4M3) for t in (k_new, v_new))
    flash_tile.flash_attn_with_kvcache(q, k8, v8, k_new8, v_new8,
                                       cache_seqlens=torch.tensor(grown, dtype=torch.int32,
                                                                  device="cuda"),
                                       block_table=table, k_descale=kd, v_descale=vd)
    seqs = reference_decode.cache_sequences(k8, v8, torch.tensor([n + new_len for n in grown]),
                                            None, table)
    for b, (k, v) in enumerate(seqs):
        for got, new in ((k, k_new8), (v, v_new8)):
            got = got[0, :, grown[b]:].transpose(0, 1)
            assert torch.equal(got.view(torch.uint8), new[b].view(torch.uint8))
