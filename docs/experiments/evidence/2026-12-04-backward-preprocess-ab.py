"""A/B: the one-pass backward's preprocess without the zero store (memset instead), with and
without an occupancy hint, against HEAD's kernels (zeros stored by the preprocess)."""
import json, sys, statistics
sys.path.insert(0, "bench")
import torch
import cuda.tile as ct
from bench_variants import load_kernels, runner
from bench_attention import device_ms
from flash_tile import _launch, variants
from flash_tile._timing import grid_shape

base = load_kernels(".device/base/kernels")
base_pre = base["attention_bwd_preprocess"]
hinted = {o: _launch.attention_bwd_preprocess.replace_hints(occupancy=o) for o in (2, 4)}
rows = [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True),
        (128, 16384, True), (64, 4096, False), (256, 1024, False), (256, 1024, True),
        (256, 4096, False), (256, 4096, True), (256, 16384, True)]
results = []
for d, L, causal in rows:
    cfg = variants.SM90_ONE_PASS if d <= 128 else variants.SM90_ONE_PASS_WIDE
    b, h = grid_shape(L, d)
    run = runner(b, h, L, d, causal, torch.bfloat16, True)
    rec = []
    saved = _launch.launch_on
    _launch.launch_on = (lambda dev, grid, k, args, **a:
                         rec.append((grid, k, args)) or saved(dev, grid, k, args, **a))
    ref = run(cfg)
    _launch.launch_on = saved
    (pg, pre, pargs), (kg, dkdv, kargs), (cg, conv, cargs) = rec
    acc = kargs[8]
    stream = torch.cuda.current_stream()
    def L_(grid, k, args):
        ct.launch(stream, grid, k, args)
    bargs = (*pargs[:5], acc, *pargs[5:9], cargs[5], *pargs[9:])
    def new(p):
        def f(full=True):
            acc.zero_(); L_(pg, p, pargs)
            if full: L_(kg, dkdv, kargs); L_(cg, conv, cargs)
        return f
    def old(full=True):
        L_(pg, base_pre, bargs)
        if full: L_(kg, dkdv, kargs); L_(cg, conv, cargs)
    variants_ = {"base": old, "memset": new(pre), "memset+occ2": new(hinted[2]),
                 "memset+occ4": new(hinted[4])}
    dq = {}
    for name, f in variants_.items():
        f(); torch.cuda.synchronize(); dq[name] = cargs[1].clone()
    diffs = {n: (dq[n].float() - dq["base"].float()).abs().max().item() for n in dq}
    times = {n: [] for n in variants_}; pre_t = {n: [] for n in variants_}
    for _ in range(5):
        for n, f in variants_.items():
            times[n].append(device_ms(f)); pre_t[n].append(device_ms(lambda: f(False)))
    row = {"d": d, "L": L, "causal": causal, "B": b, "H": h,
           "full_ms": {n: round(statistics.median(t), 4) for n, t in times.items()},
           "pre_ms": {n: round(statistics.median(t), 4) for n, t in pre_t.items()},
           "dq_maxdiff_vs_base": diffs}
    print(json.dumps(row), flush=True)
    results.append(row)
json.dump(results, open(sys.argv[1], "w"), indent=1)
