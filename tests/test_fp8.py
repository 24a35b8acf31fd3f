"""The FP8 forward on the CPU: its float64 twin against plain dequantized attention, the
quantize and Hadamard helpers, and every FP8 error raised before a launch."""

import math

import pytest
import torch

import flash_tile
from flash_tile import _launch, _ops_fp8, _validate, api, variants
from flash_tile.fp8 import E4M3_MAX, hadamard_matrix
from flash_tile.kernels._tiles import fp8_sum_mma
from flash_tile.kernels.attention_fwd import keys_major_copy, keys_major_copy_int64
from flash_tile.reference import (EXP2_FMA_ERROR, attention_dense, attention_tiles, exp2_fma,
                                  outlier_inputs, peaked_inputs, round_e4m3, visible_keys)

E4M3 = torch.float8_e4m3fn


def _quantized(q, k, v, per="head", rotate=False):
    """(q8, k8, v8 as [B, H, L, D] views, descale [3, B, H_kv]: the reference's stack of the
    q, k and v factors) of [B, L, H, D] inputs."""
    if rotate:
        q, k = flash_tile.hadamard_rotate(q.float(), k.float())
    batch, kv_heads = k.shape[0], k.shape[2]
    q8, qd = flash_tile.quantize_fp8(q, per, kv_heads=kv_heads if per == "head" else None)
    k8, kd = flash_tile.quantize_fp8(k, per)
    v8, vd = flash_tile.quantize_fp8(v, per)
    descale = torch.stack(_validate.fp8_descales(batch, kv_heads, torch.device("cpu"),
                                                 q_descale=qd, k_descale=kd, v_descale=vd))
    return (*(t.transpose(1, 2) for t in (q8, k8, v8)), descale)


def _dequantized(q8, k8, v8, descale):
    """float64 d * x8 of [B, H, L, D] e4m3 views, each query head with its group's factor."""
    group = q8.shape[1] // k8.shape[1]
    d = descale.double()[..., None, None]
    return (q8.double() * d[0].repeat_interleave(group, 1), k8.double() * d[1],
            v8.double() * d[2])


CASES = {
    "plain": dict(q_len=100, k_len=100),
    "causal-lq<lk": dict(q_len=37, k_len=130, window=(-1, 0)),
    "window-gqa": dict(q_len=90, k_len=90, window=(20, 5), heads=4, kv_heads=2),
    "softcap-mqa": dict(q_len=50, k_len=70, softcap=15.0, heads=4, kv_heads=1),
    "one-key": dict(q_len=17, k_len=1),
    "long": dict(q_len=20, k_len=600),  # unmasked 256-key steps: SUM_MMA's, EXP2_FMA's
}


def test_exp2_fma_within_its_error():
    """The FMA pipe's exp2 as the twin forms it: within EXP2_FMA_ERROR of 2**x (relative) from
    x = -126 to 8 (FP8's scaled P), at the half-integers where the rounding turns too; below
    -126 it gives 2**-126 at most (0 once P rounds to e4m3, whose least is 2**-9)."""
    x = torch.cat([torch.linspace(-126.0, 8.0, 200_001, dtype=torch.float64),
                   torch.arange(-125.5, 8.0, 1.0, dtype=torch.float64)])
    rel = (exp2_fma(x) / torch.exp2(x) - 1).abs()
    assert rel.max() <= EXP2_FMA_ERROR and rel.max() > EXP2_FMA_ERROR / 2
    low = exp2_fma(torch.tensor([-200.0, -127.0, -math.inf], dtype=torch.float64))
    assert (low <= 2.0**-125).all() and (round_e4m3(low) == 0).all()


@pytest.mark.parametrize("tile_n,exp2_fma", [(64, 0), (256, 0), (256, 4), (64, 2)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_twin_is_dequantized_attention_within_the_rounding_of_p(name, tile_n, exp2_fma):
    """The twin (the kernel's tiles, P rounded to e4m3) against softmax(S) V of the
    dequantized inputs: P, scaled by 2^8 into [0, 256], rounds with a relative error of at
    most 2^-4 where it is normal (p >= 2^-14 of its row's max) and an absolute one of at most
    2^-18 of the max below; under ``exp2_fma`` the last columns of the unmasked steps take the
    FMA pipe's exp2 first (``_tiles.exp2_fma``, relative error at most e = EXP2_FMA_ERROR; e =
    0 without), so each weight is off by at most max((2^-4 + 2 e) p_ij, 2^-18 + e p_ij) once
    rounded and by e p_ij before. Where l sums the unrounded P, |o_i - o_ref_i| <= sum_j
    max(..) (|v_j| + |o_ref_i|) / (l_i - sum_j max(..)), and the LSE is off by at most
    -ln(1 - e). On 256-key steps without a window (the kernel's SUM_MMA) l sums the rounded P
    as P V does: o_i is the average of v under the rounded weights, so with e_ij the rounding
    error, o_i - o_ref_i = sum_j e_ij (v_j - o_ref_i) / (l_i + sum_j e_ij) and |o_i - o_ref_i|
    <= sum_j max(..) (|v_j| + |o_ref_i|) / (l_i - sum_j max(..)); the LSE, ln of l_i, is then
    off by at most -ln(1 - sum_j max(..) / l_i). The twin must also differ from the reference
    (the rounding is there) but for one key, and on the long case's unmasked steps exp2_fma
    must change it."""
    case = dict(heads=2, kv_heads=2, window=(-1, -1), softcap=0.0) | CASES[name]
    batch, d = 2, 64
    q = outlier_inputs(batch, case["q_len"], case["heads"], d, 1)
    k, v = (outlier_inputs(batch, case["k_len"], case["kv_heads"], d, s) for s in (2, 3))
    q8, k8, v8, descale = _quantized(q, k, v)
    diag = case["k_len"] - case["q_len"]
    out, lse = attention_tiles(q8, k8, v8, diag_offset=diag, window=case["window"],
                               softcap=case["softcap"], fp8_descale=descale, tile_n=tile_n,
                               exp2_fma=exp2_fma)
    if exp2_fma and name == "long":
        plain, _ = attention_tiles(q8, k8, v8, diag_offset=diag, window=case["window"],
                                   softcap=case["softcap"], fp8_descale=descale,
                                   tile_n=tile_n)
        assert not torch.equal(out, plain)
    qd, kd, vd = _dequantized(q8, k8, v8, descale)
    ref, ref_lse = attention_dense(qd, kd, vd, diag_offset=diag, window=case["window"],
                                   softcap=case["softcap"], return_lse=True)
    # The reference's P with each row's max at 1 (the kernel's P is relative to its running
    # max, which only shrinks it: alpha <= 1 scales its rounding error down too).
    group = case["heads"] // case["kv_heads"]
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    scores = qd @ kr.transpose(-1, -2) / math.sqrt(d)
    if case["softcap"]:
        scores = case["softcap"] * torch.tanh(scores / case["softcap"])
    scores = scores.masked_fill(~visible_keys(case["q_len"], case["k_len"], diag,
                                              case["window"]), -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).nan_to_num(0.0)
    fma_err = EXP2_FMA_ERROR if exp2_fma else 0.0
    err_p = torch.maximum(p * (2.0**-4 + 2 * fma_err), 2.0**-18 + fma_err * p) * (p > 0)
    err_l = err_p.sum(-1, keepdim=True)
    bound = (err_p @ vr.abs() + err_l * ref.abs()) / (p.sum(-1, keepdim=True) - err_l)
    err = (out - ref).abs()
    assert (err <= bound + 1e-12).all(), (err - bound).max()
    # One key: P = 2^8, exact in e4m3 (float64's last bits only).
    assert (err.max() > 1e-9) == (case["k_len"] > 1)
    lse_err = (lse - ref_lse).abs()
    if fp8_sum_mma(tile_n, max(case["window"]) >= 0):  # ln of the rounded sum
        lse_bound = -torch.log1p(-err_l[..., 0] / p.sum(-1))
        assert (lse_err <= lse_bound + 1e-12).all(), (lse_err - lse_bound).max()
        assert (lse_err.max() > 1e-9) == (case["k_len"] > 1)
    else:
        assert (lse_err <= -math.log1p(-fma_err) + 1e-12).all(), lse_err.max()


@pytest.mark.parametrize("per", ["head", "tensor"])
def test_twin_meets_fa3_rmse_targets(per):
    """Issue 26's targets, on the twin (the kernel's rounding, simulated), at L = 1024, 4
    heads, D = 128, four draws: RMSE of the output against fp64 attention of the original
    bf16 inputs <= 2.4e-2 plain (FA3's baseline FP8) on every draw, and <= 1.0e-2 with the
    Hadamard rotation of q and k on average, below plain on every draw. Measured: 1.2-1.6e-2
    plain, 0.75-1.06e-2 rotated: the rotation cannot reach v's quantization error (an outlier
    of v sets its head's scale), so single draws land either side of 1.0e-2."""
    rotated = []
    for seed in range(4):
        q, k, v = (outlier_inputs(1, 1024, 4, 128, 10 * seed + s) for s in (4, 5, 6))
        ref = attention_dense(*(t.double().transpose(1, 2) for t in (q, k, v)))
        rmse = []
        for rotate in (False, True):
            q8, k8, v8, descale = _quantized(q, k, v, per, rotate)
            out, _ = attention_tiles(q8, k8, v8, fp8_descale=descale, tile_m=128, tile_n=128)
            rmse.append((out - ref).pow(2).mean().sqrt().item())
        assert rmse[0] <= 2.4e-2 and rmse[1] < rmse[0]
        rotated.append(rmse[1])
    assert sum(rotated) / len(rotated) <= 1.0e-2


def test_round_e4m3_grid():
    values = torch.tensor([1.0, 1.0625, 1.1875, 0.5 + 2**-5, 2.0**-9, 2.0**-11, 0.0],
                          dtype=torch.float64)
    # 1.0625 is halfway between 1 and 1.125: ties to even (1); 2^-11 is below half the
    # smallest subnormal (2^-9) and flushes to 0.
    assert round_e4m3(values).tolist() == [1.0, 1.0, 1.25, 0.5, 2.0**-9, 0.0, 0.0]


@pytest.mark.parametrize("per,kv_heads", [("head", None), ("head", 2), ("tensor", None)])
def test_quantize_round_trip(per, kv_heads):
    x = outlier_inputs(2, 33, 4, 64, 7).float()
    x8, descale = flash_tile.quantize_fp8(x, per, kv_heads=kv_heads)
    assert x8.dtype == E4M3 and descale.dtype == torch.float32
    shape = {"tensor": (), "head": (2, kv_heads or 4)}[per]
    assert tuple(descale.shape) == shape
    scale = descale if per == "tensor" else descale.repeat_interleave(
        4 // shape[1], 1)[:, None, :, None]
    back = x8.float() * scale
    # e4m3: relative error <= 2^-4 for normals (|x| / scale >= 2^-6), absolute
    # 2^-10 * scale below; the group's largest magnitude maps to 448 exactly.
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, 2**-10 * scale)).all()
    assert x8.float().abs().amax() == E4M3_MAX


def test_quantize_zero_group_and_errors():
    x = torch.zeros(1, 4, 2, 16)
    x[:, :, 1] = 3.0
    x8, descale = flash_tile.quantize_fp8(x)
    assert descale[0, 0] == 1.0 and (x8[:, :, 0].float() == 0).all()
    assert (x8[:, :, 1].float() * descale[0, 1] == 3.0).all()
    with pytest.raises(ValueError, match="head_dim"):
        flash_tile.quantize_fp8(x[0])
    with pytest.raises(ValueError, match="per"):
        flash_tile.quantize_fp8(x, per="row")
    with pytest.raises(ValueError, match="kv_heads"):
        flash_tile.quantize_fp8(torch.zeros(1, 4, 3, 16), kv_heads=2)
    with pytest.raises(ValueError, match="one factor"):  # no groups to share a tensor's
        flash_tile.quantize_fp8(x, per="tensor", kv_heads=1)
    with pytest.raises(ValueError, match="elements"):
        flash_tile.quantize_fp8(torch.zeros(1, 0, 2, 16))


def test_quantize_edge_groups():
    """Head 0 holds a NaN, head 1 an inf, head 2 magnitudes of 1e-44 (float32 subnormals),
    head 3 ordinary values; the input requires grad, as a model's activations do. The NaN
    and the inf reach their factors (not hidden behind a factor of 1), the tiny group gets a
    positive factor, the ordinary one its amax / 448; nothing requires grad, so that an FP8
    call (which refuses inputs needing a gradient) takes the outputs as they are."""
    x = torch.randn(1, 8, 4, 16)
    x[0, 3, 0, 5], x[0, 2, 1, 7] = math.nan, math.inf
    x[:, :, 2] = 1e-44
    x.requires_grad_()
    x8, descale = flash_tile.quantize_fp8(x)
    assert descale[0, 0].isnan() and descale[0, 1].isinf()
    assert descale[0, 2] == torch.finfo(torch.float32).tiny
    assert descale[0, 3] == x[:, :, 3].detach().abs().amax() / E4M3_MAX
    assert not x8.requires_grad and not descale.requires_grad


def test_hadamard_is_orthonormal_and_keeps_scores():
    h = hadamard_matrix(128, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    q, k = outlier_inputs(1, 40, 2, 128, 8).float(), outlier_inputs(1, 50, 2, 128, 9).float()
    qr, kr = flash_tile.hadamard_rotate(q, k)
    scores = torch.einsum("bihd,bjhd->bhij", q, k)
    assert torch.allclose(torch.einsum("bihd,bjhd->bhij", qr, kr), scores, atol=1e-3)
    back, _ = flash_tile.hadamard_rotate(qr, kr)  # H H = I: rotating twice gives q back
    assert torch.allclose(back, q, atol=1e-5)
    # An outlier spreads over the head dim: the largest magnitude per head drops.
    assert qr.abs().amax() < q.abs().amax() / 2
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(96)


# Errors: all raised before anything launches.

@pytest.fixture
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("the kernel was reached before validation rejected the input")

    monkeypatch.setattr(api, "attention_forward", launched)
    monkeypatch.setattr(api, "fp8_attention", launched)


def _fp8(batch=2, length=16, heads=4, head_dim=64):
    return torch.randn(batch, length, heads, head_dim).to(E4M3)


def test_fp8_dtype_mixes(no_launch):
    q = _fp8()
    with pytest.raises(ValueError, match="all be torch.float8_e4m3fn"):
        flash_tile.flash_attn_func(q, q, q.bfloat16())
    with pytest.raises(ValueError, match="takes torch.float8_e4m3fn"):
        flash_tile.flash_attn_func(q, q, q.to(torch.float8_e5m2))
    bf = q.bfloat16()
    with pytest.raises(ValueError, match="v_descale: descale factors apply"):
        flash_tile.flash_attn_func(bf, bf, bf, v_descale=torch.ones(2, 4))


@pytest.fixture
def hopper(monkeypatch, no_launch):
    """CPU tensors pass the device checks as a GPU of ``capability`` (settable)."""
    state = {"capability": (9, 0)}
    monkeypatch.setattr(_validate, "check_device", lambda *t: torch.device("cpu"))
    monkeypatch.setattr(_validate, "device_properties",
                        lambda device: (state["capability"], "a test GPU"))
    return state


@pytest.mark.parametrize("capability", [(8, 9), (8, 0)])
def test_fp8_needs_sm90(hopper, capability):
    hopper["capability"] = capability
    q = _fp8()
    with pytest.raises(RuntimeError, match="9.0 or newer.*sm_89"):
        flash_tile.flash_attn_func(q, q, q)


def test_fp8_has_no_backward_nor_dropout(hopper):
    q = _fp8()
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_tile.flash_attn_func(q.clone().requires_grad_(), q, q)
    with pytest.raises(NotImplementedError, match="no dropout"):
        flash_tile.flash_attn_func(q, q, q, dropout_p=0.1)
    qkv = torch.randn(2, 16, 3, 4, 64).to(E4M3)
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_tile.flash_attn_qkvpacked_func(qkv.requires_grad_())


def test_fp8_descale_checks(hopper):
    q, k = _fp8(), _fp8(heads=2)
    with pytest.raises(ValueError, match=r"q_descale must have shape \[2, 2\]"):
        flash_tile.flash_attn_func(q, k, k, q_descale=torch.ones(2, 4))
    with pytest.raises(ValueError, match="k_descale must be a float32 tensor"):
        flash_tile.flash_attn_func(q, k, k, k_descale=torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_descale must be a float32 tensor"):
        flash_tile.flash_attn_func(q, k, k, k_descale=0.5)
    per_head = torch.rand(2, 2) + 0.5
    views = _validate.fp8_descales(2, 2, torch.device("cpu"), q_descale=torch.tensor(2.0),
                                   k_descale=None, v_descale=torch.full((1,), 3.0))
    assert [(t.shape, t.stride()) for t in views] == [((2, 2), (0, 0))] * 3  # nothing copied
    assert [t[1, 1].item() for t in views] == [2.0, 1.0, 3.0]
    views = _validate.fp8_descales(2, 2, torch.device("cpu"), q_descale=per_head,
                                   k_descale=None, v_descale=None)
    assert views[0] is per_head
    with pytest.raises(ValueError, match="must be on meta"):
        _validate.fp8_descales(2, 2, torch.device("meta"), q_descale=torch.ones(2, 2))


def test_fp8_varlen_checks(hopper):
    q = torch.randn(30, 4, 64).to(E4M3)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="9.0 or newer"):
        hopper["capability"] = (8, 9)
        flash_tile.flash_attn_varlen_func(q, q, q, cu, cu, 20, 20)


# The launch: arguments against the AOT signature, V copied keys-major.

@pytest.mark.parametrize("big", [False, True])
def test_keys_major_takes_the_64_bit_copy_for_big_arrays(monkeypatch, big):
    """V^T's copy launches the 64-bit-index entry point where an offset reaches 2**31 (one
    [Dv, 128] tile of the 304 padded keys a program)."""
    calls = []
    monkeypatch.setattr(_launch, "launch_on", lambda device, grid, kernel, args:
                        calls.append((grid, kernel)))
    monkeypatch.setattr(_launch, "needs_int64_index", lambda *tensors: big)
    v = torch.randn(2, 3, 300, 64).to(E4M3)
    v_t = _launch.keys_major(v)
    assert v_t.shape == (2, 3, 64, 300) and v_t.stride(2) == 304
    assert calls == [((3, 3, 2), keys_major_copy_int64 if big else keys_major_copy)]


def test_fp8_config_takes_the_short_variant_on_short_dense_calls_only():
    """sm_90 D=128: a call of at most FP8_SHORT_KEYS[causal] keys runs 64x128 o2, past that
    (or with the length unknown, as varlen) 128x256, with the FMA exp2 without a diagonal;
    other head dims and architectures keep their variant whatever the length."""
    short, limit = variants.SM90_FP8_NARROW, variants.FP8_SHORT_KEYS
    for causal, long in ((True, variants.SM90_FP8_CAUSAL), (False, variants.SM90_FP8)):
        assert variants.fp8_config((9, 0), 128, causal, 1) == short
        assert variants.fp8_config((9, 0), 100, causal, limit[causal]) == short
        for key_len in (limit[causal] + 1, None):
            assert variants.fp8_config((9, 0), 128, causal, key_len) == long
        # (D <= 64's default is the short variant already)
        assert (variants.fp8_config((9, 0), 256, causal, 64)
                == variants.fp8_config((9, 0), 256, causal) == variants.SM90_TWO_GROUPS)
        for capability in ((10, 0), (12, 0)):
            assert (variants.fp8_config(capability, 128, causal, 64)
                    == variants.default_config(capability, 128))
    assert limit[True] > limit[False]  # a diagonal masks more of a wide tile's work
    assert (short.tile_m, short.tile_n, short.occupancy, short.exp2_fma) == (64, 128, 2, 0)


@pytest.mark.parametrize("short_keys", [50, 49])
@pytest.mark.parametrize("right", [0, -1])
@pytest.mark.parametrize("varlen", [False, True])
def test_fp8_launch_matches_the_compiled_signature(monkeypatch, varlen, right, short_keys):
    """The FP8 ops' launch against the signature aot compiles, with the config of the call's
    kind: sm_90 D=128 takes exp2 on the FMA pipe without a diagonal alone, and a short dense
    call the short variant: with FP8_SHORT_KEYS at 50 and at 49 only the key axis's length
    (50; the other axes 2, 2 and 128) takes the dense call to it and past it."""
    from contextlib import nullcontext

    from flash_tile import aot
    calls = []
    monkeypatch.setattr(_launch.ct, "launch",
                        lambda stream, grid, kernel, args: calls.append((grid, kernel, args)))
    monkeypatch.setattr(_launch, "current_stream", lambda device: None)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda device: nullcontext())
    monkeypatch.setattr(_ops_fp8, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(variants, "FP8_SHORT_KEYS", {True: short_keys, False: short_keys})
    descales = tuple(torch.rand(2, 2) for _ in range(3))
    if varlen:
        q, k, v = torch.randn(40, 4, 128).to(E4M3), *(torch.randn(50, 2, 128).to(E4M3)
                                                       for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, 15, n], dtype=torch.int32) for n in (40, 50))
        out, lse = _ops_fp8._fp8_varlen_impl(q, k, v, cu_q, cu_k, *descales, None, 0.1, 0.0,
                                             -1, right, True)
        v4 = v.transpose(0, 1)[None]
    else:
        q = torch.randn(2, 4, 40, 128).to(E4M3)
        k, v = (torch.randn(2, 2, 50, 128).to(E4M3) for _ in range(2))
        out, lse = _ops_fp8._fp8_forward_impl(q, k, v, *descales, None, 0.1, 0.0, 10, -1,
                                              right, True)
        v4 = v
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    (copy_grid, copy_kernel, copy_args), (_, _, args) = calls
    # First V^T: the copy kernel writes the whole padded buffer the forward reads a view of.
    v_in, v_buffer, *copy_constants = copy_args
    assert copy_kernel is keys_major_copy and v_in.data_ptr() == v4.data_ptr()
    assert v_in.shape == v4.shape and v_in.stride() == v4.stride()
    assert v_buffer.shape == (*v4.shape[:2], 128, 64) and v_buffer.is_contiguous()
    assert copy_grid == (1, v4.shape[1], v4.shape[0])  # 64 padded keys: one 128-key tile
    copy_params = aot.keys_major_signature(128, 50).parameters
    assert copy_constants == [p.value for p in copy_params[2:]]
    for arg, param in zip((v_in, v_buffer), copy_params[:2]):
        assert arg.dim() == param.ndim and str(arg.dtype).endswith(param.dtype.name)
    v_t = args[2]
    assert v_t.shape == v4.transpose(2, 3).shape and v_t.stride(-1) == 1
    assert v_t.stride(2) % 16 == 0 and v_t.data_ptr() == v_buffer.data_ptr()
    # A dense call of 50 keys at most FP8_SHORT_KEYS runs 64x128 (no FMA exp2); past it, and
    # varlen (no longest key length), 128x256, with the FMA exp2 without a diagonal.
    short = not varlen and short_keys >= 50
    config = variants.fp8_config((9, 0), 128, causal=right >= 0,
                                 key_len=None if varlen else 50)
    assert config.tile_n == (128 if short else 256)
    # The q, k and v descales, FP8 and the config's EXP2_FMA (then PAGED, PAGE_N, GATHER,
    # PAGE_AHEAD: off)
    assert args[11:14] == descales
    assert args[-6:] == (True, 4 if not short and right < 0 else 0, False, 0, False, False)
    sig = aot.forward_signature("bfloat16", 128, 128, (-1, right), False, False, None, False,
                                True, config, varlen=varlen, fp8=True)
    params = sig.parameters
    assert len(args) == len(params)
    dtypes = {0: "float8_e4m3fn", 1: "float8_e4m3fn", 2: "float8_e4m3fn", 3: "bfloat16",
              11: "float32", 12: "float32", 13: "float32"}
    for i, name in dtypes.items():
        assert params[i].dtype.name == name and str(args[i].dtype).endswith(name), i
    for i, (arg, param) in enumerate(zip(args, params)):
        if type(param).__name__ == "ArrayConstraint":
            assert arg.dim() == param.ndim, i
        elif type(param).__name__ != "ScalarConstraint":
            assert arg == param.value, (i, arg, param.value)
    assert math.isclose(args[len(_launch.FORWARD_ARRAYS)], 0.1, rel_tol=1e-6)  # the scale


@pytest.mark.parametrize("exp2_fma", [0, 4])
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("sink", [None, 11.0])
def test_twin_keeps_the_weights_far_below_the_max(sink, tile_n, exp2_fma):
    """Key 0 draws most of each row's weight, the other 2047 keys about e^-8.6 of it each
    (together 38%; values of mean 1, so that lost weight shows), with or without a sink at
    11, about 1 above key 0. Those weights are under e4m3's smallest 2^-9: P in [0, 1]
    rounded them to 0 (relative error of the output 0.19, 0.26 with the sink), P scaled by
    2^8 keeps them (4.4e-4 and 2.0e-2 measured: under the sink they sit near 2^-6 of the
    scaled max, where e4m3's steps are 2^-4 of a weight; 3.5e-4 and 1.7e-2 with l summing
    the rounded P, as on 256-key steps, whose LSE is then within the rounding's bound)."""
    q, k, v = peaked_inputs(1, 64, 2048, 2, 128, seed=7)
    q8, k8, v8, descale = _quantized(q, k, v)
    sinks = None if sink is None else torch.full((2,), sink)
    out, lse = attention_tiles(q8, k8, v8, fp8_descale=descale, sinks=sinks, tile_m=128,
                               tile_n=tile_n, exp2_fma=exp2_fma)
    ref, ref_lse = attention_dense(*_dequantized(q8, k8, v8, descale), sinks=sinks,
                                   return_lse=True)
    assert (out - ref).norm() / ref.norm() < (1e-2 if sink is None else 5e-2)
    fma_err = EXP2_FMA_ERROR if exp2_fma else 0.0
    if not fp8_sum_mma(tile_n, False):  # l sums the weights unrounded: exact but for the FMA
        # pipe's share (measured 3.6e-5 with a quarter, 2026-12-07)
        assert ((lse - ref_lse).abs() <= -math.log1p(-fma_err) + 1e-12).all()
    else:  # l sums the rounded weights: 2^-4 (+ 2 e) of each, 2^-18 of the max (measured
        # 1.4e-3 and 6.2e-3, 2026-12-05)
        assert ((lse - ref_lse).abs() <=
                -math.log1p(-2.0**-4 - 2 * fma_err - 2048 * 2.0**-18)).all()


def test_bench_fp8_targets_count_unmeasured_rows(monkeypatch):
    """bench_fp8's verdicts on the committed H200 results' rows, the target rows' FP8 rates
    set here (900 TFLOP/s: both missed), then one of them at 2,000 and the other's FP8
    measurement gone (a failed check): that row is counted and not met, never dropped."""
    import json
    import pathlib

    bench = pathlib.Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))
    import bench_fp8

    rows = json.loads((bench / "results" / "fp8-h200.json").read_text())["rows"]
    named = next(r for r in rows if r["head_dim"] == 128 and r["seqlen"] == 4096 and
                 not r["causal"])
    other = next(r for r in rows if r is not named and r["head_dim"] == 128 and
                 r["seqlen"] > 4096 and not r["causal"])
    for row in (named, other):
        row["tflops"] = dict(row["tflops"], flash_tile_fp8=900.0)
    text = bench_fp8.targets(rows)
    assert "D=128, L >= 4k, non-causal: NOT met: 0 of 2 rows meet it" in text
    named["tflops"] = dict(named["tflops"], flash_tile_fp8=2000.0)
    other["tflops"] = dict(other["tflops"], flash_tile_fp8=None)
    text = bench_fp8.targets(rows)
    assert "non-causal: NOT met: 1 of 2 rows meet it, 1 not measured" in text


def test_bench_fp8_rmse_against_the_dequantized_inputs(monkeypatch):
    """bench_fp8's second reference (FA3's Table 3 reports both): 0 for exact attention of
    the dequantized inputs, and the quantization's error for attention of the originals, on
    the checked rows (the first and last 128 of 300)."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    import bench_fp8

    q, k, v = (outlier_inputs(1, 300, 2, 64, s) for s in range(3))
    pairs = [flash_tile.quantize_fp8(t) for t in (q, k, v)]
    dequantized = [t8.double() * d.double()[:, None, :, None] for t8, d in pairs]

    def attend(*inputs):
        return attention_dense(*(t.double().transpose(1, 2) for t in inputs),
                               window=(-1, 0)).transpose(1, 2)

    assert bench_fp8.rmse_dequantized(attend(*dequantized), dequantized, True) == 0.0
    assert 1e-3 < bench_fp8.rmse_dequantized(attend(q, k, v), dequantized, True) < 5e-2

