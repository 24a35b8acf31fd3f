"""FP8 forward benchmark: flash_tile's FP8 forward beside its own bf16 forward.

The grid: D 64/128/256, L 1k/4k/16k, causal and not, batch * seqlen = 16k tokens and
heads * head dim = 2048 (``_timing.grid_shape``), Lq = Lk. Inputs as FA3's accuracy table:
N(0, 1) with 0.1% of the entries N(0, 10), bf16, quantized per (batch, head) with
``flash_tile.quantize_fp8``. Per row, in the same run:

- ``flash_tile_fp8``: ``flash_attn_func`` on the e4m3 tensors with their descale factors
  (the timed call includes the keys-major copy of V and the descale stack it makes);
- ``flash_tile_bf16``: ``flash_attn_func`` on the bf16 inputs;
- ``cudnn_fp8``: cuDNN's FP8 SDPA through ``nvidia-cudnn-frontend`` is not wired here: the
  row records null and the reason; the Markdown quotes cuDNN's published H200 figure
  instead, marked as such.

Correctness before timing: the FP8 output's RMSE on 256 query rows (the first and the last 128)
against an fp32 reference of the original bf16 inputs must be finite and at most 5e-2 (FA3's
baseline FP8 attention: 2.4e-2), and the bf16 output must pass flash-attn's 2x rule there; a
row that fails is reported, not timed. ``rmse_rotated`` is the same error with q and k rotated
by ``flash_tile.hadamard_rotate`` before quantization (FA3's incoherent processing, 9.1e-3 in
its table; the issue's target 1.0e-2): the same kernel, so not timed again. Both backends run
their arch's default tile variant, FP8 its own (``variants.fp8_config``; FLASH_TILE_AUTOTUNE=0
unless set: FP8 is never tuned, so the bf16 baseline is not either). Times are GPU time per
call with the calls queued behind a sleep (``bench_attention.device_ms``).

    python bench/bench_fp8.py                 # bench/results/fp8-<gpu>.{json,md,png}
    python bench/bench_fp8.py --head-dims 128 --lengths 4096 --out /tmp/fp8

Each JSON row carries ``head_dim``, ``seqlen``, ``causal``, ``batch``, ``heads``, ``tflops``
({flash_tile_fp8, flash_tile_bf16, cudnn_fp8}, null where not measured), ``ratio_vs_bf16``,
``rmse``, ``rmse_rotated`` and ``skipped`` (the reasons).
"""

import argparse
import math
import os

os.environ.setdefault("FLASH_TILE_AUTOTUNE", "0")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import flash_tile  # noqa: E402
from bench_attention import (device_ms, failure, machine_info, md_table,  # noqa: E402
                             results_path, save_json, write_report)
from flash_tile import reference  # noqa: E402
from flash_tile._timing import flops, grid_shape  # noqa: E402

BACKENDS = ("flash_tile_fp8", "flash_tile_bf16", "cudnn_fp8")
RMSE_LIMIT = 5e-2
CHECK_ROWS = 128  # query rows checked at each end of the sequence
# cuDNN's published FP8 SDPA forward on an H200 (cudnn-frontend's benchmark results: 32k
# tokens, GQA 64/8 heads, D = 128): quoted, not measured here.
CUDNN_PUBLISHED = ("1042-1062 TFLOP/s (cudnn-frontend's published H200 results, 32k, GQA "
                   "64/8, D=128)")


def cudnn_reason():
    """Why the cuDNN FP8 column is null."""
    try:
        import cudnn  # noqa: F401
    except ImportError as e:
        return f"skipped: nvidia-cudnn-frontend not installed ({e})"
    return "skipped: the cudnn-frontend FP8 SDPA graph is not wired into this benchmark yet"


def _checked_rows(length):
    rows = torch.arange(length, device="cuda")
    return rows if length <= 2 * CHECK_ROWS else torch.cat([rows[:CHECK_ROWS],
                                                           rows[-CHECK_ROWS:]])


def check(q, k, v, outs8, out16, causal):
    """([rmse of each FP8 output], whether bf16 passes the 2x rule) on the checked rows."""
    rows = _checked_rows(q.shape[1])
    ref = torch.empty(q.shape[0], q.shape[2], rows.numel(), v.shape[3], device="cuda")
    out_pt = torch.empty_like(ref, dtype=torch.bfloat16)
    kt, vt = (t.transpose(1, 2) for t in (k, v))
    for i, r in enumerate(rows.split(CHECK_ROWS)):  # contiguous runs of rows
        qr = q[:, r].transpose(1, 2)
        window = (-1, 0) if causal else (-1, -1)
        part = slice(i * CHECK_ROWS, i * CHECK_ROWS + r.numel())
        ref[:, :, part] = reference.attention_dense(qr.float(), kt.float(), vt.float(),
                                                    diag_offset=int(r[0]), window=window)
        out_pt[:, :, part] = reference.attention_dense(qr, kt, vt, diag_offset=int(r[0]),
                                                       window=window)
    rmse = [(o[:, rows].transpose(1, 2).float() - ref).pow(2).mean().sqrt().item()
            for o in outs8]
    return rmse, reference.check_error(out16[:, rows].transpose(1, 2), ref, out_pt)["ok"]


def bench_row(length, head_dim, causal, seed=0):
    batch, heads = grid_shape(length, head_dim)
    row = {"batch": batch, "heads": heads, "seqlen": length, "head_dim": head_dim,
           "causal": causal, "tflops": dict.fromkeys(BACKENDS), "ratio_vs_bf16": None,
           "rmse": None, "rmse_rotated": None, "skipped": {"cudnn_fp8": cudnn_reason()}}
    q, k, v = (reference.outlier_inputs(batch, length, heads, head_dim, seed + s, "cuda")
               for s in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (flash_tile.quantize_fp8(t) for t in (q, k, v))
    runs = {"flash_tile_fp8": lambda: flash_tile.flash_attn_func(
                q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd),
            "flash_tile_bf16": lambda: flash_tile.flash_attn_func(q, k, v, causal=causal)}
    (qr8, qrd), (kr8, krd) = (flash_tile.quantize_fp8(t) for t in
                              flash_tile.hadamard_rotate(q, k))
    try:
        with torch.no_grad():
            rotated = flash_tile.flash_attn_func(qr8, kr8, v8, causal=causal, q_descale=qrd,
                                                 k_descale=krd, v_descale=vd)
            (rmse, row["rmse_rotated"]), bf16_ok = check(
                q, k, v, (runs["flash_tile_fp8"](), rotated), runs["flash_tile_bf16"](), causal)
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["skipped"].update(flash_tile_fp8=failure(e), flash_tile_bf16=failure(e))
        return row
    row["rmse"] = rmse
    if not (math.isfinite(rmse) and rmse <= RMSE_LIMIT):
        row["skipped"]["flash_tile_fp8"] = f"failed the check: RMSE {rmse:.3g} > {RMSE_LIMIT}"
        runs.pop("flash_tile_fp8")
    if not bf16_ok:
        row["skipped"]["flash_tile_bf16"] = "failed the check: beyond flash-attn's 2x rule"
        runs.pop("flash_tile_bf16")
    f = flops(batch, heads, length, length, head_dim, causal)
    with torch.no_grad():
        for name, fn in runs.items():
            row["tflops"][name] = f / device_ms(fn) / 1e9
    fp8, bf16 = row["tflops"]["flash_tile_fp8"], row["tflops"]["flash_tile_bf16"]
    if fp8 and bf16:
        row["ratio_vs_bf16"] = fp8 / bf16
    return row


def table(rows):
    head = ["D", "L", "B", "H", "causal", *BACKENDS, "FP8 / bf16", "RMSE", "RMSE rotated"]

    def cell(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)
    return md_table(head, ([r["head_dim"], r["seqlen"], r["batch"], r["heads"],
                            "yes" if r["causal"] else "no",
                            *(cell(r["tflops"][n]) for n in BACKENDS),
                            cell(r["ratio_vs_bf16"], "{:.2f}x"), cell(r["rmse"], "{:.2e}"),
                            cell(r["rmse_rotated"], "{:.2e}")]
                           for r in rows))


def targets(rows):
    """Issue 26's targets on the measured rows."""
    lines = []
    d128 = [r for r in rows if r["head_dim"] == 128 and r["seqlen"] >= 4096 and
            not r["causal"] and r["tflops"]["flash_tile_fp8"]]
    if d128:
        worst = min(r["tflops"]["flash_tile_fp8"] for r in d128)
        lines.append(f"- >= 1000 TFLOP/s at D=128, L >= 4k, non-causal: "
                     f"{'met' if worst >= 1000 else 'NOT met'} (worst {worst:.0f})")
    ratios = sorted(r["ratio_vs_bf16"] for r in rows if r["ratio_vs_bf16"])
    if ratios:
        met = sum(x >= 1.5 for x in ratios)
        lines.append(f"- >= 1.5x flash_tile bf16: met on {met}/{len(ratios)} rows (worst "
                     f"{ratios[0]:.2f}x, best {ratios[-1]:.2f}x)")
    rmse = [r["rmse"] for r in rows if r["rmse"] is not None]
    if rmse:
        lines.append(f"- RMSE vs fp32 attention of the bf16 inputs (FA3 baseline 2.4e-2): "
                     f"worst {max(rmse):.2e}")
    rotated = [r["rmse_rotated"] for r in rows if r["rmse_rotated"] is not None]
    if rotated:
        lines.append(f"- RMSE with q, k Hadamard-rotated (target 1.0e-2, FA3 9.1e-3): "
                     f"{'met' if max(rotated) <= 1e-2 else 'NOT met'} (worst {max(rotated):.2e})")
    lines.append(f"- cuDNN FP8: not measured here ({rows[0]['skipped']['cudnn_fp8']}); its "
                 f"published figure, not from this run: {CUDNN_PUBLISHED}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for name, color in (("flash_tile_fp8", "C3"), ("flash_tile_bf16", "C0")):
            for causal, style in ((False, "-"), (True, "--")):
                pts = [(r["seqlen"], r["tflops"][name]) for r in rows if r["head_dim"] == d
                       and r["causal"] == causal and r["tflops"][name]]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker="o",
                            label=f"{name}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"D = {d}")
        ax.set_xlabel("seqlen")
    axes[0][0].set_ylabel("forward TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--out", help="output path prefix (default bench/results/fp8-<gpu>)")
    args = parser.parse_args()
    args.out = args.out or results_path("fp8")
    info = machine_info()
    info["note"] = ("FP8: e4m3 q, k, v quantized per (batch, head), bf16 output; both "
                    "backends on their arch's default tile variant (FP8: variants.fp8_config).")
    rows = []
    grid = [(d, n, c) for d in args.head_dims for n in args.lengths for c in (False, True)]
    for d, n, causal in tqdm(grid, desc="fp8"):
        rows.append(bench_row(n, d, causal))
        save_json(args.out, info, rows=rows)
    write_report(args.out, "FP8 forward TFLOP/s, batch*seqlen = 16384, heads*head_dim = 2048,",
                 info, f"{table(rows)}\n\nTargets:\n{targets(rows)}")
    plot(rows, args.out + ".png")
    print(table(rows))
    print(targets(rows))


if __name__ == "__main__":
    main()
