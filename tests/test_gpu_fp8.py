"""The FP8 forward on a GPU of compute capability 9.0+ (skipped elsewhere, with the reason).

Inputs as FA3's Table 3: N(0, 1) with 0.1% of the entries N(0, 10), bf16, quantized with
``flash_tile.quantize_fp8`` (per head or per tensor). Two references, both fp64:

- from the dequantized FP8 inputs (d * x8): the kernel differs from it by its rounding of P
  alone (plus fp32 arithmetic and the bf16 output). P, scaled by 2^8 into [0, 256], rounds
  to e4m3 with a relative error <= 2^-4 where it is normal (>= 2^-6, p >= 2^-14 of the row's
  max) and an absolute one <= 2^-10 below (2^-18 of the max); where the config's exp2_fma
  is set, the last columns of the unmasked key steps take the FMA pipe's exp2 first
  (``_tiles.exp2_fma``, within e = ``reference.EXP2_FMA_ERROR`` relative; e = 0 elsewhere),
  and l sums the rounded P as P V does (the output averages v under the rounded weights), so
  with e_ij <= max((2^-4 + 2 e) p_ij, 2^-18 + e p_ij) (p with row max 1) and e_i = sum_j e_ij

      |o_i - ref_i| <= sum_j e_ij (|v_j| + |ref_i|) / (l_i - e_i)

  to which the bf16 output adds 2^-9 |ref_i| and fp32 a few 1e-6; the bound asserted is
  1.1x the P term + 2^-8 |ref_i| + 1e-4. The tensor core adds P V and the row sum l into
  their accumulators itself (``use_fast_acc``; its sum keeps fewer mantissa bits than fp32,
  about 2^-13 of the accumulator a step), so the bound grows by 2^-13 * (Lk / 32) * max|ref|
  for each;
- from the original bf16 inputs: the RMSE of the output, FA3's measure, <= 2.4e-2 (FA3's
  baseline FP8 attention); with ``hadamard_rotate`` it must come out lower.

The outputs the ops allocate start as NaN (tests/conftest.py), and the twin
(``reference.attention_tiles`` with ``fp8_descale``) is checked on the same inputs at small
shapes, within the same bound.
"""

import functools
import math

import pytest
import torch

import flash_tile
from conftest import opcheck_fp8
from flash_tile import _launch, _ops_fp8, _validate, reference, variants

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_or_newer")]

E4M3 = torch.float8_e4m3fn
outlier_inputs = functools.partial(reference.outlier_inputs, device="cuda")  # FA3's Table 3


def quantized(q, k, v, per="head"):
    """(q8, k8, v8, descales as flash_attn_func takes them, and as the [3, B, H_kv] stack)."""
    q8, qd = flash_tile.quantize_fp8(q, per, kv_heads=k.shape[2] if per == "head" else None)
    k8, kd = flash_tile.quantize_fp8(k, per)
    v8, vd = flash_tile.quantize_fp8(v, per)
    stack = torch.stack(_validate.fp8_descales(q.shape[0], k.shape[2], q.device, q_descale=qd,
                                               k_descale=kd, v_descale=vd))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd), stack


def lse_bound(q8, k8, stack, scale):
    """[B, H, Lq] bound on the kernel's LSE error against the twin's: the LSE moves by at most
    the largest change of a score in its row, and a score's e4m3 matmul sums in the tensor
    core's accumulator, which on sm_90 keeps fewer mantissa bits than fp32 (the first GPU
    run, 2026-12-02, missed an fp32 tolerance of 1e-4 on every shape; FP8 GEMMs on Hopper are
    reported to keep about 14 bits). Up to 2^-14 of the partial sum's magnitude per 32-wide
    QGMMA step is at most D / 32 * 2^-14 <= 2^-11 of scale * sum_d |q_d| |k_d| for D <= 256;
    asserted: 2^-10 of the row's largest such sum (softcap only shrinks a change), plus 1e-4
    for fp32 (about 0.007 for N(0, 1) inputs at D = 128, where a wrong tile is off by O(1))."""
    q, k = (t.transpose(1, 2).double().abs().cpu() for t in (q8, k8))
    group = q.shape[1] // k.shape[1]
    d = stack.double().cpu()[..., None, None]
    q, k = q * d[0].repeat_interleave(group, 1), (k * d[1]).repeat_interleave(group, 1)
    return 2**-10 * scale * torch.einsum("bhqd,bhkd->bhqk", q, k).amax(-1) + 1e-4


def dequantized_reference(q8, k8, v8, stack, causal, window, softcap, slopes=None,
                          sinks=None):
    """(ref, bound, ref_lse, lse_rounding) in fp64: attention of the dequantized inputs (with
    ALiBi's ``slopes`` [B, H] and ``sinks`` [H] where given) and the module docstring's bound
    on the kernel's error against it, [B, Lq, H, Dv]; its LSE and the most that l summing
    the rounded weights moves it, -ln(1 - e_i / l_i), [B, H, Lq]."""
    q, k, v = (t.transpose(1, 2).double() for t in (q8, k8, v8))
    group = q.shape[1] // k.shape[1]
    d = stack.double()[..., None, None]
    q, k, v = q * d[0].repeat_interleave(group, 1), k * d[1], v * d[2]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_len, k_len = q.shape[2], k.shape[2]
    diag = k_len - q_len
    left, right = window
    if causal:
        right = 0
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        distance = (torch.arange(q_len, device=s.device)[:, None] + diag -
                    torch.arange(k_len, device=s.device)[None, :]).abs()
        s = s - slopes.double()[..., None, None] * distance
    visible = reference.visible_keys(q_len, k_len, diag, (left, right)).to(s.device)
    s = s.masked_fill(~visible, -math.inf)
    row_max = s.amax(-1, keepdim=True)
    if sinks is not None:  # a score every row sees, with no value
        row_max = torch.maximum(row_max, sinks.double()[None, :, None, None])
    p = torch.exp(s - row_max).nan_to_num(0.0)  # row max 1
    l_i = p.sum(-1, keepdim=True)
    if sinks is not None:
        l_i = l_i + torch.exp(sinks.double()[None, :, None, None] - row_max)
    ref = (p @ v) / l_i.clamp(min=1e-300)
    # The FMA pipe's exp2 where the config the op launches takes it
    fma_err = (reference.EXP2_FMA_ERROR if _ops_fp8._config(q8, v8, right, k8.shape[1]).exp2_fma
               else 0.0)
    err_p = torch.maximum(p * (2.0**-4 + 2 * fma_err), 2.0**-18 + fma_err * p) * (p > 0)
    err_l = err_p.sum(-1, keepdim=True)
    bound = (1.1 * (err_p @ v.abs() + err_l * ref.abs()) / (l_i - err_l).clamp(min=0.5) +
             2.0**-8 * ref.abs() + 1e-4)
    # the tensor core's own accumulation of P V and of l (module docstring)
    bound = bound + 2 * 2.0**-13 * (k_len / 32) * ref.abs().amax(-1, keepdim=True)
    ref_lse = (row_max + torch.log(l_i))[..., 0]
    lse_rounding = -torch.log1p(-1.1 * err_l[..., 0] / l_i[..., 0].clamp(min=1.0))
    return ref.transpose(1, 2), bound.transpose(1, 2), ref_lse, lse_rounding


def bf16_reference(q, k, v, causal, window, softcap):
    """fp64 attention of the original inputs, [B, Lq, H, Dv]."""
    left, right = window
    out = reference.attention_dense(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                    diag_offset=k.shape[1] - q.shape[1],
                                    window=(left, 0 if causal else right), softcap=softcap)
    return out.transpose(1, 2)


def rmse(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


SHAPES = [  # (batch, q_len, k_len, heads, kv_heads, head_dim)
    (2, 128, 128, 4, 4, 64),
    (1, 1, 1, 2, 2, 64),
    (1, 17, 17, 4, 1, 128),
    (2, 113, 203, 4, 2, 128),
    (1, 203, 113, 2, 2, 256),
    (1, 1, 300, 8, 2, 128),
    (3, 512, 512, 4, 2, 256),
    (1, 1024, 1024, 4, 4, 128),
    (1, 64, 6200, 2, 2, 128),  # past FP8_SHORT_KEYS: D=128's long variant, row sum and FMA exp2
]
FEATURES = {
    "plain": dict(causal=False, window=(-1, -1), softcap=0.0),
    "causal": dict(causal=True, window=(-1, -1), softcap=0.0),
    "window": dict(causal=False, window=(40, 7), softcap=0.0),
    "causal-softcap": dict(causal=True, window=(-1, -1), softcap=20.0),
    # The switches FP8 shares with the bf16 body: ALiBi, and sinks (FP8 scales P by 2^8,
    # so a sink starts the row sum at 2^8).
    "causal-alibi": dict(causal=True, window=(-1, -1), softcap=0.0, alibi=True),
    "window-sinks": dict(causal=False, window=(40, 7), softcap=0.0, sinks=True),
}


@pytest.mark.parametrize("per", ["head", "tensor"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_forward_within_the_rounding_bound(shape, feature, per):
    batch, q_len, k_len, heads, kv_heads, d = shape
    f = FEATURES[feature]
    q = outlier_inputs(batch, q_len, heads, d, 1)
    k, v = (outlier_inputs(batch, k_len, kv_heads, d, s) for s in (2, 3))
    q8, k8, v8, descales, stack = quantized(q, k, v, per)
    gen = torch.Generator(device="cuda").manual_seed(9)
    slopes = (torch.rand(batch, heads, generator=gen, device="cuda") * 0.1
              if f.get("alibi") else None)
    sinks = torch.randn(heads, generator=gen, device="cuda") if f.get("sinks") else None
    out, lse = flash_tile.flash_attn_func(q8, k8, v8, causal=f["causal"],
                                          window_size=f["window"], softcap=f["softcap"],
                                          alibi_slopes=slopes, return_lse=True, sinks=sinks,
                                          **descales)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, q_len, heads, d)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, q_len)
    ref, bound, ref_lse, lse_rounding = dequantized_reference(
        q8, k8, v8, stack, f["causal"], f["window"], f["softcap"], slopes, sinks)
    err = (out.double() - ref).abs()
    assert not out.isnan().any()
    assert (err <= bound).all(), (err - bound).max().item()
    # The LSE is that of the dequantized scores (the descales are in the scale) and of the
    # rounded weights: against the reference's, the scores' error and the rounding's. Not
    # against the twin's: a weight that the kernel's fp32 score puts on the other side of
    # an e4m3 rounding tie from the twin's moves l by a step of e4m3 (2^-3 of the weight).
    twin_out, twin_lse = reference.attention_tiles(
        q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2),
        diag_offset=k_len - q_len, window=(f["window"][0], 0 if f["causal"] else
                                           f["window"][1]),
        softcap=f["softcap"], alibi_slopes=slopes, sinks=sinks, fp8_descale=stack)
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite()) and torch.equal(finite.cpu(), twin_lse.isfinite())
    lse_err = (lse.double() - ref_lse).abs()[finite]
    slack = (lse_bound(q8, k8, stack, d ** -0.5).to(lse.device) + lse_rounding)[finite]
    assert (lse_err <= slack).all(), (lse_err - slack).max().item()
    assert ((twin_out.transpose(1, 2) - ref.cpu()).abs() <= bound.cpu()).all()


@pytest.mark.parametrize("head_dim,v_head_dim", [(72, 40), (96, 128), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_head_dims_off_the_tiles_and_dv_not_d(head_dim, v_head_dim, causal):
    """Head dims that pad the e4m3 matmuls' tiles, and Dv != D (the tiles follow the larger;
    V^T is Dv rows of keys), against the dequantized inputs' attention within the rounding
    bound; GQA, Lq != Lk."""
    q = outlier_inputs(2, 77, 4, head_dim, 1)
    k = outlier_inputs(2, 99, 2, head_dim, 2)
    v = outlier_inputs(2, 99, 2, v_head_dim, 3)
    q8, k8, v8, descales, stack = quantized(q, k, v)
    out = flash_tile.flash_attn_func(q8, k8, v8, causal=causal, **descales)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 77, 4, v_head_dim)
    ref, bound, _, _ = dequantized_reference(q8, k8, v8, stack, causal, (-1, -1), 0.0)
    err = (out.double() - ref).abs()
    assert not out.isnan().any()
    assert (err <= bound).all(), (err - bound).max().item()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_rmse_against_the_bf16_inputs(head_dim, causal):
    """FA3's measure at L = 1024, 4 heads: RMSE <= 2.4e-2 against the original inputs,
    lower again with the Hadamard rotation of q and k."""
    q, k, v = (outlier_inputs(1, 1024, 4, head_dim, s) for s in (4, 5, 6))
    ref = bf16_reference(q, k, v, causal, (-1, -1), 0.0)
    q8, k8, v8, descales, _ = quantized(q, k, v)
    plain = rmse(flash_tile.flash_attn_func(q8, k8, v8, causal=causal, **descales), ref)
    qr, kr = flash_tile.hadamard_rotate(q.float(), k.float())
    q8, k8, v8, descales, _ = quantized(qr, kr, v)
    rotated = rmse(flash_tile.flash_attn_func(q8, k8, v8, causal=causal, **descales), ref)
    assert plain <= 2.4e-2
    assert rotated < plain


@pytest.mark.parametrize("sink", [None, 11.0])
def test_fp8_keeps_the_weights_far_below_the_max(sink):
    """``reference.peaked_inputs``: key 0 draws most of each row's weight and the other 2047
    keys about e^-8.6 of it each (38% together), with or without a sink at 11. The twin's
    relative errors against the dequantized inputs' attention are 4.4e-4 and 2.0e-2 with
    P scaled by 2^8, 0.19 and 0.26 without (tests/test_fp8.py). The kernel adds the tensor
    core's own accumulation (use_fast_acc: the small keys' tiles are added into an
    accumulator that key 0 dominates, at fewer mantissa bits than fp32): 2.9e-2 without the
    sink on an H200 (2026-12-05, tileiras 13.4, on the 128x256 tile this 2,048-key call took
    before 2026-12-07's short variant). Asserted: under 5e-2 plus the bf16
    output's 2^-9, which the unscaled rounding (0.19, 0.26) fails. The LSE: within
    ``lse_bound`` plus the most that l summing the rounded weights moves it."""
    q, k, v = reference.peaked_inputs(1, 64, 2048, 2, 128, seed=7, device="cuda")
    q8, k8, v8, descales, stack = quantized(q, k, v)
    sinks = None if sink is None else torch.full((2,), sink, device="cuda")
    out, lse = flash_tile.flash_attn_func(q8, k8, v8, sinks=sinks, return_lse=True,
                                          **descales)
    qd, kd, vd = (t.transpose(1, 2).double() * stack[i].double()[..., None, None]
                  for i, t in enumerate((q8, k8, v8)))
    ref, ref_lse = reference.attention_dense(qd, kd, vd, sinks=sinks, return_lse=True)
    ref, ref_lse = ref.cpu(), ref_lse.cpu()
    err = (out.transpose(1, 2).double().cpu() - ref).norm() / ref.norm()
    assert err < 5e-2 + 2**-9, err
    lse_err = (lse.double().cpu() - ref_lse).abs()
    rounding = -math.log1p(-1.1 * (2.0**-4 + 2048 * 2.0**-18))  # l >= 1: the max's weight
    assert (lse_err <= lse_bound(q8, k8, stack, q.shape[-1] ** -0.5) + rounding).all()


def test_fp8_packed_and_per_tensor_forms_agree():
    q, k, v = (outlier_inputs(2, 96, 4, 128, s) for s in (7, 8, 9))
    q8, k8, v8, descales, _ = quantized(q, k, v, "tensor")
    out = flash_tile.flash_attn_func(q8, k8, v8, causal=True, **descales)
    # The packed views have other strides (another specialisation of the same kernel): equal
    # up to the bf16 output's last bit.
    qkv = torch.stack([q8, k8, v8], 2)
    close = dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(flash_tile.flash_attn_qkvpacked_func(qkv, causal=True,
                                                                    **descales), out, **close)
    kv = torch.stack([k8, v8], 2)
    torch.testing.assert_close(flash_tile.flash_attn_kvpacked_func(q8, kv, causal=True,
                                                                   **descales), out, **close)
    # A one-element descale is the [B, H_kv] one filled with it.
    full = {n: t.reshape(()).expand(2, 4).contiguous() for n, t in descales.items()}
    assert torch.equal(flash_tile.flash_attn_func(q8, k8, v8, causal=True, **full), out)


def test_opcheck():
    """The FP8 ops' contract (no input changed, fake kernel, no autograd registered) with descale
    factors in every form the launcher passes: [B, H_kv], a stride-0 view of one factor."""
    q, k, v = (torch.randn(2, n, h, 64, device="cuda").to(E4M3).transpose(1, 2)
               for n, h in ((70, 4), (90, 2), (90, 2)))
    per_head = torch.rand(2, 2, device="cuda") + 0.5
    one = torch.tensor(0.5, device="cuda").expand(2, 2)
    opcheck_fp8(torch.ops.flash_tile.fp8_forward,
                (q, k, v, per_head, one, one, None, 0.125, 0.0, 20, -1, 0, True))
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], 64) for t in (q, k, v))
    cu_q, cu_k = (torch.tensor([0, 33, n], dtype=torch.int32, device="cuda") for n in (140, 180))
    opcheck_fp8(torch.ops.flash_tile.fp8_varlen_forward,
                (q, k, v, cu_q, cu_k, one, per_head, one, None, 0.125, 0.0, -1, 0, True))


@pytest.mark.parametrize("feature", ["causal", "window-softcap", "alibi-sinks", "seqused_k"])
def test_fp8_varlen_matches_each_sequence_alone(feature, monkeypatch):
    """Packed sequences of odd lengths (1, 17, 113, 203), GQA, a descale per sequence, crossed
    with the switches FP8 shares with the bf16 body: each sequence's output and LSE equal the
    dense forward of the sequence alone up to the bf16 output's last bit (the VARLEN switch's
    tiles differ in masking, not in arithmetic); with seqused_k, the dense call on the used
    keys alone."""
    # The dense calls take the varlen's tiles: alone, a short call runs a variant of its own,
    # which rounds P to e4m3 at other steps of the running maximum.
    monkeypatch.setattr(variants, "FP8_SHORT_KEYS", {True: 0, False: 0})
    lengths = [1, 17, 113, 203]
    heads, kv_heads, d = 4, 2, 128
    qs = [outlier_inputs(1, n, heads, d, 10 + i)[0] for i, n in enumerate(lengths)]
    ks = [outlier_inputs(1, n, kv_heads, d, 20 + i)[0] for i, n in enumerate(lengths)]
    vs = [outlier_inputs(1, n, kv_heads, d, 30 + i)[0] for i, n in enumerate(lengths)]
    q, k, v = (torch.cat(t) for t in (qs, ks, vs))
    q8, k8, v8 = (t.to(E4M3) for t in (q, k, v))
    descale = torch.rand(len(lengths), kv_heads, device="cuda") + 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    slopes = torch.rand(len(lengths), heads, generator=gen, device="cuda") * 0.1
    sinks = torch.randn(heads, generator=gen, device="cuda")
    used = [1, 9, 113, 150]
    features = {"causal": dict(causal=True),
                "window-softcap": dict(window_size=(40, 7), softcap=20.0),
                "alibi-sinks": dict(causal=True, sinks=sinks),
                "seqused_k": dict(causal=True)}[feature]
    extra = dict(seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda")) \
        if feature == "seqused_k" else {}
    out, lse = flash_tile.flash_attn_varlen_func(
        q8, k8, v8, cu, cu, max(lengths), max(lengths), q_descale=descale, k_descale=descale,
        v_descale=descale, return_lse=True,
        alibi_slopes=slopes if feature == "alibi-sinks" else None, **features, **extra)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        keys = slice(int(cu[b]), int(cu[b]) + (used[b] if extra else n))
        alone, alone_lse = flash_tile.flash_attn_func(
            q8[rows][None], k8[keys][None], v8[keys][None], q_descale=descale[b:b + 1],
            k_descale=descale[b:b + 1], v_descale=descale[b:b + 1], return_lse=True,
            alibi_slopes=slopes[b:b + 1] if feature == "alibi-sinks" else None, **features)
        torch.testing.assert_close(out[rows], alone[0], rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(lse[:, rows], alone_lse[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 17, 3, 128), (1, 113, 2, 96),
                                   (2, 1000, 2, 256), (1, 4096, 8, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["flash_attn", "contiguous", "packed"])
def test_keys_major_copy_is_v_transposed(shape, layout):
    """``_launch.keys_major`` (the copy kernel; its buffer starts as e4m3 NaN, tests/conftest.py)
    returns V^T bit for bit: flash-attn's [B, L, H, D] view, a contiguous [B, H, L, D] and a
    packed varlen [1, H, total, D] view, odd lengths and head dims."""
    batch, length, heads, dim = shape
    v = torch.randn(batch, length, heads, dim, device="cuda").to(E4M3)
    v4 = {"flash_attn": v.transpose(1, 2), "contiguous": v.transpose(1, 2).contiguous(),
          "packed": v.reshape(batch * length, heads, dim).transpose(0, 1)[None]}[layout]
    v_t = _launch.keys_major(v4)
    assert v_t.shape == v4.transpose(2, 3).shape and v_t.stride(2) % 16 == 0
    assert torch.equal(v_t.view(torch.uint8), v4.transpose(2, 3).view(torch.uint8))
