"""Page numbers read one key step ahead (the candidate patch
2026-12-07-page-prefetch-candidate.patch: the decode's and the paged forward's loops read the
next step's block-table entries while this step's tiles load) against this tree, on the
decode: `flash_attn_with_kvcache` steps (bf16, H 32 / 8, D 128, Lq 1, causal) on shuffled
16- and 64-key pages and on a contiguous cache (unchanged code: the A/A control), the two
trees in one process, paired neighbouring calls (`_timing.paired_ms`). Compiled for sm_90
on 2026-12-07 (no GPU was lent after that); the forward's half is timed with
`bench_variants.py --baseline` (NOTES item 0).

    E=docs/experiments/evidence
    mkdir -p ab/pf && git archive HEAD flash_tile kernels | tar -x -C ab/pf
    (cd ab/pf && patch -p1 < ../../$E/2026-12-07-page-prefetch-candidate.patch)
    python $E/2026-12-07-page-prefetch-ab.py ab/pf    # writes $OUT/page-prefetch.json
"""
import json
import os
import sys

import torch

sys.path.insert(0, "bench")
import flash_tile  # noqa: E402
from bench_attention import SLEEP_CYCLES  # noqa: E402
from bench_decode import paged  # noqa: E402
from bench_launch import load_package  # noqa: E402
from flash_tile._timing import paired_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def row(candidate, batch, length, page, gen):
    """The candidate's step time over this tree's (and an A/A of this tree) for one row."""
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    k, v = (torch.randn(batch, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    table = None
    if page:
        k, v, table = paged(k, v, page, gen)
    calls = [lambda p=p: p.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                   block_table=table, causal=True)
             for p in (flash_tile, candidate)]
    diff = (calls[0]().float() - calls[1]().float()).abs().max().item()
    tree_ms, _, cost = paired_ms(calls[0], calls[1], 15, 10, SLEEP_CYCLES)
    aa = paired_ms(calls[0], calls[0], 15, 10, SLEEP_CYCLES)[2]
    gb = 2 * batch * length * KV_HEADS * HEAD_DIM * 2 / 1e9
    return {"batch": batch, "length": length, "page": page, "tree_ms": round(tree_ms, 4),
            "tree_tb_s": round(gb / tree_ms, 2), "candidate_over_tree": round(1 + cost, 4),
            "aa": round(1 + aa, 4), "max_diff": diff}


if __name__ == "__main__":
    candidate = load_package(sys.argv[1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for page in (16, 64, None):
        for batch, length in ((1, 32768), (8, 8192), (8, 32768), (32, 8192), (128, 8192)):
            rows.append(row(candidate, batch, length, page, gen))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "page-prefetch.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
