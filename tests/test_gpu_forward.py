"""The forward on a GPU against an fp32 reference, with flash-attn's tolerance rule.

The rule (``flash_tile.reference.check_error``): the kernel's max error against the fp32
reference is at most twice the max error of PyTorch's own computation in the input dtype
against the same reference, plus a floor of the dtype's rounding at the output's magnitude. Inputs are fresh random values each call; outputs
launched directly are poisoned with NaN first, so an element the kernel skips fails.
"""

import math

import pytest
import torch

import flash_tile
from flash_tile import _launch, variants
from flash_tile.reference import attention_dense, check_error

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
# (batch, heads, Lq, Lk, head_dim)
SHAPES = [
    (1, 1, 1, 1, 64),
    (2, 3, 17, 17, 64),
    (1, 2, 113, 203, 128),
    (2, 2, 203, 113, 128),
    (1, 2, 1, 203, 64),
    (1, 2, 203, 1, 128),
    (3, 2, 64, 64, 128),
    (1, 4, 1023, 1024, 64),
    (1, 2, 1024, 1023, 128),
    (2, 4, 512, 512, 128),
]
IDS = ["x".join(map(str, s)) for s in SHAPES]


def _randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _qkv(shape, dtype, layout="bhld"):
    """Fresh q, k, v for (batch, heads, Lq, Lk, head_dim) in torch's or flash-attn's layout."""
    batch, heads, q_len, k_len, head_dim = shape
    if layout == "bhld":
        return tuple(_randn(batch, heads, n, head_dim, dtype=dtype) for n in (q_len, k_len, k_len))
    return tuple(_randn(batch, n, heads, head_dim, dtype=dtype) for n in (q_len, k_len, k_len))


def _check(out, out_ref, out_pt, what=""):
    report = check_error(out, out_ref, out_pt)
    assert report["ok"], f"{what}: {report}"


def _references(q, k, v, scale, causal, offset):
    """(fp32 reference, PyTorch in the input dtype) for [B, H, L, D] inputs."""
    ref = attention_dense(q.float(), k.float(), v.float(), scale, causal, offset)
    pt = attention_dense(q, k, v, scale, causal, offset)
    return ref, pt


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_launch_writes_every_element(shape, causal, dtype):
    """The kernel launched directly into NaN-poisoned outputs, LSE included."""
    batch, heads, q_len, k_len, head_dim = shape
    q, k, v = _qkv(shape, dtype)
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads, q_len), math.nan, device="cuda")
    scale = 1.0 / math.sqrt(head_dim)
    offset = k_len - q_len
    config = variants.default_config(torch.cuda.get_device_capability())
    _launch.launch_forward(q, k, v, out, lse, scale, causal, offset, config)

    ref, pt = _references(q, k, v, scale, causal, offset)
    _check(out, ref, pt, "out")
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q_len, device="cuda")[:, None]
        cols = torch.arange(k_len, device="cuda")[None, :]
        s = s.masked_fill(cols > rows + offset, -math.inf)
    lse_ref = torch.logsumexp(s, dim=-1)
    lse_ref = torch.where(lse_ref == -math.inf, math.inf, lse_ref)  # empty rows: +inf
    assert not lse.isnan().any()
    torch.testing.assert_close(lse, lse_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=IDS[1:5])
def test_flash_attn_func(shape, causal, dtype):
    """flash-attn layout [B, L, H, D], bottom-right causal, LSE returned."""
    batch, heads, q_len, k_len, head_dim = shape
    q, k, v = _qkv(shape, dtype, layout="blhd")
    out, lse = flash_tile.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (batch, heads, q_len) and lse.dtype == torch.float32

    bhld = [t.transpose(1, 2) for t in (q, k, v)]
    ref, pt = _references(*bhld, 1.0 / math.sqrt(head_dim), causal, k_len - q_len)
    _check(out.transpose(1, 2), ref, pt, "flash_attn_func")


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


@pytest.mark.parametrize("shape", [(8, 512, 64), (2, 3, 4, 100, 128)], ids=["3d", "5d"])
def test_sdpa_leading_dims(shape):
    q, k, v = (_randn(*shape, dtype=torch.float16) for _ in range(3))
    out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == shape
    _check(out, ref, pt, "leading dims")


def test_strided_views_are_read_in_place():
    """q, k, v sliced out of one packed [B, L, 3, H, D] buffer: no unit stride but the last."""
    qkv = _randn(2, 300, 3, 4, 128, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = flash_tile.flash_attn_func(q, k, v, causal=True)
    ref, pt = _references(*[t.transpose(1, 2) for t in (q, k, v)], 1.0 / math.sqrt(128), True, 0)
    _check(out.transpose(1, 2), ref, pt, "packed views")


def test_non_unit_last_stride_is_copied_and_correct():
    q, k, v = (_randn(1, 2, 100, 128, dtype=torch.float16).transpose(-1, -2).contiguous()
               .transpose(-1, -2) for _ in range(3))
    assert q.stride(-1) != 1
    out = flash_tile.scaled_dot_product_attention(q, k, v)
    ref, pt = _references(q, k, v, 1.0 / math.sqrt(128), False, 0)
    _check(out, ref, pt, "strided last dim")


def test_runs_on_current_stream_under_no_grad_and_autocast():
    q, k, v = (_randn(2, 4, 257, 64, dtype=torch.float32) for _ in range(3))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        out = flash_tile.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    stream.synchronize()
    assert out.dtype == torch.bfloat16 == expected.dtype
    ref, _ = _references(q, k, v, 1.0 / 8.0, True, 0)
    _check(out, ref, expected, "autocast on a side stream")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU (cuda:1)")
def test_second_device():
    q, k, v = (torch.randn(1, 2, 130, 64, device="cuda:1", dtype=torch.float16)
               for _ in range(3))
    out = flash_tile.scaled_dot_product_attention(q, k, v)
    assert out.device == q.device
    ref, pt = _references(q, k, v, 1.0 / 8.0, False, 0)
    _check(out, ref, pt, "cuda:1")


def test_mixed_devices_rejected():
    q = _randn(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="same device"):
        flash_tile.scaled_dot_product_attention(q, q.cpu(), q)


def test_requires_grad_rejected_before_launch():
    q = _randn(1, 2, 16, 64, dtype=torch.float16).requires_grad_()
    with pytest.raises(NotImplementedError, match="backward"):
        flash_tile.scaled_dot_product_attention(q, q, q)
