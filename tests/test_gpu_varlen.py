"""flash_attn_varlen_func's forward on the GPU against an fp32 reference per sequence, with
flash-attn's 2x rule (the varlen entry point is not exported until these have passed)."""

import math

import pytest
import torch

from flash_tile import reference
from flash_tile.varlen import flash_attn_varlen_func

pytestmark = pytest.mark.gpu


def _packed(lengths, heads, dim, dtype, gen):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    rows = torch.randn(int(cu[-1]), heads, dim, generator=gen, device="cuda").to(dtype)
    return rows, cu


@pytest.mark.parametrize("lengths", [
    ([0, 1, 17, 113, 203, 1023, 4097], [0, 1, 17, 113, 203, 1023, 4097]),  # Lq = Lk
    ([5, 1, 40, 113, 130], [3, 60, 40, 250, 0]),                             # Lq != Lk, 0 keys
    ([300], [300]),                                                          # batch 1
])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                            (True, (64, -1)), (False, (20, 9))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_against_each_sequence(lengths, causal, window, dtype):
    gen = torch.Generator(device="cuda").manual_seed(len(lengths[0]))
    q, cu_q = _packed(lengths[0], 8, 128, dtype, gen)
    k, cu_k = _packed(lengths[1], 2, 128, dtype, gen)
    v, _ = _packed(lengths[1], 2, 128, dtype, gen)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths[0]),
                                          max(lengths[1]), causal=causal, window_size=window,
                                          return_lse=True)
    eff = (window[0], 0) if causal else window
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        if seq[1].shape[2] == 0:  # no key: zeros and +inf, as flash-attn
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert bool((lse[:, rows] == math.inf).all())
            continue
        args = dict(diag_offset=diag, window=eff)
        ref, ref_lse = reference.attention_dense(*(t.float() for t in seq), return_lse=True,
                                                 **args)
        low = reference.attention_dense(*seq, **args)
        report = reference.check_error(out[rows][None].transpose(1, 2), ref, low)
        assert report["ok"], (b, report)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], rtol=1e-4, atol=1e-4)


def test_features_and_head_dims():
    gen = torch.Generator(device="cuda").manual_seed(3)
    lengths = [17, 203, 64]
    for dim, v_dim in ((64, 64), (80, 48), (256, 256)):
        q, cu = _packed(lengths, 4, dim, torch.bfloat16, gen)
        k, _ = _packed(lengths, 4, dim, torch.bfloat16, gen)
        v, _ = _packed(lengths, 4, v_dim, torch.bfloat16, gen)
        slopes = torch.rand(len(lengths), 4, device="cuda")
        with torch.no_grad():
            out = flash_attn_varlen_func(q, k, v, cu, cu, 203, 203, causal=True, softcap=20.0,
                                         alibi_slopes=slopes)
        for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu, cu):
            args = dict(diag_offset=diag, window=(-1, 0), softcap=20.0,
                        alibi_slopes=slopes[b:b + 1])
            ref = reference.attention_dense(*(t.float() for t in seq), **args)
            low = reference.attention_dense(*seq, **args)
            report = reference.check_error(out[rows][None].transpose(1, 2), ref, low)
            assert report["ok"], (dim, b, report)
