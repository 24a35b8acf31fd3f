"""Forward attention benchmark: flash_tile against SDPA's backends, TileGym and naive attention.

Every row is checked before it is timed: each backend's output against an fp32 reference
(SDPA's memory-efficient backend in float32) with flash-attn's rule, taking SDPA cuDNN as
PyTorch's own low-precision error. A backend that fails the check is reported, not timed.
Times are medians of CUDA-event timings after warm-up, taken in rounds that time every backend
of a row once each (``time_all``); TFLOP/s use ``flash_tile._timing.flops``; ratios are against
SDPA cuDNN measured in the same run. Peak memory is the allocator's peak
above the inputs during one call.

    python bench/bench_attention.py                      # full grid, fp16 and bf16
    python bench/bench_attention.py --dtypes bf16 --lengths 1024 4096 --out /tmp/b

Writes <out>.json (machine, versions, one record per row), <out>.md (the table) and <out>.png.
"""

import argparse
import datetime
import functools
import json
import math
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import flash_tile
from flash_tile import _ops, autotune, variants
from flash_tile._timing import (DTYPES, GRID_LENGTHS, GRID_TOKENS, GRID_WIDTH, cuda_time_ms,
                                flops, grid_shape, interleaved_ms, spin)
from flash_tile._validate import driver_version, package_version
from flash_tile.reference import check_error

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
BACKENDS = ["flash_tile", *SDPA_BACKENDS, "tilegym", "naive"]


# Timing of a row: ROUNDS rounds that time each backend once (cuda_time_ms of ITERS calls after
# WARMUP), so that a drift of the GPU's clocks weighs on every backend alike.
ROUNDS, WARMUP, ITERS = 4, 2, 5
# GPU clock cycles of the sleep that the calls of ``device_ms`` queue behind (about 25 ms on
# an H200), more than the host needs to issue them.
SLEEP_CYCLES = 50_000_000


def time_all(fns: dict) -> dict:
    """Median ms of each zero-argument fn, interleaved (``_timing.interleaved_ms``); a fn
    that raised maps to its exception."""
    return interleaved_ms(fns, ROUNDS, lambda fn: cuda_time_ms(fn, WARMUP, ITERS))


def device_ms(fn, iters: int = 20) -> float:
    """GPU milliseconds per call of ``iters`` calls issued while the GPU sleeps, so that they
    run back to back with no launch gap (CUDA events around single calls, as ``time_all``
    takes them, count the gap where the host is slower than the GPU)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin(SLEEP_CYCLES)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _tilegym(name):
    """TileGym's cuTile attention ``tilegym.ops.cutile.attention.<name>`` as a runner, or the
    reason it cannot run here."""
    try:
        import tilegym.ops.cutile.attention as tilegym_attention
        attend = getattr(tilegym_attention, name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        kind = "not installed" if isinstance(e, ModuleNotFoundError) else f"import failed: {e}"
        return None, kind
    return (lambda q, k, v, causal: attend(q, k, v, is_causal=causal)), None


def backends(skip, tilegym_name="tile_fmha"):
    """({name: run(q, k, v, causal)} for flash_tile, SDPA's backends, TileGym (its
    ``tilegym_name`` entry point) and naive attention, less those in ``skip``; {name: why} for
    those left out)."""
    runners = {"flash_tile": lambda q, k, v, causal: flash_tile.scaled_dot_product_attention(
        q, k, v, is_causal=causal)}
    runners.update({name: _sdpa(b) for name, b in SDPA_BACKENDS.items()})
    skipped = {name: "skipped: --skip" for name in skip}
    tilegym, why = _tilegym(tilegym_name)
    if tilegym is not None:
        runners["tilegym"] = tilegym
    elif "tilegym" not in skip:
        skipped["tilegym"] = f"skipped: {why}"
    runners["naive"] = _naive
    return {name: run for name, run in runners.items() if name not in skip}, skipped


def _naive(q, k, v, causal):
    """Matmul, softmax, matmul with the [L, L] scores in HBM; the softmax in fp32 (scores
    rounded to fp16/bf16 failed the error rule by 3-9x on the H200)."""
    s = (q @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s, dim=-1).to(q.dtype) @ v


def failure(e: Exception) -> str:
    """One line for a baseline that could not run (some exceptions have no message)."""
    return f"failed: {str(e).splitlines()[0][:120] if str(e) else repr(e)}"


def _sdpa(backend):
    """SDPA pinned to ``backend``: run(q, k, v, causal, **other SDPA arguments)."""
    def run(q, k, v, causal, **kwargs):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return run


def _peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(row, runners, ref, out_pt, f):
    """Fill ``row`` for each zero-argument runner: its output checked against the fp32 ``ref``
    with flash-attn's rule (``out_pt`` is PyTorch's own low-precision result), then, if right,
    its median TFLOP/s for ``f`` FLOPs (every checked runner timed in the same rounds) and its
    peak memory. Failures are recorded, not timed."""
    checked = {}
    for name, run in runners.items():
        try:
            start = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            if name == "flash_tile":
                row["first_call_s"] = round(time.perf_counter() - start, 3)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            row["skipped"][name] = failure(e)
            continue
        report = check_error(out, ref, out_pt)
        row["max_err"][name] = report["max_err"]
        del out
        if not report["ok"]:
            row["skipped"][name] = f"wrong result: {report}"
            continue
        checked[name] = run
    for name, ms in time_all(checked).items():
        if isinstance(ms, Exception):
            row["skipped"][name] = failure(ms)
            continue
        row["tflops"][name] = round(f / ms / 1e9, 1)
        row["peak_mib"][name] = round(_peak_bytes(checked[name]) / 2**20, 1)


def bench_row(batch, heads, length, head_dim, causal, dtype, runners, skipped):
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    out_pt = _sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)  # PyTorch's own rounding
    row = {"batch": batch, "heads": heads, "seqlen": length, "head_dim": head_dim,
           "causal": causal, "dtype": str(dtype).removeprefix("torch."),
           "tflops": {}, "peak_mib": {}, "max_err": {}, "skipped": dict(skipped)}
    f = flops(batch, heads, length, length, head_dim, causal)
    measure(row, {name: functools.partial(run, q, k, v, causal) for name, run in runners.items()},
            ref, out_pt, f)
    cudnn = row["tflops"].get("sdpa_cudnn")
    ours = row["tflops"].get("flash_tile")
    row["ratio_vs_cudnn"] = round(ours / cudnn, 3) if ours and cudnn else None
    row["variant"], row["variant_ms"] = chosen_variant(q, causal)
    return row


def chosen_variant(q, causal, backward=False, batch=None):
    """(the tile variant flash_tile launched for the forward, or with ``backward`` the
    backward, of ``q`` [B, H, L, D] against itself, the tuner's timings of every candidate),
    or the default variant and None when untuned. With ``batch``, ``q`` is a varlen packing
    [total, H, D] of that many sequences."""
    capability = torch.cuda.get_device_capability(q.device)
    default = (variants.default_backward_config(capability, q.shape[-1], plain=True) if backward
               else variants.default_config(capability, q.shape[-1]))
    key = _ops.problem_key(backward, q, q, q, (-1, 0) if causal else (-1, -1), 0.0, None, None,
                           0.0, batch)
    entry = autotune.cached_entry(key, q.device) if autotune.enabled() else None
    if entry is None:
        return autotune.describe(default) + " (default)", None
    return autotune.describe(variants.TileConfig(**entry["config"])), entry["results"]


def machine_info():
    driver = driver_version()
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_tile": package_version("cuda-tile"),
            "flash_tile": flash_tile.__version__, "commit": source_commit(),
            "code": autotune.code_digest(),
            "autotune": autotune.enabled(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def source_commit() -> str | None:
    """The git commit of the source tree the benchmark runs from (None outside a checkout);
    ``code`` beside it is the digest of the kernels and the tile registry, which the tuner's
    cache keys on. ``FLASH_TILE_COMMIT`` names it where the tree is a copy whose git history
    lags behind the files (a GPU machine handed the working tree, not the repository)."""
    if os.environ.get("FLASH_TILE_COMMIT"):
        return os.environ["FLASH_TILE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def results_path(name, gpu=None):
    """The headline results' path prefix for this GPU: ``bench/results/<name>-<gpu>``, the GPU
    named by the last word of its name in lower case (``forward-h200`` on an NVIDIA H200)."""
    gpu = gpu or torch.cuda.get_device_name(0)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"{name}-{gpu.split()[-1].lower()}")


def pass_bars(path, labels, forward, fwd_bwd, target, target_label, ylabel):
    """A PNG of two bars a row (forward, forward+backward values) against a dashed target
    line: the plot of the benchmarks that report one figure per pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (values, name) in enumerate(((forward, "forward"), (fwd_bwd, "fwd+bwd"))):
        ax.bar([x + 0.4 * i for x in range(len(labels))], values, 0.4, label=name)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=target_label)
    ax.set_xticks([x + 0.2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def md_table(head, rows) -> str:
    """A Markdown table: the header cells, then one list of cells per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, cells)) + " |" for cells in rows]
    return "\n".join(lines)


def row_verdict(misses: list[str], unmeasured: list[str]) -> str:
    """A row's verdict on its targets: "met", or what it missed and what it did not measure
    (a target without a measurement is never met)."""
    parts = ([f"missed: {', '.join(misses)}"] if misses else []) + \
        ([f"not measured: {', '.join(unmeasured)}"] if unmeasured else [])
    return "; ".join(parts) or "met"


def table(rows):
    names = [n for n in BACKENDS if any(n in r["tflops"] for r in rows)]
    head = ["dtype", "B", "H", "L", "D", "causal", *names, "vs cuDNN", "flash_tile variant"]
    return md_table(head, ([r["dtype"], r["batch"], r["heads"], r["seqlen"], r["head_dim"],
                            "yes" if r["causal"] else "no",
                            *(r["tflops"].get(n, "-") for n in names),
                            f"{r['ratio_vs_cudnn']:.2f}x" if r["ratio_vs_cudnn"] else "-",
                            r.get("variant", "-")] for r in rows))


def plot(rows, path, key="tflops", ylabel="forward TFLOP/s"):
    """``row[key]`` TFLOP/s against sequence length: a row of panels per dtype, one per (D,
    causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    shapes = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(len(dtypes), len(shapes), figsize=(3.6 * len(shapes),
                             3.0 * len(dtypes)), squeeze=False)
    for row_axes, dtype in zip(axes, dtypes):
        for ax, (head_dim, causal) in zip(row_axes, shapes):
            sel = sorted((r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) ==
                          (dtype, head_dim, causal)), key=lambda r: r["seqlen"])
            for name in BACKENDS:
                pts = [(r["seqlen"], r[key][name]) for r in sel if name in r[key]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=name,
                            lw=2.5 if name == "flash_tile" else 1)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{dtype} D={head_dim} {'causal' if causal else 'full'}", fontsize=9)
            ax.tick_params(labelsize=7)
        row_axes[0].set_ylabel(ylabel, fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(GRID_LENGTHS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=[n for n in BACKENDS[1:] if n != "sdpa_cudnn"],
                        help="baselines to leave out (reported as skipped); SDPA cuDNN is the "
                             "ratios' baseline and stays")
    parser.add_argument("--out", help="output path prefix (default: the headline files, "
                                       "bench/results/forward-<gpu>)")
    parser.add_argument("--replot", metavar="JSON",
                        help="redraw <out>.png and <out>.md (rows copied to <out>.json) from a "
                             "results file; no GPU needed")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        args.out = args.out or results_path("forward", saved["machine"]["gpu"])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        save(saved["rows"], saved["machine"], args.out)
        plot(saved["rows"], args.out + ".png")
        return

    args.out = args.out or results_path("forward")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    runners, skipped = backends(args.skip)
    for name, why in skipped.items():
        print(f"{name}: {why}")

    info = machine_info()
    print(json.dumps(info))
    rows = []
    grid = [(dtype, head_dim, length, causal) for dtype in args.dtypes
            for head_dim in args.head_dims for length in args.lengths
            for causal in (False, True)]
    for dtype, head_dim, length, causal in tqdm(grid, desc="forward grid", unit="row"):
        row = bench_row(*grid_shape(length, head_dim), length, head_dim, causal,
                        DTYPES[dtype], runners, skipped)
        rows.append(row)
        bad = {n: s for n, s in row["skipped"].items() if n not in skipped}
        tqdm.write(f"{dtype} L={length} D={head_dim} causal={causal}: {row['tflops']} "
                   f"ratio_vs_cudnn={row['ratio_vs_cudnn']} {bad or ''}")
        save(rows, info, args.out)  # after every row: a cut-short run keeps its rows
    print(table(rows))
    plot(rows, args.out + ".png")


def save_json(out, info, **sections):
    """<out>.json with the machine and each section (``rows=...``) measured so far; the
    benchmarks call it after each row, so a run cut short keeps what it measured."""
    with open(out + ".json", "w") as f:
        json.dump({"machine": info, **sections}, f, indent=1)


# Issue 5's targets for flash_tile's forward: (baseline, least ratio) on every row.
TARGETS = (("sdpa_cudnn", 1.0), ("sdpa_flash", 1.3), ("tilegym", 1.2))


def targets(rows):
    """One plain line per target: on how many rows it is met, and the worst and median ratio."""
    lines = []
    for name, goal in TARGETS:
        ratios = sorted(r["tflops"]["flash_tile"] / r["tflops"][name] for r in rows
                        if "flash_tile" in r["tflops"] and name in r["tflops"])
        if not ratios:
            lines.append(f"- >= {goal}x {name}: not measured")
            continue
        met = sum(x >= goal for x in ratios)
        verdict = "met" if met == len(ratios) else "NOT met"
        lines.append(f"- >= {goal}x {name}: {verdict} (met on {met}/{len(ratios)} rows; worst "
                     f"{ratios[0]:.2f}x, median {ratios[len(ratios) // 2]:.2f}x, best "
                     f"{ratios[-1]:.2f}x)")
    return "\n".join(lines)


def write_report(out, title, info, body):
    """<out>.md: ``title`` with the machine and versions it was measured on (and the code's
    digest, where recorded), ``info["note"]`` if any, then ``body``."""
    tuned = {True: "autotuned", False: "default variants (no autotuning)"}.get(
        info.get("autotune"), "tuning not recorded")
    code = f", commit {info['commit']}" if info.get("commit") else ""
    code += f", code digest {info['code']}" if "code" in info else ""
    note = f"{info['note']}\n\n" if "note" in info else ""
    text = (f"{title} on {info['gpu']} ({info['date']}, torch {info['torch']}, cuda-tile "
            f"{info['cuda_tile']}, driver {info.get('driver')}; flash_tile {tuned}{code})."
            f"\n\n{note}{body}\n")
    with open(out + ".md", "w") as f:
        f.write(text)
    return text


def save(rows, info, out):
    save_json(out, info, rows=rows)
    write_report(out, f"Forward TFLOP/s, batch*seqlen = {GRID_TOKENS}, heads*head_dim = "
                      f"{GRID_WIDTH},",
                 info, f"{table(rows)}\n\nTargets:\n{targets(rows)}")


if __name__ == "__main__":
    main()
