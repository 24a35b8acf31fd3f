"""Decode benchmark: attention of a few query rows against a KV cache, GB/s of K/V read.

Each row is one decode step of B sequences whose caches hold L keys (GQA H/H_kv, D = 128,
bf16): flash_tile's ``flash_attn_with_kvcache`` on a contiguous cache and on paged caches
(page sizes 1, 16, 32, 64, 256, shuffled block tables), against SDPA's cuDNN, FLASH (FA2) and
efficient backends on the contiguous cache (``enable_gqa``, causal bottom-right through an
explicit Lq = 1 call, which needs no mask) and flash_tile's own ``flash_attn_func``. Every
backend is checked against an fp32 reference (flash-attn's 2x rule) before it is timed.
``flash_tile_fp8`` is the same step on the cache quantized to float8_e4m3fn per (sequence,
key/value head) (``flash_tile.quantize_fp8``, with ``k_descale``/``v_descale``), checked
against the reference of the dequantized cache; ``fp8_speedup`` is the bf16 cache's time per
step over the FP8 cache's (its GB/s counts the FP8 bytes it reads, half the bf16 ones).
``flash_tile_masked`` and ``sdpa_cudnn_masked`` run the step as a Transformers static cache
does: the causal band given as a materialized boolean [B, 1, Lq, L] mask (``attn_mask``),
not as a flag; ``masked_ratio`` is flash_tile's masked GB/s over its unmasked.

GB/s counts the K and V bytes the step must read, B * L * H_kv * (D + Dv) * 2, over the GPU
time per call with the calls queued behind a sleep (``bench_attention.device_ms``), so that
launch gaps do not count, the best of ROUNDS rounds that time the backends in turn;
``fraction_of_bandwidth`` divides by the read bandwidth measured in the same run (a sum over
a 4 GiB tensor). ``host_us`` is the host's time per call to issue back-to-back calls (B = 1,
L = 1k), the GPU's work not waited for (``bench_launch.back_to_back_us``): the host's cost.

    python bench/bench_decode.py                       # bench/results/decode-<gpu>.*
    python bench/bench_decode.py --batches 1 --lengths 131072 --pages 64 --out /tmp/d

Writes <out>.json (rows with ``gbps`` per backend, ``ratio_vs_cudnn`` and
``fraction_of_bandwidth``; ``paged_ratio``, each page size's GB/s over the contiguous
cache's), <out>.md and <out>.png.
"""

import argparse
import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

import flash_tile
from bench_attention import (device_ms, failure, machine_info, md_table, results_path,
                             row_verdict, save_json, write_report)
from bench_launch import decode_layers, host_us
from flash_tile import _launch, reference

PAGES = (1, 16, 32, 64, 256)
# Timing rounds: the contiguous cache's backends (and the FP8 copy) are timed in turn, round
# after round, each keeping its best. Timed once each, in a fixed order, the first backend of
# a row read B = 128, L = 1k 11% slower than in an interleaved A/B of the same calls
# (2026-12-04, H200: docs/experiments/evidence/2026-12-04-decode-mask-h200.md).
ROUNDS = 3
BACKENDS = ("flash_tile", "flash_tile_masked", "flash_tile_fp8",
            *(f"flash_tile_paged{p}" for p in PAGES), "sdpa_cudnn", "sdpa_cudnn_masked",
            "sdpa_flash", "sdpa_efficient", "flash_attn_func")
NOTE = ("Rows with Lq > 1 give SDPA torch's `causal_lower_right` bias (its `is_causal` is top-"
        "left, which decode cannot use); SDPA's backends read the cache far slower with it, so "
        "those rows' ratios compare against SDPA as a user would call it, not against cuDNN's "
        "best decode. Paged rows read the same keys through shuffled block tables, 64 keys a "
        "step: pages of 64 keys and more one tile load a step, 16- and 32-key pages four and "
        "two loads joined, 1-key pages gathered by row. `paged` is the slowest page size's "
        "GB/s over the contiguous cache's, the two timed in the same rounds (target: within "
        "5%). `masked` is the step with its band "
        "given as a boolean mask (a Transformers static cache's) over the step without one.")
SDPA = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def read_bandwidth_gbps() -> float:
    """GB/s of a sum over a 4 GiB bf16 tensor: the read bandwidth decode can hope for."""
    x = torch.ones(2**31, device="cuda", dtype=torch.bfloat16)
    ms = device_ms(functools.partial(x.sum, dtype=torch.float32), iters=10)
    del x
    return 2**32 / ms / 1e6


def paged(k, v, page_size, gen):
    """The contiguous caches [B, L, H_kv, D] as shuffled pages and their block table."""
    batch, length = k.shape[:2]
    if length % page_size:
        raise ValueError(f"a cache of {length} keys is not a whole number of {page_size}-key "
                         "pages")
    per_seq = length // page_size
    order = torch.randperm(batch * per_seq, generator=gen, device=k.device)
    table = order.view(batch, per_seq).to(torch.int32)
    pages = [torch.empty(batch * per_seq, page_size, *t.shape[2:], dtype=t.dtype,
                         device=t.device) for t in (k, v)]
    for t, p in zip((k, v), pages):
        p[order] = t.reshape(batch * per_seq, page_size, *t.shape[2:])
    return pages[0], pages[1], table


def quantize_by_sequence(cache):
    """``flash_tile.quantize_fp8`` of a [B, L, H_kv, D] cache (factors [B, H_kv]) one
    sequence at a time: its fp32 temporaries stay one sequence's size on the largest rows."""
    parts = [flash_tile.quantize_fp8(cache[b:b + 1]) for b in range(cache.shape[0])]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def runners(q, k, v, lens):
    """{backend: call} for one row on the contiguous cache."""
    calls = {"flash_tile": lambda: flash_tile.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=lens, causal=True)}
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    # Lq = 1 sees every key; more rows need the bottom-right causal bias (torch's is_causal
    # is top-left).
    mask = causal_lower_right(q.shape[1], k.shape[1]) if q.shape[1] > 1 else None
    for name, backend in SDPA.items():
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                      enable_gqa=True).transpose(1, 2)
        calls[name] = call
    calls["flash_attn_func"] = lambda: flash_tile.flash_attn_func(q, k, v, causal=True)
    # A static cache's step: the band as a boolean mask, one per sequence, as transformers
    # builds it.
    q_len, length = q.shape[1], k.shape[1]
    band = torch.ones(q_len, length, dtype=torch.bool, device=q.device).tril(length - q_len)
    band = band.expand(q.shape[0], 1, q_len, length).contiguous()
    calls["flash_tile_masked"] = lambda: flash_tile.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=lens, attn_mask=band)

    def cudnn_masked():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=band,
                                                  enable_gqa=True).transpose(1, 2)
    calls["sdpa_cudnn_masked"] = cudnn_masked
    return calls


def best_of_rounds(calls: dict) -> dict:
    """{name: GPU ms per call}: the best of ROUNDS rounds that time every call in turn
    (``device_ms``), so that no call alone meets the GPU as the previous one left it."""
    best = {}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            best[name] = min(device_ms(call), best.get(name, float("inf")))
    return best


def row_inputs(batch, length, heads, kv_heads, head_dim, q_len):
    """(generator, q, k, v, cache lengths) of one row, seeded by B and L: q [B, Lq, H, D] and
    the caches [B, L, H_kv, D] in bf16, every sequence L keys long."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + length)
    q, k, v = (torch.randn(batch, n, h, head_dim, generator=gen, device="cuda",
                           dtype=torch.bfloat16)
               for n, h in ((q_len, heads), (length, kv_heads), (length, kv_heads)))
    return gen, q, k, v, torch.full((batch,), length, dtype=torch.int32, device="cuda")


def row_reference(q, k, v):
    """(ends, seqs, ref, low): the first and the last sequence (they share the shape and the code
    path; the last sits at the cache's highest offsets, past 2**31 elements in the largest
    rows) as [B', H, L, D] views, attended causally (bottom-right) in fp32 and in bf16."""
    batch, q_len, length = q.shape[0], q.shape[1], k.shape[1]
    ends = [0, batch - 1] if batch > 1 else [0]
    seqs = [t[ends].transpose(1, 2) for t in (q, k, v)]
    args = dict(diag_offset=length - q_len, window=(-1, 0))
    return (ends, seqs, reference.attention_dense(*(t.float() for t in seqs), **args),
            reference.attention_dense(*seqs, **args))


def bench_row(batch, length, heads, kv_heads, head_dim, q_len, page_sizes, bandwidth):
    gen, q, k, v, lens = row_inputs(batch, length, heads, kv_heads, head_dim, q_len)
    row = {"batch": batch, "seqlen": length, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "q_len": q_len, "gbps": {}, "skipped": {}, "max_err": {}}
    ends, seqs, ref, low = row_reference(q, k, v)
    nbytes = batch * length * kv_heads * head_dim * 2 * 2

    def checked(name, call, ref=ref, low=low):
        """Whether ``call`` runs and gives the reference's result (flash-attn's 2x rule)."""
        try:
            out = call()
            report = reference.check_error(out[ends].transpose(1, 2), ref, low)
            row["max_err"][name] = report["max_err"]
            if not report["ok"]:
                row["skipped"][name] = f"wrong result: {report}"
            return report["ok"]
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this row
            row["skipped"][name] = failure(e)
            return False

    def timed(calls):
        """GB/s of each (call, bytes) in ``calls``, timed by ``best_of_rounds``."""
        ms = best_of_rounds({name: call for name, (call, _) in calls.items()})
        for name, (_, size) in calls.items():
            row["gbps"][name] = round(size / ms[name] / 1e6, 1)

    contiguous = {name: (call, nbytes) for name, call in runners(q, k, v, lens).items()
                  if checked(name, call)}
    (k8, kd), (v8, vd) = (quantize_by_sequence(t) for t in (k, v))
    deq = [(t8[ends].float() * d[ends][:, None, :, None]).transpose(1, 2)
           for t8, d in ((k8, kd), (v8, vd))]
    args = dict(diag_offset=length - q_len, window=(-1, 0))
    fp8 = functools.partial(flash_tile.flash_attn_with_kvcache, q, k8, v8, cache_seqlens=lens,
                            causal=True, k_descale=kd, v_descale=vd)
    if checked("flash_tile_fp8", fp8, reference.attention_dense(seqs[0].float(), *deq, **args),
               reference.attention_dense(seqs[0], *(t.to(q.dtype) for t in deq), **args)):
        contiguous["flash_tile_fp8"] = (fp8, nbytes // 2)
    timed(contiguous)
    ours_call = contiguous["flash_tile"][0] if "flash_tile" in contiguous else None
    del k8, v8, contiguous, fp8
    row["paged_ratio"] = {}
    for size in page_sizes:  # one paged copy at a time: the caches can be tens of GiB
        name = f"flash_tile_paged{size}"
        if length % size:  # the grid's lengths are powers of two; a --lengths may not be
            row["skipped"][name] = f"skipped: {length} keys are not whole {size}-key pages"
            continue
        kp, vp, table = paged(k, v, size, gen)
        call = functools.partial(flash_tile.flash_attn_with_kvcache, q, kp, vp,
                                 cache_seqlens=lens, block_table=table, causal=True)
        if checked(name, call):
            # Beside the contiguous call, in the same rounds: the ratio is of one pair of
            # timings, not of timings taken minutes apart.
            ms = best_of_rounds({"paged": call} if ours_call is None else
                                {"paged": call, "contiguous": ours_call})
            row["gbps"][name] = round(nbytes / ms["paged"] / 1e6, 1)
            if ours_call is not None:
                row["paged_ratio"][size] = round(ms["contiguous"] / ms["paged"], 3)
        del kp, vp, table, call
    ours, cudnn = row["gbps"].get("flash_tile"), row["gbps"].get("sdpa_cudnn")
    row["ratio_vs_cudnn"] = round(ours / cudnn, 3) if ours and cudnn else None
    masked = row["gbps"].get("flash_tile_masked")
    row["masked_ratio"] = round(masked / ours, 3) if ours and masked else None
    fp8 = row["gbps"].get("flash_tile_fp8")
    row["fp8_speedup"] = round(2 * fp8 / ours, 3) if ours and fp8 else None
    row["fraction_of_bandwidth"] = round(ours / bandwidth, 3) if ours else None
    row["cache_mib"] = round(nbytes / 2**20, 1)
    return row


def host_row(heads, kv_heads, head_dim):
    """Host microseconds per call, B = 1, L = 1k, Lq = 1 (the GPU is never the bottleneck):
    ``bench_launch.decode_layers``, and SDPA's backends as the grid calls them."""
    q = torch.randn(1, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    calls = {n: f for n, f in runners(q, k, v, lens).items()
             if n in ("sdpa_cudnn", "sdpa_flash", "flash_attn_func")}
    calls.update(decode_layers(heads, kv_heads, head_dim))
    return {name: round(us, 1) for name, us in host_us(calls).items()}


#: Issue 23's host time a decode call may take, microseconds.
HOST_TARGET_US = 20.0


def host_verdict(host_us: dict) -> str:
    """The host line of the report: every layer's microseconds, and the 20 us target judged
    on the public call (``flash_attn_with_kvcache``, its chosen splits and one split)."""
    calls = {n: us for n, us in host_us.items() if n.startswith("flash_attn_with_kvcache")}
    misses = [f"{n} {us} us" for n, us in calls.items() if us > HOST_TARGET_US]
    verdict = row_verdict(misses, [] if calls else ["no public call timed"])
    return (f"Host microseconds per call (B = 1, L = 1k): {host_us}\n\n"
            f"Host time <= {HOST_TARGET_US:.0f} us a decode call: {verdict}.")


SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def sweep_row(batch, length, heads, kv_heads, head_dim):
    """K/V GB/s of flash_tile's decode (Lq = 1, causal, contiguous) at each split count of
    SWEEP_SPLITS, and the count ``num_splits=0`` picks: the measurements that set
    ``DecodeConfig``'s split policy."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + length)
    q = torch.randn(batch, 1, heads, head_dim, generator=gen, device="cuda",
                    dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, kv_heads, head_dim, generator=gen, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    nbytes = batch * length * kv_heads * head_dim * 2 * 2
    gbps = {}
    for splits in (0, *SWEEP_SPLITS):
        call = functools.partial(flash_tile.flash_attn_with_kvcache, q, k, v,
                                 cache_seqlens=lens, causal=True, num_splits=splits)
        gbps[splits] = round(nbytes / device_ms(call) / 1e6, 1)
    with without_pdl():
        gbps["0, no PDL"] = round(nbytes / device_ms(call_chosen(q, k, v, lens)) / 1e6, 1)
    return {"batch": batch, "seqlen": length, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "gbps_by_splits": gbps,
            "best_splits": max(SWEEP_SPLITS, key=gbps.get)}


def call_chosen(q, k, v, lens):
    return functools.partial(flash_tile.flash_attn_with_kvcache, q, k, v, cache_seqlens=lens,
                             causal=True)


@contextlib.contextmanager
def without_pdl():
    """flash_tile's launches without programmatic dependent launch (its A/B): cuTile's launch
    wrapped to drop the attribute."""
    launch = _launch.ct.launch

    def plain(*args, programmatic_dependent_launch=False):
        return launch(*args)

    _launch.ct.launch = plain
    try:
        yield
    finally:
        _launch.ct.launch = launch


def sweep_table(rows):
    head = ["B", "L", "H/H_kv", "chosen (0)", *map(str, SWEEP_SPLITS), "best", "chosen/best",
            "chosen, no PDL", "PDL gain"]
    lines = [[r["batch"], r["seqlen"], f"{r['heads']}/{r['kv_heads']}",
              *(r["gbps_by_splits"][s] for s in (0, *SWEEP_SPLITS)), r["best_splits"],
              f"{r['gbps_by_splits'][0] / r['gbps_by_splits'][r['best_splits']]:.2f}",
              r["gbps_by_splits"]["0, no PDL"],
              f"{r['gbps_by_splits'][0] / r['gbps_by_splits']['0, no PDL']:.3f}"]
             for r in rows]
    return ("K/V GB/s by split count (Lq = 1, causal, contiguous cache). A count above the "
            "key tiles a query tile sees runs as that many splits (one tile each), so columns "
            "past it repeat the cap's timing.\n\n") + md_table(
        head, lines)


def table(rows, bandwidth):
    names = [n for n in BACKENDS if any(n in r["gbps"] for r in rows)]
    head = ["B", "L", "H/H_kv", "Lq", "cache MiB", *names, "vs cuDNN", "of bandwidth",
            "paged", "masked", "FP8 cache speedup", "targets"]
    lines = []
    for r in rows:
        ratio, frac = r["ratio_vs_cudnn"], r["fraction_of_bandwidth"]
        misses, unmeasured = [], []
        if ratio is None:  # a backend failed its check or did not run: no verdict, no "met"
            unmeasured.append("vs cuDNN")
        elif ratio < 1.0:
            misses.append("< 1.0x cuDNN")
        if r["cache_mib"] >= 32 and frac is None:
            unmeasured.append("bandwidth")
        elif r["cache_mib"] >= 32 and frac < 0.9:
            misses.append("< 90% bandwidth")
        paged = min(r.get("paged_ratio", {}).values(), default=None)
        if paged is not None and paged < 0.95:
            misses.append("paged < 0.95x")
        verdict = row_verdict(misses, unmeasured)
        lines.append([r["batch"], r["seqlen"], f"{r['heads']}/{r['kv_heads']}", r["q_len"],
                      r["cache_mib"], *(r["gbps"].get(n, "-") for n in names),
                      f"{ratio:.2f}x" if ratio else "-", f"{frac:.0%}" if frac else "-",
                      f"{paged:.2f}x" if paged else "-",
                      f"{r['masked_ratio']:.2f}x" if r.get("masked_ratio") else "-",
                      f"{r['fp8_speedup']:.2f}x" if r.get("fp8_speedup") else "-",
                      verdict])
    # A backend that ran on no row has no column: say so, with its first row's reason.
    absent = []
    for n in BACKENDS:
        why = [r["skipped"][n] for r in rows if n in r["skipped"]]
        if n not in names and why:
            absent.append(f"{n} (not measured on any row: {why[0]})")
    return (f"K/V GB/s per backend; read bandwidth measured in the same run: "
            f"{bandwidth:.0f} GB/s.\n\n{NOTE}\n\n" + md_table(head, lines) +
            (f"\n\nNo column: {'; '.join(absent)}." if absent else ""))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"B{r['batch']} L{r['seqlen'] // 1024}k Lq{r['q_len']}" for r in rows]
    names = [n for n in BACKENDS if any(n in r["gbps"] for r in rows)]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))],
               [r["gbps"].get(name, 0) for r in rows], width, label=name)
    ax.set_xticks([x + 0.4 for x in range(len(rows))], labels, rotation=45, ha="right",
                  fontsize=7)
    ax.set_ylabel("K/V read, GB/s")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 8192, 32768, 131072])
    parser.add_argument("--heads", nargs="+", default=["32/8"], help="H/H_kv pairs")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-lens", nargs="+", type=int, default=[1])
    parser.add_argument("--pages", nargs="*", type=int, default=list(PAGES))
    parser.add_argument("--max-cache-gib", type=float, default=34.0,
                        help="rows whose K/V exceed this are left out")
    parser.add_argument("--out", help="output path prefix (default: bench/results/decode-<gpu>)")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="time every split count of SWEEP_SPLITS on the grid instead")
    args = parser.parse_args()
    args.out = args.out or results_path("decode")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    info = machine_info()
    info["read_bandwidth_gbps"] = bandwidth = round(read_bandwidth_gbps(), 1)
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    shapes = [(b, n, h, kvh, lq) for h, kvh in heads for lq in args.q_lens
              for b in args.batches for n in args.lengths]
    grid = [s for s in shapes if s[0] * s[1] * s[3] * args.head_dim * 4 <=
            args.max_cache_gib * 2**30]
    left_out = ", ".join(f"B = {b} L = {n} H = {h}/{kvh} Lq = {lq}"
                         for b, n, h, kvh, lq in shapes if (b, n, h, kvh, lq) not in grid)
    left_out = (f"\n\nLeft out, their K/V over --max-cache-gib {args.max_cache_gib:g}: "
                f"{left_out}." if left_out else "")
    if args.sweep_splits:
        rows = [sweep_row(b, n, h, kvh, args.head_dim)
                for b, n, h, kvh, _ in tqdm(grid, desc="split sweep", unit="row")]
        save_json(args.out, info, rows=rows)
        print(write_report(args.out, "Decode split counts", info, sweep_table(rows)))
        return
    info["host_us"] = host_row(*heads[0], args.head_dim)
    rows = []
    for b, n, h, kvh, lq in tqdm(grid, desc="decode grid", unit="row"):
        rows.append(bench_row(b, n, h, kvh, args.head_dim, lq, args.pages, bandwidth))
        tqdm.write(f"B={b} L={n} H={h}/{kvh} Lq={lq}: {rows[-1]['gbps']} "
                   f"{rows[-1]['skipped'] or ''}")
        save_json(args.out, info, rows=rows)
        torch.cuda.empty_cache()
    write_report(args.out, "Decode, K/V read GB/s (bf16, causal)", info,
                 f"{table(rows, bandwidth)}{left_out}\n\n{host_verdict(info['host_us'])}")
    plot(rows, args.out + ".png")
    print(table(rows, bandwidth))


if __name__ == "__main__":
    main()
