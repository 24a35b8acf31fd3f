"""Item 7: FP8-cache decode, bf16 q, D=256 and 64-key pages + cache_leftpad: tree vs ab/base."""
import json, os, sys
sys.path.insert(0, "bench")
import torch
import flash_tile
from bench_launch import load_package
from bench_decode import paged, quantize_by_sequence
from flash_tile._timing import paired_ms
from bench_attention import SLEEP_CYCLES
base = load_package("ab/base")
gen = torch.Generator(device="cuda").manual_seed(0)
rows = []
H, HKV = 32, 8
for D, batch, length, page, leftpad in ((256, 1, 32768, None, False), (256, 8, 8192, None, False),
                                        (256, 32, 8192, None, False), (256, 8, 8192, 64, False),
                                        (128, 8, 32768, 64, True), (128, 32, 8192, 64, True),
                                        (128, 32, 8192, None, True)):
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, length, HKV, D, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    (k8, kd), (v8, vd) = quantize_by_sequence(k), quantize_by_sequence(v)
    del k, v
    pad = (torch.randint(0, 512, (batch,), generator=gen, device="cuda").to(torch.int32)
           if leftpad else None)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    table = None
    if page:
        k8, v8, table = paged(k8, v8, page, gen)
        kd, vd = kd.amax().reshape(()), vd.amax().reshape(())
    kw = dict(cache_seqlens=lens, block_table=table, causal=True, k_descale=kd, v_descale=vd,
              cache_leftpad=pad)
    calls = [lambda p=p: p.flash_attn_with_kvcache(q, k8, v8, **kw) for p in (base, flash_tile)]
    outs = [c() for c in calls]
    diff = (outs[0].float() - outs[1].float()).abs().max().item()
    a_ms, b_ms, cost = paired_ms(calls[0], calls[1], 15, 10, SLEEP_CYCLES)
    aa = paired_ms(calls[0], calls[0], 15, 10, SLEEP_CYCLES)[2]
    row = dict(D=D, batch=batch, length=length, page=page, leftpad=leftpad,
               base_ms=round(a_ms, 4), new_ms=round(b_ms, 4), ratio=round(1 + cost, 4),
               aa=round(1 + aa, 4), max_diff=diff)
    print(row, flush=True)
    rows.append(row)
    del k8, v8, q, calls, outs
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "item7.json"), "w"), indent=1)
