"""Backward benchmark: forward+backward and backward-only TFLOP/s and peak memory against SDPA.

flash_tile runs twice: its default backward (``flash_tile``: on Hopper the one-pass form at
head dims above 128, or where the autotuner picks it) and the deterministic two passes
(``flash_tile_2pass``).

Peak memory of a forward+backward is also measured against naive attention, over lengths.

Every backend's gradients are first checked against an fp32 reference with flash-attn's 3x
rule (SDPA cuDNN as PyTorch's own low-precision error). Backward FLOPs are 2.5x the forward's
(``flash_tile._timing.flops``); backward-only time is forward+backward minus forward, both
measured in the same rounds as every other backend of the row (``bench_attention.time_all``).
Those times are CUDA events around single calls, so they count the host's launch gaps where it
is slower than the GPU (the short rows: autograd and the launches take hundreds of
microseconds). A second table times the backward alone on the GPU: the backward of one
stored forward, calls queued behind a sleep (``bench_attention.device_ms``), for flash_tile
and SDPA's cuDNN and FLASH backends, in interleaved rounds.

    python bench/bench_backward.py        # bf16 and fp16: bench/results/backward-<gpu>.*

Writes <out>.json, <out>.md (the tables) and <out>.png (backward-only TFLOP/s); the JSON after
every row, so that a run cut short keeps what it measured, and ``--replot JSON`` writes the
tables and plot of such a file without a GPU.
"""

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import flash_tile
from bench_attention import (_peak_bytes, _sdpa, backends, chosen_variant, device_ms, failure,
                             machine_info, md_table, plot, results_path, row_verdict,
                             save_json, time_all, write_report)
from flash_tile._timing import DTYPES, flops, grid_shape, interleaved_ms
from flash_tile.reference import check_error


def _causal(backends, causal):
    """The runners of ``backends`` with ``causal`` bound: run(q, k, v)."""
    return {name: functools.partial(run, causal=causal) for name, run in backends.items()}


def _leaves(*tensors):
    """Fresh leaves with the tensors' values, needing their gradients."""
    return [t.detach().requires_grad_() for t in tensors]


def _grads(run, q, k, v, dout):
    q, k, v = _leaves(q, k, v)
    run(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def _training_step(run, q, k, v, dout):
    """(a training forward, a forward+backward step) of ``run``, as zero-argument calls.

    The forward runs on inputs that require grad, as in training (flash_tile then also stores
    the LSE); each step clears the gradients first, so no accumulation add is timed."""
    leaves = _leaves(q, k, v)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        run(*leaves).backward(dout)

    return (lambda: run(*leaves)), fwd_bwd


def _backward_only(run, q, k, v, dout):
    """The backward of one forward of ``run``, as a zero-argument call (the graph is kept)."""
    leaves = _leaves(q, k, v)
    out = run(*leaves)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


# The backends whose backward is timed on the device alone, and its rounds and calls a round.
DEVICE_BACKENDS = ("flash_tile", "flash_tile_2pass", "sdpa_cudnn", "sdpa_flash")
DEVICE_ROUNDS, DEVICE_ITERS = 3, 10


def _two_pass(q, k, v, causal):
    """flash_tile with ``deterministic=True``: the two-pass backward (bitwise reproducible),
    on the same [B, H, L, D] tensors, read in place as [B, L, H, D]."""
    return flash_tile.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      causal=causal, deterministic=True).transpose(1, 2)


def bench_row(batch, heads, length, head_dim, causal, dtype, backends, missing):
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    dout = torch.randn_like(q)
    runners = _causal(backends, causal)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal),
                     q.float(), k.float(), v.float(), dout.float())
    low = _grads(functools.partial(_sdpa(SDPBackend.CUDNN_ATTENTION), causal=causal), q, k,
                 v, dout)  # PyTorch's own rounding
    row = {"batch": batch, "heads": heads, "seqlen": length, "head_dim": head_dim,
           "causal": causal, "dtype": str(dtype).removeprefix("torch."), "fwd_bwd_tflops": {},
           "bwd_tflops": {}, "bwd_device_ms": {}, "peak_mib": {}, "skipped": dict(missing)}
    f_fwd_bwd, f_bwd = (flops(batch, heads, length, length, head_dim, causal, mode)
                        for mode in ("fwd_bwd", "bwd"))
    steps = {}
    for name, run in runners.items():
        try:
            got = _grads(run, q, k, v, dout)
            reports = [check_error(g, r, p, 3.0) for g, r, p in zip(got, ref, low)]
            del got
            if not all(r["ok"] for r in reports):
                row["skipped"][name] = f"wrong gradients: {reports}"
                continue
            # The peak of a step with fresh gradients (a cleared step would free the last).
            row["peak_mib"][name] = round(
                _peak_bytes(lambda: _grads(run, q, k, v, dout)) / 2**20, 1)
            forward, fwd_bwd = _training_step(run, q, k, v, dout)
            steps[name, "fwd"], steps[name, "fwd_bwd"] = forward, fwd_bwd
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            row["skipped"][name] = failure(e)
        finally:
            torch.cuda.empty_cache()
    times = time_all(steps)
    for name in {name for name, _ in steps}:
        forward, total = times[name, "fwd"], times[name, "fwd_bwd"]
        if isinstance(forward, Exception) or isinstance(total, Exception):
            row["skipped"][name] = failure(total if isinstance(total, Exception) else forward)
            row["peak_mib"].pop(name, None)
            continue
        # Backward-only is the difference of two medians of the same rounds.
        row["fwd_bwd_tflops"][name] = round(f_fwd_bwd / total / 1e9, 1)
        row["bwd_tflops"][name] = round(f_bwd / max(total - forward, 1e-6) / 1e9, 1)
    del steps
    backward = {}
    for name in (n for n in DEVICE_BACKENDS if n in row["bwd_tflops"]):
        try:
            backward[name] = _backward_only(runners[name], q, k, v, dout)
        except Exception as e:  # noqa: BLE001 - reported in the row, the grid goes on
            row["skipped"][f"{name} (on device)"] = failure(e)
    for name, ms in interleaved_ms(backward, DEVICE_ROUNDS,
                                   lambda fn: device_ms(fn, DEVICE_ITERS)).items():
        if isinstance(ms, Exception):  # it ran in the rounds above: report it, go on
            row["skipped"][f"{name} (on device)"] = failure(ms)
        else:
            row["bwd_device_ms"][name] = round(ms, 4)
    del backward
    torch.cuda.empty_cache()
    ours, cudnn = (row["bwd_device_ms"].get(n) for n in ("flash_tile", "sdpa_cudnn"))
    row["bwd_device_ratio_vs_cudnn"] = round(cudnn / ours, 3) if ours and cudnn else None
    row["variant"], row["variant_ms"] = chosen_variant(q, causal, backward=True)
    for key in ("fwd_bwd", "bwd"):
        ours, cudnn = row[f"{key}_tflops"].get("flash_tile"), row[f"{key}_tflops"].get(
            "sdpa_cudnn")
        row[f"{key}_ratio_vs_cudnn"] = round(ours / cudnn, 3) if ours and cudnn else None
    return row


def memory_row(length, dtype, backends, missing):
    """Peak MiB of one causal forward+backward at batch 1, 16 heads, D 128, naive attention
    included (or the out-of-memory it ends in)."""
    heads, head_dim = 16, 128
    q, k, v = (torch.randn(1, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    dout = torch.randn_like(q)
    runners = _causal(backends, True)
    row = {"seqlen": length, "heads": heads, "head_dim": head_dim, "peak_mib": {},
           "skipped": dict(missing)}
    for name, run in runners.items():
        try:
            # One call first: the peak of a steady call, without the autotuner's first-call
            # timing buffers (which made flash_tile's 8k point 496 MiB against 320 at 16k).
            _grads(run, q, k, v, dout)
            row["peak_mib"][name] = round(
                _peak_bytes(lambda: _grads(run, q, k, v, dout)) / 2**20, 1)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            row["skipped"][name] = failure(e)
        finally:
            torch.cuda.empty_cache()
    return row


def dropout_row(length, head_dim, dropout_p, dtype):
    """What dropout costs: flash_tile's and SDPA FLASH's forward and forward+backward
    TFLOP/s at ``dropout_p`` against the same call at 0, causal, B*L = 16k tokens. Correctness
    is the GPU tests' (tests/test_gpu_dropout.py); each library draws its own bits, so the
    outputs are not compared here."""
    batch, heads = grid_shape(length, head_dim)
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    dout = torch.randn_like(q)
    row = {"seqlen": length, "head_dim": head_dim, "dropout_p": dropout_p, "tflops": {}}
    f_fwd, f_fwd_bwd = (flops(batch, heads, length, length, head_dim, True, mode)
                        for mode in ("fwd", "fwd_bwd"))
    libs = {"flash_tile": functools.partial(flash_tile.scaled_dot_product_attention,
                                            is_causal=True),
            "sdpa_flash": functools.partial(_sdpa(SDPBackend.FLASH_ATTENTION), causal=True)}
    steps = {}
    for name, attend in libs.items():
        for p, label in ((0.0, "p=0"), (dropout_p, "p")):
            forward, fwd_bwd = _training_step(functools.partial(attend, dropout_p=p), q, k, v,
                                              dout)
            steps[f"{name} fwd, {label}"], steps[f"{name} fwd+bwd, {label}"] = forward, fwd_bwd
    for column, ms in time_all(steps).items():
        if isinstance(ms, Exception):
            raise ms
        row["tflops"][column] = round((f_fwd_bwd if "fwd+bwd" in column else f_fwd) / ms / 1e9,
                                      1)
    return row


def _why_missing(reason):
    """A memory cell without a figure: why (out of memory, failed, skipped), or "-"."""
    for cause in ("out of memory", "failed", "skipped"):
        if cause in reason:
            return cause
    return "-"


def dropout_table(rows):
    head = ["L", "D", "p", *rows[0]["tflops"]]
    return "\n".join(["", "Dropout's cost, causal, TFLOP/s counted as without dropout:", "",
                      md_table(head, ([r["seqlen"], r["head_dim"], r["dropout_p"],
                                       *r["tflops"].values()] for r in rows))])


def row_targets(r) -> str:
    """Issue 25's targets on one grid row: the backward (events and on-device timings) at
    least 1.0x cuDNN's (0.95x at D = 256), forward+backward at least 1.0x, and peak memory at
    or below cuDNN's; a ratio the row lacks is "not measured", never met."""
    floor = 0.95 if r["head_dim"] == 256 else 1.0
    misses, unmeasured = [], []
    for label, key, need in (("bwd", "bwd_ratio_vs_cudnn", floor),
                             ("bwd on device", "bwd_device_ratio_vs_cudnn", floor),
                             ("fwd+bwd", "fwd_bwd_ratio_vs_cudnn", 1.0)):
        ratio = r.get(key)
        if ratio is None:
            unmeasured.append(label)
        elif ratio < need:
            misses.append(f"{label} {ratio:.3f}x < {need}x")
    ours, cudnn = (r["peak_mib"].get(n) for n in ("flash_tile", "sdpa_cudnn"))
    if ours is None or cudnn is None:
        unmeasured.append("memory")
    elif ours > cudnn:
        misses.append(f"memory {ours} > {cudnn} MiB")
    return row_verdict(misses, unmeasured)


def table(rows, memory):
    """The grid's TFLOP/s and per-row peak memory (when it has rows), then the memory sweep."""
    names = ["flash_tile", "flash_tile_2pass", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient",
             "tilegym"]
    mem_names = ["flash_tile", "flash_tile_2pass", "sdpa_cudnn", "sdpa_flash", "naive"]
    parts = []
    if rows:
        head = ["dtype", "B", "H", "L", "D", "causal", *(f"fwd+bwd {n}" for n in names),
                *(f"bwd {n}" for n in names), "fwd+bwd vs cuDNN", "bwd vs cuDNN", "targets"]
        parts += [md_table(head, (
            [r["dtype"], r["batch"], r["heads"], r["seqlen"], r["head_dim"],
             "yes" if r["causal"] else "no", *(r["fwd_bwd_tflops"].get(n, "-") for n in names),
             *(r["bwd_tflops"].get(n, "-") for n in names),
             f"{r['fwd_bwd_ratio_vs_cudnn']:.2f}x" if r.get("fwd_bwd_ratio_vs_cudnn") else "-",
             f"{r['bwd_ratio_vs_cudnn']:.2f}x" if r["bwd_ratio_vs_cudnn"] else "-",
             row_targets(r)] for r in rows)),
            "", "The backward alone on the device, calls queued (ms; vs cuDNN is cuDNN's time "
            "over flash_tile's):", "",
            md_table(["dtype", "L", "D", "causal", *DEVICE_BACKENDS, "vs cuDNN",
                      "flash_tile variant"], (
                [r["dtype"], r["seqlen"], r["head_dim"], "yes" if r["causal"] else "no",
                 *(r["bwd_device_ms"].get(n, "-") for n in DEVICE_BACKENDS),
                 f"{r['bwd_device_ratio_vs_cudnn']:.2f}x" if r["bwd_device_ratio_vs_cudnn"]
                 else "-", r.get("variant", "-")] for r in rows)),
            "", "Peak memory of one forward+backward at each row's shape (MiB):", "",
            md_table(["dtype", "L", "D", "causal", *mem_names], (
                [r["dtype"], r["seqlen"], r["head_dim"], "yes" if r["causal"] else "no",
                 *(r["peak_mib"].get(n, _why_missing(r["skipped"].get(n, "")))
                   for n in mem_names)] for r in rows))]
    if memory:
        parts += ["", "Peak memory of one causal forward+backward, batch 1, 16 heads, D 128 "
                  "(MiB):", "",
                  md_table(["L", *mem_names], (
                      [r["seqlen"], *(r["peak_mib"].get(n, _why_missing(r["skipped"].get(n, "")))
                                      for n in mem_names)] for r in memory))]
    return "\n".join(parts)


def write_results(out, info, rows, memory, dropout, label):
    """<out>.md (the tables, under a title naming ``label``, the dtype) and <out>.png
    (backward-only TFLOP/s, when the grid has rows) from what a run measured; returns the
    report."""
    report = table(rows, memory) + (dropout_table(dropout) if dropout else "")
    left_out = sorted({name for r in rows + memory for name, why in r["skipped"].items()
                       if "--skip" in why})
    if left_out:
        report += f"\n\nLeft out (--skip): {', '.join(left_out)}."
    if rows:
        plot(rows, out + ".png", "bwd_tflops", "backward-only TFLOP/s")
    return write_report(out, f"Forward+backward and backward-only TFLOP/s ({label})", info,
                        report)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES),
                        help="the grid's dtypes (the memory and dropout rows use the first)")
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 4096, 16384],
                        help="the grid's lengths (none: memory and dropout rows only)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--memory-lengths", nargs="*", type=int,
                        default=[4096, 8192, 16384, 32768])
    parser.add_argument("--dropout", nargs="*", type=float, default=[],
                        help="dropout probabilities to time against 0 (causal, L 4k, each of "
                             "--head-dims)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["tilegym", "naive", "sdpa_flash", "sdpa_efficient"],
                        help="baselines to leave out (TileGym tunes its backward kernels on "
                             "each new shape: minutes per row)")
    parser.add_argument("--out", help="output path prefix (default: the headline files, "
                                       "bench/results/backward-<gpu>)")
    parser.add_argument("--replot", metavar="JSON",
                        help="redraw <out>.md and <out>.png (results copied to <out>.json) from "
                             "a results file, such as one a run cut short left; no GPU needed")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        args.out = args.out or results_path("backward", saved["machine"]["gpu"])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        sections = {name: saved.get(name, []) for name in ("rows", "memory", "dropout")}
        save_json(args.out, saved["machine"], **sections)
        names = {str(torch_dtype).removeprefix("torch."): name
                 for name, torch_dtype in DTYPES.items()}
        label = ", ".join(sorted({names[r["dtype"]] for r in saved["rows"]}))
        print(write_results(args.out, saved["machine"], **sections, label=label))
        return
    info = machine_info()
    args.out = args.out or results_path("backward")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    runners, missing = backends(args.skip, "tile_fmha_with_backward")
    runners = {"flash_tile": runners.pop("flash_tile"), "flash_tile_2pass": _two_pass, **runners}
    rows, memory, dropout = [], [], []

    def save():  # after every row: a run cut short keeps what it measured
        save_json(args.out, info, rows=rows, memory=memory, dropout=dropout)

    grid = [(dtype, head_dim, length, causal) for dtype in args.dtypes
            for head_dim in args.head_dims for length in args.lengths for causal in (False, True)]
    for name, head_dim, length, causal in tqdm(grid, desc="backward grid", unit="row"):
        rows.append(bench_row(*grid_shape(length, head_dim), length, head_dim, causal,
                              DTYPES[name], runners, missing))
        r = rows[-1]
        tqdm.write(f"{name} L={length} D={head_dim} causal={causal}: fwd+bwd {r['fwd_bwd_tflops']} "
                   f"bwd {r['bwd_tflops']} device ms {r['bwd_device_ms']} {r['skipped'] or ''}")
        save()
    for length in args.memory_lengths:
        memory.append(memory_row(length, DTYPES[args.dtypes[0]], runners, missing))
        print(f"memory L={length}: {memory[-1]['peak_mib']}", flush=True)
        save()
    for dropout_p in args.dropout:
        for head_dim in args.head_dims:
            dropout.append(dropout_row(4096, head_dim, dropout_p, DTYPES[args.dtypes[0]]))
            print(f"dropout p={dropout_p} D={head_dim}: {dropout[-1]['tflops']}", flush=True)
            save()
    print(write_results(args.out, info, rows, memory, dropout, ", ".join(args.dtypes)))


if __name__ == "__main__":
    main()
