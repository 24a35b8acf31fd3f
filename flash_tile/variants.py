"""Tile configurations of the forward kernel, one small frozen record per variant.

A variant is everything the launch needs beyond the problem itself: the tile shape and the
compiler hints of ``cuda.tile.kernel``. Each architecture family has a default; a record says
what was measured for it, on what and when, or that nothing was.
"""

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and compiler hints of one forward variant.

    ``tile_m`` query rows per program, ``tile_n`` key rows per step of the K-loop; both powers
    of two (cuTile tiles are). ``occupancy`` is the CTAs-per-SM hint, ``num_ctas`` the CGA size
    hint, ``num_worker_warps`` the warps of the compute warp groups; None leaves the choice to
    tileiras. ``group_inner`` orders the backward's dK/dV loops (only the backward has them):
    all query heads of a GQA group per query tile (True) or one head at a time (False).
    ``dq_tile_m`` and ``dq_tile_n`` (backward) are the dQ kernel's own query rows per program
    and key rows per step (it also forms Delta for those rows); None takes ``tile_m`` /
    ``tile_n``, which the dK/dV kernel reads (key rows per program ``tile_n``, query rows per
    step ``tile_m``). ``one_pass`` (backward) runs the one-pass form: dK/dV also adds dQ into
    an fp32 accumulator (TMA reduce-adds), with no dQ kernel; the dQ tiles then size the small
    preprocess and convert kernels. Its dQ is not bitwise reproducible.
    The forward alone reads the rest: ``latency_k`` and ``latency_v`` are the DRAM-latency hints
    (1-10) of its K and V tile loads; ``exp2_fma`` (the FP8 forward's alone: 0, 2 or 4) takes
    the exp2 of the last 1 / exp2_fma of each unmasked key step's columns from the FMA pipe
    (``_tiles.exp2_fma``), 0 none; ``page_ahead`` (the PAGED switch's alone, on joined page
    loads) reads each unmasked key step's block-table entries a step ahead.
    """

    tile_m: int = 64
    tile_n: int = 64
    occupancy: int | None = None
    num_ctas: int | None = None
    num_worker_warps: int | None = None
    group_inner: bool = False
    dq_tile_m: int | None = None
    dq_tile_n: int | None = None
    latency_k: int = 2
    latency_v: int = 4
    one_pass: bool = False
    exp2_fma: int = 0
    page_ahead: bool = False

    def __post_init__(self):
        for name in ("tile_m", "tile_n", "dq_tile_m", "dq_tile_n"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("latency_k", "latency_v"):
            if not 1 <= getattr(self, name) <= 10:
                raise ValueError(f"{name} must be in 1..10 (cuTile's range), got "
                                 f"{getattr(self, name)}")
        if self.exp2_fma not in (0, 2, 4):
            raise ValueError(f"exp2_fma must be 0, 2 or 4, got {self.exp2_fma}")

    def hints(self) -> dict:
        """The ``kernel.replace_hints`` keywords this config sets (None ones are left out)."""
        hints = {"occupancy": self.occupancy, "num_ctas": self.num_ctas,
                 "num_worker_warps": self.num_worker_warps}
        return {k: v for k, v in hints.items() if v is not None}

    def dq_kernel(self) -> "TileConfig":
        """The config the backward's dQ kernel runs with: its own tiles where set (``self``
        when neither is). Made once per config: every backward call asks."""
        return _dq_kernel(self)


@functools.cache
def _dq_kernel(config: TileConfig) -> TileConfig:
    if config.dq_tile_m is None and config.dq_tile_n is None:
        return config
    return replace(config, tile_m=config.dq_tile_m or config.tile_m,
                   tile_n=config.dq_tile_n or config.tile_n, dq_tile_m=None, dq_tile_n=None)


def tile_width(dim: int, least: int = 16) -> int:
    """The tile width that holds ``dim``: tiles are powers of two, and 16 is the smallest K of
    an fp16/bf16 tensor-core matmul."""
    return max(least, 1 << max(dim - 1, 0).bit_length())


# Timings: NVIDIA H200, cuda-tile 1.7.0 / tileiras 13.4, the benchmark grid's rows (B*L = 16k
# tokens, H*D = 2048), causal and not unless named; "0.9x" is a time over the named tile's.
# Spill counts (LDL/STL) and registers are from cuobjdump of tileiras 13.4 cubins.

# Hopper, 64<D<=128: 128x128 with 8 worker warps, two consumer warp groups of 64 rows each (FA3's
# split of a 128-row tile; 168 registers, no spills, 133 KB of shared memory at D=128; without
# the 8-warp hint 255 registers, 620 LDL/STL and about 250 TFLOP/s). At D=128 the tuner's pick
# in 22 of 26 classes, 2-20% ahead of 64x64 o2 from 2k on (1.83 against 2.08 ms at 16k causal,
# bf16); at 1k the runs disagree (64x64 o2 or 128x64 o2 ahead by 0.4-7%) [H200, 2026-11-30,
# bf16 and fp16, three runs; every candidate's time in
# docs/experiments/evidence/2026-11-30-tuning-h200-d7e2113.json].
SM90_TWO_GROUPS = TileConfig(tile_m=128, tile_n=128, num_worker_warps=8)
# D<=64: three CTAs per SM, each one consumer warp group on 64x64 at 80 registers (no spills
# with dropout, a boolean mask, or a window with softcap, ALiBi and a mask; 26-55 KB of shared
# memory a CTA): 0.813-0.967x the time of SM90_TWO_GROUPS on every row [H200, 2026-12-01, bf16,
# bench_variants.py, L 1k/4k/16k;
# docs/experiments/evidence/2026-12-01-variants-h200-fwd-d64-o3o4.md]. Four CTAs took
# 0.772-0.953x but spill (below). At D=128 the accumulator alone is 64 registers a thread and
# tileiras keeps 128 whatever the hint: no third CTA fits.
SM90_THREE_CTAS = TileConfig(tile_m=64, tile_n=64, occupancy=3)
# 128x64 with two CTAs per SM: the D<=64 default the H200 tuning runs of 2026-11-30 chose
# (9a2ba51; the runs in docs/experiments/evidence/2026-11-30-tuning-h200-*.json), a tuning
# candidate at D<=128 since the two-group tile and then three CTAs took D<=64 over.
SM90_NARROW = TileConfig(tile_m=128, tile_n=64, occupancy=2)
# D=256: 128x64 with 8 worker warps, the two-group split again (no spills; it spills without
# the hint): it won all 10 bf16 classes (L 1k-16k), 9.5-17% ahead of 64x128 (3.30 against
# 3.72 ms at 16k, non-causal) and 27-44% ahead of 64x64 o2 [H200, 2026-11-30;
# docs/experiments/evidence/2026-11-30-tuning-h200-24330b4.json].
SM90_WIDE = TileConfig(tile_m=128, tile_n=64, num_worker_warps=8)

# Ampere and Ada: 64x32 with 8 worker warps compiles with no spill at D=64 and D=128 (162 and
# 219 registers with the heaviest-first query index of f69088c; cp.async + 128-bit loads);
# 64x64 spills 16 LDL/STL at D=64. Above D=128 64x32 spills (434 at D=256) and 32x32 with 8
# worker warps does not (227 registers). [2026-11-30, sm_80 cubins with the JIT's shape/stride
# specialisation reproduced (flash_tile.aot); not yet timed on such a GPU.]
SM80_DEFAULT = TileConfig(tile_m=64, tile_n=32, num_worker_warps=8)
SM80_WIDE = TileConfig(tile_m=32, tile_n=32, num_worker_warps=8)

# Blackwell datacenter (sm_100, tcgen05): 64x64 compiles to UTCHMMA with no spill up to D=256
# (tests/test_aot.py); not yet timed, so the hints are left to the compiler.
SM100_DEFAULT = TileConfig(tile_m=64, tile_n=64)

# Blackwell consumer (sm_120, mma.sync + TMA): 64x64 has no spill up to D=128; at D=256 it
# spills (440 LDL/STL); 32x64 with 8 worker warps does not (168 registers) [2026-11-30,
# tileiras 13.4 cubins; not yet timed on such a GPU].
SM120_DEFAULT = TileConfig(tile_m=64, tile_n=64)
SM120_WIDE = TileConfig(tile_m=32, tile_n=64, num_worker_warps=8)

# FP8 (the forward's FP8 switch), never tuned: e4m3 halves a key tile's bytes, and on sm_90
# the kernel alone (V^T made once, outside the timed call) ran fastest on wider key steps.
# At D=128, 128x256 with 8 worker warps took 0.87-0.96x the time of the bf16 default 128x128
# on 5 of 6 rows (1.05x at 1k causal; 128x64 1.18-1.27x, 64x128 1.30-1.36x); at D=64, 64x128
# o2 0.95-1.00x of 64x64 o3 (128x256 nww8 0.93-1.07x, 128x128 nww8 1.04-1.12x; non-causal
# rows) [H200, 2026-12-03, bench_variants.py --dtype fp8, L 1k/4k/16k;
# docs/experiments/evidence/2026-12-03-fp8-h200.md]. Since the tensor core accumulates both
# matmuls itself (use_fast_acc; no second accumulator), 128x128 nww8 compiles without spills
# at D=256 and took 0.84-0.94x the time of the bf16 default 128x64 there (64x128 nww8
# 1.61-1.84x); at D=128 it took 0.87-0.99x of 128x256 at L <= 8k but 1.04x at 8k causal and
# 1.07-1.08x at 16k, so 128x256 stayed [H200, 2026-12-03, L 1k-16k;
# docs/experiments/evidence/2026-12-03-fp8-fast-acc-h200.md]. All compile to QGMMA for both
# matmuls with no spills (D=64: 128 registers, D=128 and 256: 168); 128x256 spills 31 LDL/STL
# on sm_120, so other GPUs launch the bf16 defaults, untimed [tileiras 13.4 SASS].
# exp2_fma=4 (a quarter of each unmasked step's exp2 on the FMA pipe) at D=128, where the
# MUFU's exp2 of a 128x256 tile take as long as its matmuls: 0.91-0.999x the time non-causal
# (8 measurements of 4k-16k rows in three runs), 1.02x causal at 4k and 8k (0.965-1.033x at
# 16k); head dims 65-127 share it, untimed; bench_fp8 at 16k, two runs back to back,
# 895 -> 919 TFLOP/s non-causal, 889 -> 887 causal. A half lost everywhere (1.02-1.14x);
# at D=64 a quarter lost too (1.03-1.05x); at D=256 0.92-0.99x causal, 0.96-1.02x non-causal,
# left off [H100, 2026-12-07,
# bench_variants.py --dtype fp8 --baseline;
# docs/experiments/evidence/2026-12-07-fp8-exp2-fma-h100.md]. An A/A of that harness the same
# day gave 0.934-1.001x for identical kernels, so the calls were paired (``--paired 15``:
# neighbouring calls, against kernels with the switch cut out, an A/A beside it at
# 0.999-1.000x): D=128 0.976x/0.959x non-causal at 4k/16k, 1.018x/1.023x causal; D=256
# 1.005x/1.007x non-causal. So the quarter serves D=128 calls without a diagonal alone
# (``fp8_config``'s ``causal``) [H200, 2026-12-07, commit 1f8b2e4;
# docs/experiments/evidence/2026-12-07-fp8-exp2-paired-h200.md].
# Causal at D=128, 128x128 nww8 against 128x256 by the same paired calls: 0.866x / 0.927x /
# 0.964x / 0.987x the time at 1k / 2k / 3k / 4k keys, 1.006x / 1.018x / 1.036x / 1.065x at
# 5k / 6k / 8k / 16k (a diagonal tile of 256 keys masks more of its work the fewer key steps
# a row has); non-causal, 128x128 lost at every length (1.08-1.23x at 1k-8k), and 64-key
# steps lost on 23 of 24 rows at D 64/128/256 (1.05-1.38x; 0.986x at D=128 1k causal) [H100,
# 2026-12-07, commit c51c822, bench_variants.py --dtype fp8 --paired 15, an A/A beside it at
# 0.996-1.000x; docs/experiments/evidence/2026-12-07-fp8-tile-n-paired-h100.md]; and against
# that 128x128, 64x128 o2 (D=64's tile) took 0.934x / 0.953x / 0.969x at 1k / 2k / 4k (64x128
# without the hint 1.30-1.34x; at D=256 both 1.20-1.26x) [same evidence, section 4, commit
# 5a9a76e]. So dense calls of at most FP8_SHORT_KEYS[causal] keys run 64x128 o2: non-causal,
# it took 0.912x / 0.989x / 1.052x the time of 128x256 at 1k / 2k / 4k [same evidence,
# section 5, commit 90d848f]. Past those first limits (4,096 causal, 2,048 non-causal), 64x128
# o2 against 128x256 by the same paired calls: causal 0.980x / 0.994x / 1.016x at 5k / 6k /
# 8k keys, non-causal 1.033x / 1.069x at 3k / 5k; so causal calls take it up to 6,144 keys
# [H100, 2026-12-07, commit eeb8256, A/A 0.997-1.000x;
# docs/experiments/evidence/2026-12-07-fp8-short-keys-backward-h100.md]. Varlen calls keep
# 128x256, untimed: their max_seqlen_k is never read (a tensor's value would sync,
# torch.compile guard on it).
SM90_FP8_NARROW = TileConfig(tile_m=64, tile_n=128, occupancy=2)
SM90_FP8 = TileConfig(tile_m=128, tile_n=256, num_worker_warps=8, exp2_fma=4)
SM90_FP8_CAUSAL = replace(SM90_FP8, exp2_fma=0)
FP8_SHORT_KEYS = {True: 6144, False: 2048}  # by causal: the most keys of a short call

# Per compute capability: (largest head dim, config) buckets, narrowest first. A head dim is
# the larger of the query/key and value head dims.
_DEFAULTS = {
    (8, 0): ((128, SM80_DEFAULT), (256, SM80_WIDE)),
    (9, 0): ((64, SM90_THREE_CTAS), (128, SM90_TWO_GROUPS), (256, SM90_WIDE)),
    (10, 0): ((256, SM100_DEFAULT),),
    (12, 0): ((128, SM120_DEFAULT), (256, SM120_WIDE)),
}

_FP8_DEFAULTS = {**_DEFAULTS,
                 (9, 0): ((64, SM90_FP8_NARROW), (128, SM90_FP8), (256, SM90_TWO_GROUPS))}
_FP8_CAUSAL_DEFAULTS = {**_DEFAULTS, (9, 0): (
    (64, SM90_FP8_NARROW), (128, SM90_FP8_CAUSAL), (256, SM90_TWO_GROUPS))}
# Dense FP8 calls of at most FP8_SHORT_KEYS[causal] keys, causal or not.
_FP8_SHORT_DEFAULTS = {**_DEFAULTS, (9, 0): (
    (64, SM90_FP8_NARROW), (128, SM90_FP8_NARROW), (256, SM90_TWO_GROUPS))}

# The forward's PAGED switch (keys joined from page loads or gathered; never tuned) keeps the
# default tile where it compiles without spills, and narrows it where it does not: on
# sm_100 at D=256 64x64 spilled 344 LDL/STL on 16-key pages, 64x32 none on 16- or 1-key
# pages; on sm_120 at D<=128 64x64 spilled 40 / 108 / 155 on 64- / 32- / 16-key pages and
# 60 gathered (D=128 causal), 64x32 none (D=64 and 128), while its D=256 tile (32x64 nww8)
# spills none; sm_80-sm_90 spill none on 16-key and gathered pages at D 64-256 [compiled
# only: tileiras 13.4, cuda-tile 1.7.0, 2026-12-07; no sm_100 or sm_120 GPU lent].
# sm_90 at D=128 reads each key step's block-table entries a step ahead (``page_ahead``):
# the paged call took 0.73x / 0.75x / 0.56x the time on 256- / 64- / 16-key pages
# (bench_variants.py --varlen 16384 --pages N --paired 4, H100, 2026-12-07), though on
# 16-key pages it spills 14 LDL/STL. Off where it was never timed (sm_90 at D=64 and 256,
# sm_80-sm_100); on sm_120 it spilled 48 (16-key pages) and 570 (an FP8 cache).
PAGED_NARROW = TileConfig(tile_m=64, tile_n=32)
_PAGED_DEFAULTS = {**_DEFAULTS,
                   (9, 0): ((64, SM90_THREE_CTAS),
                            (128, replace(SM90_TWO_GROUPS, page_ahead=True)), (256, SM90_WIDE)),
                   (10, 0): ((128, SM100_DEFAULT), (256, PAGED_NARROW)),
                   (12, 0): ((128, PAGED_NARROW), (256, SM120_WIDE))}

#: Architectures the kernels are built and checked for, as ``sm_XY`` names.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


def default_config(capability: tuple[int, int], head_dim: int = 128) -> TileConfig:
    """The default variant for a compute capability such as ``(9, 0)`` and a head dim.

    A capability with no entry (sm_86, sm_89, sm_103, a newer GPU) gets the entry of the
    nearest older one.
    """
    return _lookup(_DEFAULTS, capability, head_dim)


def fp8_config(capability: tuple[int, int], head_dim: int = 128, causal: bool = False,
               key_len: int | None = None) -> TileConfig:
    """The FP8 forward's variant (never tuned), as ``default_config``; ``causal``: the call's
    keys end at a diagonal (causal, or any window with a right bound), whose variant may
    differ (sm_90 D=128: no exp2 on the FMA pipe); ``key_len``: a dense call's key length
    (None for unknown), which at most ``FP8_SHORT_KEYS[causal]`` takes the short calls'
    variant (sm_90 D=128: 64x128, two CTAs an SM, as D=64)."""
    if key_len is not None and key_len <= FP8_SHORT_KEYS[causal]:
        return _lookup(_FP8_SHORT_DEFAULTS, capability, head_dim)
    return _lookup(_FP8_CAUSAL_DEFAULTS if causal else _FP8_DEFAULTS, capability, head_dim)


def paged_config(capability: tuple[int, int], head_dim: int = 128) -> TileConfig:
    """The variant of the varlen forward against paged keys (``flash_attn_varlen_func`` with
    a block table; never tuned), as ``default_config``."""
    return _lookup(_PAGED_DEFAULTS, capability, head_dim)


def _family(table, capability):
    """The (largest head dim, config) entries of the newest family not newer than
    ``capability``."""
    known = [c for c in table if c <= tuple(capability)]
    if not known:
        raise ValueError(f"no tile config for compute capability {capability}: needs 8.0+")
    return table[max(known)]


def _lookup(table, capability, head_dim):
    for max_dim, config in _family(table, capability):
        if head_dim <= max_dim:
            return config
    raise ValueError(f"no tile config for head dim {head_dim}: the largest is {max_dim}")


# The backward holds dK and dV (or dQ) accumulators beside K and V: more registers than the
# forward. On sm_80 and sm_120 walking the GQA group's heads in an outer loop spilled 400-2500
# LDL/STL at every shape tried; with the heads inside each query tile (group_inner) and 8
# worker warps the D<=128 tiles spilled none (that order spills ~3000 on sm_90). At D=256
# 32x32 still spilled on sm_80/sm_120 (592/198 and 479) and sm_100's 64x64 with 8 worker warps
# 1080 [2026-11-30; not yet timed on such GPUs; today's counts: tests/test_aot.py's
# BACKWARD_SPILLS].
# SM90_BACKWARD, an sm_90 candidate at D<=128: each kernel timed alone wants its rows tall and
# its steps narrow: dQ at D=64 ran 0.47-0.73x as long on 128x64 as on 64x128 (3.18 against
# 5.15 ms at 16k causal), dK/dV at D=128 0.79-0.86x as long on 64x128 as on 128x64 (4.04
# against 5.13 ms at 16k causal) [H200, 2026-11-30, bf16, L 1k/4k/16k, five interleaved
# rounds; docs/experiments/evidence/2026-11-30-experiments-h200.md]. No spills at D<=64 with
# GQA, dropout, softcap, ALiBi and a mask; at D=128 its dK/dV spills 16 LDL/STL with dropout,
# 38 with GQA 4 and dropout, 191 with a window, softcap, ALiBi and a mask (128x64 nww8: 0, 145
# and 0).
SM90_BACKWARD = TileConfig(tile_m=64, tile_n=128, num_worker_warps=8, dq_tile_m=128,
                           dq_tile_n=64)
# D=256 on sm_90: dK/dV on 64x64 with 8 worker warps (without the hint it spills 1172 LDL/STL),
# dQ owning 128 query rows and stepping 32 keys: the whole backward took 0.81-0.85x the time of
# 64x64 for both kernels on every bf16 row; dQ stepping 32 keys with 64 rows took 1.00-1.19x
# and dK/dV stepping 32 queries (dQ on 128x32) 1.06-1.11x [H200, 2026-12-01, bench_variants.py,
# L 1k/4k/16k; docs/experiments/evidence/2026-12-01-variants-h200-d256-backward.md]. The 128x32
# dQ spills none plain, 7 LDL/STL with a window, softcap, ALiBi, a mask and dropout; 128x64
# spills 2380.
SM90_BACKWARD_WIDE = TileConfig(tile_m=64, tile_n=64, num_worker_warps=8, dq_tile_m=128,
                                dq_tile_n=32)
# Two CTAs per SM instead of two consumer warp groups in one, both kernels on 64x64:
# 0.907-0.99x the time of SM90_BACKWARD at D=64 and 0.812-0.914x that of 128x64 nww8 at D=128,
# every row [H200, 2026-12-01, bf16, bench_variants.py, L 1k/4k/16k;
# docs/experiments/evidence/2026-12-01-variants-h200-bwd-o2.md]. The D<=64 default: no spills
# with GQA 4, dropout and the LSE's gradient, nor with a window, softcap, ALiBi and a mask
# (sm_90 SASS, 128 registers). At D=128 its dK/dV spills 120 LDL/STL under dropout (108 before
# the scale-once change, 23d1e78), so there it is the default of plain classes only
# (_PLAIN_BACKWARD) and a candidate for the others.
SM90_BACKWARD_O2 = TileConfig(tile_m=64, tile_n=64, occupancy=2)
# The D=128 default under dropout and the score features (plain classes: _PLAIN_BACKWARD): two
# CTAs per SM with dK/dV stepping 32 queries, dQ on 64x64: 0.891-0.983x the time of 128x64
# nww8 on every row, where SM90_BACKWARD_O2 took 0.812-0.919x [H200, 2026-12-01, bf16,
# bench_variants.py, L 1k/4k/16k;
# docs/experiments/evidence/2026-12-01-variants-h200-bwd-d128-32x64o2.md]. Unlike
# SM90_BACKWARD_O2 it compiles without spills at D=128 under dropout, GQA 4 with dropout and
# the LSE's gradient, and a window with softcap, ALiBi and a mask (sm_90 SASS); under GQA
# without dropout its dK/dV spills 268-283 (22 with GQA 4 and a bool mask, where
# SM90_BACKWARD_O2 spills 44) [2026-12-01, after 23d1e78]. Registered up to D=128; at D=64
# the tuner put it at 1.19-1.39x the time of the D<=64 default on every row [H200, 2026-12-01,
# fp16; docs/experiments/evidence/2026-12-01-backward-h200-fp16-{a7677c0,tilegym}.json].
SM90_BACKWARD_O2_NARROW = TileConfig(tile_m=32, tile_n=64, occupancy=2, dq_tile_m=64,
                                     dq_tile_n=64)
# dK/dV stepping 128 queries over its 64 keys, dQ on 64x64, two CTAs per SM: the shape TileGym
# 1.5.1's tuner took for its dK/dV at D=64 (its backward ran 1.05-1.29x flash_tile's fp16 rate
# there on every row but 1k causal [H200, 2026-12-01;
# docs/experiments/evidence/2026-12-01-backward-h200-fp16-tilegym.md]). 0.906-0.988x the time
# of SM90_BACKWARD_O2 on every row [H200, 2026-12-01, bf16, bench_variants.py --backward,
# L 1k/4k/16k; docs/experiments/evidence/2026-12-01-variants-h200-bwd-d64-tilegym-shapes.md];
# 0.906-0.980x with the scale applied once in both kernels (23d1e78;
# docs/experiments/evidence/2026-12-01-ab-h200-bwd-scale-once.md). Its dK/dV spills 23-35
# LDL/STL plain (584 under dropout, 998 with a window, softcap, ALiBi and a mask; sm_90 SASS),
# so it is a D<=64 candidate, not the default. In the same run dQ on 64x128 (TileGym's dQ
# shape) took 1.005-1.039x, and at D=128 dQ on 64x32 1.013-1.156x
# (docs/experiments/evidence/2026-12-01-variants-h200-bwd-d128-dq64x32.md): neither registered.
SM90_BACKWARD_O2_Q128 = TileConfig(tile_m=128, tile_n=64, occupancy=2, dq_tile_m=64,
                                   dq_tile_n=64)
_BACKWARD_DEFAULTS = {
    (8, 0): ((256, TileConfig(tile_m=32, tile_n=32, num_worker_warps=8, group_inner=True)),),
    (9, 0): ((64, SM90_BACKWARD_O2),
             (128, SM90_BACKWARD_O2_NARROW),
             (256, SM90_BACKWARD_WIDE)),
    (10, 0): ((256, TileConfig(tile_m=64, tile_n=64, num_worker_warps=8)),),
    (12, 0): ((256, TileConfig(tile_m=32, tile_n=32, num_worker_warps=8, group_inner=True)),),
}
# A default above chosen for keeping its registers under dropout and the score features, and
# the faster tile it gives way to in classes with plain scores (no dropout, softcap, ALiBi or
# mask; a window, ragged lengths, GQA and the LSE's gradient allowed). At D=128 on sm_90
# [sm_90 SASS, tileiras 13.4, bf16, 2026-12-01]: SM90_BACKWARD_O2 spills nowhere there, GQA
# groups 2-8 included, where SM90_BACKWARD_O2_NARROW's dK/dV spills 268-283 LDL/STL under
# any GQA group without dropout; under the features it is the other way round (SM90_BACKWARD_O2
# spills 6-201: 174 under softcap, 120 under dropout). SM90_BACKWARD_O2 took 0.895-0.982x the
# backward time of SM90_BACKWARD_O2_NARROW in the tuner's 16 timings of the 12 plain D=128
# classes [H200, 2026-12-01, bf16 and fp16, L 1k-16k, causal and not; the "variant_ms" of
# docs/experiments/evidence/2026-12-01-backward-h200-*-{a7677c0,f89ba83}.json].
_PLAIN_BACKWARD = {SM90_BACKWARD_O2_NARROW: SM90_BACKWARD_O2}

# The one-pass backward (``TileConfig.one_pass``): dK/dV adds dQ into fp32 with TMA
# reduce-adds, so only where TMA exists (sm_90, sm_100); elsewhere per-element atomics, which
# on the H200 took 1.02-3.05x the two passes' time [2026-11-30, docs/experiments/README.md].
# A pair of tiles adds TILE_M x D fp32 values for 10 TILE_M TILE_N D flops: 128 keys a
# program halves the reduce traffic of 64. sm_90 SASS (tileiras 13.4, bf16, causal): 64x128
# with 8 worker warps spills nowhere at D 64/128 (96 HGMMA at D=128, 16 UTMAREDG); 64x64 o2
# spills nowhere either; 64x128 with one warp group spills 972-2778 LDL/STL [2026-12-02].
SM90_ONE_PASS = TileConfig(tile_m=64, tile_n=128, num_worker_warps=8, one_pass=True)
# D=256: the two-pass default's tiles (dK/dV on 64x64 with 8 worker warps; 128-row preprocess
# and convert programs) in the one-pass form.
SM90_ONE_PASS_WIDE = replace(SM90_BACKWARD_WIDE, one_pass=True)
# Against the two-pass default (64x64 o2 in both kernels) the one pass on SM90_ONE_PASS took
# 1.03-1.35x the time at L 1k/4k and 0.96-1.02x at 16k (D 64/128, causal and not); 64x64 o2
# in the one-pass form 1.01-1.56x SM90_ONE_PASS's [H200, 2026-12-02, bf16, bench_variants.py
# --backward; docs/experiments/evidence/2026-12-02-variants-h200-bwd-one-pass.md]. The reduce
# traffic (1/TILE_N of a dQ per key tile: 2 GiB at 4k causal, D=128, against 1.9 ms) is the
# suspect: not the default at D<=128, where the tuner takes it where it wins. At D=256, where
# the two passes' dQ kernel steps 32 keys, SM90_ONE_PASS_WIDE took 0.78-0.90x the time of
# SM90_BACKWARD_WIDE on every row (L 1k/4k/16k, causal and not) [H200, 2026-12-02, bf16,
# bench_variants.py --backward;
# docs/experiments/evidence/2026-12-02-variants-h200-bwd-one-pass-d256.md]; in the backward
# grid of 2026-12-04 (bench/results/backward-h200.md, tree 2ae68ea) the two passes took
# 1.11-1.28x its time on the device, and it ran at 0.98-1.15x cuDNN's.
# The default unless ``deterministic``: (largest head dim, config) per family, as
# _BACKWARD_DEFAULTS's families, None for the two passes (also past the last entry).
_ONE_PASS_DEFAULTS = {
    (8, 0): (),
    (9, 0): ((128, None), (256, SM90_ONE_PASS_WIDE)),
    (10, 0): (),
    (12, 0): (),
}


def is_plain(softcap: bool, alibi: bool, attn_mask, dropout: bool) -> bool:
    """Whether a problem class is plain (``autotune.problem_key``'s word): no softcap, ALiBi,
    attention mask (any kind; None or a falsy name when there is none) or dropout."""
    return not (softcap or alibi or attn_mask or dropout)


def default_backward_config(capability: tuple[int, int], head_dim: int = 128,
                            plain: bool = False, deterministic: bool = False) -> TileConfig:
    """The default variant of the backward kernels, looked up as ``default_config``: the
    one-pass form where the family has one for the head dim, unless ``deterministic``; else
    the two passes, with ``plain`` for a class with no dropout, softcap, ALiBi or attention
    mask (``is_plain``)."""
    if not deterministic:
        one_pass = [config for max_dim, config in _family(_ONE_PASS_DEFAULTS, capability)
                    if head_dim <= max_dim]
        if one_pass and one_pass[0] is not None:
            return one_pass[0]
    config = _lookup(_BACKWARD_DEFAULTS, capability, head_dim)
    return _PLAIN_BACKWARD.get(config, config) if plain else config


# Candidates the autotuner times (``flash_tile.autotune``), per architecture family, as
# (largest head dim, config); the family's defaults are always among them. Adding a variant is
# one entry here: tests/test_aot.py compiles every entry for the family's architectures. Each
# candidate costs a compile and a timing (two compiles in the backward) on a class's first call.
_FORWARD_CANDIDATES = {
    # The defaults only: 64x64 and 128x32 with 8 worker warps spill at D=128 (12 and 212
    # LDL/STL); none timed on Ampere/Ada yet. More CTAs per SM, the H200's D=64 lever, spill
    # here: 64x64 with occupancy 2, 3 and 4 spills 24, 493 and 234 LDL/STL at D=64, causal
    # [2026-12-01].
    (8, 0): ((128, SM80_DEFAULT), (256, SM80_WIDE)),
    # Beside the defaults on sm_90 [H200, bf16]:
    # - 128x64 o2: the tuner's pick at D=64 for L 1k/2k [2026-11-30, the tuning run above].
    # - SM90_WIDE at D<=128 too (no spills at D=64/128/256, 168 registers): 0.4-56% behind
    #   128x128 there, 3-25% from 2k on [2026-11-30, the same run].
    # - 64x64 o4 at D<=64 (four CTAs per SM at 64 registers): 0.772-0.953x the time of 128x128
    #   nww8, ahead of SM90_THREE_CTAS on every row [2026-12-01, SM90_THREE_CTAS's run]. It
    #   spills under a boolean mask (32 LDL/STL), the score features (141) and dropout (2).
    # - 64x128 o2 at D<=128 (two one-group CTAs per SM, 128 registers, no spills at D=128):
    #   0.898-0.974x the time of 128x128 nww8 on five D=128 rows, 1.045x at 16k causal; at
    #   D=64 0.872-0.967x on five rows, 1.05x at 16k causal [2026-12-01, bench_variants.py,
    #   L 1k/4k/16k; docs/experiments/evidence/2026-12-01-variants-h200-fwd-d128-o2.md,
    #   docs/experiments/evidence/2026-12-01-variants-h200-fwd-d64-64x128o2.md]. Not the
    #   default: under a window, softcap, ALiBi and a boolean mask it spills 82 LDL/STL at D=64
    #   and 146 at D=128, where 128x128 nww8 spills none.
    # Timed and not registered (time over the tile named):
    # - 64x64 o2: never the fastest in 64 plain classes, at 1.087-1.499x the best [2026-12-01,
    #   bf16 and fp16, D 64/128/256, L 1k-16k; the tuner's "variant_ms" of
    #   docs/experiments/evidence/2026-12-01-forward-h200-{1dd46dd,fp16-rerun,d256}.json]. At
    #   D=256 the default spills nowhere under dropout, a mask or the score features, so D=256
    #   has one tile: no tuning.
    # - 128x128 o2 at D<=64 (84 LDL/STL non-causal, 243 causal): never within 6.5% of the best
    #   in the tuner's timings of the grid's 40 plain classes, behind 64x64 o4 in all 20 D=64
    #   classes; 128x64 o1 and 64x32 o2 39-83% and 27-92% behind the best [2026-12-01, bf16
    #   and fp16, D 64/128, L 1k-16k; the "variant_ms" of
    #   docs/experiments/evidence/2026-12-01-forward-h200-1dd46dd.json].
    # - 256x64 with 8 worker warps: 1.01-1.23x, no spills at D=64; clusters of two (num_ctas=2,
    #   TMA multicast of K/V, half the rows per CTA): 1.9-3.2x at D 64-256; 128x32 o2: 1.17-1.65x
    #   at D=128 [2026-12-01, bench_variants.py;
    #   docs/experiments/evidence/2026-12-01-variants-h200-{fwd256,fwd-cta2,fwd-d128-o2}.md].
    # - 128x256 with 8 worker warps at D=64 (168 registers, no spills): 4.8-39% behind the best
    #   tile in 10 classes [2026-11-30;
    #   docs/experiments/evidence/2026-11-30-tuning-h200-e284003.json].
    # - 64x128 with no hints: never the fastest (17-60% behind at D<=128, 9.5-17% at D=256)
    #   [2026-11-30; docs/experiments/evidence/2026-11-30-tuning-h200-24330b4.json]; at D=256 it
    #   spills 178 LDL/STL under a boolean mask and fails to compile (tileiras 13.4, return code
    #   5) with softcap and ALiBi on top.
    # - K/V load-latency hints: 8/8 on 64x64 o2 (24 instead of 36 HGMMA: a shallower K-loop
    #   pipeline) moved -8% to +8% against its base tile, never the fastest by more than 1.4%
    #   [2026-11-30, one tuning pass: the d7e2113 file above]; on 64x128 o2 at D=128 1/1, 4/4
    #   and 8/8 against 2/4 were within 0.7% on five rows, 3.2-5.0% slower at 16k non-causal
    #   [2026-12-01;
    #   docs/experiments/evidence/2026-12-01-variants-h200-fwd-d128-latency.md].
    # - A longest-first order of the query tiles: 0.92-0.96x at 16k causal on the two-group
    #   tiles, the non-causal control at 1.000x [2026-11-30, interleaved rounds;
    #   docs/experiments/evidence/2026-11-30-experiments-h200.md]: the kernels always run it.
    # - QK_AHEAD (commit 5f6c990): each key tile's S formed one K-loop step early (FA3's
    #   intra-warpgroup overlap; the SASS interleaves the next S's wgmmas with the exp2s, no
    #   spills): 1.00-1.08x the time of 64x128 o2 at D=128 and 1.04-1.09x of 64x64 o3 at D=64
    #   (o4 spills 60 LDL/STL with it) [2026-12-02, bench_variants.py, L 1k/4k/16k;
    #   docs/experiments/evidence/2026-12-02-variants-h200-fwd-qk-ahead-*]. On the 2026-11-30
    #   tiles: the fastest in 1 class of 30 (D=64 16k causal, by 2.1%)
    #   [docs/experiments/evidence/2026-11-30-tuning-h200-24330b4.json].
    # - A persistent grid (as many programs as CTAs fit, each walking (query tile, head,
    #   batch) in the launch order, striding by the grid; no spills, six more CTA-wide barriers
    #   in the sm_90 SASS): against the same tile launched per query tile 1.01-1.58x at D=64
    #   (64x64 o3 and o4), 1.02-1.44x on 64x128 o2 at D=128 and 1.01-1.87x at D=256; 128x128
    #   nww8 at D=128 took 0.97-0.98x non-causal, 1.05-1.60x causal, and 64x128 o2 nww8 0.99x
    #   at 1k non-causal, both behind 64x128 o2 [2026-12-01, bench_variants.py, L 1k/4k/16k;
    #   docs/experiments/evidence/2026-12-01-variants-h200-fwd-persistent-*].
    # - EXP2_FMA (commit 1e57712): the exp2 of the last 1/2 or 1/4 of each score tile's columns
    #   from a cubic on the FMA pipe (FA4's offload of the MUFU; no spills, 7-8 more
    #   instructions per score so moved): 1.02-1.19x the time of its tile on every non-causal
    #   row (64x64 o3/o4 at D=64, 64x128 o2 and 128x128 nww8 at D=128) but for 128x128 nww8
    #   with a quarter at 16k (0.955x, still behind 64x128 o2); its causal rows failed the
    #   tuner's check (a clamp bug, masked scores NaN) [2026-12-01, bench_variants.py,
    #   L 1k/4k/16k; docs/experiments/evidence/2026-12-01-variants-h200-fwd-exp2-fma-*].
    # - LAZY_RESCALE (commits 96f942a, 94feb6f): FA4's conditional rescale, the reference max
    #   (and acc and l_i) moved only at steps where some row's max rose past it by more than
    #   2**8: 1.06-1.09x the time of 64x64 o4 at D=64 (o3: 1.08-1.17x), 1.05-1.13x of 64x128 o2
    #   and 1.16-1.36x of 128x128 nww8 at D=128 [2026-12-02, bench_variants.py, L 1k/4k/16k;
    #   docs/experiments/evidence/2026-12-02-variants-h200-fwd-lazy-rescale-d*]. The CTA-wide
    #   branch takes shuffles, a shared-memory round trip and three named barriers per step
    #   (sm_90 SASS: 431 -> 463 instructions in the D=128 loop, 75 of them skipped). With p
    #   taken against the stale max before the vote: 1.33-1.38x (64x64 o4), 1.05-1.12x (64x128
    #   o2) and 1.13-1.24x (D=256's 128x64 nww8) on the non-causal rows; every top-left causal
    #   row failed the tuner's check (not debugged)
    #   [docs/experiments/evidence/2026-12-02-variants-h200-fwd-lazy-rescale-v2-*].
    (9, 0): ((64, SM90_THREE_CTAS), (128, SM90_TWO_GROUPS), (256, SM90_WIDE),
             (128, SM90_NARROW),
             (64, TileConfig(tile_m=64, tile_n=64, occupancy=4)),
             (128, TileConfig(tile_m=64, tile_n=128, occupancy=2))),
    # Three and four CTAs per SM at D<=64, as won on the H200 (2026-12-01, above): on sm_100
    # 64x64 o3 and o4 compile to 80 and 64 registers with no spills (the default: 255
    # registers, 141 KB of shared memory); under a window, softcap, ALiBi and a mask tileiras
    # keeps 128 and two CTAs' worth, still without spills [tileiras 13.4 SASS, 2026-12-01;
    # not yet timed on such a GPU].
    (10, 0): ((256, SM100_DEFAULT),
              (256, TileConfig(tile_m=128, tile_n=64)),
              (128, TileConfig(tile_m=128, tile_n=128)),
              (64, TileConfig(tile_m=64, tile_n=64, occupancy=3)),
              (64, TileConfig(tile_m=64, tile_n=64, occupancy=4))),
    # sm_120 at D<=64: 64x64 with two CTAs per SM (128 registers) spills nowhere, under the
    # score features either, where the default (255 registers) spills 127 LDL/STL under them;
    # three or four CTAs spill 12-157 [tileiras 13.4 SASS, 2026-12-01; not yet timed on such a
    # GPU].
    (12, 0): ((128, SM120_DEFAULT), (256, SM120_WIDE),
              (128, TileConfig(tile_m=64, tile_n=32, num_worker_warps=8)),
              (64, TileConfig(tile_m=64, tile_n=64, occupancy=2))),
}
_BACKWARD_CANDIDATES = {
    (8, 0): (*_BACKWARD_DEFAULTS[(8, 0)],
             (128, TileConfig(tile_m=64, tile_n=32, num_worker_warps=8, group_inner=True))),
    # Beside the defaults on sm_90: SM90_BACKWARD_O2_Q128 at D<=64, SM90_BACKWARD_O2 at D=128,
    # 128x64 nww8 (the tuner's pick under dropout at D=128 [H200, 2026-11-30]), SM90_BACKWARD
    # at D<=128 (all above). Not registered: 32x64 in both kernels (spills 410 in dQ at D=128).
    # Timed and not registered [H200, 2026-12-01, bf16, bench_variants.py, L 1k/4k/16k]: dQ on
    # 256x32 at D=64 (no spills; 1.015-1.113x the time of the default;
    # docs/experiments/evidence/2026-12-01-variants-h200-bwd-dq256.md); clusters of two
    # (num_ctas=2: 4.4-4.7x at D=128,
    # docs/experiments/evidence/2026-12-01-variants-h200-bwd-cta2-d128.md; at D=64 the launch
    # fails with a misaligned-address fault, which ends the process's CUDA context); three
    # CTAs per SM at D=64, dK/dV stepping 32 queries and dQ on 64x64 at 80 registers (no
    # spills; 64x64 for both spills 116 in dK/dV): 0.999-1.08x
    # (docs/experiments/evidence/2026-12-01-variants-h200-bwd-d64-32x64o3.md). Dropped: 64x64
    # with no hint, never the fastest in the tuner's 38 timings of 24 plain classes, at
    # 1.19-1.70x the best [H200, 2026-12-01, bf16 and fp16, D 64/128, L 1k-16k; the
    # "variant_ms" of
    # docs/experiments/evidence/2026-12-01-backward-h200-*-{a7677c0,tilegym,f89ba83}.json].
    (9, 0): (*_BACKWARD_DEFAULTS[(9, 0)],
             (64, SM90_BACKWARD_O2_Q128),
             (128, SM90_BACKWARD_O2),
             (128, TileConfig(tile_m=128, tile_n=64, num_worker_warps=8)),
             (128, SM90_BACKWARD),
             (256, TileConfig(tile_m=64, tile_n=64, num_worker_warps=8)),
             (128, SM90_ONE_PASS), (256, SM90_ONE_PASS_WIDE)),
    (10, 0): (*_BACKWARD_DEFAULTS[(10, 0)],
              (128, TileConfig(tile_m=64, tile_n=128, num_worker_warps=8))),
    (12, 0): (*_BACKWARD_DEFAULTS[(12, 0)],
              (128, TileConfig(tile_m=64, tile_n=32, num_worker_warps=8, group_inner=True))),
}


def candidates(capability: tuple[int, int], head_dim: int = 128, backward: bool = False,
               plain: bool = False, deterministic: bool = False) -> tuple[TileConfig, ...]:
    """The variants the autotuner times for a compute capability and head dim, the default
    first (the backward's for a ``plain`` class where it differs: ``default_backward_config``);
    families are looked up as in ``default_config``. A ``deterministic`` backward times the
    two-pass variants only."""
    default = (default_backward_config(capability, head_dim, plain, deterministic) if backward
               else default_config(capability, head_dim))
    fitting = [config for max_dim, config in registered(capability, backward)
               if head_dim <= max_dim and not (deterministic and config.one_pass)]
    return (default, *(c for c in fitting if c != default))


def registered(capability: tuple[int, int],
               backward: bool = False) -> tuple[tuple[int, TileConfig], ...]:
    """Every (largest head dim, config) entry registered for a capability's family."""
    return _family(_BACKWARD_CANDIDATES if backward else _FORWARD_CANDIDATES, capability)


def arch_name(capability: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"sm_90"``."""
    major, minor = capability
    return f"sm_{major}{minor}"


def capability_of(arch: str) -> tuple[int, int]:
    """``"sm_90"`` -> ``(9, 0)``, the inverse of ``arch_name``."""
    return divmod(int(arch.removeprefix("sm_")), 10)
