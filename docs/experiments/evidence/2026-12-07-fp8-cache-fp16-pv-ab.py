"""A/B of FP8-cache decode steps: this tree against ab/base, paired neighbouring calls."""
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
H, HKV, D = 32, 8, 128
for q_dtype in (torch.bfloat16, torch.float16):
    for batch, length, page in ((1, 8192, None), (1, 32768, None), (1, 131072, None),
                                (8, 8192, None),
                                (8, 32768, None), (32, 8192, None), (32, 32768, None),
                                (128, 8192, None), (8, 32768, 64), (32, 8192, 64),
                                (8, 32768, 16), (32, 8192, 256)):
        if q_dtype == torch.float16 and (page is not None or batch not in (1, 32)):
            continue
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=q_dtype, generator=gen)
        k, v = (torch.randn(batch, length, HKV, D, device="cuda", dtype=q_dtype, generator=gen)
                for _ in range(2))
        (k8, kd), (v8, vd) = quantize_by_sequence(k), quantize_by_sequence(v)
        del k, v
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        table = None
        if page:
            k8, v8, table = paged(k8, v8, page, gen)
            kd, vd = kd.amax().reshape(()), vd.amax().reshape(())
        kw = dict(cache_seqlens=lens, block_table=table, causal=True, k_descale=kd,
                  v_descale=vd)
        calls = [lambda p=p: p.flash_attn_with_kvcache(q, k8, v8, **kw) for p in (base, flash_tile)]
        outs = [c() for c in calls]
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        a_ms, b_ms, cost = paired_ms(calls[0], calls[1], 15, 10, SLEEP_CYCLES)
        aa = paired_ms(calls[0], calls[0], 15, 10, SLEEP_CYCLES)[2]
        nbytes = 2 * batch * length * HKV * D  # e4m3 K and V
        row = dict(q=str(q_dtype).split(".")[-1], batch=batch, length=length, page=page,
                   base_ms=round(a_ms, 4), new_ms=round(b_ms, 4), ratio=round(1 + cost, 4),
                   aa=round(1 + aa, 4), base_gbps=round(nbytes / a_ms / 1e6),
                   new_gbps=round(nbytes / b_ms / 1e6), max_diff=diff)
        print(row, flush=True)
        rows.append(row)
        del k8, v8, q, calls, outs
        torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_fp8_decode.json"), "w"), indent=1)
