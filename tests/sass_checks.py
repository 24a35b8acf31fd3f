"""SASS checks shared by the compile tests (test_aot.py, test_varlen.py, test_sinks.py): which
tensor-core op every matmul of a listing runs on."""

from flash_tile import aot

# Kernels that leave the arch's own tensor-core op, keyed (arch, largest head dim of the
# bucket, kernel), with the opcodes they use instead; ``assert_tensor_core_path`` accepts these
# and nothing else, and test_known_fallbacks_still_hold fails once one no longer happens.
KNOWN_FALLBACKS = {
    # sm_100, D in (128, 256], fp16 and bf16, causal or not: dQ runs on UTCHMMA through TMA
    # without spills, but dK/dV on HMMA only (768 with the default 64x64 with 8 worker warps),
    # no UTMALDG, 1094 LDL/STL (580 LDL, 514 STL; 1141 not causal). The same on every tile
    # tried: 64x64 with 4 worker warps, 32x32, 64x32, 32x64, 128x64 and 64x128 with 8 spill
    # 486-5001 in dK/dV, always HMMA (UTMALDG only at 32x32 and 64x32), and the one-pass form
    # at 64x64 with 8 (HMMA, no UTMAREDG, 1352). At D=128 both run on UTCHMMA.
    # [tileiras 13.4, cuda-tile 1.7.0, 2026-12-05]
    ("sm_100", 256, "dkdv"): {"HMMA"},
}


def assert_tensor_core_path(arch: str, sass: str, where=(), known=None, fp8=False,
                            forward=False):
    """Every matmul of ``sass`` on ``arch``'s own tensor-core op: the SET of tensor-core
    opcodes must be exactly {aot.TENSOR_CORE_OP[arch]} (aot.FP8_TENSOR_CORE_OP's with
    ``fp8``), so one matmul left on HMMA beside HGMMA or UTCHMMA fails, as does none at all.
    ``known``, an (arch, head dim, kernel) key, takes KNOWN_FALLBACKS' set where it is listed.
    With ``forward`` each of the forward's two matmuls is checked on the archs whose tensor
    cores read A from shared memory or from registers / tensor memory (HGMMA, QGMMA, UTC*MMA):
    Q K^T reads Q from shared memory, P V reads P from registers or tensor memory, so both
    forms must be there (one matmul gone to FFMA leaves one). HMMA and QMMA read registers
    for both, so there only the set is checked; nor has the backward such a split (sm_90's
    D=256 kernels read every A from shared memory)."""
    sites = aot.tensor_core_sites(sass)
    expected = {(aot.FP8_TENSOR_CORE_OP if fp8 else aot.TENSOR_CORE_OP)[arch]}
    expected = KNOWN_FALLBACKS.get(known, expected)
    assert {op for op, _ in sites} == expected, (arch, where, sites)
    if forward and not expected & {"HMMA", "QMMA"}:
        sources = {source for _, source in sites}
        assert "shared" in sources and len(sources) == 2, (arch, where, sites)
    return sites
