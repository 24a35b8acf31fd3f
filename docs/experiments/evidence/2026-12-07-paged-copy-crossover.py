"""Where the pages' copy pays (``_ops_paged.copies``): a paged ``flash_attn_varlen_func``
call with its pages read in place (the PAGED switch) against the same call with its pages
copied into packed rows first (``unpage``, then the VARLEN forward), forced each way through
``_ops_paged.COPY_MIN_QUERIES``, in pairs of neighbouring calls (``_timing.paired_ms``),
on a tree with 2026-12-07-paged-copy-candidate.patch applied (``git apply``; written for it,
not yet run: no GPU was lent after it was written).
Chunked-prefill rows: B sequences of Lk keys each (GQA 32/8, D 128, bf16, causal, bottom-right)
with Lq queries each, on shuffled 16-, 64- and 256-key pages. Prints a JSON row per shape and
writes $OUT/paged-copy-crossover.json.

    FLASH_TILE_AUTOTUNE=0 python docs/experiments/evidence/2026-12-07-paged-copy-crossover.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, "bench")
import flash_tile  # noqa: E402
from bench_attention import SLEEP_CYCLES  # noqa: E402
from flash_tile import _ops_paged, reference_decode  # noqa: E402
from flash_tile._timing import paired_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def row(batch, k_len, q_len, page_size):
    gen = torch.Generator(device="cuda").manual_seed(q_len + page_size)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    k, v = (torch.randn(batch * k_len, KV_HEADS, HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu_q, cu_k = (torch.arange(batch + 1, device="cuda", dtype=torch.int32) * n
                  for n in (q_len, k_len))
    k_pages, v_pages, table = reference_decode.paged_layout(k, v, cu_k, page_size, gen)

    def call(threshold):
        def run():
            _ops_paged.COPY_MIN_QUERIES = threshold
            return flash_tile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, q_len,
                                                     k_len, causal=True, block_table=table)
        return run
    in_place, copied = call(2**31), call(1)
    with torch.no_grad():
        diff = (in_place().float() - copied().float()).abs().max().item()
        in_place_ms, _, cost = paired_ms(in_place, copied, 6, 10, SLEEP_CYCLES)
    result = {"batch": batch, "k_len": k_len, "q_len": q_len, "page": page_size,
              "in_place_ms": round(in_place_ms, 4), "copied_over_in_place": round(1 + cost, 3),
              "max_diff": diff}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    rows = [row(batch, k_len, q_len, page)
            for batch, k_len in ((8, 4096), (32, 1024))
            for page in (16, 64, 256) for q_len in (16, 64, 128, 256, 512, 1024)]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "paged-copy-crossover.json"),
              "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
