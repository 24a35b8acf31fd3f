"""The KV-cache call's input checks on the CPU: every argument that can be checked without a
device sync raises a clear error before any launch (flash_attn_with_kvcache and the
``_validate`` helpers it calls)."""

import pytest
import torch

import flash_tile
from flash_tile import _validate, kvcache


def _q(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window_size=(1,)), ValueError, "window_size"),
    (dict(softmax_scale=-1.0), ValueError, "scale"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
])
def test_bad_arguments_raise_before_launch(kwargs, error, match):
    q, k = _q(2, 1, 4, 64), _q(2, 32, 2, 64)
    with pytest.raises(error, match=match):
        flash_tile.flash_attn_with_kvcache(q, k, k, **kwargs)


def test_bad_shapes_and_dtypes_raise_before_launch():
    q, k = _q(2, 1, 4, 64), _q(2, 32, 2, 64)
    with pytest.raises(ValueError, match="4-D"):
        flash_tile.flash_attn_with_kvcache(q[0], k, k)
    with pytest.raises(ValueError, match="at least one sequence and one query row"):
        flash_tile.flash_attn_with_kvcache(q[:, :0], k, k)
    with pytest.raises(ValueError, match="same dtype"):
        flash_tile.flash_attn_with_kvcache(q, k.half(), k)
    with pytest.raises(ValueError, match="multiple"):
        flash_tile.flash_attn_with_kvcache(_q(2, 1, 5, 64), k, k)
    with pytest.raises(ValueError, match="agree"):
        flash_tile.flash_attn_with_kvcache(q, k, k[:, :16])
    with pytest.raises(ValueError, match="both k and v"):
        flash_tile.flash_attn_with_kvcache(q, k, k, k=_q(2, 1, 2, 64))
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.flash_attn_with_kvcache(q, k, k)


def test_fp8_cache_checks():
    """An FP8 cache takes float8_e4m3fn for both caches, q in float16/bfloat16, new rows in
    q's dtype or e4m3, and descale factors of [B, H_kv] or one element, only with it; the
    rest raises before any launch (here, before the CPU tensors are turned away)."""
    q, k = _q(2, 1, 4, 64), _q(2, 32, 2, 64)
    k8 = k.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="float16 or bfloat16 q"):
        flash_tile.flash_attn_with_kvcache(q.to(torch.float8_e4m3fn), k8, k8)
    with pytest.raises(ValueError, match="same dtype"):
        flash_tile.flash_attn_with_kvcache(q, k8, k)
    with pytest.raises(ValueError, match="same dtype"):
        flash_tile.flash_attn_with_kvcache(q, k.to(torch.float8_e5m2), k.to(torch.float8_e5m2))
    with pytest.raises(ValueError, match="caches only"):
        flash_tile.flash_attn_with_kvcache(q, k, k, k_descale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="new k and v"):
        flash_tile.flash_attn_with_kvcache(q, k8, k8, k=_q(2, 1, 2, 64).half(),
                                           v=_q(2, 1, 2, 64).half(), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"shape \[2, 2\]"):
        flash_tile.flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(2, 4))
    with pytest.raises(ValueError, match="float32"):
        flash_tile.flash_attn_with_kvcache(q, k8, k8, v_descale=torch.ones(2, 2).half())
    with pytest.raises(ValueError, match="CUDA tensors"):  # all of that passed
        flash_tile.flash_attn_with_kvcache(q, k8, k8, k=k8[:, :1], v=k8[:, :1],
                                           cache_seqlens=3, k_descale=torch.ones(()),
                                           v_descale=torch.ones(2, 2))


def test_index_checks():
    dev = torch.device("cpu")
    lens = torch.zeros(3, dtype=torch.int32)
    assert _validate.check_index_tensor(lens, "cache_seqlens", (3,), dev) is lens
    with pytest.raises(ValueError, match="int32"):
        _validate.check_index_tensor(lens.long(), "cache_seqlens", (3,), dev)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        _validate.check_index_tensor(lens, "cache_seqlens", (2,), dev)
    table = torch.zeros(3, 4, dtype=torch.int32)
    for page_size in (1, 24, 64):  # any page size: pages smaller than a step are gathered
        _validate.check_block_table(table, 3, page_size, None, dev)
    with pytest.raises(ValueError, match="must be positive"):
        _validate.check_block_table(table, 3, 0, None, dev)
    with pytest.raises(ValueError, match="no columns"):
        _validate.check_block_table(table[:, :0], 3, 64, None, dev)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        _validate.check_block_table(table, 3, 64, lens, dev)
    with pytest.raises(ValueError, match=r"shape \[2, 4\]"):
        _validate.check_block_table(table, 2, 64, None, dev)
    with pytest.raises(ValueError, match="capacity"):
        kvcache._seqlens(65, 3, 64, 0, dev)
    with pytest.raises(ValueError, match="3 new rows"):  # 62 + 3 rows overflow 64
        kvcache._seqlens(62, 3, 64, 3, dev)
    with pytest.raises(ValueError, match="bool"):
        kvcache._seqlens(True, 3, 64, 0, dev)
    assert kvcache._seqlens(None, 3, 64, 0, dev).tolist() == [64, 64, 64]
    with pytest.raises(ValueError, match="num_splits"):
        _validate.check_num_splits(2.0)
    assert _validate.check_num_splits(-1) == 0  # below 1 picks the count, as in flash-attn


def test_new_kv_checks():
    k_cache = _q(2, 32, 2, 64)
    k = _q(2, 3, 2, 64)
    assert _validate.check_new_kv(k, k, 2, k_cache, k_cache, 32, True) == 3
    with pytest.raises(ValueError, match="both k and v"):
        _validate.check_new_kv(k, None, 2, k_cache, k_cache, 32, True)
    with pytest.raises(ValueError, match="cache_seqlens"):
        _validate.check_new_kv(k, k, 2, k_cache, k_cache, 32, False)
    with pytest.raises(ValueError, match=r"\[2, L_new, 2, 64\]"):
        _validate.check_new_kv(_q(2, 3, 1, 64), k, 2, k_cache, k_cache, 32, True)
    with pytest.raises(ValueError, match="do not fit"):
        _validate.check_new_kv(_q(2, 40, 2, 64), _q(2, 40, 2, 64), 2, k_cache, k_cache, 32,
                               True)


def test_rotary_checks():
    q, cos = _q(2, 1, 4, 64), _q(32, 16)
    _validate.check_rotary(cos, cos, q, 32, True)
    for args, match in [((cos, None, q, 32, True), "both"),
                        ((cos, cos, q, 32, False), "pass k and v"),
                        ((cos[0], cos[0], q, 32, True), "2-D"),
                        ((cos.half(), cos.half(), q, 32, True), "dtype"),
                        ((cos, cos[:, :8], q, 32, True), "one shape"),
                        ((_q(32, 40), _q(32, 40), q, 32, True), "head dim 64"),
                        ((cos, cos, q, 33, True), "33 positions")]:
        with pytest.raises(ValueError, match=match):
            _validate.check_rotary(*args)


def test_decode_mask_checks():
    """A KV-cache mask is bool, one for every head, as wide as the cache's capacity and
    broadcast to [B, 1, Lq, L]; anything else raises before a launch."""
    dev = torch.device("cpu")
    mask = torch.rand(1, 1, 3, 64) > 0.5
    view = _validate.check_decode_mask(mask, 2, 3, 64, dev)
    assert view.shape == (2, 1, 3, 64) and view.stride(0) == 0
    assert _validate.check_decode_mask(mask[0, 0, 0], 2, 3, 64, dev).shape == (2, 1, 3, 64)
    with pytest.raises(ValueError, match="bool tensor"):
        _validate.check_decode_mask(mask.float(), 2, 3, 64, dev)
    with pytest.raises(ValueError, match="capacity 128"):
        _validate.check_decode_mask(mask, 2, 3, 128, dev)
    with pytest.raises(ValueError, match="every head"):
        _validate.check_decode_mask(mask.expand(2, 4, 3, 64), 2, 3, 64, dev)
    with pytest.raises(ValueError, match="does not broadcast"):
        _validate.check_decode_mask(mask.expand(1, 1, 3, 64)[:, :, :2], 2, 3, 64, dev)
    with pytest.raises(ValueError, match="must be on meta"):
        _validate.check_decode_mask(mask, 2, 3, 64, torch.device("meta"))
