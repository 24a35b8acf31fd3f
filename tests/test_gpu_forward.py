"""The forward on a GPU against an fp32 reference, with flash-attn's tolerance rule.

The rule (``flash_tile.reference.check_error``): the kernel's max error against the fp32
reference is at most twice the max error of PyTorch's own computation in the input dtype
against the same reference, plus a floor of the dtype's rounding at the output's magnitude.
Inputs are fresh random values each call; outputs launched directly are poisoned with NaN
first, so an element the kernel skips fails.
"""

import math

import pytest
import torch

import flash_tile
from flash_tile import _launch, autotune, variants
from flash_tile.reference import attention_dense, check_error, visible_keys

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
# (batch, heads, kv_heads, Lq, Lk, head_dim, v_head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 64, 64),
    (2, 3, 3, 17, 17, 64, 64),
    (1, 2, 2, 113, 203, 128, 128),
    (2, 2, 2, 203, 113, 128, 128),
    (1, 2, 2, 1, 203, 64, 64),
    (1, 2, 2, 203, 1, 128, 128),
    (3, 2, 2, 64, 64, 128, 128),
    (1, 4, 4, 1023, 1024, 64, 64),
    (1, 2, 2, 1024, 1023, 128, 128),
    (2, 4, 4, 512, 512, 128, 128),
]
IDS = ["x".join(map(str, s)) for s in SHAPES]


def _randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _qkv(shape, dtype, layout="bhld"):
    """Fresh q, k, v for a SHAPES entry in torch's [B, H, L, D] or flash-attn's [B, L, H, D]."""
    batch, heads, kv_heads, q_len, k_len, head_dim, v_head_dim = shape
    dims = [(heads, q_len, head_dim), (kv_heads, k_len, head_dim), (kv_heads, k_len, v_head_dim)]
    if layout == "bhld":
        return tuple(_randn(batch, h, n, d, dtype=dtype) for h, n, d in dims)
    return tuple(_randn(batch, n, h, d, dtype=dtype) for h, n, d in dims)


def _check(out, out_ref, out_pt, what=""):
    report = check_error(out, out_ref, out_pt)
    assert report["ok"], f"{what}: {report}"


def _references(q, k, v, scale=None, offset=0, window=(-1, -1), softcap=0.0, slopes=None):
    """(fp32 reference, PyTorch in the input dtype) for [B, H, L, D] inputs."""
    ref = attention_dense(q.float(), k.float(), v.float(), scale, offset, window, softcap, slopes)
    pt = attention_dense(q, k, v, scale, offset, window, softcap, slopes)
    return ref, pt


def _lse_reference(q, k, scale, offset, window):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    visible = visible_keys(q.shape[2], k.shape[2], offset, window).cuda()
    lse = torch.logsumexp(s.masked_fill(~visible, -math.inf), dim=-1)
    return torch.where(lse == -math.inf, math.inf, lse)  # rows that see no key: +inf


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_launch_writes_every_element(shape, causal, dtype):
    """The kernel launched directly into NaN-poisoned outputs, LSE included."""
    batch, heads, _, q_len, k_len, head_dim, v_head_dim = shape
    q, k, v = _qkv(shape, dtype)
    out = torch.full((batch, heads, q_len, v_head_dim), math.nan, device="cuda", dtype=dtype)
    lse = torch.full((batch, heads, q_len), math.nan, device="cuda")
    scale, offset = 1.0 / math.sqrt(head_dim), k_len - q_len
    window = (-1, 0) if causal else (-1, -1)
    config = variants.default_config(torch.cuda.get_device_capability(), head_dim)
    _launch.launch_forward(q, k, v, out, lse, None, None, scale, 0.0, offset, window, config)

    _check(out, *_references(q, k, v, scale, offset, window), "out")
    assert not lse.isnan().any()
    torch.testing.assert_close(lse, _lse_reference(q, k, scale, offset, window),
                               rtol=1e-4, atol=1e-4)


# flash_attn_func features: (shape, causal, window, softcap, alibi).
FEATURES = [
    ((2, 8, 2, 203, 203, 64, 64), True, (-1, -1), 0.0, False),     # GQA 4, causal
    ((1, 8, 1, 113, 250, 128, 128), False, (-1, -1), 0.0, False),  # MQA, Lq != Lk
    ((1, 4, 2, 300, 300, 64, 64), True, (64, -1), 0.0, False),     # causal sliding window
    ((1, 2, 2, 256, 333, 128, 128), False, (40, 17), 0.0, False),  # two-sided window
    ((2, 2, 2, 150, 100, 64, 64), False, (0, 0), 0.0, False),      # rows with no key at all
    ((1, 4, 4, 257, 257, 128, 128), True, (-1, -1), 30.0, False),  # softcap (Gemma)
    ((2, 4, 4, 130, 190, 64, 64), True, (-1, -1), 0.0, True),      # ALiBi causal
    ((1, 4, 2, 190, 130, 64, 64), False, (-1, -1), 0.0, True),     # ALiBi non-causal, GQA
    ((1, 2, 2, 77, 99, 72, 40), False, (-1, -1), 0.0, False),      # Dv != D, odd dims
    ((1, 2, 1, 129, 129, 256, 256), True, (128, -1), 50.0, True),  # everything at D=256
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FEATURES, ids=[f"case{i}" for i in range(len(FEATURES))])
def test_flash_attn_features(case, dtype):
    shape, causal, window, softcap, alibi = case
    batch, heads, _, q_len, k_len, head_dim, v_head_dim = shape
    q, k, v = _qkv(shape, dtype, layout="blhd")
    slopes = torch.rand(batch, heads, device="cuda") * 0.2 if alibi else None
    out, lse = flash_tile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                          softcap=softcap, alibi_slopes=slopes, return_lse=True)
    assert out.shape == (batch, q_len, heads, v_head_dim) and out.dtype == dtype
    assert lse.shape == (batch, heads, q_len) and not lse.isnan().any()

    eff_window = (window[0], 0) if causal else window
    bhld = [t.transpose(1, 2) for t in (q, k, v)]
    ref, pt = _references(*bhld, 1.0 / math.sqrt(head_dim), k_len - q_len, eff_window, softcap,
                          slopes)
    _check(out.transpose(1, 2), ref, pt, f"flash_attn_func {case}")
    # The LSE in fp32 against the fp32 reference's (+inf on both sides where no key is seen);
    # softcap's tanh and ALiBi's bias take part in it too.
    _, lse_ref = attention_dense(*(t.float() for t in bhld), 1.0 / math.sqrt(head_dim),
                                 k_len - q_len, eff_window, softcap, slopes, return_lse=True)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_return_attn_probs_is_flash_attn_2s_triple(grad):
    """flash-attn 2's (out, softmax_lse, S_dmask) without dropout: the output and LSE of a
    ``return_lse`` call (the same launch: bitwise equal), S_dmask empty; gradients flow
    through the output and the LSE as ``return_lse``'s do (a planned inference call too)."""
    shape = (2, 4, 2, 113, 203, 64, 64)
    q, k, v = (t.requires_grad_(grad) for t in _qkv(shape, torch.bfloat16, layout="blhd"))
    for _ in range(2):  # the second inference call runs its plan
        out, lse, s_dmask = flash_tile.flash_attn_func(q, k, v, causal=True,
                                                       return_attn_probs=True)
        ref_out, ref_lse = flash_tile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
    bhld = (t.detach().transpose(1, 2) for t in (q, k))
    torch.testing.assert_close(lse.detach(), _lse_reference(*bhld, 1.0 / 8.0, 90, (-1, 0)),
                               rtol=1e-4, atol=1e-4)
    if grad:  # the same gradients as return_lse's, output's and LSE's alike
        douts = (torch.randn_like(out), torch.randn_like(lse))
        got = torch.autograd.grad((out, lse), (q, k, v), douts)
        want = torch.autograd.grad((ref_out, ref_lse), (q, k, v), douts)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(bool(g.abs().sum() > 0) for g in got)


@pytest.mark.parametrize("head_dim", [8, 40, 62, 80, 96, 112, 160, 192, 256])
def test_head_dims(head_dim):
    shape = (2, 3, 3, 100, 150, head_dim, head_dim)
    q, k, v = _qkv(shape, torch.bfloat16, layout="blhd")
    out = flash_tile.flash_attn_func(q, k, v, causal=True)
    ref, pt = _references(*[t.transpose(1, 2) for t in (q, k, v)], None, 50, (-1, 0))
    _check(out.transpose(1, 2), ref, pt, f"D={head_dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=IDS[1:5])
def test_sdpa_matches_torch(shape, causal, dtype):
    """torch layout [B, H, L, D], top-left causal, custom scale."""
    q, k, v = _qkv(shape, dtype)
    scale = 0.3
    out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=causal, scale=scale)
    pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    assert out.shape == q.shape and out.dtype == dtype
    _check(out, ref, pt, "sdpa")


def test_sdpa_gqa_and_value_head_dim():
    q, k, v = _qkv((2, 8, 2, 200, 180, 128, 64), torch.float16)
    out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    pt = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == (2, 8, 200, 64)
    _check(out, ref, pt, "sdpa gqa")


@pytest.mark.parametrize("shape", [(8, 512, 64), (2, 3, 4, 100, 128)], ids=["3d", "5d"])
def test_sdpa_leading_dims(shape):
    q, k, v = (_randn(*shape, dtype=torch.float16) for _ in range(3))
    out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == shape
    _check(out, ref, pt, "leading dims")


def test_packed_inputs_are_read_in_place():
    """qkvpacked [B, L, 3, H, D] and kvpacked [B, L, 2, H_kv, D]: strided views, no copies."""
    qkv = _randn(2, 300, 3, 4, 128, dtype=torch.bfloat16)
    out = flash_tile.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    _check(out.transpose(1, 2), *_references(q, k, v, None, 0, (-1, 0)), "qkvpacked")

    q = _randn(2, 120, 8, 64, dtype=torch.float16)
    kv = _randn(2, 250, 2, 2, 64, dtype=torch.float16)
    out = flash_tile.flash_attn_kvpacked_func(q, kv, causal=True)
    k, v = (t.transpose(1, 2) for t in kv.unbind(2))
    _check(out.transpose(1, 2), *_references(q.transpose(1, 2), k, v, None, 130, (-1, 0)),
           "kvpacked")


def test_non_unit_last_stride_is_copied_and_correct():
    q, k, v = (_randn(1, 2, 100, 128, dtype=torch.float16).transpose(-1, -2).contiguous()
               .transpose(-1, -2) for _ in range(3))
    assert q.stride(-1) != 1
    out = flash_tile.scaled_dot_product_attention(q, k, v)
    _check(out, *_references(q, k, v), "strided last dim")


def test_runs_on_current_stream_under_no_grad_and_autocast(monkeypatch):
    """Every launch of the call goes to the side stream that is current (the launches are
    recorded on their way to cuTile), and the autocast result is right; a planned call on
    the default stream after it launches there (the streams are kept by raw handle)."""
    from flash_tile import _launch

    streams = []
    launch = _launch.ct.launch
    monkeypatch.setattr(_launch.ct, "launch", lambda stream, *args, **attributes: (
        streams.append(stream), launch(stream, *args, **attributes)))
    q, k, v = (_randn(2, 4, 257, 64, dtype=torch.float32) for _ in range(3))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    stream.synchronize()
    assert streams and all(s == stream for s in streams), streams
    assert out.dtype == torch.bfloat16 == expected.dtype
    ref, _ = _references(q, k, v, None, 0, (-1, 0))
    _check(out, ref, expected, "autocast on a side stream")
    streams.clear()
    with torch.no_grad():
        for _ in range(2):  # the second call runs its plan
            again = flash_tile.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)),
                                                            is_causal=True)
    assert len(streams) == 2 and all(s == torch.cuda.current_stream() for s in streams)
    _check(again, ref, expected, "the default stream after a side stream")


def test_autocast_casts_as_torch_does():
    """Under fp16 autocast, bf16 and fp32 inputs (mixed) are cast to fp16, as torch's SDPA
    casts them: the output's dtype is torch's, its values within the rule."""
    q = _randn(2, 4, 130, 64, dtype=torch.bfloat16)
    k, v = _randn(2, 4, 130, 64, dtype=torch.float32), _randn(2, 4, 130, 64, dtype=torch.bfloat16)
    with torch.autocast("cuda", torch.float16):
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == torch.float16
    half = [t.half() for t in (q, k, v)]
    _check(out, *_references(*half, window=(-1, 0)), "fp16 autocast of bf16 and fp32")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU (cuda:1)")
def test_second_device():
    q, k, v = (torch.randn(1, 2, 130, 64, device="cuda:1", dtype=torch.float16)
               for _ in range(3))
    out = flash_tile.scaled_dot_product_attention(q, k, v)
    assert out.device == q.device
    _check(out, *_references(q, k, v), "cuda:1")


def test_mixed_devices_rejected():
    q = _randn(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="one device"):
        flash_tile.scaled_dot_product_attention(q, q.cpu(), q)


# Key lengths for the mask tests: ragged, and a multiple of 16 (mask rows 16-byte aligned, so
# the JIT may load mask tiles through TMA; bool tiles loaded so were misread, see
# _launch.kernel_mask).
MASK_K_LENS = [170, 176]


@pytest.mark.parametrize("k_len", MASK_K_LENS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_attention_masks(kind, k_len):
    """Masks broadcast over batch/heads/rows are read in place; fully masked rows give 0."""
    q, k, v = _qkv((2, 4, 4, 150, k_len, 64, 64), torch.float16)
    if kind == "bool":
        mask = torch.rand(2, 1, 150, k_len, device="cuda") > 0.4  # broadcast over heads
        mask[:, :, 3] = False  # fully masked rows
    else:
        mask = torch.randn(1, 4, 1, k_len, device="cuda", dtype=torch.float16)  # per-key bias
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = flash_tile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = sdpa(q.float(), k.float(), v.float(), attn_mask=mask if kind == "bool" else mask.float())
    pt = sdpa(q, k, v, attn_mask=mask)
    if kind == "bool":
        assert (out[:, :, 3] == 0).all()
    # torch's fully masked rows are NaN, ours 0: only NaN is replaced (an inf must still
    # fail the rule's check, not widen its bound).
    _check(out, ref.nan_to_num(0.0, posinf=math.inf, neginf=-math.inf),
           pt.nan_to_num(0.0, posinf=math.inf, neginf=-math.inf), f"{kind} mask")


def test_more_than_2_31_elements():
    """[1, 1100, 8192, 256] tensors (2.3e9 elements each) take the 64-bit-index kernel: rows
    from 1024 on lie past element 2**31, where a 32-bit offset would wrap."""
    q, k, v = (_randn(1, 1100, 8192, 256, dtype=torch.bfloat16) for _ in range(3))
    out = flash_tile.flash_attn_func(q, k, v, causal=True)
    heads = slice(8190, 8192)
    sub = [t[:, :, heads].transpose(1, 2) for t in (q, k, v)]
    _check(out[:, :, heads].transpose(1, 2), *_references(*sub, None, 0, (-1, 0)), "2**31")


def test_long_keys():
    """256k keys: lengths past 2**16 tiles of 64 and a 64 MiB K per head."""
    q, k, v = _qkv((1, 2, 2, 256, 262144, 64, 64), torch.bfloat16, layout="blhd")
    out = flash_tile.flash_attn_func(q, k, v, causal=True)
    _check(out.transpose(1, 2), *_references(*[t.transpose(1, 2) for t in (q, k, v)], None,
                                             262144 - 256, (-1, 0)), "256k keys")


def test_cupy_arrays_in_and_out(monkeypatch):
    """The same bits as the torch call. Tuning is off: two tuning passes may pick different
    tiles (their timings are close), whose sums round differently."""
    cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda13x) is not installed")
    monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    q, k, v = _qkv((2, 4, 2, 130, 170, 64, 64), torch.float16, layout="blhd")
    expected = flash_tile.flash_attn_func(q, k, v, causal=True)
    out = flash_tile.flash_attn_func(*(cupy.from_dlpack(t) for t in (q, k, v)), causal=True)
    assert isinstance(out, cupy.ndarray) and out.shape == tuple(expected.shape)
    cupy.cuda.get_current_stream().synchronize()
    assert torch.equal(torch.from_dlpack(out), expected)
