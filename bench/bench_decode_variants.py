"""Time DecodeConfig variants against the default decode tiles, on bench_decode's rows.

``bench_variants.py`` does this for the forward and backward's TileConfig; the decode's
tiles, steps, page loads and compiler hints live in ``decode_variants.DecodeConfig``. Each
``--configs`` JSON object is laid over the default config of the row's GPU and head dim
(``{"num_worker_warps": 8}`` is the default with 8 worker warps), and each variant's decode
plan (``_launch_decode.decode_plan``, the launcher's own) is checked against the fp32
reference on the first and last sequence (flash-attn's 2x rule), then every variant is timed
in ROUNDS interleaved rounds, each keeping its best:

    python bench/bench_decode_variants.py --configs '{"num_worker_warps": 8}' \\
        '{"occupancy": 1, "num_worker_warps": 8}' --batches 1 32 --lengths 8192 131072 \\
        --pages 16 64 --out /tmp/decode-variants

Rows are a decode step (causal, Lq rows, GQA H/H_kv, D, bf16) of B sequences whose caches
hold L keys, on the contiguous cache (page "-") and on each page size of ``--pages``
(shuffled block tables, ``bench_decode.paged``). Writes <out>.json and <out>.md: per row the
default's GPU microseconds per step, and each variant's time over it (below 1 is faster).
"""

import argparse
import dataclasses
import json
import os

import torch
from tqdm import tqdm

from bench_attention import failure, machine_info, md_table, save_json, write_report
from bench_decode import ROUNDS, best_of_rounds, paged, row_inputs, row_reference
from flash_tile import _launch_decode, _ops_decode, reference
from flash_tile.decode_variants import DecodeConfig


def parse_configs(specs: list[str]) -> list[dict]:
    """The ``--configs`` JSON objects, each a dict of DecodeConfig fields (checked here,
    before any GPU work)."""
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    configs = []
    for spec in specs:
        config = json.loads(spec)
        if not isinstance(config, dict) or not config or not set(config) <= fields:
            raise ValueError(f"{spec!r} is not an object of DecodeConfig fields "
                             f"({', '.join(sorted(fields))}); the default is always timed")
        configs.append(config)
    return configs


def config_name(config: dict) -> str:
    return json.dumps(config, sort_keys=True) if config else "default"


def variant_row(batch, length, heads, kv_heads, head_dim, q_len, page_size, configs):
    """One row: each variant checked, then all timed in interleaved rounds."""
    gen, q, k, v, lens = row_inputs(batch, length, heads, kv_heads, head_dim, q_len)
    ends, _, ref, low = row_reference(q, k, v)
    table = None
    if page_size is not None:
        k, v, table = paged(k, v, page_size, gen)
    default = _ops_decode.decode_config(q, v)
    row = {"batch": batch, "seqlen": length, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "q_len": q_len, "page_size": page_size, "us": {},
           "skipped": {}, "max_err": {}}
    calls = {}
    for config in ({}, *configs):
        name = config_name(config)
        try:
            plan = _launch_decode.decode_plan(q, k, v, False, None, table, None, 0.0, (-1, 0),
                                              0, dataclasses.replace(default, **config))
            if plan is None:
                row["skipped"][name] = "a cache past 2**31 elements: launches of fewer rows"
                continue

            def call(plan=plan):
                out = torch.empty_like(q)
                plan.launch(q, k, v, out, None, lens, None, table, None, head_dim ** -0.5,
                            0.0, (-1, 0), 0)
                return out
            report = reference.check_error(call()[ends].transpose(1, 2), ref, low)
            row["max_err"][name] = report["max_err"]
            if report["ok"]:
                calls[name] = call
            else:
                row["skipped"][name] = f"wrong result: {report}"
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch
            row["skipped"][name] = failure(e)
    row["us"] = {name: round(1e3 * ms, 2) for name, ms in best_of_rounds(calls).items()}
    base = row["us"].get("default")
    row["ratio"] = {name: round(us / base, 3) for name, us in row["us"].items()} if base else {}
    return row


def variants_table(rows, configs) -> str:
    names = [config_name(c) for c in configs]
    head = ["B", "L", "H/H_kv", "Lq", "page", "default us", *names]
    lines = []
    for r in rows:
        cells = [r["ratio"][n] if n in r["ratio"] else "skipped" if n in r["skipped"] else "-"
                 for n in names]
        lines.append([r["batch"], r["seqlen"], f"{r['heads']}/{r['kv_heads']}", r["q_len"],
                      r["page_size"] if r["page_size"] is not None else "-",
                      r["us"].get("default", "-"), *cells])
    return ("GPU time per decode step of each variant over the default's (below 1 is "
            f"faster); the best of {ROUNDS} interleaved rounds.\n\n" + md_table(head, lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True,
                        help="JSON objects of DecodeConfig fields")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 8192, 32768, 131072])
    parser.add_argument("--heads", nargs="+", default=["32/8"], help="H/H_kv pairs")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-lens", nargs="+", type=int, default=[1])
    parser.add_argument("--pages", nargs="*", type=int, default=[16, 64],
                        help="page sizes, beside the contiguous cache")
    parser.add_argument("--max-cache-gib", type=float, default=8.0,
                        help="rows whose K/V exceed this are left out")
    parser.add_argument("--out", default="bench/out/decode-variants", help="output prefix")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    info = machine_info()
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    grid = [(b, n, h, kvh, lq, p) for h, kvh in heads for lq in args.q_lens
            for b in args.batches for n in args.lengths for p in (None, *args.pages)
            if b * n * kvh * args.head_dim * 4 <= args.max_cache_gib * 2**30]
    rows = []
    for b, n, h, kvh, lq, p in tqdm(grid, desc="decode variants", unit="row"):
        rows.append(variant_row(b, n, h, kvh, args.head_dim, lq, p, configs))
        tqdm.write(f"B={b} L={n} Lq={lq} page={p}: {rows[-1]['ratio']} "
                   f"{rows[-1]['skipped'] or ''}")
        save_json(args.out, info, configs=configs, rows=rows)
        torch.cuda.empty_cache()
    print(write_report(args.out, "Decode variants", info, variants_table(rows, configs)))


if __name__ == "__main__":
    main()
