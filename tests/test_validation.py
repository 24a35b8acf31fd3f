"""Bad input raises the documented error on the CPU, before anything launches."""

import pytest
import torch

import flash_tile
from flash_tile import _launch, _validate, api, variants


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any call that reaches the custom op fails the test: validation must stop it first."""

    def launched(*args, **kwargs):
        raise AssertionError("the kernel was reached before validation rejected the input")

    monkeypatch.setattr(api, "attention_forward", launched)


def _blhd(batch=2, length=16, heads=4, head_dim=64, dtype=torch.float16):
    return torch.randn(batch, length, heads, head_dim).to(dtype)


def _bhld(batch=2, heads=4, length=16, head_dim=64, dtype=torch.float16):
    return torch.randn(batch, heads, length, head_dim).to(dtype)


def test_cpu_tensors():
    q = _blhd()
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.scaled_dot_product_attention(_bhld(), _bhld(), _bhld())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_no_gpu_is_named():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        flash_tile.scaled_dot_product_attention(_bhld(), _bhld(), _bhld())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype_lists_supported(dtype):
    q = _blhd(dtype=dtype)
    with pytest.raises(ValueError, match="float16 and torch.bfloat16"):
        flash_tile.flash_attn_func(q, q, q)


def test_mixed_dtypes():
    with pytest.raises(ValueError, match="same dtype"):
        flash_tile.flash_attn_func(_blhd(), _blhd(dtype=torch.bfloat16), _blhd())


def test_rank():
    with pytest.raises(ValueError, match="4-D"):
        flash_tile.flash_attn_func(_bhld()[0], _bhld()[0], _bhld()[0])
    with pytest.raises(ValueError, match="at least 3 dims"):
        x = torch.randn(16, 64, dtype=torch.float16)
        flash_tile.scaled_dot_product_attention(x, x, x)


def test_batch_mismatch():
    with pytest.raises(ValueError, match="batch size"):
        flash_tile.flash_attn_func(_blhd(batch=2), _blhd(batch=3), _blhd(batch=3))
    with pytest.raises(ValueError, match="batch dims"):
        flash_tile.scaled_dot_product_attention(_bhld(batch=2), _bhld(batch=3), _bhld(batch=3))


def test_head_dim_mismatch():
    with pytest.raises(ValueError, match="same head dim"):
        flash_tile.flash_attn_func(_blhd(head_dim=64), _blhd(head_dim=128), _blhd(head_dim=128))


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_unsupported_head_dim_says_what_is_supported(head_dim):
    q = _blhd(head_dim=head_dim)
    with pytest.raises(ValueError, match="supported head dims are 1 to 256"):
        flash_tile.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="value head dim"):
        flash_tile.flash_attn_func(_blhd(), _blhd(), q)


def test_heads():
    # GQA passes validation and stops at the device check on the CPU.
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.flash_attn_func(_blhd(heads=8), _blhd(heads=2), _blhd(heads=2))
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.scaled_dot_product_attention(_bhld(heads=8), _bhld(heads=2), _bhld(heads=2),
                                                enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flash_tile.scaled_dot_product_attention(_bhld(heads=8), _bhld(heads=2), _bhld(heads=2))
    with pytest.raises(ValueError, match="multiple"):
        flash_tile.flash_attn_func(_blhd(heads=6), _blhd(heads=4), _blhd(heads=4))
    with pytest.raises(ValueError, match="same number of heads"):
        flash_tile.flash_attn_func(_blhd(heads=4), _blhd(heads=4), _blhd(heads=2))


@pytest.mark.parametrize("window", [(1.5, 0), (0, "3"), (1,), "ab", None])
def test_window(window):
    q = _blhd()
    with pytest.raises(ValueError, match="window_size"):
        flash_tile.flash_attn_func(q, q, q, window_size=window)


def test_negative_window_sides_and_softcaps_are_off_as_in_flash_attn():
    """flash-attn tests a window side ``< 0`` and a softcap ``> 0``: any negative side is
    unbounded and a softcap <= 0 is off; integer types other than int are taken."""
    assert _validate.check_window((-2, -7)) == (-1, -1)
    assert _validate.check_window((torch.tensor(3), True)) == (3, 1)
    assert _validate.check_softcap(-2.5) == _validate.check_softcap(0) == 0.0
    assert _validate.check_softcap(30) == 30.0


@pytest.mark.parametrize("softcap", [float("-inf"), float("inf"), float("nan")])
def test_softcap(softcap):
    q = _blhd()
    with pytest.raises(ValueError, match="softcap"):
        flash_tile.flash_attn_func(q, q, q, softcap=softcap)


@pytest.mark.parametrize("slopes", [torch.ones(3), torch.ones(2, 4, dtype=torch.float16),
                                    torch.ones(3, 4), torch.ones(2, 4, 1)])
def test_alibi_slopes(slopes):
    q = _blhd(batch=2, heads=4)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_tile.flash_attn_func(q, q, q, alibi_slopes=slopes)


def test_packed_shapes():
    with pytest.raises(ValueError, match="qkv must be"):
        flash_tile.flash_attn_qkvpacked_func(torch.randn(2, 16, 2, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="kv must be"):
        flash_tile.flash_attn_kvpacked_func(_blhd(), torch.randn(2, 16, 3, 4, 64,
                                                                 dtype=torch.float16))
    # Well-formed packs are read as views and reach the device check.
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.flash_attn_qkvpacked_func(torch.randn(2, 16, 3, 4, 64, dtype=torch.float16))


def test_lengths():
    with pytest.raises(ValueError, match="same sequence length"):
        flash_tile.flash_attn_func(_blhd(), _blhd(length=16), _blhd(length=17))
    # Packed sequences without keys are legal as in flash-attn (every row sees none: the
    # call reaches the device check); the FP8 forward needs keys.
    q, k = torch.randn(8, 4, 64).half(), torch.randn(0, 4, 64).half()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.flash_attn_varlen_func(q, k, k, cu, cu * 0, 8, 0)
    q8, k8 = (t.to(torch.float8_e4m3fn) for t in (q, k))
    with pytest.raises(ValueError, match="length 0"):
        flash_tile.flash_attn_varlen_func(q8, k8, k8, cu, cu * 0, 8, 0)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("inf"), float("nan")])
def test_scale(scale):
    q = _blhd()
    with pytest.raises(ValueError, match="positive finite"):
        flash_tile.flash_attn_func(q, q, q, softmax_scale=scale)


def test_flash_attn_unsupported_arguments_are_named():
    q = _blhd()
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p > 0"):
        flash_tile.flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p > 0"):
        flash_tile.flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), 0.1,
                                             return_attn_probs=True)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_probability(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_tile.flash_attn_func(_blhd(), _blhd(), _blhd(), dropout_p=p)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_tile.scaled_dot_product_attention(_bhld(), _bhld(), _bhld(), dropout_p=p)


def test_attn_mask():
    q = _bhld(length=16)
    with pytest.raises(ValueError, match="bool tensor or a torch.float16"):
        flash_tile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16))
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_tile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 16, 16) > 0)
    with pytest.raises(ValueError, match="not both"):
        flash_tile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16) > 0,
                                                is_causal=True)
    # A broadcastable mask passes validation and stops at the device check on the CPU.
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_tile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 16) > 0)


def test_int64_index_is_chosen_by_extent():
    big = torch.empty(1, 32, 2**18, 256, device="meta")  # 2**31 elements
    assert _launch.needs_int64_index(big)
    assert not _launch.needs_int64_index(torch.empty(1, 32, 2**18, 128, device="meta"))
    # A transposed view reaches the same extent.
    assert _launch.needs_int64_index(big.transpose(1, 2))


def test_dropout_under_graph_capture_raises(monkeypatch):
    """A captured launch would replay one seed: dropout refuses capture, p = 0 does not care."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert api._dropout_seed(0.0) == 0
    with pytest.raises(NotImplementedError, match="CUDA-graph capture"):
        api._dropout_seed(0.1)


def test_backward_past_32_bit_indexing_is_no_error():
    """The backward has 64-bit entry points: a mask, an output or dense dk/dv of 2**31
    elements pass the checks (``test_ops`` sees the launcher pick those entry points)."""
    def grad_meta(*shape):
        return torch.empty(*shape, device="meta").requires_grad_()

    q, k = grad_meta(1, 32, 2**16, 64), grad_meta(1, 32, 16, 64)
    big_mask = torch.empty(1, 32, 2**16, 2**10, dtype=torch.bool, device="meta")
    assert _validate.check_grad(q, k, grad_meta(1, 32, 16, 64), attn_mask=big_mask)
    assert _validate.check_grad(q, k, grad_meta(1, 32, 16, 2**10))  # out [1, 32, 2**16, 2**10]
    wide_kv = grad_meta(1, 32, 2**10, 64).expand(2**11, 32, 2**10, 64)  # dk, dv: 2**31 dense
    assert _validate.check_grad(grad_meta(2**11, 32, 1, 64), wide_kv, wide_kv)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        _validate.check_grad(q, k, k, attn_mask=big_mask.float().requires_grad_())


def test_flash_attn_positional_order_matches_flash_attn():
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal): the 4th positional argument
    # is dropout, as in flash-attn, and must not be taken for something else.
    q = _blhd()
    with pytest.raises(ValueError, match="dropout_p"):
        flash_tile.flash_attn_func(q, q, q, 1.5)


def test_old_gpu():
    with pytest.raises(RuntimeError, match="8.0 or newer"):
        _validate.check_capability((7, 5), "Tesla T4")
    _validate.check_capability((8, 0))
    _validate.check_capability((12, 1))


def test_missing_compiler_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_validate, "find_tileiras", lambda: None)
    monkeypatch.setattr(_validate, "_compiler_found", False)
    with pytest.raises(RuntimeError, match=r"pip install \"cuda-tile\[tileiras\]\""):
        _validate.check_compiler()


def test_compiler_is_found_here():
    # The dev install brings tileiras from PyPI; the AOT tests depend on it too.
    assert _validate.find_tileiras() is not None


def test_variant_lookup():
    assert variants.default_config((9, 0)) == variants.SM90_TWO_GROUPS
    assert variants.default_config((8, 6)) == variants.SM80_DEFAULT
    assert variants.default_config((12, 0)) == variants.SM120_DEFAULT
    assert variants.default_config((12, 0), 256) == variants.SM120_WIDE
    assert variants.default_config((8, 9), 192) == variants.SM80_WIDE
    assert variants.default_config((10, 3), 256) == variants.SM100_DEFAULT
    with pytest.raises(ValueError, match="head dim 512"):
        variants.default_config((9, 0), 512)
    assert variants.default_config((13, 0)) == variants.SM120_DEFAULT  # newest known
    with pytest.raises(ValueError, match="8.0"):
        variants.default_config((7, 5))
    with pytest.raises(ValueError, match="power of two"):
        variants.TileConfig(tile_m=48)
    with pytest.raises(ValueError, match="latency_v must be in 1..10"):
        variants.TileConfig(latency_v=0)
    with pytest.raises(ValueError, match="exp2_fma must be 0, 2 or 4"):
        variants.TileConfig(exp2_fma=3)
