"""What the split decode's combine costs: GPU time per step of flash_attn_with_kvcache
(bf16, causal, H 32/8, D 128, Lq 1) whole, with the combine's launch skipped (the decode's
partials only: a wrong output, timing only), and at one split; device_ms (calls queued
behind a sleep), best of 5 rounds, the three in turn each round."""
import sys
import torch
sys.path.insert(0, "bench")
from bench_attention import device_ms
import flash_tile
from flash_tile import _launch_decode
from flash_tile.kernels.attention_decode import decode_combine

real = _launch_decode.launch_on
def no_combine(device, grid, kernel, args, **kw):
    if kernel is not decode_combine:
        real(device, grid, kernel, args, **kw)

gen = torch.Generator(device="cuda").manual_seed(0)
print("B L splits | whole us | no-combine us | one-split us | combine share")
for b, l in [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (32, 1024), (1, 131072)]:
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, l, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    whole = lambda: flash_tile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
    one = lambda: flash_tile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                                      num_splits=1)
    def skipped():
        _launch_decode.launch_on = no_combine
        try:
            return whole()
        finally:
            _launch_decode.launch_on = real
    best = {"whole": 1e9, "skip": 1e9, "one": 1e9}
    for _ in range(5):
        for name, fn in (("whole", whole), ("skip", skipped), ("one", one)):
            best[name] = min(best[name], device_ms(fn, iters=50) * 1e3)
    print(b, l, "|", *(f"{best[n]:.2f}" for n in ("whole", "skip", "one")), "|",
          f"{(best['whole'] - best['skip']) / best['whole']:.1%}", flush=True)
