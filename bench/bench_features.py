"""Forward benchmark of the features: GQA/MQA, sliding windows, large and odd head dims.

Each row is checked, then timed, as in ``bench_attention.py``, against every SDPA backend that
accepts it (a window becomes an explicit boolean mask there; GQA uses ``enable_gqa``); the
ratio is against the fastest of them in the same run. FLOPs count the (query, key) pairs the
mask leaves visible: 4 D per pair, so windowed rows are comparable to full ones.

    python bench/bench_features.py --out bench/out/features
"""

import argparse
import os

import torch
from torch.nn.attention import SDPBackend
from tqdm import tqdm

import flash_tile
from bench_attention import (SDPA_BACKENDS, _sdpa, machine_info, md_table, measure, save_json,
                             write_report)
from flash_tile._timing import DTYPES
from flash_tile.reference import visible_keys

# (label, batch, heads, kv_heads, seqlen, head_dim, window (left, right) or None for none,
# causal); L = 16k for the windows, as flash-attention's local-attention benchmarks.
ROWS = [
    ("GQA 32/8", 4, 32, 8, 4096, 128, None, False),
    ("GQA 32/8", 4, 32, 8, 4096, 128, None, True),
    ("MQA 32/1", 4, 32, 1, 4096, 128, None, True),
    ("window 256", 1, 16, 16, 16384, 128, (256, 0), True),
    ("window 1024", 1, 16, 16, 16384, 128, (1024, 0), True),
    ("window 4096", 1, 16, 16, 16384, 128, (4096, 0), True),
    ("D=96", 4, 16, 16, 4096, 96, None, False),
    ("D=96", 4, 16, 16, 4096, 96, None, True),
    ("D=192", 4, 16, 16, 4096, 192, None, False),
    ("D=192", 4, 16, 16, 4096, 192, None, True),
    ("D=256", 4, 16, 16, 4096, 256, None, False),
    ("D=256", 4, 16, 16, 4096, 256, None, True),
]


def bench_feature_row(label, batch, heads, kv_heads, length, head_dim, window, causal, dtype):
    q = torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=dtype)
            for _ in range(2))
    eff_window = (window[0], 0 if causal else window[1]) if window else (-1, 0 if causal else -1)
    visible = visible_keys(length, length, 0, eff_window).cuda()
    pairs = visible.sum().item()
    mask = visible if window else None
    gqa = heads != kv_heads

    def sdpa(backend, q, k, v):
        return _sdpa(backend)(q, k, v, causal and mask is None, attn_mask=mask, enable_gqa=gqa)

    group = heads // kv_heads
    k_ref, v_ref = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    ref = sdpa(SDPBackend.EFFICIENT_ATTENTION, q.float(), k_ref, v_ref)
    runners = {"flash_tile": lambda: flash_tile.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
        window_size=window or (-1, -1)).transpose(1, 2)}
    runners.update({name: (lambda b=b: sdpa(b, q, k, v)) for name, b in SDPA_BACKENDS.items()})
    out_pt = None
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        try:
            out_pt = runners[name]()
            break
        except RuntimeError:
            continue
    row = {"label": label, "batch": batch, "heads": heads, "kv_heads": kv_heads,
           "seqlen": length, "head_dim": head_dim, "window": window, "causal": causal,
           "dtype": str(dtype).removeprefix("torch."), "tflops": {}, "peak_mib": {},
           "max_err": {}, "skipped": {}}
    if out_pt is None:  # no SDPA backend ran: no low-precision error to hold anything to
        row["skipped"] = {name: "skipped: no SDPA backend ran this shape, so flash-attn's "
                          "rule has no bound" for name in runners}
        row["best_sdpa"] = row["ratio_vs_best_sdpa"] = None
        return row
    measure(row, runners, ref, out_pt, 4.0 * batch * heads * head_dim * pairs)
    best = max((t for n, t in row["tflops"].items() if n.startswith("sdpa")), default=None)
    ours = row["tflops"].get("flash_tile")
    row["best_sdpa"] = best
    row["ratio_vs_best_sdpa"] = round(ours / best, 3) if ours and best else None
    return row


def table(rows):
    head = ["row", "B", "H/Hkv", "L", "D", "causal", "flash_tile", "best SDPA", "ratio",
            "not run"]
    return md_table(head, ([r["label"], r["batch"], f"{r['heads']}/{r['kv_heads']}",
                            r["seqlen"], r["head_dim"], "yes" if r["causal"] else "no",
                            r["tflops"].get("flash_tile", "-"), r["best_sdpa"] or "-",
                            f"{r['ratio_vs_best_sdpa']:.2f}x" if r["ratio_vs_best_sdpa"] else "-",
                            ", ".join(sorted(r["skipped"])) or ""] for r in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--out", default="bench/out/features", help="output path prefix")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    info = machine_info()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    for spec in tqdm(ROWS, desc="features", unit="row"):
        rows.append(bench_feature_row(*spec, dtype))
        r = rows[-1]
        tqdm.write(f"{r['label']} causal={r['causal']}: {r['tflops']} "
                   f"ratio_vs_best_sdpa={r['ratio_vs_best_sdpa']} {r['skipped'] or ''}")
        save_json(args.out, info, rows=rows)
    print(write_report(args.out, "Forward features, TFLOP/s of visible (query, key) pairs,",
                       info, table(rows)))


if __name__ == "__main__":
    main()
