"""Ahead-of-time compiles on the CPU: each architecture's kernels on its own tensor-core op.

The switches are compile-time constants, so each instance is machine code of its own. For
every architecture in ``variants.ARCHS`` this compiles:
  - six forward instances with the default config: fp16, D=128, causal, ragged keys, LSE
    stored (the heaviest common case); bf16, D=64, even, no LSE (only the unmasked loop); a
    causal window at D=256 (the wide config); D=72 with Dv=40 (padded tiles), softcap, ALiBi
    and a two-sided window; a bool mask, causal; dropout, causal, with the LSE;
  - the backward's three BACKWARD_VARIANTS; every registered forward and backward variant of
    its family (the forward also under every score feature at once);
  - the 64-bit-index entry points, forward (additive mask) and backward.
The rest on fewer: the one-pass backward on sm_90 and sm_100; FP8 on sm_90, sm_100 and
sm_120; VARLEN, SINKS and SEQUSED_K on sm_90 only (tests/test_varlen.py and test_sinks.py
compile VARLEN and SINKS for every architecture); sm_90's tuning choices. So not every branch
on every architecture. Tensor-core checks go through ``assert_tensor_core_path`` (the arch's
op, no other; KNOWN_FALLBACKS lists the exceptions). A forward compiled in 2-3 s, a
backward's kernels in 2-6 s (cuTile's disk cache off); from an empty cache the file's 157
items took about five and a half minutes on two cores (-n 2) [tileiras 13.4, cuda-tile 1.7.0,
2026-12-05].
"""

import dataclasses
import re

import cuda.tile as ct
import pytest

from flash_tile import _launch, aot, autotune, variants
from sass_checks import KNOWN_FALLBACKS, assert_tensor_core_path

VARIANTS = {
    "fp16-d128-causal-ragged-lse": dict(dtype="float16", head_dim=128, causal=True,
                                        even_n=False, store_lse=True),
    "bf16-d64-even": dict(dtype="bfloat16", head_dim=64, causal=False, even_n=True,
                          store_lse=False),
    "bf16-d256-causal-window": dict(dtype="bfloat16", head_dim=256, causal=True,
                                    window=(256, -1), even_n=False, store_lse=True),
    "fp16-d72-dv40-softcap-alibi-window": dict(dtype="float16", head_dim=72, v_head_dim=40,
                                               causal=False, window=(100, 30), softcap=True,
                                               alibi=True, even_n=False, store_lse=True),
    "bf16-d128-bool-mask": dict(dtype="bfloat16", head_dim=128, causal=True, attn_mask="bool",
                                even_n=False, store_lse=False),
    "bf16-d128-causal-dropout": dict(dtype="bfloat16", head_dim=128, causal=True,
                                     even_n=False, store_lse=True, dropout=True),
}
# Instances that still spill to local memory with their arch's default config, and what was
# seen; everything else must compile without spills.
KNOWN_SPILLS = {
    ("sm_100", "fp16-d72-dv40-softcap-alibi-window"): "298 LDL/STL at 64x64 (none at 64x32)",
    ("sm_120", "bf16-d128-bool-mask"): "1437 LDL/STL at 64x64 (none with 8 worker warps)",
}


def _summary(cubin: bytes) -> dict:
    """``aot.summarize`` of a cubin's disassembly: instruction counts, spills."""
    return aot.summarize(aot.disassemble(cubin))


@pytest.fixture(scope="module", params=variants.ARCHS)
def compiled(request):
    arch = request.param
    return arch, {name: aot.compile_forward(arch, **kw) for name, kw in VARIANTS.items()}


def test_tensor_cores_and_tma(compiled):
    arch, cubins = compiled
    for name, cubin in cubins.items():
        sass = aot.disassemble(cubin)
        summary = aot.summarize(sass)
        assert_tensor_core_path(arch, sass, name, forward=True)
        # exp2 runs on the special-function unit.
        assert summary["exp2"] > 0, (arch, name, summary)
        # A listed spill must still happen: a stale entry would hide a regression.
        assert (summary["local_memory"] > 0) == ((arch, name) in KNOWN_SPILLS), (arch, name,
                                                                              summary)
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
        /*0150*/                   UTMAREDG.4D.ADD [UR8], [UR4] ;
    """
    summary = aot.summarize(listing)
    assert summary == {"tensor_core": 1, "tma_load": 1, "tma_store": 0, "tma_reduce": 1,
                       "exp2": 1, "barrier": 1, "global_load": 0, "local_memory": 1,
                       "instructions": 6}
    fp8 = """
        /*0100*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0110*/                   QMMA.16832.F32.E4M3.E4M3 R4, R8, R12, R4 ;
        /*0120*/                   UTCQMMA gdesc[UR4], gdesc[UR6], tmem[UR8], idesc[UR9] ;
    """
    assert aot.summarize(fp8)["tensor_core"] == 3  # the FP8 tensor-core forms count too


def test_tensor_core_path_rejects_partial_fallbacks():
    """Made-up listings: an sm_90 forward with both matmuls on HGMMA passes; with one of them
    on FFMA (one HGMMA left), beside HMMA, on HMMA alone or with none, it fails. sm_100's
    listed dK/dV passes on HMMA, and only under its key."""
    qk = "/*0100*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;"
    pv = "/*0110*/ HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR8].tnspB, R88 ;"
    ffma = "/*0120*/ FFMA R3, R4, R5, R3 ;\n" * 64
    hmma = "/*0130*/ HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
    assert assert_tensor_core_path("sm_90", f"{qk}\n{pv}\n{ffma}", forward=True) == {
        ("HGMMA", "shared"): 1, ("HGMMA", "registers"): 1}
    for listing in (f"{qk}\n{ffma}", f"{pv}\n{ffma}", f"{qk}\n{pv}\n{hmma}", hmma, ffma):
        with pytest.raises(AssertionError):
            assert_tensor_core_path("sm_90", listing, forward=True)
    utc = "/*0140*/ UTCHMMA tmem[UR6], gdesc[UR8], tmem[UR10], tmem[UR12], idesc[UR13], UPT ;"
    assert assert_tensor_core_path("sm_100", utc) == {("UTCHMMA", "tensor memory"): 1}
    assert_tensor_core_path("sm_100", hmma, known=("sm_100", 256, "dkdv"))
    for arch, listing, known in (("sm_100", hmma, ("sm_100", 128, "dkdv")),
                                 ("sm_100", utc, ("sm_100", 256, "dkdv")),
                                 ("sm_90", qk, None)):
        with pytest.raises(AssertionError):  # the last: a forward's P V on FFMA
            assert_tensor_core_path(arch, listing, known=known, forward=True)


# The 64-bit-index entry point loads without TMA, so its addresses live in registers: with an
# additive mask tile on top (non-causal, fp16, D=128, the arch's default) these spill [tileiras
# 13.4, 2026-12-05; sm_80, sm_86, sm_89 and sm_100 spill nothing].
INT64_SPILLS = {
    "sm_90": "19 LDL/STL (12 LDL, 7 STL) at 128x128 with 8 worker warps (none without the mask)",
    "sm_120": "141 LDL/STL (42 LDL, 99 STL) at 64x64",
}


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_int64_index_entry_point(arch):
    """The entry point for tensors of 2**31 elements or more: the same body, 64-bit indices,
    still the arch's tensor-core op, no spills but the listed (and no TMA: cuTile keeps
    64-bit-indexed arrays off it)."""
    sass = aot.disassemble(aot.compile_forward(arch, attn_mask="additive", causal=False,
                                               int64_index=True))
    summary = aot.summarize(sass)
    assert_tensor_core_path(arch, sass, "int64", forward=True)
    assert summary["tma_load"] == 0, summary
    assert (summary["local_memory"] > 0) == (arch in INT64_SPILLS), summary


INT64_BACKWARD = [(arch, False) for arch in variants.ARCHS] + [("sm_90", True),
                                                                ("sm_100", True)]


@pytest.mark.parametrize("arch,one_pass", INT64_BACKWARD,
                         ids=[arch + "-one" * one_pass for arch, one_pass in INT64_BACKWARD])
def test_backward_int64_entry_points(arch, one_pass):
    """The backward past 2**31 elements: each form's 64-bit entry points compile from the same
    bodies, on the arch's tensor-core op, with no spills (D = 128, ragged, causal) and no
    TMA; so the one pass adds its dQ tiles by per-element reductions (REDG), not TMA
    reduce-adds. None spilled on any arch [tileiras 13.4, 2026-12-05]."""
    config = variants.SM90_ONE_PASS if one_pass else None
    cubins = aot.compile_backward(arch, "bfloat16", 128, config=config, int64_index=True)
    assert set(cubins) == set(aot.BACKWARD_KERNELS[one_pass])
    for name, cubin in cubins.items():
        sass = aot.disassemble(cubin)
        summary = aot.summarize(sass)
        assert summary["local_memory"] == 0 and summary["tma_load"] == 0, (name, summary)
        if name in ("dq", "dkdv"):
            assert_tensor_core_path(arch, sass, name)
        else:
            assert summary["tensor_core"] == 0, (name, summary)
        if name == "dkdv":
            assert (re.search(r"\bREDG\.E\.ADD\.F32", sass) is not None) == one_pass
            assert summary["tma_reduce"] == 0, summary


def test_bool_masks_load_through_tma_only_as_uint8():
    """sm_90 at a 16-aligned key length (the JIT's alignment, with which it may use TMA): a
    bool mask, which reaches the kernels as its uint8 view there, is loaded through TMA (more
    UTMALDG than without a mask, no plain global load), while the same mask typed bool never
    is (TMA misread bool tiles on the H200): no more UTMALDG than without a mask, plain loads
    instead. With TMA allowed for bool tiles, the bool-typed forward had no plain load."""
    config = variants.default_config((9, 0), 64)
    plain = _summary(aot.compile_forward("sm_90", dtype="bfloat16", head_dim=64, even_n=True))
    as_uint8 = _summary(aot.compile_forward("sm_90", dtype="bfloat16", head_dim=64,
                                            attn_mask="bool", even_n=True))
    sig = aot.forward_signature("bfloat16", 64, 64, (-1, 0), False, False, "bool", True, True,
                                config)
    params = list(sig.parameters)
    assert params[6].dtype == ct.uint8  # the mask, as _launch.kernel_mask passes it
    params[6] = dataclasses.replace(params[6], dtype=ct.bool_)
    as_bool = _summary(aot._export(_launch.hinted_kernel(config),
                                   dataclasses.replace(sig, parameters=params), "sm_90"))
    assert as_uint8["tma_load"] > plain["tma_load"] and as_uint8["global_load"] == 0, as_uint8
    assert as_bool["tma_load"] == plain["tma_load"] and as_bool["global_load"] > 0, as_bool
    assert as_uint8["local_memory"] == as_bool["local_memory"] == 0


def test_disassemble_reads_past_a_nop_nvdisasm_cannot_decode(monkeypatch):
    """tileiras 13.4 once wrote a NOP whose extended-opcode field nvdisasm's tables lack (the
    sm_90 D=128 dK/dV kernel with a TMA-read bool mask, checked below). The same field set in
    a plain NOP of another kernel stops cuobjdump; ``disassemble`` still lists the kernel, with
    the counts of the original, and says which NOP it rewrote. Any other failure is raised,
    and so is the same complaint about a NOP already plain (no endless retry)."""
    cubin = aot.compile_forward("sm_90", "bfloat16", 64, causal=False, even_n=True)
    (text, size), = aot._text_sections(cubin)
    at = cubin.index(aot.PLAIN_NOP, text)
    assert (at - text) % 16 == 0 and at + 16 <= text + size
    odd = cubin[:at + 8] + (0x000FE00000000000).to_bytes(8, "little") + cubin[at + 16:]
    with pytest.raises(RuntimeError, match="Opclass 'nop_', undefined value"):
        aot._run_on_cubin("cuobjdump", ["-sass"], odd)
    listing = aot.disassemble(odd)
    assert listing.startswith("// flash_tile.aot: NOPs nvdisasm could not decode")
    assert f"{at - text:#x}" in listing.splitlines()[0]
    assert aot.summarize(listing) == _summary(cubin)
    with pytest.raises(RuntimeError, match="cuobjdump failed"):
        aot.disassemble(b"not a cubin")

    def always(tool, args, data):
        raise RuntimeError(f"cuobjdump failed: nvdisasm error   : Opclass 'nop_', undefined "
                           f"value 0x10 for table 'TABLES_opex_1' at address {at - text:#x}")

    monkeypatch.setattr(aot, "_run_on_cubin", always)
    with pytest.raises(RuntimeError, match="undefined value"):
        aot.disassemble(cubin)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_bool_mask_at_an_aligned_ragged_length(arch):
    """Keys a multiple of 16 but not of the tiles (EVEN_N off, the bool mask as its uint8
    view): forward and both backward kernels load the mask through TMA, no global load added
    to the unmasked kernel's (a mask read without TMA adds 96-194 LDG on sm_90), and spill
    nothing, at D 64 and 128 (bf16, causal). The UTMALDG count is no measure: tileiras
    pipelines the masked dK/dV kernel of the D=64 default less deep (17 against 28). The
    control: at D=64 the same mask at a length TMA cannot read adds global loads to each."""
    def kernels(head_dim, attn_mask, aligned=True):
        kw = dict(dtype="bfloat16", head_dim=head_dim, attn_mask=attn_mask, aligned=aligned)
        cubins = {"forward": aot.compile_forward(arch, **kw), **aot.compile_backward(arch, **kw)}
        return {kernel: _summary(cubin) for kernel, cubin in cubins.items()}

    for head_dim in (64, 128):
        plain, masked = kernels(head_dim, None), kernels(head_dim, "bool")
        unaligned = kernels(head_dim, "bool", aligned=False) if head_dim == 64 else None
        for kernel in ("forward", "dkdv", "dq"):
            where = (arch, head_dim, kernel, masked[kernel], plain[kernel])
            assert masked[kernel]["global_load"] == plain[kernel]["global_load"], where
            assert masked[kernel]["local_memory"] == 0, where
            if unaligned:
                assert unaligned[kernel]["global_load"] > plain[kernel]["global_load"], where


BACKWARD_VARIANTS = {
    "fp16-d128-causal-ragged-dropout": dict(dtype="float16", head_dim=128, causal=True,
                                            even_n=False, dropout=True),
    "bf16-d64-gqa4-dropout-lse-grad": dict(dtype="bfloat16", head_dim=64, causal=True,
                                           even_n=False, group=4, lse_grad=True, dropout=True),
    "bf16-d64-window-softcap-alibi-mask": dict(dtype="bfloat16", head_dim=64, causal=True,
                                               window=(96, -1), softcap=True, alibi=True,
                                               attn_mask="bool", even_n=False),
}
# None may spill (the GQA-with-dropout instance spilled 1601 LDL/STL on sm_90 with the former
# D=64 default, 64x64 with 8 worker warps: NOTES.md).


@pytest.mark.parametrize("arch", variants.ARCHS)
def test_backward_kernels_use_tensor_cores(arch):
    for name, kw in BACKWARD_VARIANTS.items():
        for kernel, cubin in aot.compile_backward(arch, **kw).items():
            sass = aot.disassemble(cubin)
            summary = aot.summarize(sass)
            assert_tensor_core_path(arch, sass, (name, kernel))
            assert summary["exp2"] > 0, (arch, name, kernel, summary)
            assert summary["local_memory"] == 0, (arch, name, kernel, summary)
            if arch in aot.TMA_ARCHS:
                assert summary["tma_load"] > 0, (arch, name, kernel, summary)
            else:
                assert summary["tma_load"] == 0, (arch, name, kernel, summary)


# Every registered variant (variants.registered: the defaults and the autotuning candidates),
# compiled for each architecture of its family at the largest head dim it is registered for: a
# new entry in the registry is picked up here with no edit. No variant may spill except as
# listed (tileiras 13.4); a listed one must still spill, so that a stale entry cannot hide a
# regression. Keyed by ``autotune.describe``, which names the dQ kernel's own tiles too.
FORWARD_SPILLS = {
    # Empty since sm_90's 128x128 o2 (243 LDL/STL causal at D=64, registered for its H200
    # timings of 2026-12-01, commit 3f515c1) was dropped (2026-12-01, commit 7186579). A
    # candidate registered for its timings despite spills goes here, with what was seen.
}
BACKWARD_SPILLS = {
    ("sm_80", 256, "32x32 num_worker_warps=8 group_inner"): "dK/dV 578, dQ 242 LDL/STL",
    ("sm_86", 256, "32x32 num_worker_warps=8 group_inner"): "dK/dV 230",
    ("sm_89", 256, "32x32 num_worker_warps=8 group_inner"): "dK/dV 230",
    ("sm_80", 128, "64x32 num_worker_warps=8 group_inner"): "dK/dV 3",
    ("sm_86", 128, "64x32 num_worker_warps=8 group_inner"): "dK/dV 5",
    ("sm_89", 128, "64x32 num_worker_warps=8 group_inner"): "dK/dV 5",
    ("sm_90", 64, "128x64 occupancy=2 dq=64x64"): "dK/dV 23 (kept: 2-9% ahead of the default)",
    ("sm_100", 256, "64x64 num_worker_warps=8"): "dK/dV 1094, on HMMA (KNOWN_FALLBACKS)",
    ("sm_120", 256, "32x32 num_worker_warps=8 group_inner"): "dK/dV 543, dQ 203",
}


def _registered(backward):
    return [(arch, max_dim, config) for arch in variants.ARCHS
            for max_dim, config in variants.registered(variants.capability_of(arch), backward)]


def _name(arch, head_dim, config):
    return f"{arch}-d{head_dim}-{autotune.describe(config).replace(' ', '-')}"


FORWARD_REGISTERED, BACKWARD_REGISTERED = _registered(False), _registered(True)
# Every score feature of the forward at once: a two-sided window, softcap, ALiBi, a bool mask.
EVERY_SCORE_FEATURE = dict(causal=False, window=(200, 150), softcap=True, alibi=True,
                           attn_mask="bool")


@pytest.mark.parametrize("arch,head_dim,config", FORWARD_REGISTERED,
                         ids=[_name(*c) for c in FORWARD_REGISTERED])
def test_every_registered_forward_variant_compiles(arch, head_dim, config):
    sass = aot.disassemble(aot.compile_forward(arch, "bfloat16", head_dim, causal=True,
                                               config=config))
    summary = aot.summarize(sass)
    assert_tensor_core_path(arch, sass, forward=True)
    assert summary["exp2"] > 0, summary
    if arch in aot.TMA_ARCHS:
        assert summary["tma_load"] > 0, summary
    listed = (arch, head_dim, autotune.describe(config)) in FORWARD_SPILLS
    assert (summary["local_memory"] > 0) == listed, (summary, listed)


@pytest.mark.parametrize("arch,head_dim,config", FORWARD_REGISTERED,
                         ids=[_name(*c) for c in FORWARD_REGISTERED])
def test_every_registered_forward_variant_compiles_with_every_score_feature(arch, head_dim,
                                                                            config):
    """The tuner may launch any candidate for a class with features, so each must build with
    all of them at once (a two-sided window, softcap, ALiBi, a boolean mask), as
    tests/test_gpu_variants.py runs them on a GPU. Spills are allowed here: under all of
    them several tiles spill (on 2026-11-30, 6 of the 18 then registered: three sm_90
    candidates, sm_100's 128x128 and both sm_120 tiles at D<=128, its default among them, as
    KNOWN_SPILLS has for the mask alone; sm_90's 128x128 o2, registered and dropped on
    2026-12-01, spilled 2455 LDL/STL), and the tuner times them like any other.
    64x128 at D=256 failed to compile this way (tileiras 13.4, return code 5) and was
    dropped."""
    sass = aot.disassemble(aot.compile_forward(arch, "bfloat16", head_dim, config=config,
                                               **EVERY_SCORE_FEATURE))
    assert_tensor_core_path(arch, sass, forward=True)
    assert aot.summarize(sass)["exp2"] > 0


@pytest.mark.parametrize("arch,head_dim,config", BACKWARD_REGISTERED,
                         ids=[_name(*c) for c in BACKWARD_REGISTERED])
def test_every_registered_backward_variant_compiles(arch, head_dim, config):
    cubins = aot.compile_backward(arch, "bfloat16", head_dim, causal=True, config=config)
    assert tuple(cubins) == aot.BACKWARD_KERNELS[config.one_pass]
    for kernel in ("dkdv",) if config.one_pass else ("dkdv", "dq"):
        sass = aot.disassemble(cubins[kernel])
        assert_tensor_core_path(arch, sass, kernel, known=(arch, head_dim, kernel))
        assert aot.summarize(sass)["exp2"] > 0, kernel
    if config.one_pass:  # dQ summed by TMA reduce-adds, none by per-element atomics
        summary = _summary(cubins["dkdv"])
        assert summary["tma_reduce"] > 0, summary
        assert not re.search(r"\b(REDG|ATOMG)\.", aot.disassemble(cubins["dkdv"]))
    spills = sum(_summary(cubin)["local_memory"] for cubin in cubins.values())
    listed = (arch, head_dim, autotune.describe(config)) in BACKWARD_SPILLS
    assert (spills > 0) == listed, (spills, listed)


def test_known_fallbacks_still_hold():
    """KNOWN_FALLBACKS as measured, so that an entry goes once tileiras mends it: sm_100 at
    D=256 (bf16, causal, the default) runs dQ on UTCHMMA and through TMA, without spills, and
    dK/dV on HMMA only, with no UTMALDG, spilling."""
    assert set(KNOWN_FALLBACKS) == {("sm_100", 256, "dkdv")}  # a new entry needs its check
    cubins = aot.compile_backward("sm_100", "bfloat16", 256)
    dq, dkdv = aot.disassemble(cubins["dq"]), aot.disassemble(cubins["dkdv"])
    assert_tensor_core_path("sm_100", dq, "dq")
    assert _summary(cubins["dq"])["local_memory"] == 0
    assert {op for op, _ in aot.tensor_core_sites(dkdv)} == KNOWN_FALLBACKS["sm_100", 256, "dkdv"]
    summary = aot.summarize(dkdv)
    assert summary["tma_load"] == 0 and summary["local_memory"] > 0, summary


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_one_pass_backward_on_tma_archs(arch):
    """The one-pass form (SM90_ONE_PASS; registered for sm_90 only) at D=128 on both TMA
    architectures that reduce through it: dK/dV adds dQ by TMA reduce-adds (UTMAREDG: 16 on
    sm_90, 12 on sm_100), none per element (REDG/ATOMG), on the arch's tensor-core op; no
    kernel spills [tileiras 13.4, 2026-12-05, bf16, causal]."""
    cubins = aot.compile_backward(arch, "bfloat16", 128, config=variants.SM90_ONE_PASS)
    assert tuple(cubins) == aot.BACKWARD_KERNELS[True]
    sass = aot.disassemble(cubins["dkdv"])
    assert_tensor_core_path(arch, sass, "dkdv")
    assert aot.summarize(sass)["tma_reduce"] > 0
    assert not re.search(r"\b(REDG|ATOMG)\.", sass)
    for kernel, cubin in cubins.items():
        assert _summary(cubin)["local_memory"] == 0, kernel


@pytest.mark.parametrize("features", [
    dict(), dict(dropout=True), dict(group=4, lse_grad=True), dict(varlen=True, sinks=True),
    dict(window=(64, -1), softcap=True, alibi=True, attn_mask="bool")],
    ids=["plain", "dropout", "gqa4-lse-grad", "varlen-sinks", "window-softcap-alibi-mask"])
def test_sm90_d256_one_pass_default(features):
    """At D=256 the sm_90 default is the one-pass form (timed alone 0.78-0.90x the two passes'
    time, variants.py): its dK/dV adds dQ by TMA reduce-adds (UTMAREDG) on HGMMA, and neither
    it nor the convert kernel spills, under every feature; ``deterministic`` keeps the two
    passes. The preprocess, on 128-row tiles, spills under VARLEN with SINKS (12 LDL/STL,
    tileiras 13.4, 2026-12-04): a memory-bound kernel of a few loads a row, listed here so that
    the count is seen (an entry that stops spilling fails too)."""
    config = variants.default_backward_config((9, 0), 256)
    assert config == variants.SM90_ONE_PASS_WIDE and config.one_pass
    assert not variants.default_backward_config((9, 0), 256, deterministic=True).one_pass
    cubins = aot.compile_backward("sm_90", "bfloat16", 256, causal=True, **features)
    assert_tensor_core_path("sm_90", aot.disassemble(cubins["dkdv"]), features)
    assert _summary(cubins["dkdv"])["tma_reduce"] > 0
    for kernel, cubin in cubins.items():
        listed = kernel == "preprocess" and features.get("varlen") and features.get("sinks")
        assert (_summary(cubin)["local_memory"] > 0) == bool(listed), (kernel, features)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_dq_kernel_takes_its_own_tiles(head_dim):
    """SM90_BACKWARD (a candidate at D<=128) runs dQ on 128x64 and dK/dV on 64x128: only the
    dQ kernel's machine code changes when the dQ tiles are dropped, and the dQ kernel keeps
    free of spills with GQA 4 and dropout."""
    config = variants.SM90_BACKWARD
    assert (config.dq_kernel().tile_m, config.dq_kernel().tile_n) == (128, 64)
    own = aot.compile_backward("sm_90", "bfloat16", head_dim, config=config, group=4,
                               dropout=True)
    shared = aot.compile_backward("sm_90", "bfloat16", head_dim, group=4, dropout=True,
                                  config=dataclasses.replace(config, dq_tile_m=None,
                                                             dq_tile_n=None))
    assert own["dkdv"] == shared["dkdv"]
    assert own["dq"] != shared["dq"]
    assert_tensor_core_path("sm_90", aot.disassemble(own["dq"]), "dq")
    assert _summary(own["dq"])["local_memory"] == 0


@pytest.mark.parametrize("name", ["bf16-d64-gqa4-dropout-lse-grad",
                                  "bf16-d64-window-softcap-alibi-mask"])
def test_sm90_d128_backward_default_keeps_registers_under_features(name):
    """The D=128 backward default of classes with dropout or score features was chosen over a
    faster tile (64x64 o2, which spills 120 LDL/STL under dropout there) because it spills
    under them (variants.py). The matrix above compiles it at D=128 with dropout; this test
    compiles BACKWARD_VARIANTS' two D=64 feature instances at D=128."""
    config = variants.default_backward_config((9, 0), 128)
    assert config == variants.SM90_BACKWARD_O2_NARROW
    kw = dict(BACKWARD_VARIANTS[name], head_dim=128)
    for kernel, cubin in aot.compile_backward("sm_90", config=config, **kw).items():
        assert_tensor_core_path("sm_90", aot.disassemble(cubin), kernel)
        assert _summary(cubin)["local_memory"] == 0, kernel


PLAIN_CLASSES = {
    "gqa4-lse-grad-ragged": dict(causal=True, group=4, lse_grad=True, even_n=False),
    "gqa8-window": dict(causal=False, window=(200, 150), group=8),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", sorted(PLAIN_CLASSES))
def test_sm90_plain_backward_default_keeps_registers_under_gqa(head_dim, name):
    """Plain scores (no dropout, softcap, ALiBi or mask) get 64x64 o2 up to D=128: with GQA,
    the LSE's gradient, a window and ragged keys it spills nowhere, where the features'
    D=128 default spills 268-283 LDL/STL in dK/dV under any GQA group (variants.py)."""
    kw = PLAIN_CLASSES[name]
    cubins = aot.compile_backward("sm_90", "bfloat16", head_dim, **kw)  # the class's default
    assert variants.default_backward_config((9, 0), head_dim, plain=True) == \
        variants.SM90_BACKWARD_O2
    for kernel, cubin in cubins.items():
        assert_tensor_core_path("sm_90", aot.disassemble(cubin), kernel)
        assert _summary(cubin)["local_memory"] == 0, kernel
    if head_dim == 128 and kw["group"] == 4:  # the control: the features' default spills here
        narrow = aot.compile_backward("sm_90", "bfloat16", head_dim,
                                      config=variants.SM90_BACKWARD_O2_NARROW, **kw)
        assert _summary(narrow["dkdv"])["local_memory"] > 0


@pytest.mark.parametrize("features", [
    dict(causal=True, dropout=True),
    dict(causal=True, attn_mask="bool"),
    EVERY_SCORE_FEATURE,
], ids=["dropout", "bool-mask", "window-softcap-alibi-mask"])
def test_sm90_d64_forward_default_fits_three_ctas_under_features(features):
    """The D<=64 forward default is 64x64 with three CTAs per SM, chosen over four (faster on
    plain rows) because it spills under no feature (variants.py). Its registers must stay
    below the two-CTA tiles' 128, or the hint took no effect."""
    config = variants.default_config((9, 0), 64)
    assert config == variants.SM90_THREE_CTAS
    cubin = aot.compile_forward("sm_90", "bfloat16", 64, config=config, **features)
    assert_tensor_core_path("sm_90", aot.disassemble(cubin), forward=True)
    assert _summary(cubin)["local_memory"] == 0
    assert aot.resource_usage(cubin)["registers"] < 128


def test_forward_schedule_fields_reach_the_machine_code():
    """The load latency hints are compile-time constants that change the sm_90 forward's SASS:
    latency 1/1 pipelines the K-loop deeper than 2/4, and 2/4 deeper than 8/8 (more HGMMA
    copies of its body)."""
    def sass(**fields):
        config = variants.TileConfig(tile_m=64, tile_n=64, occupancy=2, **fields)
        return aot.disassemble(aot.compile_forward("sm_90", "bfloat16", 128, causal=False,
                                                   even_n=True, config=config))

    def mmas(text):
        return aot.summarize(text)["tensor_core"]

    default = sass()  # hints 2/4
    assert mmas(sass(latency_k=8, latency_v=8)) < mmas(default) < mmas(sass(latency_k=1,
                                                                          latency_v=1))


# The FP8 switch. QGMMA reads P from registers and Q from shared memory, so on sm_90 the
# matmuls tell apart by their A operand, and the row sum (P times a ones tile, SUM_MMA: wide
# unmasked key steps) by its 8 columns. Counts per compile (Q K^T, P V, row sum) [tileiras
# 13.4, 2026-12-05, the arch's FP8 config; two copies of the K-loop body, the unmasked and
# the masked run]: D=64 (64x128 o2) 2 + 4 a body, the even non-causal loop unrolled twice;
# D=128 (128x256 nww8) 4 + 8 per warp group, + 8 without causal; D=256 (128x128 nww8) 8 + 4.
FP8_QGMMA = {(64, False): (8, 16, 0), (64, True): (4, 8, 0), (128, False): (8, 16, 16),
             (128, True): (8, 16, 0), (256, False): (16, 8, 0), (256, True): (16, 8, 0)}
_QK = re.compile(r"\bQGMMA\.\S+\.E4M3\.E4M3\s+R\d+, gdesc")  # A from shared memory: Q K^T
_PV = re.compile(r"\bQGMMA\.64x(?!8x)\S+\.E4M3\.E4M3\s+R\d+, R\d+, gdesc")  # A from registers
_SUM = re.compile(r"\bQGMMA\.64x8x32\.\S+\s+R\d+, R\d+, gdesc")  # P times the ones: the row sum


@pytest.mark.parametrize("head_dim,causal", sorted(FP8_QGMMA))
def test_sm90_fp8_forward_runs_both_matmuls_on_qgmma_without_spills(head_dim, causal):
    sass = aot.disassemble(aot.compile_forward("sm_90", head_dim=head_dim, causal=causal,
                                               even_n=not causal, fp8=True))
    summary = aot.summarize(sass)
    counts = FP8_QGMMA[head_dim, causal]
    assert tuple(len(op.findall(sass)) for op in (_QK, _PV, _SUM)) == counts
    assert summary["tensor_core"] == sum(counts)  # no HGMMA left
    assert summary["local_memory"] == 0
    assert summary["tma_load"] > 0


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fp8_short_variant_runs_on_qgmma_without_spills(causal):
    """The D=128 variant of short calls (64x128, two CTAs an SM): both matmuls on QGMMA, as
    many of each (128 keys a step over D = 128), no row sum on the tensor cores (a 128-key
    step), no spills: 8 + 8 causal, 12 + 12 non-causal on an even length (the unmasked loop
    unrolled) [tileiras 13.4, 2026-12-07; 128 registers]."""
    cubin = aot.compile_forward("sm_90", head_dim=128, causal=causal, even_n=not causal,
                                fp8=True, config=variants.SM90_FP8_NARROW)
    sass = aot.disassemble(cubin)
    each = 8 if causal else 12
    assert tuple(len(op.findall(sass)) for op in (_QK, _PV, _SUM)) == (each, each, 0)
    summary = aot.summarize(sass)
    assert summary["tensor_core"] == 2 * each and summary["local_memory"] == 0


def test_fp8_exp2_fma_moves_exp2_from_the_mufu_to_the_fma_pipe():
    """The FP8 config's exp2_fma reaches the sm_90 machine code: at D = 128 (128x256 nww8,
    a quarter) the unmasked body's MUFU.EX2 fall by 32 (of 128 a thread and step) and its FFMA
    grow, with no spills and the same registers [tileiras 13.4, 2026-12-06: 260 -> 228 MUFU,
    305 -> 369 FFMA, 168 registers]."""
    def compiled(exp2_fma):
        config = dataclasses.replace(variants.fp8_config((9, 0), 128), exp2_fma=exp2_fma)
        cubin = aot.compile_forward("sm_90", head_dim=128, causal=False, even_n=True, fp8=True,
                                    config=config)
        sass = aot.disassemble(cubin)
        ops = dict(aot.opcode_histogram(sass, top=400))
        return ops, aot.summarize(sass), aot.resource_usage(cubin)

    assert variants.fp8_config((9, 0), 128).exp2_fma == 4
    (off, off_sum, off_res), (on, on_sum, on_res) = compiled(0), compiled(4)
    assert off["MUFU.EX2"] - on["MUFU.EX2"] == 32 and on["FFMA"] > off["FFMA"] + 32
    assert on_sum["local_memory"] == off_sum["local_memory"] == 0
    assert on_res["registers"] == off_res["registers"]


@pytest.mark.parametrize("arch,op", [("sm_100", "UTCQMMA"), ("sm_120", "QMMA")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_forward_uses_e4m3_tensor_cores_on_blackwell(arch, op, head_dim):
    sass = aot.disassemble(aot.compile_forward(arch, head_dim=head_dim, causal=True,
                                               even_n=False, fp8=True))
    assert aot.FP8_TENSOR_CORE_OP[arch] == op and ".E4M3" in sass
    assert_tensor_core_path(arch, sass, fp8=True, forward=True)  # no HMMA/HGMMA/UTCHMMA
    assert aot.summarize(sass)["local_memory"] == 0


@pytest.mark.parametrize("int64_index", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("v_head_dim,k_len", [(64, 4096), (96, 17), (128, 1000), (256, 113)])
def test_fp8_keys_major_copy_moves_whole_vectors(arch, v_head_dim, k_len, int64_index):
    """The V^T copy reads and writes global memory in 16-byte vectors (the transpose happens
    in shared memory), at ragged lengths and head dims too, without spills; its 64-bit-index
    entry point too."""
    sass = aot.disassemble(aot.compile_keys_major(arch, v_head_dim, k_len, int64_index))
    assert re.search(r"\bLDG\.E\.128\b", sass) and re.search(r"\bSTG\.E\.128\b", sass)
    assert not re.search(r"\bSTG\.E\.(U8|S8|8|16|U16)\b", sass)
    assert aot.summarize(sass)["local_memory"] == 0


def test_fp8_forward_composes_with_varlen_and_the_score_features():
    """VARLEN (V^T read through a row-stepping view), GQA-independent score features, sinks
    and a window: one sm_90 compile, still QGMMA for both matmuls."""
    sass = aot.disassemble(aot.compile_forward("sm_90", head_dim=128, causal=False,
                                               window=(100, 20), softcap=True, alibi=True,
                                               sinks=True, varlen=True, seqused_k=True,
                                               fp8=True))
    assert _QK.search(sass) and _PV.search(sass)
    assert not re.search(r"\bHGMMA\b", sass)
