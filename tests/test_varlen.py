"""Packed variable-length sequences on the CPU: the float64 twin of the forward's VARLEN
switch against plain attention per sequence, the entry point's checks and its wiring to the
launch, and ahead-of-time compiles of the switch for every architecture."""

import pytest
import torch

from flash_tile import _launch, _validate, aot, reference, variants, varlen

LENGTHS_Q = [0, 1, 17, 113, 203, 5]
LENGTHS_K = [3, 1, 40, 113, 150, 0]  # Lq != Lk per sequence; 0 keys: rows see nothing


def _packed(lengths, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(int(cu[-1]), heads, dim, generator=gen, dtype=torch.float64), cu


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0), (7, 9)])
@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)])
def test_twin_equals_plain_attention_per_sequence(window, tiles):
    q, cu_q = _packed(LENGTHS_Q, 4, 16, 0)
    k, cu_k = _packed(LENGTHS_K, 2, 16, 1)
    v, _ = _packed(LENGTHS_K, 2, 8, 2)
    slopes = torch.rand(len(LENGTHS_Q), 4, dtype=torch.float64)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, None, window, 4.0, slopes, *tiles)
    assert out.shape == (q.shape[0], 4, 8) and lse.shape == (4, q.shape[0])
    checked = 0
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        ref, ref_lse = reference.attention_dense(*seq, diag_offset=diag, window=window,
                                                 softcap=4.0, alibi_slopes=slopes[b:b + 1],
                                                 return_lse=True)  # no key: 0 and +inf
        assert torch.allclose(out[rows], ref[0].transpose(0, 1), atol=1e-12)
        assert torch.equal(lse[:, rows].isinf(), ref_lse[0].isinf())
        finite = ~ref_lse[0].isinf()
        assert torch.allclose(lse[:, rows][finite], ref_lse[0][finite], atol=1e-12)
        checked += 1
    assert checked == sum(n > 0 for n in LENGTHS_Q)


def _args(dtype=torch.bfloat16):
    q = torch.randn(20, 4, 64).to(dtype)
    k = torch.randn(30, 2, 64).to(dtype)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    return q, k, k, cu_q, cu_k, 15, 20


@pytest.mark.parametrize("change,error,match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout"),
    (dict(seqused_k=torch.zeros(2, dtype=torch.int32)), NotImplementedError, "seqused_k"),
    (dict(return_attn_probs=True), NotImplementedError, "return_lse"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_k=True), ValueError, "max_seqlen_k"),
    (dict(window_size=(3,)), ValueError, "window_size"),
])
def test_bad_arguments_raise_before_launch(change, error, match):
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    kwargs = {"max_seqlen_q": max_q, "max_seqlen_k": max_k, **change}
    with pytest.raises(error, match=match):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kwargs)


def test_bad_shapes_raise_before_launch(monkeypatch):
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    with pytest.raises(ValueError, match="3-D"):
        varlen.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="same dtype"):
        varlen.flash_attn_varlen_func(q.half(), k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="CUDA tensors"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    with pytest.raises(ValueError, match="int32"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:2], max_q, max_k)
    with pytest.raises(NotImplementedError, match="backward"):
        varlen.flash_attn_varlen_func(q.requires_grad_(), k, v, cu_q, cu_k, max_q, max_k)


def test_the_call_reaches_the_launch_as_packed_views(monkeypatch):
    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_validate, "device_properties", lambda device: ((9, 0), "H200"))
    monkeypatch.setattr(varlen, "launch_forward", lambda *a, **k: calls.append((a, k)))
    q, k, v, cu_q, cu_k, max_q, max_k = _args()
    out, lse = varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                             window_size=(8, -1), softcap=5.0, return_lse=True)
    (qv, kv, vv, outv, lsev, slopes, mask, scale, softcap, _, window, config), kw = calls[0]
    assert qv.shape == (1, 4, 20, 64) and kv.shape == (1, 2, 30, 64)
    assert outv.shape == (1, 4, 20, 64) and outv.data_ptr() == out.data_ptr()
    assert lsev.shape == (1, 4, 20) and lsev.data_ptr() == lse.data_ptr()
    assert (slopes, mask, scale, softcap, window) == (None, None, 0.125, 5.0, (8, 0))
    assert config == variants.default_config((9, 0), 64)
    assert kw["varlen"] == _launch.Varlen(cu_q, cu_k, max_q)
    assert out.shape == (20, 4, 64) and lse.shape == (4, 20)


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_varlen_switch_compiles_with_tensor_cores(arch):
    """The VARLEN forward for every architecture: tensor cores, no spills, and on the TMA
    architectures the tile loads still through TMA (its row-granular views keep them)."""
    sass = aot.summarize(aot.disassemble(aot.compile_forward(
        arch, dtype="bfloat16", head_dim=128, causal=True, varlen=True)))
    assert sass["tensor_core"] > 0 and sass["local_memory"] == 0, sass
    assert (sass["tma_load"] > 0) == (arch in aot.TMA_ARCHS), sass
