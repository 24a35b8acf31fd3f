"""Probe (2026-12-07, not yet run on a GPU): does copying a paged varlen call's pages into
packed rows first (one memory-bound cuTile kernel, ``unpage``) and then running the packed
call beat the paged call, whose page loads wait on their block-table entries
(2026-12-07-paged-varlen-bench-h100.md)? Times, in pairs of neighbouring calls against the
packed call (bench_paged_varlen's rows: D 128, H 16, bf16, 16k and 64k tokens): the paged
call, the copy + packed call, the copy alone (and its TB/s of K and V read and written).
The copy's workspace holds B * max_seqlen_k rows (the bound a paged call's host knows).

    FLASH_TILE_AUTOTUNE=0 python docs/experiments/evidence/2026-12-07-paged-copy-probe.py
"""
import json
import os
import sys

import cuda.tile as ct
import torch

sys.path.insert(0, "bench")
import flash_tile  # noqa: E402
from bench_attention import SLEEP_CYCLES  # noqa: E402
from bench_varlen import cu_seqlens, packing  # noqa: E402
from flash_tile import reference_decode  # noqa: E402
from flash_tile._timing import paired_ms  # noqa: E402
from flash_tile.kernels._pages import kv_tile, page_rows  # noqa: E402
from flash_tile.kernels._tiles import ConstBool, ConstInt, store_seq_rows  # noqa: E402

HEADS, HEAD_DIM = 16, 128


@ct.kernel
def unpage(K, V, BlockTable, CuSeqK, Kp, Vp, TILE: ConstInt, TILE_D: ConstInt,
           PAGE_N: ConstInt, GATHER: ConstBool):
    t, kv_head, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    start = ct.load(CuSeqK, (batch,), shape=()).item()
    k_len = ct.load(CuSeqK, (batch + 1,), shape=()).item() - start
    if t * TILE >= k_len:
        return
    kv = (K, V, BlockTable, 0, batch, kv_head, K.shape[1], 0, k_len)
    pages = page_rows(kv, t, TILE) if GATHER else None
    k_t = kv_tile(K, kv, t, pages, TILE, TILE_D, True, PAGE_N, GATHER, False, K.dtype)
    store_seq_rows(Kp, 0, kv_head, start, k_len, t, k_t.reshape((1, 1, TILE, TILE_D)), True)
    v_t = kv_tile(V, kv, t, pages, TILE, TILE_D, True, PAGE_N, GATHER, False, V.dtype)
    store_seq_rows(Vp, 0, kv_head, start, k_len, t, v_t.reshape((1, 1, TILE, TILE_D)), True)



def row(tokens, page_size, causal, tile):
    """One row: the three ratios to the packed call and the copy's own time."""
    lengths = packing(tokens)
    gen = torch.Generator(device="cuda").manual_seed(tokens + page_size)
    q, k, v = (torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))
    cu, longest = cu_seqlens(lengths), max(lengths)
    k_pages, v_pages, table = reference_decode.paged_layout(k, v, cu, page_size, gen)
    batch = len(lengths)
    work = [torch.empty(batch * longest, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)]
    views = [w.permute(1, 0, 2).unsqueeze(0) for w in work]  # [1, H_kv, rows, D]
    gather = page_size < 16
    page_n = 1 if gather else min(page_size, tile)
    grid = (-(-longest // tile), HEADS, batch)

    def copy():
        ct.launch(torch.cuda.current_stream(), grid, unpage,
                  (k_pages, v_pages, table, cu, *views, tile, HEAD_DIM, page_n, gather))

    def packed():
        return flash_tile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                 causal=causal)

    def paged():
        return flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, longest,
                                                 longest, causal=causal, block_table=table)

    def copied():
        copy()
        return flash_tile.flash_attn_varlen_func(q, *work, cu, cu, longest, longest,
                                                 causal=causal)
    with torch.no_grad():
        diff = (copied().float() - packed().float()).abs().max().item()
        packed_ms, _, paged_cost = paired_ms(packed, paged, 6, 10, SLEEP_CYCLES)
        _, _, copied_cost = paired_ms(packed, copied, 6, 10, SLEEP_CYCLES)
        _, copy_ms, _ = paired_ms(packed, copy, 6, 10, SLEEP_CYCLES)
    moved = 2 * 2 * tokens * HEADS * HEAD_DIM * 2  # K and V, read and written, bytes
    result = {"tokens": tokens, "page": page_size, "causal": causal, "tile": tile,
              "max_diff": diff, "packed_ms": round(packed_ms, 4),
              "paged_over_packed": round(1 + paged_cost, 3),
              "copied_over_packed": round(1 + copied_cost, 3),
              "copy_ms": round(copy_ms, 4), "copy_tb_s": round(moved / copy_ms / 1e9, 2)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    rows = [row(tokens, page, causal, 64 if page < 16 else 128)
            for tokens in (16384, 65536) for page in (16, 64, 256, 1) for causal in (False, True)]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "paged-copy-probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
