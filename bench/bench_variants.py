"""Time tile variants that are not registered (yet) against the default, on the grid's rows.

The autotuner only times registered candidates. To decide whether a new variant earns its
entry, this script runs the tuner's own check-then-time (``autotune.tune``: each variant's
result checked against the default's, then all timed in interleaved rounds) on the variants
given as TileConfig fields, for the forward or the backward, at each row of the benchmark
grid (bf16 unless ``--dtype`` says otherwise; ``--dtype fp8`` times the FP8 forward's
kernel on e4m3 inputs quantized per head, V^T made once outside the timed call):

    python bench/bench_variants.py --backward --configs '{"dq_tile_m": 64}' \\
        --head-dims 64 128 --lengths 1024 4096 16384 --out /tmp/variants

A config's fields are laid over the default variant of the row's head dim, so
``{"dq_tile_m": 64}`` is the default with 64-row dQ programs. Writes <out>.json and <out>.md:
per row, each variant's median ms (or why it was rejected) and its time over the default's.

A change to the kernels' source is timed against the source before it with ``--baseline
DIR``, DIR holding that other ``kernels/`` (``git archive REV kernels | tar -x -C /tmp/base``
gives /tmp/base/kernels). Each variant (``{}`` is the default itself) then runs with this
tree's kernels and with DIR's, loaded side by side in one process and timed in the same
interleaved rounds; the table gives both times, their ratio and the largest difference of
their outputs:

    python bench/bench_variants.py --backward --configs '{}' --baseline /tmp/base/kernels

``--paired ROUNDS`` times each variant's two sides by ``_timing.paired_ms`` instead: rounds of
neighbouring calls (A B B A ...) queued behind a GPU sleep, the ratio the median of the
rounds' time with this tree's kernels over the baseline's. Interleaved rounds of ten launches
a side put an A/A of the FP8 forward at 0.934-1.001x (2026-12-07, H100); for a change of a
few percent, pair the calls and run an A/A (DIR a plain copy) beside the A/B.

Without ``--baseline``, ``--paired ROUNDS`` pairs each config with the default instead (same
kernels, the config the only change): the A/B of a tile shape whose few percent the tuner's
interleaved rounds cannot tell from noise.

    python bench/bench_variants.py --dtype fp8 --head-dims 128 --causal yes \\
        --lengths 8192 16384 --configs '{"tile_n": 128}' --paired 15

``--dropout P`` times every row with dropout of probability P (and the defaults of classes with
dropout); without it the rows' scores are plain.

``--varlen TOKENS ...`` times the kernels' VARLEN switch instead, a row per token count on
``bench_varlen.py``'s packing of that many tokens (log-uniform lengths 64-8192, seeded by the
count; H * D = 2048): with ``--baseline`` the one-command A/B of a varlen kernel change.
``--pages PAGE_SIZE`` lays that packing's keys into shuffled pages (``bench_paged_varlen``'s
layout, ``reference_decode.paged_layout``) and times the PAGED switch, its configs laid
over ``variants.paged_config``.

    python bench/bench_variants.py --backward --varlen 65536 --head-dims 64 --causal yes \
        --configs '{}' --baseline /tmp/base/kernels
    python bench/bench_variants.py --varlen 16384 --pages 16 --head-dims 128 \
        --configs '{"tile_n": 64}' --paired 10
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import sys

import torch
from tqdm import tqdm

from flash_tile import (_launch, _ops, _ops_fp8, autotune, quantize_fp8, reference_decode,
                        variants)
from flash_tile._timing import (DTYPES, GRID_LENGTHS, GRID_WIDTH, cuda_time_ms, grid_shape,
                                interleaved_ms, paired_ms)
from bench_attention import SLEEP_CYCLES, machine_info, md_table, save_json, write_report
from bench_varlen import cu_seqlens, packing

# The kernel entry points ``_launch`` launches, which --baseline swaps for DIR's.
KERNELS = ("attention_fwd", "attention_fwd_int64", "attention_bwd_dq", "attention_bwd_dkdv",
           "attention_bwd_preprocess", "attention_bwd_dq_convert")
# --baseline's timing: interleaved rounds, each the median of ITERS launches after WARMUP.
ROUNDS, WARMUP, ITERS = 5, 3, 10
PAIRS = 10  # --paired: pairs of neighbouring calls a round (``_timing.paired_ms``)


def load_kernels(directory: str) -> dict:
    """The entry points of another ``kernels/`` directory (or of the tree holding one, as
    bench_launch's ``--baseline`` takes it), loaded as a package of its own (its own
    ``_tiles`` included) beside ``flash_tile.kernels``."""
    if os.path.isfile(os.path.join(directory, "kernels", "__init__.py")):
        directory = os.path.join(directory, "kernels")
    name = "flash_tile_baseline_kernels"
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]  # a directory loaded before: its modules must not be reused
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    modules = [importlib.import_module(f"{name}.{m}") for m in ("attention_fwd", "attention_bwd")]
    return {k: getattr(m, k) for m in modules for k in KERNELS if hasattr(m, k)}


@contextlib.contextmanager
def launching(kernels: dict):
    """``_launch`` launches ``kernels`` (entry point name -> kernel) inside the block."""
    saved = {name: getattr(_launch, name) for name in kernels}

    def swap(chosen):
        for name, kernel in chosen.items():
            setattr(_launch, name, kernel)
        _launch.hinted_kernel.cache_clear()  # its caches hold the kernels it last built from
        _launch.hinted_backward_kernels.cache_clear()
    swap(kernels)
    try:
        yield
    finally:
        swap(saved)


def max_diff(outputs, others) -> float:
    """The largest |difference| between two runs' outputs (the backward's end with an empty
    dsinks without sinks)."""
    return max(((a.float() - b.float()).abs().max().item()
                for a, b in zip(outputs, others) if a.numel()), default=0.0)


def paired(sides: dict, rounds: int, label: str) -> tuple[dict, dict]:
    """({name: ms of B, "name (label)": ms of A}, {name: 1 + the median round's cost of B over
    A}) for ``sides`` {name: (A, B)}, each pair timed by ``paired_ms`` over ``rounds``."""
    timed, ratios = {}, {}
    for name, (a, b) in sides.items():
        a_ms, b_ms, cost = paired_ms(a, b, rounds, PAIRS, SLEEP_CYCLES)
        timed[name], timed[f"{name} ({label})"] = b_ms, a_ms
        ratios[name] = round(1 + cost, 3)
    return timed, ratios


def against_baseline(configs, run, baseline: dict,
                     paired_rounds: int = 0) -> tuple[dict, dict, dict]:
    """({name: ms} with this tree's kernels and DIR's (" (baseline)" names), {name: the largest
    |difference| of the two's outputs}, {name: ours over the baseline}) for each config, timed
    in interleaved rounds or, with ``paired_rounds``, by ``paired_ms`` (the ratio its median
    round's, not the medians' quotient). Both sides swap the launcher's kernels around each
    call, so both pay the same host cost."""
    own = {name: getattr(_launch, name) for name in baseline}

    def with_kernels(kernels, config):
        with launching(kernels):
            return run(config)
    fns, diffs = {}, {}
    for config in configs:
        name = autotune.describe(config)
        ours, theirs = with_kernels(own, config), with_kernels(baseline, config)
        diffs[name] = max_diff(ours, theirs)
        fns[name] = functools.partial(with_kernels, own, config)
        fns[f"{name} (baseline)"] = functools.partial(with_kernels, baseline, config)
    if paired_rounds:
        timed, ratios = paired(
            {name: (fns[f"{name} (baseline)"], fns[name]) for name in diffs}, paired_rounds,
            "baseline")
    else:
        timed = interleaved_ms(fns, ROUNDS, lambda fn: cuda_time_ms(fn, WARMUP, ITERS))
        for ms in timed.values():
            if isinstance(ms, Exception):  # both ran once above: a failure here is news
                raise ms
        ratios = {name: round(timed[name] / timed[f"{name} (baseline)"], 3) for name in diffs}
    return {name: round(ms, 4) for name, ms in timed.items()}, diffs, ratios


def against_default(configs, run, rounds: int) -> tuple[dict, dict, dict]:
    """Each of ``configs[1:]`` against ``configs[0]`` (the default) by ``paired_ms``, as
    ``against_baseline`` with the default's time under the " (default)" name: ({name: ms},
    {name: the largest |difference| of its outputs from the default's}, {name: the median
    round's time over the default's})."""
    default, *others = configs
    reference = [t.clone() for t in run(default)]
    diffs = {autotune.describe(c): max_diff(run(c), reference) for c in others}
    timed, ratios = paired({autotune.describe(c): (functools.partial(run, default),
                                                   functools.partial(run, c))
                            for c in others}, rounds, "default")
    return {name: round(ms, 4) for name, ms in timed.items()}, diffs, ratios


def runner(batch: int, heads: int, length: int, head_dim: int, causal: bool, dtype,
           backward: bool, dropout: _launch.Dropout = _launch.NO_DROPOUT):
    """``run(config)`` for one row, as the autotuner builds it: fresh outputs, one launch."""
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    scale, window = head_dim ** -0.5, (-1, 0 if causal else -1)
    forward = _ops.forward_runner(q, k, v, None, None, scale, 0.0, 0, window, True, dropout)
    if not backward:
        return forward
    out, lse = forward(variants.default_config(torch.cuda.get_device_capability(), head_dim))
    return _ops.backward_runner(torch.randn_like(q), q, k, v, out, lse, None, None, None, scale,
                                0.0, 0, window, dropout)


def varlen_runner(tokens: int, head_dim: int, causal: bool, dtype, backward: bool,
                  dropout: _launch.Dropout = _launch.NO_DROPOUT, page_size: int | None = None):
    """``run(config)`` for one packing row, as the autotuner builds it for the varlen ops:
    ``bench_varlen``'s packing of ``tokens`` tokens, q, k, v [tokens, H, D] with
    H * D = 2048; with ``page_size`` the forward against k, v laid into shuffled pages."""
    heads = GRID_WIDTH // head_dim
    q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    lengths = packing(tokens)
    cu = cu_seqlens(lengths)
    sequences, scale = _launch.Varlen(cu, cu), head_dim ** -0.5
    if page_size:
        gen = torch.Generator(device="cuda").manual_seed(tokens + page_size)
        k, v, table = reference_decode.paged_layout(k, v, cu, page_size, gen)
        sequences = _launch.Varlen(cu, cu, None, table)
    window = (-1, 0 if causal else -1)
    forward = _ops.varlen_forward_runner(q, k, v, sequences, None, scale, 0.0, window, True,
                                         dropout)
    if not backward:
        return forward
    out, lse = forward(variants.default_config(torch.cuda.get_device_capability(), head_dim))
    return _ops.varlen_backward_runner(torch.randn_like(q), q, k, v, out, lse, None,
                                       sequences, None, scale, 0.0, window, dropout)


def fp8_runner(batch: int, heads: int, length: int, head_dim: int, causal: bool):
    """``run(config)`` of the FP8 forward's kernel alone: e4m3 q, k, v quantized per head and
    V^T (``_launch.keys_major``) made once, then ``_ops_fp8.fp8_forward``: fresh bf16 outputs
    and one launch a call."""
    x8, descales = zip(*(quantize_fp8(torch.randn(batch, length, heads, head_dim,
                                                  device="cuda", dtype=torch.bfloat16))
                         for _ in range(3)))
    q, k, v = (t.transpose(1, 2) for t in x8)
    v_t = _launch.keys_major(v)
    scale, window = head_dim ** -0.5, (-1, 0 if causal else -1)

    def run(config):
        return _ops_fp8.fp8_forward(q, k, v_t, descales, None, scale, 0.0, 0, window, True,
                                    config)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", required=True,
                        help="TileConfig fields as JSON objects, laid over the default")
    parser.add_argument("--backward", action="store_true", help="time the backward kernels")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--lengths", nargs="+", type=int, default=list(GRID_LENGTHS))
    parser.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    parser.add_argument("--dtype", default="bf16", choices=[*DTYPES, "fp8"])
    parser.add_argument("--out", default="bench/out/variants", help="output path prefix")
    parser.add_argument("--baseline", metavar="DIR",
                        help="another kernels/ directory, or a tree holding one, to time "
                             "each variant against (the same config on both: DIR's kernels "
                             "must lack the change, or the row is an A/A)")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                        help="time each config against its baseline side (--baseline) or "
                             "against the default by paired_ms over ROUNDS rounds of "
                             "neighbouring calls instead of interleaved rounds")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="dropout probability of every row (default 0: plain scores)")
    parser.add_argument("--varlen", nargs="+", type=int, metavar="TOKENS",
                        help="rows of packed sequences (bench_varlen's packing of TOKENS "
                             "tokens) through the VARLEN switch, instead of --lengths")
    parser.add_argument("--pages", type=int, metavar="PAGE_SIZE",
                        help="with --varlen: the keys in shuffled pages of PAGE_SIZE keys "
                             "(the forward's PAGED switch)")
    args = parser.parse_args()
    if args.dtype == "fp8" and (args.backward or args.dropout or args.varlen):
        parser.error("--dtype fp8 times the dense FP8 forward: no backward, dropout or varlen")
    if args.pages and (not args.varlen or args.backward or args.dropout):
        parser.error("--pages times the paged varlen forward: needs --varlen, no backward "
                     "or dropout")
    os.environ["FLASH_TILE_AUTOTUNE"] = "0"  # recorded as such: nothing here is tuned
    overlays = [json.loads(c) for c in args.configs]
    capability = torch.cuda.get_device_capability()
    dropout = _launch.Dropout(args.dropout, 2024) if args.dropout else _launch.NO_DROPOUT

    def pick(head_dim: int, causal: bool, length: int | None) -> variants.TileConfig:
        if args.backward:
            return variants.default_backward_config(capability, head_dim, not args.dropout)
        if args.dtype == "fp8":  # (its causal rows' default may differ, by length too)
            return variants.fp8_config(capability, head_dim, causal, length)
        if args.pages:
            return variants.paged_config(capability, head_dim)
        return variants.default_config(capability, head_dim)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]

    baseline = load_kernels(args.baseline) if args.baseline else None
    rows = []
    sizes = args.varlen or args.lengths  # token counts of packings, or grid lengths
    progress = tqdm(total=len(args.head_dims) * len(sizes) * len(causals), desc="variants",
                    unit="row")
    for head_dim in args.head_dims:
        for size in sizes:
            for causal in causals:
                default = pick(head_dim, causal, None if args.varlen else size)
                laid = [dataclasses.replace(default, **o) for o in overlays]
                configs = laid if baseline else [default, *laid]
                if args.varlen:
                    run = varlen_runner(size, head_dim, causal, DTYPES[args.dtype],
                                        args.backward, dropout, args.pages)
                elif args.dtype == "fp8":
                    run = fp8_runner(*grid_shape(size, head_dim), size, head_dim, causal)
                else:
                    run = runner(*grid_shape(size, head_dim), size, head_dim, causal,
                                 DTYPES[args.dtype], args.backward, dropout)
                row = {"dtype": args.dtype, "head_dim": head_dim,
                       "tokens" if args.varlen else "length": size, "causal": causal,
                       "dropout": args.dropout, "page_size": args.pages,
                       "variants": [autotune.describe(c) for c in configs]}
                if baseline:
                    row["ms"], row["max_diff"], row["ratio"] = against_baseline(
                        configs, run, baseline, args.paired)
                elif args.paired:
                    row["ms"], row["max_diff"], row["ratio"] = against_default(
                        configs, run, args.paired)
                    row["variants"] = row["variants"][1:]
                else:
                    _, row["ms"] = autotune.tune(configs, run)
                    base = row["ms"][autotune.describe(default)]
                    row["ratio"] = {n: round(ms / base, 3) for n, ms in row["ms"].items()
                                    if isinstance(ms, float)}
                rows.append(row)
                progress.update()
                tqdm.write(str(row))
                del run
                torch.cuda.empty_cache()

    progress.close()
    info = {**machine_info(), "note": "Each variant is launched directly, as the table names "
            "it (the autotuner's check-then-time, not its choice)."}
    if baseline:
        timing = (f"by paired_ms, {args.paired} rounds of {PAIRS} pairs of neighbouring calls "
                  "(ratio: the median round's)" if args.paired else
                  f"in {ROUNDS} interleaved rounds of {ITERS} launches")
        info["note"] = (f"Each variant with this tree's kernels and with those of {args.baseline}"
                        f" (baseline), {timing}; max diff: the largest |difference| of their "
                        "outputs.")
    elif args.paired:
        info["note"] = (f"Each variant against the default by paired_ms, {args.paired} rounds "
                        f"of {PAIRS} pairs of neighbouring calls (ratio: the median round's); "
                        "max diff: the largest |difference| from the default's outputs.")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    save_json(args.out, info, backward=args.backward, baseline=args.baseline,
              paired_rounds=args.paired, rows=rows)
    print(write_report(args.out, f"{'Backward' if args.backward else 'Forward'} variants "
                       f"against {'the baseline kernels' if baseline else 'the default'}, "
                       f"{args.dtype}{f', dropout {args.dropout}' if args.dropout else ''},",
                       info, table(rows, args.configs, "baseline" if baseline else
                                   "default" if args.paired else "")))


def table(rows, overlays, paired_with: str) -> str:
    """The Markdown table: per row, each variant's ms (or why it failed) and its ratio, over
    the default's or, ``paired_with`` "baseline" (--baseline), over its own time with the
    baseline kernels, or with "default" (--paired alone), over the default's paired time.
    The default, and so each overlay's name, differs by head dim: a column per overlay."""
    def cell(r, i, n):
        if paired_with == "default":
            return (f"{n}: {r['ms'][n]} / {r['ms'][n + ' (default)']} ({r['ratio'][n]}x; "
                    f"max diff {r['max_diff'][n]:.3g})")
        if paired_with == "baseline":
            # Bitwise-equal outputs: most likely both sides ran the same kernels (an A/A: on
            # 2026-12-07 one such row set spread 0.934-1.001x), unless the change keeps them.
            same = ", identical outputs" if r["max_diff"][n] == 0 else ""
            return (f"{n}: {r['ms'][n]} / {r['ms'][n + ' (baseline)']} ({r['ratio'][n]}x; "
                    f"max diff {r['max_diff'][n]:.3g}{same})")
        return f"{n}: {r['ms'][n]}" + (f" ({r['ratio'][n]}x)" if i and n in r["ratio"] else "")
    side = {"baseline": "ours / baseline", "default": "config / default"}.get(paired_with)
    head = ([f"{c} ms, {side} (ratio)" for c in overlays] if paired_with else
            ["default ms", *(f"{c} ms (over the default)" for c in overlays)])
    return md_table(["D", "L", "causal", *head],
                    [[r["head_dim"], r.get("length", f"packed, {r.get('tokens')} tokens"
                                       + (f", {r['page_size']}-key pages" if r.get("page_size")
                                          else "")),
                      "yes" if r["causal"] else "no",
                      *(cell(r, i, n) for i, n in enumerate(r["variants"]))] for r in rows])


if __name__ == "__main__":
    main()
