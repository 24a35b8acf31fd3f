"""Tile configurations of the KV-cache decode kernel (``kernels/attention_decode.py``): its
tiles, split policy and page loads, one frozen record with the measurements that decided it,
and the per-GPU default (``default_decode_config``). The forward's and backward's variants
live in ``flash_tile.variants``.
"""

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's tiles and split policy (``kernels/attention_decode.py``).

    ``rows``: packed query rows per program (query rows x the GQA group, padded to powers of
    two); ``tile_n``: keys per step of a contiguous cache; ``ctas_per_sm``: how many
    programs per SM the split heuristic aims at; ``min_tiles_per_split``: the fewest key tiles
    a split is given; ``max_splits``: the split count's cap (the combine reads them all).
    Paged caches: ``paged_tile_n`` keys a step, joined from at most ``max_page_loads`` tile
    loads of pages where a load of at least ``min_page_load`` keys fits the page, else
    gathered by row, ``gather_tile_n`` keys a step (``_launch_decode.decode_tiles``).

    Measured [H200, 2026-12-02, cuda-tile 1.7.0, GQA 32/8, D = 128, bf16, Lq = 1, B 1-128, L
    4k-128k, K/V GB/s by device time; docs/experiments/evidence/2026-12-02-decode-h200.md]:
    occupancy 2 is 1.19-1.55x no hint on a kernel that masks every V tile, and the kernel as
    it is spills 322 LDL/STL without it; occupancy 4 0.41-0.44x of 2. 128-key steps 1.24-1.37x
    64-key ones. Splits aimed at 2 programs per SM beat 4 and 8 on 5 of 7 rows (at B = 8, 4
    and 8 were up to 1.18x ahead). Every split count timed on the grid [H200, 2026-12-02,
    commit 3f3562e, docs/experiments/evidence/2026-12-02-decode-splits-h200-3f3562e.md]: the
    best count is the most that keeps the grid in one wave of 2 a SM, rounded down (B = 32,
    L = 1k: no split, 3811 GB/s, where rounding the wave up to 2 splits gave 2720), with
    splits of one key tile allowed (B = 1, L = 1k: 8 splits, 501 GB/s, where 2 tiles a split
    gave 4 splits and 426); that rule lands within 2% of the best count on all 15 rows.
    Paged steps [H200, 2026-12-04, same shapes, B 1-128, L 1k-128k, shuffled tables;
    docs/experiments/evidence/2026-12-04-decode-pages-h200.md]: 256-key pages read 1.07-1.15x
    faster in 64-key steps than in 128-key ones (0.89-0.95x contiguous) on the 32-bit
    kernel; 16-key pages joined four to a 64-key step 1.34-1.84x faster than gathered by
    row, and 3.5-4.0x faster than the 16-key steps of before (which spilled); gathered rows
    64 a step beat 128 on 6 of 8 rows; joined steps of 128 keys (2, 4 or 8 loads) ran
    0.26-0.73x the 64-key ones. 8 worker warps (which drop the 16-key pages' 22 LDL/STL
    on sm_90) took 1.04-1.09x the time on contiguous caches and 1.38-2.66x on 16- to
    256-key pages [H200, 2026-12-04, commit 90453ff, B 1-128, L 8k/32k;
    docs/experiments/evidence/2026-12-04-decode-candidates-h200.md]: no worker-warp hint."""

    rows: int = 16
    tile_n: int = 128
    occupancy: int | None = 2
    num_worker_warps: int | None = None
    ctas_per_sm: int = 2
    min_tiles_per_split: int = 1
    max_splits: int = 64  # a bound, not a measured best: the combine reads every split
    paged_tile_n: int = 64
    min_page_load: int = 16
    max_page_loads: int = 4
    gather_tile_n: int = 64
    # Programmatic dependent launch of the decode and the combine (sm_90+): 1.01-1.24x the
    # GB/s of the chosen split counts at B 1-8, 0.995-1.017x at B = 32 [H200, 2026-12-02,
    # 34866c3; docs/experiments/evidence/2026-12-02-decode-pdl-h200-34866c3.md].
    pdl: bool = False

    def hints(self) -> dict:
        hints = {"occupancy": self.occupancy, "num_worker_warps": self.num_worker_warps}
        return {k: v for k, v in hints.items() if v is not None}


DECODE_DEFAULT = DecodeConfig()


# GPUs with 100 KiB of shared memory a SM (228 KiB on sm_90 and sm_100, 164 KiB on sm_80).
SMALL_SHARED_MEMORY = ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1))


@functools.cache
def default_decode_config(capability: tuple[int, int], head_dim: int = 128) -> DecodeConfig:
    """The decode config for a GPU and head dim: 64-key steps at D > 128 (the K and V tiles
    of a step stay at 64 KiB in bf16), 128-key steps below; at D > 128 gathered pages half
    as many keys a step on the GPUs of 100 KiB of shared memory a SM (sm_86, sm_89, sm_120:
    tileiras 13.4 spills 110-173 LDL/STL there at the full step, none at half); programmatic
    dependent launch where the GPU has it (sm_90 and newer)."""
    config = DecodeConfig(tile_n=64) if head_dim > 128 else DECODE_DEFAULT
    if tuple(capability) in SMALL_SHARED_MEMORY and head_dim > 128:
        config = replace(config, gather_tile_n=32)
    return replace(config, pdl=tuple(capability) >= (9, 0))
