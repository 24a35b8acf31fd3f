"""Paged varlen benchmark: ``flash_attn_varlen_func`` with a ``block_table`` (packed queries
against the shuffled pages of a KV cache, the forward's PAGED switch) against the same call
on the keys packed, in the same run.

Each row packs ``bench_varlen.packing``'s sequences (log-uniform lengths 64 to 8192, seeded
by the token count) into 16k or 64k tokens, H * D = 2048, Lq = Lk per sequence, lays the
keys and values into pages of 16, 64 or 256 keys (1: rows gathered) in a random order
(``reference_decode.paged_layout``), and
times in pairs of neighbouring calls (``_timing.paired_ms``):

- ``packed``: ``flash_attn_varlen_func`` on the packed keys (the VARLEN switch);
- ``paged``: the same call with the pages and their block table;
- ``paged_fp8`` (``--fp8-cache``): the paged call on the pages quantized to float8_e4m3fn
  (one descale factor a tensor, bfloat16 q), timed in pairs with ``paged``.

Run with ``FLASH_TILE_AUTOTUNE=0`` (the paged call is never tuned): where the paged tile
is the default one (``variants.paged_config``; sm_80-sm_90 at every head dim) the ratio is
the cost of reading pages alone. The paged output's largest difference from the packed one
is recorded (``max_diff``; 0 where both run one tile). FA2's varlen forward (torch's
``_flash_attention_forward``, packed: torch ships no paged varlen) is timed beside them as
the peer's figure.

    FLASH_TILE_AUTOTUNE=0 python bench/bench_paged_varlen.py    # results/paged-varlen-<gpu>.*
    python bench/bench_paged_varlen.py --tokens 16384 --pages 16 64 --out /tmp/p
    python bench/bench_paged_varlen.py --fp8-cache --out /tmp/p8

Writes <out>.json (rows with ``ms`` and ``tflops`` per call, ``paged_over_packed`` and,
with ``--fp8-cache``, ``fp8_over_paged``) and <out>.md.
"""

import argparse

import torch
from tqdm import tqdm

import flash_tile
from flash_tile import reference_decode
from bench_attention import (SLEEP_CYCLES, device_ms, machine_info, md_table, results_path,
                             save_json, write_report)
from bench_varlen import _fa2, cu_seqlens, packing
from flash_tile._timing import DTYPES, GRID_WIDTH, flops, paired_ms

ROUNDS, PAIRS = 10, 10


def bench_row(tokens, page_size, causal, head_dim, dtype, fp8_cache):
    lengths = packing(tokens)
    heads = GRID_WIDTH // head_dim
    gen = torch.Generator(device="cuda").manual_seed(tokens + page_size)
    q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
               for _ in range(3))
    cu, longest = cu_seqlens(lengths), max(lengths)
    k_pages, v_pages, table = reference_decode.paged_layout(k, v, cu, page_size, gen)

    def packed_call():
        return flash_tile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                 causal=causal)

    def paged_call():
        return flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, longest,
                                                 longest, causal=causal, block_table=table)
    with torch.no_grad():
        diff = (paged_call().float() - packed_call().float()).abs().max().item()
        packed_ms, paged_ms, cost = paired_ms(packed_call, paged_call, ROUNDS, PAIRS,
                                              SLEEP_CYCLES)
        fa2 = _fa2(q, k, v, cu, longest, causal)[0]
        fa2_ms = device_ms(fa2)
        ms = {"packed": packed_ms, "paged": paged_ms, "fa2_varlen_packed": fa2_ms}
        extra = {}
        if fp8_cache:  # one factor a tensor: |x| / descale inside e4m3's 448
            descales = [t.abs().amax().float() / 448 for t in (k_pages, v_pages)]
            k8, v8 = ((t.float() / d).to(torch.float8_e4m3fn)
                      for t, d in zip((k_pages, v_pages), descales))

            def fp8_call():
                return flash_tile.flash_attn_varlen_func(
                    q, k8, v8, cu, cu, longest, longest, causal=causal, block_table=table,
                    k_descale=descales[0], v_descale=descales[1])
            extra["fp8_max_diff"] = (fp8_call().float() - paged_call().float()).abs().max().item()
            _, ms["paged_fp8"], fp8_cost = paired_ms(paged_call, fp8_call, ROUNDS, PAIRS,
                                                     SLEEP_CYCLES)
            extra["fp8_over_paged"] = round(1 + fp8_cost, 3)
    f = sum(flops(1, heads, n, n, head_dim, causal) for n in lengths)
    return {"tokens": tokens, "sequences": len(lengths), "page_size": page_size,
            "causal": causal, "head_dim": head_dim, "heads": heads,
            "dtype": {v: k for k, v in DTYPES.items()}[dtype], "max_diff": diff,
            "ms": {name: round(t, 4) for name, t in ms.items()},
            "tflops": {name: round(f / t / 1e9, 1) for name, t in ms.items()},
            "paged_over_packed": round(1 + cost, 3), **extra}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256, 1])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="also time the pages as an FP8 cache (float8_e4m3fn)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or results_path("paged-varlen")
    info, rows = machine_info(), []
    grid = [(t, p, c) for t in args.tokens for p in args.pages for c in (False, True)]
    for tokens, page_size, causal in tqdm(grid, desc="paged varlen", unit="row"):
        rows.append(bench_row(tokens, page_size, causal, args.head_dim, DTYPES[args.dtype],
                              args.fp8_cache))
        tqdm.write(str(rows[-1]))
        save_json(out, info, rows=rows)
    table = md_table(
        ["tokens", "seqs", "page", "causal", "packed TFLOP/s", "paged TFLOP/s",
         "paged / packed time", "FA2 varlen (packed) TFLOP/s", "max diff",
         "FP8 cache / paged time"],
        [[r["tokens"], r["sequences"], r["page_size"], "yes" if r["causal"] else "no",
          r["tflops"]["packed"], r["tflops"]["paged"], f'{r["paged_over_packed"]}x',
          r["tflops"]["fa2_varlen_packed"], f'{r["max_diff"]:.3g}',
          f'{r["fp8_over_paged"]}x' if "fp8_over_paged" in r else "-"] for r in rows])
    write_report(out, f"Paged varlen forward, D = {args.head_dim}, {args.dtype}", info,
                 "paged / packed: the paged call's time over the packed one's, median of "
                 f"{ROUNDS} rounds of {PAIRS} neighbouring pairs (`_timing.paired_ms`).\n\n"
                 + table + "\n")


if __name__ == "__main__":
    main()
