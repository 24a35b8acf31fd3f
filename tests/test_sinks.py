"""Attention sinks on the CPU: the float64 twins of the SINKS switch (forward, backward with
the sinks' gradient, varlen) against autograd through plain attention with a sink column,
the entry points' checks and wiring, and AOT compiles of the switch on every architecture."""

import pytest
import torch

from flash_tile import _launch, _ops, _validate, aot, api, reference, variants, varlen
from sass_checks import assert_tensor_core_path

# (batch, heads, kv_heads, Lq, Lk, head_dim, window, softcap, alibi, dropout_p)
CASES = [
    ((1, 2, 2, 1, 1, 16), (-1, -1), 0.0, False, 0.0),
    ((2, 4, 2, 17, 40, 16), (-1, 0), 0.0, False, 0.0),     # bottom-right causal, GQA
    ((1, 2, 1, 50, 20, 16), (-1, 0), 0.0, False, 0.0),     # rows that see no key
    ((1, 4, 4, 70, 90, 32), (20, 5), 3.0, True, 0.0),      # window, softcap, ALiBi
    ((2, 2, 2, 33, 33, 16), (-1, -1), 0.0, False, 0.3),    # dropout
]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_twin_matches_autograd_with_a_sink_column(case):
    (batch, heads, kv_heads, q_len, k_len, d), window, softcap, alibi, p = case
    gen = torch.Generator().manual_seed(q_len + k_len)
    q, k, v = _randn(gen, batch, heads, q_len, d), _randn(gen, batch, kv_heads, k_len, d), \
        _randn(gen, batch, kv_heads, k_len, d)
    sinks = _randn(gen, heads) * 2
    slopes = torch.rand(batch, heads, generator=gen, dtype=torch.float64) if alibi else None
    dout, dlse = _randn(gen, batch, heads, q_len, d), _randn(gen, batch, heads, q_len)
    args = (None, k_len - q_len, window, softcap, slopes)
    drop = dict(dropout_p=p, dropout_seed=99)

    out, lse = reference.attention_tiles(q, k, v, *args, tile_m=16, tile_n=16, sinks=sinks,
                                         **drop)
    dq, dk, dv, dsinks = reference.attention_tiles_backward(
        q, k, v, out, lse, dout, *args, tile_m=16, tile_n=16, dlse=dlse, sinks=sinks, **drop)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = reference.attention_dense(*leaves[:3], *args, return_lse=True,
                                             sinks=leaves[3], **drop)
    torch.autograd.backward((ref, ref_lse), (dout, dlse))
    assert torch.allclose(out, ref.detach(), rtol=1e-10, atol=1e-12)
    # finite: the sink is counted
    assert torch.allclose(lse, ref_lse.detach(), rtol=1e-10, atol=1e-12)
    for got, leaf in zip((dq, dk, dv, dsinks), leaves):
        assert torch.allclose(got, leaf.grad, rtol=1e-10, atol=1e-10)


def test_a_sink_lowers_the_output_by_its_weight():
    """A sink only adds to the denominator: the output is the sink-free one times
    1 - p_sink, and a sink of -inf changes nothing."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (_randn(gen, 1, 2, 9, 16) for _ in range(3))
    plain, plain_lse = reference.attention_tiles(q, k, v)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = reference.attention_tiles(q, k, v, sinks=sinks)
    kept = 1 - torch.exp(sinks.view(1, 2, 1) - lse)
    assert torch.allclose(out, plain * kept[..., None], rtol=1e-10, atol=1e-12)
    assert torch.allclose(lse, torch.logaddexp(plain_lse, sinks.view(1, 2, 1)), rtol=1e-10,
                          atol=1e-12)
    none, _ = reference.attention_tiles(q, k, v, sinks=torch.full((2,), -torch.inf))
    assert torch.allclose(none, plain, rtol=1e-10, atol=1e-12)


def test_varlen_twin_with_sinks_per_sequence():
    gen = torch.Generator().manual_seed(2)
    # Query lengths 5, 0, 17, 3 against key lengths 7, 4, 17, 0.
    cu_q = torch.tensor([0, 5, 5, 22, 25], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 28, 28], dtype=torch.int32)
    q, k, v = _randn(gen, 25, 4, 16), _randn(gen, 28, 2, 16), _randn(gen, 28, 2, 16)
    dout = _randn(gen, 25, 4, 16)
    sinks = _randn(gen, 4)
    out, lse = reference.varlen_tiles(q, k, v, cu_q, cu_k, None, (-1, 0), tile_m=16,
                                      tile_n=16, sinks=sinks)
    grads = reference.varlen_tiles_backward(q, k, v, out, lse, dout, cu_q, cu_k, None, (-1, 0),
                                            tile_m=16, tile_n=16, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    for b, rows, seq, diag in reference.varlen_sequences(*leaves[:3], cu_q, cu_k):
        if seq[1].shape[2] == 0:  # no key: zeros, and the LSE is the sink's alone
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert torch.allclose(lse[:, rows], sinks[:, None].expand(-1, rows.stop -
                                                                     rows.start),
                                  rtol=1e-10, atol=1e-12)
            continue
        ref, ref_lse = reference.attention_dense(*seq, diag_offset=diag, window=(-1, 0),
                                                 return_lse=True, sinks=leaves[3])
        assert torch.allclose(out[rows], ref[0].detach().transpose(0, 1), rtol=1e-10, atol=1e-12)
        assert torch.allclose(lse[:, rows], ref_lse[0].detach(), rtol=1e-10, atol=1e-12)
        ref.backward(dout[rows][None].transpose(1, 2))
    for got, leaf in zip(grads, leaves):
        assert torch.allclose(got, leaf.grad, rtol=1e-10, atol=1e-10)


def _dense_args():
    q = torch.randn(2, 20, 4, 64).bfloat16()
    k = torch.randn(2, 30, 2, 64).bfloat16()
    return q, k, k


@pytest.mark.parametrize("sinks,match", [
    (torch.zeros(4, dtype=torch.float16), "float32"),
    (torch.zeros(2), r"shape \[4\]"),
    ([0.0] * 4, "float32 tensor"),
])
def test_bad_sinks_raise_before_launch(sinks, match, monkeypatch):
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: torch.device("cpu"))
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: pytest.fail("launched"))
    q, k, v = _dense_args()
    with pytest.raises(ValueError, match=match):
        api.flash_attn_func(q, k, v, sinks=sinks)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        varlen.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 20, 30, sinks=sinks)


def test_sinks_on_another_device_raise():
    with pytest.raises(ValueError, match="sinks must be on"):
        _validate.check_sinks(torch.zeros(4), 4, torch.device("meta"))


def test_sinks_reach_the_launches_and_get_their_gradient(monkeypatch):
    """The forward launches with the sinks; a loss that reaches only the sinks still runs
    the backward, whose summed shares come back as the sinks' gradient."""
    calls = []
    monkeypatch.setattr(_validate, "check_device", lambda *tensors: tensors[0].device)
    monkeypatch.setattr(_ops, "_choose", lambda *a: variants.default_config((9, 0), 64))
    monkeypatch.setattr(_ops, "launch_forward", lambda *a, **k: calls.append(("fwd", k)))

    def backward(*args, **kwargs):
        calls.append(("bwd", kwargs))
        return torch.arange(4.0)
    monkeypatch.setattr(_ops, "launch_backward", backward)
    q, k, v = _dense_args()
    sinks = torch.zeros(4, requires_grad=True)
    out = api.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    out.float().sum().backward()
    (_, fwd), (_, bwd) = calls
    assert fwd["sinks"] is sinks and bwd["sinks"] is sinks
    assert torch.equal(sinks.grad, torch.arange(4.0))


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_sinks_switch_compiles_with_tensor_cores(arch):
    """The SINKS forward and dQ kernel (the dK/dV kernel has no switch) for every
    architecture, GQA 64/8 as gpt-oss: tensor cores, no spills."""
    cubins = {"fwd": aot.compile_forward(arch, dtype="bfloat16", head_dim=64, causal=True,
                                         sinks=True),
              "dq": aot.compile_backward(arch, dtype="bfloat16", head_dim=64, causal=True,
                                         group=8, sinks=True)["dq"]}
    for name, cubin in cubins.items():
        listing = aot.disassemble(cubin)
        assert_tensor_core_path(arch, listing, name, forward=name == "fwd")
        assert aot.summarize(listing)["local_memory"] == 0, name


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_decode_sinks_switch_compiles_with_tensor_cores(arch):
    """The decode's SINKS switch, paged and split as gpt-oss serves (GQA 8): tensor cores, no
    spills."""
    cubin = aot.compile_decode(arch, head_dim=64, page_size=64, splits=4, sinks=True)["decode"]
    sass = aot.summarize(aot.disassemble(cubin))
    assert sass["tensor_core"] > 0 and sass["local_memory"] == 0, sass


def test_spec_orders_the_sinks_switch():
    spec = _launch.forward_spec(variants.default_config((9, 0), 64), 64, 64, True, (-1, 0),
                                False, False, 0, True, False, True)
    # SINKS, then SEQUSED_K (then the forward's FP8, EXP2_FMA, PAGED, PAGE_N, GATHER and
    # PAGE_AHEAD); the dK/dV kernel has no SINKS (its last three: VARLEN, SEQUSED_K, DQ_ACCUM).
    assert spec.constants()[-8:] == (True, False, False, 0, False, 0, False, False)
    # EXP2_FMA is the FP8 forward's alone: other dtypes keep one kernel instance per config.
    fp8_config = variants.fp8_config((9, 0), 128)
    assert fp8_config.exp2_fma == 4
    assert [_launch.forward_spec(fp8_config, 128, 128, True, (-1, -1), False, False, 0, True,
                                 False, fp8=fp8).constants()[-6:-4] for fp8 in (False, True)] \
        == [(False, 0), (True, 4)]
    assert spec.dq_constants(False)[-2:] == (True, False)
    assert spec.dkdv_constants(1, False)[-3:] == (False, False, False)
    assert spec.dkdv_constants(1, False, dq_accum=True)[-3:] == (False, False, True)
