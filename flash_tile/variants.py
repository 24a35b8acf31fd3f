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
    step ``tile_m``).
    The forward alone reads the rest: ``latency_k`` and ``latency_v`` are the DRAM-latency hints
    (1-10) of its K and V tile loads.
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

    def __post_init__(self):
        for name in ("tile_m", "tile_n", "dq_tile_m", "dq_tile_n"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("latency_k", "latency_v"):
            if not 1 <= getattr(self, name) <= 10:
                raise ValueError(f"{name} must be in 1..10 (cuTile's range), got "
                                 f"{getattr(self, name)}")

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


# Hopper, 64<D<=128: 128x128 with 8 worker warps, two consumer warp groups of 64 rows each (FA3's
# split of a 128-row tile; 168 registers, no spills, 133 KB of shared memory at D=128). The
# autotuner on the H200 [session 5, 2026-11-30, bf16 and fp16, cuda-tile 1.7.0 / tileiras
# 13.4, B*L = 16k, H*D = 2048, three runs; every candidate's time in
# bench/results/tuning-h200-session5.json]: at D=128 it won 22 of 26 classes, 2-20% ahead of
# 64x64 o2 from 2k on (1.83 against 2.08 ms at 16k causal, bf16); at 1k the runs disagree
# (64x64 o2 or 128x64 o2 ahead by 0.4-7%). At D=64 it won 15 of the 16 classes at L 4k-16k,
# by 0.1-7.8% over 128x64 o2, and lost 1k/2k by 2-12% (1k: 0.377 against 0.343 ms), where the
# tuner picks 128x64 o2. It was the D<=64 default too until session 11 (SM90_THREE_CTAS below).
# Earlier sessions (bench/results/tuning-h200*.json, before the 8-warp candidates existed)
# had 128x64 o2 ahead at D=64 and 64x64 o2 / 128x64 o2 trading places at D=128; the
# occupancy hint moved a plain 64x64 forward from about 400 to about 510 TFLOP/s, and 128x128
# without the 8-warp hint fell to about 250 (255 registers, 620 LDL/STL).
# - D=256: 128x64 with 8 worker warps, the two-group split again (no spills). It won all 10
#   bf16 classes (L 1k-16k, causal and not) [H200, session 6, 2026-11-30, same stack;
#   bench/results/tuning-h200-session6.json], 9.5-17% ahead of 64x128, the default until then
#   (3.30 against 3.72 ms at 16k, non-causal), and 27-44% ahead of 64x64 o2. 128x64 spills
#   without the 8-warp hint.
SM90_TWO_GROUPS = TileConfig(tile_m=128, tile_n=128, num_worker_warps=8)
# D<=64: three CTAs per SM, each one consumer warp group on 64x64 at 80 registers (no spills
# with dropout, a boolean mask, or a window with softcap, ALiBi and a mask; 26-55 KB of shared
# memory a CTA) [H200, session 11, 2026-12-01, bf16, bench_variants.py, L 1k/4k/16k, causal
# and not]: 0.813-0.967x the time of SM90_TWO_GROUPS, the default until then, on every row.
# More CTAs in flight overlap one CTA's softmax with another's wgmmas, the overlap tileiras
# does not build inside a CTA (docs/kernel-internals.md). Four CTAs (64 registers) took
# 0.772-0.953x but spill under a mask (32 LDL/STL; 141 with the score features; 2 under
# dropout), so that one is a candidate. At D=128 the accumulator alone is 64 registers a
# thread and tileiras keeps 128 whatever the hint: no third CTA fits there.
SM90_THREE_CTAS = TileConfig(tile_m=64, tile_n=64, occupancy=3)
SM90_NARROW = TileConfig(tile_m=128, tile_n=64, occupancy=2)
SM90_WIDE = TileConfig(tile_m=128, tile_n=64, num_worker_warps=8)

# Ampere and Ada: 64x32 with 8 worker warps compiles with no spill at D=64 and D=128 (162 and
# 219 registers with session 7's heaviest-first index; cp.async + 128-bit loads); 64x64
# spills 16 LDL/STL at D=64. Above D=128 64x32 spills (434 at D=256) and 32x32 with 8 worker
# warps does not (227 registers). [2026-11-30, cuobjdump of tileiras 13.4 cubins for sm_80
# with the JIT's shape/stride specialisation reproduced (flash_tile.aot); not yet timed on
# such a GPU.]
SM80_DEFAULT = TileConfig(tile_m=64, tile_n=32, num_worker_warps=8)
SM80_WIDE = TileConfig(tile_m=32, tile_n=32, num_worker_warps=8)

# Blackwell datacenter (sm_100, tcgen05): 64x64 compiles to UTCHMMA with no spill up to D=256
# (tests/test_aot.py); not yet timed, so the hints are left to the compiler.
SM100_DEFAULT = TileConfig(tile_m=64, tile_n=64)

# Blackwell consumer (sm_120, mma.sync + TMA): 64x64 has no spill up to D=128; at D=256 it
# spills (440 LDL/STL); 32x64 with 8 worker warps does not (168 registers) [2026-11-30,
# cuobjdump of tileiras 13.4 cubins; not yet timed on such a GPU].
SM120_DEFAULT = TileConfig(tile_m=64, tile_n=64)
SM120_WIDE = TileConfig(tile_m=32, tile_n=64, num_worker_warps=8)

# Per compute capability: (largest head dim, config) buckets, narrowest first. A head dim is
# the larger of the query/key and value head dims.
_DEFAULTS = {
    (8, 0): ((128, SM80_DEFAULT), (256, SM80_WIDE)),
    (9, 0): ((64, SM90_THREE_CTAS), (128, SM90_TWO_GROUPS), (256, SM90_WIDE)),
    (10, 0): ((256, SM100_DEFAULT),),
    (12, 0): ((128, SM120_DEFAULT), (256, SM120_WIDE)),
}

#: Architectures the kernels are built and checked for, as ``sm_XY`` names.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


def default_config(capability: tuple[int, int], head_dim: int = 128) -> TileConfig:
    """The default variant for a compute capability such as ``(9, 0)`` and a head dim.

    A capability with no entry (sm_86, sm_89, sm_103, a newer GPU) gets the entry of the
    nearest older one.
    """
    return _lookup(_DEFAULTS, capability, head_dim)


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


# The backward holds dK and dV (or dQ) accumulators beside K and V: more registers than the forward.
# First choices, from cuobjdump of tileiras 13.4 cubins [2026-11-30], not yet timed; each compiles
# the dK/dV and dQ kernels with no spill at D=64 and D=128 for GQA groups of 1 and 4 (without
# dropout: with GQA 4 and dropout sm_90's D=128 default spills 145 LDL/STL in dK/dV, session 7). On
# the way: sm_90 64x64 spills 1913 LDL/STL in dK/dV at D=64 (8 worker warps remove them, and add 323
# at D=128); on sm_80 and sm_120 the spills (400-2500 at every shape tried) came from walking the
# GQA group's heads in an outer loop: with the heads inside each query tile (group_inner) and 8
# worker warps they are gone. The same order spills ~3000 on sm_90. On sm_90 the autotuner's winners
# on the H200 are the defaults [2026-11-30, bf16 and fp16, L 1k-16k,
# bench/results/tuning-h200-grid.json]: at D<=64 64x128 with 8 worker warps (4.89 ms against 6.79
# for the former default 64x64 nww8 and 5.59 for 128x64 nww8 at 4k; it won 10 of 12 classes, 64x64
# the other two by 1%); it also compiles without spills for GQA 4 with dropout, where 64x64 nww8
# spilled 1601 LDL/STL. At D=128 128x64 with 8 worker warps (3.66 against 4.05 for 64x64 at 4k,
# every class). Those were one shape for both kernels. Timed kernel by kernel [H200, session 7,
# 2026-11-30, bf16, same stack, L 1k/4k/16k, five interleaved rounds; NOTES.md], each wants its own
# rows tall and its steps narrow: dQ at D=64 ran 0.47-0.73x as long with 128x64 as with 64x128 (3.18
# against 5.15 ms at 16k causal), and dK/dV at D=128 0.79-0.86x as long with 64x128 as with 128x64
# (4.04 against 5.13 ms at 16k causal); the other two kernels were already on their best shape
# (dK/dV 128x128 at D=64 within 1.5% of 64x128). So SM90_BACKWARD runs dK/dV on 64x128 and dQ on
# 128x64, both with 8 worker warps: the D<=64 default until session 10 (no spills with GQA, dropout,
# softcap, ALiBi and a mask). At D=128 its dK/dV spills under the score features: 16 LDL/STL with
# dropout, 38 with GQA 4 and dropout, 191 with a window, softcap, ALiBi and a mask, where 128x64
# spills 0, 145 and 0. The mask case decides: it is a candidate there and 128x64 was the untuned
# default until session 11; the autotuner picks per feature class (session 7: the new shape in
# every plain class, 128x64 with dropout). At D=256 on sm_90 64x64 spills 1172 in dK/dV; with 8
# worker warps none (32x64, 64x32 and 32x32 all spill 380-740 in one kernel or the other while
# both kernels share a shape). On sm_80/sm_120 32x32 still spills at D=256 (592/198 and 479), and
# on sm_100 64x64 with 8 worker warps spills 1080 there.
SM90_BACKWARD = TileConfig(tile_m=64, tile_n=128, num_worker_warps=8, dq_tile_m=128,
                           dq_tile_n=64)
# At D=256 on sm_90 the dQ kernel owns 128 query rows and steps 32 keys (dK/dV as before, 64x64
# with 8 worker warps): the whole backward took 0.81-0.85x the time of 64x64 for both kernels
# on every bf16 row (L 1k/4k/16k, causal and not; bench_variants, H200, session 8); dQ stepping
# 32 keys with 64 rows took 1.00-1.19x and dK/dV stepping 32 queries (dQ on 128x32)
# 1.06-1.11x, each against that former default. SASS (tileiras 13.4): the 128x32 dQ spills
# none plain, 7 LDL/STL with a window, softcap, ALiBi, a mask and dropout; 128x64 spills 2380.
SM90_BACKWARD_WIDE = TileConfig(tile_m=64, tile_n=64, num_worker_warps=8, dq_tile_m=128,
                                dq_tile_n=32)
# Two CTAs per SM instead of two consumer warp groups in one, both kernels on 64x64 [H200,
# session 10, 2026-12-01, bf16, bench_variants.py, interleaved rounds, L 1k/4k/16k, causal and
# not]: 0.907-0.99x the time of SM90_BACKWARD at D=64 and 0.812-0.914x that of 128x64 nww8 at
# D=128, every row. The D<=64 default: no spills with GQA 4, dropout and the LSE's gradient,
# nor with a window, softcap, ALiBi and a mask (sm_90 SASS, 128 registers). At D=128 its dK/dV
# spills 108 LDL/STL under dropout (120 since session 13), so there it is the default of plain
# classes only (_PLAIN_BACKWARD) and a candidate for the others.
SM90_BACKWARD_O2 = TileConfig(tile_m=64, tile_n=64, occupancy=2)
# The D=128 default under dropout and the score features (plain classes take SM90_BACKWARD_O2
# since session 13: _PLAIN_BACKWARD): two CTAs per SM with dK/dV stepping 32 queries, dQ on
# 64x64 [H200, session 11, 2026-12-01, bf16, bench_variants.py, L 1k/4k/16k, causal and not]:
# 0.891-0.983x the time of 128x64 nww8 (the default until then) on every row;
# SM90_BACKWARD_O2 took 0.812-0.919x in the same run. Unlike it, this tile compiles without
# spills at D=128 under dropout, GQA 4 with dropout and the LSE's gradient, and a window with
# softcap, ALiBi and a mask (sm_90 SASS, tileiras 13.4). Under GQA without dropout its dK/dV
# spills 268-283 (found in session 13; 22 with GQA 4 and a bool mask, where SM90_BACKWARD_O2
# spills 44). Registered up to D=128, it is a D=64 candidate too; the tuner's own timings
# there (session 12's fp16 backward grid, bench/results/backward-h200-fp16-session12*.json)
# put it at 1.19-1.39x the time of the D<=64 default on every row.
SM90_BACKWARD_O2_NARROW = TileConfig(tile_m=32, tile_n=64, occupancy=2, dq_tile_m=64,
                                     dq_tile_n=64)
# dK/dV stepping 128 queries over its 64 keys, dQ on 64x64, two CTAs per SM: the shape TileGym
# 1.5.1's tuner took for its dK/dV at D=64 (its backward ran 1.05-1.29x flash_tile's fp16 rate
# there on every row but 1k causal, session 12). [H200, session 12, 2026-12-01, bf16,
# bench_variants.py --backward, L 1k/4k/16k, causal and not]: 0.906-0.988x the time of
# SM90_BACKWARD_O2 on every row; with the scale applied once (session 13, both kernels so
# changed, same rows) 0.906-0.980x. Its dK/dV spills 23-35 LDL/STL plain (584 under dropout,
# 998 with a window, softcap, ALiBi and a mask; sm_90 SASS, tileiras 13.4; 26-52 plain before
# session 13), so it is a D<=64 candidate, which the tuner times per feature class, and not
# the default. In the same run dQ on 64x128 (TileGym's dQ shape) took
# 1.005-1.039x, and at D=128 dQ on 64x32 1.013-1.156x: neither registered.
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
# mask; a window, ragged lengths, GQA and the LSE's gradient allowed). At D=128 on sm_90,
# session 13 [sm_90 SASS, tileiras 13.4, bf16]: SM90_BACKWARD_O2 spills nowhere there, GQA
# groups 2-8 included, where SM90_BACKWARD_O2_NARROW's dK/dV spills 268-283 LDL/STL under
# any GQA group without dropout; under the features it is the other way round (SM90_BACKWARD_O2
# spills 6-201: 174 under softcap, 120 under dropout). On the H200 SM90_BACKWARD_O2 took
# 0.895-0.982x the backward time of SM90_BACKWARD_O2_NARROW in the tuner's 16 timings of the
# 12 plain D=128 classes (bf16 and fp16, L 1k-16k, causal and not; the "variant_ms" of
# bench/results/backward-h200-*-session1[23]*.json).
_PLAIN_BACKWARD = {SM90_BACKWARD_O2_NARROW: SM90_BACKWARD_O2}


def is_plain(softcap: bool, alibi: bool, attn_mask, dropout: bool) -> bool:
    """Whether a problem class is plain (``autotune.problem_key``'s word): no softcap, ALiBi,
    attention mask (any kind; None or a falsy name when there is none) or dropout."""
    return not (softcap or alibi or attn_mask or dropout)


def default_backward_config(capability: tuple[int, int], head_dim: int = 128,
                            plain: bool = False) -> TileConfig:
    """The default variant of the backward kernels, looked up as ``default_config``; with
    ``plain``, for a class with no dropout, softcap, ALiBi or attention mask (``is_plain``)."""
    config = _lookup(_BACKWARD_DEFAULTS, capability, head_dim)
    return _PLAIN_BACKWARD.get(config, config) if plain else config


# Candidates the autotuner times (``flash_tile.autotune``), per architecture family, as
# (largest head dim, config); the family's defaults are always among them. Adding a variant is
# one entry here: tests/test_aot.py compiles every entry for the family's architectures.
_FORWARD_CANDIDATES = {
    # The defaults only: 64x64 and 128x32 with 8 worker warps spill at D=128 (12 and 212
    # LDL/STL, cuobjdump of tileiras 13.4 cubins); none timed on Ampere/Ada yet. More CTAs
    # per SM, the H200's D=64 lever, spill here: 64x64 with occupancy 2, 3 and 4 spills 24,
    # 493 and 234 LDL/STL at D=64, causal (session 11).
    (8, 0): ((128, SM80_DEFAULT), (256, SM80_WIDE)),
    # Beside the defaults [H200, sessions 5 and 6, as above]: 128x64 o2 wins D=64 at L 1k/2k;
    # 64x64 o2 was the D=128 default until session 5. SM90_WIDE (no spills at D=64/128/256,
    # 168 registers) is timed at D<=128 too: 0.4-56% behind 128x128 there, 3-25% from 2k on
    # (session 5).
    # Tried and dropped in session 5 (bf16 run): K/V load-latency hints 8/8 on 64x64 o2 (24
    # instead of 36 HGMMA: tileiras pipelines the K-loop less deep). Against its base tile it
    # moved -8% to +8%, never the fastest by more than 1.4%. A longest-first order of the
    # query tiles, judged noise then on these one-group tiles (one tuning pass, no control),
    # measured 0.92-0.96x at 16k causal on the two-group tiles in session 7 with interleaved
    # rounds, the non-causal control at 1.000x; the kernels now always run it.
    # Tried and dropped in session 6 (bf16, 30 classes, D 64/128/256; NOTES.md): forming each
    # key tile's S one K-loop step early (a QK_AHEAD switch, FA3's intra-warpgroup overlap,
    # whose SASS interleaved the next S wgmmas with the exp2s) on four of these tiles. It was
    # the fastest in 1 class of 30 (D=64 16k causal, 2.1% ahead of the same tile without it);
    # the best of them trailed the best plain tile by 0-23% at D=64, 0.3-10% at D=128 and
    # 28-57% at D=256. The two-group tiles already overlap one group's softmax with the
    # other's wgmmas, and the switch cost an extra S fragment and one unused tile of S.
    # Timed again in session 15 on the tiles that win since (same method, L 1k/4k/16k, causal
    # and not; bench/results/variants-h200-session15-fwd-qk-ahead-*), ported to today's kernel
    # (the SASS interleaves the next S's wgmmas with the exp2s; no spills on either tile): it
    # took 1.00-1.08x the time of 64x128 o2 at D=128 and 1.04-1.09x of 64x64 o3 at D=64 (o4
    # spills 60 LDL/STL with it). The likely reason (not profiled): two to four CTAs per SM
    # already feed the tensor cores through each other's softmax, and the early S only adds
    # its live registers and one unused tile of S per program.
    # Dropped in session 6 too: 64x128, the D=256 default until then. It was never the fastest
    # (17-60% behind at D<=128, 9.5-17% at D=256), and at D=256 it spills 178 LDL/STL under a
    # boolean mask and fails to compile (tileiras 13.4, return code 5) with softcap and ALiBi
    # on top, found by tests/test_gpu_variants.py and reproduced with flash_tile.aot.
    # Dropped in session 7 (bf16, D=64, 10 classes): 128x256 with 8 worker warps, the
    # two-group tile with twice the keys per K-loop step (168 registers, no spills). It was
    # never the fastest: 4.8-39% behind the best tile (bench/results/tuning-h200-session7.json).
    # Added in session 9 [H200, 2026-12-01, bf16, bench_variants.py, interleaved rounds]:
    # 128x128 with occupancy 2 and no worker-warp hint at D<=64 took 0.84-0.96x the time of
    # 128x128 nww8 on the non-causal rows (L 1k-16k) and 1.15-1.36x on the causal ones, and
    # 1.6-2.0x at D=128, where it is not registered. One consumer warp group holds all 128
    # rows and spills (84 LDL/STL non-causal, 243 causal at D=64), yet it wins the non-causal
    # rows: two CTAs per SM, each its own K/V pipeline. The tuner picked it at 1k-8k in both
    # dtypes (bench/results/forward-h200-session9.md). Timed then and not
    # registered: 256x64 with 8 worker warps (1.01-1.23x, no spills at D=64), clusters of two
    # (num_ctas=2: 1.9-3.2x at D 64-256; TMA multicast of K/V, half the rows per CTA).
    # Added in session 10 [H200, 2026-12-01, bf16, bench_variants.py, L 1k/4k/16k]: 64x128
    # with occupancy 2, two one-group CTAs per SM with 64 rows each (no spills at D=128, 128
    # registers): 0.898-0.974x the time of 128x128 nww8 on five D=128 rows, 1.045x at 16k
    # causal. Registered for D<=128; at D=64 [session 11, same method] it took 0.872-0.967x
    # the time of 128x128 nww8 on five rows and 1.05x at 16k causal. It stays a candidate, not
    # the default: under a window, softcap, ALiBi and a boolean mask it spills 82 LDL/STL at
    # D=64 and 146 at D=128, where 128x128 nww8 spills none (sm_90 SASS, tileiras 13.4).
    # Timed in session 10 and not registered: 128x32 o2 (1.17-1.65x at D=128).
    # Added in session 11 [H200, bf16, bench_variants.py, L 1k/4k/16k]: 64x64 with occupancy 4
    # at D<=64, four one-group CTAs per SM at 64 registers: 0.772-0.953x the time of 128x128
    # nww8 on every row, ahead of SM90_THREE_CTAS on every row, of 128x128 o2 on five. It
    # spills under a boolean mask (32 LDL/STL) and the score features (141), as above.
    # Dropped in session 11, by the tuner's timings of every candidate in the grid's 40 plain
    # classes (bf16 and fp16, D 64/128, L 1k-16k, causal and not; the "variant_ms" of
    # bench/results/forward-h200-session11.json): 128x128 o2 (D<=64), never within 6.5% of the
    # best there, behind 64x64 o4 in all 20 D=64 classes; 128x64 o1 and 64x32 o2, which never
    # won in any session (here 39-83% and 27-92% behind the best). Each candidate costs a
    # compile and a timing on a class's first call.
    # Tried and dropped in session 12 [H200, bf16, bench_variants.py, L 1k/4k/16k, causal and
    # not; bench/results/variants-h200-session12-fwd-persistent-*]: a persistent grid (as many
    # programs as CTAs fit, each walking (query tile, head, batch) in the launch order,
    # striding by the grid; no spills, and six more CTA-wide barriers in the sm_90 SASS).
    # Against the same tile launched per query tile it took 1.01-1.58x at D=64 (64x64 o3 and
    # o4), 1.02-1.44x on 64x128 o2 at D=128 and 1.01-1.87x at D=256; only the 8-worker-warp
    # tiles at D=128 gained anywhere (128x128 nww8 0.97-0.98x non-causal, 1.05-1.60x causal;
    # 64x128 o2 nww8 0.99x at 1k non-causal), and both stay behind 64x128 o2. The hardware
    # starts the next program as soon as an SM has room, which a static stride cannot match
    # under causal's uneven tiles.
    # Dropped in session 14: 64x64 o2 (D<=256), a candidate since session 4. By the tuner's
    # timings it was never the fastest in 64 plain classes (bench/results/forward-h200-
    # session11.json, -session12-fp16-rerun.json and forward-h200-d256-session14.json: bf16
    # and fp16, D 64/128/256, L 1k-16k, causal and not), at 1.087-1.499x the best; at D=256
    # the default spills nowhere under dropout, a mask or the score features (tileiras 13.4
    # SASS), so the candidate was no escape there either. D=256 now has one tile: no tuning.
    # Tried and dropped in session 14 [H200, bf16, bench_variants.py, L 1k/4k/16k;
    # bench/results/variants-h200-session14-fwd-*]: an EXP2_FMA switch giving the exp2 of the
    # last 1/2 or 1/4 of each score tile's columns to a cubic on the FMA pipe (FA4's offload of
    # the MUFU; no shuffles, no spills, 7-8 more instructions per score so moved). On every
    # non-causal row it took 1.02-1.19x the time of its tile (64x64 o3/o4 at D=64, 64x128 o2
    # and 128x128 nww8 at D=128) but for 128x128 nww8 with a quarter at 16k (0.955x, still
    # behind 64x128 o2); its causal rows failed the tuner's check (a clamp bug, masked scores
    # NaN). At D=64 the MUFU, the FP32 issue and the tensor cores are all near saturation
    # (docs/kernel-internals.md), so moving work from the first to the second gains nothing.
    # The K/V latency hints on 64x128 o2 at D=128 (1/1, 4/4, 8/8 against 2/4): within 0.7% of
    # it on five rows, 3.2-5.0% slower at 16k non-causal.
    # Tried and dropped in session 15 [H200, 2026-12-02, bf16, bench_variants.py, L 1k/4k/16k,
    # causal and not; bench/results/variants-h200-session15-fwd-lazy-rescale-*]: FA4's
    # conditional rescale, a LAZY_RESCALE switch that moved the reference max (and rescaled acc
    # and l_i) only at steps where some row's max rose past it by more than 2**8. Random scores
    # should skip it at every step after the first (a rise of 8 in log2 units is a score about 8
    # standard deviations out), yet it took 1.06-1.09x the time of 64x64 o4 at D=64 (o3:
    # 1.08-1.17x), 1.05-1.13x of 64x128 o2 and 1.16-1.36x of 128x128 nww8 at D=128. A branch
    # needs one answer per CTA: tileiras forms it through shuffles, a shared-memory round trip
    # and three named barriers per step (sm_90 SASS: 431 -> 463 instructions in the D=128 loop,
    # 75 of them skipped), a serial chain between the score wgmma and the P V wgmma: the likely
    # reason (not profiled) it costs more than the 64 FMULs a thread it saves, and with two
    # consumer warp groups it makes them wait for each other. Taking p against the stale max
    # before the vote, so that the SASS interleaves the vote with the exp2s, took 1.33-1.38x
    # (64x64 o4), 1.05-1.12x (64x128 o2) and 1.13-1.24x (D=256's 128x64 nww8) on the non-causal
    # rows, and failed the tuner's check on every top-left causal row (not debugged; its GPU
    # test, bottom-right causal and the score features, had passed).
    (9, 0): ((64, SM90_THREE_CTAS), (128, SM90_TWO_GROUPS), (256, SM90_WIDE),
             (128, SM90_NARROW),
             (64, TileConfig(tile_m=64, tile_n=64, occupancy=4)),
             (128, TileConfig(tile_m=64, tile_n=128, occupancy=2))),
    # Three and four CTAs per SM at D<=64, as won on the H200 (session 11, above): on sm_100
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
    # Beside the defaults on sm_90: SM90_BACKWARD_O2 at D=128, SM90_BACKWARD at D<=128 and 128x64
    # nww8, the D=128 default of sessions 3-10, which won the dropout classes in session 7 (above);
    # SM90_BACKWARD_O2_Q128
    # at D<=64 (dK/dV stepping 128 query rows: within 1.5% of 64 kernel-alone with 8 worker
    # warps in session 7, 1-9% ahead with two CTAs per SM in session 12). Not registered:
    # 32x64 in both kernels (spills 410 in dQ at D=128). Timed in session 9 and not
    # registered [H200, bf16, L 1k/4k/16k]: dQ on 256x32 at D=64 (no spills; 1.015-1.113x the
    # time of the default) and clusters of two (num_ctas=2: 4.4-4.7x at D=128; at D=64 the launch
    # fails with a misaligned-address fault, which ends the process's CUDA context). Timed in
    # session 11: three CTAs per SM at D=64, dK/dV stepping 32 queries and dQ on 64x64 at 80
    # registers (no spills; 64x64 for both spills 116 in dK/dV), 0.999-1.08x the time of the
    # default. Dropped in session 13: 64x64 with no hint, a control since session 5. In the
    # tuner's 38 timings of it in sessions 12 and 13 (24 plain classes: bf16 and fp16, D 64/128,
    # L 1k-16k, causal and not; the "variant_ms" of bench/results/backward-h200-*-session1[23]
    # *.json) it was never the fastest, at 1.19-1.70x the best; each candidate costs two
    # compiles and a timing on a class's first call.
    (9, 0): (*_BACKWARD_DEFAULTS[(9, 0)],
             (64, SM90_BACKWARD_O2_Q128),
             (128, SM90_BACKWARD_O2),
             (128, TileConfig(tile_m=128, tile_n=64, num_worker_warps=8)),
             (128, SM90_BACKWARD),
             (256, TileConfig(tile_m=64, tile_n=64, num_worker_warps=8))),
    (10, 0): (*_BACKWARD_DEFAULTS[(10, 0)],
              (128, TileConfig(tile_m=64, tile_n=128, num_worker_warps=8))),
    (12, 0): (*_BACKWARD_DEFAULTS[(12, 0)],
              (128, TileConfig(tile_m=64, tile_n=32, num_worker_warps=8, group_inner=True))),
}


def candidates(capability: tuple[int, int], head_dim: int = 128, backward: bool = False,
               plain: bool = False) -> tuple[TileConfig, ...]:
    """The variants the autotuner times for a compute capability and head dim, the default
    first (the backward's for a ``plain`` class where it differs: ``default_backward_config``);
    families are looked up as in ``default_config``."""
    default = (default_backward_config(capability, head_dim, plain) if backward
               else default_config(capability, head_dim))
    fitting = [config for max_dim, config in registered(capability, backward)
               if head_dim <= max_dim]
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
