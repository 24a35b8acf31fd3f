"""Time tile variants that are not registered (yet) against the default, on the grid's rows.

The autotuner only times registered candidates. To decide whether a new variant earns its
entry, this script runs the tuner's own check-then-time (``autotune.tune``: each variant's
result checked against the default's, then all timed in interleaved rounds) on the variants
given as TileConfig fields, for the forward or the backward, at each row of the benchmark
grid (bf16 unless ``--dtype`` says otherwise):

    python bench/bench_variants.py --backward --configs '{"dq_tile_m": 64}' \\
        --head-dims 64 128 --lengths 1024 4096 16384 --out /tmp/variants

A config's fields are laid over the default variant of the row's head dim, so
``{"dq_tile_m": 64}`` is the default with 64-row dQ programs. Writes <out>.json and <out>.md:
per row, each variant's median ms (or why it was rejected) and its time over the default's.
"""

import argparse
import dataclasses
import json
import os

import torch

from flash_tile import _ops, autotune, variants
from flash_tile._timing import DTYPES, GRID_LENGTHS, grid_shape
from bench_attention import machine_info, md_table, save_json, write_report


def runner(batch: int, heads: int, length: int, head_dim: int, causal: bool, dtype,
           backward: bool):
    """``run(config)`` for one row, as the autotuner builds it: fresh outputs, one launch."""
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    scale, window = head_dim ** -0.5, (-1, 0 if causal else -1)
    forward = _ops.forward_runner(q, k, v, None, None, scale, 0.0, 0, window, True)
    if not backward:
        return forward
    out, lse = forward(variants.default_config(torch.cuda.get_device_capability(), head_dim))
    return _ops.backward_runner(torch.randn_like(q), q, k, v, out, lse, None, None, None, scale,
                                0.0, 0, window)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", required=True,
                        help="TileConfig fields as JSON objects, laid over the default")
    parser.add_argument("--backward", action="store_true", help="time the backward kernels")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--lengths", nargs="+", type=int, default=list(GRID_LENGTHS))
    parser.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--out", default="bench/out/variants", help="output path prefix")
    args = parser.parse_args()
    os.environ["FLASH_TILE_AUTOTUNE"] = "0"  # recorded as such: nothing here is tuned
    overlays = [json.loads(c) for c in args.configs]
    capability = torch.cuda.get_device_capability()
    pick = variants.default_backward_config if args.backward else variants.default_config
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]

    rows = []
    for head_dim in args.head_dims:
        default = pick(capability, head_dim)
        configs = [default, *(dataclasses.replace(default, **o) for o in overlays)]
        for length in args.lengths:
            for causal in causals:
                batch, heads = grid_shape(length, head_dim)
                run = runner(batch, heads, length, head_dim, causal, DTYPES[args.dtype],
                             args.backward)
                _, results = autotune.tune(configs, run)
                base = results[autotune.describe(default)]
                rows.append({"dtype": args.dtype, "head_dim": head_dim, "length": length,
                             "causal": causal,
                             "variants": [autotune.describe(c) for c in configs],
                             "ms": results,
                             "ratio": {name: round(ms / base, 3) for name, ms in results.items()
                                       if isinstance(ms, float)}})
                print(rows[-1], flush=True)
                del run
                torch.cuda.empty_cache()

    # The default, and so each overlay's name, differs by head dim: a column per overlay.
    body = md_table(["D", "L", "causal", "default ms", *(f"{c} ms (over the default)"
                                                         for c in args.configs)],
                    [[r["head_dim"], r["length"], "yes" if r["causal"] else "no",
                      *(f"{n}: {r['ms'][n]}" + (f" ({r['ratio'][n]}x)" if i and n in r["ratio"]
                                                else "")
                        for i, n in enumerate(r["variants"]))] for r in rows])
    info = {**machine_info(), "note": "Each variant is launched directly, as the table names "
            "it (the autotuner's check-then-time, not its choice)."}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    save_json(args.out, info, backward=args.backward, rows=rows)
    print(write_report(args.out, f"{'Backward' if args.backward else 'Forward'} variants "
                       f"against the default, {args.dtype},", info, body))


if __name__ == "__main__":
    main()
