"""Ahead-of-time compiles on the CPU: every architecture gets tensor-core (and TMA) code.

The matrix: each architecture in ``variants.ARCHS`` compiles its default variant twice, once
as the heaviest instance (float16, D=128, causal, ragged key length, LSE stored: both masked
paths and every store) and once as the lightest (bfloat16, D=64, not causal, even length, no
LSE: only the unmasked loop). The switches are compile-time constants of one kernel body, so
these two bound what any mixture of them compiles to. Each compile takes a few seconds, which
keeps this file near a minute on two cores.
"""

import pytest

from flash_tile import aot, variants

VARIANTS = {
    "fp16-d128-causal-ragged-lse": dict(dtype="float16", head_dim=128, causal=True,
                                        even_n=False, store_lse=True),
    "bf16-d64-even": dict(dtype="bfloat16", head_dim=64, causal=False, even_n=True,
                          store_lse=False),
}


@pytest.fixture(scope="module", params=variants.ARCHS)
def compiled(request):
    arch = request.param
    return arch, {name: aot.compile_forward(arch, **kw) for name, kw in VARIANTS.items()}


def test_tensor_cores_and_tma(compiled):
    arch, cubins = compiled
    for name, cubin in cubins.items():
        sass = aot.disassemble(cubin)
        summary = aot.summarize(sass)
        ops = {op for op, _ in aot.opcode_histogram(sass, top=1000)}
        expected = aot.TENSOR_CORE_OP[arch]
        assert any(op.split(".")[0] == expected for op in ops), (arch, name, summary)
        assert summary["tensor_core"] > 0, (arch, name, summary)
        # exp2 runs on the special-function unit, and nothing spills to local memory.
        assert summary["exp2"] > 0, (arch, name, summary)
        assert summary["local_memory"] == 0, (arch, name, summary)
        if arch in aot.TMA_ARCHS:
            assert summary["tma_load"] > 0, (arch, name, summary)
        else:
            assert summary["tma_load"] == 0, (arch, name, summary)


def test_resource_usage_is_recorded(compiled):
    arch, cubins = compiled
    usage = aot.resource_usage(cubins["fp16-d128-causal-ragged-lse"])
    assert 0 < usage["registers"] <= 255, (arch, usage)
    assert usage["shared_bytes"] is not None, (arch, usage)


def test_summarize_counts_known_listing():
    listing = """
        /*0100*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ, !UPT ;
        /*0110*/                   MUFU.EX2 R3, R3 ;
        /*0120*/              @!P0 UTMALDG.4D [UR8], [UR4] ;
        /*0130*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0140*/                   LDL R2, [R1] ;
    """
    summary = aot.summarize(listing)
    assert summary == {"tensor_core": 1, "tma_load": 1, "tma_store": 0, "exp2": 1, "barrier": 1,
                       "global_load": 0, "local_memory": 1, "instructions": 5}
